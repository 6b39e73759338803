// (seq, tile) lookup shared by the prefill attention kernels (attention_prefill*.cu).
#pragma once
#include "common.cuh"

// Cache slot (32-bit) of key p of a seq through its block table row bt (block_size 1 << bs_log2).
__device__ __forceinline__ u32 paged_slot(const int* bt, int p, int bs_log2) {
    return ((u32)bt[p >> bs_log2] << bs_log2) + (p & ((1 << bs_log2) - 1));
}

// Which (seq, tile) block b takes, tiles of rows_per_tile query rows: the NT threads scan NT seqs at a time (tile
// counts, block prefix sum). seq -1: none (a spare block). Seqs with fewer than min_rows rows have no tiles.
template <int NT>
__device__ __forceinline__ void find_tile(const int* __restrict__ qsl, int num_seqs, int min_rows, int rows_per_tile,
                                          int b, int& seq, int& tile) {
    __shared__ int scan_w[NT / 32], found_seq, found_tile;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) found_seq = -1;
    __syncthreads();
    for (int base = 0, acc_tiles = 0; base < num_seqs; base += NT) {
        const int i = base + tid;
        const int n_i = i < num_seqs ? qsl[i + 1] - qsl[i] : 0;
        const int nt = n_i >= min_rows && n_i > 0 ? (n_i + rows_per_tile - 1) / rows_per_tile : 0;
        int incl = nt;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        if (lane == 31) scan_w[warp] = incl;
        __syncthreads();
        int total = 0;
#pragma unroll
        for (int w = 0; w < NT / 32; w++) {
            if (w < warp) incl += scan_w[w];
            total += scan_w[w];
        }
        const int lo = acc_tiles + incl - nt;
        if (nt > 0 && b >= lo && b < lo + nt) { found_seq = i; found_tile = b - lo; }
        acc_tiles += total;
        __syncthreads();
        if (found_seq >= 0 || acc_tiles > b) break;
    }
    seq = found_seq;
    tile = found_tile;
}

// A block's next (seq, tile) pair when the blocks loop past the grid (pairs blockIdx, + gridDim, ...): false after
// the last. The barrier after the search: every thread has read its result (and is done with the previous pair's
// shared memory) before the next search resets it. The caller keeps b in a register (the wgmma kernels)...
template <int NT>
__device__ __forceinline__ bool next_pair(const int* __restrict__ qsl, int num_seqs, int min_rows, int rows_per_tile,
                                          int b, int& seq, int& tile) {
    find_tile<NT>(qsl, num_seqs, min_rows, rows_per_tile, b, seq, tile);
    __syncthreads();
    return seq >= 0;
}
// ... or in shared memory (*b: blockIdx at the start, published; it advances by `grid`, gridDim of the pairs'
// axis): a register kept across the loop spilled 8 B in the 255-register pipe kernels (session 15). Every thread
// reads *b before find_tile's barriers, thread 0 advances it after them, the last barrier publishes it.
template <int NT>
__device__ __forceinline__ bool next_pair(const int* __restrict__ qsl, int num_seqs, int min_rows, int rows_per_tile,
                                          int* b, int grid, int& seq, int& tile) {
    const int bi = *b;
    find_tile<NT>(qsl, num_seqs, min_rows, rows_per_tile, bi, seq, tile);
    if (threadIdx.x == 0) *b = bi + grid;
    __syncthreads();
    return seq >= 0;
}

// Two finite floats to bf16 (round to nearest even, as pack2) in one instruction; lo in the low half.
__device__ __forceinline__ u32 pack2_rn(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
// 2^x on the SFU (one instruction; subnormal results flush to 0, exp2(-inf) = 0).
__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
