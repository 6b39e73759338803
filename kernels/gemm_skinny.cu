// Skinny tensor-core GEMM for decode batches of 3..64 rows: out[M, N] = X[M, K] @ W[N, K]^T (+ bias).
// mma.sync m16n8k16 with the weights as A (16 weight rows = the MMA's M) and X as B (8 batch rows = the MMA's N),
// so a batch of M rows costs ceil(M / 8) B tiles. Each weight byte is read once with 16-byte cp.async (8 lanes
// copy one full 128-byte line of a row) into a per-warp shared-memory ring of SK_STAGES 64-k steps (warp syncs only,
// no block syncs in the main loop); X rows come through L1 with 16-byte loads, a half step ahead for M <= 32.
// K is permuted inside each 32-wide half step, identically for A and B: lane (g = lane / 4, t = lane % 4) takes the
// 8 consecutive k at k0 + 8t of weight rows g and g + 8 and of X row g; words .x.y feed one MMA, .z.w the next.
// Block: 8 warps = WN row groups x WK K slices; a warp owns 16 * RT weight rows x 8 * MB batch rows. The WK partial
// sums are added in shared memory in slice order (deterministic, no atomics). K % 8 == 0.
// GATE: W is gate_up [2I, K]; A tile 0 holds gate rows j.., tile 1 up rows I + j..; out[M, I] = silu(g) * u with
// g, u rounded to bf16 first (the unfused linear + silu_mul semantics, as gemv_gate).
#include "common.cuh"

// SK_WARPS, SK_RT (16-row A tiles per warp; GATE pairs tile 0 = gate with tile 1 = up) and SK_STAGES (ring of
// 64-k steps per warp) come from plan/kernel_constants.py as NVRTC -D options; skinny_smem there is the dynamic
// shared memory (the weight rings, reused afterwards for the partial sums).

__device__ __forceinline__ vec16 sk_lds(u32 addr) {
    vec16 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
                 : "memory");
    return v;
}
__device__ __forceinline__ vec16 sk_ld_x(const void* p) {
    vec16 v;
    asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

template <int MB, int WN, bool OUT_F32, bool GATE>
__device__ __forceinline__ void skinny_impl(const bf16* __restrict__ X, const bf16* __restrict__ W,
                                            const bf16* __restrict__ bias, void* __restrict__ out,
                                            int M, int N, int K) {
    pdl_entry();
    constexpr int WK = SK_WARPS / WN, RT = SK_RT, SLOTS = RT * MB * 4;
    extern __shared__ __align__(16) float red[];             // rings [warp][stage][row][128 B], then sums
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wn = warp % WN, wk = warp / WN;
    const int g = lane >> 2, t = lane & 3;
    // GATE: N is I and a row group covers output columns j0 .. j0 + 15; else rows n0 .. n0 + 16 * RT - 1.
    const int grp = blockIdx.x * WN + wn;
    const int n_rows = GATE ? 2 * N : N;

    // Weight row of ring row r (0 .. 16 * RT - 1): tile r / 16, row r % 16 of it.
    auto w_row = [&](int r) {
        int row = GATE ? grp * 16 + (r & 15) : grp * 16 * RT + r;
        if (GATE && row >= N) row = N - 1;
        if (GATE) row += (r >> 4) * N;
        return row < n_rows ? row : n_rows - 1;               // clamped rows are computed and never stored
    };
    constexpr int LOADS = RT * 16 * 8 / 32;                   // 16-byte copies per lane per 64-k step
    int lrow[LOADS];
#pragma unroll
    for (int c = 0; c < LOADS; c++) lrow[c] = w_row(c * 4 + (lane >> 3));
    const int piece = lane & 7;
    const bf16* xrow[MB];
#pragma unroll
    for (int mb = 0; mb < MB; mb++) xrow[mb] = X + (size_t)min(mb * 8 + g, M - 1) * K + 8 * t;

    float acc[RT][MB][4];
#pragma unroll
    for (int rt = 0; rt < RT; rt++)
#pragma unroll
        for (int mb = 0; mb < MB; mb++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[rt][mb][e] = 0.f;

    // Warp wk takes 64-k steps wk, wk + WK, ...; a step is 16 * RT rows x 128 bytes, copied a full 128-byte line of a
    // row per 8 lanes. Ring slot: row r at r * 128 bytes, 16-byte piece p at (p ^ 4 (r odd)) * 16 (conflict-free
    // both for the copies and for the fragment reads).
    const int steps = (K + 63) >> 6, n_my = wk < steps ? (steps - wk + WK - 1) / WK : 0;
    const vec16 zero = {0u, 0u, 0u, 0u};
    const u32 ring = (u32)__cvta_generic_to_shared(red) + (u32)(warp * SK_STAGES * RT * 16 * 128);
    auto issue = [&](int j) {
        const int k = (wk + j * WK) * 64 + piece * 8;
        if (j < n_my && k < K) {
            const u32 slot = ring + (u32)((j % SK_STAGES) * RT * 16 * 128);
#pragma unroll
            for (int c = 0; c < LOADS; c++) {
                const int r = c * 4 + (lane >> 3);
                cp_async16(slot + (u32)(r * 128 + ((piece ^ ((r & 1) << 2)) * 16)), W + (size_t)lrow[c] * K + k);
            }
        }
        cp_async_commit();
    };
    // X for local 32-k sub-step i (step i / 2, half i % 2).
    auto load_x = [&](vec16 (&xv)[MB], int i) {
        const int k = (wk + (i >> 1) * WK) * 64 + (i & 1) * 32;
        const bool ok = i < 2 * n_my && k + 8 * t < K;
#pragma unroll
        for (int mb = 0; mb < MB; mb++) xv[mb] = (ok && mb * 8 + g < M) ? sk_ld_x(xrow[mb] + k) : zero;
    };
#pragma unroll
    for (int j = 0; j < SK_STAGES - 1; j++) issue(j);
    constexpr bool XPRE = MB <= 4;                             // X one sub-step ahead (registers allow up to MB 4)
    vec16 xv[MB];
    if (XPRE) load_x(xv, 0);
    for (int i = 0; i < 2 * n_my; i++) {
        const int j = i >> 1, half = i & 1;
        if (!XPRE) load_x(xv, i);
        if (!half) {
            cp_async_wait<SK_STAGES - 2>();                          // this lane's copies of step j have landed,
            __syncwarp();                                      // and every lane's; all reads of step j - 1 are done
        }
        const int p = half * 4 + t;
        const bool ok = (wk + j * WK) * 64 + p * 8 < K;
        const u32 slot = ring + (u32)((j % SK_STAGES) * RT * 16 * 128);
        vec16 wv[RT][2];
#pragma unroll
        for (int rt = 0; rt < RT; rt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = rt * 16 + g + 8 * h;
                wv[rt][h] = ok ? sk_lds(slot + (u32)(r * 128 + ((p ^ ((r & 1) << 2)) * 16))) : zero;
            }
        vec16 xn[MB];
        if (XPRE) load_x(xn, i + 1);
#pragma unroll
        for (int mb = 0; mb < MB; mb++)
#pragma unroll
            for (int rt = 0; rt < RT; rt++) {
                mma_bf16(acc[rt][mb], wv[rt][0].x, wv[rt][1].x, wv[rt][0].y, wv[rt][1].y, xv[mb].x, xv[mb].y);
                mma_bf16(acc[rt][mb], wv[rt][0].z, wv[rt][1].z, wv[rt][0].w, wv[rt][1].w, xv[mb].z, xv[mb].w);
            }
        if (half) issue(j + SK_STAGES - 1);                    // refills the slot of step j - 1
        if (XPRE) {
#pragma unroll
            for (int mb = 0; mb < MB; mb++) xv[mb] = xn[mb];
        }
    }
    cp_async_wait<0>();
    __syncthreads();                                           // every ring is drained before the sums reuse it

    float* mine = red + (size_t)(wk * WN + wn) * SLOTS * 32;
#pragma unroll
    for (int rt = 0; rt < RT; rt++)
#pragma unroll
        for (int mb = 0; mb < MB; mb++)
#pragma unroll
            for (int e = 0; e < 4; e++) mine[((rt * MB + mb) * 4 + e) * 32 + lane] = acc[rt][mb][e];
    __syncthreads();

    // One item = (row group, mb, e, lane): all RT tiles of one accumulator position, summed over K slices in order.
    constexpr int ITEMS = WN * MB * 4 * 32;
    for (int it = threadIdx.x; it < ITEMS; it += blockDim.x) {
        const int ln = it & 31, e = (it >> 5) & 3, mb = (it >> 7) % MB, w = (it >> 7) / MB;
        const int m = mb * 8 + (ln & 3) * 2 + (e & 1);
        if (m >= M) continue;
        const int rg = blockIdx.x * WN + w, r_in = (ln >> 2) + 8 * (e >> 1);
        float v[RT];
#pragma unroll
        for (int rt = 0; rt < RT; rt++) {
            float sum = 0.f;
            for (int z = 0; z < WK; z++) sum += red[((size_t)(z * WN + w) * SLOTS + (rt * MB + mb) * 4 + e) * 32 + ln];
            v[rt] = sum;
        }
        if (GATE) {
            const int j = rg * 16 + r_in;
            if (j < N) ((bf16*)out)[(size_t)m * N + j] = f2bf(silu(round_bf(v[0])) * round_bf(v[1]));
        } else {
#pragma unroll
            for (int rt = 0; rt < RT; rt++) {
                const int n = rg * 16 * RT + rt * 16 + r_in;
                if (n < N) {
                    const float o = v[rt] + (bias ? bf2f(bias[n]) : 0.f);
                    if (OUT_F32) ((float*)out)[(size_t)m * N + n] = o;
                    else ((bf16*)out)[(size_t)m * N + n] = f2bf(o);
                }
            }
        }
    }
}

// Grid: ceil(N / (16 * SK_RT * WN)) blocks of 256 threads (gate: ceil(I / (16 * WN))), N = I for gate;
// dynamic shared memory skinny_smem(MB) bytes. M <= 8 * MB.
#define SKINNY_KERNELS(BN, MT, WN, MINB)                                                                        \
    extern "C" __global__ void __launch_bounds__(256, MINB) skinny##BN##_m##MT##_bf16(                             \
        const bf16* X, const bf16* W, const bf16* bias, bf16* out, int M, int N, int K) {                    \
        skinny_impl<MT / 8, WN, false, false>(X, W, bias, out, M, N, K); }                                \
    extern "C" __global__ void __launch_bounds__(256, MINB) skinny##BN##_m##MT##_f32(                              \
        const bf16* X, const bf16* W, const bf16* bias, float* out, int M, int N, int K) {                   \
        skinny_impl<MT / 8, WN, true, false>(X, W, bias, out, M, N, K); }                                 \
    extern "C" __global__ void __launch_bounds__(256, MINB) skinny##BN##_gate_m##MT(                               \
        const bf16* X, const bf16* W, bf16* out, int M, int I, int K) {                                      \
        skinny_impl<MT / 8, WN, false, true>(X, W, nullptr, out, M, I, K); }

SKINNY_KERNELS(32, 8, 1, 2)
SKINNY_KERNELS(32, 16, 1, 2)
SKINNY_KERNELS(32, 32, 1, 2)
SKINNY_KERNELS(32, 64, 1, 2)
SKINNY_KERNELS(64, 8, 2, 2)
SKINNY_KERNELS(64, 16, 2, 2)
SKINNY_KERNELS(64, 32, 2, 2)
SKINNY_KERNELS(64, 64, 2, 2)
