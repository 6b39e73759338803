// Instantiates one FP8 config (compile with -DXSERV_FP8_CONFIG=<index>), so configs build in parallel.
#include "gemm_sm90_fp8_kernel.cuh"
#include "gemm_sm90_fp8_configs.h"

#ifndef XSERV_FP8_CONFIG
#error "compile with -DXSERV_FP8_CONFIG=<index>"
#endif

namespace xserv {
template <int Index> struct Fp8Config;
#define XSERV_FP8_CONFIG_TYPE(idx, name, scheme, tm, tn, tk, cm, cn, sched, out) \
  template <> struct Fp8Config<idx> { using Gemm = GemmSm90Fp8<scheme, tm, tn, tk, cm, cn, sched, out>; };
XSERV_FP8_CONFIGS(XSERV_FP8_CONFIG_TYPE)
using SelectedFp8 = Fp8Config<XSERV_FP8_CONFIG>::Gemm;
}  // namespace xserv

extern "C" int XSERV_FP8_CAT(xserv_gemm_fp8_run_, XSERV_FP8_CONFIG)(const void* A, const void* SA, const void* B,
                                                                   const void* SB, void* D, const void* bias, int M,
                                                                   int N, int K, int splits, void* workspace,
                                                                   size_t workspace_bytes, cudaStream_t stream) {
  return xserv::SelectedFp8::run(A, SA, B, SB, D, bias, M, N, K, splits, workspace, workspace_bytes, stream);
}

extern "C" size_t XSERV_FP8_CAT(xserv_gemm_fp8_workspace_, XSERV_FP8_CONFIG)(int M, int N, int K, int splits,
                                                                            int sm_count) {
  return xserv::SelectedFp8::workspace_size(M, N, K, splits, sm_count);
}
