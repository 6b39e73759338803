// C ABI of the FP8 (W8A8) GEMMs of libxserv_gemm.so: validation and dispatch over gemm_sm90_fp8_configs.h.
// Status codes as xserv_gemm_bf16_ex (gemm_sm90.cu; xserv_gemm_status_string explains them).
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "cutlass/numeric_types.h"
#include "gemm_sm90_fp8_configs.h"

XSERV_FP8_CONFIGS(XSERV_FP8_DECLARE_CONFIG)

namespace {

using Fp8RunFn = int (*)(const void*, const void*, const void*, const void*, void*, const void*, int, int, int,
                         int, void*, size_t, cudaStream_t);
using Fp8WorkspaceFn = size_t (*)(int, int, int, int, int);

struct Fp8Entry {
  const char* name;
  int out_bytes;
  Fp8RunFn run;
  Fp8WorkspaceFn workspace;
};

#define XSERV_FP8_ENTRY(idx, name, scheme, tm, tn, tk, cm, cn, sched, out) \
  {name, static_cast<int>(sizeof(out)), xserv_gemm_fp8_run_##idx, xserv_gemm_fp8_workspace_##idx},
const Fp8Entry kFp8Entries[XSERV_FP8_NUM_CONFIGS] = {XSERV_FP8_CONFIGS(XSERV_FP8_ENTRY)};

bool fp8_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

extern "C" {

int xserv_gemm_fp8_num_configs() { return XSERV_FP8_NUM_CONFIGS; }

const char* xserv_gemm_fp8_config_name(int config) {
  return (config >= 0 && config < XSERV_FP8_NUM_CONFIGS) ? kFp8Entries[config].name : nullptr;
}

int xserv_gemm_fp8_config_out_bytes(int config) {
  return (config >= 0 && config < XSERV_FP8_NUM_CONFIGS) ? kFp8Entries[config].out_bytes : 0;
}

// Device workspace the config needs for this problem on sm_count SMs (stream-K configs; the others 0); splits:
// 0 stream-K, 1 data-parallel, > 1 split-K.
size_t xserv_gemm_fp8_workspace_size(int config, int M, int N, int K, int splits, int sm_count) {
  if (config < 0 || config >= XSERV_FP8_NUM_CONFIGS || M <= 0 || N <= 0 || K <= 0 || splits < 0) return 0;
  return kFp8Entries[config].workspace(M, N, K, splits, sm_count);
}

// D[M,N] from A[M,K] e4m3 (activations, scales SA) and B[N,K] e4m3 (weights, scales SB), packed row-major;
// channel configs: SA [M], SB [N]; block128 configs: SA [M, ceil(K/128)], SB [ceil(N/128), ceil(K/128)] (float32);
// bias bf16 [N] or null; D bf16 or fp32 by config. N % 8 == 0, K % 16 == 0, pointers 16-byte aligned (scales 4);
// splits as xserv_gemm_fp8_workspace_size; workspace (16-byte aligned, workspace_bytes >= that size) the stream-K
// configs' scratch.
int xserv_gemm_fp8_ex(int config, const void* A, const void* SA, const void* B, const void* SB, void* D,
                      const void* bias, int M, int N, int K, int splits, void* workspace, size_t workspace_bytes,
                      void* stream) {
  if (config < 0 || config >= XSERV_FP8_NUM_CONFIGS) return 100;
  if (M < 0 || N <= 0 || K <= 0) return 4;
  if (M == 0) return 0;
  if (A == nullptr || B == nullptr || D == nullptr || SA == nullptr || SB == nullptr) return 4;
  if (N % 8 != 0 || K % 16 != 0) return 1;
  if (!fp8_aligned16(A) || !fp8_aligned16(B) || !fp8_aligned16(D)) return 1;
  if (bias != nullptr && !fp8_aligned16(bias)) return 1;
  if (splits < 0 || (workspace != nullptr && !fp8_aligned16(workspace))) return 4;
  return kFp8Entries[config].run(A, SA, B, SB, D, bias, M, N, K, splits, workspace, workspace_bytes,
                                 static_cast<cudaStream_t>(stream));
}

int xserv_gemm_fp8(int config, const void* A, const void* SA, const void* B, const void* SB, void* D,
                   const void* bias, int M, int N, int K, void* stream) {
  return xserv_gemm_fp8_ex(config, A, SA, B, SB, D, bias, M, N, K, 0, nullptr, 0, stream);
}

}  // extern "C"
