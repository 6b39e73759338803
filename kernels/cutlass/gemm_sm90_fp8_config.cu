// Instantiates one FP8 config (compile with -DXSERV_FP8_CONFIG=<index>), so configs build in parallel.
#include "gemm_sm90_fp8_kernel.cuh"
#include "gemm_sm90_fp8_configs.h"

#ifndef XSERV_FP8_CONFIG
#error "compile with -DXSERV_FP8_CONFIG=<index>"
#endif

namespace xserv {
template <int Index> struct Fp8Config;
#define XSERV_FP8_CONFIG_TYPE(idx, name, scheme, tm, tn, tk, out) \
  template <> struct Fp8Config<idx> { using Gemm = GemmSm90Fp8<scheme, tm, tn, tk, out>; };
XSERV_FP8_CONFIGS(XSERV_FP8_CONFIG_TYPE)
using SelectedFp8 = Fp8Config<XSERV_FP8_CONFIG>::Gemm;
}  // namespace xserv

extern "C" int XSERV_FP8_CAT(xserv_gemm_fp8_run_, XSERV_FP8_CONFIG)(const void* A, const void* SA, const void* B,
                                                                   const void* SB, void* D, const void* bias, int M,
                                                                   int N, int K, cudaStream_t stream) {
  return xserv::SelectedFp8::run(A, SA, B, SB, D, bias, M, N, K, stream);
}
