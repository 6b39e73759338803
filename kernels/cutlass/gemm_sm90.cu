// C ABI of libxserv_gemm.so: validation and dispatch over the configs of gemm_sm90_configs.h.
// Status codes: 0 ok; 1..11 cutlass::Status; 100 bad config index.
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "cutlass/numeric_types.h"
#include "gemm_sm90_configs.h"

XSERV_GEMM_CONFIGS(XSERV_GEMM_DECLARE_CONFIG)

namespace {

constexpr int kOk = 0;
constexpr int kMisaligned = 1;       // cutlass::Status::kErrorMisalignedOperand
constexpr int kInvalidProblem = 4;   // cutlass::Status::kErrorInvalidProblem
constexpr int kBadConfig = 100;

using RunFn = int (*)(const void*, const void*, void*, const void*, int, int, int, int, void*, size_t,
                      cudaStream_t);
using WorkspaceFn = size_t (*)(int, int, int, int, int);

struct Entry {
  const char* name;
  int tile_m;
  int tile_n;
  int out_bytes;
  RunFn run;
  WorkspaceFn workspace;
};

#define XSERV_ENTRY(idx, name, kind, tm, tn, tk, cm, cn, sched, out) \
  {name, tm, tn, static_cast<int>(sizeof(out)), xserv_gemm_run_##idx, xserv_gemm_workspace_##idx},
const Entry kEntries[XSERV_GEMM_NUM_CONFIGS] = {XSERV_GEMM_CONFIGS(XSERV_ENTRY)};

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

extern "C" {

int xserv_gemm_num_configs() { return XSERV_GEMM_NUM_CONFIGS; }

const char* xserv_gemm_config_name(int config) {
  return (config >= 0 && config < XSERV_GEMM_NUM_CONFIGS) ? kEntries[config].name : nullptr;
}

// Bytes per output element (2 = bf16, 4 = fp32); 0 for a bad index.
int xserv_gemm_config_out_bytes(int config) {
  return (config >= 0 && config < XSERV_GEMM_NUM_CONFIGS) ? kEntries[config].out_bytes : 0;
}

// Device workspace the config needs for this problem on sm_count SMs (the runtime never allocates one).
// splits: 0 stream-K, 1 data-parallel, > 1 split-K (swap-AB configs; the others take 0 or 1 only).
size_t xserv_gemm_workspace_size_ex(int config, int M, int N, int K, int splits, int sm_count) {
  if (config < 0 || config >= XSERV_GEMM_NUM_CONFIGS) return 0;
  return kEntries[config].workspace(M, N, K, splits, sm_count);
}

size_t xserv_gemm_workspace_size(int config, int M, int N, int K) {
  return xserv_gemm_workspace_size_ex(config, M, N, K, 0, 132);
}

const char* xserv_gemm_status_string(int status) {
  switch (status) {
    case 0: return "success";
    case 1: return "misaligned operand (pointers must be 16-byte aligned, N and K multiples of 8)";
    case 2: return "invalid data type";
    case 3: return "invalid layout";
    case 4: return "invalid problem (M >= 0, N > 0, K > 0, non-null A/B/C required)";
    case 5: return "not supported";
    case 6: return "config needs a workspace";
    case 7: return "internal error (kernel launch failed or no CUDA device)";
    case 8: return "architecture mismatch (needs sm_90a)";
    case 9: return "insufficient driver";
    case 10: return "memory allocation";
    case 100: return "config index out of range";
    default: return "unknown status";
  }
}

// C[M,N] = A[M,K] @ B[N,K]^T (+ bias[N]); A, B, bias bf16; C bf16 or fp32 by config; workspace (16-byte
// aligned, workspace_bytes >= xserv_gemm_workspace_size_ex) is the config's stream-K / split-K scratch.
int xserv_gemm_bf16_ex(int config, const void* A, const void* B, void* C, const void* bias, int M, int N,
                       int K, int splits, void* workspace, size_t workspace_bytes, void* stream) {
  if (config < 0 || config >= XSERV_GEMM_NUM_CONFIGS) return kBadConfig;
  if (M < 0 || N <= 0 || K <= 0) return kInvalidProblem;
  if (M == 0) return kOk;
  if (A == nullptr || B == nullptr || C == nullptr) return kInvalidProblem;
  if (N % 8 != 0 || K % 8 != 0) return kMisaligned;
  if (!aligned16(A) || !aligned16(B) || !aligned16(C)) return kMisaligned;
  if (bias != nullptr && !aligned16(bias)) return kMisaligned;
  if (splits < 0 || (workspace != nullptr && !aligned16(workspace))) return kInvalidProblem;
  return kEntries[config].run(A, B, C, bias, M, N, K, splits, workspace, workspace_bytes,
                              static_cast<cudaStream_t>(stream));
}

int xserv_gemm_bf16(int config, const void* A, const void* B, void* C, const void* bias, int M, int N,
                    int K, void* stream) {
  return xserv_gemm_bf16_ex(config, A, B, C, bias, M, N, K, 0, nullptr, 0, stream);
}

}  // extern "C"
