// The tile configs of libxserv_gemm.so; index = the `config` argument of xserv_gemm_bf16_ex.
// X(index, name, kind, tile_m, tile_n, tile_k, cluster_m, cluster_n, schedule, output element)
// kind Tile: tiles of D (schedule Cooperative / Pingpong: persistent data-parallel; StreamK: stream-K / split-K,
// needs a workspace); Residual: a Tile config whose epilogue adds D in place (D = bf16(bf16(acc + bias) + D));
// SwapAB: decode rows, weights on the tile's M side, stream-K/split-K. 11..16: the prefill candidates (issue 14).
#pragma once

#define XSERV_GEMM_CONFIGS(X)                                                                                    \
  X(0, "sm90_bf16_128x128x64_c2x1_coop", Tile, 128, 128, 64, 2, 1, Cooperative, cutlass::bfloat16_t)             \
  X(1, "sm90_bf16_128x256x64_c2x1_coop", Tile, 128, 256, 64, 2, 1, Cooperative, cutlass::bfloat16_t)             \
  X(2, "sm90_bf16_64x128x64_c1x1_pingpong", Tile, 64, 128, 64, 1, 1, Pingpong, cutlass::bfloat16_t)              \
  X(3, "sm90_f32out_128x128x64_c2x1_coop", Tile, 128, 128, 64, 2, 1, Cooperative, float)                         \
  X(4, "sm90_bf16_swap_128x32x128_streamk", SwapAB, 128, 32, 128, 1, 1, StreamKSwapAB, cutlass::bfloat16_t)      \
  X(5, "sm90_bf16_swap_128x64x128_streamk", SwapAB, 128, 64, 128, 1, 1, StreamKSwapAB, cutlass::bfloat16_t)      \
  X(6, "sm90_bf16_swap_128x128x64_streamk", SwapAB, 128, 128, 64, 1, 1, StreamKSwapAB, cutlass::bfloat16_t)      \
  X(7, "sm90_bf16_swap_128x256x64_streamk", SwapAB, 128, 256, 64, 1, 1, StreamKSwapAB, cutlass::bfloat16_t)      \
  X(8, "sm90_f32out_swap_128x64x128_streamk", SwapAB, 128, 64, 128, 1, 1, StreamKSwapAB, float)                  \
  X(9, "sm90_f32out_swap_128x128x64_streamk", SwapAB, 128, 128, 64, 1, 1, StreamKSwapAB, float)                  \
  X(10, "sm90_f32out_swap_128x256x64_streamk", SwapAB, 128, 256, 64, 1, 1, StreamKSwapAB, float)                 \
  X(11, "sm90_bf16_256x128x64_c2x1_coop", Tile, 256, 128, 64, 2, 1, Cooperative, cutlass::bfloat16_t)            \
  X(12, "sm90_bf16_128x256x64_c1x2_coop", Tile, 128, 256, 64, 1, 2, Cooperative, cutlass::bfloat16_t)            \
  X(13, "sm90_bf16_128x128x64_c1x2_pingpong", Tile, 128, 128, 64, 1, 2, Pingpong, cutlass::bfloat16_t)           \
  X(14, "sm90_bf16_128x256x64_c2x1_streamk", Tile, 128, 256, 64, 2, 1, StreamK, cutlass::bfloat16_t)             \
  X(15, "sm90_bf16res_128x256x64_c2x1_coop", Residual, 128, 256, 64, 2, 1, Cooperative, cutlass::bfloat16_t)     \
  X(16, "sm90_bf16res_256x128x64_c2x1_coop", Residual, 256, 128, 64, 2, 1, Cooperative, cutlass::bfloat16_t)

#define XSERV_GEMM_NUM_CONFIGS 17

#define XSERV_CAT_(a, b) a##b
#define XSERV_CAT(a, b) XSERV_CAT_(a, b)

// Per-config symbols defined by gemm_sm90_config.cu.
#define XSERV_GEMM_DECLARE_CONFIG(idx, ...)                                                          \
  extern "C" int xserv_gemm_run_##idx(const void* A, const void* B, void* D, const void* bias, int M, \
                                      int N, int K, int splits, void* workspace,                     \
                                      size_t workspace_bytes, cudaStream_t stream);                  \
  extern "C" size_t xserv_gemm_workspace_##idx(int M, int N, int K, int splits, int sm_count);
