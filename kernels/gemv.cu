// Skinny GEMM for decode: out[M, N] = X[M, K] @ W[N, K]^T (+ bias), M <= MT (1, 2, 4, 8).
// One warp owns R (2) weight rows and streams them with 16-byte loads (U in flight per row, no atomics);
// X rows are re-read through L1. fp32 accumulation, warp-shuffle reduction. K % 8 == 0.
// GATE: W is gate_up [2I, K]; the warp owns gate row j and up row I + j and writes silu(g) * u to out[M, I]
// (g and u are rounded to bf16 first, as the unfused linear + silu_mul would).
#include "common.cuh"

#define GEMV_WARPS 8
#define GEMV_U 4            // 8 measured slower on H200 (2026-11-29: 2.67 vs 2.40 ms for qkv/o/down)

template <int MT, bool OUT_F32, bool GATE, int R>
__device__ __forceinline__ void gemv_impl(const bf16* __restrict__ X, const bf16* __restrict__ W,
                                          const bf16* __restrict__ bias, void* __restrict__ out,
                                          int M, int N, int K) {
    pdl_entry();
    static_assert(!GATE || R == 2, "the gate kernel pairs gate row j with up row I + j");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int unit = blockIdx.x * GEMV_WARPS + warp;        // gate: output column; else a group of R rows
    int row[R];
    if (GATE) { if (unit >= N) return; row[0] = unit; row[R - 1] = unit + N; }
    else {
#pragma unroll
        for (int r = 0; r < R; r++) row[r] = unit * R + r;
        if (row[0] >= N) return;
    }
    const bf16* wp[R];
#pragma unroll
    for (int r = 0; r < R; r++) wp[r] = W + (size_t)((GATE || row[r] < N) ? row[r] : row[0]) * K;

    float acc[R][MT];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int m = 0; m < MT; m++) acc[r][m] = 0.f;

    for (int kb = lane * 8; kb < K; kb += 32 * 8 * GEMV_U) {
        vec16 wv[R][GEMV_U];
#pragma unroll
        for (int u = 0; u < GEMV_U; u++) {
            int k = kb + u * 256;
            if (k < K) {
#pragma unroll
                for (int r = 0; r < R; r++) wv[r][u] = ld_stream(wp[r] + k);
            }
        }
#pragma unroll
        for (int u = 0; u < GEMV_U; u++) {
            int k = kb + u * 256;
            if (k < K) {
                float a[R][8];
#pragma unroll
                for (int r = 0; r < R; r++) unpack8(wv[r][u], a[r]);
#pragma unroll
                for (int m = 0; m < MT; m++) {
                    if (m < M) {
                        float x[8]; unpack8(ld_cached(X + (size_t)m * K + k), x);
#pragma unroll
                        for (int r = 0; r < R; r++)
#pragma unroll
                            for (int i = 0; i < 8; i++) acc[r][m] += a[r][i] * x[i];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MT; m++) {
        if (m < M) {
            float sum[R];
#pragma unroll
            for (int r = 0; r < R; r++) sum[r] = warp_sum(acc[r][m]);
            if (lane == m) {
                if (GATE) {
                    float g = round_bf(sum[0]), u = round_bf(sum[R - 1]);
                    ((bf16*)out)[(size_t)m * N + unit] = f2bf(silu(g) * u);
                } else {
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        if (row[r] < N) {
                            float v = sum[r] + (bias ? bf2f(bias[row[r]]) : 0.f);
                            if (OUT_F32) ((float*)out)[(size_t)m * N + row[r]] = v;
                            else ((bf16*)out)[(size_t)m * N + row[r]] = f2bf(v);
                        }
                    }
                }
            }
        }
    }
}

// Grid: ceil(N / 16) blocks of 256 threads (gate: ceil(I / 8), N = I).
#define GEMV_KERNELS(MT)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256) gemv_m##MT##_bf16(                                     \
        const bf16* X, const bf16* W, const bf16* bias, bf16* out, int M, int N, int K) {                    \
        gemv_impl<MT, false, false, 2>(X, W, bias, out, M, N, K); }                                             \
    extern "C" __global__ void __launch_bounds__(256) gemv_m##MT##_f32(                                      \
        const bf16* X, const bf16* W, const bf16* bias, float* out, int M, int N, int K) {                   \
        gemv_impl<MT, true, false, 2>(X, W, bias, out, M, N, K); }                                              \
    extern "C" __global__ void __launch_bounds__(256) gemv_gate_m##MT(                                       \
        const bf16* X, const bf16* W, bf16* out, int M, int I, int K) {                                      \
        gemv_impl<MT, false, true, 2>(X, W, nullptr, out, M, I, K); }

GEMV_KERNELS(1)
GEMV_KERNELS(2)
GEMV_KERNELS(4)
GEMV_KERNELS(8)

// Rows-per-warp variants of the batch-1 kernel, for the shape sweep in scripts/bench.py (grid ceil(N / (8 R))).
extern "C" __global__ void __launch_bounds__(256) gemv_r1_m1_bf16(
    const bf16* X, const bf16* W, const bf16* bias, bf16* out, int M, int N, int K) {
    gemv_impl<1, false, false, 1>(X, W, bias, out, M, N, K); }
extern "C" __global__ void __launch_bounds__(256) gemv_r4_m1_bf16(
    const bf16* X, const bf16* W, const bf16* bias, bf16* out, int M, int N, int K) {
    gemv_impl<1, false, false, 4>(X, W, bias, out, M, N, K); }
