// W8A8 GEMM for 33-256 activation rows on Hopper wgmma, the tiles moved by TMA: the op and layout of
// gemm_w8a8_wgmma.cu (swap-AB: the block's weight rows n0 .. + ROWS - 1 are the wgmma A side in m64 tiles, TPW of
// them a consumer warpgroup, the NT activation rows of a grid-x slice are the wgmma N; one step = 128 k; K split
// over a (1, C, 1) cluster reduced in DSMEM), with the cp.async copies replaced by a producer warp (the block's
// last): per step one TMA of the ROWS x 128 B weight box (map tw over W [N, K] e4m3) and one of the NT x 128 B X box
// (map tx over xq [M, K] e4m3), both 128B-swizzled into the slot, on the slot's full mbarrier (complete_tx; BLK: +
// the step's NT X scales and its ROWS / 128 weight scales by 4-byte cp.async from the 32 lanes, 32 more arrivals);
// consumers release a slot on its empty mbarrier (one arrival a warp). Boxes: the plan's
// (plan/fp8_build.plan_w8a8_tma): ROWS / NT rows, or N / M where those are fewer (the slot's rows past them keep
// stale bytes, which only reach outputs that are never stored); the tensor's K tail and the last slice's rows past
// M are zero-filled by TMA. Needs K >= 128 and K % 16 == 0 (the map's row stride).
#include "w8a8_wgmma.cuh"
#include "tma.cuh"

// Block shapes (WGS consumer warpgroups of TPW m64 tiles: ROWS = 64 WGS TPW weight rows): 2 x 1 at NT 64 / 128,
// and at NT 64 the 256-row 2 x 2 (`t2`: both tiles' wgmmas under one wait).
template <int NT, int ROWS>
__device__ constexpr int w8a8_tma_stages() {
    return ROWS == 128 ? (NT == 64 ? WG8_STAGES_N64 : WG8_STAGES_N128) : WG8_STAGES_R256;
}

template <int NT, bool OUT_F32, bool BLK, int C, int WGS, int TPW>
__device__ __forceinline__ void w8a8_tma_impl(const TmaDesc& tw, const TmaDesc& tx, const float* __restrict__ XS,
                                              const float* __restrict__ WS, const bf16* __restrict__ bias,
                                              void* __restrict__ out, int M, int N, int K) {
    constexpr int ROWS = 64 * WGS * TPW, CONSUMERS = 128 * WGS, W_BYTES = ROWS * 128, TILE = W_BYTES + NT * 128;
    constexpr int STAGES = w8a8_tma_stages<NT, ROWS>(), SWN = ROWS / 128;   // SWN: 128-row weight-scale blocks
    const int steps = (K + 127) >> 7;
    const u32 tx_bytes = 128u * (u32)(min(ROWS, N) + min(NT, M));   // the two boxes of a step
    const int slices = (M + NT - 1) / NT, m0 = (blockIdx.x % slices) * NT;   // a tile's slices: adjacent blocks
    M -= m0;
    XS += BLK ? (size_t)m0 * steps : (size_t)m0;
    out = OUT_F32 ? (void*)((float*)out + (size_t)m0 * N) : (void*)((bf16*)out + (size_t)m0 * N);
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 raw = smem_addr(smem_raw), base = (raw + 1023u) & ~1023u;   // swizzle atoms: 1024-byte aligned
    float* part = reinterpret_cast<float*>(smem_raw + (base - raw));       // partial sums, over the ring at the end
    const u32 xs_ring = base + (u32)(STAGES * TILE);                   // BLK: STAGES x NT X scales,
    const u32 sw_ring = xs_ring + (u32)(STAGES * NT * 4);              // ... then STAGES x SWN weight scales
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, t = lane & 3;
    const int n0 = (blockIdx.x / slices) * ROWS, z = blockIdx.y;
    const int n_my = z < steps ? (steps - z + C - 1) / C : 0;
    __shared__ __align__(8) u64 bars[2 * STAGES];
    const u32 full = smem_addr(bars), empty = full + 8 * STAGES;
    if (tid == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(full + 8 * s, 1 + (BLK ? 32 : 0));
            mbar_init(empty + 8 * s, 4 * WGS);
        }
        fence_mbar_init();
    }
    __syncthreads();

    float acc[TPW][NT / 2], d[TPW][NT / 2];
#pragma unroll
    for (int p = 0; p < TPW; p++)
#pragma unroll
        for (int i = 0; i < NT / 2; i++) acc[p][i] = d[p][i] = 0.f;
    if (tid >= CONSUMERS) {                        // the producer warp
        // the first ring's weight boxes and scales (constant: no kernel writes them) before griddepcontrol.wait,
        // so under PDL they stream during the previous kernel's tail; X (its output) and X scales after it
        auto weights = [&](int j) {
            const int slot = j % STAGES, step = z + j * C;
            const u32 st = base + (u32)(slot * TILE), bar = full + 8 * slot;
            if (lane == 0) {
                mbar_arrive_expect_tx(bar, tx_bytes);
                tma_load_2d(st, tw, step * 128, n0, bar);
            }
            if (BLK && lane < SWN)
                wg8_cp4(sw_ring + (u32)((slot * SWN + lane) * 4),
                        WS + (size_t)(min(n0 + 128 * lane, N - 1) >> 7) * steps + step);
        };
        auto activations = [&](int j) {
            const int slot = j % STAGES, step = z + j * C;
            const u32 st = base + (u32)(slot * TILE), bar = full + 8 * slot;
            if (lane == 0) tma_load_2d(st + W_BYTES, tx, step * 128, m0, bar);
            if (BLK) {                             // the step's scales ride on the same barrier: no consumer
#pragma unroll                                     // waits on a global load
                for (int i = 0; i < NT / 32; i++) {
                    const int m = lane + 32 * i;
                    wg8_cp4(xs_ring + (u32)((slot * NT + m) * 4), XS + (size_t)min(m, M - 1) * steps + step);
                }
                mbar_arrive_on_copies(bar);
            }
        };
        if (lane == 0) {
            tma_prefetch(tw);
            tma_prefetch(tx);
        }
        const int early = min(n_my, STAGES);
        for (int j = 0; j < early; j++) weights(j);
        pdl_entry();                               // launched early (the record's pdl): only weight loads before
        for (int j = 0; j < early; j++) activations(j);
        for (int j = early; j < n_my; j++) {
            mbar_wait(empty + 8 * (j % STAGES), (j / STAGES - 1) & 1);
            weights(j);
            activations(j);
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
    } else {
        pdl_entry();
        const float* xs_base = reinterpret_cast<const float*>(smem_raw + (xs_ring - raw));
        const float* sw_base = reinterpret_cast<const float*>(smem_raw + (sw_ring - raw));
        for (int j = 0; j < n_my; j++) {
            const int slot = j % STAGES;
            mbar_wait(full + 8 * slot, (j / STAGES) & 1);
            float sw[TPW];                         // BLK: tile p's 64 rows lie in 128-row block (TPW wg + p) / 2
#pragma unroll
            for (int p = 0; p < TPW; p++) sw[p] = BLK ? sw_base[slot * SWN + ((wg * TPW + p) >> 1)] : 0.f;
            w8a8_step<NT, BLK, ROWS, TPW>(acc, d, base + (u32)(slot * TILE), wg, t, xs_base + slot * NT, sw);
            __syncwarp();
            if (lane == 0) mbar_arrive(empty + 8 * slot);
        }
    }
    __syncthreads();                               // every copy landed and was read: partial sums over the ring
    w8a8_finish<NT, OUT_F32, BLK, C, WGS, TPW>(acc, part, base, tid < CONSUMERS, tid, z, n0, XS, WS, bias, out, M, N);
}

// Grid (ceil(N / ROWS) x ceil(M / NT), C) of 128 WGS + 32 threads, clusters (1, C, 1); dynamic shared memory
// w8a8_tma_smem(NT, ROWS). TAG: the block shape, none for 2 x 1. One line per block shape and cluster size, for
// both schemes (S: ch, blk) and both outputs.
#define W8A8_TMA_KERNELS(S, BLK, NT, CL, WGS, TPW, TAG)                                                             \
    extern "C" __global__ void __launch_bounds__(128 * WGS + 32, 1) __cluster_dims__(1, CL, 1)                     \
    w8a8_tma_##S##_n##NT##c##CL##TAG##_bf16(const __grid_constant__ TmaDesc tw, const __grid_constant__ TmaDesc tx, \
                                            const float* XS, const float* WS, const bf16* bias, bf16* out,         \
                                            int M, int N, int K) {                                                 \
        w8a8_tma_impl<NT, false, BLK, CL, WGS, TPW>(tw, tx, XS, WS, bias, out, M, N, K); }                         \
    extern "C" __global__ void __launch_bounds__(128 * WGS + 32, 1) __cluster_dims__(1, CL, 1)                     \
    w8a8_tma_##S##_n##NT##c##CL##TAG##_f32(const __grid_constant__ TmaDesc tw, const __grid_constant__ TmaDesc tx,  \
                                           const float* XS, const float* WS, const bf16* bias, float* out,         \
                                           int M, int N, int K) {                                                  \
        w8a8_tma_impl<NT, true, BLK, CL, WGS, TPW>(tw, tx, XS, WS, bias, out, M, N, K); }
#define W8A8_TMA_SCHEMES(NT, CL, WGS, TPW, TAG)                                                                    \
    W8A8_TMA_KERNELS(ch, false, NT, CL, WGS, TPW, TAG) W8A8_TMA_KERNELS(blk, true, NT, CL, WGS, TPW, TAG)
W8A8_TMA_SCHEMES(64, 1, 2, 1, )
W8A8_TMA_SCHEMES(64, 2, 2, 1, )
W8A8_TMA_SCHEMES(64, 3, 2, 1, )
W8A8_TMA_SCHEMES(64, 4, 2, 1, )
W8A8_TMA_SCHEMES(128, 1, 2, 1, )
W8A8_TMA_SCHEMES(128, 2, 2, 1, )
W8A8_TMA_SCHEMES(128, 3, 2, 1, )
W8A8_TMA_SCHEMES(128, 4, 2, 1, )
W8A8_TMA_SCHEMES(64, 1, 2, 2, t2)
W8A8_TMA_SCHEMES(64, 2, 2, 2, t2)
W8A8_TMA_SCHEMES(64, 3, 2, 2, t2)
W8A8_TMA_SCHEMES(64, 4, 2, 2, t2)
W8A8_TMA_SCHEMES(64, 6, 2, 2, t2)

// The tensor-map check (tests/test_cuda_w8a8_tma.py): one TMA of map's box at (c0, c1), `bytes` bytes, into shared
// memory (1024-byte aligned), copied out as it landed. Dynamic shared memory: bytes + 1024.
extern "C" __global__ void __launch_bounds__(128) tma_box_copy(const __grid_constant__ TmaDesc map, int c0, int c1,
                                                               int bytes, e4m3* out) {
    extern __shared__ __align__(1024) unsigned char box_smem[];
    __shared__ __align__(8) u64 bar;
    const u32 raw = smem_addr(box_smem), base = (raw + 1023u) & ~1023u, b = smem_addr(&bar);
    if (threadIdx.x == 0) {
        mbar_init(b, 1);
        fence_mbar_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbar_arrive_expect_tx(b, (u32)bytes);
        tma_load_2d(base, map, c0, c1, b);
    }
    mbar_wait(b, 0);
    for (int i = threadIdx.x; i < bytes; i += blockDim.x) out[i] = box_smem[base - raw + i];
}
