// Persistent decode megakernel for buckets of M (1, 2) sequences: every layer of the step in one launch of one
// block per SM (grid NB = the plan's SM count, all co-resident). Per layer five phases, each ended by a grid
// barrier: (1) rmsnorm(x) -> qkv GEMV; (2) QK-norm + RoPE + KV write + split-KV attention, the last split of a
// kv head combines; (3) o_proj GEMV + residual; (4) rmsnorm(x) -> gate_up GEMV -> silu * up; (5) down GEMV +
// residual. After the last layer block 0 writes h = rmsnorm(x) * final_norm.
// Warp MK_CONSUMERS (the producer) streams every weight row the block owns, for the whole step, through an
// `stages`-deep ring of MK_STAGE_BYTES shared-memory slots (cp.async.bulk + mbarriers); it never waits for a grid
// barrier, so the next phase's weights arrive while the consumers sit at one. Block b owns rows
// [b N / NB, (b + 1) N / NB) of every matrix (gate_up: pairs j, gate row j and up row I + j).
// Data written inside the launch by other blocks (x, qkv, attn, act, partials) is read with ld.global.cg (L2).
// Rounding: every GEMV output to bf16, x + o to bf16, silu(g) * u of bf16 g, u: the unfused kernels' rules.
#include "bulk_copy.cuh"
#include "fp8.cuh"
#include "qk_rope.cuh"

// PW producer warps: 1, or 4 (a warpgroup that gives its registers to the consumers with setmaxnreg: 240 a
// consumer thread instead of the 168 ptxas allots 9 warps)
#define MK_THREADS_1 ((MK_CONSUMERS + 1) * 32)
#define MK_THREADS_4 ((MK_CONSUMERS + 4) * 32)
#define MK_REGS_CONSUMER 240
#define MK_REGS_PRODUCER 24
// setmaxnreg moves registers inside the block's launch allotment (ptxas: 168 a thread for 12 warps): the consumers'
// increase must fit what the producer warpgroup gives up, or setmaxnreg.inc waits forever (32 hung the kernel)
static_assert(MK_CONSUMERS * (MK_REGS_CONSUMER - 168) <= 4 * (168 - MK_REGS_PRODUCER), "setmaxnreg pool");
#define MK_CTHREADS (MK_CONSUMERS * 32)
// MK_STAGE_BYTES (a ring slot), MK_H_SEQ_BYTES (GEMV input a sequence / attention scratch), MK_PART_FLOATS
// (partial sums), MK_CONSUMERS (consumer warps; warp MK_CONSUMERS is the producer), MK_TILE (keys an attention
// tile, two consumer threads a key), MK_TRACE (stamps a layer: 14 phase edges, the 4 GEMVs' ring-wait sums, 4
// barrier arrivals, the producer's L2 prefetches, 3 attention edges):
// plan/kernel_constants.py, as -D options
#define MK_HD 128
// dynamic smem = stages slots + M * MK_H_SEQ_BYTES + part + 2 * stages mbarriers + 64 floats (plan/megakernel_plan.py)

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void csync() { asm volatile("bar.sync 1, %0;" :: "n"(MK_CTHREADS) : "memory"); }
__device__ __forceinline__ vec16 ld_l2(const void* p) {
    vec16 v;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ float ld_l2_bf(const bf16* p) {
    unsigned short v;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return bf2f(v);
}
__device__ __forceinline__ float ld_l2_f(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ void ld_stream8(const void* p, u32& a, u32& b) {
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(a), "=r"(b) : "l"(p));
}

// A shared-memory float4 the compiler may not hoist out of the tile loop (it would keep all of q in registers).
__device__ __forceinline__ float4 lds_f4(const float* p) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(smem_addr(p)));
    return v;
}

// Block-wide (consumer threads) sum; every consumer gets it. scratch: >= MK_CONSUMERS floats.
__device__ __forceinline__ float csum(float v, float* scratch) {
    v = warp_sum(v);
    csync();
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    csync();
    float t = (threadIdx.x & 31) < MK_CONSUMERS ? scratch[threadIdx.x & 31] : 0.f;
    return warp_sum(t);
}

// Grid barrier over NB blocks: a monotonic 64-bit counter (a multiple of NB between launches); barrier k of this
// launch completes at base + k NB.
__device__ __forceinline__ void grid_sync(long long* ctr, u64 target) {
    csync();
    if (threadIdx.x == 0) {
        __threadfence();
        asm volatile("red.release.gpu.global.add.u64 [%0], 1;" :: "l"(ctr) : "memory");
        u64 v;
        do { asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(ctr) : "memory"); } while (v < target);
    }
    csync();
}

struct Ring { u64* full; u64* empty; char* slots; int stages, stage; u32 phase; };
__device__ __forceinline__ void ring_next(Ring& r) { if (++r.stage == r.stages) { r.stage = 0; r.phase ^= 1u; } }

// Weights: Q 0 bf16; 1 e4m3 with a float32 scale a row (fp8_channel); 2 e4m3 with one a 128 x 128 block
// (fp8_block128, scale[row / 128][k / 128]). WB: bytes a weight.
template <int Q> struct Wt { static constexpr int WB = Q ? 1 : 2; };

// Rows per ring slot of a K-wide matrix: a power of two <= 8 (a slot's rows split the 8 consumer warps evenly).
template <int Q>
__device__ __forceinline__ int slot_rows(int K) {
    int r = MK_STAGE_BYTES / (Wt<Q>::WB * K);
    return r >= 8 ? 8 : r >= 4 ? 4 : r >= 2 ? 2 : 1;
}

// One ring slot's copies: `rows` pieces of `bytes` from src (step bytes apart) to the slot at `pitch` apart, and
// from src2 (the up rows of a gate_up slot) from slot row `up` on. Unpadded slots: one piece of all the rows.
struct Chunk { const char* src; const char* src2; u32 rows, bytes, pitch, up; };

// FP8 through the tensor cores (TC): slot rows padded by MK_ROW_PAD bytes (plan/kernel_constants.py), so the 8 rows'
// u32 reads of one k offset fall in 8 different bank groups (an unpadded row is a multiple of 128 B).
template <int Q, bool TC>
__device__ __forceinline__ int row_pitch(int K) { return K * Wt<Q>::WB + (TC ? MK_ROW_PAD : 0); }
// Warps that share one row (each sums its part of K): TC every consumer warp takes K / MK_CONSUMERS of every row.
template <int Q, bool TC>
__device__ __forceinline__ int warps_per_row(int K) { return TC ? MK_CONSUMERS : MK_CONSUMERS / slot_rows<Q>(K); }

// Consumers: the same slots in the same order; part[(local row * wpr + warp part) * M + m] = partial dot.
// Local rows: plain, j - r0; gate, 2 (j - r0) (gate) and 2 (j - r0) + 1 (up).
__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

// Slot row sr of the slot that starts at global row j (gate_up: `step` gate rows, then their up rows): pair = its
// index among the slot's rows of one kind, grow its global row, lr its local row in part[] (plain j - r0 + pair;
// gate_up 2 (j - r0 + pair) + up).
struct SlotRow { int pair, grow, lr; bool up; };
__device__ __forceinline__ SlotRow slot_row(int sr, int j, int r0, int step, bool gate, int up_off) {
    const bool up = gate && sr >= step;
    const int pair = up ? sr - step : sr;
    return {pair, (up ? up_off : 0) + j + pair, gate ? 2 * (j - r0 + pair) + (up ? 1 : 0) : j - r0 + pair, up};
}

// FP8 scales of one GEMV phase in shared memory (stage_scales): lo the block's rows (gate_up: its gate rows), up its
// up rows; base: the first row (Q 1) or 128-row block (Q 2) each holds. scale_row: the scales of global row grow.
struct ScaleView { const float *lo, *up; int base_lo, base_up; };
template <int Q>
__device__ __forceinline__ const float* scale_row(const ScaleView& v, const SlotRow& sr, int K) {
    const int i = (Q == 2 ? sr.grow >> 7 : sr.grow) - (sr.up ? v.base_up : v.base_lo);
    return (sr.up ? v.up : v.lo) + (Q == 2 ? i * (K >> 7) : i);
}

// The ring slot the consumers read next, once its copies landed (wait_ns: add the wait); release: all warps done.
__device__ __forceinline__ const char* slot_acquire(Ring& r, u64* wait_ns) {
    const u64 t0 = wait_ns ? now_ns() : 0;
    mbar_wait(&r.full[r.stage], r.phase);
    if (wait_ns) *wait_ns += now_ns() - t0;
    return r.slots + (size_t)r.stage * MK_STAGE_BYTES;
}
__device__ __forceinline__ void slot_release(Ring& r) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(&r.empty[r.stage]);
    ring_next(r);
}

// Dot products of this lane's chunks of one slot row with the M inputs in hs: acc[m] (fp32). FP8 block scales
// (srow: the row's scales, one a 128-k block) are applied to each 16-weight chunk's sum.
template <int M, int Q>
__device__ __forceinline__ void row_dots(const char* wrow, const bf16* hs, int K, int v0, int vstep,
                                         const float* srow, float* acc) {
    if (Q == 0) {
        const bf16* w = (const bf16*)wrow;
#pragma unroll 4
        for (int v = v0; v < K / 8; v += vstep) {
            float a[8]; unpack8(ld16(w + v * 8), a);
#pragma unroll
            for (int m = 0; m < M; m++) {
                float x[8]; unpack8(ld16(hs + (size_t)m * K + v * 8), x);
#pragma unroll
                for (int i = 0; i < 8; i++) acc[m] += a[i] * x[i];
            }
        }
    } else {
#pragma unroll 2
        for (int v = v0; v < K / 16; v += vstep) {
            const vec16 wv = ld16(wrow + v * 16);
            float a[16];
            e4m3x4_f32(wv.x, a); e4m3x4_f32(wv.y, a + 4); e4m3x4_f32(wv.z, a + 8); e4m3x4_f32(wv.w, a + 12);
            const float sb = Q == 2 ? srow[v >> 3] : 1.f;
#pragma unroll
            for (int m = 0; m < M; m++) {
                float x[16], d = 0.f;
                unpack8(ld16(hs + (size_t)m * K + v * 16), x); unpack8(ld16(hs + (size_t)m * K + v * 16 + 8), x + 8);
#pragma unroll
                for (int i = 0; i < 16; i++) d += a[i] * x[i];
                acc[m] += Q == 2 ? d * sb : d;
            }
        }
    }
}

// sc: the matrix's scales (Q > 0); rows j of the slot are global rows j (plain) or j and up_off + j (gate_up).
template <int M, int Q>
__device__ __forceinline__ void consume(Ring& r, const bf16* hs, float* part, int r0, int r1, int K, bool gate,
                                        const ScaleView& sc, int up_off, u64* wait_ns = nullptr) {
    const int rc = slot_rows<Q>(K), step = gate ? rc / 2 : rc, wpr = MK_CONSUMERS / rc;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, row = warp / wpr, wp = warp % wpr;
    for (int j = r0; j < r1; j += step) {
        const int n = min(step, r1 - j);
        const char* slot = slot_acquire(r, wait_ns);
        const SlotRow sr = slot_row(row, j, r0, step, gate, up_off);
        if (sr.pair < n) {
            const char* w = slot + (size_t)row * K * Wt<Q>::WB;
            const float* srow = Q ? scale_row<Q>(sc, sr, K) : nullptr;
            const float sch = Q == 1 ? *srow : 1.f;
            float acc[M];
#pragma unroll
            for (int m = 0; m < M; m++) acc[m] = 0.f;
            row_dots<M, Q>(w, hs, K, wp * 32 + lane, wpr * 32, srow, acc);
#pragma unroll
            for (int m = 0; m < M; m++) {
                const float s = warp_sum(acc[m]);
                if (lane == 0) part[(sr.lr * wpr + wp) * M + m] = Q == 1 ? s * sch : s;
            }
        }
        slot_release(r);
    }
}

// FP8 rows through the tensor cores (one sequence). A slot's rc rows (pitch row_pitch) are the m16 side of mma.sync
// m16n8k16: A row m = (slot row m % rc, block slot m / rc); the input's 128-k blocks are the n8 side (column s:
// block slot s), so C[m][m / rc] are the dot products and the rest is discarded (every mma moves 256 weights).
// Warp w takes the 128-k blocks w + 8 j (j < K / 1024) of every row, TC_G = 16 / rc of them an iteration (at most
// two). Inside 16 k the fragments' logical k (2t, 2t + 1) / (2t + 8, 2t + 9) (t = lane % 4) are physical
// k 4t .. 4t + 3 of both operands (one u32 of e4m3, one uint2 of f16); block slot s visits its eight 16-k chunks
// rotated by tc_rot(rc) s, so the eight A rows of a load hit eight bank groups. f16 operands: e4m3 -> f16 exactly,
// the input x 2^-4 in f16 (norm_to_smem / copy_to_smem <M, true>), undone in fp32.
__device__ __forceinline__ int tc_rot(int rc) { return rc == 8 ? 2 : rc; }

// f0 / f1: the scales of this lane's C entries e 0 (A row g) / 1 (g + 8) in iteration 0, f2 / f3 in iteration 1;
// 0 where the entry is not this lane's, its row is past the slot or its block past K. ch: the row's channel scale.
struct TcScales { float f0, f1, f2, f3, ch; };
template <int Q, int RC>
__device__ __forceinline__ TcScales tc_scales(const ScaleView& sc, int j, int r0, int r1, int step, bool gate,
                                              int up_off, int K, int row, int s0, int s1, bool e0, bool e1) {
    const int G = 16 / RC, nb = K / (MK_CONSUMERS * 128), warp = threadIdx.x >> 5;
    const SlotRow sr = slot_row(row, j, r0, step, gate, up_off);
    const bool ok = sr.pair < min(step, r1 - j);
    const float* srow = ok ? scale_row<Q>(sc, sr, K) + (Q == 2 ? warp : 0) : nullptr;
    auto f = [&](bool e, int jj) { return ok && e && jj < nb ? (Q == 2 ? srow[8 * jj] : 1.f) : 0.f; };
    return {f(e0, s0), f(e1, s1), f(e0, G + s0), f(e1, G + s1), Q == 1 && ok ? *srow : 1.f};
}

template <int Q, int RC>
__device__ __forceinline__ void consume_tc_rc(Ring& r, const bf16* hs, float* part, int r0, int r1, int K, bool gate,
                                              const ScaleView& sc, int up_off, u64* wait_ns) {
    constexpr int rc = RC;
    const int step = gate ? rc / 2 : rc, pitch = row_pitch<Q, true>(K);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int G = 16 / rc, nb = K / (MK_CONSUMERS * 128), rs = tc_rot(rc);
    const int row = g % rc, s0 = g / rc, s1 = (g + 8) / rc, sb = g % G;
    const bool e0 = (s0 >> 1) == t, e1 = (s1 >> 1) == t;     // C[g][s0] is c[s0 & 1], C[g + 8][s1] c[2 + (s1 & 1)]
    for (int j = r0; j < r1; j += step) {
        const TcScales f = tc_scales<Q, RC>(sc, j, r0, r1, step, gate, up_off, K, row, s0, s1, e0, e1);
        const char* slot = slot_acquire(r, wait_ns);
        const char* wrow = slot + (size_t)row * pitch + 4 * t;
        float v = 0.f;
#pragma unroll
        for (int it = 0; it < 2; it++) {
            if (it * G < nb) {
                const char* w0 = wrow + 128 * (warp + 8 * min(it * G + s0, nb - 1));
                const char* w1 = wrow + 128 * (warp + 8 * min(it * G + s1, nb - 1));
                const bf16* xb = hs + 4 * t + 128 * (warp + 8 * min(it * G + sb, nb - 1));
                float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int q = 0; q < 8; q++) {
                    const u32 wa = *(const u32*)(w0 + 16 * ((q + rs * s0) & 7));
                    const u32 wb = *(const u32*)(w1 + 16 * ((q + rs * s1) & 7));
                    const uint2 xv = *(const uint2*)(xb + 16 * ((q + rs * sb) & 7));
                    u32 a0, a1, a2, a3;
                    e4m3x4_f16x4(wa, a0, a2);
                    e4m3x4_f16x4(wb, a1, a3);
                    mma_f16(q & 1 ? d1 : d0, a0, a1, a2, a3, xv.x, xv.y);
                }
                const float c0 = (s0 & 1) ? d0[1] + d1[1] : d0[0] + d1[0];
                const float c1 = (s1 & 1) ? d0[3] + d1[3] : d0[2] + d1[2];
                const float fa = it ? f.f2 : f.f0, fb = it ? f.f3 : f.f1;
                v += (fa != 0.f ? c0 * fa : 0.f) + (fb != 0.f ? c1 * fb : 0.f);
            }
        }
        // sum over the lanes of one slot row: t, and the bits of g above rc
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        for (int mk = 4 * rc; mk < 32; mk <<= 1) v += __shfl_xor_sync(0xffffffffu, v, mk);
        const SlotRow sr = slot_row(row, j, r0, step, gate, up_off);
        if (t == 0 && g < rc && sr.pair < min(step, r1 - j))
            part[sr.lr * MK_CONSUMERS + warp] = v * FP8_F16_UNSCALE * f.ch;
        slot_release(r);
    }
}

// rc (rows a slot: 8, 4 or 2, plan rule megakernel_plan.check_shapes) as a constant of the loop
template <int M, int Q>
__device__ __forceinline__ void consume_tc(Ring& r, const bf16* hs, float* part, int r0, int r1, int K, bool gate,
                                           const ScaleView& sc, int up_off, u64* wait_ns) {
    static_assert(M == 1, "FP8 rows on the tensor cores: one sequence");
    const int rc = slot_rows<Q>(K);
    if (rc == 8) consume_tc_rc<Q, 8>(r, hs, part, r0, r1, K, gate, sc, up_off, wait_ns);
    else if (rc == 4) consume_tc_rc<Q, 4>(r, hs, part, r0, r1, K, gate, sc, up_off, wait_ns);
    else consume_tc_rc<Q, 2>(r, hs, part, r0, r1, K, gate, sc, up_off, wait_ns);
}

// Sum of the wpr partials of local row lr, sequence m.
template <int M>
__device__ __forceinline__ float part_sum(const float* part, int lr, int wpr, int m) {
    float s = 0.f;
    for (int p = 0; p < wpr; p++) s += part[(lr * wpr + p) * M + m];
    return s;
}

// hs[m] = rmsnorm(x[m]) * w (bf16), from x in global memory (L2); the same value in every block.
// One L2 round trip: a thread keeps its MK_NORM_NV chunks of every row and of w in registers (H <= 8192).
#define MK_NORM_NV 4
template <int M, bool F16 = false>
__device__ __forceinline__ void norm_to_smem(const bf16* x, const bf16* w, bf16* hs, int H, float eps,
                                             float* scratch) {
    vec16 xv[M][MK_NORM_NV], wv[MK_NORM_NV];
#pragma unroll
    for (int j = 0; j < MK_NORM_NV; j++) {
        const int v = threadIdx.x + j * MK_CTHREADS;
        if (v < H / 8) {
            wv[j] = ld16(w + v * 8);
#pragma unroll
            for (int m = 0; m < M; m++) xv[m][j] = ld_l2(x + (size_t)m * H + v * 8);
        }
    }
#pragma unroll
    for (int m = 0; m < M; m++) {
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < MK_NORM_NV; j++) {
            if (threadIdx.x + j * MK_CTHREADS < H / 8) {
                float f[8]; unpack8(xv[m][j], f);
#pragma unroll
                for (int i = 0; i < 8; i++) ss += f[i] * f[i];
            }
        }
        const float inv = rsqrtf(csum(ss, scratch + 8 * m) / (float)H + eps);
#pragma unroll
        for (int j = 0; j < MK_NORM_NV; j++) {
            const int v = threadIdx.x + j * MK_CTHREADS;
            if (v < H / 8) {
                float f[8], g[8]; unpack8(xv[m][j], f); unpack8(wv[j], g);
#pragma unroll
                for (int i = 0; i < 8; i++) g[i] = f[i] * inv * g[i];
                st16(hs + (size_t)m * H + v * 8, F16 ? bf16x8_f16x8_scaled(pack8(g)) : pack8(g));
            }
        }
    }
    csync();
}

template <int M, bool F16 = false>
__device__ __forceinline__ void copy_to_smem(const bf16* src, bf16* hs, int K) {
    for (int v = threadIdx.x; v < M * K / 8; v += MK_CTHREADS) {
        const vec16 x = ld_l2(src + v * 8);
        st16(hs + v * 8, F16 ? bf16x8_f16x8_scaled(x) : x);
    }
    csync();
}

// The attention work of one block for the whole step (seq m, kv head kvh, keys [k0, k1) of split s of S).
struct AttnItem { int m, kvh, s, S, ctx, k0, k1, slot, pos; bool live; };

struct Args {
    bf16* x; bf16* h_out; bf16* qkv; bf16* attn; bf16* act;
    const bf16 *in_norm, *q_norm, *k_norm, *post_norm, *final_norm;
    const char *w_qkv, *w_o, *w_gu, *w_down;   // bf16 or e4m3 (Q)
    const float *s_qkv, *s_o, *s_gu, *s_down;  // their scales (Q > 0), else null
    u64 layer_stride;                          // bf16 elements between layer l and l + 1 of every layer weight
    const float *cos_t, *sin_t; const int *positions, *seq_lens, *slot_mapping, *block_tables;
    bf16* kv; float* part_o; float* part_ml; int* counters; long long* bar;
    long long* trace;                          // null, or [NB][layers][MK_TRACE] globaltimer stamps (ns) of thread 0
    int layers, H, I, nh, nkv, block_size, max_blocks, num_slots, smax, stages, l2_ahead,
        kv_prefetch;
    float eps, scale;
};

// This block's rows and its slots a layer (qkv, o, gate_up, down), from blockIdx.
struct Rows { int q0, q1, h0, h1, i0, i1, nq, no, ng, nd; };

template <int Q>
__device__ __forceinline__ Rows block_rows(const Args& a) {
    Rows r;
    const int NB = gridDim.x, b = blockIdx.x, nqkv = (a.nh + 2 * a.nkv) * MK_HD, rh = slot_rows<Q>(a.H);
    const int ro = slot_rows<Q>(a.nh * MK_HD), rd = slot_rows<Q>(a.I);
    r.q0 = (int)((long long)b * nqkv / NB); r.q1 = (int)((long long)(b + 1) * nqkv / NB);
    r.h0 = (int)((long long)b * a.H / NB); r.h1 = (int)((long long)(b + 1) * a.H / NB);
    r.i0 = (int)((long long)b * a.I / NB); r.i1 = (int)((long long)(b + 1) * a.I / NB);
    r.nq = (r.q1 - r.q0 + rh - 1) / rh; r.no = (r.h1 - r.h0 + ro - 1) / ro;
    r.ng = (r.i1 - r.i0 + rh / 2 - 1) / (rh / 2);
    r.nd = (r.h1 - r.h0 + rd - 1) / rd;
    return r;
}

// Slot c of the block's whole-step sequence: per layer its qkv, o_proj, gate_up, down rows in slot_rows steps.
template <int Q, bool TC>
__device__ __forceinline__ Chunk slot_copy(const char* src, const char* src2, int n, int K, int up) {
    const u32 row = (u32)K * Wt<Q>::WB;
    return TC ? Chunk{src, src2, (u32)n, row, (u32)row_pitch<Q, TC>(K), (u32)up}
              : Chunk{src, src2, 1u, (u32)n * row, row, (u32)up};
}

template <int Q, bool TC>
__device__ __forceinline__ Chunk chunk_at(const Args& a, const Rows& r, int c) {
    constexpr int WB = Wt<Q>::WB;
    const int per = r.nq + r.no + r.ng + r.nd, l = c / per, rh = slot_rows<Q>(a.H);
    int i = c % per;
    const size_t lb = (size_t)l * a.layer_stride * 2;             // bytes
    if (i < r.nq) {
        const int j = r.q0 + i * rh;
        return slot_copy<Q, TC>(a.w_qkv + lb + (size_t)j * a.H * WB, nullptr, min(rh, r.q1 - j), a.H, 0);
    }
    i -= r.nq;
    if (i < r.no) {
        const int ko = a.nh * MK_HD, ro = slot_rows<Q>(ko), j = r.h0 + i * ro;
        return slot_copy<Q, TC>(a.w_o + lb + (size_t)j * ko * WB, nullptr, min(ro, r.h1 - j), ko, 0);
    }
    i -= r.no;
    if (i < r.ng) {
        const int step = rh / 2, j = r.i0 + i * step;
        return slot_copy<Q, TC>(a.w_gu + lb + (size_t)j * a.H * WB, a.w_gu + lb + (size_t)(a.I + j) * a.H * WB,
                                min(step, r.i1 - j), a.H, step);
    }
    i -= r.ng;
    const int rd = slot_rows<Q>(a.I), j = r.h0 + i * rd;
    return slot_copy<Q, TC>(a.w_down + lb + (size_t)j * a.I * WB, nullptr, min(rd, r.h1 - j), a.I, 0);
}

// The FP8 scales a block reads in a layer, staged into shared memory one layer ahead: five segments (qkv, o_proj,
// gate, up, down rows of the block), each the scale rows of its 128-row blocks (Q 2) or its rows' scales (Q 1).
// scale_seg: segment k's first float in the layer's scale tensor, count, offset in the buffer, first row (block).
struct ScaleSeg { int src, n, off, base; };
template <int Q>
__device__ __forceinline__ ScaleSeg scale_seg(const Args& a, const Rows& r, int k) {
    const int K[5] = {a.H, a.nh * MK_HD, a.H, a.H, a.I};
    const int lo[5] = {r.q0, r.h0, r.i0, a.I + r.i0, r.h0}, hi[5] = {r.q1, r.h1, r.i1, a.I + r.i1, r.h1};
    ScaleSeg g{0, 0, 0, 0};
    for (int i = 0; i <= k; i++) {
        g.off += g.n;
        g.base = Q == 2 ? lo[i] >> 7 : lo[i];
        g.n = hi[i] <= lo[i] ? 0 : Q == 2 ? (((hi[i] - 1) >> 7) - g.base + 1) * (K[i] >> 7) : hi[i] - lo[i];
        g.src = Q == 2 ? g.base * (K[i] >> 7) : g.base;
    }
    return g;
}
// Consumer threads copy the segments of the layer whose scales start at ls (float elements) into buf (cp.async,
// one commit group).
template <int Q>
__device__ __forceinline__ void stage_scales(const Args& a, const Rows& r, size_t ls, float* buf) {
#pragma unroll 1
    for (int k = 0; k < 5; k++) {
        const ScaleSeg g = scale_seg<Q>(a, r, k);
        const float* src = (k == 0 ? a.s_qkv : k == 1 ? a.s_o : k == 4 ? a.s_down : a.s_gu) + ls + g.src;
        for (int i = threadIdx.x; i < g.n; i += MK_CTHREADS)
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(smem_addr(buf + g.off + i)), "l"(src + i)
                         : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}
// Phase p's view (0 qkv, 1 o_proj, 2 gate_up, 3 down) of a staged buffer.
template <int Q>
__device__ __forceinline__ ScaleView scale_view(const Args& a, const Rows& r, const float* buf, int p) {
    const ScaleSeg g = scale_seg<Q>(a, r, p < 3 ? p : 4);
    const ScaleSeg u = p == 2 ? scale_seg<Q>(a, r, 3) : g;
    return {buf + g.off, buf + u.off, g.base, u.base};
}

__device__ __forceinline__ void prefetch_l2(const void* p, u32 bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
}

__device__ __forceinline__ bool mbar_test(u64* b, u32 parity) {
    u32 ok;
    asm volatile("{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}" : "=r"(ok) : "r"(smem_addr(b)), "r"(parity) : "memory");
    return ok;
}

// try_wait that gives up after about hint_ns (the thread sleeps meanwhile instead of spinning)
__device__ __forceinline__ bool mbar_try(u64* b, u32 parity, u32 hint_ns) {
    u32 ok;
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n"
                 " selp.u32 %0, 1, 0, p;\n}" : "=r"(ok) : "r"(smem_addr(b)), "r"(parity), "r"(hint_ns) : "memory");
    return ok;
}

// Producer: every slot of the step in order. While every slot holds landed, unconsumed rows (the consumers at a
// grid barrier or in attention: this SM's DRAM stream idle) it prefetches the next l2_ahead slots' rows into L2,
// one slot a poll, so the stream goes on through the wait; while copies are in flight it prefetches nothing (a
// look-ahead racing its own copies was slower). A prefetched slot's copy later hits L2.
template <int Q, bool TC>
__device__ __forceinline__ void produce_all(Ring& r, const Args& a, const Rows& rows, u64 policy) {
    const int per = rows.nq + rows.no + rows.ng + rows.nd, total = a.layers * per;
    int pf = 0;                                   // slots [c, pf) are prefetched
    int npf = 0, lpf = -1;                        // trace: prefetches of layer lpf so far
    long long* tr = a.trace ? a.trace + (size_t)blockIdx.x * a.layers * MK_TRACE + 22 : nullptr;
    if (tr) for (int l = 0; l < a.layers; l++) tr[(size_t)l * MK_TRACE] = 0;
    for (int c = 0; c < total; c++) {
        const Chunk ch = chunk_at<Q, TC>(a, rows, c);
        if (pf < c) pf = c;
        // the newest slot issued (the one before r.stage) and the parity its copy completes
        const int nw = r.stage ? r.stage - 1 : r.stages - 1;
        const u32 np = r.stage ? r.phase : r.phase ^ 1u;
        while (!mbar_try(&r.empty[r.stage], r.phase ^ 1u, 512)) {
            if (pf < c + a.l2_ahead && pf < total && mbar_test(&r.full[nw], np)) {
                const Chunk f = chunk_at<Q, TC>(a, rows, pf++);
                prefetch_l2(f.src, f.rows * f.bytes);
                if (f.src2) prefetch_l2(f.src2, f.rows * f.bytes);
                if (tr) {
                    const int pl = (pf - 1) / per;
                    npf = pl == lpf ? npf + 1 : 1;
                    lpf = pl;
                    tr[(size_t)pl * MK_TRACE] = npf;
                }
            }
        }
        char* dst = r.slots + (size_t)r.stage * MK_STAGE_BYTES;
        mbar_expect_tx(&r.full[r.stage], ch.rows * ch.bytes * (ch.src2 ? 2 : 1));
        for (u32 i = 0; i < ch.rows; i++) {
            bulk_load(dst + i * ch.pitch, ch.src + i * ch.bytes, ch.bytes, &r.full[r.stage], policy);
            if (ch.src2)
                bulk_load(dst + (ch.up + i) * ch.pitch, ch.src2 + i * ch.bytes, ch.bytes, &r.full[r.stage], policy);
        }
        ring_next(r);
    }
}

// Registers of an attention tile: half of this thread's key row (key t / 2, dims 64 (t % 2) ..) and its warp's
// V rows (4 dims a lane, keys w + 8 i).
struct KVTile { vec16 k[MK_HD / 16]; u32 v[MK_TILE / MK_CONSUMERS][2]; };

__device__ __forceinline__ size_t key_slot(const Args& a, const AttnItem& it, int p) {
    return (size_t)a.block_tables[(size_t)it.m * a.max_blocks + p / a.block_size] * a.block_size + p % a.block_size;
}

__device__ __forceinline__ void load_tile(const Args& a, const AttnItem& it, const bf16* kvl, int t0, KVTile& t) {
    const size_t stride = (size_t)a.nkv * MK_HD;
    const bf16* kb = kvl + (size_t)it.kvh * MK_HD;
    const bf16* vb = kvl + (size_t)a.num_slots * stride + (size_t)it.kvh * MK_HD;
    const int p = t0 + (threadIdx.x >> 1);
    if (p < it.k1 && p != it.ctx - 1) {
        const bf16* kr = kb + key_slot(a, it, p) * stride + (threadIdx.x & 1) * (MK_HD / 2);
#pragma unroll
        for (int e = 0; e < MK_HD / 16; e++) t.k[e] = ld_stream(kr + e * 8);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int i = 0; i < MK_TILE / MK_CONSUMERS; i++) {
        const int q = t0 + warp + MK_CONSUMERS * i;
        if (q < it.k1 && q != it.ctx - 1) ld_stream8(vb + key_slot(a, it, q) * stride + lane * 4, t.v[i][0], t.v[i][1]);
    }
}

// L2 prefetch of the split's keys from p0 on (K and V rows): a.kv_prefetch 0, prefetch.global.L2 of each 128-B
// line; 1, one cp.async.bulk.prefetch.L2 (the copy engine) of each 256-B row.
__device__ __forceinline__ void prefetch_keys(const Args& a, const AttnItem& it, const bf16* kvl, int p0) {
    const size_t stride = (size_t)a.nkv * MK_HD;
    for (int p = p0 + (threadIdx.x >> 1); p < it.k1; p += MK_CTHREADS / 2) {
        const bf16* k = kvl + key_slot(a, it, p) * stride + (size_t)it.kvh * MK_HD;
        const bf16* v = k + (size_t)a.num_slots * stride;
        if (a.kv_prefetch == 1) {
            prefetch_l2(threadIdx.x & 1 ? v : k, MK_HD * 2);
        } else {
            asm volatile("prefetch.global.L2 [%0];" :: "l"(k + (threadIdx.x & 1) * (MK_HD / 2)));
            asm volatile("prefetch.global.L2 [%0];" :: "l"(v + (threadIdx.x & 1) * (MK_HD / 2)));
        }
    }
}

// What a warp's attention task needs that no op of the step writes, loaded before the qkv barrier: the RoPE
// tables at the item's position and the QK-norm weights of its head (task = warp: q heads 0..G-1, k, v).
struct AttnConst { float cs[MK_HD / 64], sn[MK_HD / 64], nw[MK_HD / 32]; };

template <int G>
__device__ __forceinline__ void attn_const(const Args& a, const AttnItem& it, int layer, AttnConst& c) {
    const int lane = threadIdx.x & 31, task = threadIdx.x >> 5;
    rope_load<MK_HD>(a.cos_t, a.sin_t, it.pos, lane, c.cs, c.sn);
    const bf16* w = a.q_norm ? (task < G ? a.q_norm : a.k_norm) + (size_t)layer * a.layer_stride : nullptr;
#pragma unroll
    for (int e = 0; e < MK_HD / 32; e++) c.nw[e] = w && task <= G ? bf2f(w[lane + 32 * e]) : 0.f;
}

// L2 prefetch of everything the item's attention reads that no op of the step writes (its keys, the RoPE rows,
// the QK-norm weights), issued at the layer's start so that it has landed when the qkv barrier passes.
__device__ __forceinline__ void prefetch_attention(const Args& a, const AttnItem& it, int layer) {
    prefetch_keys(a, it, a.kv + (size_t)layer * 2 * a.num_slots * a.nkv * MK_HD, it.k0);
    const int t = threadIdx.x;
    if (t < 8) {                                   // 8 lines of 128 B: cos, sin rows (256 B), q / k norm weights
        const char* p = t < 2 ? (const char*)(a.cos_t + (size_t)it.pos * (MK_HD / 2)) + 128 * t
                      : t < 4 ? (const char*)(a.sin_t + (size_t)it.pos * (MK_HD / 2)) + 128 * (t - 2)
                      : a.q_norm ? (const char*)((t < 6 ? a.q_norm : a.k_norm) + (size_t)layer * a.layer_stride)
                                   + 128 * (t % 2) : nullptr;
        if (p) asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
    }
}

// Phase 2 for one block (consumer threads): q / new k, v from the qkv row, online softmax over the split's tiles
// (the first in t: TL 1 loaded before the qkv barrier, TL 2 issued here before q, k, v are read, TL 0 after),
// then the split's (o, m, l) or, for one split, the output; the last split combines.
template <int M, int G, int TL>
__device__ __forceinline__ void attention_phase(const Args& a, const AttnItem& it, int layer, KVTile& t,
                                                const AttnConst& c, float* sm, long long* tr) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nh = a.nh;
    float* qs = sm;                             // [G][HD] rounded q
    float* kn = qs + G * MK_HD;                 // [HD] new k, then [HD] new v
    float* vn = kn + MK_HD;
    float* ps = vn + MK_HD;                     // [G][TILE] probabilities
    float* red = ps + G * MK_TILE;              // [CONSUMERS][G] maxima, then [CONSUMERS][G][HD + 1] sums
    float* flag = red + MK_CONSUMERS * G * (MK_HD + 1);
    bf16* out = a.attn + (size_t)it.m * nh * MK_HD + (size_t)it.kvh * G * MK_HD;
    if (it.ctx <= 0) {                         // padding row: zeros
        for (int i = threadIdx.x; i < G * MK_HD; i += MK_CTHREADS) out[i] = 0;
        return;
    }
    const bf16* kvl = a.kv + (size_t)layer * 2 * a.num_slots * a.nkv * MK_HD;
    if (TL == 2) load_tile(a, it, kvl, it.k0, t);  // in flight while q, k, v are prepared
    const bool last = it.k1 == it.ctx;
    const bf16* row = a.qkv + (size_t)it.m * (nh + 2 * a.nkv) * MK_HD;
    static_assert(G + 2 <= MK_CONSUMERS, "one attention task a warp (attn_const)");
    for (int task = warp; task < G + (last ? 2 : 0); task += MK_CONSUMERS) {
        float x[MK_HD / 32], y[MK_HD / 32];
        const int head = task < G ? it.kvh * G + task : task == G ? nh + it.kvh : nh + a.nkv + it.kvh;
#pragma unroll
        for (int e = 0; e < MK_HD / 32; e++) x[e] = ld_l2_bf(row + (size_t)head * MK_HD + lane + 32 * e);
        if (task <= G) {
            qk_norm_rope_head_w<MK_HD>(x, a.q_norm ? c.nw : nullptr, c.cs, c.sn, a.eps, lane, y);
        } else {
#pragma unroll
            for (int e = 0; e < MK_HD / 32; e++) y[e] = x[e];
        }
        float* dst = task < G ? qs + task * MK_HD : task == G ? kn : vn;
        bf16* cache = nullptr;
        if (task >= G && it.slot >= 0)
            cache = a.kv + (size_t)(layer * 2 + task - G) * a.num_slots * a.nkv * MK_HD
                    + ((size_t)it.slot * a.nkv + it.kvh) * MK_HD;
#pragma unroll
        for (int e = 0; e < MK_HD / 32; e++) {
            const bf16 b = f2bf(y[e]);
            dst[lane + 32 * e] = bf2f(b);
            if (cache) cache[lane + 32 * e] = b;
        }
    }
    csync();
    if (tr) tr[23] = (long long)now_ns();
    const float sl2 = a.scale * 1.4426950408889634f;
    float m_run[G], l_run[G], acc[G][4];
#pragma unroll
    for (int g = 0; g < G; g++) {
        m_run[g] = -1e30f; l_run[g] = 0.f;
        acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = 0.f;
    }
    for (int t0 = it.k0; t0 < it.k1; t0 += MK_TILE) {
        if (TL == 0 || t0 != it.k0) load_tile(a, it, kvl, t0, t);
        const int p = t0 + (threadIdx.x >> 1), half = (threadIdx.x & 1) * (MK_HD / 2);
        float s[G];
#pragma unroll
        for (int g = 0; g < G; g++) s[g] = 0.f;
        if (p < it.k1) {
#pragma unroll
            for (int e = 0; e < MK_HD / 16; e++) {
                float kf[8];
                if (p == it.ctx - 1) {
#pragma unroll
                    for (int i = 0; i < 8; i++) kf[i] = kn[half + e * 8 + i];
                } else {
                    unpack8(t.k[e], kf);
                }
#pragma unroll
                for (int g = 0; g < G; g++) {
                    const float4 q0 = lds_f4(qs + g * MK_HD + half + e * 8);
                    const float4 q1 = lds_f4(qs + g * MK_HD + half + e * 8 + 4);
                    s[g] += q0.x * kf[0] + q0.y * kf[1] + q0.z * kf[2] + q0.w * kf[3]
                          + q1.x * kf[4] + q1.y * kf[5] + q1.z * kf[6] + q1.w * kf[7];
                }
            }
        }
#pragma unroll
        for (int g = 0; g < G; g++) {
            s[g] += __shfl_xor_sync(0xffffffffu, s[g], 1);
            s[g] = p < it.k1 ? s[g] * sl2 : -1e30f;
        }
        float mt[G];
#pragma unroll
        for (int g = 0; g < G; g++) {
            const float v = warp_max(s[g]);
            if (lane == 0) red[warp * G + g] = v;
        }
        csync();
#pragma unroll
        for (int g = 0; g < G; g++) {
            float v = red[g];
            for (int w = 1; w < MK_CONSUMERS; w++) v = fmaxf(v, red[w * G + g]);
            const float mn = fmaxf(m_run[g], v), alpha = exp2f(m_run[g] - mn);
            m_run[g] = mn; mt[g] = mn;
            l_run[g] *= alpha;
            acc[g][0] *= alpha; acc[g][1] *= alpha; acc[g][2] *= alpha; acc[g][3] *= alpha;
            if (!half) ps[g * MK_TILE + (threadIdx.x >> 1)] = p < it.k1 ? exp2f(s[g] - mt[g]) : 0.f;
        }
        csync();
#pragma unroll
        for (int i = 0; i < MK_TILE / MK_CONSUMERS; i++) {
            const int j = warp + MK_CONSUMERS * i, q = t0 + j;
            if (q < it.k1) {
                float v[4];
                if (q == it.ctx - 1) {
                    v[0] = vn[lane * 4]; v[1] = vn[lane * 4 + 1]; v[2] = vn[lane * 4 + 2]; v[3] = vn[lane * 4 + 3];
                } else {
                    v[0] = bflo(t.v[i][0]); v[1] = bfhi(t.v[i][0]); v[2] = bflo(t.v[i][1]); v[3] = bfhi(t.v[i][1]);
                }
#pragma unroll
                for (int g = 0; g < G; g++) {
                    const float pg = ps[g * MK_TILE + j];
                    l_run[g] += pg;
                    acc[g][0] += pg * v[0]; acc[g][1] += pg * v[1]; acc[g][2] += pg * v[2]; acc[g][3] += pg * v[3];
                }
            }
        }
        csync();
    }
    if (tr) tr[24] = (long long)now_ns();
    // merge the warps: red[w][g][0..HD) = acc, red[w][g][HD] = l (each warp summed its own keys' p)
#pragma unroll
    for (int g = 0; g < G; g++) {
        float* r = red + (warp * G + g) * (MK_HD + 1);
        r[lane * 4] = acc[g][0]; r[lane * 4 + 1] = acc[g][1]; r[lane * 4 + 2] = acc[g][2]; r[lane * 4 + 3] = acc[g][3];
        if (lane == 0) r[MK_HD] = l_run[g];
    }
    csync();
    float* po = a.part_o + ((size_t)(it.m * a.smax + it.s) * nh + it.kvh * G) * MK_HD;
    float* pml = a.part_ml + ((size_t)(it.m * a.smax + it.s) * nh + it.kvh * G) * 2;
    for (int i = threadIdx.x; i < G * MK_HD; i += MK_CTHREADS) {
        const int g = i / MK_HD, d = i % MK_HD;
        float o = 0.f, l = 0.f;
        for (int w = 0; w < MK_CONSUMERS; w++) {
            o += red[(w * G + g) * (MK_HD + 1) + d];
            l += red[(w * G + g) * (MK_HD + 1) + MK_HD];
        }
        if (it.S == 1) {
            out[i] = f2bf(o / l);
        } else {
            po[i] = o;
            if (d == 0) { pml[g * 2] = m_run[g]; pml[g * 2 + 1] = l; }
        }
    }
    if (tr) tr[25] = (long long)now_ns();
    if (it.S == 1) return;
    __threadfence();
    csync();
    if (threadIdx.x == 0) {
        int* c = a.counters + it.m * a.nkv + it.kvh;
        const int done = atomicAdd(c, 1);
        const bool is_last = done == it.S - 1;
        if (is_last) atomicExch(c, 0);
        flag[0] = is_last ? 1.f : 0.f;
    }
    csync();
    if (flag[0] == 0.f) return;
    __threadfence();
    const float* po0 = a.part_o + ((size_t)(it.m * a.smax) * nh + it.kvh * G) * MK_HD;
    const float* pml0 = a.part_ml + ((size_t)(it.m * a.smax) * nh + it.kvh * G) * 2;
    const size_t so = (size_t)nh * MK_HD, sml = (size_t)nh * 2;
    for (int i = threadIdx.x; i < G * MK_HD; i += MK_CTHREADS) {
        const int g = i / MK_HD;
        float mx = -1e30f;
        for (int s = 0; s < it.S; s++) mx = fmaxf(mx, ld_l2_f(pml0 + s * sml + g * 2));
        float o = 0.f, l = 0.f;
        for (int s = 0; s < it.S; s++) {
            const float w = exp2f(ld_l2_f(pml0 + s * sml + g * 2) - mx);
            l += w * ld_l2_f(pml0 + s * sml + g * 2 + 1);
            o += w * ld_l2_f(po0 + s * so + i);
        }
        out[i] = f2bf(o / l);
    }
}

__device__ __forceinline__ AttnItem attn_item(const Args& a, int M) {
    AttnItem it{};
    const int per_seq = a.nkv * a.smax, b = blockIdx.x;
    it.m = b / per_seq;
    it.kvh = (b % per_seq) % a.nkv;
    it.s = (b % per_seq) / a.nkv;
    it.live = false;
    if (it.m >= M) return it;
    it.ctx = a.seq_lens[it.m];
    it.S = it.ctx <= 0 ? 1 : min(a.smax, (it.ctx + MK_TILE - 1) / MK_TILE);
    if (it.s >= it.S) return it;
    it.live = true;
    it.k0 = it.ctx <= 0 ? 0 : (int)((long long)it.s * it.ctx / it.S);
    it.k1 = it.ctx <= 0 ? 0 : (int)((long long)(it.s + 1) * it.ctx / it.S);
    it.slot = a.slot_mapping[it.m];
    it.pos = a.positions[it.m];
    return it;
}

// Consume one GEMV phase's slots (CUDA cores, or FP8 on the tensor cores).
template <int M, int Q, bool TC>
__device__ __forceinline__ void consume_phase(Ring& r, const bf16* hs, float* part, int r0, int r1, int K, bool gate,
                                              const ScaleView& sc, int up_off, u64* wait_ns) {
    if constexpr (TC) consume_tc<M, Q>(r, hs, part, r0, r1, K, gate, sc, up_off, wait_ns);
    else consume<M, Q>(r, hs, part, r0, r1, K, gate, sc, up_off, wait_ns);
}

template <int M, int G, int TL, int PW, int Q, bool TC>
__device__ void megakernel(const Args& a) {
    extern __shared__ __align__(128) char smem[];
    char* slots = smem;
    bf16* hs = (bf16*)(smem + (size_t)a.stages * MK_STAGE_BYTES);
    float* part = (float*)(smem + (size_t)a.stages * MK_STAGE_BYTES + M * MK_H_SEQ_BYTES);
    u64* bars = (u64*)(part + MK_PART_FLOATS);
    float* scratch = (float*)(bars + 2 * a.stages);
    float* scl = scratch + 64;                        // [2][MK_SCALE_FLOATS]: FP8 scales of layers l, l + 1
    Ring ring{bars, bars + a.stages, slots, a.stages, 0, 0u};
    if (threadIdx.x == 0) {
        for (int s = 0; s < a.stages; s++) { mbar_init(&ring.full[s], 1); mbar_init(&ring.empty[s], MK_CONSUMERS); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const Rows rows = block_rows<Q>(a);
    const int NB = gridDim.x, b = blockIdx.x, H = a.H, I = a.I, nq = (a.nh + 2 * a.nkv) * MK_HD;
    const int q0 = rows.q0, q1 = rows.q1, h0 = rows.h0, h1 = rows.h1, i0 = rows.i0, i1 = rows.i1;
    if (threadIdx.x >= MK_CTHREADS) {                      // producer warp(s)
        if (PW == 4) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(MK_REGS_PRODUCER));
        if (threadIdx.x != MK_CTHREADS) return;
        u64 policy;
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
        produce_all<Q, TC>(ring, a, rows, policy);
        return;
    }
    if (PW == 4) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(MK_REGS_CONSUMER));
    u64 base;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(base) : "l"(a.bar) : "memory");
    base = base / NB * NB;
    u64 nbar = 0;
    const AttnItem it = attn_item(a, M);
    if (Q) stage_scales<Q>(a, rows, 0, scl);
    for (int l = 0; l < a.layers; l++) {
        KVTile tile;                                  // per layer: nothing carried to the next one
        AttnConst ac;
        const size_t lw = (size_t)l * a.layer_stride;            // bf16 elements
        long long* tr = a.trace && threadIdx.x == 0 ? a.trace + ((size_t)b * a.layers + l) * MK_TRACE : nullptr;
        u64 waits[4] = {0, 0, 0, 0};
#define STAMP(k) do { if (tr) tr[k] = (long long)now_ns(); } while (0)
        STAMP(0);
        if (it.live && it.ctx > 0) prefetch_attention(a, it, l);
        const float* lsc = scl + (l & 1) * MK_SCALE_FLOATS;
        if (Q) {                                       // layer l's scales landed (staged during l - 1); stage l + 1
            asm volatile("cp.async.wait_all;" ::: "memory");
            csync();
            if (l + 1 < a.layers)
                stage_scales<Q>(a, rows, (size_t)(l + 1) * a.layer_stride / 2,
                                scl + ((l + 1) & 1) * MK_SCALE_FLOATS);
        }
        // (1) qkv = rmsnorm(x) W_qkv^T
        norm_to_smem<M, TC>(a.x, a.in_norm + lw, hs, H, a.eps, scratch);
        STAMP(1);
        consume_phase<M, Q, TC>(ring, hs, part, q0, q1, H, false, scale_view<Q>(a, rows, lsc, 0), 0,
                                tr ? &waits[0] : nullptr);
        STAMP(2);
        if (it.live && it.ctx > 0) {
            const bf16* kvl = a.kv + (size_t)l * 2 * a.num_slots * a.nkv * MK_HD;
            if (TL == 1) load_tile(a, it, kvl, it.k0, tile);
            attn_const<G>(a, it, l, ac);
        }
        csync();
        {
            const int wpr = warps_per_row<Q, TC>(H);
            for (int i = threadIdx.x; i < (q1 - q0) * M; i += MK_CTHREADS) {
                const int r = i / M, m = i % M;
                a.qkv[(size_t)m * nq + q0 + r] = f2bf(part_sum<M>(part, r, wpr, m));
            }
        }
        STAMP(18);
        grid_sync(a.bar, base + (++nbar) * NB);
        // (2) attention
        STAMP(3);
        if (it.live) attention_phase<M, G, TL>(a, it, l, tile, ac, (float*)hs, tr);
        STAMP(4);
        grid_sync(a.bar, base + (++nbar) * NB);
        STAMP(5);
        // (3) x += attn W_o^T
        copy_to_smem<M, TC>(a.attn, hs, a.nh * MK_HD);
        STAMP(6);
        consume_phase<M, Q, TC>(ring, hs, part, h0, h1, a.nh * MK_HD, false, scale_view<Q>(a, rows, lsc, 1), 0,
                                tr ? &waits[1] : nullptr);
        STAMP(7);
        csync();
        {
            const int wpr = warps_per_row<Q, TC>(a.nh * MK_HD);
            for (int i = threadIdx.x; i < (h1 - h0) * M; i += MK_CTHREADS) {
                const int r = i / M, m = i % M;
                bf16* xp = a.x + (size_t)m * H + h0 + r;
                *xp = f2bf(ld_l2_bf(xp) + round_bf(part_sum<M>(part, r, wpr, m)));
            }
        }
        STAMP(19);
        grid_sync(a.bar, base + (++nbar) * NB);
        // (4) act = silu(g) * u, [g | u] = rmsnorm(x) W_gate_up^T
        STAMP(8);
        norm_to_smem<M, TC>(a.x, a.post_norm + lw, hs, H, a.eps, scratch);
        STAMP(9);
        consume_phase<M, Q, TC>(ring, hs, part, i0, i1, H, true, scale_view<Q>(a, rows, lsc, 2), I,
                                tr ? &waits[2] : nullptr);
        STAMP(10);
        csync();
        {
            const int wpr = warps_per_row<Q, TC>(H);
            for (int i = threadIdx.x; i < (i1 - i0) * M; i += MK_CTHREADS) {
                const int r = i / M, m = i % M;
                const float g = round_bf(part_sum<M>(part, 2 * r, wpr, m));
                const float u = round_bf(part_sum<M>(part, 2 * r + 1, wpr, m));
                a.act[(size_t)m * I + i0 + r] = f2bf(silu(g) * u);
            }
        }
        STAMP(20);
        grid_sync(a.bar, base + (++nbar) * NB);
        // (5) x += act W_down^T
        STAMP(11);
        copy_to_smem<M, TC>(a.act, hs, I);
        STAMP(12);
        consume_phase<M, Q, TC>(ring, hs, part, h0, h1, I, false, scale_view<Q>(a, rows, lsc, 3), 0,
                                tr ? &waits[3] : nullptr);
        STAMP(13);
        if (tr) for (int k = 0; k < 4; k++) tr[14 + k] = (long long)waits[k];
        csync();
        {
            const int wpr = warps_per_row<Q, TC>(I);
            for (int i = threadIdx.x; i < (h1 - h0) * M; i += MK_CTHREADS) {
                const int r = i / M, m = i % M;
                bf16* xp = a.x + (size_t)m * H + h0 + r;
                *xp = f2bf(ld_l2_bf(xp) + round_bf(part_sum<M>(part, r, wpr, m)));
            }
        }
        STAMP(21);
#undef STAMP
        grid_sync(a.bar, base + (++nbar) * NB);
    }
    if (b == 0) {
        norm_to_smem<M>(a.x, a.final_norm, hs, H, a.eps, scratch);
        for (int v = threadIdx.x; v < M * H / 8; v += MK_CTHREADS) st16(a.h_out + v * 8, ld16(hs + v * 8));
    }
}

// Grid: the plan's SM count, block MK_THREADS, dynamic smem MK_SMEM_BYTES. x [M, H] (in: embeddings; out: the
// residual stream), h_out [M, H] = final rmsnorm; qkv [M, (nh + 2 nkv) HD], attn [M, nh HD], act [M, I] scratch;
// layer weights: layer 0's pointers, layer l at + l * layer_stride elements; kv: the cache's layer 0.
// WT: the weight matrices' pointee type (bf16 for Q 0, e4m3 else); their scales follow w_down (null for bf16)
#define MK_KERNEL(M, G, TL, PW, Q, TC, WT, SUF)                                                                    \
    extern "C" __global__ void __launch_bounds__(MK_THREADS_##PW, 1) decode_mk_m##M##_g##G##_hd128##SUF(        \
        bf16* x, bf16* h_out, bf16* qkv, bf16* attn, bf16* act, const bf16* in_norm, const WT* w_qkv,            \
        const bf16* q_norm, const bf16* k_norm, const WT* w_o, const bf16* post_norm, const WT* w_gu,            \
        const WT* w_down, const float* s_qkv, const float* s_o, const float* s_gu, const float* s_down,          \
        const bf16* final_norm, u64 layer_stride, const float* cos_t, const float* sin_t,                       \
        const int* positions, const int* seq_lens, const int* slot_mapping, const int* block_tables, bf16* kv,   \
        float* part_o, float* part_ml, int* counters, long long* bar, long long* trace, int layers, int H,      \
        int I, int nh, int nkv, int block_size, int max_blocks, int num_slots, int smax, int stages, int l2_ahead,\
        int kv_prefetch, float eps, float scale) {                                                              \
        const Args a{x, h_out, qkv, attn, act, in_norm, q_norm, k_norm, post_norm, final_norm,                  \
                     (const char*)w_qkv, (const char*)w_o, (const char*)w_gu, (const char*)w_down,              \
                     s_qkv, s_o, s_gu, s_down, layer_stride, cos_t, sin_t, positions, seq_lens, slot_mapping,    \
                     block_tables, kv, part_o, part_ml, counters, bar, trace, layers, H, I, nh, nkv, block_size, \
                     max_blocks, num_slots, smax, stages, l2_ahead, kv_prefetch, eps, scale};                   \
        megakernel<M, G, TL, PW, Q, TC>(a); }

// TL: where a split's first KV tile (from L2, where the layer's start prefetched it) is loaded into registers: 1
// before the qkv barrier (no suffix), 0 after q, k, v are prepared (_tl2), 2 at attention's start, before q, k, v
// are read (_tl3); PW: producer warps (_p4: a producer warpgroup, setmaxnreg); Q: _f8c / _f8b FP8 weights
// (fp8_channel / fp8_block128), only the _tl2_p4 / _tl3_p4 variants (_tl3 only with FP8); TC (_f8ct / _f8bt): FP8
// rows on the tensor cores, one sequence
MK_KERNEL(1, 4, 1, 1, 0, false, bf16, )
MK_KERNEL(2, 4, 1, 1, 0, false, bf16, )
MK_KERNEL(1, 4, 0, 1, 0, false, bf16, _tl2)
MK_KERNEL(2, 4, 0, 1, 0, false, bf16, _tl2)
MK_KERNEL(1, 4, 1, 4, 0, false, bf16, _p4)
MK_KERNEL(2, 4, 1, 4, 0, false, bf16, _p4)
MK_KERNEL(1, 4, 0, 4, 0, false, bf16, _tl2_p4)
MK_KERNEL(2, 4, 0, 4, 0, false, bf16, _tl2_p4)
MK_KERNEL(1, 4, 0, 4, 1, false, e4m3, _tl2_p4_f8c)
MK_KERNEL(2, 4, 0, 4, 1, false, e4m3, _tl2_p4_f8c)
MK_KERNEL(1, 4, 0, 4, 2, false, e4m3, _tl2_p4_f8b)
MK_KERNEL(2, 4, 0, 4, 2, false, e4m3, _tl2_p4_f8b)
MK_KERNEL(1, 4, 0, 4, 1, true, e4m3, _tl2_p4_f8ct)
MK_KERNEL(1, 4, 0, 4, 2, true, e4m3, _tl2_p4_f8bt)
MK_KERNEL(1, 4, 2, 4, 1, false, e4m3, _tl3_p4_f8c)
MK_KERNEL(2, 4, 2, 4, 1, false, e4m3, _tl3_p4_f8c)
MK_KERNEL(1, 4, 2, 4, 2, false, e4m3, _tl3_p4_f8b)
MK_KERNEL(2, 4, 2, 4, 2, false, e4m3, _tl3_p4_f8b)
MK_KERNEL(1, 4, 2, 4, 1, true, e4m3, _tl3_p4_f8ct)
MK_KERNEL(1, 4, 2, 4, 2, true, e4m3, _tl3_p4_f8bt)
