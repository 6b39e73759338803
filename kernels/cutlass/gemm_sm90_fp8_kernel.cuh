// CUTLASS 3 sm90a TMA warp-specialized FP8 (e4m3 x e4m3) "TN" GEMMs with scales: D[M,N] from A[M,K] (activations,
// quantized per row and K group) and B[N,K] (weights), fp32 accumulation, bf16 or fp32 D, optional bf16 bias[N].
// Schedules and the workspace launch are the bf16 GEMMs' (gemm_sm90_kernel.cuh).
#pragma once

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "gemm_sm90_kernel.cuh"

namespace xserv {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

struct Channel {};
struct Block128 {};

template <class TileShape, class ElementD, class ElementAcc>
using BiasPlus = fusion::Sm90EVT<
    fusion::Sm90Compute<cutlass::plus, ElementD, ElementAcc, cutlass::FloatRoundStyle::round_to_nearest>,
    fusion::Sm90AccFetch,
    fusion::Sm90RowBroadcast<0, TileShape, cutlass::bfloat16_t, ElementAcc, Stride<_0, _1, int64_t>, 8>>;

// ((acc * sx[m]) * sw[n]) + bias[n], in fp32, rounded once to ElementD.
template <class TileShape, class ElementD, class ElementAcc>
using ChannelScaled = fusion::Sm90EVT<
    fusion::Sm90Compute<cutlass::plus, ElementD, ElementAcc, cutlass::FloatRoundStyle::round_to_nearest>,
    fusion::Sm90EVT<
        fusion::Sm90Compute<cutlass::multiplies, ElementAcc, ElementAcc, cutlass::FloatRoundStyle::round_to_nearest>,
        fusion::Sm90EVT<
            fusion::Sm90Compute<cutlass::multiplies, ElementAcc, ElementAcc,
                                cutlass::FloatRoundStyle::round_to_nearest>,
            fusion::Sm90AccFetch,
            fusion::Sm90ColBroadcast<0, TileShape, float, ElementAcc, Stride<_1, _0, int64_t>, 1>>,
        fusion::Sm90RowBroadcast<0, TileShape, float, ElementAcc, Stride<_0, _1, int64_t>, 4>>,
    fusion::Sm90RowBroadcast<0, TileShape, cutlass::bfloat16_t, ElementAcc, Stride<_0, _1, int64_t>, 8>>;

// Schedule: Cooperative (persistent tiles), Pingpong (two tiles an SM, one a consumer warpgroup) or StreamK
// (cooperative, the K loop of the tiles spread over every SM, reduced in a fixed order in a workspace).
template <class Scheme, int TM, int TN, int TK, int CM, int CN, class Schedule, class ElementD>
struct GemmSm90Fp8 {
  static constexpr bool kBlock = std::is_same_v<Scheme, Block128>;
  static constexpr bool kPingpong = std::is_same_v<Schedule, Pingpong>;
  static constexpr bool kSplits = !std::is_void_v<typename Schedule::Scheduler>;
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementAcc = float;
  using LayoutA = cutlass::layout::RowMajor;     // [M, K]
  using LayoutB = cutlass::layout::ColumnMajor;  // [N, K] row-major
  using LayoutD = cutlass::layout::RowMajor;     // [M, N]
  static constexpr int kAlignAB = 16;            // 16 bytes of e4m3
  static constexpr int kAlignD = 16 / sizeof(ElementD);

  using TileShape = Shape<Int<TM>, Int<TN>, Int<TK>>;
  using ClusterShape = Shape<Int<CM>, Int<CN>, _1>;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K,
                                                                cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using Fusion = std::conditional_t<kBlock, BiasPlus<TileShape, ElementD, ElementAcc>,
                                    ChannelScaled<TileShape, ElementD, ElementAcc>>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementAcc,
      void, LayoutD, kAlignD, ElementD, LayoutD, kAlignD, typename Schedule::Epilogue, Fusion>::CollectiveOp;

  using StrideArgA = std::conditional_t<kBlock, cute::tuple<LayoutA, LayoutSFA>, LayoutA>;
  using StrideArgB = std::conditional_t<kBlock, cute::tuple<LayoutB, LayoutSFB>, LayoutB>;
  using MainloopSchedule = std::conditional_t<
      kPingpong,
      std::conditional_t<kBlock, cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise,
                         cutlass::gemm::KernelTmaWarpSpecializedPingpong>,
      std::conditional_t<kBlock, cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperative>>;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, StrideArgA, kAlignAB,
      ElementB, StrideArgB, kAlignAB, ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, typename Schedule::Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments arguments(const void* A, const void* SA, const void* B, const void* SB, void* D,
                                            const void* bias, int M, int N, int K, int splits, int device,
                                            int sm_count) {
    auto sA = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(M, K, 1));
    auto sB = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(N, K, 1));
    auto sD = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(M, N, 1));
    auto a = static_cast<const ElementA*>(A);
    auto b = static_cast<const ElementB*>(B);
    auto d = static_cast<ElementD*>(D);
    auto bias_bf = static_cast<const cutlass::bfloat16_t*>(bias);
    typename Gemm::Arguments args;
    if constexpr (kBlock) {
      auto lsa = ScaleConfig::tile_atom_to_shape_SFA(make_shape(M, N, K, 1));
      auto lsb = ScaleConfig::tile_atom_to_shape_SFB(make_shape(M, N, K, 1));
      args = typename Gemm::Arguments{
          cutlass::gemm::GemmUniversalMode::kGemm, {M, N, K, 1},
          {a, sA, b, sB, static_cast<const float*>(SA), lsa, static_cast<const float*>(SB), lsb},
          {{}, nullptr, sD, d, sD}};
      args.epilogue.thread = {{}, {bias_bf, cutlass::bfloat16_t(0), {_0{}, _1{}, 0}}, {}};
    } else {
      args = typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGemm, {M, N, K, 1}, {a, sA, b, sB},
                                      {{}, nullptr, sD, d, sD}};
      args.epilogue.thread = {
          {{{}, {static_cast<const float*>(SA), 0.f, {_1{}, _0{}, 0}}, {}},
           {static_cast<const float*>(SB), 0.f, {_0{}, _1{}, 0}},
           {}},
          {bias_bf, cutlass::bfloat16_t(0), {_0{}, _1{}, 0}},
          {}};
    }
    args.hw_info.device_id = device;
    args.hw_info.sm_count = sm_count;
    if constexpr (kSplits) set_decomposition<typename Kernel::TileScheduler>(args.scheduler, splits);
    return args;
  }

  // Returns 0 or a cutlass::Status value; never allocates (stream-K scratch: the caller's workspace).
  // splits (stream-K configs): 0 stream-K, 1 data-parallel, > 1 split-K; the others take 0 or 1 only.
  static int run(const void* A, const void* SA, const void* B, const void* SB, void* D, const void* bias, int M,
                 int N, int K, int splits, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
    if (!kSplits && splits > 1) return static_cast<int>(cutlass::Status::kErrorNotSupported);
    int device = 0, sm_count = 0;
    if (int st = device_sms(&device, &sm_count)) return st;
    return launch_gemm<Gemm>(arguments(A, SA, B, SB, D, bias, M, N, K, splits, device, sm_count), workspace,
                             workspace_bytes, stream);
  }

  static size_t workspace_size(int M, int N, int K, int splits, int sm_count) {
    return Gemm::get_workspace_size(arguments(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, M, N, K, splits,
                                              0, sm_count));
  }
};

}  // namespace xserv
