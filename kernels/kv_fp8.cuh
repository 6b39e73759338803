// FP8 KV cache (plan kv_cache dtype float8_e4m3fn; docs/plan-format.md "FP8 KV cache"): e4m3fn bytes in the same
// [2, num_slots, nkv, HD] layout, one k and one v scale a layer passed as kernel arguments. Write: e4m3 of the bf16
// cache value divided by the scale (IEEE division, round to nearest even, saturating to +-448: xserv_aot/kv_cache.py).
// Read: the exact e4m3 value as bf16 (every e4m3 value is one); the kernels fold k_scale into the softmax scale and
// v_scale into the output, so no product is rounded to bf16.
#pragma once
#include "fp8.cuh"

template <typename KVT> struct KvF8 { static constexpr bool value = false; };
template <> struct KvF8<e4m3> { static constexpr bool value = true; };

// One cache element from its float value: bf16(v), or e4m3(bf16(v) / scale).
__device__ __forceinline__ void kv_put(bf16* p, float v, float) { *p = f2bf(v); }
__device__ __forceinline__ void kv_put(e4m3* p, float v, float scale) {
    *p = (e4m3)f32x2_e4m3x2(round_bf(v) / scale, 0.f);
}

// Two e4m3 (low byte first) -> bf16x2, exact.
__device__ __forceinline__ u32 e4m3x2_bf16x2(u32 two) {
    const u32 h = e4m3x2_f16x2(two);
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(f16hi(h)), "f"(f16lo(h)));
    return d;
}

// Eight e4m3 -> eight bf16 (k order kept).
__device__ __forceinline__ vec16 e4m3x8_bf16x8(uint2 w) {
    vec16 v;
    v.x = e4m3x2_bf16x2(w.x & 0xffffu); v.y = e4m3x2_bf16x2(w.x >> 16);
    v.z = e4m3x2_bf16x2(w.y & 0xffffu); v.w = e4m3x2_bf16x2(w.y >> 16);
    return v;
}

// Eight bf16 cache values (a 16-byte chunk) -> their eight e4m3 bytes at `scale`.
__device__ __forceinline__ uint2 kv_chunk_e4m3(const vec16& v, float scale) {
    float f[8];
    unpack8(v, f);
    return e4m3x8_div(f, scale);
}

// A tile of ROWS e4m3 rows (HD bytes each, contiguous) -> bf16 rows of LD elements, by NT threads.
template <int ROWS, int HD, int LD, int NT>
__device__ __forceinline__ void kv_tile_to_bf16(const e4m3* __restrict__ src, bf16* __restrict__ dst) {
    constexpr int CH = HD / 8;
    static_assert(ROWS * CH % NT == 0, "whole conversion rounds");
#pragma unroll 4
    for (int i = 0; i < ROWS * CH / NT; i++) {
        const int c = threadIdx.x + i * NT, r = c / CH, u = c % CH;
        st16(dst + r * LD + u * 8, e4m3x8_bf16x8(*reinterpret_cast<const uint2*>(src + r * HD + u * 8)));
    }
}
