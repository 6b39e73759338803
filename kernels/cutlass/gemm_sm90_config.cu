// Instantiates one tile config (compile with -DXSERV_GEMM_CONFIG=<index>), so configs build in parallel.
#include "gemm_sm90_kernel.cuh"
#include "gemm_sm90_configs.h"

#ifndef XSERV_GEMM_CONFIG
#error "compile with -DXSERV_GEMM_CONFIG=<index>"
#endif

namespace xserv {
struct Tile {};
struct Residual {};
struct SwapAB {};
template <class Kind, int TM, int TN, int TK, int CM, int CN, class Sched, class Out> struct Pick;
template <int TM, int TN, int TK, int CM, int CN, class Sched, class Out>
struct Pick<Tile, TM, TN, TK, CM, CN, Sched, Out> { using Gemm = GemmSm90<TM, TN, TK, CM, CN, Sched, Out>; };
template <int TM, int TN, int TK, int CM, int CN, class Sched, class Out>
struct Pick<Residual, TM, TN, TK, CM, CN, Sched, Out> { using Gemm = GemmSm90<TM, TN, TK, CM, CN, Sched, Out, true>; };
template <int TM, int TN, int TK, int CM, int CN, class Sched, class Out>
struct Pick<SwapAB, TM, TN, TK, CM, CN, Sched, Out> { using Gemm = GemmSm90SwapAB<TM, TN, TK, Out>; };

template <int Index> struct Config;
#define XSERV_CONFIG_TYPE(idx, name, kind, tm, tn, tk, cm, cn, sched, out) \
  template <> struct Config<idx> { using Gemm = typename Pick<kind, tm, tn, tk, cm, cn, sched, out>::Gemm; };
XSERV_GEMM_CONFIGS(XSERV_CONFIG_TYPE)
using Selected = Launcher<Config<XSERV_GEMM_CONFIG>::Gemm>;
}  // namespace xserv

extern "C" int XSERV_CAT(xserv_gemm_run_, XSERV_GEMM_CONFIG)(const void* A, const void* B, void* D,
                                                            const void* bias, int M, int N, int K, int splits,
                                                            void* workspace, size_t workspace_bytes,
                                                            cudaStream_t stream) {
  return xserv::Selected::run(A, B, D, bias, M, N, K, splits, workspace, workspace_bytes, stream);
}

extern "C" size_t XSERV_CAT(xserv_gemm_workspace_, XSERV_GEMM_CONFIG)(int M, int N, int K, int splits,
                                                                     int sm_count) {
  return xserv::Selected::workspace_size(M, N, K, splits, sm_count);
}
