// Fused per-head QK RMSNorm + NeoX RoPE + paged KV write. Grid (rows, head groups); one warp per head
// (q heads, then k heads, then v heads). HD % 64 == 0: lane holds elements lane + 32 e, RoPE pairs e, e + E/2.
// kv_layer: [2, num_slots, nkv, HD] of this layer; rows with slot < 0 write no KV.
#include "qk_rope.cuh"

template <int HD>
__device__ __forceinline__ void qk_rope_impl(const bf16* __restrict__ qkv, const int* __restrict__ positions,
                                             const int* __restrict__ slot_mapping, const bf16* __restrict__ q_norm,
                                             const bf16* __restrict__ k_norm, const float* __restrict__ cos_t,
                                             const float* __restrict__ sin_t, bf16* __restrict__ q_out,
                                             bf16* __restrict__ kv_layer, int nh, int nkv, float eps, int num_slots) {
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
                bf16* dst = kv_layer + ((size_t)num_slots + slot) * nkv * HD + (size_t)(head - nh - nkv) * HD;
#pragma unroll
                for (int e = 0; e < E; e++) dst[lane + 32 * e] = f2bf(x[e]);
            }
            continue;
        }
        const bool is_q = head < nh;
        if (!is_q && slot < 0) continue;
        float y[E];
        qk_norm_rope_head<HD>(x, is_q ? q_norm : k_norm, cs, sn, eps, lane, y);
        bf16* dst = is_q ? q_out + ((size_t)r * nh + head) * HD
                         : kv_layer + (size_t)slot * nkv * HD + (size_t)(head - nh) * HD;
#pragma unroll
        for (int e = 0; e < E; e++) dst[lane + 32 * e] = f2bf(y[e]);
    }
}

#define ROPE_KERNEL(HD)                                                                                      \
    extern "C" __global__ void qk_norm_rope_cache_hd##HD(                                                    \
        const bf16* qkv, const int* positions, const int* slot_mapping, const bf16* q_norm,                  \
        const bf16* k_norm, const float* cos_t, const float* sin_t, bf16* q_out, bf16* kv_layer,             \
        int nh, int nkv, float eps, int num_slots) {                                                         \
        qk_rope_impl<HD>(qkv, positions, slot_mapping, q_norm, k_norm, cos_t, sin_t, q_out, kv_layer,        \
                         nh, nkv, eps, num_slots); }

ROPE_KERNEL(64)
ROPE_KERNEL(128)
ROPE_KERNEL(256)
