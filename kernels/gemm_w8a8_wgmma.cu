// W8A8 GEMM for 33-256 activation rows on Hopper wgmma, shaped for weight streaming ("swap-AB"), the NumPy op
// linear_w8a8: out[m, n] = sum_g xs[m, g] * sw[n | n / 128, g] * sum_{k in g} xq[m, k] * W[n, k] (+ bias), fp32
// sums; xq / xs are quantize_fp8's e4m3 rows and scales ([M, K], [M, groups] packed), W e4m3 [N, K] with CH: sw[N]
// (one group: the whole row) or BLK: sw[ceil(N/128), ceil(K/128)].
// Block = WG8_WGS consumer warpgroups, warpgroup w owning the m64 tile of weight rows n0 + 64 w .. + 63 (the wgmma
// A operand); the NT activation rows of a grid-z slice are the wgmma N (NT = 64 or 128). Every warpgroup works on
// the same 128-k step: one step = 4 x wgmma m64nNTk32 e4m3 from a WG8_STAGES_N{NT}-deep cp.async ring of steps (the
// block's 128-byte weight lines + the X tile, both 128B-swizzled K-major, + BLK: the step's X scales), one block
// barrier a step. Each step's sum lands in fresh registers d and is promoted into the fp32 accumulator (FP8 tensor
// core sums are short): acc += d * sw * xs[m] (BLK) or acc += d (CH; scales applied once at the end).
// D layout (m64nN, thread = warp w4 of the warpgroup, lane (g, t)): element 4 j + 2 e + c is weight row
// 16 w4 + g + 8 e, activation row 8 j + 2 t + c.
// C blocks (grid y, a thread-block cluster) split the k-steps of one tile (interleaved: block y takes steps y,
// y + C, ..); partial sums meet in distributed shared memory and block y reduces its share of the tile's outputs
// in cluster-rank order (deterministic, no atomics, no workspace). Grid x: (weight tile, NT-row slice of the
// activations), the slices of a tile adjacent (they run together, the second one's weight reads hit L2).
// K % 16 == 0 (16-byte copies; the last step's missing chunks are zero-filled), M / N tails clamped on reads and
// skipped on writes.
#include "w8a8_wgmma.cuh"

template <int NT, bool OUT_F32, bool BLK, int C, bool MB>
__device__ __forceinline__ void w8a8_wgmma_impl(const e4m3* __restrict__ XQ, const float* __restrict__ XS,
                                                const e4m3* __restrict__ W, const float* __restrict__ WS,
                                                const bf16* __restrict__ bias, void* __restrict__ out,
                                                int M, int N, int K) {
    pdl_entry();
    constexpr int ROWS = 64 * WG8_WGS, THREADS = 128 * WG8_WGS, W_BYTES = ROWS * 128, TILE = W_BYTES + NT * 128;
    constexpr int STAGES = NT == 64 ? WG8_STAGES_N64 : NT == 128 ? WG8_STAGES_N128 : WG8_STAGES_N256;
    constexpr int NW = NT > 128 ? NT / 2 : NT;     // NT 256: two n128 wgmma chains on one weight tile
    const int steps = (K + 127) >> 7;
    const int slices = (M + NT - 1) / NT, m0 = (blockIdx.x % slices) * NT;   // a tile's slices: adjacent blocks
    M -= m0;
    XQ += (size_t)m0 * K;
    XS += BLK ? (size_t)m0 * steps : (size_t)m0;
    out = OUT_F32 ? (void*)((float*)out + (size_t)m0 * N) : (void*)((bf16*)out + (size_t)m0 * N);
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 raw = smem_addr(smem_raw), base = (raw + 1023u) & ~1023u;   // swizzle atoms: 1024-byte aligned
    float* part = reinterpret_cast<float*>(smem_raw + (base - raw));       // partial sums, over the ring at the end
    const u32 xs_ring = base + (u32)(STAGES * TILE);                   // BLK: STAGES x NT X scales
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, t = lane & 3;
    const int n0 = (blockIdx.x / slices) * ROWS, z = blockIdx.y;
    const int n_my = z < steps ? (steps - z + C - 1) / C : 0;
    // MB: per-slot mbarriers instead of a block barrier a step: full (every thread's copies landed: THREADS
    // arrivals) and empty (every warp done with the slot's MMAs and scales: 4 WG8_WGS arrivals), so the
    // warpgroups drift apart (one's promotion overlaps the other's MMAs) by up to a step.
    __shared__ __align__(8) u64 bars[MB ? 2 * STAGES : 1];
    const u32 full = smem_addr(bars), empty = full + 8 * STAGES;
    if (MB) {
        if (tid < STAGES) {
            mbar_init(full + 8 * tid, THREADS);
            mbar_init(empty + 8 * tid, 4 * WG8_WGS);
        }
        __syncthreads();
    }

    auto issue = [&](int j) {
        if (j < n_my) {
            const int k = (z + j * C) * 128, slot = j % STAGES;
            if (MB && j >= STAGES) mbar_wait(empty + 8 * slot, (j / STAGES - 1) & 1);
            const u32 st = base + (u32)(slot * TILE);
            const int p = tid & 7, kk = k + p * 16, bytes = kk < K ? 16 : 0, ks = kk < K ? kk : 0;
#pragma unroll
            for (int i = 0; i < ROWS * 8 / THREADS; i++) {
                const int r = (tid >> 3) + (THREADS / 8) * i;
                cp_async16_zfill(st + (u32)(r * 128 + ((p ^ (r & 7)) << 4)), W + (size_t)min(n0 + r, N - 1) * K + ks,
                                 bytes);
            }
#pragma unroll
            for (int i = 0; i < NT * 8 / THREADS; i++) {
                const int m = (tid >> 3) + (THREADS / 8) * i;
                cp_async16_zfill(st + (u32)(W_BYTES + m * 128 + ((p ^ (m & 7)) << 4)),
                                 XQ + (size_t)min(m, M - 1) * K + ks, bytes);
            }
            if (BLK && tid < NT)
                wg8_cp4(xs_ring + (u32)((slot * NT + tid) * 4), XS + (size_t)min(tid, M - 1) * steps + (z + j * C));
            if (MB) mbar_arrive_on_copies(full + 8 * slot);
        }
        cp_async_commit();
    };
#pragma unroll
    for (int j = 0; j < STAGES - 1; j++) issue(j);

    float acc[1][NT / 2], d[1][NW / 2];            // acc: the NH halves' sums; d: one half's step sum
#pragma unroll
    for (int i = 0; i < NT / 2; i++) acc[0][i] = 0.f;
#pragma unroll
    for (int i = 0; i < NW / 2; i++) d[0][i] = 0.f;
    // BLK: a warpgroup's 64 rows lie in one 128-row block of the weight scales
    const float* sw_row = WS + (size_t)(min(n0 + wg * 64, N - 1) >> 7) * steps;

    for (int j = 0; j < n_my; j++) {
        const int slot = j % STAGES;
        if (MB) {
            issue(j + STAGES - 1);             // waits until every warp is done with step j - 1
            mbar_wait(full + 8 * slot, (j / STAGES) & 1);
            fence_proxy_async();
        } else {
            cp_async_wait<STAGES - 2>();       // step j landed (this thread's copies) ...
            fence_proxy_async();                   // ... visible to the tensor cores
            __syncthreads();                       // ... every thread's; step j - 1's slot is free
            issue(j + STAGES - 1);
        }
        const u32 st = base + (u32)(slot * TILE);
        const float sw[1] = {BLK ? __ldg(sw_row + z + j * C) : 0.f};
        w8a8_step<NT, BLK>(acc, d, st, wg, t,
                           reinterpret_cast<const float*>(smem_raw + (xs_ring - raw)) + slot * NT, sw);
        if (MB) {
            __syncwarp();
            if (lane == 0) mbar_arrive(empty + 8 * slot);
        }
    }
    cp_async_wait<0>();
    __syncthreads();                               // the ring is free: partial sums over it
    w8a8_finish<NT, OUT_F32, BLK, C>(acc, part, base, true, tid, z, n0, XS, WS, bias, out, M, N);
}

// Grid (ceil(N / (64 WG8_WGS)) x ceil(M / NT), C) of 128 WG8_WGS threads, clusters (1, C, 1); dynamic shared memory
// w8a8_wgmma_smem(NT).
#define W8A8_WGMMA_KERNELS(S, BLK, NT, CL, MB, TAG)                                                                \
    extern "C" __global__ void __launch_bounds__(128 * WG8_WGS, 1) __cluster_dims__(1, CL, 1)                      \
    w8a8_wgmma_##S##_n##NT##c##CL##TAG##_bf16(const e4m3* XQ, const float* XS, const e4m3* W, const float* WS,     \
                                              const bf16* bias, bf16* out, int M, int N, int K) {                  \
        w8a8_wgmma_impl<NT, false, BLK, CL, MB>(XQ, XS, W, WS, bias, out, M, N, K); }                              \
    extern "C" __global__ void __launch_bounds__(128 * WG8_WGS, 1) __cluster_dims__(1, CL, 1)                      \
    w8a8_wgmma_##S##_n##NT##c##CL##TAG##_f32(const e4m3* XQ, const float* XS, const e4m3* W, const float* WS,      \
                                             const bf16* bias, float* out, int M, int N, int K) {                  \
        w8a8_wgmma_impl<NT, true, BLK, CL, MB>(XQ, XS, W, WS, bias, out, M, N, K); }
// TAG mb: the per-slot mbarrier ring (MB).
W8A8_WGMMA_KERNELS(ch, false, 64, 1, false, )
W8A8_WGMMA_KERNELS(ch, false, 64, 2, false, )
W8A8_WGMMA_KERNELS(ch, false, 64, 4, false, )
W8A8_WGMMA_KERNELS(ch, false, 64, 8, false, )
W8A8_WGMMA_KERNELS(ch, false, 128, 1, false, )
W8A8_WGMMA_KERNELS(ch, false, 128, 2, false, )
W8A8_WGMMA_KERNELS(ch, false, 128, 4, false, )
W8A8_WGMMA_KERNELS(ch, false, 128, 8, false, )
W8A8_WGMMA_KERNELS(blk, true, 64, 1, false, )
W8A8_WGMMA_KERNELS(blk, true, 64, 2, false, )
W8A8_WGMMA_KERNELS(blk, true, 64, 4, false, )
W8A8_WGMMA_KERNELS(blk, true, 64, 8, false, )
W8A8_WGMMA_KERNELS(blk, true, 128, 1, false, )
W8A8_WGMMA_KERNELS(blk, true, 128, 2, false, )
W8A8_WGMMA_KERNELS(blk, true, 128, 4, false, )
W8A8_WGMMA_KERNELS(blk, true, 128, 8, false, )
W8A8_WGMMA_KERNELS(ch, false, 64, 1, true, mb)
W8A8_WGMMA_KERNELS(ch, false, 64, 2, true, mb)
W8A8_WGMMA_KERNELS(ch, false, 64, 4, true, mb)
W8A8_WGMMA_KERNELS(ch, false, 64, 8, true, mb)
W8A8_WGMMA_KERNELS(ch, false, 128, 1, true, mb)
W8A8_WGMMA_KERNELS(ch, false, 128, 2, true, mb)
W8A8_WGMMA_KERNELS(ch, false, 128, 4, true, mb)
W8A8_WGMMA_KERNELS(ch, false, 128, 8, true, mb)
W8A8_WGMMA_KERNELS(blk, true, 64, 1, true, mb)
W8A8_WGMMA_KERNELS(blk, true, 64, 2, true, mb)
W8A8_WGMMA_KERNELS(blk, true, 64, 4, true, mb)
W8A8_WGMMA_KERNELS(blk, true, 64, 8, true, mb)
W8A8_WGMMA_KERNELS(blk, true, 128, 1, true, mb)
W8A8_WGMMA_KERNELS(blk, true, 128, 2, true, mb)
W8A8_WGMMA_KERNELS(blk, true, 128, 4, true, mb)
W8A8_WGMMA_KERNELS(blk, true, 128, 8, true, mb)
W8A8_WGMMA_KERNELS(ch, false, 256, 1, false, )
W8A8_WGMMA_KERNELS(ch, false, 256, 2, false, )
W8A8_WGMMA_KERNELS(ch, false, 256, 4, false, )
W8A8_WGMMA_KERNELS(ch, false, 256, 8, false, )
W8A8_WGMMA_KERNELS(blk, true, 256, 1, false, )
W8A8_WGMMA_KERNELS(blk, true, 256, 2, false, )
W8A8_WGMMA_KERNELS(blk, true, 256, 4, false, )
W8A8_WGMMA_KERNELS(blk, true, 256, 8, false, )
