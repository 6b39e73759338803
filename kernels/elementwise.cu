// Row-wise memory-bound ops on bf16 rows of H elements (H % 8 == 0): one block per row, 16-byte accesses.
#include "fp8.cuh"

// Overlapped steps: ids[r] = sampled[prev_rows[r]] where prev_rows[r] >= 0 (the previous step's token, never
// copied to the host), else unchanged. One thread per token row.
extern "C" __global__ void resolve_input_ids(int* __restrict__ ids, const int* __restrict__ prev_rows,
                                             const int* __restrict__ sampled, int rows) {
    pdl_entry();
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < rows) {
        int p = prev_rows[r];
        if (p >= 0) ids[r] = sampled[p];
    }
}

// out[r] = table[ids[r]]; ids clamped into [0, vocab).
extern "C" __global__ void embedding(const int* __restrict__ ids, const bf16* __restrict__ table,
                                     bf16* __restrict__ out, int H, int vocab) {
    pdl_entry();
    int r = blockIdx.x;
    int id = ids[r];
    id = id < 0 ? 0 : (id >= vocab ? vocab - 1 : id);
    const bf16* src = table + (size_t)id * H;
    bf16* dst = out + (size_t)r * H;
    for (int c = threadIdx.x * 8; c < H; c += blockDim.x * 8) st16(dst + c, ld_cached(src + c));
}

// Row norms keep the row in registers: thread t holds chunks t, t + blockDim, ... (at most NORM_NC of them),
// so H <= blockDim * 8 * NORM_NC; blockDim is a multiple of 32. NORM_NC: plan/kernel_constants.py (-D).

// The row norms' output: o = f * inv * w rounded to bf16, stored; Q: also quantize_fp8 of it, fused (the op that
// follows in the plan): per group of 128 (16 chunks = the 16 lanes of a half-warp, as blockDim % 32 == 0) or of
// the whole row (group == H): xq[r] = e4m3(o / s), xs[r, g] = s = fp8_act_scale(amax).
template <bool Q>
__device__ __forceinline__ void norm_store(float (&f)[NORM_NC][8], const vec16 (&wv)[NORM_NC], float inv,
                                           bf16* __restrict__ out, int H, e4m3* __restrict__ xq,
                                           float* __restrict__ xs, int group, float* scratch) {
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_NC; j++) {
        int c = (threadIdx.x + j * blockDim.x) * 8;
        if (c < H) {
            float g[8]; unpack8(wv[j], g);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                f[j][i] = round_bf(f[j][i] * inv * g[i]);
                amax = fmaxf(amax, fabsf(f[j][i]));
            }
            st16(out + c, pack8(f[j]));
        }
    }
    if (!Q) return;
    if (group == H) {
        const float sx = fp8_act_scale(block_max(amax, scratch));
        if (threadIdx.x == 0) xs[0] = sx;
#pragma unroll
        for (int j = 0; j < NORM_NC; j++) {
            int c = (threadIdx.x + j * blockDim.x) * 8;
            if (c < H) *reinterpret_cast<uint2*>(xq + c) = e4m3x8_div(f[j], sx);
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < NORM_NC; j++) {
        int c = (threadIdx.x + j * blockDim.x) * 8;
        float a = 0.f;
        if (c < H) {
#pragma unroll
            for (int i = 0; i < 8; i++) a = fmaxf(a, fabsf(f[j][i]));
        }
        const float sx = group128_scale(a, 0xffffffffu);
        if (c < H) {
            *reinterpret_cast<uint2*>(xq + c) = e4m3x8_div(f[j], sx);
            if ((c & 127) == 0) xs[c >> 7] = sx;
        }
    }
}

// out = x * rsqrt(mean(x^2) + eps) * w, x = inp[r] (float32 math).
template <bool Q>
__device__ __forceinline__ void rmsnorm_impl(const bf16* __restrict__ inp, const bf16* __restrict__ w,
                                             bf16* __restrict__ out, e4m3* __restrict__ xq, float* __restrict__ xs,
                                             int H, float eps, int group) {
    pdl_entry();
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    const bf16* x = inp + (size_t)r * H;
    float f[NORM_NC][8];
    vec16 wv[NORM_NC];                                   // weights loaded up front: off the critical path
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_NC; j++) {
        int c = (threadIdx.x + j * blockDim.x) * 8;
        if (c < H) {
            wv[j] = ld16(w + c);
            unpack8(ld16(x + c), f[j]);
#pragma unroll
            for (int i = 0; i < 8; i++) ss += f[j][i] * f[j][i];
        }
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)H + eps);
    norm_store<Q>(f, wv, inv, out + (size_t)r * H, H, xq + (size_t)r * H, xs + (size_t)r * ((H + group - 1) / group),
                  group, scratch);
}

// residual += delta (rounded to bf16), then out = rmsnorm(residual) * w.
template <bool Q>
__device__ __forceinline__ void add_rmsnorm_impl(bf16* __restrict__ residual, const bf16* __restrict__ delta,
                                                 const bf16* __restrict__ w, bf16* __restrict__ out,
                                                 e4m3* __restrict__ xq, float* __restrict__ xs, int H, float eps,
                                                 int group) {
    pdl_entry();
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    bf16* x = residual + (size_t)r * H;
    const bf16* d = delta + (size_t)r * H;
    float f[NORM_NC][8];
    vec16 wv[NORM_NC];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_NC; j++) {
        int c = (threadIdx.x + j * blockDim.x) * 8;
        if (c < H) {
            wv[j] = ld16(w + c);
            float g[8]; unpack8(ld16(x + c), f[j]); unpack8(ld16(d + c), g);
#pragma unroll
            for (int i = 0; i < 8; i++) { f[j][i] = round_bf(f[j][i] + g[i]); ss += f[j][i] * f[j][i]; }
            st16(x + c, pack8(f[j]));
        }
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)H + eps);
    norm_store<Q>(f, wv, inv, out + (size_t)r * H, H, xq + (size_t)r * H, xs + (size_t)r * ((H + group - 1) / group),
                  group, scratch);
}

extern "C" __global__ void rmsnorm(const bf16* __restrict__ inp, const bf16* __restrict__ w,
                                   bf16* __restrict__ out, int H, float eps) {
    rmsnorm_impl<false>(inp, w, out, nullptr, nullptr, H, eps, H);
}
extern "C" __global__ void add_rmsnorm(bf16* __restrict__ residual, const bf16* __restrict__ delta,
                                       const bf16* __restrict__ w, bf16* __restrict__ out, int H, float eps) {
    add_rmsnorm_impl<false>(residual, delta, w, out, nullptr, nullptr, H, eps, H);
}
// The same with the next op, quantize_fp8 of out (group 128 or H), fused: xq [rows, H] e4m3, xs [rows, groups].
extern "C" __global__ void rmsnorm_q(const bf16* __restrict__ inp, const bf16* __restrict__ w,
                                     bf16* __restrict__ out, e4m3* __restrict__ xq, float* __restrict__ xs, int H,
                                     float eps, int group) {
    rmsnorm_impl<true>(inp, w, out, xq, xs, H, eps, group);
}
extern "C" __global__ void add_rmsnorm_q(bf16* __restrict__ residual, const bf16* __restrict__ delta,
                                         const bf16* __restrict__ w, bf16* __restrict__ out, e4m3* __restrict__ xq,
                                         float* __restrict__ xs, int H, float eps, int group) {
    add_rmsnorm_impl<true>(residual, delta, w, out, xq, xs, H, eps, group);
}

// out[r, j] = silu(inp[r, j]) * inp[r, I + j]; grid covers rows * I / 8 chunks. Q: also quantize_fp8 of out in
// groups of 128 (I % 128 == 0: a group is 16 consecutive chunks = the 16 lanes of a half-warp, blockDim % 32 == 0).
template <bool Q>
__device__ __forceinline__ void silu_mul_impl(const bf16* __restrict__ inp, bf16* __restrict__ out,
                                              e4m3* __restrict__ xq, float* __restrict__ xs, int rows, int I) {
    pdl_entry();
    int chunks = I / 8;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < rows * chunks; t += gridDim.x * blockDim.x) {
        int r = t / chunks, c = (t % chunks) * 8;
        float g[8], u[8];
        unpack8(ld16(inp + (size_t)r * 2 * I + c), g);
        unpack8(ld16(inp + (size_t)r * 2 * I + I + c), u);
#pragma unroll
        for (int i = 0; i < 8; i++) g[i] = silu(g[i]) * u[i];
        st16(out + (size_t)r * I + c, pack8(g));
        if (Q) {                                   // rows * chunks % 16 == 0: a half-warp is all in or all out
            float a = 0.f;
#pragma unroll
            for (int i = 0; i < 8; i++) { g[i] = round_bf(g[i]); a = fmaxf(a, fabsf(g[i])); }
            const float sx = group128_scale(a, 0xffffu << (threadIdx.x & 16));
            *reinterpret_cast<uint2*>(xq + (size_t)r * I + c) = e4m3x8_div(g, sx);
            if ((c & 127) == 0) xs[(size_t)r * (I >> 7) + (c >> 7)] = sx;
        }
    }
}
extern "C" __global__ void silu_mul(const bf16* __restrict__ inp, bf16* __restrict__ out, int rows, int I) {
    silu_mul_impl<false>(inp, out, nullptr, nullptr, rows, I);
}
extern "C" __global__ void silu_mul_q(const bf16* __restrict__ inp, bf16* __restrict__ out, e4m3* __restrict__ xq,
                                      float* __restrict__ xs, int rows, int I) {
    silu_mul_impl<true>(inp, out, xq, xs, rows, I);
}

// out[r] = inp[idx[r]]; idx clamped into [0, src_rows).
extern "C" __global__ void gather_rows(const bf16* __restrict__ inp, const int* __restrict__ idx,
                                       bf16* __restrict__ out, int H, int src_rows) {
    pdl_entry();
    int r = blockIdx.x;
    int s = idx[r];
    s = s < 0 ? 0 : (s >= src_rows ? src_rows - 1 : s);
    for (int c = threadIdx.x * 8; c < H; c += blockDim.x * 8)
        st16(out + (size_t)r * H + c, ld16(inp + (size_t)s * H + c));
}

// Dummy weights (plan/dummy_weights.py, bit-identical to its NumPy generator): element i of the tensor seeded `seed`
// is mean + g * std, g = (sum of the four 16-bit fields of splitmix64(seed, i) / 65536 - 2) * 1.7320508, each step
// rounded to float32 (no fused multiply-add), then rounded to bf16 (fill_normal_f32: kept in float32, the input of
// an FP8 weight's quantization).
__device__ __forceinline__ float dummy_value(u64 seed, u64 i, float mean, float std) {
    const u64 z = splitmix64(seed, i);
    const float s = (float)((z & 0xffff) + ((z >> 16) & 0xffff) + ((z >> 32) & 0xffff) + (z >> 48));
    const float g = __fmul_rn(__fadd_rn(__fmul_rn(s, 1.f / 65536.f), -2.f), 1.7320508f);
    return __fadd_rn(__fmul_rn(g, std), mean);
}
extern "C" __global__ void fill_normal_bf16(bf16* __restrict__ p, u64 n, u64 seed, float mean, float std) {
    pdl_entry();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        p[i] = f2bf(dummy_value(seed, i, mean, std));
}
extern "C" __global__ void fill_normal_f32(float* __restrict__ p, u64 n, u64 seed, float mean, float std) {
    pdl_entry();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        p[i] = dummy_value(seed, i, mean, std);
}
