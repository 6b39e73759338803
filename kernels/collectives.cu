// Tensor-parallel plans (plan op all_gather): ncclAllGather leaves rank r's [rows, n] block of logits at
// gathered[r] ([ranks, rows, n]); this lays the blocks side by side: out[i, r * n + j] = gathered[r, i, j].
#include "common.cuh"

extern "C" __global__ void gather_shard_columns(const float* __restrict__ gathered, float* __restrict__ out,
                                                int rows, int n, int ranks) {
    pdl_entry();
    const int i = blockIdx.x, r = blockIdx.y;
    const float* src = gathered + ((size_t)r * rows + i) * n;
    float* dst = out + (size_t)i * ranks * n + (size_t)r * n;
    for (int j = threadIdx.x; j < n; j += blockDim.x) dst[j] = src[j];
}
