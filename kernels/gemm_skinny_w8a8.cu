// W8A8 skinny tensor-core GEMM for decode batches (routed up to 64 rows), the NumPy op linear_w8a8:
// out[m, n] = sum_g xs[m, g] * sw[n | n / 128, g] * sum_{k in g} xq[m, k] * W[n, k] (+ bias), fp32 sums; xq / xs are
// quantize_fp8's e4m3 rows and scales ([M, K] and [M, groups] packed), W e4m3 [N, K] with CH: sw[N] (one group: the
// whole row) or BLK: sw[ceil(N/128), ceil(K/128)] (groups of 128 k).
// Block = 8 warps x RT m16 weight tiles (RT 2: 256 rows; 1: 128 rows, at 128 batch rows and the r1 variants); every
// warp of a block works on the same 128-k step, so the step's X tile (MT rows x 128 B) is copied to shared memory
// once per block and read by all 8 warps. A block streams a SW8_STAGES-deep cp.async ring of steps (the block's
// weight lines + the X tile + BLK: the X scales of the step), one block barrier a step. C blocks (grid y, a
// thread-block cluster) split the k-steps of one tile (interleaved: block y takes steps y, y + C, ..); their
// partial sums meet in distributed shared memory, and block y reduces its share of the tile's outputs in
// cluster-rank order (deterministic, no atomics, no workspace). Grid z: slices of MT batch rows.
// mma.sync m16n8k32 e4m3: weights are A (16 rows), X rows are B (8 batch rows). Lane (g, t) holds 16-byte pieces t
// and 4 + t of a 128-byte line; each piece feeds two MMAs (bytes 0-7, 8-15), the same k permutation for A and B.
// Shared line of row r: piece p at (p ^ 4 (r & 1)) * 16 (conflict-free copies and fragment reads). K % 16 == 0.
// QX (block scales only, where a 128-k step is one activation group): X is the bf16 input itself; each block
// quantizes its step's X tile in shared memory exactly as quantize_fp8 does (fp8_act_scale, e4m3x8_div), so the
// quantize_fp8 kernel before the linear is not launched (xq / xq_scale stay unwritten).
#include "fp8.cuh"
#include "cluster.cuh"

__device__ __forceinline__ uint4 sw8_lds16(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ float2 sw8_lds8f(u32 addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void sw8_cp16(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void sw8_cp4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(dst), "l"(src) : "memory");
}
// D = A(16x32 e4m3, row) * B(32x8 e4m3, col) + D (f32), sm_89+.
__device__ __forceinline__ void mma_e4m3(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// RT m16 weight tiles a warp: 2 (256 rows a block; 1, 128 rows, at 128 batch rows: the register budget).
template <int MB, bool OUT_F32, bool BLK, int C, bool QX, int RT>
__device__ __forceinline__ void skinny_w8a8_impl(const void* __restrict__ XIN, const float* __restrict__ XS,
                                                 const e4m3* __restrict__ W, const float* __restrict__ WS,
                                                 const bf16* __restrict__ bias, void* __restrict__ out,
                                                 int M, int N, int K) {
    pdl_entry();
    static_assert(BLK || !QX, "quantizing X in the kernel needs 128-k activation groups (block scales)");
    constexpr int MT = 8 * MB, SW8_ROWS = SK_WARPS * 16 * RT, W_BYTES = SW8_ROWS * 128, X_BYTES = MT * 128;
    constexpr int SW8_PSTRIDE = SW8_ROWS + 4;      // floats a batch row of the partial sums (conflict-free stores)
    // stage: weight lines, then QX: the bf16 X tile (MT x 256 B); else the e4m3 X tile and its MT scales
    constexpr int STAGE = W_BYTES + (QX ? MT * 256 : X_BYTES + MT * 4);
    // grid z: MT-row slices of the batch (more than MT rows; a slice's blocks re-read the weights from L2)
    const int m0 = blockIdx.z * MT;
    M -= m0;
    const e4m3* XQ = (const e4m3*)XIN + (size_t)m0 * K;
    const bf16* XB = (const bf16*)XIN + (size_t)m0 * K;
    if (!QX) XS += BLK ? (size_t)m0 * ((K + 127) >> 7) : (size_t)m0;
    out = OUT_F32 ? (void*)((float*)out + (size_t)m0 * N) : (void*)((bf16*)out + (size_t)m0 * N);
    extern __shared__ __align__(16) float smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * SW8_ROWS, z = blockIdx.y;
    const int steps = (K + 127) >> 7;
    const int n_my = z < steps ? (steps - z + C - 1) / C : 0;
    const int xs_stride = BLK ? steps : 1;
    const u32 base = (u32)__cvta_generic_to_shared(smem);
    const u32 qtile = base + (u32)(SW8_STAGES * STAGE);   // QX: the step's quantized X tile, then its MT scales

    auto issue = [&](int j) {
        if (j < n_my) {
            const int k = (z + j * C) * 128;
            const u32 st = base + (u32)((j % SW8_STAGES) * STAGE);
            const int p = tid & 7, kk = k + p * 16, bytes = kk < K ? 16 : 0, ks = kk < K ? kk : 0;
#pragma unroll
            for (int i = 0; i < SW8_ROWS * 8 / 256; i++) {
                const int r = (tid >> 3) + 32 * i;
                sw8_cp16(st + (u32)(r * 128 + ((p ^ ((r & 1) << 2)) << 4)),
                         W + (size_t)min(n0 + r, N - 1) * K + ks, bytes);
            }
            if (QX) {
#pragma unroll
                for (int c = tid; c < MT * 16; c += 256) {            // 16 chunks of 8 bf16 a row
                    const int m = c >> 4, ch = c & 15, kx = k + ch * 8;
                    sw8_cp16(st + (u32)(W_BYTES + m * 256 + ((ch ^ ((m & 1) << 2)) << 4)),
                             XB + (size_t)min(m, M - 1) * K + (kx < K ? kx : 0), kx < K ? 16 : 0);
                }
            } else {
#pragma unroll
                for (int c = tid; c < MT * 8; c += 256) {
                    const int m = c >> 3;
                    sw8_cp16(st + (u32)(W_BYTES + m * 128 + ((p ^ ((m & 1) << 2)) << 4)),
                             XQ + (size_t)min(m, M - 1) * K + ks, bytes);
                }
            }
            if (BLK && !QX && tid < MT) sw8_cp4(st + (u32)(W_BYTES + X_BYTES + tid * 4),
                                         XS + (size_t)min(tid, M - 1) * xs_stride + (z + j * C));
        }
        cp_async_commit();
    };
#pragma unroll
    for (int j = 0; j < SW8_STAGES - 1; j++) issue(j);

    float acc[RT][MB][4];
#pragma unroll
    for (int rt = 0; rt < RT; rt++)
#pragma unroll
        for (int mb = 0; mb < MB; mb++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[rt][mb][e] = 0.f;
    // BLK: a warp's 16 RT rows lie in one 128-row block of the weight scales
    const float* sw_row = WS + (size_t)(min(n0 + warp * 16 * RT, N - 1) >> 7) * steps;

    for (int j = 0; j < n_my; j++) {
        cp_async_wait<SW8_STAGES - 2>();
        __syncthreads();                       // step j landed for all; step j - 1's slot is free
        issue(j + SW8_STAGES - 1);
        const u32 st = base + (u32)((j % SW8_STAGES) * STAGE);
        const u32 xt = QX ? qtile : st + W_BYTES, xst = QX ? qtile + X_BYTES : st + W_BYTES + X_BYTES;
        if (QX) {                                  // TPR threads a row: amax over the 128-k group, then e4m3(x / s)
            constexpr int TPR = 256 / MT, CPT = 16 / TPR;
            constexpr bool KEEP = CPT <= 4;        // more chunks a thread (m128): read them twice, not kept
            const int qm = tid / TPR, qu = tid % TPR;
            auto chunk = [&](int i, float* v8) {
                const int ch = qu + TPR * i;
                const uint4 v = sw8_lds16(st + (u32)(W_BYTES + qm * 256 + ((ch ^ ((qm & 1) << 2)) << 4)));
                unpack8(*reinterpret_cast<const vec16*>(&v), v8);
            };
            float f[KEEP ? CPT : 1][8], amax = 0.f;
#pragma unroll
            for (int i = 0; i < CPT; i++) {
                float* v8 = f[KEEP ? i : 0];
                chunk(i, v8);
#pragma unroll
                for (int e = 0; e < 8; e++) amax = fmaxf(amax, fabsf(v8[e]));
            }
#pragma unroll
            for (int o = TPR / 2; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            const float sx = fp8_act_scale(amax);
            if (qu == 0) asm volatile("st.shared.f32 [%0], %1;" :: "r"(xst + (u32)(qm * 4)), "f"(sx) : "memory");
#pragma unroll
            for (int i = 0; i < CPT; i++) {
                const int ch = qu + TPR * i;
                float* v8 = f[KEEP ? i : 0];
                if (!KEEP) chunk(i, v8);
                const uint2 q = e4m3x8_div(v8, sx);
                asm volatile("st.shared.v2.u32 [%0], {%1,%2};"
                             :: "r"(xt + (u32)(qm * 128 + (((ch >> 1) ^ ((qm & 1) << 2)) << 4) + (ch & 1) * 8)),
                                "r"(q.x), "r"(q.y) : "memory");
            }
            __syncthreads();                       // the quantized tile for all warps
        }
        uint4 a[RT][2][2];                     // [m16 tile][row g, g + 8][piece t, 4 + t]
#pragma unroll
        for (int rt = 0; rt < RT; rt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = warp * 16 * RT + rt * 16 + g + 8 * h;
#pragma unroll
                for (int q = 0; q < 2; q++)
                    a[rt][h][q] = sw8_lds16(st + (u32)(r * 128 + (((4 * q + t) ^ ((r & 1) << 2)) << 4)));
            }
        const float sw = BLK ? __ldg(sw_row + z + j * C) : 0.f;
#pragma unroll
        for (int mb = 0; mb < MB; mb++) {
            const int m = mb * 8 + g;
            uint4 b[2];
#pragma unroll
            for (int q = 0; q < 2; q++)
                b[q] = sw8_lds16(xt + (u32)(m * 128 + (((4 * q + t) ^ ((m & 1) << 2)) << 4)));
            float2 s = make_float2(0.f, 0.f);
            if (BLK) {
                s = sw8_lds8f(xst + (u32)((mb * 8 + 2 * t) * 4));
                s.x *= sw;
                s.y *= sw;
            }
#pragma unroll
            for (int rt = 0; rt < RT; rt++) {
                float d[4] = {0.f, 0.f, 0.f, 0.f};      // the step's sum, promoted to fp32 (FP8 MMA sums are short)
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    const uint4 &lo = a[rt][0][q], &hi = a[rt][1][q];
                    mma_e4m3(d, lo.x, hi.x, lo.y, hi.y, b[q].x, b[q].y);
                    mma_e4m3(d, lo.z, hi.z, lo.w, hi.w, b[q].z, b[q].w);
                }
                if (BLK) {
                    acc[rt][mb][0] += d[0] * s.x;
                    acc[rt][mb][1] += d[1] * s.y;
                    acc[rt][mb][2] += d[2] * s.x;
                    acc[rt][mb][3] += d[3] * s.y;
                } else {
#pragma unroll
                    for (int e = 0; e < 4; e++) acc[rt][mb][e] += d[e];
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    // partial sums [MT][SW8_PSTRIDE] (batch row, weight row of the tile) over the ring
#pragma unroll
    for (int rt = 0; rt < RT; rt++)
#pragma unroll
        for (int mb = 0; mb < MB; mb++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int n = warp * 16 * RT + rt * 16 + g + 8 * (e >> 1), m = mb * 8 + 2 * t + (e & 1);
                smem[m * SW8_PSTRIDE + n] = acc[rt][mb][e];
            }
    if (C > 1) cluster_barrier();
    else __syncthreads();

    constexpr int QUADS = MT * SW8_ROWS / 4;
    for (int qd = z * 256 + tid; qd < QUADS; qd += C * 256) {
        const int m = qd / (SW8_ROWS / 4), nl = (qd % (SW8_ROWS / 4)) * 4;
        if (m >= M) continue;
        const u32 off = base + (u32)((m * SW8_PSTRIDE + nl) * 4);
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int zz = 0; zz < C; zz++) {
            const float4 p = C > 1 ? ld_cluster_v4(off, zz)
                                   : *reinterpret_cast<const float4*>(smem + m * SW8_PSTRIDE + nl);
            v.x += p.x; v.y += p.y; v.z += p.z; v.w += p.w;
        }
        const float vals[4] = {v.x, v.y, v.z, v.w};
        const float sx = BLK ? 1.f : XS[m];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int n = n0 + nl + i;
            if (n < N) {
                const float o = (BLK ? vals[i] : vals[i] * sx * WS[n]) + (bias ? bf2f(bias[n]) : 0.f);
                if (OUT_F32) ((float*)out)[(size_t)m * N + n] = o;
                else ((bf16*)out)[(size_t)m * N + n] = f2bf(o);
            }
        }
    }
    if (C > 1) cluster_barrier();              // no block leaves while the cluster still reads its partials
}

// Grid (ceil(N / rows a block), C, ceil(M / MT)) of 256 threads, clusters (1, C, 1); dynamic shared memory
// skinny_w8a8_smem(MT, QX).
// RT: m16 weight tiles a warp (TAG r1: one tile, 128-row blocks, below 128 batch rows).
#define SKINNY_W8A8_KERNELS(S, BLK, MT, CL, RT, TAG)                                                              \
    extern "C" __global__ void __launch_bounds__(256, 1) __cluster_dims__(1, CL, 1)                              \
    skinny_w8a8_##S##_m##MT##TAG##c##CL##_bf16( \
        const e4m3* XQ, const float* XS, const e4m3* W, const float* WS, const bf16* bias, bf16* out, int M, int N, \
        int K) { skinny_w8a8_impl<MT / 8, false, BLK, CL, false, RT>(XQ, XS, W, WS, bias, out, M, N, K); }         \
    extern "C" __global__ void __launch_bounds__(256, 1) __cluster_dims__(1, CL, 1)                              \
    skinny_w8a8_##S##_m##MT##TAG##c##CL##_f32( \
        const e4m3* XQ, const float* XS, const e4m3* W, const float* WS, const bf16* bias, float* out, int M, int N, \
        int K) { skinny_w8a8_impl<MT / 8, true, BLK, CL, false, RT>(XQ, XS, W, WS, bias, out, M, N, K); }
// blkq: the bf16 X quantized in the kernel (QX).
#define SKINNY_W8A8_QX_KERNELS(MT, CL, RT, TAG)                                                                    \
    extern "C" __global__ void __launch_bounds__(256, 1) __cluster_dims__(1, CL, 1)                              \
    skinny_w8a8_blkq_m##MT##TAG##c##CL##_bf16( \
        const bf16* X, const e4m3* W, const float* WS, const bf16* bias, bf16* out, int M, int N, int K) {        \
        skinny_w8a8_impl<MT / 8, false, true, CL, true, RT>(X, nullptr, W, WS, bias, out, M, N, K); }            \
    extern "C" __global__ void __launch_bounds__(256, 1) __cluster_dims__(1, CL, 1)                              \
    skinny_w8a8_blkq_m##MT##TAG##c##CL##_f32( \
        const bf16* X, const e4m3* W, const float* WS, const bf16* bias, float* out, int M, int N, int K) {       \
        skinny_w8a8_impl<MT / 8, true, true, CL, true, RT>(X, nullptr, W, WS, bias, out, M, N, K); }

SKINNY_W8A8_KERNELS(ch, false, 16, 1, 2, )
SKINNY_W8A8_KERNELS(ch, false, 16, 2, 2, )
SKINNY_W8A8_KERNELS(ch, false, 16, 4, 2, )
SKINNY_W8A8_KERNELS(ch, false, 16, 5, 2, )
SKINNY_W8A8_KERNELS(ch, false, 16, 8, 2, )
SKINNY_W8A8_KERNELS(ch, false, 32, 1, 2, )
SKINNY_W8A8_KERNELS(ch, false, 32, 2, 2, )
SKINNY_W8A8_KERNELS(ch, false, 32, 4, 2, )
SKINNY_W8A8_KERNELS(ch, false, 32, 5, 2, )
SKINNY_W8A8_KERNELS(ch, false, 32, 8, 2, )
SKINNY_W8A8_KERNELS(ch, false, 64, 1, 2, )
SKINNY_W8A8_KERNELS(ch, false, 64, 2, 2, )
SKINNY_W8A8_KERNELS(ch, false, 64, 4, 2, )
SKINNY_W8A8_KERNELS(ch, false, 64, 5, 2, )
SKINNY_W8A8_KERNELS(ch, false, 64, 8, 2, )
SKINNY_W8A8_KERNELS(ch, false, 128, 1, 1, )
SKINNY_W8A8_KERNELS(ch, false, 128, 2, 1, )
SKINNY_W8A8_KERNELS(ch, false, 128, 4, 1, )
SKINNY_W8A8_KERNELS(ch, false, 128, 5, 1, )
SKINNY_W8A8_KERNELS(ch, false, 128, 8, 1, )
SKINNY_W8A8_KERNELS(ch, false, 64, 1, 1, r1)
SKINNY_W8A8_KERNELS(ch, false, 64, 2, 1, r1)
SKINNY_W8A8_KERNELS(ch, false, 64, 4, 1, r1)
SKINNY_W8A8_KERNELS(ch, false, 64, 5, 1, r1)
SKINNY_W8A8_KERNELS(ch, false, 64, 8, 1, r1)
SKINNY_W8A8_KERNELS(blk, true, 16, 1, 2, )
SKINNY_W8A8_KERNELS(blk, true, 16, 2, 2, )
SKINNY_W8A8_KERNELS(blk, true, 16, 4, 2, )
SKINNY_W8A8_KERNELS(blk, true, 16, 5, 2, )
SKINNY_W8A8_KERNELS(blk, true, 16, 8, 2, )
SKINNY_W8A8_KERNELS(blk, true, 32, 1, 2, )
SKINNY_W8A8_KERNELS(blk, true, 32, 2, 2, )
SKINNY_W8A8_KERNELS(blk, true, 32, 4, 2, )
SKINNY_W8A8_KERNELS(blk, true, 32, 5, 2, )
SKINNY_W8A8_KERNELS(blk, true, 32, 8, 2, )
SKINNY_W8A8_KERNELS(blk, true, 64, 1, 2, )
SKINNY_W8A8_KERNELS(blk, true, 64, 2, 2, )
SKINNY_W8A8_KERNELS(blk, true, 64, 4, 2, )
SKINNY_W8A8_KERNELS(blk, true, 64, 5, 2, )
SKINNY_W8A8_KERNELS(blk, true, 64, 8, 2, )
SKINNY_W8A8_KERNELS(blk, true, 128, 1, 1, )
SKINNY_W8A8_KERNELS(blk, true, 128, 2, 1, )
SKINNY_W8A8_KERNELS(blk, true, 128, 4, 1, )
SKINNY_W8A8_KERNELS(blk, true, 128, 5, 1, )
SKINNY_W8A8_KERNELS(blk, true, 128, 8, 1, )
SKINNY_W8A8_KERNELS(blk, true, 64, 1, 1, r1)
SKINNY_W8A8_KERNELS(blk, true, 64, 2, 1, r1)
SKINNY_W8A8_KERNELS(blk, true, 64, 4, 1, r1)
SKINNY_W8A8_KERNELS(blk, true, 64, 5, 1, r1)
SKINNY_W8A8_KERNELS(blk, true, 64, 8, 1, r1)
SKINNY_W8A8_QX_KERNELS(16, 1, 2, )
SKINNY_W8A8_QX_KERNELS(16, 2, 2, )
SKINNY_W8A8_QX_KERNELS(16, 4, 2, )
SKINNY_W8A8_QX_KERNELS(16, 5, 2, )
SKINNY_W8A8_QX_KERNELS(16, 8, 2, )
SKINNY_W8A8_QX_KERNELS(32, 1, 2, )
SKINNY_W8A8_QX_KERNELS(32, 2, 2, )
SKINNY_W8A8_QX_KERNELS(32, 4, 2, )
SKINNY_W8A8_QX_KERNELS(32, 5, 2, )
SKINNY_W8A8_QX_KERNELS(32, 8, 2, )
SKINNY_W8A8_QX_KERNELS(64, 1, 2, )
SKINNY_W8A8_QX_KERNELS(64, 2, 2, )
SKINNY_W8A8_QX_KERNELS(64, 4, 2, )
SKINNY_W8A8_QX_KERNELS(64, 5, 2, )
SKINNY_W8A8_QX_KERNELS(64, 8, 2, )
SKINNY_W8A8_QX_KERNELS(64, 1, 1, r1)
SKINNY_W8A8_QX_KERNELS(64, 2, 1, r1)
SKINNY_W8A8_QX_KERNELS(64, 4, 1, r1)
SKINNY_W8A8_QX_KERNELS(64, 5, 1, r1)
SKINNY_W8A8_QX_KERNELS(64, 8, 1, r1)
SKINNY_W8A8_QX_KERNELS(128, 1, 1, )
SKINNY_W8A8_QX_KERNELS(128, 2, 1, )
SKINNY_W8A8_QX_KERNELS(128, 4, 1, )
SKINNY_W8A8_QX_KERNELS(128, 5, 1, )
SKINNY_W8A8_QX_KERNELS(128, 8, 1, )
