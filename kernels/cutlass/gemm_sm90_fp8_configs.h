// The FP8 (W8A8) configs of libxserv_gemm.so; index = the `config` argument of xserv_gemm_fp8.
// X(index, name, scheme, tile_m, tile_n, tile_k, cluster_m, cluster_n, schedule, output element); schedules as the
// bf16 configs' (gemm_sm90_kernel.cuh): Cooperative (two consumer warpgroups on one tile), Pingpong (the two on two
// tiles: twice the tiles at decode-batch rows, where 128 x 128 tiles leave SMs idle), StreamK (cooperative, the
// tiles' K loops spread over every SM, or split-K; needs a workspace).
// scheme Channel: D = acc * sx[m] * sw[n] (+ bias[n]), sx [M] (one K group), sw [N] (the epilogue applies both).
// scheme Block128: sx [M, ceil(K/128)], sw [ceil(N/128), ceil(K/128)], both K-major; the mainloop scales each
// 128-k partial sum (CUTLASS's blockwise-scaled FP8 mainloop), the epilogue adds the bias.
#pragma once

#define XSERV_FP8_CONFIGS(X)                                                                                        \
  X(0, "sm90_fp8_channel_128x128x128_coop", Channel, 128, 128, 128, 1, 1, Cooperative, cutlass::bfloat16_t)         \
  X(1, "sm90_fp8_channel_f32out_128x128x128_coop", Channel, 128, 128, 128, 1, 1, Cooperative, float)                \
  X(2, "sm90_fp8_block128_128x128x128_coop", Block128, 128, 128, 128, 1, 1, Cooperative, cutlass::bfloat16_t)       \
  X(3, "sm90_fp8_block128_f32out_128x128x128_coop", Block128, 128, 128, 128, 1, 1, Cooperative, float)              \
  X(4, "sm90_fp8_channel_64x128x128_pingpong", Channel, 64, 128, 128, 1, 1, Pingpong, cutlass::bfloat16_t)          \
  X(5, "sm90_fp8_block128_64x128x128_pingpong", Block128, 64, 128, 128, 1, 1, Pingpong, cutlass::bfloat16_t)        \
  X(6, "sm90_fp8_block128_128x128x128_streamk", Block128, 128, 128, 128, 1, 1, StreamK, cutlass::bfloat16_t)        \
  X(7, "sm90_fp8_channel_128x128x128_streamk", Channel, 128, 128, 128, 1, 1, StreamK, cutlass::bfloat16_t)         \

#define XSERV_FP8_NUM_CONFIGS 8

#define XSERV_FP8_CAT_(a, b) a##b
#define XSERV_FP8_CAT(a, b) XSERV_FP8_CAT_(a, b)

// Per-config symbols defined by gemm_sm90_fp8_config.cu.
#define XSERV_FP8_DECLARE_CONFIG(idx, ...)                                                                 \
  extern "C" int xserv_gemm_fp8_run_##idx(const void* A, const void* SA, const void* B, const void* SB,    \
                                          void* D, const void* bias, int M, int N, int K, int splits,        \
                                          void* workspace, size_t workspace_bytes, cudaStream_t s);         \
  extern "C" size_t xserv_gemm_fp8_workspace_##idx(int M, int N, int K, int splits, int sm_count);
