// Hopper (sm_90a) building blocks of attention_prefill_wgmma.cu: warpgroup MMA (wgmma) with 128B-swizzled shared
// operands, mbarriers, cp.async into swizzled tiles, and the online softmax of one 64 x 64 S tile in the wgmma
// accumulator layout (warp w of the warpgroup: rows 16 w + lane / 4 (+ 8); element 4 j + 2 e + c: row e, column
// 8 j + 2 (lane % 4) + c).
#pragma once
#include "prefill_tiles.cuh"

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp_async16_zfill(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// Shared-memory matrix descriptor, 128-byte swizzle; lbo / sbo in bytes (multiples of 16).
__device__ __forceinline__ u64 sw128_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }
// Keeps the compiler from moving register reads/writes of an accumulator across the asynchronous MMA.
template <int N>
__device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i]) :: "memory");
}
// ... and of A fragments in registers (read by wgmma until its wait_group).
template <int N>
__device__ __forceinline__ void reg_fence(u32 (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) asm volatile("" : "+r"(r[i][j]) :: "memory");
}

// The accumulator operand lists of the wgmma asm statements below (32 or 64 f32 registers, in order).
#define WG_ACC32(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WG_ACC64(d) WG_ACC32(d), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define WG_REGS32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_REGS64 WG_REGS32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

// d (64 x N f32, accumulate or overwrite) += A (64 x 16, smem) * B (16 x N, smem, K-major), N = 2 x size of d.
__device__ __forceinline__ void wgmma_ss(float (&d)[32], u64 da, u64 db, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" WG_REGS32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : WG_ACC32(d) : "l"(da), "l"(db), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_ss(float (&d)[64], u64 da, u64 db, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_REGS64 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : WG_ACC64(d) : "l"(da), "l"(db), "r"(accumulate));
}
// d (64 x 128 f32) += A (64 x 16 bf16, registers: the m16n8k16 A fragment of each warp's 16 rows) * B (16 x 128,
// smem, MN-major).
__device__ __forceinline__ void wgmma_rs_n128_tb(float (&d)[64], const u32 (&a)[4], u64 db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_REGS64 "}, {%64, %65, %66, %67}, %68, "
                 "p, 1, 1, 1;\n}\n"
                 : WG_ACC64(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// d (64 x N f32) (+)= A (64 x 16 bf16, registers as above) * B (16 x N, smem, K-major), N = 2 x size of d.
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const u32 (&a)[4], u64 db, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" WG_REGS32 "}, {%32, %33, %34, %35}, %36, "
                 "p, 1, 1, 0;\n}\n"
                 : WG_ACC32(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const u32 (&a)[4], u64 db, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_REGS64 "}, {%64, %65, %66, %67}, %68, "
                 "p, 1, 1, 0;\n}\n"
                 : WG_ACC64(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}
__device__ __forceinline__ void ldmatrix_x4_at(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Byte offset of 16-byte chunk c (of 16) of row r in a swizzled tile of `rows` rows of 128 dims.
__device__ __forceinline__ u32 sw128_offset(int r, int c, int rows) {
    return (u32)((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// Online softmax of one S tile (64 rows x N / 2 keys) in place (S -> exp2 values P, unnormalised), rows e of
// this thread: keys past lim[e] (relative to this thread's first column) masked when diag; m (log2 units,
// scaled), l, corr per row. BRANCH: the mask under a branch (no select instructions on the other tiles). LAZY: a
// row's m moves only when the tile's max passes it by more than SOFTMAX_LAZY_LOG2 (P <= 2^that, exact after the
// final 1 / l; rescales become rare), and the row max / sum by four independent chains.
constexpr float SOFTMAX_LAZY_LOG2 = 8.f;
template <int N, bool BRANCH = false, bool LAZY = false>
__device__ __forceinline__ bool softmax_tile(float (&s)[N], float (&m)[2], float (&l)[2], float (&corr)[2],
                                             bool diag, const int (&lim)[2], float sl2) {
    const float NEG_INF = -__int_as_float(0x7f800000);
    constexpr int CH = LAZY ? 4 : 1;                             // independent max / sum chains a row
    if (BRANCH && diag) {
#pragma unroll
        for (int j = 0; j < N / 4; j++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                if (j * 8 + (i & 1) > lim[i >> 1]) s[4 * j + i] = NEG_INF;
    }
    bool moved = false;
#pragma unroll
    for (int e = 0; e < 2; e++) {
        float mc[CH];
#pragma unroll
        for (int c = 0; c < CH; c++) mc[c] = NEG_INF;
#pragma unroll
        for (int j = 0; j < N / 4; j++) {
#pragma unroll
            for (int c = 0; c < 2; c++) {
                float& v = s[4 * j + 2 * e + c];
                if (!BRANCH && diag && j * 8 + c > lim[e]) v = NEG_INF;
                mc[(2 * j + c) % CH] = fmaxf(mc[(2 * j + c) % CH], v);
            }
        }
        float mx = mc[0];
#pragma unroll
        for (int c = 1; c < CH; c++) mx = fmaxf(mx, mc[c]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        float nm = fmaxf(m[e], mx * sl2);                        // finite: key 0 is visible to every row
        if (LAZY) nm = nm > m[e] + SOFTMAX_LAZY_LOG2 ? nm : m[e];  // (m = -inf: moves)
        corr[e] = nm != m[e] ? ex2_approx(m[e] - nm) : 1.f;
        moved |= nm != m[e];
        m[e] = nm;
        float sc[CH];
#pragma unroll
        for (int c = 0; c < CH; c++) sc[c] = 0.f;
#pragma unroll
        for (int j = 0; j < N / 4; j++) {
#pragma unroll
            for (int c = 0; c < 2; c++) {
                float& v = s[4 * j + 2 * e + c];
                v = ex2_approx(fmaf(v, sl2, -nm));
                sc[(2 * j + c) % CH] += v;
            }
        }
        float sum = sc[0];
#pragma unroll
        for (int c = 1; c < CH; c++) sum += sc[c];
        l[e] = l[e] * corr[e] + sum;
    }
    return moved;
}

__device__ __forceinline__ void rescale_rows(float (&o)[64], const float (&corr)[2]) {
#pragma unroll
    for (int t = 0; t < 16; t++) {
        o[4 * t] *= corr[0]; o[4 * t + 1] *= corr[0]; o[4 * t + 2] *= corr[1]; o[4 * t + 3] *= corr[1];
    }
}
__device__ __forceinline__ void rescale(float (&o)[64], const float (&corr)[2], bool moved) {
    if (__any_sync(0xffffffffu, moved)) rescale_rows(o, corr);
}

// P (fp32, the S accumulator layout) -> the bf16 A fragments of the N / 8 k16 steps of the PV product.
template <int N>
__device__ __forceinline__ void pack_p(const float (&s)[N], u32 (&pf)[N / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < N / 8; kk++)
#pragma unroll
        for (int r = 0; r < 4; r++) pf[kk][r] = pack2_rn(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
}

// Thread t of NTH copies its share of K/V tile kt of KT keys (rows past max_pos zero-filled) into the slot at dst
// (K tile, then the V tile KT x 256 bytes later).
template <int KT, int NTH>
__device__ __forceinline__ void copy_kv_tile(u32 dst, const bf16* kv_head, const int* bt, int kt, int max_pos,
                                             int bs_log2, size_t kv_stride, size_t v_off, int t) {
#pragma unroll
    for (int i = 0; i < (KT * 16 + NTH - 1) / NTH; i++) {
        const int c = t + i * NTH, kr = c >> 4, ch = c & 15, p = kt * KT + kr;
        if (KT * 16 % NTH != 0 && c >= KT * 16) break;
        const bool ok = p <= max_pos;
        const size_t slot = ok ? paged_slot(bt, p, bs_log2) : 0u;
        const bf16* kp = kv_head + slot * kv_stride + ch * 8;
        const u32 off = sw128_offset(kr, ch, KT);
        cp_async16_zfill(dst + off, kp, ok ? 16 : 0);
        cp_async16_zfill(dst + KT * 256 + off, kp + v_off, ok ? 16 : 0);
    }
}

// e: the producer warpgroup's copy with the per-thread constants hoisted: thread t always copies chunk t % 16 of rows
// t / 16 + 8 i, so its swizzled offsets are off0 + 1024 i, and its K / V row addresses one 32 x 32 -> 64-bit
// multiply-add each from bases that already hold the head and the chunk.
template <int KT>
__device__ __forceinline__ void copy_kv_tile_lean(u32 dst, const char* k_base, const char* v_base, const int* bt,
                                                  int kt, int max_pos, int bs_log2, u32 row_bytes, int r0, u32 off0) {
#pragma unroll
    for (int i = 0; i < KT / 8; i++) {
        const int p = kt * KT + r0 + 8 * i;
        const bool ok = p <= max_pos;
        const u32 slot = ok ? paged_slot(bt, p, bs_log2) : 0u;
        const u32 d = dst + off0 + 1024 * i;
        cp_async16_zfill(d, k_base + (size_t)slot * row_bytes, ok ? 16 : 0);
        cp_async16_zfill(d + KT * 256, v_base + (size_t)slot * row_bytes, ok ? 16 : 0);
    }
}

// Low / high words of a 128B-swizzle descriptor (sw128_desc); a byte offset o (multiple of 16, inside shared memory)
// moves it by o >> 4 in the low word.
__device__ __forceinline__ u32 sw128_desc_lo(u32 addr, u32 lbo) {
    return ((addr & 0x3FFFFu) >> 4) | ((lbo >> 4) << 16);
}
__device__ __forceinline__ u64 desc_at(u32 lo, u32 sbo) { return ((u64)((sbo >> 4) | (1u << 30)) << 32) | lo; }

// mbarriers (shared::cta): init, plain arrive, arrive when this thread's earlier cp.async copies land, wait for
// the phase of the given parity to complete.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_on_copies(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
// Shared memory written through the generic proxy (cp.async, st.shared) made visible to wgmma's async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
