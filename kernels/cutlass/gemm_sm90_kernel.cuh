// CUTLASS 3 sm90a TMA warp-specialized bf16 "TN" GEMM: D[M,N] = A[M,K] @ B[N,K]^T (+ bias[N]).
// A, B, D row-major; fp32 accumulation; D is bf16 or fp32; bias is bf16 (nullptr = no bias).
// Residual configs: D = bf16(bf16(acc + bias) + D), D read in place (a linear, then the residual add).
#pragma once

#include <type_traits>

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace xserv {

using namespace cute;

struct Cooperative {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
  using Scheduler = void;  // persistent data-parallel tiles, no workspace
};
struct Pingpong {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
  using Scheduler = void;
};
// Cooperative, work split along K over every SM (stream-K, reduced in a fixed order); needs a workspace.
struct StreamK {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
  using Scheduler = cutlass::gemm::StreamKScheduler;
};
// Decode rows: operands swapped (the weights fill the 128-wide M side of the tile, the few activation rows the
// N side), stream-K over every SM with deterministic (turnstile) reduction.
using StreamKSwapAB = StreamK;

// Stream-K scheduler mode: splits 0 stream-K (CUTLASS's heuristic), 1 data-parallel, > 1 split-K; fixed order.
template <class Scheduler>
void set_decomposition(typename Scheduler::Arguments& s, int splits) {
  using Mode = typename Scheduler::DecompositionMode;
  s.reduction_mode = Scheduler::ReductionMode::Deterministic;
  if (splits > 1) {
    s.splits = splits;
    s.decomposition_mode = Mode::SplitK;
  } else {
    s.decomposition_mode = splits == 1 ? Mode::DataParallel : Mode::StreamK;
  }
}

inline int device_sms(int* device, int* sm_count) {
  if (cudaGetDevice(device) != cudaSuccess ||
      cudaDeviceGetAttribute(sm_count, cudaDevAttrMultiProcessorCount, *device) != cudaSuccess) {
    return static_cast<int>(cutlass::Status::kErrorInternal);
  }
  return 0;
}

// Launch into a caller-owned workspace (never allocates): 0 or a cutlass::Status value.
template <class Gemm>
int launch_gemm(typename Gemm::Arguments const& args, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  Gemm gemm;
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess) return static_cast<int>(st);
  if (Gemm::get_workspace_size(args) > workspace_bytes) return static_cast<int>(cutlass::Status::kErrorWorkspaceNull);
  st = gemm.initialize(args, workspace, stream);
  if (st != cutlass::Status::kSuccess) return static_cast<int>(st);
  return static_cast<int>(gemm.run(stream));
}

// Run/workspace of a config type G (G::arguments(A, B, D, bias, M, N, K, splits, device, sm_count)).
template <class G>
struct Launcher {
  static int run(const void* A, const void* B, void* D, const void* bias, int M, int N, int K, int splits,
                 void* workspace, size_t workspace_bytes, cudaStream_t stream) {
    if (!G::kSplits && splits > 1) return static_cast<int>(cutlass::Status::kErrorNotSupported);
    int device = 0, sm_count = 0;
    if (int st = device_sms(&device, &sm_count)) return st;
    return launch_gemm<typename G::Gemm>(G::arguments(A, B, D, bias, M, N, K, splits, device, sm_count), workspace,
                                         workspace_bytes, stream);
  }

  static size_t workspace_size(int M, int N, int K, int splits, int sm_count) {
    return G::Gemm::get_workspace_size(G::arguments(nullptr, nullptr, nullptr, nullptr, M, N, K, splits, 0, sm_count));
  }
};

template <int TM, int TN, int TK, int CM, int CN, class Schedule, class ElementD, bool Residual = false>
struct GemmSm90 {
  static_assert(!Residual || sizeof(ElementD) == 2, "the residual epilogue writes bf16");
  using ElementA = cutlass::bfloat16_t;
  using ElementB = cutlass::bfloat16_t;
  using ElementBias = cutlass::bfloat16_t;
  using ElementC = std::conditional_t<Residual, cutlass::bfloat16_t, void>;
  using ElementAcc = float;
  using LayoutA = cutlass::layout::RowMajor;     // [M, K], K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // [N, K] row-major == K x N column-major
  using LayoutD = cutlass::layout::RowMajor;     // [M, N]
  static constexpr int kAlignAB = 8;             // 16 bytes of bf16
  static constexpr int kAlignD = 16 / sizeof(ElementD);

  using TileShape = Shape<Int<TM>, Int<TN>, Int<TK>>;
  using ClusterShape = Shape<Int<CM>, Int<CN>, _1>;

  // D = acc + bias[n] (rounded to D's type); a null bias pointer broadcasts 0 and skips the load.
  using BiasRow = cutlass::epilogue::fusion::Sm90RowBroadcast<
      0, TileShape, ElementBias, ElementAcc, Stride<_0, _1, int64_t>, 8>;
  template <class In, class Other>
  using Add = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, ElementD, ElementAcc,
                                             cutlass::FloatRoundStyle::round_to_nearest>, In, Other>;
  using BiasAdd = Add<cutlass::epilogue::fusion::Sm90AccFetch, BiasRow>;
  using Fusion = std::conditional_t<Residual, Add<BiasAdd, cutlass::epilogue::fusion::Sm90SrcFetch<ElementC>>,
                                    BiasAdd>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementAcc,
      ElementC, LayoutD, kAlignD, ElementD, LayoutD, kAlignD,
      typename Schedule::Epilogue, Fusion>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlignAB,
      ElementB, LayoutB, kAlignAB, ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, typename Schedule::Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr bool kSplits = !std::is_void_v<typename Schedule::Scheduler>;  // stream-K / split-K

  static typename Gemm::Arguments arguments(const void* A, const void* B, void* D, const void* bias,
                                            int M, int N, int K, int splits, int device, int sm_count) {
    auto sA = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(M, K, 1));
    auto sB = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(N, K, 1));
    auto sD = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(M, N, 1));
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {M, N, K, 1},
        {static_cast<const ElementA*>(A), sA, static_cast<const ElementB*>(B), sB},
        {{}, static_cast<const ElementC*>(Residual ? D : nullptr), sD, static_cast<ElementD*>(D), sD}};
    typename BiasAdd::Arguments bias_add{
        {},                                                                        // acc
        {static_cast<const ElementBias*>(bias), ElementBias(0), {_0{}, _1{}, 0}},  // bias
        {}};                                                                       // plus
    if constexpr (Residual) {
      args.epilogue.thread = {bias_add, {}, {}};                                   // (acc + bias) + C
    } else {
      args.epilogue.thread = bias_add;
    }
    args.hw_info.device_id = device;
    args.hw_info.sm_count = sm_count;
    if constexpr (kSplits) set_decomposition<typename Kernel::TileScheduler>(args.scheduler, splits);
    return args;
  }
};

// D[M,N] = A[M,K] @ B[N,K]^T computed as D^T[N,M] = B @ A^T: B (the weights, N large) is the GEMM's A operand,
// A (M = a few activation rows) its B operand, D^T column-major == D row-major; bias[N] is a column broadcast.
// Stream-K (splits == 0: CUTLASS's heuristic) or split-K (splits > 1), reduced in a fixed order.
template <int TM, int TN, int TK, class ElementD>
struct GemmSm90SwapAB {
  using ElementW = cutlass::bfloat16_t;
  using ElementX = cutlass::bfloat16_t;
  using ElementBias = cutlass::bfloat16_t;
  using ElementAcc = float;
  using LayoutW = cutlass::layout::RowMajor;     // [N, K]
  using LayoutX = cutlass::layout::ColumnMajor;  // [M, K] row-major == K x M column-major
  using LayoutD = cutlass::layout::ColumnMajor;  // D^T [N, M] column-major == D [M, N] row-major
  static constexpr int kAlignAB = 8;
  static constexpr int kAlignD = 16 / sizeof(ElementD);

  using TileShape = Shape<Int<TM>, Int<TN>, Int<TK>>;
  using ClusterShape = Shape<_1, _1, _1>;

  using BiasCol = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, ElementBias, ElementAcc,
                                                              Stride<_1, _0, int64_t>, 8>;
  using Fusion = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, ElementD, ElementAcc,
                                             cutlass::FloatRoundStyle::round_to_nearest>,
      cutlass::epilogue::fusion::Sm90AccFetch, BiasCol>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementAcc,
      void, LayoutD, kAlignD, ElementD, LayoutD, kAlignD,
      typename StreamKSwapAB::Epilogue, Fusion>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementW, LayoutW, kAlignAB,
      ElementX, LayoutX, kAlignAB, ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename StreamKSwapAB::Kernel>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, typename StreamKSwapAB::Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr bool kSplits = true;

  static typename Gemm::Arguments arguments(const void* A, const void* B, void* D, const void* bias,
                                            int M, int N, int K, int splits, int device, int sm_count) {
    // GEMM problem: (N, M, K); operand A = weights B[N,K], operand B = activations A[M,K].
    auto sW = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(N, K, 1));
    auto sX = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(M, K, 1));
    auto sD = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(N, M, 1));
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {N, M, K, 1},
        {static_cast<const ElementW*>(B), sW, static_cast<const ElementX*>(A), sX},
        {{}, nullptr, sD, static_cast<ElementD*>(D), sD}};
    args.epilogue.thread = {
        {},
        {static_cast<const ElementBias*>(bias), ElementBias(0), {_1{}, _0{}, 0}},
        {}};
    args.hw_info.device_id = device;
    args.hw_info.sm_count = sm_count;
    set_decomposition<typename Kernel::TileScheduler>(args.scheduler, splits);
    return args;
  }
};

}  // namespace xserv
