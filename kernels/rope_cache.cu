// Fused per-head QK RMSNorm + NeoX RoPE + paged KV write. Grid (rows, head groups); one warp per head
// (q heads, then k heads, then v heads). HD % 64 == 0: lane holds elements lane + 32 e, RoPE pairs e, e + E/2.
// kv_layer: [2, num_slots, nkv, HD] of this layer; rows with slot < 0 write no KV. KVT e4m3 (the _f8kv kernels):
// an FP8 cache, k and v stored at k_scale / v_scale (kv_fp8.cuh).
#include "qk_rope.cuh"
#include "kv_fp8.cuh"

template <int HD, typename KVT = bf16>
__device__ __forceinline__ void qk_rope_impl(const bf16* __restrict__ qkv, const int* __restrict__ positions,
                                             const int* __restrict__ slot_mapping, const bf16* __restrict__ q_norm,
                                             const bf16* __restrict__ k_norm, const float* __restrict__ cos_t,
                                             const float* __restrict__ sin_t, bf16* __restrict__ q_out,
                                             KVT* __restrict__ kv_layer, int nh, int nkv, float eps, int num_slots,
                                             float k_scale = 1.f, float v_scale = 1.f) {
    pdl_entry();
    constexpr int E = HD / 32;
    const int r = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int pos = positions[r], slot = slot_mapping[r];
    const int width = (nh + 2 * nkv) * HD;
    const bf16* src = qkv + (size_t)r * width;
    for (int head = blockIdx.y * nwarps + warp; head < nh + 2 * nkv; head += nwarps * gridDim.y) {
        float x[E], cs[E / 2], sn[E / 2];
#pragma unroll
        for (int e = 0; e < E; e++) x[e] = bf2f(src[head * HD + lane + 32 * e]);
        rope_load<HD>(cos_t, sin_t, pos, lane, cs, sn);       // table loads issued with x's, before the norm
        if (head >= nh + nkv) {                               // v: copy into the cache
            if (slot >= 0) {
                KVT* dst = kv_layer + ((size_t)num_slots + slot) * nkv * HD + (size_t)(head - nh - nkv) * HD;
#pragma unroll
                for (int e = 0; e < E; e++) kv_put(dst + lane + 32 * e, x[e], v_scale);
            }
            continue;
        }
        const bool is_q = head < nh;
        if (!is_q && slot < 0) continue;
        float y[E];
        qk_norm_rope_head<HD>(x, is_q ? q_norm : k_norm, cs, sn, eps, lane, y);
        if (is_q) {
            bf16* dst = q_out + ((size_t)r * nh + head) * HD;
#pragma unroll
            for (int e = 0; e < E; e++) dst[lane + 32 * e] = f2bf(y[e]);
        } else {
            KVT* dst = kv_layer + (size_t)slot * nkv * HD + (size_t)(head - nh) * HD;
#pragma unroll
            for (int e = 0; e < E; e++) kv_put(dst + lane + 32 * e, y[e], k_scale);
        }
    }
}

#define ROPE_KERNEL(NAME, IMPL, HD)                                                                          \
    extern "C" __global__ void NAME##_hd##HD(                                                                \
        const bf16* qkv, const int* positions, const int* slot_mapping, const bf16* q_norm,                  \
        const bf16* k_norm, const float* cos_t, const float* sin_t, bf16* q_out, bf16* kv_layer,             \
        int nh, int nkv, float eps, int num_slots) {                                                         \
        IMPL<HD>(qkv, positions, slot_mapping, q_norm, k_norm, cos_t, sin_t, q_out, kv_layer, nh, nkv, eps,  \
                 num_slots); }

ROPE_KERNEL(qk_norm_rope_cache, qk_rope_impl, 64)
ROPE_KERNEL(qk_norm_rope_cache, qk_rope_impl, 128)
ROPE_KERNEL(qk_norm_rope_cache, qk_rope_impl, 256)

// qk_norm_rope_cache_f8kv_hdHD: the same into an FP8 cache (k / v divided by the layer's scales).
#define ROPE_KERNEL_F8KV(HD)                                                                                 \
    extern "C" __global__ void qk_norm_rope_cache_f8kv_hd##HD(                                               \
        const bf16* qkv, const int* positions, const int* slot_mapping, const bf16* q_norm,                  \
        const bf16* k_norm, const float* cos_t, const float* sin_t, bf16* q_out, e4m3* kv_layer,             \
        int nh, int nkv, float eps, int num_slots, float k_scale, float v_scale) {                           \
        qk_rope_impl<HD, e4m3>(qkv, positions, slot_mapping, q_norm, k_norm, cos_t, sin_t, q_out, kv_layer,  \
                               nh, nkv, eps, num_slots, k_scale, v_scale); }

ROPE_KERNEL_F8KV(64)
ROPE_KERNEL_F8KV(128)
ROPE_KERNEL_F8KV(256)

// Same op, vector layout: lane holds E = HD / 32 consecutive elements (HD 128: one 8-byte load and store a lane),
// RoPE partner e +- HD / 2 in lane ^ 16 (one shuffle an element). Only the norm's sum of squares is grouped
// differently from qk_rope_impl; any block of whole warps, any grid.y (heads are strided over both).
template <int E> struct __align__(2 * E) bf16x { u32 w[E / 2]; };

template <int HD>
__device__ __forceinline__ void qk_rope_vec_impl(const bf16* __restrict__ qkv, const int* __restrict__ positions,
                                                 const int* __restrict__ slot_mapping, const bf16* __restrict__ q_norm,
                                                 const bf16* __restrict__ k_norm, const float* __restrict__ cos_t,
                                                 const float* __restrict__ sin_t, bf16* __restrict__ q_out,
                                                 bf16* __restrict__ kv_layer, int nh, int nkv, float eps,
                                                 int num_slots) {
    pdl_entry();
    constexpr int E = HD / 32;
    using V = bf16x<E>;
    const int r = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int pos = positions[r], slot = slot_mapping[r];
    const bf16* src = qkv + (size_t)r * (nh + 2 * nkv) * HD;
    const int c0 = lane * E, f0 = (lane & 15) * E;             // first element, its RoPE frequency
    const float sign = lane < 16 ? -1.f : 1.f;                 // y = x c - x' s (first half), x c + x' s
    for (int head = blockIdx.y * nwarps + warp; head < nh + 2 * nkv; head += nwarps * gridDim.y) {
        const V raw = *reinterpret_cast<const V*>(src + head * HD + c0);
        if (head >= nh + nkv) {                               // v: copy into the cache
            if (slot >= 0) {
                bf16* dst = kv_layer + ((size_t)num_slots + slot) * nkv * HD + (size_t)(head - nh - nkv) * HD;
                *reinterpret_cast<V*>(dst + c0) = raw;
            }
            continue;
        }
        const bool is_q = head < nh;
        if (!is_q && slot < 0) continue;
        float x[E];
#pragma unroll
        for (int i = 0; i < E / 2; i++) { x[2 * i] = bflo(raw.w[i]); x[2 * i + 1] = bfhi(raw.w[i]); }
        const bf16* nw = is_q ? q_norm : k_norm;
        if (nw) {
            float ss = 0.f;
#pragma unroll
            for (int e = 0; e < E; e++) ss += x[e] * x[e];
            const float inv = rsqrtf(warp_sum(ss) / (float)HD + eps);
            const V wv = *reinterpret_cast<const V*>(nw + c0);
#pragma unroll
            for (int i = 0; i < E / 2; i++) {
                x[2 * i] = x[2 * i] * inv * bflo(wv.w[i]);
                x[2 * i + 1] = x[2 * i + 1] * inv * bfhi(wv.w[i]);
            }
        }
        V out;
#pragma unroll
        for (int i = 0; i < E / 2; i++) {
            float y[2];
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int e = 2 * i + j;
                const float other = __shfl_xor_sync(0xffffffffu, x[e], 16);
                const float c = cos_t[(size_t)pos * (HD / 2) + f0 + e], s = sin_t[(size_t)pos * (HD / 2) + f0 + e];
                y[j] = x[e] * c + sign * (other * s);
            }
            out.w[i] = pack2(y[0], y[1]);
        }
        bf16* dst = is_q ? q_out + ((size_t)r * nh + head) * HD
                         : kv_layer + (size_t)slot * nkv * HD + (size_t)(head - nh) * HD;
        *reinterpret_cast<V*>(dst + c0) = out;
    }
}

ROPE_KERNEL(qk_norm_rope_cache_vec, qk_rope_vec_impl, 64)
ROPE_KERNEL(qk_norm_rope_cache_vec, qk_rope_vec_impl, 128)
ROPE_KERNEL(qk_norm_rope_cache_vec, qk_rope_vec_impl, 256)
