// Prefill row kernels (1k - 8k rows): the same values as elementwise.cu's add_rmsnorm / rmsnorm / silu_mul and
// rope_cache.cu's qk_norm_rope_cache, bit for bit, with more bytes in flight a thread, fewer and larger blocks and
// one bf16 rounding an element where those round twice (the second rounding of a bf16 value changes nothing).
// EF: the streams read once (the GEMM outputs, the residual) load with an L2 evict-first hint.
// QO (the `_q` / `_qonly` kernels): also the next op's quantize_fp8, as elementwise.cu's `_q` kernels fuse it (the
// same e4m3 bytes and scales); QO_ONLY: the bf16 output is not stored (the plan reads only the e4m3 rows after it).
#include "qk_rope.cuh"
#include "kv_fp8.cuh"

template <bool EF>
__device__ __forceinline__ vec16 ld_once(const void* p) {
    if (!EF) return ld16(p);
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    vec16 v;
    asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(policy));
    return v;
}

// pack8 of f2bf, by the hardware's round-to-nearest-even conversion (two floats an instruction); a NaN becomes
// 0x7fc0 as f2bf makes it, so the bits are f2bf's for every input.
__device__ __forceinline__ u32 pack2_rn(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    if (lo != lo) r = (r & 0xffff0000u) | 0x7fc0u;
    if (hi != hi) r = (r & 0xffffu) | 0x7fc00000u;
    return r;
}
__device__ __forceinline__ vec16 pack8_rn(const float* f) {
    vec16 v;
    v.x = pack2_rn(f[0], f[1]); v.y = pack2_rn(f[2], f[3]); v.z = pack2_rn(f[4], f[5]); v.w = pack2_rn(f[6], f[7]);
    return v;
}

// HW false: the software f2bf of common.cuh (the same bits; kept to time the conversion's share).
template <bool HW>
__device__ __forceinline__ vec16 pack8_as(const float* f) { return HW ? pack8_rn(f) : pack8(f); }

// 16 bytes global -> shared, asynchronous (all of a thread's copies in flight until cp_async_wait).
template <bool EF>
__device__ __forceinline__ void cp_async_once(void* smem, const void* gmem) {
    if (!EF) return cp_async16((u32)__cvta_generic_to_shared(smem), gmem);
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;"
                 :: "r"((u32)__cvta_generic_to_shared(smem)), "l"(gmem), "l"(policy) : "memory");
}

enum { QO_NONE = 0, QO_STORE = 1, QO_ONLY = 2 };

// quantize_fp8 of one row held by a block as K bf16 chunks a lane, chunk j of a lane at element
// ((warp + j * nw) * 32 + lane) * 8 (< H): group 128 (a half-warp's 16 chunks) or the whole row (group == H):
// xs[g] = s = fp8_act_scale(amax of the group), xq = e4m3(x / s). xq, xs: the row's.
template <int K>
__device__ __forceinline__ void quantize_row_chunks(const vec16 (&v)[K], int H, int group, e4m3* __restrict__ xq,
                                                    float* __restrict__ xs, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (group == H) {
        float a = 0.f;
#pragma unroll
        for (int j = 0; j < K; j++) {
            const int c = ((warp + j * nw) * 32 + lane) * 8;
            if (c < H) {
                float f[8]; unpack8(v[j], f);
#pragma unroll
                for (int i = 0; i < 8; i++) a = fmaxf(a, fabsf(f[i]));
            }
        }
        const float sx = fp8_act_scale(block_max(a, scratch));
        if (threadIdx.x == 0) xs[0] = sx;
#pragma unroll
        for (int j = 0; j < K; j++) {
            const int c = ((warp + j * nw) * 32 + lane) * 8;
            if (c < H) {
                float f[8]; unpack8(v[j], f);
                *reinterpret_cast<uint2*>(xq + c) = e4m3x8_div(f, sx);
            }
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < K; j++) {
        const int c = ((warp + j * nw) * 32 + lane) * 8;
        if (((warp + j * nw) * 32) * 8 >= H) continue;           // warp-uniform: the whole warp past the row
        float f[8], a = 0.f;
        if (c < H) {
            unpack8(v[j], f);
#pragma unroll
            for (int i = 0; i < 8; i++) a = fmaxf(a, fabsf(f[i]));
        }
        const float sx = group128_scale(a, 0xffffffffu);
        if (c < H) {
            *reinterpret_cast<uint2*>(xq + c) = e4m3x8_div(f, sx);
            if ((c & 127) == 0) xs[c >> 7] = sx;
        }
    }
}

// Row norms with K 16-byte chunks a lane. The one-chunk-a-thread kernel (elementwise.cu, norm_threads) has
// W = ceil(H / 256) warps, chunk 32 w + lane each; here warp v of NW = blockDim / 32 plays its warps v, v + NW, ...
// (W <= 32, W <= K * NW): each chunk's sum of squares, each warp sum and the sum over warp sums are added in the
// same order as block_sum, so inv and the output are the same bits. x (and d) loads all issued before any use.
template <int K, bool ADD, bool EF, bool HW = true, int QO = QO_NONE>
__device__ __forceinline__ void norm_rows_impl(bf16* __restrict__ residual, const bf16* __restrict__ delta,
                                               const bf16* __restrict__ w, bf16* __restrict__ out, int H,
                                               float eps, e4m3* __restrict__ xq = nullptr,
                                               float* __restrict__ xs = nullptr, int group = 0) {
    pdl_entry();
    __shared__ float scratch[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int W = (H / 8 + 31) >> 5;
    const size_t row = (size_t)blockIdx.x * H;
    vec16 xv[K], dv[K];
#pragma unroll
    for (int j = 0; j < K; j++) {
        const int c = ((warp + j * nw) * 32 + lane) * 8;
        if (c < H) {
            xv[j] = ld_once<EF>(residual + row + c);
            if (ADD) dv[j] = ld_once<EF>(delta + row + c);
        }
    }
    float part[K];
#pragma unroll
    for (int j = 0; j < K; j++) {
        const int c = ((warp + j * nw) * 32 + lane) * 8;
        float ss = 0.f;
        if (c < H) {
            float f[8]; unpack8(xv[j], f);
            if (ADD) {                                         // f = round_bf(x + d), rounded once
                float g[8]; unpack8(dv[j], g);
#pragma unroll
                for (int i = 0; i < 8; i++) f[i] = f[i] + g[i];
                xv[j] = pack8_as<HW>(f);
                unpack8(xv[j], f);
                st16(residual + row + c, xv[j]);
            }
#pragma unroll
            for (int i = 0; i < 8; i++) ss += f[i] * f[i];
        }
        part[j] = ss;
    }
#pragma unroll
    for (int j = 0; j < K; j++) {
        const int v = warp + j * nw;                           // warp-uniform
        if (v < W) {
            const float t = warp_sum(part[j]);
            if (lane == 0) scratch[v] = t;
        }
    }
    vec16 wv[K];
#pragma unroll
    for (int j = 0; j < K; j++) {
        const int c = ((warp + j * nw) * 32 + lane) * 8;
        if (c < H) wv[j] = ld16(w + c);
    }
    __syncthreads();
    const float inv = rsqrtf(warp_sum(lane < W ? scratch[lane] : 0.f) / (float)H + eps);
    if constexpr (QO != QO_NONE) {
#pragma unroll
        for (int j = 0; j < K; j++) {                          // xv[j] becomes the output chunk
            const int c = ((warp + j * nw) * 32 + lane) * 8;
            if (c < H) {
                float f[8], g[8]; unpack8(xv[j], f); unpack8(wv[j], g);
#pragma unroll
                for (int i = 0; i < 8; i++) f[i] = f[i] * inv * g[i];
                xv[j] = pack8_as<HW>(f);
                if (QO == QO_STORE) st16(out + row + c, xv[j]);
            }
        }
        quantize_row_chunks<K>(xv, H, group, xq + row, xs + (size_t)blockIdx.x * ((H + group - 1) / group), scratch);
        return;
    }
#pragma unroll
    for (int j = 0; j < K; j++) {
        const int c = ((warp + j * nw) * 32 + lane) * 8;
        if (c < H) {
            float f[8], g[8]; unpack8(xv[j], f); unpack8(wv[j], g);
#pragma unroll
            for (int i = 0; i < 8; i++) f[i] = f[i] * inv * g[i];
            st16(out + row + c, pack8_as<HW>(f));
        }
    }
}

#define NORM_ROWS(K, EF, SFX)                                                                                \
    extern "C" __global__ void add_rmsnorm_rows_k##K##SFX(bf16* residual, const bf16* delta, const bf16* w,  \
                                                         bf16* out, int H, float eps) {                      \
        norm_rows_impl<K, true, EF>(residual, delta, w, out, H, eps); }                                      \
    extern "C" __global__ void rmsnorm_rows_k##K##SFX(const bf16* inp, const bf16* w, bf16* out, int H,      \
                                                     float eps) {                                            \
        norm_rows_impl<K, false, EF>(const_cast<bf16*>(inp), nullptr, w, out, H, eps); }

NORM_ROWS(2, false, )
NORM_ROWS(4, false, )
NORM_ROWS(8, false, )
NORM_ROWS(2, true, _ef)
NORM_ROWS(4, true, _ef)
NORM_ROWS(8, true, _ef)
extern "C" __global__ void add_rmsnorm_rows_k4_sw(bf16* residual, const bf16* delta, const bf16* w, bf16* out, int H,
                                                  float eps) {
    norm_rows_impl<4, true, false, false>(residual, delta, w, out, H, eps);
}

// The same with quantize_fp8 of out fused (elementwise.cu's add_rmsnorm_q / rmsnorm_q: group 128 or H): xq [rows, H]
// e4m3, xs [rows, groups]; `_qonly`: out is not written.
#define NORM_ROWS_Q(K, QO, SFX)                                                                              \
    extern "C" __global__ void add_rmsnorm_rows_k##K##SFX(bf16* residual, const bf16* delta, const bf16* w,  \
                                                         bf16* out, e4m3* xq, float* xs, int H, float eps,   \
                                                         int group) {                                        \
        norm_rows_impl<K, true, false, true, QO>(residual, delta, w, out, H, eps, xq, xs, group); }          \
    extern "C" __global__ void rmsnorm_rows_k##K##SFX(const bf16* inp, const bf16* w, bf16* out, e4m3* xq,   \
                                                     float* xs, int H, float eps, int group) {               \
        norm_rows_impl<K, false, false, true, QO>(const_cast<bf16*>(inp), nullptr, w, out, H, eps, xq, xs,   \
                                                  group); }

NORM_ROWS_Q(2, QO_STORE, _q)
NORM_ROWS_Q(4, QO_STORE, _q)
NORM_ROWS_Q(2, QO_ONLY, _qonly)
NORM_ROWS_Q(4, QO_ONLY, _qonly)

// out[r, j] = silu(inp[r, j]) * inp[r, I + j]: one block a row, U chunks of g and of u loaded a thread before the
// first use (the same float math as silu_mul_impl).
// QO: also quantize_fp8 of out in groups of 128 (silu_mul_q's: I % 128 == 0, blockDim % 32 == 0, so a group is the
// 16 chunks of a half-warp, all in the row or all past it).
template <int U, bool EF, bool HW = true, int QO = QO_NONE>
__device__ __forceinline__ void silu_rows_impl(const bf16* __restrict__ inp, bf16* __restrict__ out, int I,
                                               e4m3* __restrict__ xq = nullptr, float* __restrict__ xs = nullptr) {
    pdl_entry();
    const int chunks = I / 8;
    const bf16* g_row = inp + (size_t)blockIdx.x * 2 * I;
    bf16* o_row = out + (size_t)blockIdx.x * I;
    for (int c0 = threadIdx.x; c0 < chunks; c0 += U * blockDim.x) {
        vec16 gv[U], uv[U];
#pragma unroll
        for (int k = 0; k < U; k++) {
            const int c = c0 + k * blockDim.x;
            if (c < chunks) { gv[k] = ld_once<EF>(g_row + 8 * c); uv[k] = ld_once<EF>(g_row + I + 8 * c); }
        }
#pragma unroll
        for (int k = 0; k < U; k++) {
            const int c = c0 + k * blockDim.x;
            if (c < chunks) {
                float g[8], u[8];
                unpack8(gv[k], g); unpack8(uv[k], u);
#pragma unroll
                for (int i = 0; i < 8; i++) g[i] = silu(g[i]) * u[i];
                if constexpr (QO == QO_NONE) {
                    st16(o_row + 8 * c, pack8_as<HW>(g));
                } else {
                    const vec16 o = pack8_as<HW>(g);
                    if (QO == QO_STORE) st16(o_row + 8 * c, o);
                    unpack8(o, g);
                    float a = 0.f;
#pragma unroll
                    for (int i = 0; i < 8; i++) a = fmaxf(a, fabsf(g[i]));
                    const float sx = group128_scale(a, 0xffffu << (threadIdx.x & 16));
                    *reinterpret_cast<uint2*>(xq + (size_t)blockIdx.x * I + 8 * c) = e4m3x8_div(g, sx);
                    if ((c & 15) == 0) xs[(size_t)blockIdx.x * (I >> 7) + (c >> 4)] = sx;
                }
            }
        }
    }
}

#define SILU_ROWS(U, EF, SFX)                                                                                \
    extern "C" __global__ void silu_mul_rows_u##U##SFX(const bf16* inp, bf16* out, int I) {                  \
        silu_rows_impl<U, EF>(inp, out, I); }

SILU_ROWS(2, false, )
SILU_ROWS(3, false, )
SILU_ROWS(6, false, )
SILU_ROWS(2, true, _ef)
SILU_ROWS(3, true, _ef)
SILU_ROWS(6, true, _ef)
extern "C" __global__ void silu_mul_rows_u3_sw(const bf16* inp, bf16* out, int I) {
    silu_rows_impl<3, false, false>(inp, out, I);
}

// The same with quantize_fp8 of out fused (silu_mul_q): xq [rows, I] e4m3, xs [rows, I / 128]; `_qonly`: out is not
// written.
#define SILU_ROWS_Q(U, QO, SFX)                                                                              \
    extern "C" __global__ void silu_mul_rows_u##U##SFX(const bf16* inp, bf16* out, e4m3* xq, float* xs,     \
                                                      int I) {                                               \
        silu_rows_impl<U, false, true, QO>(inp, out, I, xq, xs); }

SILU_ROWS_Q(3, QO_STORE, _q)
SILU_ROWS_Q(3, QO_ONLY, _qonly)

// quantize_fp8 (gemv_fp8.cu's) of rows of K bf16 (K % 8 == 0), one block a row, KC 16-byte chunks a lane loaded
// before any use: out [rows, K] e4m3, scale [rows, groups] per group of 128 or of the row (group == K).
template <int KC>
__device__ __forceinline__ void quantize_rows_impl(const bf16* __restrict__ X, e4m3* __restrict__ out,
                                                   float* __restrict__ scale, int K, int group) {
    pdl_entry();
    __shared__ float scratch[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const size_t row = (size_t)blockIdx.x * K;
    vec16 v[KC];
#pragma unroll
    for (int j = 0; j < KC; j++) {
        const int c = ((warp + j * nw) * 32 + lane) * 8;
        if (c < K) v[j] = ld16(X + row + c);
    }
    quantize_row_chunks<KC>(v, K, group, out + row, scale + (size_t)blockIdx.x * ((K + group - 1) / group), scratch);
}

#define QUANTIZE_ROWS(KC)                                                                                    \
    extern "C" __global__ void quantize_fp8_rows_k##KC(const bf16* X, e4m3* out, float* scale, int K,        \
                                                      int group) {                                           \
        quantize_rows_impl<KC>(X, out, scale, K, group); }

QUANTIZE_ROWS(2)
QUANTIZE_ROWS(4)

// QK-norm + RoPE + KV write, one block a row: the row's (nh + 2 nkv) heads and its cos / sin rows come in through
// shared memory with 16-byte loads (dynamic smem: (nh + 2 nkv) * HD bf16 + HD floats), one warp a q / k head computes exactly as qk_rope_impl
// (qk_norm_rope_head, lane + 32 e), and 16-byte stores write q, k and v (v through f2bf: NaN made canonical, as
// qk_rope_impl's copy does).
// KVT e4m3 (the _f8kv kernels): an FP8 cache, each k / v chunk divided by k_scale / v_scale (kv_fp8.cuh).
template <int HD, bool EF, typename KVT = bf16>
__device__ __forceinline__ void qk_rope_rows_impl(const bf16* __restrict__ qkv, const int* __restrict__ positions,
                                                  const int* __restrict__ slot_mapping,
                                                  const bf16* __restrict__ q_norm, const bf16* __restrict__ k_norm,
                                                  const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                                  bf16* __restrict__ q_out, KVT* __restrict__ kv_layer, int nh,
                                                  int nkv, float eps, int num_slots, float k_scale = 1.f,
                                                  float v_scale = 1.f) {
    pdl_entry();
    extern __shared__ vec16 row_smem[];
    constexpr int E = HD / 32;
    const int r = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int chunks = (nh + 2 * nkv) * HD / 8, qc = nh * HD / 8, kc = nkv * HD / 8;
    const int pos = positions[r], slot = slot_mapping[r];
    const vec16* src = reinterpret_cast<const vec16*>(qkv + (size_t)r * (nh + 2 * nkv) * HD);
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) cp_async_once<EF>(row_smem + c, src + c);
    vec16* tables = row_smem + chunks;                         // cos then sin of pos: HD / 2 floats each
    for (int i = threadIdx.x; i < HD / 4; i += blockDim.x)
        cp_async_once<false>(tables + i, (i < HD / 8 ? cos_t : sin_t) + (size_t)pos * (HD / 2) + (i % (HD / 8)) * 4);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    bf16* sm = reinterpret_cast<bf16*>(row_smem);
    const float* cos_s = reinterpret_cast<const float*>(tables);
    for (int head = warp; head < nh + nkv; head += nwarps) {
        if (head >= nh && slot < 0) continue;
        float x[E], cs[E / 2], sn[E / 2], y[E];
#pragma unroll
        for (int e = 0; e < E; e++) x[e] = bf2f(sm[head * HD + lane + 32 * e]);
        rope_load<HD>(cos_s, cos_s + HD / 2, 0, lane, cs, sn);
        qk_norm_rope_head<HD>(x, head < nh ? q_norm : k_norm, cs, sn, eps, lane, y);
#pragma unroll
        for (int e = 0; e < E; e++) sm[head * HD + lane + 32 * e] = f2bf(y[e]);
    }
    __syncthreads();
    KVT* k_dst = kv_layer + (size_t)slot * nkv * HD;
    KVT* v_dst = kv_layer + ((size_t)num_slots + slot) * nkv * HD;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        vec16 v = row_smem[c];
        if (c < qc) {
            st16(q_out + (size_t)r * nh * HD + 8 * c, v);
        } else if (KvF8<KVT>::value && slot >= 0) {
            const bool is_k = c < qc + kc;
            *reinterpret_cast<uint2*>((is_k ? k_dst + 8 * (c - qc) : v_dst + 8 * (c - qc - kc))) =
                kv_chunk_e4m3(v, is_k ? k_scale : v_scale);
        } else if (slot >= 0) {
            if (c < qc + kc) {
                st16(reinterpret_cast<bf16*>(k_dst) + 8 * (c - qc), v);
            } else {
                v.x = pack2(bflo(v.x), bfhi(v.x)); v.y = pack2(bflo(v.y), bfhi(v.y));
                v.z = pack2(bflo(v.z), bfhi(v.z)); v.w = pack2(bflo(v.w), bfhi(v.w));
                st16(reinterpret_cast<bf16*>(v_dst) + 8 * (c - qc - kc), v);
            }
        }
    }
}

#define ROPE_ROWS(HD, EF, SFX)                                                                               \
    extern "C" __global__ void qk_norm_rope_cache_rows##SFX##_hd##HD(                                        \
        const bf16* qkv, const int* positions, const int* slot_mapping, const bf16* q_norm,                  \
        const bf16* k_norm, const float* cos_t, const float* sin_t, bf16* q_out, bf16* kv_layer,             \
        int nh, int nkv, float eps, int num_slots) {                                                         \
        qk_rope_rows_impl<HD, EF>(qkv, positions, slot_mapping, q_norm, k_norm, cos_t, sin_t, q_out,         \
                                  kv_layer, nh, nkv, eps, num_slots); }

ROPE_ROWS(64, false, )
ROPE_ROWS(128, false, )
ROPE_ROWS(256, false, )
ROPE_ROWS(64, true, _ef)
ROPE_ROWS(128, true, _ef)
ROPE_ROWS(256, true, _ef)

// qk_norm_rope_cache_rows_f8kv_hdHD: the same into an FP8 cache.
#define ROPE_ROWS_F8KV(HD)                                                                                   \
    extern "C" __global__ void qk_norm_rope_cache_rows_f8kv_hd##HD(                                          \
        const bf16* qkv, const int* positions, const int* slot_mapping, const bf16* q_norm,                  \
        const bf16* k_norm, const float* cos_t, const float* sin_t, bf16* q_out, e4m3* kv_layer,             \
        int nh, int nkv, float eps, int num_slots, float k_scale, float v_scale) {                           \
        qk_rope_rows_impl<HD, false, e4m3>(qkv, positions, slot_mapping, q_norm, k_norm, cos_t, sin_t,       \
                                           q_out, kv_layer, nh, nkv, eps, num_slots, k_scale, v_scale); }

ROPE_ROWS_F8KV(64)
ROPE_ROWS_F8KV(128)
ROPE_ROWS_F8KV(256)
