// Paged decode attention, split over the KV length, GQA inside the block (no repeat_kv). No plan routes to it since
// the fused few-seq kernel (attention_decode_tc.cu attn_decode_fused_*); kept as the benchmark's baseline.
// Block (seq i, kv head, split s) reads keys [s*P, s*P + P) of seq i once for all G = nh / nkv query heads
// (P = P_KEYS; the P argument must equal it).
// A seq may hold n >= 1 query rows (query j at position Lc - n + j); each row gets its own partial.
// Partials: part_o [T, nh, S, HD] (unnormalized sum p*v), part_ml [T, nh, S, 2] (max, sum of p). The last split
// block of a (seq, kv head) to finish (counter in `counters`, reset by that block) combines splits 0 .. pos / P in
// split order (deterministic) and writes out [T, nh * HD]; split-0 blocks zero the rows covered by no seq.
#include "common.cuh"

// P_KEYS (keys per split = threads per block: one key per thread in the score phase) and G_MAX come from
// plan/kernel_constants.py as NVRTC -D options.
#define DEC_THREADS P_KEYS

template <int HD>
__device__ __forceinline__ void attn_decode_impl(
        const bf16* __restrict__ q, const bf16* __restrict__ kv_layer, const int* __restrict__ qsl,
        const int* __restrict__ seq_lens, const int* __restrict__ block_tables, float* __restrict__ part_o,
        float* __restrict__ part_ml, int* __restrict__ counters, bf16* __restrict__ out, int T, int nh, int nkv,
        int block_size, int max_blocks, int num_slots, float scale, int S) {
    pdl_entry();
    constexpr int DCH = HD / 8, KG = DEC_THREADS / DCH;     // PV phase: 16-byte d-chunks x key groups
    __shared__ __align__(16) float qs[G_MAX][HD];
    __shared__ float sc[G_MAX][P_KEYS];
    __shared__ int slots[P_KEYS];
    __shared__ __align__(16) float red[KG][G_MAX][HD];
    __shared__ float mls[G_MAX][2];
    __shared__ int is_last;

    const int i = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int G = nh / nkv;
    if (s == 0) {
        for (int r = qsl[gridDim.x] + i; r < T; r += gridDim.x)
            for (int c = tid; c < G * HD; c += DEC_THREADS) out[((size_t)r * nh + kvh * G) * HD + c] = 0;
    }
    const int n = qsl[i + 1] - qsl[i], Lc = seq_lens[i], k0 = s * P_KEYS;
    if (n <= 0 || k0 >= Lc) return;
    const size_t kv_stride = (size_t)nkv * HD;               // elements per slot
    const bf16* kbase = kv_layer + (size_t)kvh * HD;
    const bf16* vbase = kv_layer + (size_t)num_slots * kv_stride + (size_t)kvh * HD;
    const int kend_seq = min(k0 + P_KEYS, Lc);
    const int active = (Lc + P_KEYS - 1) / P_KEYS;              // splits holding keys of this seq
    if (tid < kend_seq - k0) {
        int p = k0 + tid;
        slots[tid] = block_tables[(size_t)i * max_blocks + p / block_size] * block_size + p % block_size;
    }
    const int dc = tid % DCH, kg = tid / DCH;

    for (int j = 0; j < n; j++) {
        const int row = qsl[i] + j, pos = Lc - n + j;
        const int len = min(kend_seq, pos + 1) - k0;           // keys of this split this query sees
        __syncthreads();
        for (int c = tid; c < G * HD; c += DEC_THREADS) {
            int g = c / HD, d = c % HD;
            qs[g][d] = bf2f(q[((size_t)row * nh + kvh * G + g) * HD + d]);
        }
        __syncthreads();
        if (tid < len) {
            const bf16* kp = kbase + (size_t)slots[tid] * kv_stride;
            vec16 kv[DCH];
#pragma unroll
            for (int c = 0; c < DCH; c++) kv[c] = ld16(kp + c * 8);
            float acc[G_MAX];
#pragma unroll
            for (int g = 0; g < G_MAX; g++) acc[g] = 0.f;
#pragma unroll
            for (int c = 0; c < DCH; c++) {
                float kf[8]; unpack8(kv[c], kf);
#pragma unroll
                for (int g = 0; g < G_MAX; g++) {
                    if (g < G) {
                        float4 qa = *reinterpret_cast<const float4*>(&qs[g][c * 8]);
                        float4 qb = *reinterpret_cast<const float4*>(&qs[g][c * 8 + 4]);
                        acc[g] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3]
                                + qb.x * kf[4] + qb.y * kf[5] + qb.z * kf[6] + qb.w * kf[7];
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < G_MAX; g++) if (g < G) sc[g][tid] = acc[g] * scale;
        }
        __syncthreads();
        for (int g = warp; g < G; g += DEC_THREADS / 32) {
            float m = -__int_as_float(0x7f800000);
            for (int t = lane; t < len; t += 32) m = fmaxf(m, sc[g][t]);
            m = warp_max(m);
            float l = 0.f;
            for (int t = lane; t < len; t += 32) { float p = __expf(sc[g][t] - m); sc[g][t] = p; l += p; }
            l = warp_sum(l);
            if (lane == 0) { mls[g][0] = m; mls[g][1] = l; }
        }
        __syncthreads();
        float acc[G_MAX][8];
#pragma unroll
        for (int g = 0; g < G_MAX; g++)
#pragma unroll
            for (int e = 0; e < 8; e++) acc[g][e] = 0.f;
        for (int t0 = kg; t0 < len; t0 += 4 * KG) {
            vec16 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                int t = t0 + u * KG;
                if (t < len) v[u] = ld16(vbase + (size_t)slots[t] * kv_stride + dc * 8);
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                int t = t0 + u * KG;
                if (t < len) {
                    float vf[8]; unpack8(v[u], vf);
#pragma unroll
                    for (int g = 0; g < G_MAX; g++) {
                        if (g < G) {
                            float p = sc[g][t];
#pragma unroll
                            for (int e = 0; e < 8; e++) acc[g][e] += p * vf[e];
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int g = 0; g < G_MAX; g++) {
            if (g < G) {
                *reinterpret_cast<float4*>(&red[kg][g][dc * 8]) = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
                *reinterpret_cast<float4*>(&red[kg][g][dc * 8 + 4]) = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
            }
        }
        __syncthreads();
        for (int c = tid; c < G * HD; c += DEC_THREADS) {
            int g = c / HD, dd = c % HD;
            float o = 0.f;
#pragma unroll
            for (int h = 0; h < KG; h++) o += red[h][g][dd];
            if (active == 1) {                                  // one split: normalize here, no partials
                out[((size_t)row * nh + kvh * G + g) * HD + dd] = f2bf(mls[g][1] > 0.f ? o / mls[g][1] : 0.f);
                continue;
            }
            size_t idx = ((size_t)row * nh + kvh * G + g) * S + s;
            part_o[idx * HD + dd] = o;
            if (dd == 0) { part_ml[idx * 2] = mls[g][0]; part_ml[idx * 2 + 1] = mls[g][1]; }
        }
    }
    if (active == 1) return;

    __threadfence();
    __syncthreads();
    if (tid == 0) {
        const int prev = atomicAdd(&counters[i * nkv + kvh], 1);
        is_last = prev == active - 1;
        if (is_last) counters[i * nkv + kvh] = 0;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // Last block: combine the splits of each of its rows. Split weights exp(m_z - M) go to smem (red is free now).
    constexpr int S_CAP = KG * HD;                               // splits per head that fit: S <= S_CAP
    float* wbuf = &red[0][0][0];
    __shared__ float Ls[G_MAX];
    for (int j = 0; j < n; j++) {
        const int row = qsl[i] + j, pos = Lc - n + j, ns = pos / P_KEYS + 1;
        __syncthreads();
        for (int g = warp; g < G; g += DEC_THREADS / 32) {
            const size_t base = ((size_t)row * nh + kvh * G + g) * S;
            float M = -__int_as_float(0x7f800000);
            for (int z = lane; z < ns; z += 32) M = fmaxf(M, __ldcg(part_ml + (base + z) * 2));
            M = warp_max(M);
            float L = 0.f;
            for (int z = lane; z < ns; z += 32) {
                float m = __ldcg(part_ml + (base + z) * 2);
                float w = m == -__int_as_float(0x7f800000) ? 0.f : __expf(m - M);
                wbuf[g * S_CAP + z] = w;
                L += w * __ldcg(part_ml + (base + z) * 2 + 1);
            }
            L = warp_sum(L);
            if (lane == 0) Ls[g] = L;
        }
        __syncthreads();
        for (int c = tid; c < G * (HD / 4); c += DEC_THREADS) {
            const int g = c / (HD / 4), d4 = (c % (HD / 4)) * 4, h = kvh * G + g;
            const float* po = part_o + ((size_t)row * nh + h) * S * HD + d4;
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
            for (int z = 0; z < ns; z++) {
                const float w = wbuf[g * S_CAP + z];
                const float4 v = __ldcg(reinterpret_cast<const float4*>(po + (size_t)z * HD));
                acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w;
            }
            const float inv = Ls[g] > 0.f ? 1.f / Ls[g] : 0.f;
            u32* dst = reinterpret_cast<u32*>(out + ((size_t)row * nh + h) * HD + d4);
            dst[0] = pack2(acc.x * inv, acc.y * inv);
            dst[1] = pack2(acc.z * inv, acc.w * inv);
        }
    }
}

#define DECODE_KERNEL(HD)                                                                                    \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS) attn_decode_hd##HD(                            \
        const bf16* q, const bf16* kv_layer, const int* qsl, const int* seq_lens, const int* block_tables,   \
        float* part_o, float* part_ml, int* counters, bf16* out, int T, int nh, int nkv, int block_size,     \
        int max_blocks, int num_slots, float scale, int S) {                                                 \
        attn_decode_impl<HD>(q, kv_layer, qsl, seq_lens, block_tables, part_o, part_ml, counters, out, T,   \
                             nh, nkv, block_size, max_blocks, num_slots, scale, S); }

DECODE_KERNEL(64)
DECODE_KERNEL(128)
