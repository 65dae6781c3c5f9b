// Shared device code of the decode engine's kernels (nanoeuler/kernels/decode/*.cu): what more than one
// family uses. The model runs over "rows", each row one token at (slot, position) of a preallocated KV
// cache; a row's token id, cache slot and position sit in an int32 `meta` array: ids[M], slot[M], pos[M].
// Weights and the cache are stored as W = bf16 (raw 16-bit words, as in bf16/) or float; all arithmetic
// is float32 and activations between kernels are float32 (the GEMV kernels) or W (cuBLAS operands).
//
// Programmatic dependent launch (compute capability 9.0): the host launches these kernels so that each
// may start while the one before it still runs (kernels/pdl.py). A kernel first does what depends on no
// earlier kernel (requesting its weights), then waits for the one before it to finish (pdl_wait) before
// it reads or writes any activation, and only then lets the next one start (pdl_launch). Launched the
// ordinary way, both are no-ops.
//
// References (NumPy, float64): nanoeuler.model.layers (rmsnorm, rope, attention, swiglu, embedding) and
// nanoeuler.infer.generate.sampling_probs (temperature, top-k, top-p).

#pragma once
#include "../bf16/common.cuh"
#include "../bf16/mma.cuh"

// Shape constants. decode/plan.py owns them and passes each as -D to NVRTC; these defaults are the same
// values (tests/test_decode_plan.py checks), so that plain nvcc compiles every file.
#ifndef GEMV_ROWS
#define GEMV_ROWS 4  // rows of x a GEMV block stages in shared memory (grid.y covers the rest)
#endif
#ifndef GEMV_WARPS
#define GEMV_WARPS 8  // a GEMV block's warps, one output each
#endif
#ifndef TC_WARPS
#define TC_WARPS 8  // a tensor-core GEMV block's warps, splitting K
#endif
#ifndef TC_PASS
#define TC_PASS 2  // chunks of x a tensor-core GEMV warp loads before its products
#endif
#ifndef MLP_FC
#define MLP_FC 16  // hidden units (and warps) of a swiglu_down block
#endif
#ifndef ATTEND_THREADS
#define ATTEND_THREADS 512  // a block of attend_row (one row and query head)
#endif
#ifndef O_PRE
#define O_PRE 4  // W_o pieces a thread of attend_o requests before its wait
#endif
#ifndef OSPLIT
#define OSPLIT 8  // attend_o_cluster's cluster, and attend_o's row splits at most
#endif
#ifndef OC_WARPS
#define OC_WARPS 8  // attend_o_cluster's warps a block
#endif
#ifndef OC_KEYS
#define OC_KEYS 2  // keys a lane group of attend_o_cluster holds from before its wait
#endif
#ifndef KV_WARPS
#define KV_WARPS 8  // attend_kv's warps a block
#endif
#ifndef KV_MAXG
#define KV_MAXG 4  // attend_kv's query heads a key/value head, at most
#endif
#ifndef KV_AHEAD
#define KV_AHEAD 2  // keys a lane group of attend_kv requests before using any
#endif
#ifndef SAMPLE_THREADS
#define SAMPLE_THREADS 1024  // a block of the next-token kernels (one row)
#endif
#ifndef SAMPLE_PER_THREAD
#define SAMPLE_PER_THREAD 64  // logits a thread of sample_rows holds: V <= SAMPLE_THREADS * SAMPLE_PER_THREAD
#endif

#define NEG_INF __int_as_float(0xff800000)  // NVRTC has no INFINITY

__device__ __forceinline__ float tof(float x) { return x; }
__device__ __forceinline__ float tof(bf16 x) { return bf2f(x); }
template <typename T> __device__ __forceinline__ T fromf(float x);
template <> __device__ __forceinline__ float fromf<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 fromf<bf16>(float x) { return f2bf(x); }

__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// 16 bytes of a weight row: one raw load, unpacked to floats where used (8 bf16 or 4 float).
template <typename W> struct Vec;
template <> struct Vec<bf16> {
    static constexpr int N = 8;
    __device__ static void unpack(uint4 u, float* out) {
        const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            out[2 * i] = lo_bf(w[i]);
            out[2 * i + 1] = hi_bf(w[i]);
        }
    }
};
template <> struct Vec<float> {
    static constexpr int N = 4;
    __device__ static void unpack(uint4 u, float* out) {
        out[0] = __uint_as_float(u.x); out[1] = __uint_as_float(u.y);
        out[2] = __uint_as_float(u.z); out[3] = __uint_as_float(u.w);
    }
};
template <typename W> __device__ __forceinline__ uint4 ld16(const W* p) { return *reinterpret_cast<const uint4*>(p); }
// 16 bytes into shared memory by cp.async, without registers; the copying thread waits with cp_wait (mma.cuh)
__device__ __forceinline__ void cp16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src));
}

// A float's bits mapped to an unsigned key with the same order (for threshold searches).
__device__ __forceinline__ unsigned okey(float f) {
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// ---- GEMV pieces: y[m, n] = sum_k W[n, k] * a[m, k] for a few rows m ----------------------------------
// (gemv.cu's kernels, and swiglu_down's gate/up product in mlp.cu.) A warp computes one output (one weight
// row) or a pair (two weight rows sharing each x value read):
//   EPI_STORE  y[m, n] = acc                           one row n = warp
//   EPI_STORE2 y[m, n] = acc                           two rows 2 warp, 2 warp + 1 (N: pairs; the heads)
//   EPI_ADD    y[m, n] += acc                          one row (a branch joining the residual stream)
//   EPI_SWIGLU y[m, n] = silu(acc_n) * acc_{n + N}     gate row n, up row n + N (W: gate rows, then up rows)
//   EPI_ROPE   q/k rotated, k and v into the cache     rows h D + j and h D + j + D/2 of the qkv matrix
// Each lane streams 16-byte pieces of its rows, U of them per row in flight at once, the first U requested
// before the kernel waits for the one before it: with U * 32 pieces covering a row (K <= 2048 bf16 at
// U = 8) the whole weight matrix is on its way while the previous kernel still runs. The block stages its
// GEMV_ROWS input rows in shared memory (grid.y covers the rest); with `gain` given, the product is with
// the RMSNorm of x (x / rms(x) * gain).
enum { EPI_STORE = 0, EPI_ADD = 1, EPI_SWIGLU = 2, EPI_ROPE = 3, EPI_STORE2 = 4 };

template <int EPI> struct Gemv {
    static constexpr int P = (EPI == EPI_STORE || EPI == EPI_ADD) ? 1 : 2;  // weight rows per warp
    // the weight rows of output `o` (N outputs; `half` = D/2 for EPI_ROPE)
    __device__ static void rows(int o, int N, int half, int (&r)[2]) {
        if (EPI == EPI_SWIGLU) { r[0] = o; r[1] = o + N; }
        else if (EPI == EPI_ROPE) { r[0] = (o / half) * 2 * half + o % half; r[1] = r[0] + half; }
        else if (EPI == EPI_STORE2) { r[0] = 2 * o; r[1] = 2 * o + 1; }
        else { r[0] = o; r[1] = o; }
    }
};

template <typename W, int P, int U>
__device__ __forceinline__ void gemv_load(const W* const (&wr)[2], int K, int k0, uint4 (&raw)[P][U]) {
    constexpr int V = Vec<W>::N;
#pragma unroll
    for (int p = 0; p < P; p++)
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int k = k0 + u * 32 * V;
            if (k < K) raw[p][u] = ld16(wr[p] + k);
        }
}

// Stage `rows` rows of x (+ x2 where given; K wide, from row m0) in shared memory xs (rows, K), times gain
// where given, and add up their squares per warp in sq (the norm's 1/rms multiplies the sums, gemv_finish,
// so one barrier ends the staging). With bf16 weights a lane reads the 8 x values of its 16 weight bytes as two float4:
// the first halves of all pieces lie in xs[0, K/2), the second halves in xs[K/2, K), so the warp's
// 16-byte reads are consecutive (no bank conflicts).
template <typename W, int R = GEMV_ROWS>
__device__ __forceinline__ void stage_x(const float* __restrict__ x, const float* __restrict__ x2,
                                        const float* __restrict__ gain, int m0, int rows, int K, float* xs,
                                        float (*sq)[32]) {
    constexpr int NH = Vec<W>::N / 4;
    float ss[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) ss[rr] = 0.f;
    if (K % Vec<W>::N == 0) {
        const int K4 = K / 4;
#pragma unroll
        for (int rr = 0; rr < R; rr++) {
            if (rr >= rows) break;
            const float4* xr = reinterpret_cast<const float4*>(x + (long long)(m0 + rr) * K);
            const float4* x2r = reinterpret_cast<const float4*>(x2 + (long long)(m0 + rr) * K);
#pragma unroll 4
            for (int k4 = threadIdx.x; k4 < K4; k4 += blockDim.x) {
                float4 v = xr[k4];
                if (x2 != nullptr) {
                    const float4 d = x2r[k4];
                    v.x += d.x; v.y += d.y; v.z += d.z; v.w += d.w;
                }
                ss[rr] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
                if (gain != nullptr) {
                    const float4 g = reinterpret_cast<const float4*>(gain)[k4];
                    v.x *= g.x; v.y *= g.y; v.z *= g.z; v.w *= g.w;
                }
                *reinterpret_cast<float4*>(xs + rr * K + (k4 % NH) * (K / NH) + (k4 / NH) * 4) = v;
            }
        }
    } else {
#pragma unroll
        for (int rr = 0; rr < R; rr++) {
            if (rr >= rows) break;
            const float* xr = x + (long long)(m0 + rr) * K;
            for (int k = threadIdx.x; k < K; k += blockDim.x) {
                const float v = xr[k] + (x2 != nullptr ? x2[(long long)(m0 + rr) * K + k] : 0.f);
                xs[rr * K + k] = gain != nullptr ? v * gain[k] : v;
                ss[rr] += v * v;
            }
        }
    }
    if (gain != nullptr) {
#pragma unroll
        for (int rr = 0; rr < R; rr++) {
            ss[rr] = warp_sum(ss[rr]);
            if ((threadIdx.x & 31) == 0) sq[rr][threadIdx.x >> 5] = ss[rr];
        }
    }
    __syncthreads();
}

// This lane's share of the dot products of the P weight rows wr with the staged rows: acc[p][r]. raw holds
// the first U pieces already where `loaded` (requested early), the loop requests the rest.
template <typename W, int P, int U, int R = GEMV_ROWS>
__device__ __forceinline__ void warp_dots(const W* const (&wr)[2], int K, const float* xs, int rows,
                                          uint4 (&raw)[P][U], bool loaded, float (&acc)[2][R]) {
    constexpr int V = Vec<W>::N, NH = V / 4;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int p = 0; p < 2; p++)
#pragma unroll
        for (int rr = 0; rr < R; rr++) acc[p][rr] = 0.f;
    if (K % V != 0) {  // rows not 16-byte aligned: one element per lane
#pragma unroll
        for (int p = 0; p < P; p++)
            for (int k = lane; k < K; k += 32) {
                const float wk = tof(wr[p][k]);
#pragma unroll
                for (int rr = 0; rr < R; rr++)
                    if (rr < rows) acc[p][rr] += wk * xs[rr * K + k];
            }
        return;
    }
    for (int k0 = lane * V; k0 < K; k0 += 32 * V * U) {
        if (!loaded || k0 != lane * V) gemv_load<W, P, U>(wr, K, k0, raw);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int k = k0 + u * 32 * V;
            if (k >= K) break;
            float wf[P][V];
#pragma unroll
            for (int p = 0; p < P; p++) Vec<W>::unpack(raw[p][u], wf[p]);
#pragma unroll
            for (int rr = 0; rr < R; rr++) {
                if (rr >= rows) break;
                float xv[V];  // 16-byte shared-memory loads
#pragma unroll
                for (int i = 0; i < NH; i++) {
                    const float4 t = *reinterpret_cast<const float4*>(xs + rr * K + i * (K / NH) + (k / V) * 4);
                    xv[4 * i] = t.x; xv[4 * i + 1] = t.y; xv[4 * i + 2] = t.z; xv[4 * i + 3] = t.w;
                }
#pragma unroll
                for (int p = 0; p < P; p++)
#pragma unroll
                    for (int i = 0; i < V; i++) acc[p][rr] += wf[p][i] * xv[i];
            }
        }
    }
}

// The warp's sums (valid in every lane), times the rows' 1/rms where the product is with the norm.
template <int P, int R = GEMV_ROWS>
__device__ __forceinline__ void gemv_finish(float (&acc)[2][R], const float (*sq)[32], bool norm, int K,
                                            float eps) {
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        float scale = 1.f;
        if (norm) {
            float t = 0.f;
            for (int i = 0; i < (int)(blockDim.x >> 5); i++) t += sq[rr][i];
            scale = rsqrtf(t / K + eps);
        }
        acc[0][rr] = warp_sum(acc[0][rr]) * scale;
        if (P == 2) acc[1][rr] = warp_sum(acc[1][rr]) * scale;
    }
}

// Where the qkv product goes (EPI_ROPE): q (M, H, D) float; k rotated and v into the caches (slots, Hkv,
// L, D) of W at the row's slot and position (meta); cos/sin (L, D/2) as layers.rope_tables.
template <typename W> struct RopeOut {
    float* q;
    W* kc;
    W* vc;
    const int* meta;
    const float* cos_t;
    const float* sin_t;
    int H, Hkv, D, L;
};

// Output o = pair (head, column j < D/2) of the (H + 2 Hkv) heads of q, k, v, for row m: x1, x2 the
// pair's two sums, c and s its rotation at the row's position.
template <typename W>
__device__ __forceinline__ void rope_store(const RopeOut<W>& r, int o, int m, int M, float x1, float x2, float c,
                                           float s) {
    const int half = r.D / 2, head = o / half, j = o % half;
    const int slot = r.meta[M + m], pos = r.meta[2 * M + m];
    if (head < r.H + r.Hkv) {
        const float y1 = x1 * c - x2 * s, y2 = x2 * c + x1 * s;
        if (head < r.H) {
            float* dst = r.q + ((long long)m * r.H + head) * r.D;
            dst[j] = y1;
            dst[j + half] = y2;
        } else {
            W* dst = r.kc + (((long long)slot * r.Hkv + (head - r.H)) * r.L + pos) * r.D;
            dst[j] = fromf<W>(y1);
            dst[j + half] = fromf<W>(y2);
        }
    } else {
        W* dst = r.vc + (((long long)slot * r.Hkv + (head - r.H - r.Hkv)) * r.L + pos) * r.D;
        dst[j] = fromf<W>(x1);
        dst[j + half] = fromf<W>(x2);
    }
}

// A greedy chain's row m after a step (of M rows): its chosen id recorded in the step's place in the ring
// hist (cap steps; the host's pinned memory) and fed at the next position, kept below L. ctl = [ids, slots,
// positions (M each), top_k, step, temperature, top_p].
__device__ __forceinline__ void chain_row(int* ctl, int* hist, int M, int m, int id, int step, int cap, int L) {
    hist[(long long)(step % cap) * M + m] = id;
    ctl[m] = id;
    ctl[2 * M + m] = min(ctl[2 * M + m] + 1, L - 1);
}

// ---- attention of one row and query head over its slot's cache, keys 0..pos ---------------------------
// Scores: one thread per key (a whole D-dot each, in 16-byte loads). p @ V: thread t takes the 16-byte
// piece t % (D / Vec) of every (blockDim / (D / Vec))-th key, so all of a thread's loads are independent;
// the partial outputs are added up in shared memory, in two rounds (each thread of a round adds up to 8).
// With PRE, a thread holds its key row and its first AV V pieces in registers, requested at once: those
// of rows that earlier steps wrote (positions before pos - m: this step writes a row's own position, and
// in a verify pass rows 0..m-1 of the same slot the m positions before it) before `wait()` (the wait for
// the kernel before), the others after it. Shared: scores (L) + partial outputs (blockDim.x * (Vec + 1)).
template <typename W, typename O, bool PRE, typename Wait>
__device__ void attend_row(const float* __restrict__ q, const W* __restrict__ kc, const W* __restrict__ vc,
                           const int* __restrict__ meta, O* __restrict__ dst, int M, int H, int Hkv, int D, int L,
                           int m, int h, Wait wait) {
    extern __shared__ float sm[];
    __shared__ float red[32];
    constexpr int V = Vec<W>::N;
    float* sc = sm;                         // L
    float* part = sc + L;                   // blockDim.x * V
    float* part2 = part + blockDim.x * V;   // blockDim.x
    const int slot = meta[M + m], S = meta[2 * M + m] + 1, old = S - 1 - m;
    const int kvh = h / (H / Hkv);
    const W* kb = kc + ((long long)slot * Hkv + kvh) * L * D;
    const W* vb = vc + ((long long)slot * Hkv + kvh) * L * D;
    const int pieces = D / V, groups = blockDim.x / pieces, g = threadIdx.x / pieces, c = threadIdx.x % pieces;
    // key pieces held (a key row of up to 8 pieces: D <= 8 Vec) and V pieces; PRE = false (the batched
    // path, many blocks: fewer registers, more blocks resident) holds none
    constexpr int AV = PRE ? 2 : 0, KP = PRE ? 8 : 1;
    const int j0 = threadIdx.x;
    uint4 kpre[KP], vpre[AV > 0 ? AV : 1];
    auto load = [&](bool before) {
#pragma unroll
        for (int p = 0; p < KP; p++)
            if (PRE && p < pieces && j0 < S && (j0 < old) == before) kpre[p] = ld16(kb + (long long)j0 * D + p * V);
#pragma unroll
        for (int i = 0; i < AV; i++) {
            const int j = g + i * groups;
            if (g < groups && j < S && (j < old) == before) vpre[i] = ld16(vb + (long long)j * D + c * V);
        }
    };
    load(true);
    wait();
    load(false);
    float* qs = part;  // D floats, free until p @ V
    const float scale = rsqrtf((float)D);
    for (int d = threadIdx.x; d < D; d += blockDim.x) qs[d] = q[((long long)m * H + h) * D + d] * scale;
    __syncthreads();
    float mx = NEG_INF;
    for (int j = j0; j < S; j += blockDim.x) {
        float s = 0.f;
        if (PRE && j == j0 && pieces <= KP) {
#pragma unroll
            for (int p = 0; p < KP; p++) {
                if (p >= pieces) break;
                float kv[V];
                Vec<W>::unpack(kpre[p], kv);
#pragma unroll
                for (int i = 0; i < V; i++) s += qs[p * V + i] * kv[i];
            }
        } else {
            const W* kr = kb + (long long)j * D;
#pragma unroll 8
            for (int p = 0; p < pieces; p++) {
                float kv[V];
                Vec<W>::unpack(ld16(kr + p * V), kv);
#pragma unroll
                for (int i = 0; i < V; i++) s += qs[p * V + i] * kv[i];
            }
        }
        sc[j] = s;
        mx = fmaxf(mx, s);
    }
    mx = block_max(mx, red);
    float sum = 0.f;
    for (int j = threadIdx.x; j < S; j += blockDim.x) {
        const float e = __expf(sc[j] - mx);
        sc[j] = e;
        sum += e;
    }
    sum = block_sum(sum, red);  // its barriers also publish sc
    float acc[V];
#pragma unroll
    for (int i = 0; i < V; i++) acc[i] = 0.f;
    if (g < groups) {
#pragma unroll
        for (int i = 0; i < AV; i++) {
            const int j = g + i * groups;
            if (j >= S) break;
            float vv[V];
            Vec<W>::unpack(vpre[i], vv);
            const float p = sc[j];
#pragma unroll
            for (int t = 0; t < V; t++) acc[t] += p * vv[t];
        }
#pragma unroll 4
        for (int j = g + AV * groups; j < S; j += groups) {
            float vv[V];
            Vec<W>::unpack(ld16(vb + (long long)j * D + c * V), vv);
            const float p = sc[j];
#pragma unroll
            for (int t = 0; t < V; t++) acc[t] += p * vv[t];
        }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < V; i++) part[threadIdx.x * V + i] = acc[i];  // = part[g * D + c * V + i]
    __syncthreads();
    // round 1: thread (k, d) adds partials k, k + R, ... of output d (R = blockDim.x / D rounds' worth)
    const int R = blockDim.x / D;
    if ((int)threadIdx.x < R * D) {
        const int k = threadIdx.x / D, d = threadIdx.x % D;
        float o = 0.f;
        for (int i = k; i < groups; i += R) o += part[i * D + d];
        part2[threadIdx.x] = o;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float o = 0.f;
        for (int k = 0; k < R; k++) o += part2[k * D + d];
        dst[d] = fromf<O>(o / sum);
    }
}

// The cache rows of row m, head h at positions before pos - m: earlier steps wrote them (this step writes a
// row's own position, and in a verify pass rows 0..m-1 of the same slot the m positions before it), so
// L2 may be asked for them before the kernel waits for the one before it. meta is the host's (or the
// previous step's): readable then too.
template <typename W>
__device__ __forceinline__ void cache_prefetch(const W* kc, const W* vc, const int* meta, int M, int H, int Hkv,
                                               int D, int L, int m, int h) {
    const int slot = meta[M + m], S = meta[2 * M + m] + 1;
    const long long base = ((long long)slot * Hkv + h / (H / Hkv)) * L * D;
    for (int j = threadIdx.x; j < S - 1 - m; j += blockDim.x)
        for (int b = 0; b < D * (int)sizeof(W); b += 128) {
            asm volatile("prefetch.global.L2 [%0];" ::"l"((const char*)(kc + base + (long long)j * D) + b));
            asm volatile("prefetch.global.L2 [%0];" ::"l"((const char*)(vc + base + (long long)j * D) + b));
        }
}
