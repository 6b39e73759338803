// Hopper TMA (cp.async.bulk.tensor) building blocks. A tensor map is the plan's launch argument ["tmap", spec]
// (docs/plan-format.md "Tensor maps"), encoded by the runtime at plan load (cuTensorMapEncodeTiled) and passed by
// value: kernel parameter `const __grid_constant__ TmaDesc name` (its address is the map's generic address).
#pragma once
#include "common.cuh"

struct __align__(64) TmaDesc { u64 opaque[16]; };

__device__ __forceinline__ void tma_prefetch(const TmaDesc& map) {
    asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<u64>(&map)) : "memory");
}
// The box at coordinates (c0 innermost, c1) of a 2-D map into shared memory at dst; the bytes count on mbarrier bar.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaDesc& map, int c0, int c1, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(dst), "l"(reinterpret_cast<u64>(&map)), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
// One arrival on bar that also expects `bytes` more bytes of asynchronous copies in the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
// mbarrier inits visible to the async proxy (TMA's complete_tx) and to the cluster.
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
