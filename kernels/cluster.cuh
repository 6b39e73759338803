// Thread-block cluster helpers: the cluster-wide barrier and reads of a peer block's shared memory (DSMEM).
#pragma once
#include "common.cuh"

__device__ __forceinline__ void cluster_barrier() {
    asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}
// The same shared-memory offset in the block of cluster rank `rank`, read as 4 floats.
__device__ __forceinline__ float4 ld_cluster_v4(u32 local, u32 rank) {
    u32 remote;
    float4 v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(remote) : "memory");
    return v;
}
