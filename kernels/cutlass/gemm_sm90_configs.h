// The tile configs of libxserv_gemm.so; index = the `config` argument of xserv_gemm_bf16.
// X(index, name, tile_m, tile_n, tile_k, cluster_m, cluster_n, schedule, output element)
#pragma once

#define XSERV_GEMM_CONFIGS(X)                                                                    \
  X(0, "sm90_bf16_128x128x64_c2x1_coop", 128, 128, 64, 2, 1, Cooperative, cutlass::bfloat16_t)   \
  X(1, "sm90_bf16_128x256x64_c2x1_coop", 128, 256, 64, 2, 1, Cooperative, cutlass::bfloat16_t)   \
  X(2, "sm90_bf16_64x128x64_c1x1_pingpong", 64, 128, 64, 1, 1, Pingpong, cutlass::bfloat16_t)    \
  X(3, "sm90_f32out_128x128x64_c2x1_coop", 128, 128, 64, 2, 1, Cooperative, float)

#define XSERV_GEMM_NUM_CONFIGS 4

#define XSERV_CAT_(a, b) a##b
#define XSERV_CAT(a, b) XSERV_CAT_(a, b)

// Per-config symbols defined by gemm_sm90_config.cu.
#define XSERV_GEMM_DECLARE_CONFIG(idx, ...)                                                     \
  extern "C" int xserv_gemm_run_##idx(const void* A, const void* B, void* D, const void* bias,  \
                                      int M, int N, int K, cudaStream_t stream);               \
  extern "C" size_t xserv_gemm_workspace_##idx(int M, int N, int K);
