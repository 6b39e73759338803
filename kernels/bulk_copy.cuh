// mbarrier and cp.async.bulk helpers of the kernels whose producer warp streams weights into shared memory with
// the copy engine (kernels/decode_megakernel.cu, gemv_tc.cu): u64 barriers addressed by generic pointers.
#pragma once
#include "common.cuh"

__device__ __forceinline__ u32 bulk_smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(u64* b, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bulk_smem(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bulk_smem(b)) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u64* b, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bulk_smem(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* b, u32 parity) {
    u32 ok = 0;
    while (!ok) {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}" : "=r"(ok) : "r"(bulk_smem(b)), "r"(parity) : "memory");
    }
}
// bytes (a multiple of 16) from global to shared memory, completing on bar; policy: an L2 cache hint
__device__ __forceinline__ void bulk_load(void* dst, const void* src, u32 bytes, u64* bar, u64 policy) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                 " [%0], [%1], %2, [%3], %4;"
                 :: "r"(bulk_smem(dst)), "l"(src), "r"(bytes), "r"(bulk_smem(bar)), "l"(policy) : "memory");
}
