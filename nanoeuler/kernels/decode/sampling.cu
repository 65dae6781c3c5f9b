// The decode engine's choice of the next token on the GPU (launchers in sampling.py): the argmax of rows
// of logits, greedy steps and verify passes that feed themselves, and sampling (temperature, top-k, top-p)
// from a counter-based generator. Reference: np.argmax, infer.generate.sampling_probs, and the greedy
// verify rule of infer.engine.
//
// Kernels: argmax_rows, argmax_chain, accept_chain, sample_rows (one block of SAMPLE_THREADS a row).

#include "decode.cuh"

// The argmax of z[0..V) over the block, in thread 0; the lowest index wins a tie (as np.argmax).
__device__ int block_argmax(const float* __restrict__ z, int V) {
    __shared__ float bv[32];
    __shared__ int bi[32];
    float best = NEG_INF;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = z[i];
        if (v > best || (v == best && i < idx)) { best = v; idx = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { bv[warp] = best; bi[warp] = idx; }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < (int)(blockDim.x >> 5); w++)
            if (bv[w] > best || (bv[w] == best && bi[w] < idx)) { best = bv[w]; idx = bi[w]; }
    return idx < V ? idx : 0;  // an all-NaN row: token 0
}

// out[r] = argmax of logits row r (V wide, rows `stride` apart).
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int V, long long stride,
                                       int* __restrict__ out) {
    pdl_wait();
    pdl_launch();
    const int idx = block_argmax(logits + blockIdx.x * stride, V);
    if (threadIdx.x == 0) out[blockIdx.x] = idx;
}

// Greedy decoding that feeds itself, one block per row of M: out[m] = the argmax of row m, which becomes
// the row's next input token at the next position (kept below L: a row that has finished may run on);
// the step's ids are kept at hist[(step % cap) M ...] (pinned host memory), step counting in ctl[3M + 1].
// ctl = [ids, slots, positions (M each), top_k, step, temperature, top_p]. The last block to finish (counted
// in *arrive) does the update. Steps replayed back to back then need nothing from the host, which reads hist while
// the GPU runs ahead.
extern "C" __global__ void argmax_chain(const float* __restrict__ logits, int V, int* out, int* __restrict__ ctl,
                                        int* __restrict__ hist, int cap, int L, int* arrive) {
    __shared__ bool last;
    pdl_wait();
    pdl_launch();
    const int M = gridDim.x;
    const int idx = block_argmax(logits + (long long)blockIdx.x * V, V);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = idx;
        __threadfence();
        last = atomicAdd(arrive, 1) == M - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int step = ctl[3 * M + 1];
    for (int m = threadIdx.x; m < M; m += blockDim.x) chain_row(ctl, hist, M, m, ((volatile int*)out)[m], step, cap, L);
    __threadfence_system();  // hist is the host's (pinned) memory
    __syncthreads();
    if (threadIdx.x == 0) {
        ctl[3 * M + 1] = step + 1;
        *arrive = 0;
    }
}

// Greedy self-speculative decoding that feeds itself: after a verify pass of one slot's K rows
// [sure, draft 1, ..., draft K-1] at positions p0 .. p0+K-1 with every head's argmax in out (row-major
// (K rows, K heads)), keep drafts while each equals head 0's argmax at the row before it (a of them),
// and write the next pass's block (the K heads' ids at row a: next sure token, then drafts) at positions
// p0+a+1 ... into ctl = [ids (K), slots (K), positions (K), top_k, pass, temperature, top_p]. The pass
// is recorded at hist[(pass % cap) * (2K+1)]: a, the block verified, the K heads' ids at row a.
extern "C" __global__ void accept_chain(const int* __restrict__ out, int* __restrict__ ctl,
                                        int* __restrict__ hist, int cap, int K) {
    pdl_wait();
    pdl_launch();
    if (threadIdx.x != 0) return;
    const int pass = ctl[3 * K + 1];
    int* rec = hist + (long long)(pass % cap) * (2 * K + 1);
    int a = 0;
    while (a < K - 1 && out[a * K] == ctl[a + 1]) a++;
    rec[0] = a;
    const int p0 = ctl[2 * K];
    for (int j = 0; j < K; j++) {
        rec[1 + j] = ctl[j];
        rec[1 + K + j] = out[a * K + j];
    }
    __threadfence_system();  // hist is the host's (pinned) memory
    for (int j = 0; j < K; j++) {
        ctl[j] = out[a * K + j];
        ctl[2 * K + j] = p0 + a + 1 + j;
    }
    ctl[3 * K + 1] = pass + 1;
}

// splitmix64: a counter-based generator; uniform in [0, 1) from (seed, counter).
__device__ __forceinline__ double uniform01(unsigned long long seed, unsigned long long counter) {
    unsigned long long z = seed + 0x9E3779B97F4A7C15ull * (counter + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

// One sampled token per row, as generate.sampling_probs: logits / temperature, keep the top_k largest
// (0 = all; ties with the k-th all stay), then the most likely tokens whose mass first reaches top_p
// (by a threshold on the logit, so ties at the threshold all stay), and draw with the counter-based
// generator at (seeds[row], counter). ctl: int32 [top_k, counter, bits of temperature, bits of top_p].
// One block of SAMPLE_THREADS per row; V <= SAMPLE_THREADS * SAMPLE_PER_THREAD.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_rows(const float* __restrict__ logits, int V,
        long long stride, const int* __restrict__ ctl, const unsigned long long* __restrict__ seeds,
        int* __restrict__ out) {
    __shared__ float red[32];
    pdl_wait();
    pdl_launch();
    const float* z = logits + blockIdx.x * stride;
    const int top_k = ctl[0];
    const unsigned long long counter = (unsigned)ctl[1];
    const float temp = __int_as_float(ctl[2]), top_p = __int_as_float(ctl[3]);
    const int per = (V + blockDim.x - 1) / blockDim.x, lo = threadIdx.x * per, hi = min(V, lo + per);
    float zl[SAMPLE_PER_THREAD];
    float mx = NEG_INF;
    for (int i = lo; i < hi; i++) { zl[i - lo] = z[i] / temp; mx = fmaxf(mx, zl[i - lo]); }
    mx = block_max(mx, red);
    unsigned thr = 0;  // keep key(z) >= thr
    if (top_k > 0 && top_k < V) {
        for (int bit = 31; bit >= 0; bit--) {  // the largest threshold with at least top_k keys at or above it
            const unsigned cand = thr | (1u << bit);
            float cnt = 0.f;
            for (int i = lo; i < hi; i++) cnt += okey(zl[i - lo]) >= cand;
            if (block_sum(cnt, red) >= (float)top_k) thr = cand;
        }
    }
    float tot = 0.f;
    for (int i = lo; i < hi; i++) tot += okey(zl[i - lo]) >= thr ? __expf(zl[i - lo] - mx) : 0.f;
    tot = block_sum(tot, red);
    if (top_p < 1.f) {  // the largest threshold whose kept mass (top-k's tokens above it) still reaches top_p
        unsigned t = 0;
        for (int bit = 31; bit >= 0; bit--) {
            const unsigned cand = max(t | (1u << bit), thr);
            float mass = 0.f;
            for (int i = lo; i < hi; i++) mass += okey(zl[i - lo]) >= cand ? __expf(zl[i - lo] - mx) : 0.f;
            if (block_sum(mass, red) >= top_p * tot) t = t | (1u << bit);
        }
        thr = max(t, thr);
        tot = 0.f;
        for (int i = lo; i < hi; i++) tot += okey(zl[i - lo]) >= thr ? __expf(zl[i - lo] - mx) : 0.f;
        tot = block_sum(tot, red);
    }
    // inverse CDF in index order: each thread's chunk mass, an exclusive scan over threads, then a walk
    __shared__ float scan[SAMPLE_THREADS];
    __shared__ int pick;
    float mine = 0.f;
    for (int i = lo; i < hi; i++) mine += okey(zl[i - lo]) >= thr ? __expf(zl[i - lo] - mx) : 0.f;
    scan[threadIdx.x] = mine;
    if (threadIdx.x == 0) pick = -1;
    __syncthreads();
    for (int off = 1; off < (int)blockDim.x; off <<= 1) {  // inclusive Hillis-Steele scan
        const float v = threadIdx.x >= off ? scan[threadIdx.x - off] : 0.f;
        __syncthreads();
        scan[threadIdx.x] += v;
        __syncthreads();
    }
    const float total = scan[blockDim.x - 1];
    const float u = (float)(uniform01(seeds[blockIdx.x], counter) * total);
    float c = scan[threadIdx.x] - mine;
    if (mine > 0.f && u >= c && u < c + mine) {
        int last = -1;
        for (int i = lo; i < hi; i++) {
            if (okey(zl[i - lo]) < thr) continue;
            last = i;
            c += __expf(zl[i - lo] - mx);
            if (u < c) break;
        }
        atomicMax(&pick, last);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int t = pick;
        if (t < 0) {  // u fell past the total by rounding: the last kept token
            for (int i = V - 1; i >= 0; i--)
                if (okey(z[i] / temp) >= thr) { t = i; break; }
        }
        out[blockIdx.x] = t;
    }
}
