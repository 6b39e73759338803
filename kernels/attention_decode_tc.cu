// Paged decode attention for batches on the tensor cores: one query row per sequence; block (seq, kv head,
// split) puts the G = nh / nkv query heads of its kv head on the rows of m16n8k16 MMAs (rows >= G are zero), the
// keys on their columns. Keys come in tiles of 64 through a STAGES-deep cp.async ring (rows padded to HD + 8
// elements: conflict-free fragment loads); warp w owns keys [16w, 16w + 16) of every tile with its own online
// softmax (log2 domain), and the 4 warps' (o, m, l) merge once at the end. Splits and partials as in
// attention_split.cuh (m in log2 units).
// The few-seq variant (attn_decode_fused_*, decode buckets of 1-2 seqs) also does the QK-norm / RoPE / KV write of
// the step: every block normalises and rotates q of its G heads from the raw qkv row (split-0 blocks store it in
// q_out), and the block owning the new token (position seq_len - 1, the last split) computes its k / v, writes
// them to the cache at slot_mapping[row] and puts them in its tile itself (that row gets no cp.async). Its split
// count follows the context at run time (one split of all tiles up to solo_tiles, else >= min_tiles tiles a
// split; one split writes out directly). Before
// griddepcontrol.wait (programmatic dependent launch) it only reads what no kernel of the step writes (the step's
// inputs, the RoPE tables, the context's KV): block ids of its keys into shared memory, the first tiles' copies.
// KVT e4m3 (the _f8kv kernels, an FP8 cache: kv_fp8.cuh): the ring holds unpadded e4m3 rows of HD bytes (32-byte
// spans swizzled by the row: tc_span), read as 8 bytes a lane and converted in registers (e4m3 -> f16 is exact) for
// f16 MMAs: QK^T with q as f16 x 2^-4 and each k16 step's dims permuted alike on both sides (lane tig's 8 bytes of a
// 32-dim span feed two k16 steps), PV with the V fragment transposed by movmatrix and P as f16; so no staging tile,
// and a ring of the same bytes holds twice the tiles. k_scale joins the softmax scale and v_scale the output; the
// new token's k / v go to the ring and the cache as e4m3.
// HN (the _f8kvn kernels, batched, G <= 8): the heads on the n8 side instead, S^T = K Q^T (a warp's 16 keys on the
// m16 side, q the B operand) and O^T = V^T P^T (head dims on m; P^T by movmatrix of the S^T fragment): at G = 4 the
// 16-row layout is 3/4 padding, so this one takes half its MMAs, o accumulators and exponentials (128 registers: 4
// blocks an SM).
#include "attention_split.cuh"
#include "qk_rope.cuh"
#include "kv_fp8.cuh"

#define TC_THREADS 128
#define TC_TILE 64
#define TC_LAZY_LOG2 8.f    // online softmax: a row's running max (log2 units) moves when passed by more than this

// The inputs of the fused QK-norm / RoPE / KV write (FUSED kernels only).
template <typename KVT>
struct FusedRope {
    const bf16* qkv; const int* positions; const int* slot_mapping; const bf16* q_norm; const bf16* k_norm;
    const float* cos_t; const float* sin_t; bf16* q_out; KVT* kv_out; float eps; int min_tiles; int solo_tiles;
};

// Shared memory of a block (bytes): the ring of STAGES K/V tile pairs (rows of HD + 8 bf16, or HD e4m3 bytes), then
// (fused) q [16][HD + 8] bf16, the new k / v [2][HD] bf16 space (plan: attention_plan.tc_ring_smem, few_seq_smem).
template <int HD, int STAGES, typename KVT>
struct TcSmem {
    static constexpr bool F8 = KvF8<KVT>::value;
    static constexpr int LD = HD + 8, ROW = F8 ? HD : LD * 2, STAGE = 2 * TC_TILE * ROW;
    static constexpr int QS = STAGES * STAGE, KVNEW = QS + 16 * LD * 2, BTS = KVNEW + 2 * HD * 2;
};

// e4m3 rows: where 32-byte span s of ring row r lies (s ^ (r & 3); HD 64: s ^ ((r >> 1) & 1)), so the 8-byte reads
// of four rows at one span (a half warp) hit distinct banks.
template <int HD>
__device__ __forceinline__ int tc_span(int r, int s) {
    static_assert(HD % 64 == 0, "e4m3 rows of whole 64-byte pairs of spans");
    return HD >= 128 ? s ^ (r & 3) : s ^ ((r >> 1) & 1);
}
// Byte offset of 16-byte chunk u of ring row r (K rows 0..63, V rows 64..127 of a stage).
template <int HD, typename KVT>
__device__ __forceinline__ int tc_chunk(int r, int u) {
    if constexpr (KvF8<KVT>::value) return r * HD + (tc_span<HD>(r, u >> 1) << 5) + ((u & 1) << 4);
    else return r * (HD + 8) * 2 + u * 16;
}

// Tiles a split of a sequence of Lc keys holds at least: all of them (one split, no combine) when they are at
// most solo_tiles, else min_tiles.
template <typename KVT>
__device__ __forceinline__ int fused_min_tiles(const FusedRope<KVT>& fr, int Lc) {
    const int tiles = (Lc + TC_TILE - 1) / TC_TILE;
    return tiles <= fr.solo_tiles ? max(tiles, 1) : fr.min_tiles;
}

// NEW: key position newkey gets no copy; its K / V rows come from knew / vnew (null: the prologue writes them);
// bt[(p >> bs_shift) - b0] is the block of key p (block sizes are powers of two: BuildConfig). The thread's block
// ids are loaded first, all at once (keys past kend read the last key's block and copy nothing).
// stage: one ring slot (K rows, then V rows, of TcSmem::ROW bytes); 16-byte chunks of KVT elements.
template <int HD, bool NEW = false, typename KVT = bf16>
__device__ __forceinline__ void tc_issue(unsigned char* stage, const KVT* kbase, const KVT* vbase, size_t kv_stride,
                                         const int* bt, int bs_shift, int k0, int kend, int newkey = -1,
                                         const unsigned char* knew = nullptr, const unsigned char* vnew = nullptr,
                                         int b0 = 0) {
    constexpr int DCH = HD * (int)sizeof(KVT) / 16, EPC = 16 / (int)sizeof(KVT), N = TC_TILE * DCH / TC_THREADS;
    int blk[N];
#pragma unroll
    for (int j = 0; j < N; j++) blk[j] = bt[(min(k0 + (threadIdx.x + j * TC_THREADS) / DCH, kend - 1) >> bs_shift) - b0];
#pragma unroll
    for (int j = 0; j < N; j++) {
        const int idx = threadIdx.x + j * TC_THREADS, key = idx / DCH, u = idx % DCH, p = k0 + key;
        const bool ok = p < kend;
        if constexpr (NEW) {
            if (p == newkey) {
                if (knew) {
                    st16(stage + tc_chunk<HD, KVT>(key, u), ld16(knew + u * 16));
                    st16(stage + tc_chunk<HD, KVT>(TC_TILE + key, u), ld16(vnew + u * 16));
                }
                continue;
            }
        }
        const size_t slot = ((size_t)blk[j] << bs_shift) + (p & ((1 << bs_shift) - 1));
        cp_async16(stage + tc_chunk<HD, KVT>(key, u), kbase + slot * kv_stride + u * EPC, ok ? 16 : 0);
        cp_async16(stage + tc_chunk<HD, KVT>(TC_TILE + key, u), vbase + slot * kv_stride + u * EPC, ok ? 16 : 0);
    }
}

// Fused: q of the block's G heads from the raw qkv row into qs (bf16, as q_out holds it), and for the block owning
// the new token (newkey >= 0) its k / v into kv_new and the cache, and into its ring row when that tile is
// already being copied (prologue tiles). One warp per head.
// cs / sn: this lane's RoPE table entries at positions[row]; slot: slot_mapping[row].
template <int HD, int STAGES, typename KVT>
__device__ __forceinline__ void fused_qkv_rope(const FusedRope<KVT>& fr, bf16 (*qs)[HD + 8], KVT (*kv_new)[HD],
                                               unsigned char* stages, int row, int nh, int nkv, int kvh,
                                               int num_slots, int newkey, int k0, const float* cs, const float* sn,
                                               int slot, float k_scale, float v_scale) {
    constexpr int E = HD / 32, STAGE = TcSmem<HD, STAGES, KVT>::STAGE;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, G = nh / nkv;
    const bf16* src = fr.qkv + (size_t)row * (nh + 2 * nkv) * HD;
    for (int g = warp; g < G; g += TC_THREADS / 32) {
        float x[E], y[E];
#pragma unroll
        for (int e = 0; e < E; e++) x[e] = bf2f(src[(kvh * G + g) * HD + lane + 32 * e]);
        qk_norm_rope_head<HD>(x, fr.q_norm, cs, sn, fr.eps, lane, y);
#pragma unroll
        for (int e = 0; e < E; e++) {
            const bf16 b = f2bf(y[e]);
            qs[g][lane + 32 * e] = b;
            if (blockIdx.z == 0) fr.q_out[((size_t)row * nh + kvh * G + g) * HD + lane + 32 * e] = b;
        }
    }
    if (newkey < 0 || warp >= 2) return;
    const int head = warp == 0 ? nh + kvh : nh + nkv + kvh;                                  // warp 0: k, 1: v
    float x[E], y[E];
#pragma unroll
    for (int e = 0; e < E; e++) x[e] = bf2f(src[head * HD + lane + 32 * e]);
    if (warp == 0) {
        qk_norm_rope_head<HD>(x, fr.k_norm, cs, sn, fr.eps, lane, y);
    } else {
#pragma unroll
        for (int e = 0; e < E; e++) y[e] = x[e];
    }
    const int key = newkey - k0, t = key / TC_TILE, r = warp * TC_TILE + key % TC_TILE;
    unsigned char* ring = t < STAGES - 1 ? stages + t * STAGE : nullptr;
    KVT* cache = slot >= 0 ? fr.kv_out + ((size_t)warp * num_slots + slot) * nkv * HD + (size_t)kvh * HD : nullptr;
#pragma unroll
    for (int e = 0; e < E; e++) {
        KVT b;
        kv_put(&b, y[e], warp == 0 ? k_scale : v_scale);
        kv_new[warp][lane + 32 * e] = b;
        if (ring) {
            if constexpr (KvF8<KVT>::value) ring[r * HD + (tc_span<HD>(r, e) << 5) + lane] = b;
            else reinterpret_cast<KVT*>(ring + r * TcSmem<HD, STAGES, KVT>::ROW)[lane + 32 * e] = b;
        }
        if (cache) cache[lane + 32 * e] = b;
    }
}

// Lane tig's 8 e4m3 of span c (dims 32 c + 8 tig ..) of ring rows r0 and r1, as f16x2 pairs a[q] / b[q] = dims
// 32 c + 8 tig + 2 q + (0, 1) (exact).
template <int HD>
__device__ __forceinline__ void tc_rows_f16(const unsigned char* rows, int r0, int r1, int c, int tig, u32 (&a)[4],
                                            u32 (&b)[4]) {
    const uint2 w0 = *reinterpret_cast<const uint2*>(rows + r0 * HD + (tc_span<HD>(r0, c) << 5) + tig * 8);
    const uint2 w1 = *reinterpret_cast<const uint2*>(rows + r1 * HD + (tc_span<HD>(r1, c) << 5) + tig * 8);
    e4m3x4_f16x4(w0.x, a[0], a[1]);
    e4m3x4_f16x4(w0.y, a[2], a[3]);
    e4m3x4_f16x4(w1.x, b[0], b[1]);
    e4m3x4_f16x4(w1.y, b[2], b[3]);
}

// The running maxes m_a, m_b (log2 units) of a warp's two softmax rows (heads-on-m: rows ga, gb; HN: heads 2 tig,
// 2 tig + 1) move only when the tile maxes mxa, mxb pass one by more than TC_LAZY_LOG2 (else P <= 2^8: exact enough
// in f16, bf16 hi + lo and the f32 sums); then l_a, l_b and the o[0..NT) elements of each row (row a: 0 and A1, row
// b: B0 and 3) rescale to the new max. A macro over the impl's locals, so both layouts compile as written inline.
#define TC_LAZY_RESCALE(NT, A1, B0)                                                                           \
    if (__any_sync(0xffffffffu, mxa > m_a + TC_LAZY_LOG2 || mxb > m_b + TC_LAZY_LOG2)) {                      \
        const float na = fmaxf(m_a, mxa), nb = fmaxf(m_b, mxb);                                              \
        const float ca = exp2f(m_a - (na == NEG ? 0.f : na)), cb = exp2f(m_b - (nb == NEG ? 0.f : nb));      \
        m_a = na;                                                                                            \
        m_b = nb;                                                                                            \
        l_a *= ca;                                                                                           \
        l_b *= cb;                                                                                           \
        _Pragma("unroll")                                                                                    \
        for (int d = 0; d < NT; d++) { o[d][0] *= ca; o[d][A1] *= ca; o[d][B0] *= cb; o[d][3] *= cb; }       \
    }

template <int HD, int STAGES, bool FUSED = false, typename KVT = bf16, bool HN = false>
__device__ __forceinline__ void attn_decode_tc_impl(
        const bf16* __restrict__ q, const KVT* __restrict__ kv_layer, const int* __restrict__ qsl,
        const int* __restrict__ seq_lens, const int* __restrict__ block_tables, float* __restrict__ part_o,
        float* __restrict__ part_ml, int* __restrict__ counters, bf16* __restrict__ out, int T, int nh, int nkv,
        int block_size, int max_blocks, int num_slots, float scale, const FusedRope<KVT>& fr = FusedRope<KVT>{},
        float k_scale = 1.f, float v_scale = 1.f) {
    using SM = TcSmem<HD, STAGES, KVT>;
    static_assert(!HN || (SM::F8 && !FUSED), "heads on the n side: the batched e4m3 kernel");
    constexpr int LD = HD + 8, KS = HD / 16, DT = HD / 8, STAGE = SM::STAGE, GM = 16;
    constexpr int OT = HN ? HD / 16 : DT;                        // o accumulator tiles
    extern __shared__ __align__(16) unsigned char tc_smem[];
    unsigned char* stages = tc_smem;                                  // [STAGES][K, V][TC_TILE][ROW bytes]
    __shared__ float wm[4][GM], wl[4][GM];
    // fused: after the ring, this block's q heads [GM][LD], the new token's k, v [2][HD] (KVT), then the
    // block ids of its keys (as many ints as the rest of the dynamic shared memory holds)
    bf16 (*qs)[LD] = reinterpret_cast<bf16 (*)[LD]>(tc_smem + SM::QS);
    KVT (*kv_new)[HD] = reinterpret_cast<KVT (*)[HD]>(tc_smem + SM::KVNEW);
    int* bts = reinterpret_cast<int*>(tc_smem + SM::BTS);

    const int i = blockIdx.x, kvh = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int G = nh / nkv;
    if constexpr (!FUSED) {
        // batched: q and the new tokens' K / V come from the kernels before this one. Wait only, no trigger: a
        // successor launched under PDL (the TMA W8A8 o_proj of default plans) still starts at this kernel's end.
        pdl_wait();
        zero_uncovered_rows(out, qsl, T, nh, G, HD, kvh);
    }
    SplitRange sr;
    if (!split_range(qsl, seq_lens, i, blockIdx.z, gridDim.z, TC_TILE, sr,
                     FUSED ? fused_min_tiles(fr, seq_lens[i]) : SPLIT_MIN_TILES)) {
        if constexpr (FUSED) {
            pdl_entry();
            zero_uncovered_rows(out, qsl, T, nh, G, HD, kvh);
        }
        return;
    }
    const int newkey = FUSED && sr.kend == seq_lens[i] ? sr.kend - 1 : -1;

    const size_t kv_stride = (size_t)nkv * HD;
    const KVT* kbase = kv_layer + (size_t)kvh * HD;
    const KVT* vbase = kv_layer + (size_t)num_slots * kv_stride + (size_t)kvh * HD;
    const int* bt = block_tables + (size_t)i * max_blocks;
    const int bs_shift = __ffs(block_size) - 1;
    int b0 = 0;                                                  // fused: bt[(k >> bs_shift) - b0] = block of key k
    float cs[FUSED ? HD / 64 : 1], sn[FUSED ? HD / 64 : 1];
    int slot = -1;
    if constexpr (FUSED) {
        const int row = sr.row;
        slot = fr.slot_mapping[row];
        rope_load<HD>(fr.cos_t, fr.sin_t, fr.positions[row], lane, cs, sn);
        u32 smem_bytes;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_bytes));
        const int cap = (int)(smem_bytes - SM::BTS) / 4;
        const int first = sr.k0 / block_size, nblk = (sr.kend - 1) / block_size - first + 1;
        if (nblk <= cap) {
            for (int b = tid; b < nblk; b += TC_THREADS) bts[b] = bt[first + b];
            __syncthreads();
            bt = bts;
            b0 = first;
        }
    }
#pragma unroll
    for (int st = 0; st < STAGES - 1; st++) {
        if (st < sr.ntiles)
            tc_issue<HD, FUSED, KVT>(stages + st * STAGE, kbase, vbase, kv_stride, bt, bs_shift,
                                     sr.k0 + st * TC_TILE, sr.kend, newkey, nullptr, nullptr, b0);
        cp_async_commit();
    }
    if constexpr (FUSED) {
        pdl_entry();                                           // from here on: the previous kernels' outputs
        zero_uncovered_rows(out, qsl, T, nh, G, HD, kvh);
        fused_qkv_rope<HD, STAGES, KVT>(fr, qs, kv_new, stages, sr.row, nh, nkv, kvh, num_slots, newkey, sr.k0,
                                        cs, sn, slot, k_scale, v_scale);
        __syncthreads();
    }

    // A fragments of Q: rows = heads ga = lane / 4 and gb = ga + 8 (zero past G), k = head dims. e4m3 cache: f16 of
    // q x 2^-4, k16 step 2c + h's k pairs (2 tig, 2 tig + 8) = dims 32 c + 8 tig + 4 h + (0, 2) (the K reads' order).
    // HN (heads on the n side, G <= 8): q is the B operand of S^T = K Q^T, qa[ks][0] / qa[ks][2] (head ga).
    const int ga = lane >> 2, gb = ga + 8, tig = lane & 3;
    u32 qa[KS][4];
    {
        const u32* pa = reinterpret_cast<const u32*>(FUSED ? &qs[min(ga, G - 1)][0]
                                                           : q + ((size_t)sr.row * nh + kvh * G + min(ga, G - 1)) * HD);
        const u32* pb = reinterpret_cast<const u32*>(FUSED ? &qs[min(gb, G - 1)][0]
                                                           : q + ((size_t)sr.row * nh + kvh * G + min(gb, G - 1)) * HD);
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            int c0 = ks * 8 + tig, c1 = c0 + 4;                      // u32 (dim pair) indices of the two k pairs
            if constexpr (SM::F8) { c0 = (ks >> 1) * 16 + tig * 4 + (ks & 1) * 2; c1 = c0 + 1; }
            qa[ks][0] = ga < G ? pa[c0] : 0u;
            qa[ks][1] = gb < G ? pb[c0] : 0u;
            qa[ks][2] = ga < G ? pa[c1] : 0u;
            qa[ks][3] = gb < G ? pb[c1] : 0u;
            if constexpr (SM::F8) {
#pragma unroll
                for (int e = 0; e < 4; e++) qa[ks][e] = bf16x2_f16x2_scaled(qa[ks][e]);
            }
        }
    }
    const float sl2 = scale * k_scale * 1.4426950408889634f * (SM::F8 ? FP8_F16_UNSCALE : 1.f);
    const float NEG = -__int_as_float(0x7f800000);
    float o[OT][4];
#pragma unroll
    for (int t = 0; t < OT; t++) { o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f; }
    float m_a = NEG, m_b = NEG, l_a = 0.f, l_b = 0.f;
    const int qm = lane >> 3, r8 = lane & 7;

    for (int t = 0; t < sr.ntiles; t++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();                                        // tile t landed; tile t - 1 consumed by all
        {
            const int nt = t + STAGES - 1;
            if (nt < sr.ntiles)
                tc_issue<HD, FUSED, KVT>(stages + (nt % STAGES) * STAGE, kbase, vbase, kv_stride, bt, bs_shift,
                                         sr.k0 + nt * TC_TILE, sr.kend, newkey,
                                         reinterpret_cast<const unsigned char*>(kv_new[0]),
                                         reinterpret_cast<const unsigned char*>(kv_new[FUSED ? 1 : 0]), b0);
            cp_async_commit();
        }
        const unsigned char* tile = stages + (t % STAGES) * STAGE;
        if constexpr (HN) {
            // S^T (keys r0 = 16 warp + ga, r1 = r0 + 8 on the m side; heads 2 tig, 2 tig + 1 on the n side):
            // k16 step 2c + h: dims 32 c + 8 tig + 4 h + (0, 1) / (2, 3) of both keys, as qa[2c + h][0] / [2] hold them.
            const int r0 = warp * 16 + ga, r1 = r0 + 8;
            float sc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int c = 0; c < HD / 32; c++) {
                u32 k0[4], k1[4];
                tc_rows_f16<HD>(tile, r0, r1, c, tig, k0, k1);
                mma_f16(sc, k0[0], k1[0], k0[1], k1[1], qa[2 * c][0], qa[2 * c][2]);
                mma_f16(sc, k0[2], k1[2], k0[3], k1[3], qa[2 * c + 1][0], qa[2 * c + 1][2]);
            }
            const int kb = sr.k0 + t * TC_TILE + warp * 16;
            if (kb + 16 <= sr.kend) {
#pragma unroll
                for (int e = 0; e < 4; e++) sc[e] *= sl2;
            } else {
                const bool v0 = kb + ga < sr.kend, v1 = kb + ga + 8 < sr.kend;
                sc[0] = v0 ? sc[0] * sl2 : NEG;
                sc[1] = v0 ? sc[1] * sl2 : NEG;
                sc[2] = v1 ? sc[2] * sl2 : NEG;
                sc[3] = v1 ? sc[3] * sl2 : NEG;
            }
            float mxa = fmaxf(sc[0], sc[2]), mxb = fmaxf(sc[1], sc[3]);   // heads 2 tig, 2 tig + 1
#pragma unroll
            for (int o2 = 4; o2 <= 16; o2 <<= 1) {
                mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, o2));
                mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, o2));
            }
            TC_LAZY_RESCALE(OT, 2, 1)
            const float ba = m_a == NEG ? 0.f : m_a, bb = m_b == NEG ? 0.f : m_b;
            sc[0] = exp2f(sc[0] - ba); sc[2] = exp2f(sc[2] - ba);
            sc[1] = exp2f(sc[1] - bb); sc[3] = exp2f(sc[3] - bb);
            l_a += sc[0] + sc[2];
            l_b += sc[1] + sc[3];
            // P^T as B (keys 2 tig.. of each 8, head ga): the (key, head pair) f16x2 transposed
            const u32 pb0 = movmatrix_trans(f32x2_f16x2(sc[0], sc[1]));
            const u32 pb1 = movmatrix_trans(f32x2_f16x2(sc[2], sc[3]));
            // V^T as A: movmatrix.trans of lane (ga, tig)'s dims 32 c + 8 tig + 2 q + (0, 1) of keys r0 / r1 holds
            // dim 32 c + 8 (ga / 2) + 2 q + ga % 2 at keys 2 tig..: rows ga / ga + 8 of o[2c + p] are q = 2p / 2p + 1.
            const unsigned char* vt = tile + TC_TILE * HD;
#pragma unroll
            for (int c = 0; c < HD / 32; c++) {
                u32 p0[4], p1[4];
                tc_rows_f16<HD>(vt, r0, r1, c, tig, p0, p1);
#pragma unroll
                for (int p = 0; p < 2; p++)
                    mma_f16(o[2 * c + p], movmatrix_trans(p0[2 * p]), movmatrix_trans(p0[2 * p + 1]),
                            movmatrix_trans(p1[2 * p]), movmatrix_trans(p1[2 * p + 1]), pb0, pb1);
            }
        } else {
            float s[2][4];
#pragma unroll
            for (int j = 0; j < 2; j++) {
                s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
                const int r = warp * 16 + j * 8 + ga;
                if constexpr (SM::F8) {                             // 8 e4m3 of span c: k16 steps 2c, 2c + 1
#pragma unroll
                    for (int c = 0; c < HD / 32; c++) {
                        const uint2 w =
                            *reinterpret_cast<const uint2*>(tile + r * HD + (tc_span<HD>(r, c) << 5) + tig * 8);
                        u32 b0, b1, b2, b3;
                        e4m3x4_f16x4(w.x, b0, b1);
                        e4m3x4_f16x4(w.y, b2, b3);
                        mma_f16(s[j], qa[2 * c][0], qa[2 * c][1], qa[2 * c][2], qa[2 * c][3], b0, b1);
                        mma_f16(s[j], qa[2 * c + 1][0], qa[2 * c + 1][1], qa[2 * c + 1][2], qa[2 * c + 1][3], b2, b3);
                    }
                } else {
                    const u32* kr = reinterpret_cast<const u32*>(reinterpret_cast<const bf16*>(tile) + r * LD);
#pragma unroll
                    for (int ks = 0; ks < KS; ks++)
                        mma_bf16(s[j], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], kr[ks * 8 + tig],
                                 kr[ks * 8 + 4 + tig]);
                }
            }
            const int kb = sr.k0 + t * TC_TILE + warp * 16;
            float mxa = NEG, mxb = NEG;
            if (kb + 16 <= sr.kend) {                               // all 16 keys of the warp are in the split
#pragma unroll
                for (int j = 0; j < 2; j++) {
#pragma unroll
                    for (int e = 0; e < 4; e++) s[j][e] *= sl2;
                    mxa = fmaxf(mxa, fmaxf(s[j][0], s[j][1]));
                    mxb = fmaxf(mxb, fmaxf(s[j][2], s[j][3]));
                }
            } else {
#pragma unroll
                for (int j = 0; j < 2; j++) {
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const bool valid = kb + j * 8 + tig * 2 + e < sr.kend;
                        s[j][e] = valid ? s[j][e] * sl2 : NEG;
                        s[j][2 + e] = valid ? s[j][2 + e] * sl2 : NEG;
                        mxa = fmaxf(mxa, s[j][e]);
                        mxb = fmaxf(mxb, s[j][2 + e]);
                    }
                }
            }
#pragma unroll
            for (int o2 = 1; o2 <= 2; o2 <<= 1) {
                mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, o2));
                mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, o2));
            }
            TC_LAZY_RESCALE(DT, 1, 2)
            const float ba = m_a == NEG ? 0.f : m_a, bb = m_b == NEG ? 0.f : m_b;   // a row without keys so far
            float suma = 0.f, sumb = 0.f;
#pragma unroll
            for (int j = 0; j < 2; j++) {
                s[j][0] = exp2f(s[j][0] - ba); s[j][1] = exp2f(s[j][1] - ba);
                s[j][2] = exp2f(s[j][2] - bb); s[j][3] = exp2f(s[j][3] - bb);
                suma += s[j][0] + s[j][1];
                sumb += s[j][2] + s[j][3];
            }
            l_a += suma;
            l_b += sumb;
            if constexpr (SM::F8) {
                // P as f16 (11 bits). V: lane (ga, tig) reads 8 e4m3 of rows 16 warp + ga (+ 8) at span c, i.e. dims
                // 32 c + 8 tig + 2 q + (0, 1) as f16x2 q; movmatrix.trans of each gives the B fragment of n tile
                // 4 c + q (column n = dim 32 c + 8 (n / 2) + 2 q + n % 2), whose accumulator holds dims
                // 32 c + 8 tig + 2 q + (0, 1).
                u32 ap[4];
#pragma unroll
                for (int j = 0; j < 2; j++) {
#pragma unroll
                    for (int h = 0; h < 2; h++) ap[2 * j + h] = f32x2_f16x2(s[j][2 * h], s[j][2 * h + 1]);
                }
                const unsigned char* vt = tile + TC_TILE * HD;
                const int r0 = warp * 16 + ga, r1 = r0 + 8;
#pragma unroll
                for (int c = 0; c < HD / 32; c++) {
                    u32 p0[4], p1[4];
                    tc_rows_f16<HD>(vt, r0, r1, c, tig, p0, p1);
#pragma unroll
                    for (int qd = 0; qd < 4; qd++)
                        mma_f16(o[4 * c + qd], ap[0], ap[1], ap[2], ap[3], movmatrix_trans(p0[qd]),
                                movmatrix_trans(p1[qd]));
                }
            } else {
                // P = hi + lo, both bf16 (P to ~16 bits: the PV product is as exact as the fp32 CUDA-core kernels')
                u32 ah[4], al[4];
#pragma unroll
                for (int j = 0; j < 2; j++) {
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const float x0 = s[j][2 * h], x1 = s[j][2 * h + 1];
                        ah[2 * j + h] = pack2(x0, x1);
                        al[2 * j + h] = pack2(x0 - round_bf(x0), x1 - round_bf(x1));
                    }
                }
                const bf16* Vs = reinterpret_cast<const bf16*>(tile) + TC_TILE * LD;
#pragma unroll
                for (int d = 0; d < DT; d += 2) {
                    u32 b0, b1, b2, b3;
                    ldmatrix_x4_trans(b0, b1, b2, b3,
                                      Vs + (warp * 16 + r8 + (qm & 1) * 8) * LD + d * 8 + (qm >> 1) * 8);
                    mma_bf16(o[d], ah[0], ah[1], ah[2], ah[3], b0, b1);
                    mma_bf16(o[d + 1], ah[0], ah[1], ah[2], ah[3], b2, b3);
                    mma_bf16(o[d], al[0], al[1], al[2], al[3], b0, b1);
                    mma_bf16(o[d + 1], al[0], al[1], al[2], al[3], b2, b3);
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    // merge the 4 warps: red [4][GM][HD] floats in the idle ring, (m, l) per warp and head
    float* red = reinterpret_cast<float*>(tc_smem);
    if constexpr (HN) {
#pragma unroll
        for (int o2 = 4; o2 <= 16; o2 <<= 1) {
            l_a += __shfl_xor_sync(0xffffffffu, l_a, o2);
            l_b += __shfl_xor_sync(0xffffffffu, l_b, o2);
        }
        const int h0 = 2 * tig, h1 = h0 + 1;
        if (ga == 0) { wm[warp][h0] = m_a; wl[warp][h0] = l_a; wm[warp][h1] = m_b; wl[warp][h1] = l_b; }
#pragma unroll
        for (int d = 0; d < OT; d++) {
            const int da = (d >> 1) * 32 + (ga >> 1) * 8 + (d & 1) * 4 + (ga & 1), db = da + 2;
            if (h0 < G) { red[(warp * GM + h0) * HD + da] = o[d][0]; red[(warp * GM + h0) * HD + db] = o[d][2]; }
            if (h1 < G) { red[(warp * GM + h1) * HD + da] = o[d][1]; red[(warp * GM + h1) * HD + db] = o[d][3]; }
        }
    } else {
#pragma unroll
        for (int o2 = 1; o2 <= 2; o2 <<= 1) {
            l_a += __shfl_xor_sync(0xffffffffu, l_a, o2);
            l_b += __shfl_xor_sync(0xffffffffu, l_b, o2);
        }
        if (tig == 0) { wm[warp][ga] = m_a; wl[warp][ga] = l_a; wm[warp][gb] = m_b; wl[warp][gb] = l_b; }
#pragma unroll
        for (int d = 0; d < DT; d++) {
            const int col = SM::F8 ? (d >> 2) * 32 + tig * 8 + (d & 3) * 2 : d * 8 + tig * 2;
            if (ga < G) { red[(warp * GM + ga) * HD + col] = o[d][0]; red[(warp * GM + ga) * HD + col + 1] = o[d][1]; }
            if (gb < G) { red[(warp * GM + gb) * HD + col] = o[d][2]; red[(warp * GM + gb) * HD + col + 1] = o[d][3]; }
        }
    }
    __syncthreads();
    for (int c = tid; c < G * HD; c += TC_THREADS) {
        const int g = c / HD, d = c % HD;
        const float M = fmaxf(fmaxf(wm[0][g], wm[1][g]), fmaxf(wm[2][g], wm[3][g]));
        float acc = 0.f, L = 0.f;
#pragma unroll
        for (int w = 0; w < 4; w++) {
            const float f = split_weight<true>(wm[w][g], M);
            acc += f * red[(w * GM + g) * HD + d];
            L += f * wl[w][g];
        }
        store_split(part_o, part_ml, out, i, sr.row, kvh * G + g, d, HD, nh, sr.active, acc * v_scale, M, L);
    }
    if (sr.active == 1) return;
    combine_splits_if_last<HD, GM, true, FUSED>(part_o, part_ml, counters, out, i, kvh, sr.row, nh, nkv, sr.active,
                                                red);
}

// attn_decode_tc_sSTAGES_hdHD (G = nh / nkv <= 16)
#define DECODE_TC_KERNEL(HD, STAGES)                                                                         \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, 3) attn_decode_tc_s##STAGES##_hd##HD(           \
        const bf16* q, const bf16* kv_layer, const int* qsl, const int* seq_lens, const int* block_tables,   \
        float* part_o, float* part_ml, int* counters, bf16* out, int T, int nh, int nkv, int block_size,     \
        int max_blocks, int num_slots, float scale) {                                                        \
        attn_decode_tc_impl<HD, STAGES>(q, kv_layer, qsl, seq_lens, block_tables, part_o, part_ml, counters, \
                                        out, T, nh, nkv, block_size, max_blocks, num_slots, scale); }

DECODE_TC_KERNEL(64, 2)
DECODE_TC_KERNEL(64, 3)
DECODE_TC_KERNEL(128, 2)
DECODE_TC_KERNEL(128, 3)
DECODE_TC_KERNEL(128, 4)

// attn_decode_tc_f8kv_sSTAGES_hdHD: the same over an FP8 cache (k_scale, v_scale: the layer's).
#define DECODE_TC_F8KV_KERNEL(HD, STAGES)                                                                    \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, 3) attn_decode_tc_f8kv_s##STAGES##_hd##HD(      \
        const bf16* q, const e4m3* kv_layer, const int* qsl, const int* seq_lens, const int* block_tables,   \
        float* part_o, float* part_ml, int* counters, bf16* out, int T, int nh, int nkv, int block_size,     \
        int max_blocks, int num_slots, float scale, float k_scale, float v_scale) {                          \
        attn_decode_tc_impl<HD, STAGES, false, e4m3>(q, kv_layer, qsl, seq_lens, block_tables, part_o,      \
                                                     part_ml, counters, out, T, nh, nkv, block_size,         \
                                                     max_blocks, num_slots, scale, FusedRope<e4m3>{},       \
                                                     k_scale, v_scale); }

DECODE_TC_F8KV_KERNEL(64, 2)
DECODE_TC_F8KV_KERNEL(64, 4)
DECODE_TC_F8KV_KERNEL(128, 2)
DECODE_TC_F8KV_KERNEL(128, 3)
DECODE_TC_F8KV_KERNEL(128, 4)

// attn_decode_tc_f8kvn_bBLOCKS_sSTAGES_hdHD: the FP8-cache kernel with the heads on the MMAs' n side (G <= 8):
// S^T = K Q^T and O^T = V^T P^T, so half the MMAs, accumulators and exponentials of the 16-row layout; launch bound
// BLOCKS blocks an SM (128 / 96 / 80 registers for 4 / 5 / 6).
#define DECODE_TC_F8KVN_KERNEL(HD, STAGES, BLOCKS)                                                           \
    extern "C" __global__ void __launch_bounds__(TC_THREADS, BLOCKS)                                        \
        attn_decode_tc_f8kvn_b##BLOCKS##_s##STAGES##_hd##HD(                                                  \
        const bf16* q, const e4m3* kv_layer, const int* qsl, const int* seq_lens, const int* block_tables,   \
        float* part_o, float* part_ml, int* counters, bf16* out, int T, int nh, int nkv, int block_size,     \
        int max_blocks, int num_slots, float scale, float k_scale, float v_scale) {                          \
        attn_decode_tc_impl<HD, STAGES, false, e4m3, true>(q, kv_layer, qsl, seq_lens, block_tables, part_o, \
                                                           part_ml, counters, out, T, nh, nkv, block_size,   \
                                                           max_blocks, num_slots, scale, FusedRope<e4m3>{},  \
                                                           k_scale, v_scale); }

DECODE_TC_F8KVN_KERNEL(64, 2, 4)
DECODE_TC_F8KVN_KERNEL(64, 3, 4)
DECODE_TC_F8KVN_KERNEL(64, 4, 4)
DECODE_TC_F8KVN_KERNEL(64, 2, 5)
DECODE_TC_F8KVN_KERNEL(64, 2, 6)
DECODE_TC_F8KVN_KERNEL(128, 2, 4)
DECODE_TC_F8KVN_KERNEL(128, 3, 4)
DECODE_TC_F8KVN_KERNEL(128, 4, 4)
DECODE_TC_F8KVN_KERNEL(128, 2, 5)
DECODE_TC_F8KVN_KERNEL(128, 2, 6)

// attn_decode_fused_sSTAGES_hdHD: decode buckets of 1-2 seqs, QK-norm / RoPE / KV write included (q_norm, k_norm
// null: no norm). kv_layer is read (the context) and written (the new token's k / v). Dynamic shared memory:
// the ring (STAGES * 2 * 64 * (HD + 8) bf16) + (16 * (HD + 8) + 2 * HD) bf16 + block ids (int; the plan sizes them
// for its longest split: plan.attention_plan.few_seq_smem; a split with more reads the block table directly).
#define DECODE_FUSED_KERNEL(HD, STAGES)                                                                      \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) attn_decode_fused_s##STAGES##_hd##HD(          \
        const bf16* qkv, const int* positions, const int* slot_mapping, const bf16* q_norm,                  \
        const bf16* k_norm, const float* cos_t, const float* sin_t, bf16* q_out, bf16* kv_layer,             \
        const int* qsl, const int* seq_lens, const int* block_tables, float* part_o, float* part_ml,         \
        int* counters, bf16* out, int T, int nh, int nkv, int block_size, int max_blocks, int num_slots,     \
        float eps, float scale, int min_tiles, int solo_tiles) {                                             \
        const FusedRope<bf16> fr{qkv, positions, slot_mapping, q_norm, k_norm, cos_t, sin_t, q_out, kv_layer, \
                                 eps, min_tiles, solo_tiles};                                                \
        attn_decode_tc_impl<HD, STAGES, true>(nullptr, kv_layer, qsl, seq_lens, block_tables, part_o,        \
                                              part_ml, counters, out, T, nh, nkv, block_size, max_blocks,    \
                                              num_slots, scale, fr); }

DECODE_FUSED_KERNEL(64, 2)
DECODE_FUSED_KERNEL(64, 3)
DECODE_FUSED_KERNEL(128, 2)
DECODE_FUSED_KERNEL(128, 3)
DECODE_FUSED_KERNEL(128, 4)
DECODE_FUSED_KERNEL(128, 6)

// attn_decode_fused_f8kv_sSTAGES_hdHD: the same over an FP8 cache (the new k / v written as e4m3 at the layer's
// scales). Dynamic shared memory: plan.attention_plan.few_seq_smem(..., fp8=True) (TcSmem above).
#define DECODE_FUSED_F8KV_KERNEL(HD, STAGES)                                                                 \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) attn_decode_fused_f8kv_s##STAGES##_hd##HD(     \
        const bf16* qkv, const int* positions, const int* slot_mapping, const bf16* q_norm,                  \
        const bf16* k_norm, const float* cos_t, const float* sin_t, bf16* q_out, e4m3* kv_layer,             \
        const int* qsl, const int* seq_lens, const int* block_tables, float* part_o, float* part_ml,         \
        int* counters, bf16* out, int T, int nh, int nkv, int block_size, int max_blocks, int num_slots,     \
        float eps, float scale, int min_tiles, int solo_tiles, float k_scale, float v_scale) {               \
        const FusedRope<e4m3> fr{qkv, positions, slot_mapping, q_norm, k_norm, cos_t, sin_t, q_out, kv_layer, \
                                 eps, min_tiles, solo_tiles};                                                \
        attn_decode_tc_impl<HD, STAGES, true, e4m3>(nullptr, kv_layer, qsl, seq_lens, block_tables, part_o,  \
                                                    part_ml, counters, out, T, nh, nkv, block_size,          \
                                                    max_blocks, num_slots, scale, fr, k_scale, v_scale); }

DECODE_FUSED_F8KV_KERNEL(64, 3)
DECODE_FUSED_F8KV_KERNEL(128, 3)
DECODE_FUSED_F8KV_KERNEL(128, 4)
