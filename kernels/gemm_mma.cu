// Tensor-core GEMM (mma.sync m16n8k16 bf16 -> f32) for prefill and wide batches:
// out[M, N] = A[M, K] @ W[N, K]^T (+ bias). Both operands K-contiguous; K % 8 == 0, N % 2 == 0.
// Block tile BM x BN x 32, WARPS_M x WARPS_N warps, STAGES-deep cp.async pipeline in dynamic shared memory.
#include "common.cuh"

// GEMM_BK, GEMM_LDS (padded row stride: ldmatrix rows hit distinct banks) and the stage counts come from
// plan/kernel_constants.py as NVRTC -D options (gemm_smem there is the dynamic shared memory formula).
#define BK GEMM_BK
#define LDS GEMM_LDS

// SPLIT: blockIdx.z takes K range [z * kc, min(K, (z + 1) * kc)), kc = ceil(K / gridDim.z / BK) * BK, and
// writes fp32 partials (no bias) to out + z * M * N; splitk_reduce sums them in order (deterministic).
template <int BM, int BN, int WARPS_M, int WARPS_N, int STAGES, bool OUT_F32, bool SPLIT>
__device__ __forceinline__ void gemm_impl(const bf16* __restrict__ A, const bf16* __restrict__ W,
                                          const bf16* __restrict__ bias, void* __restrict__ out,
                                          int M, int N, int K) {
    pdl_entry();
    constexpr int THREADS = WARPS_M * WARPS_N * 32;
    constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N, MI = WM / 16, NI = WN / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* smem = reinterpret_cast<bf16*>(smem_raw);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int m_blk = blockIdx.y * BM, n_blk = blockIdx.x * BN;
    int k_lo = 0, k_hi = K;
    if (SPLIT) {
        const int kc = (K + gridDim.z * BK - 1) / (gridDim.z * BK) * BK;
        k_lo = min(K, (int)blockIdx.z * kc);
        k_hi = min(K, k_lo + kc);
        out = (float*)out + (size_t)blockIdx.z * M * N;
        bias = nullptr;
    }
    const int KT = (k_hi - k_lo + BK - 1) / BK;

    auto stage_a = [&](int s) { return smem + s * (BM + BN) * LDS; };
    auto stage_b = [&](int s) { return smem + s * (BM + BN) * LDS + BM * LDS; };

    auto load_tile = [&](int s, int kt) {
        bf16* sa = stage_a(s); bf16* sb = stage_b(s);
        const int k0 = k_lo + kt * BK;
#pragma unroll
        for (int c = tid; c < BM * 4; c += THREADS) {
            int r = c >> 2, kc = (c & 3) * 8;
            int gm = m_blk + r, gk = k0 + kc;
            bool ok = gm < M && gk < k_hi;
            cp_async16(sa + r * LDS + kc, A + (ok ? (size_t)gm * K + gk : 0), ok ? 16 : 0);
        }
#pragma unroll
        for (int c = tid; c < BN * 4; c += THREADS) {
            int r = c >> 2, kc = (c & 3) * 8;
            int gn = n_blk + r, gk = k0 + kc;
            bool ok = gn < N && gk < k_hi;
            cp_async16(sb + r * LDS + kc, W + (ok ? (size_t)gn * K + gk : 0), ok ? 16 : 0);
        }
    };

    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NI; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < KT) load_tile(s, s);
        cp_async_commit();
    }

    const int q = lane >> 3, r8 = lane & 7;
    for (int kt = 0; kt < KT; kt++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        int nk = kt + STAGES - 1;
        if (nk < KT) load_tile(nk % STAGES, nk);
        cp_async_commit();

        const bf16* sa = stage_a(kt % STAGES);
        const bf16* sb = stage_b(kt % STAGES);
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            u32 af[MI][4], bfr[NI][2];
#pragma unroll
            for (int i = 0; i < MI; i++) {
                int row = wm * WM + i * 16 + r8 + (q & 1) * 8, col = kk + (q >> 1) * 8;
                ldmatrix_x4(af[i][0], af[i][1], af[i][2], af[i][3], sa + row * LDS + col);
            }
#pragma unroll
            for (int j = 0; j < NI; j += 2) {
                int row = wn * WN + j * 8 + r8 + (q >> 1) * 8, col = kk + (q & 1) * 8;
                ldmatrix_x4(bfr[j][0], bfr[j][1], bfr[j + 1][0], bfr[j + 1][1], sb + row * LDS + col);
            }
#pragma unroll
            for (int i = 0; i < MI; i++)
#pragma unroll
                for (int j = 0; j < NI; j++)
                    mma_bf16(acc[i][j], af[i][0], af[i][1], af[i][2], af[i][3], bfr[j][0], bfr[j][1]);
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < MI; i++) {
#pragma unroll
        for (int j = 0; j < NI; j++) {
            int col = n_blk + wn * WN + j * 8 + (lane & 3) * 2;
            if (col >= N) continue;
            float b0 = 0.f, b1 = 0.f;
            if (bias) { b0 = bf2f(bias[col]); b1 = bf2f(bias[col + 1]); }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int row = m_blk + wm * WM + i * 16 + (lane >> 2) + h * 8;
                if (row >= M) continue;
                float v0 = acc[i][j][2 * h] + b0, v1 = acc[i][j][2 * h + 1] + b1;
                if (OUT_F32 || SPLIT) *reinterpret_cast<float2*>((float*)out + (size_t)row * N + col) = make_float2(v0, v1);
                else *reinterpret_cast<u32*>((bf16*)out + (size_t)row * N + col) = pack2(v0, v1);
            }
        }
    }
}

// Grid (ceil(N / BN), ceil(M / BM)); dynamic shared memory STAGES * (BM + BN) * LDS * 2 bytes.
#define GEMM_KERNEL(NAME, BM, BN, WM_, WN_, ST, F32, SPLIT, OUT_T)                                           \
    extern "C" __global__ void __launch_bounds__(WM_ * WN_ * 32) NAME(                                       \
        const bf16* A, const bf16* W, const bf16* bias, OUT_T* out, int M, int N, int K) {                   \
        gemm_impl<BM, BN, WM_, WN_, ST, F32, SPLIT>(A, W, bias, out, M, N, K); }

GEMM_KERNEL(gemm_128x128_bf16, 128, 128, 2, 4, GEMM_STAGES_128, false, false, bf16)
GEMM_KERNEL(gemm_128x128_f32, 128, 128, 2, 4, GEMM_STAGES_128, true, false, float)
GEMM_KERNEL(gemm_64x64_bf16, 64, 64, 2, 2, GEMM_STAGES_64, false, false, bf16)
GEMM_KERNEL(gemm_64x64_f32, 64, 64, 2, 2, GEMM_STAGES_64, true, false, float)
GEMM_KERNEL(gemm_64x64_splitk, 64, 64, 2, 2, GEMM_STAGES_64, true, true, float)

// out[M, N] = sum_z ws[z] (+ bias), in z order; grid-stride over column pairs. N even.
extern "C" __global__ void splitk_reduce(const float* __restrict__ ws, const bf16* __restrict__ bias,
                                         void* __restrict__ out, int M, int N, int splits, int out_f32) {
    pdl_entry();
    const size_t total = (size_t)M * N / 2, plane = (size_t)M * N;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < total; t += (size_t)gridDim.x * blockDim.x) {
        size_t e = t * 2;
        int col = (int)(e % N);
        float2 acc = *reinterpret_cast<const float2*>(ws + e);
        for (int z = 1; z < splits; z++) {
            float2 v = *reinterpret_cast<const float2*>(ws + z * plane + e);
            acc.x += v.x; acc.y += v.y;
        }
        if (bias) { acc.x += bf2f(bias[col]); acc.y += bf2f(bias[col + 1]); }
        if (out_f32) *reinterpret_cast<float2*>((float*)out + e) = acc;
        else *reinterpret_cast<u32*>((bf16*)out + e) = pack2(acc.x, acc.y);
    }
}
