// Per-head QK RMSNorm + NeoX RoPE, one warp per head (HD % 64 == 0): lane holds elements lane + 32 e
// (e < HD / 32), RoPE pairs e, e + E/2. Shared by the QK-norm/RoPE/KV-write kernel (rope_cache.cu) and the fused
// decode attention (attention_decode_tc.cu), so both round the same values the same way.
#pragma once
#include "common.cuh"

// RoPE tables of position pos for this lane: cs[e], sn[e] = cos / sin at frequency lane + 32 e.
template <int HD>
__device__ __forceinline__ void rope_load(const float* __restrict__ cos_t, const float* __restrict__ sin_t, int pos,
                                          int lane, float* cs, float* sn) {
#pragma unroll
    for (int e = 0; e < HD / 64; e++) {
        cs[e] = cos_t[(size_t)pos * (HD / 2) + lane + 32 * e];
        sn[e] = sin_t[(size_t)pos * (HD / 2) + lane + 32 * e];
    }
}

// x (this lane's HD / 32 elements of one head) -> y = rope(rmsnorm(x) * nw) (no norm when nw is null); nw: this
// lane's HD / 32 norm weights, in registers.
template <int HD>
__device__ __forceinline__ void qk_norm_rope_head_w(float* x, const float* nw, const float* cs, const float* sn,
                                                    float eps, int lane, float* y) {
    constexpr int E = HD / 32;
    if (nw) {
        float ss = 0.f;
#pragma unroll
        for (int e = 0; e < E; e++) ss += x[e] * x[e];
        float inv = rsqrtf(warp_sum(ss) / (float)HD + eps);
#pragma unroll
        for (int e = 0; e < E; e++) x[e] = x[e] * inv * nw[e];
    }
#pragma unroll
    for (int e = 0; e < E / 2; e++) {
        float c = cs[e], s = sn[e];
        float x1 = x[e], x2 = x[e + E / 2];
        y[e] = x1 * c - x2 * s;
        y[e + E / 2] = x2 * c + x1 * s;
    }
}

// The same with the norm weights read from nw [HD] (bf16).
template <int HD>
__device__ __forceinline__ void qk_norm_rope_head(float* x, const bf16* __restrict__ nw, const float* cs,
                                                  const float* sn, float eps, int lane, float* y) {
    float w[HD / 32];
    if (nw) {
#pragma unroll
        for (int e = 0; e < HD / 32; e++) w[e] = bf2f(nw[lane + 32 * e]);
    }
    qk_norm_rope_head_w<HD>(x, nw ? w : nullptr, cs, sn, eps, lane, y);
}
