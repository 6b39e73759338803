// Pipelined causal prefill attention over the paged KV cache, same contract as attention_prefill.cu (varlen by
// query_start_loc, queries at the end of each seq's context, GQA by indexing, seqs of < min_rows rows skipped, rows
// no seq covers zeroed). attn_prefill_w{W}m{MT}k{KT}s{S}_hd{HD}: W warps of 16 MT query rows each (MT m16 tiles
// sharing every K/V fragment), one seq and one q head a block; K/V tiles of KT keys stream through an S-deep
// cp.async ring in dynamic shared memory (S x 2 x KT x (HD + 8) bf16); K fragments by ldmatrix, V by ldmatrix.trans,
// P stays in registers (bf16 by cvt.rn.bf16x2); scale folded into exp2 (ex2.approx); o rescaled only when a row
// max moved; a warp skips the tiles after its last row and masks only those past its first.
// Grid (nh, ceil(T / (16 W MT)) + min(num_seqs, PREFILL_EXTRA_TILES)): block y takes the (seq, tile) pairs y,
// y + gridDim.y, ..., a seq's tiles in reverse (its longest rows first); every block zeroes uncovered rows r with
// r % gridDim.y == y.
// KVT e4m3 (attn_prefill_f8kv_*, an FP8 cache: kv_fp8.cuh): the ring holds e4m3 rows of HD bytes (S x 2 x KT x HD),
// each landed tile pair is converted into one bf16 tile pair after the ring (2 x KT x (HD + 8)) that the same MMA
// code reads; k_scale joins the softmax scale, v_scale the output.
#include "prefill_tiles.cuh"
#include "kv_fp8.cuh"

template <int HD, int W, int MT, int KT, int STAGES, typename KVT = bf16>
__device__ __forceinline__ void attn_prefill_pipe_impl(
        const bf16* __restrict__ q, const KVT* __restrict__ kv_layer, const int* __restrict__ qsl,
        const int* __restrict__ seq_lens, const int* __restrict__ block_tables, bf16* __restrict__ out,
        int T, int num_seqs, int nh, int nkv, int block_size, int max_blocks, int num_slots, float scale,
        int min_rows, float k_scale = 1.f, float v_scale = 1.f) {
    pdl_entry();
    constexpr bool F8 = KvF8<KVT>::value;
    constexpr int LD = HD + 8, KS = HD / 16, DT = HD / 8, NJ = KT / 8, WR = 16 * MT, BQ = W * WR, NT = W * 32;
    constexpr int TILE = KT * LD;                                // elements of one bf16 K (or V) tile
    constexpr int EPC = 16 / (int)sizeof(KVT), ROW = F8 ? HD : LD * 2, SLOT = 2 * KT * ROW;   // bytes
    static_assert(KT * (HD / EPC) % NT == 0 && KS % 2 == 0 && KT % 16 == 0, "whole copy rounds, paired k-steps");
    extern __shared__ __align__(16) unsigned char kv_smem[];     // [STAGES][K tile | V tile] (+ FP8: the bf16 pair)
    bf16* cvt = reinterpret_cast<bf16*>(kv_smem + STAGES * SLOT);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, h = blockIdx.x;
    const int covered = qsl[num_seqs];
    for (int r = covered + blockIdx.y; r < T; r += gridDim.y)
        for (int d = tid; d < HD; d += NT) out[((size_t)r * nh + h) * HD + d] = 0;

    const int kvh = h / (nh / nkv), bs_log2 = __ffs(block_size) - 1;   // block_size: a power of two (BuildConfig)
    const size_t kv_stride = (size_t)nkv * HD, v_off = (size_t)num_slots * kv_stride;
    const KVT* kv_head = kv_layer + (size_t)kvh * HD;
    const float sl2 = scale * k_scale * 1.4426950408889634f, NEG_INF = -__int_as_float(0x7f800000);
    // The block's (seq, tile) pairs: y, y + gridDim.y, ... (a grid of the prompt's tiles + PREFILL_EXTRA_TILES).
    __shared__ int pair_b;
    if (tid == 0) pair_b = blockIdx.y;
    __syncthreads();
    for (int seq, tile; next_pair<NT>(qsl, num_seqs, min_rows, BQ, &pair_b, gridDim.y, seq, tile);) {
        const int n = qsl[seq + 1] - qsl[seq], Lc = seq_lens[seq], pos0 = Lc - n;
        const int q0 = ((n + BQ - 1) / BQ - 1 - tile) * BQ;          // first query (within seq) of this tile
        const int max_pos = pos0 + min(q0 + BQ, n) - 1;

        // This warp's rows: m tile mt, half e (lane / 4 and lane / 4 + 8); rows past the seq's end repeat its last row
        // (results dropped); a warp with no row in the seq computes nothing (wpos_last -1).
        const int w0 = q0 + warp * WR;
        const int wpos_first = pos0 + min(w0, n - 1), wpos_last = w0 < n ? pos0 + min(w0 + WR - 1, n - 1) : -1;
        const int row_l = w0 + (lane >> 2);                          // row of m tile mt, half e: row_l + 16 mt + 8 e
        u32 qa[MT][KS][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            const size_t ra = qsl[seq] + min(row_l + mt * 16, n - 1), rb = qsl[seq] + min(row_l + mt * 16 + 8, n - 1);
            const u32* qra = reinterpret_cast<const u32*>(q + (ra * nh + h) * HD);
            const u32* qrb = reinterpret_cast<const u32*>(q + (rb * nh + h) * HD);
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                const int c = ks * 8 + (lane & 3);
                qa[mt][ks][0] = qra[c]; qa[mt][ks][1] = qrb[c]; qa[mt][ks][2] = qra[c + 4]; qa[mt][ks][3] = qrb[c + 4];
            }
        }
        const int* bt = block_tables + (size_t)seq * max_blocks;
        auto load_tile = [&](int kt) {                               // keys past max_pos are zero-filled
            unsigned char* ks = kv_smem + (kt % STAGES) * SLOT;
#pragma unroll
            for (int i = 0; i < KT * (HD / EPC) / NT; i++) {
                const int c = tid + i * NT, kr = c / (HD / EPC), kc = (c % (HD / EPC)) * EPC, p = kt * KT + kr;
                const bool ok = p <= max_pos;
                const size_t slot = ok ? paged_slot(bt, p, bs_log2) : 0u;
                const KVT* kp = kv_head + slot * kv_stride + kc;
                cp_async16(ks + kr * ROW + kc * (int)sizeof(KVT), kp, ok ? 16 : 0);
                cp_async16(ks + (KT + kr) * ROW + kc * (int)sizeof(KVT), kp + v_off, ok ? 16 : 0);
            }
        };
        float o[MT][DT][4], m_r[MT][2], l_r[MT][2];                  // m_r: running max in log2 units (scaled)
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
#pragma unroll
            for (int t = 0; t < DT; t++) { o[mt][t][0] = o[mt][t][1] = o[mt][t][2] = o[mt][t][3] = 0.f; }
            m_r[mt][0] = m_r[mt][1] = NEG_INF;
            l_r[mt][0] = l_r[mt][1] = 0.f;
        }

        const int ntiles = max_pos / KT + 1;
#pragma unroll
        for (int st = 0; st < STAGES - 1; st++) {
            if (st < ntiles) load_tile(st);
            cp_async_commit();
        }
        for (int kt = 0; kt < ntiles; kt++) {
            cp_async_wait<STAGES - 2>();                             // tile kt landed (this thread's copies)
            __syncthreads();                                         // ... every thread's; tile kt - 1 is free
            if (kt + STAGES - 1 < ntiles) load_tile(kt + STAGES - 1);
            cp_async_commit();
            const bf16* Ks = reinterpret_cast<const bf16*>(kv_smem + (kt % STAGES) * SLOT);
            if constexpr (F8) {                                      // e4m3 pair -> cvt (free: all passed tile kt - 1)
                kv_tile_to_bf16<2 * KT, HD, LD, NT>(reinterpret_cast<const e4m3*>(Ks), cvt);
                __syncthreads();
                Ks = cvt;
            }
            const int kb = kt * KT;
            if (kb > wpos_last) continue;                            // every key of the tile is after this warp's rows
            const bf16* Vs = Ks + TILE;

            float s[MT][NJ][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int j = 0; j < NJ; j++) { s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f; }
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                const bf16* kr = Ks + (j * 8 + (lane & 7)) * LD + (lane >> 3) * 8;
#pragma unroll
                for (int ks = 0; ks < KS; ks += 2) {
                    u32 b0, b1, b2, b3;
                    ldmatrix_x4(b0, b1, b2, b3, kr + ks * 16);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma_bf16(s[mt][j], qa[mt][ks][0], qa[mt][ks][1], qa[mt][ks][2], qa[mt][ks][3], b0, b1);
                        mma_bf16(s[mt][j], qa[mt][ks + 1][0], qa[mt][ks + 1][1], qa[mt][ks + 1][2], qa[mt][ks + 1][3],
                                 b2, b3);
                    }
                }
            }
            const bool diag = kb + KT - 1 > wpos_first;              // the diagonal: mask keys after each row
            u32 pf[MT][KT / 16][4];                                  // P as bf16 A fragments
            float corr[MT][2];
            bool moved = false;
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int lim = pos0 + min(row_l + mt * 16 + e * 8, n - 1) - kb - (lane & 3) * 2;
                    float mx = NEG_INF;
#pragma unroll
                    for (int j = 0; j < NJ; j++) {
#pragma unroll
                        for (int c = 0; c < 2; c++) {
                            float& v = s[mt][j][2 * e + c];
                            if (diag && j * 8 + c > lim) v = NEG_INF;
                            mx = fmaxf(mx, v);
                        }
                    }
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float nm = fmaxf(m_r[mt][e], mx * sl2);    // finite: key 0 is always visible
                    corr[mt][e] = nm != m_r[mt][e] ? ex2_approx(m_r[mt][e] - nm) : 1.f;
                    moved |= nm != m_r[mt][e];
                    m_r[mt][e] = nm;
                    float sum = 0.f;
#pragma unroll
                    for (int j = 0; j < NJ; j++) {
                        const float p0 = ex2_approx(fmaf(s[mt][j][2 * e], sl2, -nm));
                        const float p1 = ex2_approx(fmaf(s[mt][j][2 * e + 1], sl2, -nm));
                        sum += p0 + p1;
                        pf[mt][j / 2][(j & 1) * 2 + e] = pack2_rn(p0, p1);
                    }
                    l_r[mt][e] = l_r[mt][e] * corr[mt][e] + sum;
                }
            }
            if (__any_sync(0xffffffffu, moved)) {                    // rescale o only when some row's max moved
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
#pragma unroll
                    for (int t = 0; t < DT; t++) {
                        o[mt][t][0] *= corr[mt][0]; o[mt][t][1] *= corr[mt][0];
                        o[mt][t][2] *= corr[mt][1]; o[mt][t][3] *= corr[mt][1];
                    }
            }

            const int qm = lane >> 3, r8 = lane & 7;
#pragma unroll
            for (int kk = 0; kk < KT / 16; kk++) {
                const bf16* vr = Vs + (kk * 16 + r8 + (qm & 1) * 8) * LD + (qm >> 1) * 8;
#pragma unroll
                for (int t = 0; t < DT; t += 2) {
                    u32 b0, b1, b2, b3;
                    ldmatrix_x4_trans(b0, b1, b2, b3, vr + t * 8);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma_bf16(o[mt][t], pf[mt][kk][0], pf[mt][kk][1], pf[mt][kk][2], pf[mt][kk][3], b0, b1);
                        mma_bf16(o[mt][t + 1], pf[mt][kk][0], pf[mt][kk][1], pf[mt][kk][2], pf[mt][kk][3], b2, b3);
                    }
                }
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float l = l_r[mt][e];
                l += __shfl_xor_sync(0xffffffffu, l, 1);
                l += __shfl_xor_sync(0xffffffffu, l, 2);
                const float inv = v_scale / l;
                const int r = row_l + mt * 16 + e * 8;
                if (r >= n) continue;
                bf16* orow = out + ((size_t)(qsl[seq] + r) * nh + h) * HD + (lane & 3) * 2;
#pragma unroll
                for (int t = 0; t < DT; t++)
                    *reinterpret_cast<u32*>(orow + t * 8) = pack2(o[mt][t][2 * e] * inv, o[mt][t][2 * e + 1] * inv);
            }
        }
    }
}

#define PREFILL_PIPE_KERNEL(HD, W, MT, KT, S)                                                                  \
    extern "C" __global__ void __launch_bounds__(W * 32) attn_prefill_w##W##m##MT##k##KT##s##S##_hd##HD(       \
        const bf16* q, const bf16* kv_layer, const int* qsl, const int* seq_lens, const int* block_tables,   \
        bf16* out, int T, int num_seqs, int nh, int nkv, int block_size, int max_blocks, int num_slots,      \
        float scale, int min_rows) {                                                                         \
        attn_prefill_pipe_impl<HD, W, MT, KT, S>(q, kv_layer, qsl, seq_lens, block_tables, out, T, num_seqs,  \
                                                 nh, nkv, block_size, max_blocks, num_slots, scale, min_rows); }

PREFILL_PIPE_KERNEL(64, 8, 1, 64, 2)
PREFILL_PIPE_KERNEL(64, 4, 2, 32, 2)
PREFILL_PIPE_KERNEL(128, 8, 1, 64, 2)
PREFILL_PIPE_KERNEL(128, 8, 1, 64, 3)
PREFILL_PIPE_KERNEL(128, 4, 1, 64, 2)
PREFILL_PIPE_KERNEL(128, 4, 2, 32, 2)
PREFILL_PIPE_KERNEL(128, 4, 2, 32, 3)
PREFILL_PIPE_KERNEL(128, 8, 2, 32, 2)
PREFILL_PIPE_KERNEL(128, 4, 2, 16, 3)
PREFILL_PIPE_KERNEL(128, 4, 2, 16, 4)

// attn_prefill_f8kv_wWmMTkKTsS_hdHD: the same over an FP8 cache. Dynamic shared memory: S x 2 x KT x HD bytes (the
// e4m3 ring) + 2 x KT x (HD + 8) bf16 (plan.attention_plan.prefill_attn_launch).
#define PREFILL_PIPE_F8KV_KERNEL(HD, W, MT, KT, S)                                                             \
    extern "C" __global__ void __launch_bounds__(W * 32) attn_prefill_f8kv_w##W##m##MT##k##KT##s##S##_hd##HD(  \
        const bf16* q, const e4m3* kv_layer, const int* qsl, const int* seq_lens, const int* block_tables,   \
        bf16* out, int T, int num_seqs, int nh, int nkv, int block_size, int max_blocks, int num_slots,      \
        float scale, int min_rows, float k_scale, float v_scale) {                                           \
        attn_prefill_pipe_impl<HD, W, MT, KT, S, e4m3>(q, kv_layer, qsl, seq_lens, block_tables, out, T,     \
                                                       num_seqs, nh, nkv, block_size, max_blocks, num_slots, \
                                                       scale, min_rows, k_scale, v_scale); }

PREFILL_PIPE_F8KV_KERNEL(64, 8, 1, 64, 2)
PREFILL_PIPE_F8KV_KERNEL(128, 8, 1, 64, 2)
PREFILL_PIPE_F8KV_KERNEL(128, 8, 1, 64, 3)
PREFILL_PIPE_F8KV_KERNEL(128, 4, 2, 16, 4)
