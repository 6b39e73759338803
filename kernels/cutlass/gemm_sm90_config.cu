// Instantiates one tile config (compile with -DXSERV_GEMM_CONFIG=<index>), so configs build in parallel.
#include "gemm_sm90_kernel.cuh"
#include "gemm_sm90_configs.h"

#ifndef XSERV_GEMM_CONFIG
#error "compile with -DXSERV_GEMM_CONFIG=<index>"
#endif

namespace xserv {
template <int Index> struct Config;
#define XSERV_CONFIG_TYPE(idx, name, tm, tn, tk, cm, cn, sched, out) \
  template <> struct Config<idx> { using Gemm = GemmSm90<tm, tn, tk, cm, cn, sched, out>; };
XSERV_GEMM_CONFIGS(XSERV_CONFIG_TYPE)
using Selected = Config<XSERV_GEMM_CONFIG>::Gemm;
}  // namespace xserv

extern "C" int XSERV_CAT(xserv_gemm_run_, XSERV_GEMM_CONFIG)(const void* A, const void* B, void* D,
                                                            const void* bias, int M, int N, int K,
                                                            cudaStream_t stream) {
  return xserv::Selected::run(A, B, D, bias, M, N, K, stream);
}

extern "C" size_t XSERV_CAT(xserv_gemm_workspace_, XSERV_GEMM_CONFIG)(int M, int N, int K) {
  return xserv::Selected::workspace_size(M, N, K);
}
