// Hopper (sm_90a) causal prefill attention over the paged KV cache on warpgroup MMA (wgmma), same contract as
// attention_prefill_pipe.cu (varlen by query_start_loc, queries at the end of each seq's context, GQA, seqs of
// < min_rows rows skipped, rows no seq covers zeroed). attn_prefill_{wg|ws}{G}h{H}k{K}s{S}[o][p][l][q][e]_hd128: G
// warpgroups of 64 query rows; H q heads of one KV head a block: H 1: consecutive rows of one q head, H 2: two q
// heads (same rows), H 4 (2 warpgroups): two q heads a warpgroup, one after the other on each K/V tile.
// K/V tiles of 64 keys go through the block table by cp.async (zero-fill past the block's last key) into an S-deep
// ring of 128B-swizzled tiles ([2 halves of 64 dims][64 keys][128 B]); wg: every thread copies, one __syncthreads
// a tile; ws: a producer warpgroup copies (its registers handed to the consumers by setmaxnreg), full/empty
// mbarriers a slot (the consumer warpgroups drift apart).
// S = Q K^T: 8 wgmma m64n64k16, Q and K from shared memory (K-major); online softmax in registers (exp2, scale
// folded in); P to bf16 in registers as the A operand of O += P V: 4 wgmma m64n128k16, V MN-major (transposed by
// the descriptor). o: QK^T of tile kt is issued with PV of tile kt - 1, and kt's softmax runs while that PV does;
// p: the consumer warpgroups take turns issuing (round robin, named barriers); l: lazy softmax (wgmma.cuh); q: Q in
// registers (QK^T as register-A wgmma); e: the lean producer copy and descriptors stepped by adds.
// Grid (nh / H, Y): block y takes the (seq, tile) pairs y, y + Y, ... (a seq's tiles in reverse: longest rows
// first; Y covers the tiles of one long prompt plus a few partial ones, attention_plan.PREFILL_EXTRA_TILES);
// every block zeroes uncovered rows r with r % Y == y.
// KVT e4m3 (attn_prefill_f8kv_ws*, an FP8 cache: kv_fp8.cuh; ws only): the producer warpgroup cp.asyncs a tile's
// e4m3 rows into a ring of PREFILL_F8KV_STAGING staging buffers after the bf16 ring ([K | V] x KT x 128 B each),
// PREFILL_F8KV_STAGING - 1 tiles ahead, converts the staged tile into its ring slot as the same swizzled bf16 tile
// (exact), and arrives on the slot's full barrier; k_scale joins the softmax scale, v_scale the output.
#include "wgmma.cuh"
#include "kv_fp8.cuh"

constexpr int WG_HD = 128;                                       // head size
constexpr u32 WG_QTILE = 64 * WG_HD * 2;                         // bytes of one warpgroup's Q tile
// ws: the producer warpgroup's registers go to the consumers (at launch 65536 / threads each, rounded down to 8):
// 2 consumer warpgroups 168 -> 40 / 232, 3 consumer warpgroups 128 -> 32 / 160. An FP8 cache's producer converts
// 8 chunks at a time and keeps 56 (consumers 224 / 152): with 32 - 40 its conversion bound the kernel.
__device__ constexpr int ws_producer_regs(int nwg, bool f8) { return f8 ? 56 : nwg == 2 ? 40 : 32; }
__device__ constexpr int ws_consumer_regs(int nwg, bool f8) { return nwg == 2 ? (f8 ? 224 : 232) : (f8 ? 152 : 160); }

template <int NWG, int HB, int KT, int STAGES, bool OV, bool WS, bool PP, bool LZ, bool QR, bool LE,
          typename KVT = bf16>
__device__ __forceinline__ void attn_prefill_wgmma_impl(
        const bf16* __restrict__ q, const KVT* __restrict__ kv_layer, const int* __restrict__ qsl,
        const int* __restrict__ seq_lens, const int* __restrict__ block_tables, bf16* __restrict__ out,
        int T, int num_seqs, int nh, int nkv, int block_size, int max_blocks, int num_slots, float scale,
        int min_rows, float k_scale = 1.f, float v_scale = 1.f) {
    pdl_entry();
    // HB q heads a block: the warpgroups split them HG ways (the rest of the warpgroups take further rows), each
    // warpgroup covers HPW of them in turn (its K/V tiles serve HPW x 64 (row, head) pairs).
    constexpr int HG = HB < NWG ? HB : NWG, HPW = HB / HG;
    constexpr int HD = WG_HD, NC = NWG * 128, NT = NC + (WS ? 128 : 0), BQ = 64 * NWG / HG;
    constexpr u32 HALF = KT * 128, TILE = 2 * HALF;              // bytes of 64 dims of a K (V) tile, of the tile
    static_assert(NWG % HG == 0 && HB % HG == 0 && (WS || !OV || STAGES >= 3) && (HPW == 1 || !OV),
                  "warpgroups per head; wg + o keeps 2 tiles live; heads in turn without the overlap");
    static_assert(!PP || (WS && OV), "turns: consumer warpgroups of ws + o");
    static_assert(!LZ || OV, "the lazy softmax: overlap variants");
    static_assert(!QR || (WS && HPW == 1), "Q in registers: ws, one Q tile a warpgroup");
    static_assert(!LE || WS, "the lean producer: ws");
    constexpr bool F8 = KvF8<KVT>::value;
    static_assert(!F8 || WS, "an FP8 cache: the producer warpgroup converts");
    static_assert(!WS || (NWG * ws_consumer_regs(NWG, F8) + ws_producer_regs(NWG, F8)) * 128 <= 65536 / NT / 8 * 8 * NT,
                  "setmaxnreg moves registers only inside the block's launch allotment");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ __align__(8) u64 bars[2 * STAGES];               // ws: full[STAGES], empty[STAGES]
    const u32 q_s = (smem_addr(smem_raw) + 1023u) & ~1023u;      // swizzle atoms need 1024-byte alignment
    const u32 kv_s = q_s + NWG * HPW * WG_QTILE;                 // [STAGES][K tile | V tile]
    const u32 full = smem_addr(bars), empty = full + 8 * STAGES;
    const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, wl = (tid >> 5) & 3, h0 = blockIdx.x * HB;
    if (WS && tid == 0) {
        for (int s = 0; s < STAGES; s++) { mbar_init(full + 8 * s, 128); mbar_init(empty + 8 * s, NWG * 4); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    const int covered = qsl[num_seqs];
    for (int r = covered + blockIdx.y; r < T; r += gridDim.y)
        for (int d = tid; d < HB * HD; d += NT) out[((size_t)r * nh + h0) * HD + d] = 0;
    const int kvh = h0 / (nh / nkv), bs_log2 = __ffs(block_size) - 1;   // block_size: a power of two (BuildConfig)
    const size_t kv_stride = (size_t)nkv * HD, v_off = (size_t)num_slots * kv_stride;
    const KVT* kv_head = kv_layer + (size_t)kvh * HD;
    // The block's (seq, tile) pairs: y, y + gridDim.y, ...; every thread searches each (next_pair's barriers, which
    // also publish the inits), the producer in its own loop (its registers are given away before it).
    auto find_pair = [&](int b, int& seq, int& tile) {
        return next_pair<NT>(qsl, num_seqs, min_rows, BQ, b, seq, tile);
    };
    auto pair_keys = [&](int seq, int tile, int& n, int& pos0, int& q0) {   // -> keys up to the last row (max_pos)
        n = qsl[seq + 1] - qsl[seq];
        pos0 = seq_lens[seq] - n;
        q0 = ((n + BQ - 1) / BQ - 1 - tile) * BQ;                // first query (within seq) of this block
        return pos0 + min(q0 + BQ, n) - 1;
    };
    // The ring's slots and phases count key tiles over all of a block's pairs (g: base + kt).
    auto ring_slot = [&](int g) { return kv_s + (g % STAGES) * 2 * TILE; };

    if constexpr (WS) if (tid >= NC) {                           // the producer warpgroup
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(ws_producer_regs(NWG, F8)));
        const int t = tid - NC, ch = t & 15;
        const char* k_base = reinterpret_cast<const char*>(kv_head + ch * 8);
        const char* v_base = reinterpret_cast<const char*>(kv_head + v_off + ch * 8);
        // F8: thread t stages 16-B chunk t % 8 of rows t / 8 + 16 i (an e4m3 row is 128 B) into staging g % NS
        // ([NS][K | V][KT][128 B] after the ring), then converts staging g % NS into ring slot g, bf16 swizzled.
        // Every staging step commits one cp.async group (empty past the pair's tiles), so tile g has landed once at
        // most NS - 2 groups are pending.
        constexpr int NS = PREFILL_F8KV_STAGING;
        static_assert(NS >= 2, "a tile staged ahead");
        const u32 stg = kv_s + STAGES * 2 * TILE;
        const char* k8 = reinterpret_cast<const char*>(kv_head) + (t & 7) * 16;
        const char* v8 = k8 + v_off;                             // (e4m3: bytes = elements)
        auto stage = [&](int g, const int* bt, int kt, int max_pos) {
            const u32 d = stg + (g % NS) * 2 * HALF + (t >> 3) * 128 + (t & 7) * 16;
#pragma unroll
            for (int i = 0; i < KT / 16; i++) {
                const int p = kt * KT + (t >> 3) + 16 * i;
                const bool ok = p <= max_pos;
                const u32 slot = ok ? paged_slot(bt, p, bs_log2) : 0u;
                cp_async16_zfill(d + i * 16 * 128, k8 + (size_t)slot * (u32)kv_stride, ok ? 16 : 0);
                cp_async16_zfill(d + HALF + i * 16 * 128, v8 + (size_t)slot * (u32)kv_stride, ok ? 16 : 0);
            }
            cp_async_commit();
        };
        auto convert = [&](int g) {
            const u32 src = stg + (g % NS) * 2 * HALF, dst = ring_slot(g);
#pragma unroll 8
            for (int i = 0; i < 2 * KT * 16 / 128; i++) {
                const int c = t + 128 * i, v = c / (KT * 16), r = (c >> 4) % KT, ch = c & 15;
                sts16(dst + v * KT * 256 + sw128_offset(r, ch, KT), e4m3x8_bf16x8(lds8(src + v * HALF + r * 128
                                                                                        + ch * 8)));
            }
        };
        int seq, tile, n, pos0, q0;
        for (int b = blockIdx.y, base = 0; find_pair(b, seq, tile); b += gridDim.y) {
            const int max_pos = pair_keys(seq, tile, n, pos0, q0), ntiles = max_pos / KT + 1;
            const int* bt = block_tables + (size_t)seq * max_blocks;
            if constexpr (F8) {
#pragma unroll
                for (int i = 0; i < NS - 1; i++) {
                    if (i < ntiles) stage(base + i, bt, i, max_pos);
                    else cp_async_commit();
                }
            }
            for (int kt = 0; kt < ntiles; kt++) {
                const int g = base + kt;
                if constexpr (F8) {
                    cp_async_wait<NS - 2>();                     // tile g staged (this thread's copies) ...
                    asm volatile("bar.sync 15, 128;" ::: "memory");   // ... every producer's; g - 1's staging read
                    if (kt + NS - 1 < ntiles) stage(g + NS - 1, bt, kt + NS - 1, max_pos);
                    else cp_async_commit();
                }
                if (g >= STAGES) mbar_wait(empty + 8 * (g % STAGES), (g / STAGES - 1) & 1);
                if constexpr (F8) {
                    convert(g);
                    fence_proxy_async();
                    mbar_arrive(full + 8 * (g % STAGES));
                } else {
                    if constexpr (LE)
                        copy_kv_tile_lean<KT>(ring_slot(g), k_base, v_base, bt, kt, max_pos, bs_log2,
                                              (u32)kv_stride * 2, t >> 4, sw128_offset(t >> 4, ch, KT));
                    else
                        copy_kv_tile<KT, 128>(ring_slot(g), kv_head, bt, kt, max_pos, bs_log2, kv_stride, v_off, t);
                    mbar_arrive_on_copies(full + 8 * (g % STAGES));
                }
            }
            base += ntiles;
        }
        cp_async_commit();
        cp_async_wait<0>();
        return;
    }
    if constexpr (WS) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(ws_consumer_regs(NWG, F8)));

    int seq, tile, n, pos0, q0;
    for (int b = blockIdx.y, base = 0; find_pair(b, seq, tile); b += gridDim.y) {
        const int max_pos = pair_keys(seq, tile, n, pos0, q0), ntiles = max_pos / KT + 1;
        const int* bt = block_tables + (size_t)seq * max_blocks;
        auto slot_of = [&](int kt) { return ring_slot(base + kt); };

        // Q tile w * HPW + j: warpgroup w's 64 rows (rows past the seq's end repeat its last row; results dropped) of
        // head h0 + (w % HG) HPW + j; wg: every thread copies every tile (in the first tile's group), ws: each
        // warpgroup its own.
        constexpr int QW = WS ? HPW : NWG * HPW, QTH = WS ? 128 : NC;
#pragma unroll
        for (int i = 0; i < QW * 64 * 16 / QTH; i++) {
            const int c = (WS ? tid & 127 : tid) + i * QTH, qt = (WS ? wg * HPW : 0) + (c >> 10), r = (c >> 4) & 63;
            const int w = qt / HPW, head = h0 + (w % HG) * HPW + qt % HPW, ch = c & 15;
            const size_t row = qsl[seq] + min(q0 + (w / HG) * 64 + r, n - 1);
            cp_async16_zfill(q_s + qt * WG_QTILE + sw128_offset(r, ch, 64), q + (row * nh + head) * HD + ch * 8, 16);
        }
        if constexpr (WS) {
            cp_async_commit();                                       // (wait_group waits for committed groups only)
            cp_async_wait<0>();
            fence_proxy_async();
            asm volatile("bar.sync %0, 128;" :: "r"(1 + wg) : "memory");   // this warpgroup's Q is in place
        }

        // This warpgroup: rows w0 .. w0 + 63 (within seq), thread rows wl * 16 + lane / 4 + 8 e.
        const int w0 = q0 + (wg / HG) * 64, row_l = w0 + wl * 16 + (lane >> 2);
        const int wpos_first = pos0 + min(w0, n - 1), wpos_last = w0 < n ? pos0 + min(w0 + 63, n - 1) : -1;
        const int wtiles = wpos_last < 0 ? 0 : wpos_last / KT + 1;  // tiles with a key visible to this warpgroup
        const int qpos[2] = {pos0 + min(row_l, n - 1), pos0 + min(row_l + 8, n - 1)};
        const u32 qw = q_s + wg * HPW * WG_QTILE;                    // this warpgroup's first Q tile
        const float sl2 = scale * k_scale * 1.4426950408889634f;
        float o[HPW][64], s[KT / 2], m_r[HPW][2], l_r[HPW][2], corr[2];   // o, m, l: one set per head in turn
        u32 pf[KT / 16][4], qf[QR ? HD / 16 : 1][4];                  // P (A of PV); qr: Q (A of QK^T)
        if constexpr (QR) {                                          // warp wl's 16 rows, k-step k: ldmatrix x4
#pragma unroll
            for (int k = 0; k < HD / 16; k++) {
                const int i = lane >> 3;
                ldmatrix_x4_at(qf[k], qw + sw128_offset(wl * 16 + (i & 1) * 8 + (lane & 7), 2 * k + (i >> 1), 64));
            }
        }
#pragma unroll
        for (int j = 0; j < HPW; j++) {
#pragma unroll
            for (int i = 0; i < 64; i++) o[j][i] = 0.f;
            m_r[j][0] = m_r[j][1] = -__int_as_float(0x7f800000);
            l_r[j][0] = l_r[j][1] = 0.f;
        }

        // 128B-swizzle descriptor of base + off (e: from the base's low word stepped by an add; the high word constant)
        auto tile_desc = [&](u32 base, u32 off, u32 lbo) {
            return LE ? desc_at(sw128_desc_lo(base, lbo) + (off >> 4), 1024) : sw128_desc(base + off, lbo, 1024);
        };
        auto issue_s = [&](int kt, u32 qw) {                         // s = Q K(kt)^T, committed as one group
            const u32 ks = slot_of(kt);
            wg_fence();
#pragma unroll
            for (int k = 0; k < HD / 16; k++) {
                const u64 kd = tile_desc(ks, (k >> 2) * HALF + (k & 3) * 32, 16);
                if constexpr (QR) wgmma_rs(s, qf[k], kd, k > 0);
                else wgmma_ss(s, tile_desc(qw, (k >> 2) * (WG_QTILE / 2) + (k & 3) * 32, 16), kd, k > 0);
            }
            wg_commit();
        };
        auto issue_pv = [&](int kt, float (&o)[64]) {                // o += P V(kt), committed as one group
            const u32 vs = slot_of(kt) + TILE;
            reg_fence(o);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < KT / 16; kk++)
                wgmma_rs_n128_tb(o, pf[kk], tile_desc(vs, kk * 16 * 128, HALF));
            wg_commit();
        };
        // s -> P in place; corr; returns moved (the overlap variants branch around the causal mask)
        auto softmax = [&](int kt, float (&m)[2], float (&l)[2]) {
            const int kb = kt * KT;
            const int lim[2] = {qpos[0] - kb - (lane & 3) * 2, qpos[1] - kb - (lane & 3) * 2};
            reg_fence(s);
            return softmax_tile<KT / 2, OV, LZ>(s, m, l, corr, kb + KT - 1 > wpos_first, lim, sl2);
        };
        auto step = [&](int kt) {                                    // tile kt, products one after the other
            if (kt >= wtiles) return;                                // every key is after this warpgroup's rows
#pragma unroll
            for (int j = 0; j < HPW; j++) {
                issue_s(kt, qw + j * WG_QTILE);
                wg_wait<0>();
                const bool moved = softmax(kt, m_r[j], l_r[j]);
                rescale(o[j], corr, moved);
                pack_p(s, pf);
                issue_pv(kt, o[j]);
                wg_wait<0>();
                reg_fence(o[j]);
                reg_fence(pf);
            }
        };
        // p: the warpgroups take turns issuing their products, 0, 1, .. NWG - 1, 0, .. (named barrier turn0 + w: w's
        // turn, after 1 + w of the Q tiles), so that one's softmax runs while the others' products do; the last one
        // lets warpgroup 0 go first and skips its last pass (counts match).
        const int my_turn = 1 + NWG + wg, next_turn = 1 + NWG + (wg + 1) % NWG;
        auto turn_wait = [&]() {
            if constexpr (PP) asm volatile("bar.sync %0, 256;" :: "r"(my_turn) : "memory");
        };
        auto turn_pass = [&](int kt) {
            if constexpr (PP)
                if (wg < NWG - 1 || kt < ntiles) asm volatile("bar.arrive %0, 256;" :: "r"(next_turn) : "memory");
        };
        // kt in 0..ntiles: S(kt) and PV(kt - 1) in flight together. Each case is straight-line code from the first
        // issue to the last wait: a branch in between makes ptxas wait for every group (or serialize every wgmma).
        auto step_overlap = [&](int kt) {
            turn_wait();
            if (kt > 0 && kt < wtiles) {
                issue_s(kt, qw);
                issue_pv(kt - 1, o[0]);
                if constexpr (PP) asm volatile("bar.arrive %0, 256;" :: "r"(next_turn) : "memory");
                wg_wait<1>();                                        // S(kt) done, PV(kt - 1) may still run
                // PV(kt - 1) is waited for in both arms of the vote: a branch ptxas cannot hoist above the softmax
                // (in one block it hoists the wait, and the P packing that waits on it, into the softmax).
                if (__any_sync(0xffffffffu, softmax(kt, m_r[0], l_r[0]))) {
                    wg_wait<0>();
                    reg_fence(o[0]);
                    rescale_rows(o[0], corr);
                } else {
                    wg_wait<0>();
                }
                reg_fence(o[0]);
                reg_fence(pf);
                pack_p(s, pf);
            } else if (kt == 0 && wtiles > 0) {
                issue_s(0, qw);
                wg_wait<0>();
                turn_pass(kt);
                softmax(0, m_r[0], l_r[0]);                          // o is still 0: nothing to rescale
                pack_p(s, pf);
            } else if (kt == wtiles && kt > 0) {
                issue_pv(kt - 1, o[0]);
                wg_wait<0>();
                reg_fence(o[0]);
                reg_fence(pf);
                turn_pass(kt);
            } else {
                turn_pass(kt);
            }
        };

        if constexpr (WS) {
            // Tile kt waits for full[kt % S] (phase kt / S); a warp releases a slot (empty) when done with its tile:
            // after step kt, or after step_overlap kt + 1 (V of tile kt is read there).
            if (PP && wg == NWG - 1) asm volatile("bar.arrive %0, 256;" :: "r"(next_turn) : "memory");
            for (int kt = 0; kt <= ntiles; kt++) {
                if (kt < ntiles) {
                    mbar_wait(full + 8 * ((base + kt) % STAGES), ((base + kt) / STAGES) & 1);
                    fence_proxy_async();
                }
                if constexpr (OV) step_overlap(kt); else if (kt < ntiles) step(kt);
                const int done = OV ? kt - 1 : kt;
                __syncwarp();
                if (lane == 0 && done >= 0 && done < ntiles) mbar_arrive(empty + 8 * ((base + done) % STAGES));
            }
        } else if constexpr (!OV) {
#pragma unroll
            for (int st = 0; st < STAGES - 1; st++) {
                if (st < ntiles)
                    copy_kv_tile<KT, NT>(slot_of(st), kv_head, bt, st, max_pos, bs_log2, kv_stride, v_off, tid);
                cp_async_commit();                                   // group 0 also holds Q
            }
            for (int kt = 0; kt < ntiles; kt++) {
                cp_async_wait<STAGES - 2>();                         // tile kt landed (this thread's copies) ...
                fence_proxy_async();                                 // ... visible to the tensor cores
                __syncthreads();                                     // ... every thread's; tile kt - 1 is free
                if (kt + STAGES - 1 < ntiles)
                    copy_kv_tile<KT, NT>(slot_of(kt + STAGES - 1), kv_head, bt, kt + STAGES - 1, max_pos, bs_log2,
                                         kv_stride, v_off, tid);
                cp_async_commit();
                step(kt);
            }
        } else {
            // Tile kt's slot is refilled at iteration kt + 2 (its V is read in iteration kt + 1): S - 2 tiles ahead.
#pragma unroll
            for (int st = 0; st < STAGES - 2; st++) {
                if (st < ntiles)
                    copy_kv_tile<KT, NT>(slot_of(st), kv_head, bt, st, max_pos, bs_log2, kv_stride, v_off, tid);
                cp_async_commit();
            }
            for (int kt = 0; kt <= ntiles; kt++) {
                cp_async_wait<STAGES - 3>();                         // tile kt landed
                fence_proxy_async();
                __syncthreads();                                     // every warpgroup is done with tile kt - 2
                if (kt + STAGES - 2 < ntiles)
                    copy_kv_tile<KT, NT>(slot_of(kt + STAGES - 2), kv_head, bt, kt + STAGES - 2, max_pos, bs_log2,
                                         kv_stride, v_off, tid);
                cp_async_commit();
                step_overlap(kt);
            }
        }
        cp_async_wait<0>();                                          // this tile's copies (Q, wg: K / V) landed

#pragma unroll
        for (int j = 0; j < HPW; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float l = l_r[j][e];
                l += __shfl_xor_sync(0xffffffffu, l, 1);
                l += __shfl_xor_sync(0xffffffffu, l, 2);
                const float inv = v_scale / l;
                const int r = row_l + e * 8;
                if (r >= n) continue;
                bf16* orow = out + ((size_t)(qsl[seq] + r) * nh + h0 + (wg % HG) * HPW + j) * HD + (lane & 3) * 2;
#pragma unroll
                for (int t = 0; t < 16; t++)
                    *reinterpret_cast<u32*>(orow + t * 8) = pack2(o[j][4 * t + 2 * e] * inv,
                                                                  o[j][4 * t + 2 * e + 1] * inv);
            }
        }
        base += ntiles;
    }
}

#define PREFILL_WGMMA_KERNEL(MODE, NWG, HB, KEYS, S, SUFFIX, OV, WS, PP, LZ, QR, LE, THREADS)                       \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                                        \
    attn_prefill_##MODE##NWG##h##HB##k##KEYS##s##S##SUFFIX##_hd128(                                                 \
        const bf16* q, const bf16* kv_layer, const int* qsl, const int* seq_lens, const int* block_tables,          \
        bf16* out, int T, int num_seqs, int nh, int nkv, int block_size, int max_blocks, int num_slots,             \
        float scale, int min_rows) {                                                                                \
        attn_prefill_wgmma_impl<NWG, HB, KEYS, S, OV, WS, PP, LZ, QR, LE>(q, kv_layer, qsl, seq_lens, block_tables, \
                                                                      out, T, num_seqs, nh, nkv, block_size,        \
                                                                      max_blocks, num_slots, scale, min_rows); }

PREFILL_WGMMA_KERNEL(wg, 2, 2, 64, 2, , false, false, false, false, false, false, 256)
PREFILL_WGMMA_KERNEL(wg, 3, 1, 64, 2, , false, false, false, false, false, false, 384)
PREFILL_WGMMA_KERNEL(wg, 2, 2, 64, 4, o, true, false, false, false, false, false, 256)
PREFILL_WGMMA_KERNEL(wg, 3, 1, 64, 4, o, true, false, false, false, false, false, 384)
PREFILL_WGMMA_KERNEL(ws, 2, 2, 64, 3, , false, true, false, false, false, false, 384)
PREFILL_WGMMA_KERNEL(ws, 2, 2, 64, 4, o, true, true, false, false, false, false, 384)
PREFILL_WGMMA_KERNEL(ws, 2, 1, 64, 4, o, true, true, false, false, false, false, 384)
PREFILL_WGMMA_KERNEL(ws, 2, 1, 64, 3, o, true, true, false, false, false, false, 384)
PREFILL_WGMMA_KERNEL(ws, 2, 2, 128, 3, o, true, true, false, false, false, false, 384)
PREFILL_WGMMA_KERNEL(wg, 2, 2, 128, 2, , false, false, false, false, false, false, 256)
PREFILL_WGMMA_KERNEL(ws, 2, 2, 64, 4, , false, true, false, false, false, false, 384)
PREFILL_WGMMA_KERNEL(ws, 3, 1, 64, 3, , false, true, false, false, false, false, 512)
PREFILL_WGMMA_KERNEL(ws, 3, 1, 64, 4, , false, true, false, false, false, false, 512)
PREFILL_WGMMA_KERNEL(ws, 2, 4, 64, 4, , false, true, false, false, false, false, 384)
PREFILL_WGMMA_KERNEL(ws, 2, 4, 64, 3, , false, true, false, false, false, false, 384)
PREFILL_WGMMA_KERNEL(ws, 3, 1, 64, 3, o, true, true, false, false, false, false, 512)
PREFILL_WGMMA_KERNEL(ws, 3, 1, 64, 4, o, true, true, false, false, false, false, 512)
PREFILL_WGMMA_KERNEL(ws, 2, 2, 64, 4, op, true, true, true, false, false, false, 384)
PREFILL_WGMMA_KERNEL(ws, 3, 1, 64, 4, op, true, true, true, false, false, false, 512)
PREFILL_WGMMA_KERNEL(ws, 3, 1, 64, 3, ol, true, true, false, true, false, false, 512)
PREFILL_WGMMA_KERNEL(ws, 2, 2, 64, 4, opl, true, true, true, true, false, false, 384)
PREFILL_WGMMA_KERNEL(ws, 2, 2, 64, 4, oplq, true, true, true, true, true, false, 384)
PREFILL_WGMMA_KERNEL(ws, 2, 2, 64, 4, q, false, true, false, false, true, false, 384)
PREFILL_WGMMA_KERNEL(ws, 3, 1, 64, 4, oe, true, true, false, false, false, true, 512)
PREFILL_WGMMA_KERNEL(ws, 2, 2, 64, 4, oplqe, true, true, true, true, true, true, 384)

// attn_prefill_f8kv_ws*: the same over an FP8 cache (ws only). Dynamic shared memory: the bf16 kernel's + the two
// staging tiles, 2 x 2 x KEYS x 128 B (plan.attention_plan.prefill_attn_launch).
#define PREFILL_WGMMA_F8KV_KERNEL(NWG, HB, KEYS, S, SUFFIX, OV, PP, LZ, QR, LE, THREADS)                               \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                                        \
    attn_prefill_f8kv_ws##NWG##h##HB##k##KEYS##s##S##SUFFIX##_hd128(                                                \
        const bf16* q, const e4m3* kv_layer, const int* qsl, const int* seq_lens, const int* block_tables,          \
        bf16* out, int T, int num_seqs, int nh, int nkv, int block_size, int max_blocks, int num_slots,             \
        float scale, int min_rows, float k_scale, float v_scale) {                                                  \
        attn_prefill_wgmma_impl<NWG, HB, KEYS, S, OV, true, PP, LZ, QR, LE, e4m3>(                                  \
            q, kv_layer, qsl, seq_lens, block_tables, out, T, num_seqs, nh, nkv, block_size, max_blocks, num_slots, \
            scale, min_rows, k_scale, v_scale); }

PREFILL_WGMMA_F8KV_KERNEL(3, 1, 64, 4, oe, true, false, false, false, true, 512)
PREFILL_WGMMA_F8KV_KERNEL(2, 2, 64, 4, , false, false, false, false, false, 384)
