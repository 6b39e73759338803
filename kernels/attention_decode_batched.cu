// Paged decode attention for batches: one query row per sequence, all GQ = nh / nkv query heads of a kv head in
// one block, the keys of a sequence cut into `gridDim.z` splits of whole 64-key tiles, each split streamed tile by
// tile through a 2-stage cp.async ring in shared memory with an online softmax (flash-decoding).
// Sequence i (query row qsl[i], context Lc = seq_lens[i]) uses up to gridDim.z splits of whole tiles
// (attention_split.cuh); rows with qsl[i+1] - qsl[i] != 1 are left to other kernels. One split: the
// block writes the normalized output. Several: partials part_o [num_seqs, nh, S, HD] / part_ml [.., 2]
// (S = gridDim.z) and the last split block to finish (counter, reset by it) combines them in split order.
// Split-0 blocks zero the output rows covered by no sequence.
#include "attention_split.cuh"

#define BD_THREADS 128

template <int HD, int TILE>
struct BdShape {
    static constexpr int DCH = HD / 8;                  // 16-byte units per K/V row
    static constexpr int TPK = BD_THREADS / TILE;       // score phase: threads per key
    static constexpr int UPT = DCH / TPK;               // units per thread in the score phase
    static constexpr int KG = BD_THREADS / DCH;         // PV phase: key groups (thread = d-chunk x key group)
    static constexpr int KPT = TILE / KG;               // keys per thread per tile in the PV phase
    static constexpr int STAGE_ELEMS = 2 * TILE * HD;   // K tile then V tile, bf16
    static constexpr int SWZ_KEYS = 8 / TPK;            // keys sharing one 8-thread load phase
};

// Unit u (16 bytes) of key k sits at u ^ swz(k): the TPK threads of a key and the 8 / TPK keys of one
// 8-thread load phase hit 8 distinct 16-byte bank groups in the score phase.
template <int HD, int TILE>
__device__ __forceinline__ int bd_swz(int k) {
    using S = BdShape<HD, TILE>;
    return (k & (S::SWZ_KEYS - 1)) * S::TPK;
}

template <int HD, int TILE>
__device__ __forceinline__ void bd_issue(bf16* stage, const bf16* kbase, const bf16* vbase, size_t kv_stride,
                                         const int* bt, int block_size, int k0, int kend) {
    using S = BdShape<HD, TILE>;
#pragma unroll
    for (int j = 0; j < TILE * S::DCH / BD_THREADS; j++) {
        const int idx = threadIdx.x + j * BD_THREADS, key = idx / S::DCH, u = idx % S::DCH, p = k0 + key;
        const bool ok = p < kend;
        const size_t slot = ok ? (size_t)bt[p / block_size] * block_size + p % block_size : 0;
        const int pu = u ^ bd_swz<HD, TILE>(key);
        cp_async16(stage + key * HD + pu * 8, kbase + slot * kv_stride + u * 8, ok ? 16 : 0);
        cp_async16(stage + TILE * HD + key * HD + u * 8, vbase + slot * kv_stride + u * 8, ok ? 16 : 0);
    }
}

template <int HD, int GM, int TILE, int STAGES>
__device__ __forceinline__ void attn_decode_batched_impl(
        const bf16* __restrict__ q, const bf16* __restrict__ kv_layer, const int* __restrict__ qsl,
        const int* __restrict__ seq_lens, const int* __restrict__ block_tables, float* __restrict__ part_o,
        float* __restrict__ part_ml, int* __restrict__ counters, bf16* __restrict__ out, int T, int nh, int nkv,
        int block_size, int max_blocks, int num_slots, float scale) {
    using S = BdShape<HD, TILE>;
    static_assert(S::TPK >= 1 && S::TPK <= 8 && S::KPT >= 1 && TILE % 32 == 0, "tile shape");
    pdl_wait();                      // no trigger: a successor launched under PDL starts at its end, as before
    extern __shared__ __align__(16) unsigned char bd_smem[];
    bf16* stages = reinterpret_cast<bf16*>(bd_smem);                  // [STAGES][2][TILE][HD]
    __shared__ __align__(16) float qs[GM][HD];
    __shared__ float sc[GM][TILE];
    __shared__ float m_run[GM], l_run[GM], alpha[GM];

    const int i = blockIdx.x, kvh = blockIdx.y, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int G = nh / nkv;
    zero_uncovered_rows(out, qsl, T, nh, G, HD, kvh);
    SplitRange sr;
    if (!split_range(qsl, seq_lens, i, blockIdx.z, gridDim.z, TILE, sr)) return;
    const int row = sr.row, active = sr.active, k0 = sr.k0, kend = sr.kend, ntiles = sr.ntiles;

    const size_t kv_stride = (size_t)nkv * HD;
    const bf16* kbase = kv_layer + (size_t)kvh * HD;
    const bf16* vbase = kv_layer + (size_t)num_slots * kv_stride + (size_t)kvh * HD;
    const int* bt = block_tables + (size_t)i * max_blocks;

#pragma unroll
    for (int st = 0; st < STAGES - 1; st++) {
        if (st < ntiles)
            bd_issue<HD, TILE>(stages + st * S::STAGE_ELEMS, kbase, vbase, kv_stride, bt, block_size,
                               k0 + st * TILE, kend);
        cp_async_commit();
    }
    for (int c = tid; c < G * HD; c += BD_THREADS) qs[c / HD][c % HD] = bf2f(q[((size_t)row * nh + kvh * G) * HD + c]);
    if (tid < GM) { m_run[tid] = -__int_as_float(0x7f800000); l_run[tid] = 0.f; }

    const int skey = tid / S::TPK, sh = tid % S::TPK;          // score phase
    const int dc = tid % S::DCH, kg = tid / S::DCH;            // PV phase
    float acc[GM][8];
#pragma unroll
    for (int g = 0; g < GM; g++)
#pragma unroll
        for (int e = 0; e < 8; e++) acc[g][e] = 0.f;

    for (int t = 0; t < ntiles; t++) {
        cp_async_wait<STAGES - 2>();                            // tile t has landed (this thread's copies)
        __syncthreads();                                        // ... everyone's; and tile t - 1 is consumed
        {
            const int nt = t + STAGES - 1;
            if (nt < ntiles)
                bd_issue<HD, TILE>(stages + (nt % STAGES) * S::STAGE_ELEMS, kbase, vbase, kv_stride, bt,
                                   block_size, k0 + nt * TILE, kend);
            cp_async_commit();
        }
        const bf16* ks = stages + (t % STAGES) * S::STAGE_ELEMS;
        const bf16* vs = ks + TILE * HD;
        // scores: key skey of this tile, units u = c * TPK + sh
        float dot[GM];
#pragma unroll
        for (int g = 0; g < GM; g++) dot[g] = 0.f;
#pragma unroll
        for (int c = 0; c < S::UPT; c++) {
            const int u = c * S::TPK + sh;
            float kf[8];
            unpack8(ld16(ks + skey * HD + (u ^ bd_swz<HD, TILE>(skey)) * 8), kf);
#pragma unroll
            for (int g = 0; g < GM; g++) {
                if (g < G) {
                    const float4 qa = *reinterpret_cast<const float4*>(&qs[g][u * 8]);
                    const float4 qb = *reinterpret_cast<const float4*>(&qs[g][u * 8 + 4]);
                    dot[g] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3]
                            + qb.x * kf[4] + qb.y * kf[5] + qb.z * kf[6] + qb.w * kf[7];
                }
            }
        }
        const bool valid = k0 + t * TILE + skey < kend;
#pragma unroll
        for (int g = 0; g < GM; g++) {
#pragma unroll
            for (int o = 1; o < S::TPK; o <<= 1) dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], o);
            if (g < G && sh == 0) sc[g][skey] = valid ? dot[g] * scale : -__int_as_float(0x7f800000);
        }
        __syncthreads();
        for (int g = warp; g < G; g += BD_THREADS / 32) {
            float v[TILE / 32];
            float mt = -__int_as_float(0x7f800000);
#pragma unroll
            for (int j = 0; j < TILE / 32; j++) { v[j] = sc[g][lane + 32 * j]; mt = fmaxf(mt, v[j]); }
            const float m_old = m_run[g];
            mt = warp_max(mt);
            const float mn = fmaxf(m_old, mt);
            float lt = 0.f;
#pragma unroll
            for (int j = 0; j < TILE / 32; j++) { const float pj = __expf(v[j] - mn); sc[g][lane + 32 * j] = pj; lt += pj; }
            lt = warp_sum(lt);
            __syncwarp();                                      // every lane has read m_run[g] before lane 0 writes
            if (lane == 0) {
                const float a = __expf(m_old - mn);
                alpha[g] = a;
                l_run[g] = l_run[g] * a + lt;
                m_run[g] = mn;
            }
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < GM; g++) {
            const float a = g < G ? alpha[g] : 0.f;
#pragma unroll
            for (int e = 0; e < 8; e++) acc[g][e] *= a;
        }
#pragma unroll
        for (int j = 0; j < S::KPT; j++) {
            const int kk = kg + j * S::KG;
            float vf[8];
            unpack8(ld16(vs + kk * HD + dc * 8), vf);
#pragma unroll
            for (int g = 0; g < GM; g++) {
                if (g < G) {
                    const float p = sc[g][kk];
#pragma unroll
                    for (int e = 0; e < 8; e++) acc[g][e] += p * vf[e];
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    // reduce the key groups: red [KG][GM][HD] floats in the (now idle) stage ring
    float* red = reinterpret_cast<float*>(bd_smem);
#pragma unroll
    for (int g = 0; g < GM; g++) {
        if (g < G) {
            float* r = red + ((size_t)kg * GM + g) * HD + dc * 8;
            *reinterpret_cast<float4*>(r) = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
            *reinterpret_cast<float4*>(r + 4) = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
        }
    }
    __syncthreads();
    for (int c = tid; c < G * HD; c += BD_THREADS) {
        const int g = c / HD, d = c % HD;
        float o = 0.f;
#pragma unroll
        for (int h = 0; h < S::KG; h++) o += red[((size_t)h * GM + g) * HD + d];
        store_split(part_o, part_ml, out, i, row, kvh * G + g, d, HD, nh, active, o, m_run[g], l_run[g]);
    }
    if (active == 1) return;
    combine_splits_if_last<HD, GM, false>(part_o, part_ml, counters, out, i, kvh, row, nh, nkv, active, red);
}

// attn_decode_b_tTILEsSTAGES_hdHD_gGM: kernel_build.batched_attn_launch names the (tile, stages) pair it uses.
#define DECODE_BATCHED_KERNEL(HD, GM, TILE, STAGES)                                                          \
    extern "C" __global__ void __launch_bounds__(BD_THREADS) attn_decode_b_t##TILE##s##STAGES##_hd##HD##_g##GM( \
        const bf16* q, const bf16* kv_layer, const int* qsl, const int* seq_lens, const int* block_tables,   \
        float* part_o, float* part_ml, int* counters, bf16* out, int T, int nh, int nkv, int block_size,     \
        int max_blocks, int num_slots, float scale) {                                                        \
        attn_decode_batched_impl<HD, GM, TILE, STAGES>(q, kv_layer, qsl, seq_lens, block_tables, part_o,     \
                                                       part_ml, counters, out, T, nh, nkv, block_size,       \
                                                       max_blocks, num_slots, scale); }
// 64 x 2: 64 KB of K/V tiles a block at hd 128 (3 blocks an SM); 32 x 2: 32 KB (up to 5 by registers)
DECODE_BATCHED_KERNEL(64, 4, 64, 2)
DECODE_BATCHED_KERNEL(64, 8, 64, 2)
DECODE_BATCHED_KERNEL(128, 4, 64, 2)
DECODE_BATCHED_KERNEL(128, 8, 64, 2)
DECODE_BATCHED_KERNEL(64, 4, 32, 2)
DECODE_BATCHED_KERNEL(64, 8, 32, 2)
DECODE_BATCHED_KERNEL(128, 4, 32, 2)
DECODE_BATCHED_KERNEL(128, 8, 32, 2)
