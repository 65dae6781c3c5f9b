// Kernels of the decode engine (nanoeuler/infer/gpu.py): the model's forward over "rows", each row one
// token at (slot, position) of a preallocated KV cache, and the choice of the next token on the GPU.
//
// A row's token id, cache slot and position sit in an int32 `meta` array: ids[M], slot[M], pos[M].
// Weights and the cache are stored as W = bf16 (raw 16-bit words, as in bf16.cu) or float; all arithmetic
// is float32 and activations between kernels are float32 (the GEMV kernels) or W (cuBLAS operands).
//
// References (NumPy, float64): nanoeuler.model.layers (rmsnorm, rope, attention, swiglu, embedding) and
// nanoeuler.infer.generate.sampling_probs (temperature, top-k, top-p).

typedef unsigned short bf16;
#define NEG_INF __int_as_float(0xff800000)  // NVRTC has no INFINITY

// bf16 <-> float (the same few lines as bf16.cu): widen by a shift, narrow with round-to-nearest-even.
__device__ __forceinline__ float bf2f(bf16 h) { return __uint_as_float(((unsigned)h) << 16); }
__device__ __forceinline__ bf16 f2bf(float f) {
    bf16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float tof(float x) { return x; }
__device__ __forceinline__ float tof(bf16 x) { return bf2f(x); }
template <typename T> __device__ __forceinline__ T fromf(float x);
template <> __device__ __forceinline__ float fromf<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 fromf<bf16>(float x) { return f2bf(x); }

// 16 bytes of a weight row as floats: 8 bf16 or 4 float.
template <typename W> struct Vec;
template <> struct Vec<bf16> {
    static constexpr int N = 8;
    __device__ static void load(const bf16* p, float* out) {
        uint4 u = *reinterpret_cast<const uint4*>(p);
        unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            out[2 * i] = __uint_as_float(w[i] << 16);
            out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
};
template <> struct Vec<float> {
    static constexpr int N = 4;
    __device__ static void load(const float* p, float* out) {
        float4 u = *reinterpret_cast<const float4*>(p);
        out[0] = u.x; out[1] = u.y; out[2] = u.z; out[3] = u.w;
    }
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Block-wide sum / max (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float block_sum(float v) {
    __shared__ float red[32];
    __shared__ float total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? red[lane] : 0.f;
        v = warp_sum(v);
        if (lane == 0) total = v;
    }
    __syncthreads();
    return total;
}
__device__ float block_max(float v) {
    __shared__ float red[32];
    __shared__ float total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? red[lane] : NEG_INF;
        v = warp_max(v);
        if (lane == 0) total = v;
    }
    __syncthreads();
    return total;
}

// ---- embedding: x[m] = emb[ids[m]] (float32 residual stream) ----------------------------------------

template <typename W>
__device__ void embed(const int* meta, const W* emb, float* x, int M, int C) {
    const int m = blockIdx.x;
    const long long id = meta[m];
    for (int c = threadIdx.x; c < C; c += blockDim.x) x[(long long)m * C + c] = tof(emb[id * C + c]);
}

// ---- GEMV: y[m, n] = sum_k W[n, k] * a[m, k] for a few rows m ---------------------------------------
// One warp per two output rows (rows n and n + N for the SwiGLU form), streaming the weight rows in
// 16-byte loads; the block first stages up to GEMV_ROWS input rows in shared memory (grid.y covers the
// rest), applying the RMSNorm (x / rms(x) * gain) there when `gain` is given. Epilogues:
//   EPI_STORE  y[m, n] = acc
//   EPI_ADD    y[m, n] += acc                         (a branch joining the residual stream)
//   EPI_SWIGLU y[m, n] = silu(acc_n) * acc_{n + N}    (W holds gate rows, then up rows)
#define GEMV_ROWS 4
#define GEMV_WARPS 8
#define GEMV_UNROLL 4
enum { EPI_STORE = 0, EPI_ADD = 1, EPI_SWIGLU = 2 };

// GEMV_UNROLL 16-byte loads per lane and weight row, all issued before any is used: a warp keeps several
// loads in flight instead of waiting out the memory latency once per load.
template <typename W>
__device__ __forceinline__ void load_chunk(const W* __restrict__ w, const int* wrow, int parts, int K, int k0,
                                           float (&wv)[2][GEMV_UNROLL][Vec<W>::N]) {
#pragma unroll
    for (int p = 0; p < 2; p++) {
        if (p >= parts) break;
        const W* wr = w + (long long)wrow[p] * K;
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            const int k = k0 + u * 32 * Vec<W>::N;
            if (k < K) Vec<W>::load(wr + k, wv[p][u]);
        }
    }
}

template <typename W, int EPI>
__device__ void gemv(const W* __restrict__ w, const float* __restrict__ x, const float* __restrict__ gain,
                     float* __restrict__ y, int M, int N, int K, float eps) {
    extern __shared__ float xs[];  // (rows, K)
    const int m0 = blockIdx.y * GEMV_ROWS;
    const int rows = min(GEMV_ROWS, M - m0);
    const int lane = threadIdx.x & 31;
    const int wid = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    // a warp computes two output rows, so each x value read from shared memory feeds two weights:
    // rows 2 wid and 2 wid + 1, or for the SwiGLU gate row wid and up row wid + N
    int wrow[2];
    wrow[0] = EPI == EPI_SWIGLU ? wid : 2 * wid;
    wrow[1] = EPI == EPI_SWIGLU ? wid + N : 2 * wid + 1;
    const bool active = wrow[0] < N;
    const int parts = (EPI != EPI_SWIGLU && wrow[1] >= N) ? 1 : 2;
    constexpr int V = Vec<W>::N;
    float wv[2][GEMV_UNROLL][V];
    // the first weights are requested before x is staged, so the two memory latencies overlap
    if (active && K % V == 0) load_chunk<W>(w, wrow, parts, K, lane * V, wv);
    for (int r = 0; r < rows; r++) {
        const float* xr = x + (long long)(m0 + r) * K;
        float ss = 0.f;
        for (int k = threadIdx.x; k < K; k += blockDim.x) {
            const float v = xr[k];
            xs[r * K + k] = v;
            ss += v * v;
        }
        if (gain != nullptr) {  // uniform branch: block_sum's barriers are reached by every thread
            const float rstd = rsqrtf(block_sum(ss) / K + eps);
            for (int k = threadIdx.x; k < K; k += blockDim.x) xs[r * K + k] = xs[r * K + k] * rstd * gain[k];
        }
    }
    __syncthreads();
    if (!active) return;
    float acc[2][GEMV_ROWS];
#pragma unroll
    for (int p = 0; p < 2; p++)
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) acc[p][r] = 0.f;
    if (K % V == 0) {
        for (int k0 = lane * V; k0 < K; k0 += 32 * V * GEMV_UNROLL) {
            if (k0 != lane * V) load_chunk<W>(w, wrow, parts, K, k0, wv);
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; u++) {
                const int k = k0 + u * 32 * V;
                if (k >= K) break;
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; r++) {
                    if (r >= rows) break;
                    float xv[V];  // 16-byte shared-memory loads
#pragma unroll
                    for (int i = 0; i < V; i += 4) {
                        const float4 t = *reinterpret_cast<const float4*>(xs + r * K + k + i);
                        xv[i] = t.x; xv[i + 1] = t.y; xv[i + 2] = t.z; xv[i + 3] = t.w;
                    }
#pragma unroll
                    for (int p = 0; p < 2; p++) {
                        if (p >= parts) break;
#pragma unroll
                        for (int i = 0; i < V; i++) acc[p][r] += wv[p][u][i] * xv[i];
                    }
                }
            }
        }
    } else {  // rows not 16-byte aligned: one element per lane
        for (int p = 0; p < parts; p++) {
            const W* wr = w + (long long)wrow[p] * K;
            for (int k = lane; k < K; k += 32) {
                const float wk = tof(wr[k]);
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; r++)
                    if (r < rows) acc[p][r] += wk * xs[r * K + k];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) {
        if (r >= rows) break;
        const float a0 = warp_sum(acc[0][r]);
        const float a1 = warp_sum(acc[1][r]);
        if (lane == 0) {
            float* out = y + (long long)(m0 + r) * N;
            if (EPI == EPI_SWIGLU) {
                out[wid] = a0 / (1.f + __expf(-a0)) * a1;
            } else {
                if (EPI == EPI_STORE) out[wrow[0]] = a0;
                if (EPI == EPI_ADD) out[wrow[0]] += a0;
                if (parts == 2 && EPI == EPI_STORE) out[wrow[1]] = a1;
                if (parts == 2 && EPI == EPI_ADD) out[wrow[1]] += a1;
            }
        }
    }
}

// ---- RoPE on q and k, k and v written into the cache -------------------------------------------------
// qkv (M, (H + 2 Hkv) D) float; q (M, H, D) float out; caches (slots, Hkv, L, D) of W.
// cos/sin (L, D/2): the tables of layers.rope_tables for every position of the context.

template <typename W>
__device__ void rope_cache(const float* __restrict__ qkv, const int* __restrict__ meta, float* __restrict__ q,
                           W* __restrict__ kc, W* __restrict__ vc, const float* __restrict__ cos_t,
                           const float* __restrict__ sin_t, int M, int H, int Hkv, int D, int L) {
    const int m = blockIdx.x;
    const int slot = meta[M + m], pos = meta[2 * M + m];
    const int half = D / 2, width = (H + 2 * Hkv) * D;
    const float* row = qkv + (long long)m * width;
    for (int i = threadIdx.x; i < (H + Hkv) * half; i += blockDim.x) {
        const int head = i / half, j = i % half;
        const float c = cos_t[pos * half + j], s = sin_t[pos * half + j];
        const float x1 = row[head * D + j], x2 = row[head * D + j + half];
        const float y1 = x1 * c - x2 * s, y2 = x2 * c + x1 * s;
        if (head < H) {
            q[((long long)m * H + head) * D + j] = y1;
            q[((long long)m * H + head) * D + j + half] = y2;
        } else {
            W* dst = kc + (((long long)slot * Hkv + (head - H)) * L + pos) * D;
            dst[j] = fromf<W>(y1);
            dst[j + half] = fromf<W>(y2);
        }
    }
    for (int i = threadIdx.x; i < Hkv * D; i += blockDim.x) {
        const int h = i / D, d = i % D;
        vc[(((long long)slot * Hkv + h) * L + pos) * D + d] = fromf<W>(row[(H + Hkv) * D + i]);
    }
}

// ---- attention of one row and query head over its slot's cache, keys 0..pos ---------------------------
// grid (M, H); one thread per key for the scores (a whole D-dot each), then groups of D threads split the
// keys for p @ V (a block of 512 threads: 8 groups at D = 64) and add up in shared memory. Shared: q (D) + scores (L) + partial outputs.

template <typename W, typename O>
__device__ void attend(const float* __restrict__ q, const W* __restrict__ kc, const W* __restrict__ vc,
                       const int* __restrict__ meta, O* __restrict__ out, int M, int H, int Hkv, int D, int L) {
    extern __shared__ float sm[];
    float* qs = sm;           // D
    float* sc = sm + D;       // L
    float* part = sc + L;     // blockDim.x
    const int m = blockIdx.x, h = blockIdx.y;
    const int slot = meta[M + m], S = meta[2 * M + m] + 1;
    const int kvh = h / (H / Hkv);
    const W* kb = kc + ((long long)slot * Hkv + kvh) * L * D;
    const W* vb = vc + ((long long)slot * Hkv + kvh) * L * D;
    const float scale = rsqrtf((float)D);
    for (int d = threadIdx.x; d < D; d += blockDim.x) qs[d] = q[((long long)m * H + h) * D + d] * scale;
    __syncthreads();
    float mx = NEG_INF;
    for (int j = threadIdx.x; j < S; j += blockDim.x) {
        const W* kr = kb + (long long)j * D;
        float s = 0.f;
        constexpr int V = Vec<W>::N;
#pragma unroll 8
        for (int d = 0; d < D; d += V) {
            float kv[V];
            Vec<W>::load(kr + d, kv);
#pragma unroll
            for (int i = 0; i < V; i++) s += qs[d + i] * kv[i];
        }
        sc[j] = s;
        mx = fmaxf(mx, s);
    }
    mx = block_max(mx);
    float sum = 0.f;
    for (int j = threadIdx.x; j < S; j += blockDim.x) {
        const float e = __expf(sc[j] - mx);
        sc[j] = e;
        sum += e;
    }
    sum = block_sum(sum);  // its barriers also publish sc
    const int groups = blockDim.x / D, g = threadIdx.x / D, d = threadIdx.x % D;
    float acc = 0.f;
    if (g < groups) {
#pragma unroll 8
        for (int j = g; j < S; j += groups) acc += sc[j] * tof(vb[(long long)j * D + d]);
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.x < D) {
        float o = 0.f;
        for (int i = 0; i < groups; i++) o += part[i * D + threadIdx.x];
        out[(long long)m * H * D + h * D + threadIdx.x] = fromf<O>(o / sum);
    }
}

// ---- the batched (cuBLAS) path's elementwise kernels --------------------------------------------------

// a[m] = W(x[m] / rms(x[m]) * gain): the operand of the next GEMM.
template <typename W>
__device__ void rmsnorm_act(const float* __restrict__ x, const float* __restrict__ gain, W* __restrict__ a,
                            int C, float eps) {
    const long long m = blockIdx.x;
    float ss = 0.f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) ss += x[m * C + c] * x[m * C + c];
    const float rstd = rsqrtf(block_sum(ss) / C + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x) a[m * C + c] = fromf<W>(x[m * C + c] * rstd * gain[c]);
}

// m = W(silu(gu[:, :F]) * gu[:, F:]), gu (M, 2F) float.
template <typename W>
__device__ void swiglu_act(const float* __restrict__ gu, W* __restrict__ out, int F) {
    const long long m = blockIdx.x;
    for (int f = threadIdx.x; f < F; f += blockDim.x) {
        const float g = gu[m * 2 * F + f], u = gu[m * 2 * F + F + f];
        out[m * F + f] = fromf<W>(g / (1.f + __expf(-g)) * u);
    }
}

#define DECODE_KERNELS(W, NAME)                                                                               \
    extern "C" __global__ void embed_##NAME(const int* meta, const W* emb, float* x, int M, int C) {          \
        embed<W>(meta, emb, x, M, C);                                                                         \
    }                                                                                                         \
    extern "C" __global__ void gemv_store_##NAME(const W* w, const float* x, const float* gain, float* y,     \
                                                 int M, int N, int K, float eps) {                            \
        gemv<W, EPI_STORE>(w, x, gain, y, M, N, K, eps);                                                      \
    }                                                                                                         \
    extern "C" __global__ void gemv_add_##NAME(const W* w, const float* x, const float* gain, float* y,       \
                                               int M, int N, int K, float eps) {                              \
        gemv<W, EPI_ADD>(w, x, gain, y, M, N, K, eps);                                                        \
    }                                                                                                         \
    extern "C" __global__ void gemv_swiglu_##NAME(const W* w, const float* x, const float* gain, float* y,    \
                                                  int M, int N, int K, float eps) {                           \
        gemv<W, EPI_SWIGLU>(w, x, gain, y, M, N, K, eps);                                                     \
    }                                                                                                         \
    extern "C" __global__ void rope_cache_##NAME(const float* qkv, const int* meta, float* q, W* kc, W* vc,   \
                                                 const float* c, const float* s, int M, int H, int Hkv, int D, \
                                                 int L) {                                                      \
        rope_cache<W>(qkv, meta, q, kc, vc, c, s, M, H, Hkv, D, L);                                           \
    }                                                                                                         \
    extern "C" __global__ void attend_##NAME(const float* q, const W* kc, const W* vc, const int* meta,       \
                                             float* out, int M, int H, int Hkv, int D, int L) {               \
        attend<W, float>(q, kc, vc, meta, out, M, H, Hkv, D, L);                                              \
    }                                                                                                         \
    extern "C" __global__ void attend_act_##NAME(const float* q, const W* kc, const W* vc, const int* meta,   \
                                                 W* out, int M, int H, int Hkv, int D, int L) {               \
        attend<W, W>(q, kc, vc, meta, out, M, H, Hkv, D, L);                                                  \
    }                                                                                                         \
    extern "C" __global__ void rmsnorm_act_##NAME(const float* x, const float* gain, W* a, int C, float eps) {\
        rmsnorm_act<W>(x, gain, a, C, eps);                                                                   \
    }                                                                                                         \
    extern "C" __global__ void swiglu_act_##NAME(const float* gu, W* out, int F) { swiglu_act<W>(gu, out, F); }

DECODE_KERNELS(bf16, bf16)
DECODE_KERNELS(float, f32)

// ---- the next token ---------------------------------------------------------------------------------

// out[r] = argmax of logits row r (V wide, rows `stride` apart); the lowest index wins a tie (as np.argmax).
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int V, long long stride,
                                       int* __restrict__ out) {
    __shared__ float bv[32];
    __shared__ int bi[32];
    const float* z = logits + blockIdx.x * stride;
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
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++)
            if (bv[w] > best || (bv[w] == best && bi[w] < idx)) { best = bv[w]; idx = bi[w]; }
        out[blockIdx.x] = idx < V ? idx : 0;  // an all-NaN row: token 0
    }
}

// A float's bits mapped to an unsigned key with the same order (for threshold searches).
__device__ __forceinline__ unsigned okey(float f) {
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
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
// One block of 1024 threads per row; V <= 1024 * SAMPLE_PER_THREAD.
#define SAMPLE_PER_THREAD 64
extern "C" __global__ void __launch_bounds__(1024) sample_rows(const float* __restrict__ logits, int V,
        long long stride, const int* __restrict__ ctl, const unsigned long long* __restrict__ seeds,
        int* __restrict__ out) {
    const float* z = logits + blockIdx.x * stride;
    const int top_k = ctl[0];
    const unsigned long long counter = (unsigned)ctl[1];
    const float temp = __int_as_float(ctl[2]), top_p = __int_as_float(ctl[3]);
    const int per = (V + blockDim.x - 1) / blockDim.x, lo = threadIdx.x * per, hi = min(V, lo + per);
    float zl[SAMPLE_PER_THREAD];
    float mx = NEG_INF;
    for (int i = lo; i < hi; i++) { zl[i - lo] = z[i] / temp; mx = fmaxf(mx, zl[i - lo]); }
    mx = block_max(mx);
    unsigned thr = 0;  // keep key(z) >= thr
    if (top_k > 0 && top_k < V) {
        for (int bit = 31; bit >= 0; bit--) {  // the largest threshold with at least top_k keys at or above it
            const unsigned cand = thr | (1u << bit);
            float cnt = 0.f;
            for (int i = lo; i < hi; i++) cnt += okey(zl[i - lo]) >= cand;
            if (block_sum(cnt) >= (float)top_k) thr = cand;
        }
    }
    float tot = 0.f;
    for (int i = lo; i < hi; i++) tot += okey(zl[i - lo]) >= thr ? __expf(zl[i - lo] - mx) : 0.f;
    tot = block_sum(tot);
    if (top_p < 1.f) {  // the largest threshold whose kept mass (top-k's tokens above it) still reaches top_p
        unsigned t = 0;
        for (int bit = 31; bit >= 0; bit--) {
            const unsigned cand = max(t | (1u << bit), thr);
            float mass = 0.f;
            for (int i = lo; i < hi; i++) mass += okey(zl[i - lo]) >= cand ? __expf(zl[i - lo] - mx) : 0.f;
            if (block_sum(mass) >= top_p * tot) t = t | (1u << bit);
        }
        thr = max(t, thr);
        tot = 0.f;
        for (int i = lo; i < hi; i++) tot += okey(zl[i - lo]) >= thr ? __expf(zl[i - lo] - mx) : 0.f;
        tot = block_sum(tot);
    }
    // inverse CDF in index order: each thread's chunk mass, an exclusive scan over threads, then a walk
    __shared__ float scan[1024];
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
