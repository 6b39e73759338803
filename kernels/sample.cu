// On-device sampling, one block (1024 threads) per row, no host sync. Semantics of docs/plan-format.md:
// greedy (lowest index on ties) when temperature <= 0; else e = exp(x - max x), x = logits / temperature,
// restricted to top_k, then to the shortest most-likely-first prefix reaching top_p, then the first token
// whose inclusive cumulative mass exceeds u * total. The order "most likely first, ties by lower index"
// is resolved without sorting: radix select over the bits of e (8 bits a pass), masses in 2^-40 fixed
// point (integer sums, so the result does not depend on thread order).
#include "common.cuh"

#define SM_THREADS 1024
#define FIX_SCALE 1099511627776.f     // 2^40

struct Boundary { u32 key; int idx; };   // tokens (key, i) with key > b.key or (key == b.key, i <= b.idx)

struct SampleSmem {
    u32 cnt[256];
    u64 mass[256];
    u64 wsum[32];
    int wcnt[32];
    u32 prefix;
    u64 above;
    int found;
    float fscratch[32];
};

__device__ __forceinline__ bool inside(u32 key, int i, bool has_b, Boundary b) {
    return !has_b || key > b.key || (key == b.key && i <= b.idx);
}
__device__ __forceinline__ u64 fixed(float e) { return (u64)__float2ull_rz(e * FIX_SCALE); }

__device__ u64 block_sum_u64(u64 v, SampleSmem& sm) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) sm.wsum[warp] = v;
    __syncthreads();
    u64 t = lane < (SM_THREADS / 32) ? sm.wsum[lane] : 0ull;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}

// First token (in order) whose inclusive cumulative count/mass is >= target (strict: > target), among
// tokens inside the boundary. Falls back to the last token in order when the target is never reached.
__device__ Boundary select_token(const float* __restrict__ x, float xmax, int V, bool use_mass, u64 target,
                                 bool strict, bool has_b, Boundary b, SampleSmem& sm) {
    const int tid = threadIdx.x;
    u32 prefix = 0, pmask = 0;
    u64 above = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int c = tid; c < 256; c += SM_THREADS) { sm.cnt[c] = 0; sm.mass[c] = 0; }
        __syncthreads();
        for (int i = tid; i < V; i += SM_THREADS) {
            float e = __expf(x[i] - xmax);
            u32 key = __float_as_uint(e);
            if ((key & pmask) == prefix && inside(key, i, has_b, b)) {
                u32 bin = (key >> shift) & 255u;
                atomicAdd(&sm.cnt[bin], 1u);
                if (use_mass) atomicAdd(&sm.mass[bin], fixed(e));
            }
        }
        __syncthreads();
        if (tid == 0) {
            u64 run = above, last_run = above;
            int chosen = -1, last = -1;
            for (int bin = 255; bin >= 0; bin--) {
                if (sm.cnt[bin] == 0) continue;
                u64 val = use_mass ? sm.mass[bin] : (u64)sm.cnt[bin];
                bool hit = strict ? (run + val > target) : (run + val >= target);
                if (hit) { chosen = bin; break; }
                last = bin; last_run = run;
                run += val;
            }
            if (chosen < 0) { chosen = last; run = last_run; }
            sm.prefix = prefix | ((u32)(chosen < 0 ? 0 : chosen) << shift);
            sm.above = run;
        }
        __syncthreads();
        prefix = sm.prefix; above = sm.above;
        pmask |= 255u << shift;
    }
    // prefix is the boundary key; take the j-th (1-based) tie in index order.
    const u32 v = prefix;
    const u32 ties = sm.cnt[v & 255u];
    u64 j;
    if (!use_mass) j = target > above ? target - above : 1;
    else {
        u64 fv = fixed(__uint_as_float(v));
        if (fv == 0) j = ties;
        else if (strict) j = (target >= above ? (target - above) / fv : 0) + 1;
        else j = target > above ? (target - above + fv - 1) / fv : 1;
    }
    if (j < 1) j = 1;
    if (j > ties) j = ties;
    __syncthreads();
    if (tid == 0) sm.found = -1;
    __syncthreads();
    if (ties <= 1) {
        for (int i = tid; i < V; i += SM_THREADS) {
            u32 key = __float_as_uint(__expf(x[i] - xmax));
            if (key == v && inside(key, i, has_b, b)) sm.found = i;
        }
    } else {
        const int lane = tid & 31, warp = tid >> 5;
        int need = (int)j;
        for (int base = 0; base < V; base += SM_THREADS) {
            int i = base + tid;
            bool f = i < V && __float_as_uint(__expf(x[i] - xmax)) == v && inside(v, i, has_b, b);
            u32 bal = __ballot_sync(0xffffffffu, f);
            if (lane == 0) sm.wcnt[warp] = __popc(bal);
            __syncthreads();
            int before = 0, total = 0;
            for (int w = 0; w < SM_THREADS / 32; w++) { if (w < warp) before += sm.wcnt[w]; total += sm.wcnt[w]; }
            int rank = before + __popc(bal & ((1u << lane) - 1u)) + 1;
            if (f && rank == need) sm.found = i;
            __syncthreads();
            if (need <= total) break;
            need -= total;
        }
    }
    __syncthreads();
    Boundary out; out.key = v; out.idx = sm.found;
    __syncthreads();
    return out;
}

extern "C" __global__ void __launch_bounds__(SM_THREADS) sample_rows(
        const float* __restrict__ logits, const float* __restrict__ temperature, const int* __restrict__ top_k,
        const float* __restrict__ top_p, const long long* __restrict__ seeds, const int* __restrict__ offsets,
        int* __restrict__ out, float* __restrict__ scaled, int V) {
    pdl_entry();
    __shared__ SampleSmem sm;
    __shared__ int sidx[32];
    const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float* lg = logits + (size_t)row * V;
    const float temp = temperature[row];
    if (!(temp > 0.f)) {                                        // greedy: max value, lowest index
        float best = -__int_as_float(0x7f800000); int bi = V;
        for (int i = tid; i < V; i += SM_THREADS) { float v = lg[i]; if (v > best) { best = v; bi = i; } }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o); int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
        }
        if (lane == 0) { sm.fscratch[warp] = best; sidx[warp] = bi; }
        __syncthreads();
        if (tid < 32) {
            best = sm.fscratch[tid]; bi = sidx[tid];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                float ov = __shfl_xor_sync(0xffffffffu, best, o); int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
            }
            if (tid == 0) out[row] = bi >= V ? 0 : bi;
        }
        return;
    }
    float* x = scaled + (size_t)row * V;                        // logits / temperature (workspace)
    float mx = -__int_as_float(0x7f800000);
    for (int i = tid; i < V; i += SM_THREADS) { float v = lg[i] / temp; x[i] = v; mx = fmaxf(mx, v); }
    mx = block_max(mx, sm.fscratch);
    __syncthreads();

    Boundary b; b.key = 0; b.idx = V; bool has_b = false;
    const int k = top_k[row];
    if (k > 0 && k < V) { b = select_token(x, mx, V, false, (u64)k, false, false, b, sm); has_b = true; }
    u64 total = 0;
    for (int i = tid; i < V; i += SM_THREADS) {
        float e = __expf(x[i] - mx);
        if (inside(__float_as_uint(e), i, has_b, b)) total += fixed(e);
    }
    total = block_sum_u64(total, sm);
    const float tp = top_p[row];
    if (tp < 1.f) {
        u64 target = (u64)((double)tp * (double)total);
        b = select_token(x, mx, V, true, target, false, has_b, b, sm); has_b = true;
        u64 t2 = 0;
        for (int i = tid; i < V; i += SM_THREADS) {
            float e = __expf(x[i] - mx);
            if (inside(__float_as_uint(e), i, has_b, b)) t2 += fixed(e);
        }
        total = block_sum_u64(t2, sm);
    }
    const u64 bits = splitmix_bits((u64)seeds[row], (u64)(unsigned)offsets[row]);
    const u64 target = __umul64hi(bits << 40, total);           // floor(u * total), u = bits * 2^-24
    Boundary s = select_token(x, mx, V, true, target, true, has_b, b, sm);
    if (tid == 0) out[row] = s.idx < 0 ? 0 : s.idx;
}

// Grammar masks before sampling: rows with bitmask_rows[row] != 0 get logits[row, i] = -inf unless bit i % 32 of
// mask[row, i / 32] is set; other rows pass through untouched (no mask was staged for them).
extern "C" __global__ void apply_token_bitmask(float* __restrict__ logits, const int* __restrict__ mask,
                                               const int* __restrict__ bitmask_rows, int V) {
    pdl_entry();
    const int row = blockIdx.x;
    if (!bitmask_rows[row]) return;
    const int W = (V + 31) >> 5;
    const int* m = mask + (size_t)row * W;
    float* lg = logits + (size_t)row * V;
    for (int i = threadIdx.x; i < V; i += blockDim.x)
        if (!((((u32)m[i >> 5]) >> (i & 31)) & 1u)) lg[i] = -__int_as_float(0x7f800000);
}
