// W8A16 skinny tensor-core GEMM for decode batches of 3..64 rows: out[M, N] = bf16 X[M, K] @ W_real[N, K]^T
// (+ bias), W e4m3 with float32 scales (CH: scale[N]; BLK: scale[ceil(N/128), ceil(K/128)]). The structure of
// kernels/gemm_skinny.cu (weights as the MMA's A operand, read once with 16-byte cp.async into per-warp rings,
// X rows through L1) with 128-k steps (a 128-byte line of e4m3 per weight row) of four 32-k sub-steps. The e4m3
// fragments are converted in registers: hardware cvt to f16x2, then exponent/mantissa bits moved to bf16 position,
// which carries value * 2^-112 (fp8.cuh); the fp32 sums are multiplied back by 2^112 with the scale: per row at the
// end (CH) or per 128-k step, which is exactly one 128-block of K (BLK). Ring slot: row r at r * 128 bytes, 16-byte
// piece p at (p ^ 2 (r % 4)) * 16 (conflict-free for the copies and for the 8-byte fragment reads). K % 16 == 0.
// GATE: W is gate_up [2I, K]; A tile 0 holds gate rows j.., tile 1 up rows I + j..; out[M, I] = silu(g) * u with
// g, u rounded to bf16 first (the unfused linear + silu_mul semantics).
#include "fp8.cuh"

__device__ __forceinline__ vec16 skf_ld_x(const void* p) {
    vec16 v;
    asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
// 8 e4m3 (k order) -> 8 bf16 * 2^-112 as the A-fragment words of one row.
__device__ __forceinline__ vec16 skf_dequant(uint2 q) {
    vec16 v;
    v.x = f16x2_bf16x2_scaled(e4m3x2_f16x2(q.x & 0xffffu));
    v.y = f16x2_bf16x2_scaled(e4m3x2_f16x2(q.x >> 16));
    v.z = f16x2_bf16x2_scaled(e4m3x2_f16x2(q.y & 0xffffu));
    v.w = f16x2_bf16x2_scaled(e4m3x2_f16x2(q.y >> 16));
    return v;
}

template <int MB, int WN, bool OUT_F32, bool GATE, bool BLK>
__device__ __forceinline__ void skinny_fp8_impl(const bf16* __restrict__ X, const e4m3* __restrict__ W,
                                                const float* __restrict__ scale, const bf16* __restrict__ bias,
                                                void* __restrict__ out, int M, int N, int K) {
    pdl_entry();
    constexpr int WK = SK_WARPS / WN, RT = SK_RT, SLOTS = RT * MB * 4;
    // BLK: MB <= 4 keeps the step's partial sums (PART) and scales them once per step; MB 8 would spill them, so
    // it scales each sub-step's two MMAs instead.
    constexpr bool PART = BLK && MB <= 4;
    constexpr int PMB = PART ? MB : 1;
    extern __shared__ __align__(16) float red[];             // rings [warp][stage][row][128 B], then sums
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wn = warp % WN, wk = warp / WN;
    const int g = lane >> 2, t = lane & 3;
    const int grp = blockIdx.x * WN + wn;
    const int n_rows = GATE ? 2 * N : N, kb_n = (K + 127) >> 7;

    auto w_row = [&](int r) {
        int row = GATE ? grp * 16 + (r & 15) : grp * 16 * RT + r;
        if (GATE && row >= N) row = N - 1;
        if (GATE) row += (r >> 4) * N;
        return row < n_rows ? row : n_rows - 1;               // clamped rows are computed and never stored
    };
    constexpr int LOADS = RT * 16 * 8 / 32;
    int lrow[LOADS];
#pragma unroll
    for (int c = 0; c < LOADS; c++) lrow[c] = w_row(c * 4 + (lane >> 3));
    const int piece = lane & 7;
    const bf16* xrow[MB];
#pragma unroll
    for (int mb = 0; mb < MB; mb++) xrow[mb] = X + (size_t)min(mb * 8 + g, M - 1) * K + 8 * t;
    // BLK: the scale rows of this lane's weight rows g, g + 8 of each tile. A non-gate warp's 16 * RT rows lie in
    // one 128-row block (16 * RT divides 128); a gate tile's up rows I + j.. may straddle two when I % 16 != 0.
    constexpr int SH = GATE ? 2 : 1;
    static_assert(GATE || 128 % (16 * RT) == 0, "a warp's weight rows must lie in one 128-row block");
    const float* srow[RT][SH];
#pragma unroll
    for (int rt = 0; rt < RT; rt++)
#pragma unroll
        for (int h = 0; h < SH; h++) srow[rt][h] = scale + (size_t)(w_row(rt * 16 + g + 8 * h) >> 7) * kb_n;

    float acc[RT][MB][4], part[RT][PMB][4], sc[RT][SH];
#pragma unroll
    for (int rt = 0; rt < RT; rt++)
#pragma unroll
        for (int mb = 0; mb < MB; mb++)
#pragma unroll
            for (int e = 0; e < 4; e++) { acc[rt][mb][e] = 0.f; if (mb < PMB) part[rt][mb][e] = 0.f; }

    const int steps = (K + 127) >> 7, n_my = wk < steps ? (steps - wk + WK - 1) / WK : 0;
    const vec16 zero = {0u, 0u, 0u, 0u};
    const u32 ring = (u32)__cvta_generic_to_shared(red) + (u32)(warp * SK_STAGES * RT * 16 * 128);
    auto issue = [&](int j) {
        const int k = (wk + j * WK) * 128 + piece * 16;
        if (j < n_my && k < K) {
            const u32 slot = ring + (u32)((j % SK_STAGES) * RT * 16 * 128);
#pragma unroll
            for (int c = 0; c < LOADS; c++) {
                const int r = c * 4 + (lane >> 3);
                cp_async16(slot + (u32)(r * 128 + ((piece ^ ((r & 3) << 1)) * 16)), W + (size_t)lrow[c] * K + k);
            }
        }
        cp_async_commit();
    };
    auto load_x = [&](vec16 (&xv)[MB], int i) {
        const int k = (wk + (i >> 2) * WK) * 128 + (i & 3) * 32;
        const bool ok = i < 4 * n_my && k + 8 * t < K;
#pragma unroll
        for (int mb = 0; mb < MB; mb++) xv[mb] = (ok && mb * 8 + g < M) ? skf_ld_x(xrow[mb] + k) : zero;
    };
#pragma unroll
    for (int j = 0; j < SK_STAGES - 1; j++) issue(j);
    constexpr bool XPRE = MB <= 4;
    vec16 xv[MB];
    if (XPRE) load_x(xv, 0);
    for (int i = 0; i < 4 * n_my; i++) {
        const int j = i >> 2, q = i & 3, kstep = wk + j * WK;
        if (!XPRE) load_x(xv, i);
        if (q == 0) {
            cp_async_wait<SK_STAGES - 2>();
            __syncwarp();
            if (BLK) {
#pragma unroll
                for (int rt = 0; rt < RT; rt++)
#pragma unroll
                    for (int h = 0; h < SH; h++) sc[rt][h] = __ldg(srow[rt][h] + kstep) * FP8_BF16_UNSCALE;
            }
        }
        const int p = 2 * q + (t >> 1);
        const bool ok = kstep * 128 + q * 32 + 8 * t < K;
        const u32 slot = ring + (u32)((j % SK_STAGES) * RT * 16 * 128);
        vec16 wv[RT][2];
#pragma unroll
        for (int rt = 0; rt < RT; rt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = rt * 16 + g + 8 * h;
                wv[rt][h] = ok ? skf_dequant(lds8(slot + (u32)(r * 128 + ((p ^ ((r & 3) << 1)) * 16) + (t & 1) * 8)))
                               : zero;
            }
        vec16 xn[MB];
        if (XPRE) load_x(xn, i + 1);
#pragma unroll
        for (int mb = 0; mb < MB; mb++)
#pragma unroll
            for (int rt = 0; rt < RT; rt++) {
                float tmp[4] = {0.f, 0.f, 0.f, 0.f};
                float* d = PART ? part[rt][mb < PMB ? mb : 0] : BLK ? tmp : acc[rt][mb];
                mma_bf16(d, wv[rt][0].x, wv[rt][1].x, wv[rt][0].y, wv[rt][1].y, xv[mb].x, xv[mb].y);
                mma_bf16(d, wv[rt][0].z, wv[rt][1].z, wv[rt][0].w, wv[rt][1].w, xv[mb].z, xv[mb].w);
                if (BLK && !PART) {
#pragma unroll
                    for (int e = 0; e < 4; e++) acc[rt][mb][e] += tmp[e] * sc[rt][GATE ? e >> 1 : 0];
                }
            }
        if (q == 3) {
            if (PART) {
#pragma unroll
                for (int rt = 0; rt < RT; rt++)
#pragma unroll
                    for (int mb = 0; mb < PMB; mb++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            acc[rt][mb][e] += part[rt][mb][e] * sc[rt][GATE ? e >> 1 : 0];
                            part[rt][mb][e] = 0.f;
                        }
            }
            issue(j + SK_STAGES - 1);                          // refills the slot of step j - 1
        }
        if (XPRE) {
#pragma unroll
            for (int mb = 0; mb < MB; mb++) xv[mb] = xn[mb];
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    float* mine = red + (size_t)(wk * WN + wn) * SLOTS * 32;
#pragma unroll
    for (int rt = 0; rt < RT; rt++)
#pragma unroll
        for (int mb = 0; mb < MB; mb++)
#pragma unroll
            for (int e = 0; e < 4; e++) mine[((rt * MB + mb) * 4 + e) * 32 + lane] = acc[rt][mb][e];
    __syncthreads();

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
            if (j < N) {
                const float sg = BLK ? 1.f : scale[j] * FP8_BF16_UNSCALE;
                const float su = BLK ? 1.f : scale[N + j] * FP8_BF16_UNSCALE;
                ((bf16*)out)[(size_t)m * N + j] = f2bf(silu(round_bf(v[0] * sg)) * round_bf(v[1] * su));
            }
        } else {
#pragma unroll
            for (int rt = 0; rt < RT; rt++) {
                const int n = rg * 16 * RT + rt * 16 + r_in;
                if (n < N) {
                    const float o = v[rt] * (BLK ? 1.f : scale[n] * FP8_BF16_UNSCALE) + (bias ? bf2f(bias[n]) : 0.f);
                    if (OUT_F32) ((float*)out)[(size_t)m * N + n] = o;
                    else ((bf16*)out)[(size_t)m * N + n] = f2bf(o);
                }
            }
        }
    }
}

// Grid: ceil(N / (16 * SK_RT * WN)) blocks of 256 threads (gate: ceil(I / (16 * WN))), N = I for gate;
// dynamic shared memory skinny_smem(MB) bytes. M <= 8 * MB.
#define SKINNY_FP8_KERNELS(S, BLK, BN, MT, WN)                                                                    \
    extern "C" __global__ void __launch_bounds__(256, 2) skinny_fp8##S##BN##_m##MT##_bf16(                        \
        const bf16* X, const e4m3* W, const float* scale, const bf16* bias, bf16* out, int M, int N, int K) {    \
        skinny_fp8_impl<MT / 8, WN, false, false, BLK>(X, W, scale, bias, out, M, N, K); }                     \
    extern "C" __global__ void __launch_bounds__(256, 2) skinny_fp8##S##BN##_m##MT##_f32(                         \
        const bf16* X, const e4m3* W, const float* scale, const bf16* bias, float* out, int M, int N, int K) {   \
        skinny_fp8_impl<MT / 8, WN, true, false, BLK>(X, W, scale, bias, out, M, N, K); }                      \
    extern "C" __global__ void __launch_bounds__(256, 2) skinny_fp8##S##BN##_gate_m##MT(                          \
        const bf16* X, const e4m3* W, const float* scale, bf16* out, int M, int I, int K) {                     \
        skinny_fp8_impl<MT / 8, WN, false, true, BLK>(X, W, scale, nullptr, out, M, I, K); }

SKINNY_FP8_KERNELS(_ch, false, 32, 8, 1)
SKINNY_FP8_KERNELS(_ch, false, 32, 16, 1)
SKINNY_FP8_KERNELS(_ch, false, 32, 32, 1)
SKINNY_FP8_KERNELS(_ch, false, 32, 64, 1)
SKINNY_FP8_KERNELS(_ch, false, 64, 8, 2)
SKINNY_FP8_KERNELS(_ch, false, 64, 16, 2)
SKINNY_FP8_KERNELS(_ch, false, 64, 32, 2)
SKINNY_FP8_KERNELS(_ch, false, 64, 64, 2)
SKINNY_FP8_KERNELS(_blk, true, 32, 8, 1)
SKINNY_FP8_KERNELS(_blk, true, 32, 16, 1)
SKINNY_FP8_KERNELS(_blk, true, 32, 32, 1)
SKINNY_FP8_KERNELS(_blk, true, 32, 64, 1)
SKINNY_FP8_KERNELS(_blk, true, 64, 8, 2)
SKINNY_FP8_KERNELS(_blk, true, 64, 16, 2)
SKINNY_FP8_KERNELS(_blk, true, 64, 32, 2)
SKINNY_FP8_KERNELS(_blk, true, 64, 64, 2)
