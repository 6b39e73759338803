// The GEMV of decode rows 1..8 on the tensor cores (build setting gemv "tc"; plan/gemv_tc_plan.py):
// out[M, N] = bf16 X[M, K] @ W[N, K]^T (+ bias), W bf16 or e4m3 with float32 scales (W8A16), the semantics and
// roundings of kernels/gemv.cu / gemv_fp8.cu (channel scale on the row's sum, block128 scale on each 128-k partial,
// fp32 sums; GATE: silu(bf16 g) * bf16 u).
//
// A tile is 16 weight rows (GATE: gate rows j0..j0+7 and up rows I+j0..I+j0+7) over all of K; a block takes
// tiles blockIdx.x, + gridDim.x, ... (the planner's grid: at most the blocks resident at once). Warp 8 (the
// producer) streams them, tile after tile without draining, through S stages of TC_CHUNK bytes a row with
// cp.async.bulk (one copy a row, L2 evict-first, rows TC_PITCH apart so the eight rows of a fragment load hit eight
// bank groups), the first S issued before griddepcontrol.wait; warps 0..7 (consumers) take 128 bytes of every row of
// a chunk. The 16 rows are the m16 side of mma.sync m16n8k16 (f32 sums), the M input rows the n8 side (columns >= M
// are zero). Lane (g, t) loads
// bytes 16 t + 64 h (h = 0, 1) of its warp's slice of rows g and g + 8; the logical k of mma i (A's 2 t, 2 t + 1,
// 2 t + 8, 2 t + 9; B the same k of x) are four consecutive weights of those loads:
//   e4m3: load h is 64 k of its own, mma i its bytes 4 i .. 4 i + 3 (f16 operands: e4m3 -> f16 exact, x in shared
//         memory as f16 x 2^-4, exact for magnitudes in [2^-13, 2^20), undone in fp32);
//   bf16: the two loads are one 64 k (k 8 t + 32 h ..), mma i words 2 (i % 2), +1 of load i / 2 (bf16 operands).
// The eight warps' partials are summed in warp order (deterministic). K % 64 == 0, M <= 8.
//
// The add_rmsnorm between two of these GEMVs, folded (build setting fold_norm, plan/fp8_build.folds_norm; its
// roundings):
// RES (o_proj, down): out is the residual [M, N]; out[m, n] = bf16(out[m, n] + bf16(sum + bias)) in place.
// NORM (qkv, gate_up): X is that residual, staged raw; the consumers sum its squares by row (each thread its
//   chunks, warp_sum, the eight warps in order: every block the same inv[m] = rsqrt(ss / K + eps)), then each
//   thread rewrites its own chunks as h = bf16(x * inv[m] * nw[k]), the GEMV's input.
#include "bulk_copy.cuh"
#include "fp8.cuh"

// GT_CHUNK (bytes of a stage row: GT_CONSUMERS warps x 128), GT_ROW_PAD: plan/kernel_constants.py.
#define TC_CHUNK GT_CHUNK
#define TC_PITCH (GT_CHUNK + GT_ROW_PAD)   // row pitch of a stage (16-B units: 2 mod 8)
#define TC_STAGE (16 * TC_PITCH)           // bytes of a stage
#define TC_CONSUMERS GT_CONSUMERS
static_assert(GT_CHUNK == 128 * GT_CONSUMERS, "a consumer warp takes 128 k of a chunk");
static_assert((TC_PITCH / 16) % 8 == 2, "rows g and the 4 lanes t of a fragment load hit 8 bank groups evenly");

__device__ __forceinline__ void tc_consumers_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

// Dynamic shared memory: full[S], empty[S] mbarriers (u64), the block scales (BLK: 2 x kb_n floats, the 128-row
// blocks of rows 0-7 and 8-15), x [M, K] f16, S stages (16-B aligned), then the partials [8 warps][16][M] float.
// plan/gemv_tc_plan.gemv_tc_smem mirrors it.
__device__ __forceinline__ int tc_x_offset(int S, int kb_n) { return (16 * S + 8 * kb_n + 15) & ~15; }

enum TcFold { TC_PLAIN = 0, TC_RES = 1, TC_NORM = 2 };

// WB: bytes a weight (1 e4m3, 2 bf16); Q: 0 no scales (bf16), 1 channel, 2 block128.
template <int WB, int Q, bool OUT_F32, bool GATE, int FOLD = TC_PLAIN>
__device__ __forceinline__ void gemv_tc_impl(const bf16* __restrict__ X, const void* __restrict__ Wv,
                                                 const float* __restrict__ scale, const bf16* __restrict__ bias,
                                                 void* __restrict__ out, int M, int N, int K, int S,
                                                 const bf16* __restrict__ nw = nullptr, float eps = 0.f) {
    static_assert(FOLD != TC_RES || (!GATE && !OUT_F32), "the residual is bf16, written by a plain linear");
    extern __shared__ __align__(16) unsigned char tc_dyn[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    constexpr bool BLK = Q == 2;
    const unsigned char* W = static_cast<const unsigned char*>(Wv);
    const int kb_n = (K + 127) >> 7, KB = K * WB, NC = (KB + TC_CHUNK - 1) / TC_CHUNK;
    u64* full = reinterpret_cast<u64*>(tc_dyn);
    u64* empty = full + S;
    float* sc_s = reinterpret_cast<float*>(tc_dyn + 16 * S);
    bf16* xs = reinterpret_cast<bf16*>(tc_dyn + tc_x_offset(S, BLK ? kb_n : 0));   // [M, K] (e4m3: f16 bits)
    unsigned char* stages = tc_dyn + tc_x_offset(S, BLK ? kb_n : 0) + ((M * K * 2 + 15) & ~15);
    float* red = reinterpret_cast<float*>(stages + (size_t)S * TC_STAGE);   // [warp][A row][M]
    const int n_rows = GATE ? 2 * N : N;
    const int tiles = GATE ? (N + 7) >> 3 : (N + 15) >> 4;
    // a tile's first weight row of A rows 0-7 (j0, also its first output) and of A rows 8-15 (tile_hi)
    auto tile_j0 = [&](int tile) { return tile * (GATE ? 8 : 16); };
    auto tile_hi = [&](int j0) { return GATE ? N + j0 : j0 + 8; };
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; s++) { mbar_init(full + s, 1); mbar_init(empty + s, TC_CONSUMERS); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp == TC_CONSUMERS) {                                // producer: lane r < 16 copies A row r
        const int r = lane & 15;
        u64 policy;
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
        int q = 0;                                             // chunks issued by this block
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            const int j0 = tile_j0(tile);
            int wrow = (r < 8 ? j0 : tile_hi(j0)) + (r & 7);
            const bool row_ok = GATE ? j0 + (r & 7) < N : wrow < N;
            if (!row_ok) wrow = GATE ? (r < 8 ? 0 : N) : 0;    // in bounds; its sums are never written
            const unsigned char* src = W + (size_t)wrow * KB;
            for (int c = 0; c < NC; c++, q++) {
                const int s = q % S;
                if (q >= S) mbar_wait(empty + s, ((q / S) - 1) & 1);
                const int bytes = min(TC_CHUNK, KB - c * TC_CHUNK);
                if (lane == 0) mbar_expect_tx(full + s, 16 * bytes);
                __syncwarp();
                if (lane < 16) bulk_load(stages + (size_t)s * TC_STAGE + r * TC_PITCH,
                                         src + (size_t)c * TC_CHUNK, bytes, full + s, policy);
            }
        }
        return;
    }

    // consumers: the first tile's block scales (constants) before the wait, x after it
    auto load_scales = [&](int j0) {
        if (BLK) {
            for (int i = threadIdx.x; i < 2 * kb_n; i += 32 * TC_CONSUMERS) {
                const int half = i >= kb_n, kb = i - half * kb_n;
                const int frow = half ? tile_hi(j0) : j0;
                sc_s[i] = __ldg(scale + (size_t)(min(frow, n_rows - 1) >> 7) * kb_n + kb);
            }
        }
    };
    load_scales(tile_j0(blockIdx.x));
    pdl_entry();
    // x [M, K] into xs (e4m3: as f16 x 2^-4; NORM: raw, normalized below). The folded kernels keep two 16-byte loads
    // in flight a thread; the plain ones one (measured: two made the plain 2-row steps 1-2% slower, H100)
    constexpr int STEP = 32 * TC_CONSUMERS * 8;
    constexpr bool RAW = WB == 2 || FOLD == TC_NORM;
    if (FOLD == TC_PLAIN) {
        for (int i = threadIdx.x * 8; i < M * K; i += STEP) {
            const vec16 v = ld_cached(X + i);
            *reinterpret_cast<vec16*>(xs + i) = WB == 1 ? bf16x8_f16x8_scaled(v) : v;
        }
    } else {
        for (int i = threadIdx.x * 8; i < M * K; i += 2 * STEP) {
            const bool two = i + STEP < M * K;
            const vec16 v0 = ld_cached(X + i);
            const vec16 v1 = two ? ld_cached(X + i + STEP) : v0;
            if (FOLD == TC_NORM) {                             // the norm weight, for the pass below
                if (i < K) asm volatile("prefetch.global.L1 [%0];" ::"l"(nw + i));
                if (i + STEP < K) asm volatile("prefetch.global.L1 [%0];" ::"l"(nw + i + STEP));
            }
            *reinterpret_cast<vec16*>(xs + i) = RAW ? v0 : bf16x8_f16x8_scaled(v0);
            if (two) *reinterpret_cast<vec16*>(xs + i + STEP) = RAW ? v1 : bf16x8_f16x8_scaled(v1);
        }
    }
    if (FOLD == TC_NORM) {
        tc_consumers_sync();
        for (int m = 0; m < M; m++) {                          // each thread its chunks k = 8 tid + j STEP of a row
            float s = 0.f;
            for (int k = threadIdx.x * 8; k < K; k += STEP) {
                float f[8];
                unpack8(*reinterpret_cast<const vec16*>(xs + (size_t)m * K + k), f);
#pragma unroll
                for (int j = 0; j < 8; j++) s += f[j] * f[j];
            }
            s = warp_sum(s);
            if (lane == 0) red[warp * GT_MAX_ROWS + m] = s;     // red is free until the first tile's sums
        }
        tc_consumers_sync();
        for (int m = 0; m < M; m++) {
            float ss = 0.f;
#pragma unroll
            for (int w = 0; w < TC_CONSUMERS; w++) ss += red[w * GT_MAX_ROWS + m];
            const float inv = rsqrtf(ss / (float)K + eps);
            for (int k = threadIdx.x * 8; k < K; k += STEP) {
                bf16* xp = xs + (size_t)m * K + k;
                float f[8], g[8];
                unpack8(*reinterpret_cast<const vec16*>(xp), f);
                unpack8(ld_cached(nw + k), g);
#pragma unroll
                for (int j = 0; j < 8; j++) f[j] = round_bf(f[j] * inv * g[j]);
                const vec16 h = pack8(f);
                *reinterpret_cast<vec16*>(xp) = WB == 1 ? bf16x8_f16x8_scaled(h) : h;
            }
        }
    }
    const int g = lane >> 2, t = lane & 3;
    int q = 0;                                                 // chunks consumed by this block
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int j0 = tile_j0(tile);
        if (tile != (int)blockIdx.x) load_scales(j0);     // every consumer is past the last tile's chunks
        tc_consumers_sync();
        float res_old = 0.f;                                      // RES: thread (r, m)'s residual, read early
        if (FOLD == TC_RES && (int)threadIdx.x < 16 * M && j0 + (threadIdx.x & 15) < N)
            res_old = bf2f(((const bf16*)out)[(size_t)(threadIdx.x >> 4) * N + j0 + (threadIdx.x & 15)]);
        float acc[4] = {0.f, 0.f, 0.f, 0.f};                      // C: (row g | g + 8) x (column 2t, 2t + 1)
        for (int c = 0; c < NC; c++, q++) {
            const int s = q % S;
            mbar_wait(full + s, (q / S) & 1);
            const int kw = (c * TC_CHUNK + warp * 128) / WB;      // this warp's first k of the chunk
            if (kw < K) {
                const unsigned char* st = stages + (size_t)s * TC_STAGE + warp * 128 + 16 * t;
                vec16 wa[2], wb[2], xv[2];
#pragma unroll
                for (int h = 0; h < 2; h++) {                     // e4m3: h = 1 only where K goes on (K % 64 == 0)
                    if (WB == 2 || kw + 64 * h < K) {
                        wa[h] = *reinterpret_cast<const vec16*>(st + g * TC_PITCH + 64 * h);
                        wb[h] = *reinterpret_cast<const vec16*>(st + (g + 8) * TC_PITCH + 64 * h);
                    }
                }
                if (WB == 2) {
                    xv[0] = xv[1] = vec16{0u, 0u, 0u, 0u};
                    if (g < M) {
                        const bf16* xp = xs + (size_t)g * K + kw + 8 * t;
                        xv[0] = *reinterpret_cast<const vec16*>(xp);
                        xv[1] = *reinterpret_cast<const vec16*>(xp + 32);
                    }
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const vec16& a = wa[i >> 1];
                        const vec16& b = wb[i >> 1];
                        const vec16& x = xv[i >> 1];
                        if (i & 1) mma_bf16(acc, a.z, b.z, a.w, b.w, x.z, x.w);
                        else mma_bf16(acc, a.x, b.x, a.y, b.y, x.x, x.y);
                    }
                } else {
                    float part[4] = {0.f, 0.f, 0.f, 0.f};
                    float* d = BLK ? part : acc;
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        if (kw + 64 * h < K) {
                            vec16 xa = {0u, 0u, 0u, 0u}, xb = {0u, 0u, 0u, 0u};
                            if (g < M) {
                                const bf16* xp = xs + (size_t)g * K + kw + 64 * h + 16 * t;
                                xa = *reinterpret_cast<const vec16*>(xp);
                                xb = *reinterpret_cast<const vec16*>(xp + 8);
                            }
                            const u32 wav[4] = {wa[h].x, wa[h].y, wa[h].z, wa[h].w};
                            const u32 wbv[4] = {wb[h].x, wb[h].y, wb[h].z, wb[h].w};
                            const u32 xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
                            for (int i = 0; i < 4; i++) {
                                u32 a0, a1, a2, a3;
                                e4m3x4_f16x4(wav[i], a0, a2);
                                e4m3x4_f16x4(wbv[i], a1, a3);
                                mma_f16(d, a0, a1, a2, a3, xw[2 * i], xw[2 * i + 1]);
                            }
                        }
                    }
                    if (BLK) {
                        const float slo = sc_s[kw >> 7], shi = sc_s[kb_n + (kw >> 7)];
                        acc[0] += part[0] * slo; acc[1] += part[1] * slo;
                        acc[2] += part[2] * shi; acc[3] += part[3] * shi;
                    }
                }
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(empty + s);
        }

        // the eight warps' partials, summed in warp order
        if (2 * t < M) {
            red[(warp * 16 + g) * M + 2 * t] = acc[0];
            red[(warp * 16 + g + 8) * M + 2 * t] = acc[2];
        }
        if (2 * t + 1 < M) {
            red[(warp * 16 + g) * M + 2 * t + 1] = acc[1];
            red[(warp * 16 + g + 8) * M + 2 * t + 1] = acc[3];
        }
        tc_consumers_sync();
        auto total = [&](int row, int m) {
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < TC_CONSUMERS; w++) v += red[(w * 16 + row) * M + m];
            return WB == 1 ? v * FP8_F16_UNSCALE : v;
        };
        if (GATE) {
            const int j = threadIdx.x & 7, m = threadIdx.x >> 3;
            if (m < M && j0 + j < N) {
                float gs = total(j, m), us = total(j + 8, m);
                if (Q == 1) { gs *= __ldg(scale + j0 + j); us *= __ldg(scale + N + j0 + j); }
                const float gv = round_bf(gs), uv = round_bf(us);
                ((bf16*)out)[(size_t)m * N + j0 + j] = f2bf(silu(gv) * uv);
            }
        } else {
            const int r = threadIdx.x & 15, m = threadIdx.x >> 4, row = j0 + r;
            if (m < M && row < N) {
                float v = total(r, m);
                if (Q == 1) v *= __ldg(scale + row);
                v += bias ? bf2f(bias[row]) : 0.f;
                if (FOLD == TC_RES) ((bf16*)out)[(size_t)m * N + row] = f2bf(res_old + round_bf(v));
                else if (OUT_F32) ((float*)out)[(size_t)m * N + row] = v;
                else ((bf16*)out)[(size_t)m * N + row] = f2bf(v);
            }
        }
    }
}

// Grid: the planner's (at most ceil(N / 16) tiles, gate: ceil(I / 8)), 288 threads, dynamic shared memory
// plan/gemv_tc_plan.gemv_tc_smem.
// e4m3: gemv_fp8_tc_{ch|blk}_{bf16|f32|gate} (X, W, scale, bias, out, M, N, K, S); bf16: gemv_tc_{bf16|f32|gate}
// without `scale`. The folded norm: `_res` (X, W, [scale,] bias, residual, M, N, K, S) and `_norm_{bf16|gate}`
// (residual, nw, eps, W, [scale,] ...) with the plain kernel's arguments after W.
#define GEMV_FP8_TC_KERNELS(NAME, Q)                                                                         \
    extern "C" __global__ void __launch_bounds__(288, GT_BLOCKS_SM) NAME##_bf16(const bf16* X, const e4m3* W,  \
        const float* scale, const bf16* bias, bf16* out, int M, int N, int K, int S) {                       \
        gemv_tc_impl<1, Q, false, false>(X, W, scale, bias, out, M, N, K, S); }                              \
    extern "C" __global__ void __launch_bounds__(288, GT_BLOCKS_SM) NAME##_f32(const bf16* X, const e4m3* W,   \
        const float* scale, const bf16* bias, float* out, int M, int N, int K, int S) {                      \
        gemv_tc_impl<1, Q, true, false>(X, W, scale, bias, out, M, N, K, S); }                               \
    extern "C" __global__ void __launch_bounds__(288, GT_BLOCKS_SM) NAME##_gate(const bf16* X, const e4m3* W,  \
        const float* scale, bf16* out, int M, int I, int K, int S) {                                         \
        gemv_tc_impl<1, Q, false, true>(X, W, scale, nullptr, out, M, I, K, S); }                            \
    extern "C" __global__ void __launch_bounds__(288, GT_BLOCKS_SM) NAME##_res(const bf16* X, const e4m3* W,   \
        const float* scale, const bf16* bias, bf16* residual, int M, int N, int K, int S) {                  \
        gemv_tc_impl<1, Q, false, false, TC_RES>(X, W, scale, bias, residual, M, N, K, S); }                 \
    extern "C" __global__ void __launch_bounds__(288, GT_BLOCKS_SM) NAME##_norm_bf16(const bf16* X,            \
        const bf16* nw, float eps, const e4m3* W, const float* scale, const bf16* bias, bf16* out, int M,    \
        int N, int K, int S) {                                                                               \
        gemv_tc_impl<1, Q, false, false, TC_NORM>(X, W, scale, bias, out, M, N, K, S, nw, eps); }            \
    extern "C" __global__ void __launch_bounds__(288, GT_BLOCKS_SM) NAME##_norm_gate(const bf16* X,            \
        const bf16* nw, float eps, const e4m3* W, const float* scale, bf16* out, int M, int I, int K, int S) { \
        gemv_tc_impl<1, Q, false, true, TC_NORM>(X, W, scale, nullptr, out, M, I, K, S, nw, eps); }
GEMV_FP8_TC_KERNELS(gemv_fp8_tc_ch, 1)
GEMV_FP8_TC_KERNELS(gemv_fp8_tc_blk, 2)

extern "C" __global__ void __launch_bounds__(288, GT_BLOCKS_SM) gemv_tc_bf16(const bf16* X, const bf16* W,
        const bf16* bias, bf16* out, int M, int N, int K, int S) {
    gemv_tc_impl<2, 0, false, false>(X, (const unsigned char*)W, nullptr, bias, out, M, N, K, S);
}
extern "C" __global__ void __launch_bounds__(288, GT_BLOCKS_SM) gemv_tc_f32(const bf16* X, const bf16* W,
        const bf16* bias, float* out, int M, int N, int K, int S) {
    gemv_tc_impl<2, 0, true, false>(X, (const unsigned char*)W, nullptr, bias, out, M, N, K, S);
}
extern "C" __global__ void __launch_bounds__(288, GT_BLOCKS_SM) gemv_tc_gate(const bf16* X, const bf16* W,
        bf16* out, int M, int I, int K, int S) {
    gemv_tc_impl<2, 0, false, true>(X, (const unsigned char*)W, nullptr, nullptr, out, M, I, K, S);
}
extern "C" __global__ void __launch_bounds__(288, GT_BLOCKS_SM) gemv_tc_res(const bf16* X, const bf16* W,
        const bf16* bias, bf16* residual, int M, int N, int K, int S) {
    gemv_tc_impl<2, 0, false, false, TC_RES>(X, (const unsigned char*)W, nullptr, bias, residual, M, N, K, S);
}
extern "C" __global__ void __launch_bounds__(288, GT_BLOCKS_SM) gemv_tc_norm_bf16(const bf16* X, const bf16* nw,
        float eps, const bf16* W, const bf16* bias, bf16* out, int M, int N, int K, int S) {
    gemv_tc_impl<2, 0, false, false, TC_NORM>(X, (const unsigned char*)W, nullptr, bias, out, M, N, K, S, nw, eps);
}
extern "C" __global__ void __launch_bounds__(288, GT_BLOCKS_SM) gemv_tc_norm_gate(const bf16* X, const bf16* nw,
        float eps, const bf16* W, bf16* out, int M, int I, int K, int S) {
    gemv_tc_impl<2, 0, false, true, TC_NORM>(X, (const unsigned char*)W, nullptr, nullptr, out, M, I, K, S, nw, eps);
}
