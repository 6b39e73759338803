// Flash-style causal prefill attention over the paged KV cache (earlier context included), varlen by
// query_start_loc, GQA by indexing (q head h reads kv head h / G). mma.sync m16n8k16 bf16, fp32 softmax.
// Block: 4 warps = 64 query rows of one seq, one q head; K/V tiles of 64 keys in shared memory.
// Grid (ceil(T / 64) + num_seqs, nh): block b takes the b-th (seq, tile) pair; spare blocks only zero rows
// covered by no seq (row >= qsl[num_seqs]), which every block does for rows r with r % gridDim.x == b.
// Seqs with fewer than min_rows query rows are skipped (min_rows 2: a mixed step's decode rows, which
// attention_decode_batched.cu computes in the same op).
#include "common.cuh"

#define PF_Q 64
#define PF_K 64

// Which (seq, tile) block b takes, tiles of rows_per_tile query rows: the NT threads scan NT seqs at a time (tile
// counts, block prefix sum). seq -1: none (a spare block). Seqs with fewer than min_rows rows have no tiles.
template <int NT>
__device__ __forceinline__ void find_tile(const int* __restrict__ qsl, int num_seqs, int min_rows, int rows_per_tile,
                                          int b, int& seq, int& tile) {
    __shared__ int scan_w[NT / 32], found_seq, found_tile;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) found_seq = -1;
    __syncthreads();
    for (int base = 0, acc_tiles = 0; base < num_seqs; base += NT) {
        const int i = base + tid;
        const int n_i = i < num_seqs ? qsl[i + 1] - qsl[i] : 0;
        const int nt = n_i >= min_rows && n_i > 0 ? (n_i + rows_per_tile - 1) / rows_per_tile : 0;
        int incl = nt;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        if (lane == 31) scan_w[warp] = incl;
        __syncthreads();
        int total = 0;
#pragma unroll
        for (int w = 0; w < NT / 32; w++) {
            if (w < warp) incl += scan_w[w];
            total += scan_w[w];
        }
        const int lo = acc_tiles + incl - nt;
        if (nt > 0 && b >= lo && b < lo + nt) { found_seq = i; found_tile = b - lo; }
        acc_tiles += total;
        __syncthreads();
        if (found_seq >= 0 || acc_tiles > b) break;
    }
    seq = found_seq;
    tile = found_tile;
}

template <int HD>
__device__ __forceinline__ void attn_prefill_impl(
        const bf16* __restrict__ q, const bf16* __restrict__ kv_layer, const int* __restrict__ qsl,
        const int* __restrict__ seq_lens, const int* __restrict__ block_tables, bf16* __restrict__ out,
        int T, int num_seqs, int nh, int nkv, int block_size, int max_blocks, int num_slots, float scale,
        int min_rows) {
    pdl_entry();
    constexpr int LD = HD + 8, KS = HD / 16, DT = HD / 8;
    __shared__ __align__(16) bf16 Ks[PF_K * LD];
    __shared__ __align__(16) bf16 Vs[PF_K * LD];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, h = blockIdx.y;
    const int covered = qsl[num_seqs];
    for (int r = covered + blockIdx.x; r < T; r += gridDim.x)
        for (int d = tid; d < HD; d += blockDim.x) out[((size_t)r * nh + h) * HD + d] = 0;

    int seq, tile;
    find_tile<128>(qsl, num_seqs, min_rows, PF_Q, blockIdx.x, seq, tile);
    if (seq < 0) return;
    const int n = qsl[seq + 1] - qsl[seq], Lc = seq_lens[seq], G = nh / nkv, kvh = h / G;
    const int q0 = tile * PF_Q;                                  // first query (within seq) of this tile
    const int qlast = min(q0 + PF_Q, n) - 1;
    const int max_pos = Lc - n + qlast;
    const size_t kv_stride = (size_t)nkv * HD;

    // Q fragments of this warp's 16 rows (rows past the seq's end repeat its last row, results dropped).
    const int ra = q0 + warp * 16 + (lane >> 2), rb = ra + 8;
    const int rowa = qsl[seq] + min(ra, n - 1), rowb = qsl[seq] + min(rb, n - 1);
    const int posa = Lc - n + min(ra, n - 1), posb = Lc - n + min(rb, n - 1);
    u32 qa[KS][4];
    {
        const u32* pa = reinterpret_cast<const u32*>(q + ((size_t)rowa * nh + h) * HD);
        const u32* pb = reinterpret_cast<const u32*>(q + ((size_t)rowb * nh + h) * HD);
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            int c = ks * 8 + (lane & 3);
            qa[ks][0] = pa[c]; qa[ks][1] = pb[c]; qa[ks][2] = pa[c + 4]; qa[ks][3] = pb[c + 4];
        }
    }
    const float sl2 = scale * 1.4426950408889634f;
    float o[DT][4];
#pragma unroll
    for (int t = 0; t < DT; t++) { o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f; }
    float m_a = -__int_as_float(0x7f800000), m_b = m_a, l_a = 0.f, l_b = 0.f;

    const int ntiles = max_pos / PF_K + 1;
    for (int kt = 0; kt < ntiles; kt++) {
        const int kb = kt * PF_K;
        __syncthreads();
        for (int c = tid; c < PF_K * (HD / 8); c += blockDim.x) {
            int kr = c / (HD / 8), kc = (c % (HD / 8)) * 8, p = kb + kr;
            bool ok = p <= max_pos;
            size_t slot = ok ? (size_t)block_tables[(size_t)seq * max_blocks + p / block_size] * block_size
                               + p % block_size : 0;
            const bf16* kp = kv_layer + slot * kv_stride + (size_t)kvh * HD + kc;
            cp_async16(Ks + kr * LD + kc, kp, ok ? 16 : 0);
            cp_async16(Vs + kr * LD + kc, kp + (size_t)num_slots * kv_stride, ok ? 16 : 0);
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        float s[8][4];
#pragma unroll
        for (int j = 0; j < 8; j++) { s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f; }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const u32* kr = reinterpret_cast<const u32*>(Ks + (j * 8 + (lane >> 2)) * LD);
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                u32 b0 = kr[ks * 8 + (lane & 3)], b1 = kr[ks * 8 + 4 + (lane & 3)];
                mma_bf16(s[j], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], b0, b1);
            }
        }
        float mxa = -__int_as_float(0x7f800000), mxb = mxa;
#pragma unroll
        for (int j = 0; j < 8; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int key = kb + j * 8 + (lane & 3) * 2 + e;
                s[j][e] = key <= posa ? s[j][e] * sl2 : -__int_as_float(0x7f800000);
                s[j][2 + e] = key <= posb ? s[j][2 + e] * sl2 : -__int_as_float(0x7f800000);
                mxa = fmaxf(mxa, s[j][e]); mxb = fmaxf(mxb, s[j][2 + e]);
            }
        }
#pragma unroll
        for (int o2 = 1; o2 <= 2; o2 <<= 1) {
            mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, o2));
            mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, o2));
        }
        const float na = fmaxf(m_a, mxa), nb = fmaxf(m_b, mxb);   // finite: key 0 is always visible
        const float ca = exp2f(m_a - na), cb = exp2f(m_b - nb);
        m_a = na; m_b = nb;
        float suma = 0.f, sumb = 0.f;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            s[j][0] = exp2f(s[j][0] - na); s[j][1] = exp2f(s[j][1] - na);
            s[j][2] = exp2f(s[j][2] - nb); s[j][3] = exp2f(s[j][3] - nb);
            suma += s[j][0] + s[j][1]; sumb += s[j][2] + s[j][3];
        }
        l_a = l_a * ca + suma; l_b = l_b * cb + sumb;
#pragma unroll
        for (int t = 0; t < DT; t++) { o[t][0] *= ca; o[t][1] *= ca; o[t][2] *= cb; o[t][3] *= cb; }

        const int qm = lane >> 3, r8 = lane & 7;
#pragma unroll
        for (int kk = 0; kk < PF_K / 16; kk++) {
            u32 a0 = pack2(s[2 * kk][0], s[2 * kk][1]), a1 = pack2(s[2 * kk][2], s[2 * kk][3]);
            u32 a2 = pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]), a3 = pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int t = 0; t < DT; t += 2) {
                u32 b0, b1, b2, b3;
                const bf16* vp = Vs + (kk * 16 + r8 + (qm & 1) * 8) * LD + t * 8 + (qm >> 1) * 8;
                ldmatrix_x4_trans(b0, b1, b2, b3, vp);
                mma_bf16(o[t], a0, a1, a2, a3, b0, b1);
                mma_bf16(o[t + 1], a0, a1, a2, a3, b2, b3);
            }
        }
    }
#pragma unroll
    for (int o2 = 1; o2 <= 2; o2 <<= 1) {
        l_a += __shfl_xor_sync(0xffffffffu, l_a, o2);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, o2);
    }
    const float ia = 1.f / l_a, ib = 1.f / l_b;
#pragma unroll
    for (int t = 0; t < DT; t++) {
        int col = t * 8 + (lane & 3) * 2;
        if (ra < n) *reinterpret_cast<u32*>(out + ((size_t)rowa * nh + h) * HD + col) = pack2(o[t][0] * ia, o[t][1] * ia);
        if (rb < n) *reinterpret_cast<u32*>(out + ((size_t)rowb * nh + h) * HD + col) = pack2(o[t][2] * ib, o[t][3] * ib);
    }
}

#define PREFILL_KERNEL(HD)                                                                                   \
    extern "C" __global__ void __launch_bounds__(128) attn_prefill_hd##HD(                                   \
        const bf16* q, const bf16* kv_layer, const int* qsl, const int* seq_lens, const int* block_tables,   \
        bf16* out, int T, int num_seqs, int nh, int nkv, int block_size, int max_blocks, int num_slots,      \
        float scale, int min_rows) {                                                                         \
        attn_prefill_impl<HD>(q, kv_layer, qsl, seq_lens, block_tables, out, T, num_seqs, nh, nkv,          \
                              block_size, max_blocks, num_slots, scale, min_rows); }

PREFILL_KERNEL(64)
PREFILL_KERNEL(128)

// Pipelined variant (attn_prefill_w{W}s{S}_hd{HD}): W warps = 16 W query rows of one seq and one q head a block; K/V
// tiles of 64 keys stream through an S-deep cp.async ring in dynamic shared memory (S x 2 x 64 x (HD + 8) bf16),
// K fragments by ldmatrix, V by ldmatrix.trans; scale folded into exp2; a warp skips the tiles past its last row
// and masks only the tiles that reach past its first. Grid (nh, ceil(T / 16 W) + num_seqs): block y takes the y-th
// (seq, tile) pair, a seq's tiles in reverse (its longest rows first); spare blocks zero as above.
template <int HD, int W, int STAGES>
__device__ __forceinline__ void attn_prefill_pipe_impl(
        const bf16* __restrict__ q, const bf16* __restrict__ kv_layer, const int* __restrict__ qsl,
        const int* __restrict__ seq_lens, const int* __restrict__ block_tables, bf16* __restrict__ out,
        int T, int num_seqs, int nh, int nkv, int block_size, int max_blocks, int num_slots, float scale,
        int min_rows) {
    pdl_entry();
    constexpr int LD = HD + 8, KS = HD / 16, DT = HD / 8, BQ = W * 16, NT = W * 32, TILE = PF_K * LD;
    static_assert(PF_K * (HD / 8) % NT == 0 && KS % 2 == 0, "whole copy rounds, paired k-steps");
    extern __shared__ __align__(16) bf16 kv_ring[];              // [STAGES][K tile | V tile]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, h = blockIdx.x;
    const int covered = qsl[num_seqs];
    for (int r = covered + blockIdx.y; r < T; r += gridDim.y)
        for (int d = tid; d < HD; d += NT) out[((size_t)r * nh + h) * HD + d] = 0;

    int seq, tile;
    find_tile<NT>(qsl, num_seqs, min_rows, BQ, blockIdx.y, seq, tile);
    if (seq < 0) return;
    const int n = qsl[seq + 1] - qsl[seq], Lc = seq_lens[seq], kvh = h / (nh / nkv);
    const int q0 = ((n + BQ - 1) / BQ - 1 - tile) * BQ;          // first query (within seq) of this tile
    const int max_pos = Lc - n + min(q0 + BQ, n) - 1;
    const size_t kv_stride = (size_t)nkv * HD, v_off = (size_t)num_slots * kv_stride;

    // Q fragments of this warp's 16 rows (rows past the seq's end repeat its last row, results dropped).
    const int w0 = q0 + warp * 16, ra = w0 + (lane >> 2), rb = ra + 8;
    const int rowa = qsl[seq] + min(ra, n - 1), rowb = qsl[seq] + min(rb, n - 1);
    const int posa = Lc - n + min(ra, n - 1), posb = Lc - n + min(rb, n - 1);
    const int wpos_first = Lc - n + min(w0, n - 1), wpos_last = Lc - n + min(w0 + 15, n - 1);
    u32 qa[KS][4];
    {
        const u32* pa = reinterpret_cast<const u32*>(q + ((size_t)rowa * nh + h) * HD);
        const u32* pb = reinterpret_cast<const u32*>(q + ((size_t)rowb * nh + h) * HD);
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            int c = ks * 8 + (lane & 3);
            qa[ks][0] = pa[c]; qa[ks][1] = pb[c]; qa[ks][2] = pa[c + 4]; qa[ks][3] = pb[c + 4];
        }
    }
    const int* bt = block_tables + (size_t)seq * max_blocks;
    const bf16* kv_head = kv_layer + (size_t)kvh * HD;
    auto load_tile = [&](int kt) {                               // keys past max_pos are zero-filled
        bf16* ks = kv_ring + (kt % STAGES) * 2 * TILE;
#pragma unroll
        for (int i = 0; i < PF_K * (HD / 8) / NT; i++) {
            const int c = tid + i * NT, kr = c / (HD / 8), kc = (c % (HD / 8)) * 8, p = kt * PF_K + kr;
            const bool ok = p <= max_pos;
            const size_t slot = ok ? (size_t)bt[p / block_size] * block_size + p % block_size : 0;
            const bf16* kp = kv_head + slot * kv_stride + kc;
            cp_async16(ks + kr * LD + kc, kp, ok ? 16 : 0);
            cp_async16(ks + TILE + kr * LD + kc, kp + v_off, ok ? 16 : 0);
        }
    };
    const float sl2 = scale * 1.4426950408889634f, NEG_INF = -__int_as_float(0x7f800000);
    float o[DT][4];
#pragma unroll
    for (int t = 0; t < DT; t++) { o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f; }
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.f, l_b = 0.f;       // running max in log2 units (scaled)

    const int ntiles = max_pos / PF_K + 1;
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
        const int kb = kt * PF_K;
        if (kb > wpos_last) continue;                            // every key of the tile is after this warp's rows
        const bf16* Ks = kv_ring + (kt % STAGES) * 2 * TILE;
        const bf16* Vs = Ks + TILE;

        float s[8][4];
#pragma unroll
        for (int j = 0; j < 8; j++) { s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f; }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const bf16* kr = Ks + (j * 8 + (lane & 7)) * LD + (lane >> 3) * 8;
#pragma unroll
            for (int ks = 0; ks < KS; ks += 2) {
                u32 b0, b1, b2, b3;
                ldmatrix_x4(b0, b1, b2, b3, kr + ks * 16);
                mma_bf16(s[j], qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], b0, b1);
                mma_bf16(s[j], qa[ks + 1][0], qa[ks + 1][1], qa[ks + 1][2], qa[ks + 1][3], b2, b3);
            }
        }
        if (kb + PF_K - 1 > wpos_first) {                        // the diagonal: mask keys after each row
#pragma unroll
            for (int j = 0; j < 8; j++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int key = kb + j * 8 + (lane & 3) * 2 + e;
                    if (key > posa) s[j][e] = NEG_INF;
                    if (key > posb) s[j][2 + e] = NEG_INF;
                }
            }
        }
        float mxa = NEG_INF, mxb = NEG_INF;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            mxa = fmaxf(mxa, fmaxf(s[j][0], s[j][1]));
            mxb = fmaxf(mxb, fmaxf(s[j][2], s[j][3]));
        }
#pragma unroll
        for (int o2 = 1; o2 <= 2; o2 <<= 1) {
            mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, o2));
            mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, o2));
        }
        const float na = fmaxf(m_a, mxa * sl2), nb = fmaxf(m_b, mxb * sl2);  // finite: key 0 is always visible
        const float ca = exp2f(m_a - na), cb = exp2f(m_b - nb);
        m_a = na; m_b = nb;
        float suma = 0.f, sumb = 0.f;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            s[j][0] = exp2f(fmaf(s[j][0], sl2, -na)); s[j][1] = exp2f(fmaf(s[j][1], sl2, -na));
            s[j][2] = exp2f(fmaf(s[j][2], sl2, -nb)); s[j][3] = exp2f(fmaf(s[j][3], sl2, -nb));
            suma += s[j][0] + s[j][1]; sumb += s[j][2] + s[j][3];
        }
        l_a = l_a * ca + suma; l_b = l_b * cb + sumb;
#pragma unroll
        for (int t = 0; t < DT; t++) { o[t][0] *= ca; o[t][1] *= ca; o[t][2] *= cb; o[t][3] *= cb; }

        const int qm = lane >> 3, r8 = lane & 7;
#pragma unroll
        for (int kk = 0; kk < PF_K / 16; kk++) {
            u32 a0 = pack2(s[2 * kk][0], s[2 * kk][1]), a1 = pack2(s[2 * kk][2], s[2 * kk][3]);
            u32 a2 = pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]), a3 = pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            const bf16* vr = Vs + (kk * 16 + r8 + (qm & 1) * 8) * LD + (qm >> 1) * 8;
#pragma unroll
            for (int t = 0; t < DT; t += 2) {
                u32 b0, b1, b2, b3;
                ldmatrix_x4_trans(b0, b1, b2, b3, vr + t * 8);
                mma_bf16(o[t], a0, a1, a2, a3, b0, b1);
                mma_bf16(o[t + 1], a0, a1, a2, a3, b2, b3);
            }
        }
    }
#pragma unroll
    for (int o2 = 1; o2 <= 2; o2 <<= 1) {
        l_a += __shfl_xor_sync(0xffffffffu, l_a, o2);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, o2);
    }
    const float ia = 1.f / l_a, ib = 1.f / l_b;
#pragma unroll
    for (int t = 0; t < DT; t++) {
        int col = t * 8 + (lane & 3) * 2;
        if (ra < n) *reinterpret_cast<u32*>(out + ((size_t)rowa * nh + h) * HD + col) = pack2(o[t][0] * ia, o[t][1] * ia);
        if (rb < n) *reinterpret_cast<u32*>(out + ((size_t)rowb * nh + h) * HD + col) = pack2(o[t][2] * ib, o[t][3] * ib);
    }
}

#define PREFILL_PIPE_KERNEL(HD, W, S)                                                                          \
    extern "C" __global__ void __launch_bounds__(W * 32) attn_prefill_w##W##s##S##_hd##HD(                       \
        const bf16* q, const bf16* kv_layer, const int* qsl, const int* seq_lens, const int* block_tables,   \
        bf16* out, int T, int num_seqs, int nh, int nkv, int block_size, int max_blocks, int num_slots,      \
        float scale, int min_rows) {                                                                         \
        attn_prefill_pipe_impl<HD, W, S>(q, kv_layer, qsl, seq_lens, block_tables, out, T, num_seqs, nh, nkv, \
                                         block_size, max_blocks, num_slots, scale, min_rows); }

PREFILL_PIPE_KERNEL(64, 8, 2)
PREFILL_PIPE_KERNEL(64, 8, 3)
PREFILL_PIPE_KERNEL(64, 4, 2)
PREFILL_PIPE_KERNEL(64, 4, 3)
PREFILL_PIPE_KERNEL(128, 8, 2)
PREFILL_PIPE_KERNEL(128, 8, 3)
PREFILL_PIPE_KERNEL(128, 4, 2)
PREFILL_PIPE_KERNEL(128, 4, 3)
