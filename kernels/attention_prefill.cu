// Flash-style causal prefill attention over the paged KV cache (earlier context included), varlen by
// query_start_loc, GQA by indexing (q head h reads kv head h / G). mma.sync m16n8k16 bf16, fp32 softmax.
// Block: 4 warps = 64 query rows of one seq, one q head; K/V tiles of 64 keys in shared memory.
// Grid (ceil(T / 64) + num_seqs, nh): block b takes the b-th (seq, tile) pair; spare blocks only zero rows
// covered by no seq (row >= qsl[num_seqs]), which every block does for rows r with r % gridDim.x == b.
// Seqs with fewer than min_rows query rows are skipped (min_rows 2: a mixed step's decode rows, which
// attention_decode_batched.cu computes in the same op).
#include "prefill_tiles.cuh"

#define PF_Q 64
#define PF_K 64

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
