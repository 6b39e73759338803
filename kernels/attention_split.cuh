// Split-KV bookkeeping shared by the batched decode kernels (attention_decode_batched.cu, attention_decode_tc.cu):
// which keys a (seq, split) block owns, zeroing rows no sequence covers, and the last-finishing split block
// combining every split's partial (o, m, l) in split order. m is natural-log or log2 scaled (LOG2).
#pragma once
#include "common.cuh"

#define SPLIT_MIN_TILES 4     // a split holds at least this many key tiles (H200 sweep: shorter splits lose)

struct SplitRange {
    int row;       // the sequence's one query row
    int active;    // splits that hold keys of this sequence
    int k0, kend;  // keys [k0, kend) of this block
    int ntiles;    // tiles of `tile` keys in the range
};

// False when the block has nothing to do (not a one-row sequence, empty, or a split past the context).
// A split holds >= min_tiles tiles (fewer splits than NS for short contexts; one split: no combine).
__device__ __forceinline__ bool split_range(const int* qsl, const int* seq_lens, int i, int s, int NS, int tile,
                                            SplitRange& r, int min_tiles = SPLIT_MIN_TILES) {
    r.row = qsl[i];
    const int Lc = seq_lens[i];
    if (qsl[i + 1] - r.row != 1 || Lc <= 0) return false;
    const int tiles = (Lc + tile - 1) / tile;
    const int want = min(NS, (tiles + min_tiles - 1) / min_tiles);
    const int chunk = ((tiles + want - 1) / want) * tile;
    r.active = (Lc + chunk - 1) / chunk;
    r.k0 = blockIdx.z * chunk;
    if (r.k0 >= Lc) return false;
    r.kend = min(r.k0 + chunk, Lc);
    r.ntiles = (r.kend - r.k0 + tile - 1) / tile;
    return true;
}

// Split-0 blocks zero the output rows past qsl[num_seqs] (num_seqs = gridDim.x) for their kv head's q heads.
__device__ __forceinline__ void zero_uncovered_rows(bf16* out, const int* qsl, int T, int nh, int G, int HD, int kvh) {
    if (blockIdx.z != 0) return;
    for (int r = qsl[gridDim.x] + blockIdx.x; r < T; r += gridDim.x)
        for (int c = threadIdx.x; c < G * HD; c += blockDim.x) out[((size_t)r * nh + kvh * G) * HD + c] = 0;
}

template <bool LOG2>
__device__ __forceinline__ float split_weight(float m, float M) {
    if (m == -__int_as_float(0x7f800000)) return 0.f;
    return LOG2 ? exp2f(m - M) : __expf(m - M);
}

// After this block wrote its partials for seq i: the last block of (i, kvh) to finish combines the `active`
// splits into out (normalized bf16) and resets the counter. wbuf: >= GM * gridDim.z floats of shared memory.
// UNROLL8: the split loop's loads unrolled by 8 (the few-seq kernel, whose one combining block is its tail).
template <int HD, int GM, bool LOG2, bool UNROLL8 = false>
__device__ __forceinline__ void combine_splits_if_last(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                                       int* __restrict__ counters, bf16* __restrict__ out, int i,
                                                       int kvh, int row, int nh, int nkv, int active, float* wbuf) {
    __shared__ int is_last;
    __shared__ float Ls[GM];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5, NS = gridDim.z;
    const int G = nh / nkv;
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        const int prev = atomicAdd(&counters[i * nkv + kvh], 1);
        is_last = prev == active - 1;
        if (is_last) counters[i * nkv + kvh] = 0;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    for (int g = warp; g < G; g += nwarps) {
        const size_t base = ((size_t)i * nh + kvh * G + g) * NS;
        float M = -__int_as_float(0x7f800000);
        for (int z = lane; z < active; z += 32) M = fmaxf(M, __ldcg(part_ml + (base + z) * 2));
        M = warp_max(M);
        float L = 0.f;
        for (int z = lane; z < active; z += 32) {
            const float w = split_weight<LOG2>(__ldcg(part_ml + (base + z) * 2), M);
            wbuf[g * NS + z] = w;
            L += w * __ldcg(part_ml + (base + z) * 2 + 1);
        }
        L = warp_sum(L);
        if (lane == 0) Ls[g] = L;
    }
    __syncthreads();
    for (int c = tid; c < G * (HD / 4); c += blockDim.x) {
        const int g = c / (HD / 4), d4 = (c % (HD / 4)) * 4, h = kvh * G + g;
        const float* po = part_o + ((size_t)i * nh + h) * NS * HD + d4;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        if constexpr (UNROLL8) {
#pragma unroll 8
            for (int z = 0; z < active; z++) {
                const float w = wbuf[g * NS + z];
                const float4 v = __ldcg(reinterpret_cast<const float4*>(po + (size_t)z * HD));
                a.x += w * v.x; a.y += w * v.y; a.z += w * v.z; a.w += w * v.w;
            }
        } else {
            for (int z = 0; z < active; z++) {
                const float w = wbuf[g * NS + z];
                const float4 v = __ldcg(reinterpret_cast<const float4*>(po + (size_t)z * HD));
                a.x += w * v.x; a.y += w * v.y; a.z += w * v.z; a.w += w * v.w;
            }
        }
        const float inv = Ls[g] > 0.f ? 1.f / Ls[g] : 0.f;
        u32* dst = reinterpret_cast<u32*>(out + ((size_t)row * nh + h) * HD + d4);
        dst[0] = pack2(a.x * inv, a.y * inv);
        dst[1] = pack2(a.z * inv, a.w * inv);
    }
}

// Write this block's (o, m, l) for head g, dim d: the output itself when the seq has one split, else a partial.
__device__ __forceinline__ void store_split(float* __restrict__ part_o, float* __restrict__ part_ml, bf16* __restrict__ out,
                                            int i, int row, int h, int d, int HD, int nh, int active,
                                            float o, float m, float l) {
    if (active == 1) {
        out[((size_t)row * nh + h) * HD + d] = f2bf(l > 0.f ? o / l : 0.f);
        return;
    }
    const size_t idx = ((size_t)i * nh + h) * gridDim.z + blockIdx.z;
    part_o[idx * HD + d] = o;
    if (d == 0) { part_ml[idx * 2] = m; part_ml[idx * 2 + 1] = l; }
}
