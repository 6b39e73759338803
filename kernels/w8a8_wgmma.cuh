// The parts of the W8A8 wgmma GEMMs that do not depend on how a step's tiles reach shared memory
// (gemm_w8a8_wgmma.cu: cp.async by every thread; gemm_w8a8_tma.cu: TMA from a producer warp): the e4m3 wgmma, one
// 128-k step's MMAs and promotion, and the end (partial sums over the ring, the cluster reduction in rank order,
// scales, bias, stores). A slot holds the ROWS weight lines of 128 B (64 x the m64 tiles of its block), then the NT X
// lines, both in the 128B-swizzle layout (row r at 128 r, 16-byte chunk c at (c ^ (r & 7)) * 16), 1024-byte aligned.
#pragma once
#include "fp8.cuh"
#include "cluster.cuh"
#include "wgmma.cuh"

// d (64 x NT f32) = or += A (64 x 32 e4m3, smem desc) * B (32 x NT e4m3, smem desc, K-major).
__device__ __forceinline__ void wgmma_e4m3(float (&d)[32], u64 da, u64 db, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {" WG_REGS32 "}, %32, %33, p, 1, 1;\n}\n"
                 : WG_ACC32(d) : "l"(da), "l"(db), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_e4m3(float (&d)[64], u64 da, u64 db, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" WG_REGS64 "}, %64, %65, p, 1, 1;\n}\n"
                 : WG_ACC64(d) : "l"(da), "l"(db), "r"(accumulate));
}
__device__ __forceinline__ void wg8_cp4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(dst), "l"(src) : "memory");
}

// Warpgroup wg's step on the slot at st (ROWS weight lines, then the X lines): the warpgroup owns TPW m64 tiles,
// weight rows 64 (TPW wg + p) .. + 63 of the slot; for each of the NH halves of NW activation rows, d[p] = tile p's
// 4 k32 wgmmas' sum (all TPW tiles issued before one wait), then acc[p] += d[p] * sw[p] * xs[m] (BLK; xs: the
// slot's NT X scales in shared memory, sw[p]: tile p's weight scale) or acc[p] += d[p] (CH).
template <int NT, bool BLK, int ROWS = 64 * WG8_WGS, int TPW = 1>
__device__ __forceinline__ void w8a8_step(float (&acc)[TPW][NT / 2], float (&d)[TPW][(NT > 128 ? NT / 2 : NT) / 2],
                                          u32 st, int wg, int t, const float* xs, const float (&sw)[TPW]) {
    constexpr int W_BYTES = ROWS * 128;
    constexpr int NH = NT > 128 ? 2 : 1, NW = NT / NH;   // NT 256: two n128 wgmma chains on one weight tile
#pragma unroll
    for (int h = 0; h < NH; h++) {              // activation rows h NW .. + NW - 1, the same A tiles
        wg_fence();
#pragma unroll
        for (int p = 0; p < TPW; p++)
#pragma unroll
            for (int kc = 0; kc < 4; kc++)
                wgmma_e4m3(d[p], sw128_desc(st + (u32)((wg * TPW + p) * 64 * 128 + kc * 32), 16, 1024),
                           sw128_desc(st + (u32)(W_BYTES + h * NW * 128 + kc * 32), 16, 1024), kc);
        wg_commit();
        wg_wait<0>();                          // (ptxas serialises wgmma when other accumulators are read
#pragma unroll
        for (int p = 0; p < TPW; p++) reg_fence(d[p]);   // while one is in flight: no overlap of steps)
#pragma unroll
        for (int p = 0; p < TPW; p++) {
            float* ah = acc[p] + h * (NW / 2);
            if (BLK) {
                const float* xh = xs + h * NW;
#pragma unroll
                for (int jj = 0; jj < NW / 8; jj++) {
                    const float2 s = *reinterpret_cast<const float2*>(xh + 8 * jj + 2 * t);
                    const float s0 = s.x * sw[p], s1 = s.y * sw[p];
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        ah[4 * jj + 2 * e] += d[p][4 * jj + 2 * e] * s0;
                        ah[4 * jj + 2 * e + 1] += d[p][4 * jj + 2 * e + 1] * s1;
                    }
                }
            } else {
#pragma unroll
                for (int i = 0; i < NW / 2; i++) ah[i] += d[p][i];
            }
        }
    }
}

// The end of a block, after its last step (the caller has made the ring free: no copy in flight, __syncthreads):
// the consumers' sums as partials [NT][ROWS + 4] over the ring, then block z of the cluster reduces its share of
// the tile's outputs over ranks 0..C-1 in order, applies the scales (CH) and bias, stores rows m < M, n < N.
// Every thread of the block calls it (consumer: one of the 128 WGS MMA threads, which hold acc; TPW tiles each).
template <int NT, bool OUT_F32, bool BLK, int C, int WGS = WG8_WGS, int TPW = 1>
__device__ __forceinline__ void w8a8_finish(const float (&acc)[TPW][NT / 2], float* part, u32 base, bool consumer,
                                            int tid, int z, int n0, const float* __restrict__ XS,
                                            const float* __restrict__ WS, const bf16* __restrict__ bias,
                                            void* __restrict__ out, int M, int N) {
    constexpr int ROWS = 64 * WGS * TPW, THREADS = 128 * WGS, PSTRIDE = ROWS + 4;
    const int wg = tid >> 7, w4 = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
    if (consumer) {
#pragma unroll
        for (int p = 0; p < TPW; p++)
#pragma unroll
            for (int jj = 0; jj < NT / 8; jj++)        // (the NH halves: jj runs on over both)
#pragma unroll
                for (int e = 0; e < 2; e++)
#pragma unroll
                    for (int c = 0; c < 2; c++)
                        part[(8 * jj + 2 * t + c) * PSTRIDE + (wg * TPW + p) * 64 + 16 * w4 + g + 8 * e] =
                            acc[p][4 * jj + 2 * e + c];
    }
    if (C > 1) cluster_barrier();
    else __syncthreads();

    constexpr int QUADS = NT * ROWS / 4;
    for (int qd = z * THREADS + tid; consumer && qd < QUADS; qd += C * THREADS) {
        const int m = qd / (ROWS / 4), nl = (qd % (ROWS / 4)) * 4;
        if (m >= M) continue;
        const u32 off = base + (u32)((m * PSTRIDE + nl) * 4);
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int zz = 0; zz < C; zz++) {
            const float4 q = C > 1 ? ld_cluster_v4(off, zz) : *reinterpret_cast<const float4*>(part + m * PSTRIDE + nl);
            v.x += q.x; v.y += q.y; v.z += q.z; v.w += q.w;
        }
        const float vals[4] = {v.x, v.y, v.z, v.w};
        const float sx = BLK ? 1.f : XS[m];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int n = n0 + nl + i;
            if (n < N) {
                const float o = (BLK ? vals[i] : vals[i] * sx * WS[n]) + (bias ? bf2f(bias[n]) : 0.f);
                if (OUT_F32) ((float*)out)[(size_t)m * N + n] = o;
                else ((bf16*)out)[(size_t)m * N + n] = f2bf(o);
            }
        }
    }
    if (C > 1) cluster_barrier();                  // no block leaves while the cluster still reads its partials
}
