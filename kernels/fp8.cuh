// e4m3fn (FP8) helpers: weights and W8A8 activations are raw e4m3fn bytes (bias 7, no infinities, 0x7f NaN).
#pragma once
#include "common.cuh"

typedef unsigned char e4m3;

#define FP8_MAX 448.f
#define FP8_MIN_AMAX 1e-12f

// Two e4m3 (low byte -> low half) -> f16x2, exact (hardware cvt, sm_89+).
__device__ __forceinline__ u32 e4m3x2_f16x2(u32 two) {
    u32 h;
    asm("{ .reg .b16 t; cvt.u16.u32 t, %1; cvt.rn.f16x2.e4m3x2 %0, t; }" : "=r"(h) : "r"(two));
    return h;
}
__device__ __forceinline__ float f16lo(u32 h) {
    float f;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, lo; }" : "=f"(f) : "r"(h));
    return f;
}
__device__ __forceinline__ float f16hi(u32 h) {
    float f;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, hi; }" : "=f"(f) : "r"(h));
    return f;
}
// Four e4m3 of a word -> four floats, exact.
__device__ __forceinline__ void e4m3x4_f32(u32 w, float* f) {
    const u32 a = e4m3x2_f16x2(w & 0xffffu), b = e4m3x2_f16x2(w >> 16);
    f[0] = f16lo(a); f[1] = f16hi(a); f[2] = f16lo(b); f[3] = f16hi(b);
}
// Four e4m3 of a word -> four floats carrying value * 2^-120, by integer ops only: byte i moved to the top of a word,
// shifted right arithmetically by 4 (sign into bit 31, exponent and mantissa into the f32 exponent's low 4 bits and
// the mantissa's top 3), masked. Exact: e4m3 subnormals become f32 denormals of the same ratio (kernels are built
// without flush-to-zero); the NaN encoding becomes a finite value (quantized weights hold no NaN).
__device__ __forceinline__ void e4m3x4_f32_scaled(u32 w, float* f) {
#pragma unroll
    for (int i = 0; i < 4; i++) f[i] = __uint_as_float((u32)((int)(w << (24 - 8 * i)) >> 4) & 0x87f00000u);
}
#define FP8_F32_UNSCALE 1.329227995784916e36f    // 2^120

// f16x2 of e4m3 values -> bf16x2 carrying value * 2^-112: the f16 exponent and mantissa bits moved into bf16
// position (every e4m3 value, subnormals included, is a normal f16, so the result is a normal bf16 or zero). Callers
// multiply the fp32 sums by FP8_BF16_UNSCALE.
// Four e4m3 of a word -> two f16x2 (bytes 0, 1 -> lo; 2, 3 -> hi), exact.
__device__ __forceinline__ void e4m3x4_f16x4(u32 w, u32& lo, u32& hi) {
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h; }"
        : "=r"(lo), "=r"(hi) : "r"(w));
}
// Two floats -> f16x2 (lo -> low half), round to nearest even.
__device__ __forceinline__ u32 f32x2_f16x2(float lo, float hi) {
    u32 h;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(hi), "f"(lo));
    return h;
}
// bf16 -> f16 of value * 2^-4 (exact for magnitudes in [2^-13, 2^20)): two, or eight (the tensor-core FP8 GEMV
// input).
#define FP8_F16_IN_SCALE 0.0625f
#define FP8_F16_UNSCALE 16.f
__device__ __forceinline__ u32 bf16x2_f16x2_scaled(u32 b) {
    return f32x2_f16x2(__uint_as_float(b << 16) * FP8_F16_IN_SCALE, __uint_as_float(b & 0xffff0000u) * FP8_F16_IN_SCALE);
}
__device__ __forceinline__ vec16 bf16x8_f16x8_scaled(const vec16& v) {
    return vec16{bf16x2_f16x2_scaled(v.x), bf16x2_f16x2_scaled(v.y), bf16x2_f16x2_scaled(v.z),
                 bf16x2_f16x2_scaled(v.w)};
}
__device__ __forceinline__ u32 f16x2_bf16x2_scaled(u32 h) {
    return ((h >> 3) & 0x0fff0fffu) | (h & 0x80008000u);
}
#define FP8_BF16_UNSCALE 5.192296858534828e33f   // 2^112

// Two floats -> two e4m3 in the low 16 bits (lo -> low byte), round to nearest even, saturating to +-448.
__device__ __forceinline__ u32 f32x2_e4m3x2(float lo, float hi) {
    unsigned short d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return (u32)d;
}

// The per-token activation scale of quantize_fp8 (fp8.scale_of): s = max(amax, 1e-12) / 448, IEEE division.
__device__ __forceinline__ float fp8_act_scale(float amax) { return fmaxf(amax, FP8_MIN_AMAX) / FP8_MAX; }
// The scale of a group of 128 held by 16 lanes of a half-warp (8 values each; a: a lane's amax, 0 past the row):
// fp8_act_scale of the half-warp's amax. mask: the lanes that take part in the shuffles.
__device__ __forceinline__ float group128_scale(float a, unsigned mask) {
#pragma unroll
    for (int o = 8; o; o >>= 1) a = fmaxf(a, __shfl_xor_sync(mask, a, o));
    return fp8_act_scale(a);
}
// Eight floats -> eight e4m3 (k order, low byte first) of f / s: IEEE division, RNE, saturating.
__device__ __forceinline__ uint2 e4m3x8_div(const float* f, float s) {
    uint2 q;
    q.x = f32x2_e4m3x2(f[0] / s, f[1] / s) | (f32x2_e4m3x2(f[2] / s, f[3] / s) << 16);
    q.y = f32x2_e4m3x2(f[4] / s, f[5] / s) | (f32x2_e4m3x2(f[6] / s, f[7] / s) << 16);
    return q;
}
