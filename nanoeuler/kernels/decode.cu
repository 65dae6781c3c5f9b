// Kernels of the decode engine (nanoeuler/infer/gpu.py): the model's forward over "rows", each row one
// token at (slot, position) of a preallocated KV cache, and the choice of the next token on the GPU.
//
// A row's token id, cache slot and position sit in an int32 `meta` array: ids[M], slot[M], pos[M].
// Weights and the cache are stored as W = bf16 (raw 16-bit words, as in bf16/) or float; all arithmetic
// is float32 and activations between kernels are float32 (the GEMV kernels) or W (cuBLAS operands).
//
// Programmatic dependent launch (compute capability 9.0): the host launches these kernels so that each
// may start while the one before it still runs (gpu.py). A kernel first does what depends on no earlier
// kernel (requesting its weights), then waits for the one before it to finish (pdl_wait) before it
// reads or writes any activation, and only then lets the next one start (pdl_launch). Launched the
// ordinary way, both are no-ops.
//
// References (NumPy, float64): nanoeuler.model.layers (rmsnorm, rope, attention, swiglu, embedding) and
// nanoeuler.infer.generate.sampling_probs (temperature, top-k, top-p).

#include "bf16/common.cuh"
#include "bf16/mma.cuh"

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

// ---- embedding: x[m] = emb[ids[m]] (float32 residual stream), dx[m] = 0 -------------------------------

template <typename W>
__device__ void embed(const int* meta, const W* emb, float* x, float* dx, int M, int C) {
    pdl_wait();
    pdl_launch();
    const int m = blockIdx.x;
    const long long id = meta[m];
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        x[(long long)m * C + c] = tof(emb[id * C + c]);
        dx[(long long)m * C + c] = 0.f;  // the MLP branch's sums (swiglu_down) start from zero
    }
}

// ---- GEMV: y[m, n] = sum_k W[n, k] * a[m, k] for a few rows m ---------------------------------------
// A warp computes one output (one weight row) or a pair (two weight rows sharing each x value read):
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
#define GEMV_ROWS 4
#define GEMV_WARPS 8
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

// Output o of the store / store2 / add / swiglu epilogues for `rows` rows from m0 (lane 0).
template <int EPI>
__device__ __forceinline__ void gemv_store(const float (&acc)[2][GEMV_ROWS], float* __restrict__ y, int o, int N,
                                           int m0, int rows) {
#pragma unroll
    for (int rr = 0; rr < GEMV_ROWS; rr++) {
        if (rr >= rows) break;
        float* row = y + (long long)(m0 + rr) * (EPI == EPI_STORE2 ? 2 * N : N);
        if (EPI == EPI_STORE) row[o] = acc[0][rr];
        if (EPI == EPI_STORE2) { row[2 * o] = acc[0][rr]; row[2 * o + 1] = acc[1][rr]; }
        if (EPI == EPI_ADD) row[o] += acc[0][rr];
        if (EPI == EPI_SWIGLU) row[o] = acc[0][rr] / (1.f + __expf(-acc[0][rr])) * acc[1][rr];
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

// The kernel GEMV's dot products: this warp's P weight rows with the block's rows of x, acc[p][r] (summed
// over the warp, valid in every lane). Returns false for a warp past the last output (it must not store).
template <typename W, int EPI, int U>
__device__ __forceinline__ bool gemv_dots(const W* __restrict__ w, const float* __restrict__ x,
                                          const float* __restrict__ x2, const float* __restrict__ gain, int M,
                                          int N, int K, float eps,
                                          int half, float (&acc)[2][GEMV_ROWS], int& o, int& m0, int& rows) {
    extern __shared__ float xs[];  // (rows, K)
    __shared__ float sq[GEMV_ROWS][32];
    constexpr int P = Gemv<EPI>::P;
    m0 = blockIdx.y * GEMV_ROWS;
    rows = min(GEMV_ROWS, M - m0);
    o = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    const bool active = o < N;
    int r[2];
    Gemv<EPI>::rows(active ? o : 0, N, half, r);
    const W* const wr[2] = {w + (long long)r[0] * K, w + (long long)r[1] * K};
    uint4 raw[P][U];
    const bool early = active && K % Vec<W>::N == 0;
    if (early) gemv_load<W, P, U>(wr, K, (threadIdx.x & 31) * Vec<W>::N, raw);  // independent of earlier kernels
    pdl_wait();
    pdl_launch();
    stage_x<W>(x, x2, gain, m0, rows, K, xs, sq);
    if (!active) return false;
    warp_dots<W, P, U>(wr, K, xs, rows, raw, early, acc);
    gemv_finish<P>(acc, sq, gain != nullptr, K, eps);
    return true;
}

template <typename W, int EPI, int U>
__device__ void gemv(const W* __restrict__ w, const float* __restrict__ x, const float* __restrict__ x2,
                     const float* __restrict__ gain, float* __restrict__ y, int M, int N, int K, float eps) {
    float acc[2][GEMV_ROWS];
    int o, m0, rows;
    if (!gemv_dots<W, EPI, U>(w, x, x2, gain, M, N, K, eps, 1, acc, o, m0, rows) || (threadIdx.x & 31) != 0) return;
    gemv_store<EPI>(acc, y, o, N, m0, rows);
}

// The qkv GEMV with RoPE and the cache write in its epilogue (rope_store).
template <typename W, int U>
__device__ void gemv_rope(const W* __restrict__ w, const float* __restrict__ x, const float* __restrict__ x2,
                          const float* __restrict__ gain, const RopeOut<W>& ro, int M, int K, float eps) {
    const int half = ro.D / 2, N = (ro.H + 2 * ro.Hkv) * half;
    // the rows' rotations: the host's (or the previous step's) positions and constant tables, requested
    // before the GEMV waits for the kernel before it
    const int out = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5), j = out % half;
    const int first = blockIdx.y * GEMV_ROWS;
    float cr[GEMV_ROWS], sr[GEMV_ROWS];
#pragma unroll
    for (int rr = 0; rr < GEMV_ROWS; rr++) {
        if (first + rr >= M || out >= N) break;
        const int pos = ro.meta[2 * M + first + rr];
        cr[rr] = ro.cos_t[pos * half + j];
        sr[rr] = ro.sin_t[pos * half + j];
    }
    float acc[2][GEMV_ROWS];
    int o, m0, rows;
    if (!gemv_dots<W, EPI_ROPE, U>(w, x, x2, gain, M, N, K, eps, half, acc, o, m0, rows) || (threadIdx.x & 31) != 0)
        return;
#pragma unroll
    for (int rr = 0; rr < GEMV_ROWS; rr++) {
        if (rr >= rows) break;
        rope_store<W>(ro, o, m0 + rr, M, acc[0][rr], acc[1][rr], cr[rr], sr[rr]);
    }
}

// ---- GEMV of 2 to 16 rows on the tensor cores (bf16 weights) -----------------------------------------
// The same products and epilogues as `gemv` (y = W norm(x + x2)), for a few rows at once: the rows of x
// are the A tile of mma.sync m16n8k16 (16 rows, zeros past M), 8 weight rows the B tile, accumulated in
// float32. A block of TC_WARPS warps owns 8 outputs (NT = 2 tiles of 8 weight rows where an output needs
// two: gate and up, RoPE's pair) and splits K among its warps in chunks of 32, chunk q to warp q % TC_WARPS;
// the warps' tiles meet in shared memory. Each lane loads 16 bytes of its weight row per chunk, columns
// 8c .. 8c+7 (c = lane % 4): the sum runs over k in any order, so those 8 columns serve as the two k16 steps'
// B fragments as they lie in memory, and the A fragments are taken from the same columns of x. x is split
// into two bf16 parts, hi + lo (each product twice), so the activations keep about 16 bits, as close to the
// float GEMV's as makes no difference to the bf16 weights' own rounding. The weights of up to CH chunks a
// warp are requested before the wait for the kernel before, into shared memory (cp.async). Needs K % 32 == 0
// and K <= 32 * TC_WARPS * CH.
#define TC_WARPS 8
#define TC_PASS 2
template <int EPI> struct Tc { static constexpr int NT = (EPI == EPI_SWIGLU || EPI == EPI_ROPE) ? 2 : 1; };

// 8 values of row m of x (+ x2) from column k, zeros past M.
__device__ __forceinline__ void tc_x8(const float* __restrict__ x, const float* __restrict__ x2, int m, int M, int K,
                                      int k, float (&a)[8]) {
    float4 u = make_float4(0.f, 0.f, 0.f, 0.f), v = u;
    if (m < M) {
        u = ld4(x + (long long)m * K + k, 0);
        v = ld4(x + (long long)m * K + k, 1);
        if (x2 != nullptr) {
            const float4 d = ld4(x2 + (long long)m * K + k, 0), e = ld4(x2 + (long long)m * K + k, 1);
            u.x += d.x; u.y += d.y; u.z += d.z; u.w += d.w;
            v.x += e.x; v.y += e.y; v.z += e.z; v.w += e.w;
        }
    }
    a[0] = u.x; a[1] = u.y; a[2] = u.z; a[3] = u.w; a[4] = v.x; a[5] = v.y; a[6] = v.z; a[7] = v.w;
}

// The A fragments (hi, lo) of k16 step s from rows g (a0) and g + 8 (a1): columns 4s .. 4s+3 of the 8.
__device__ __forceinline__ void tc_frags(const float (&a0)[8], const float (&a1)[8], int s, unsigned (&hi)[4],
                                         unsigned (&lo)[4]) {
    hi[0] = pack2(a0[4 * s], a0[4 * s + 1]);
    hi[1] = pack2(a1[4 * s], a1[4 * s + 1]);
    hi[2] = pack2(a0[4 * s + 2], a0[4 * s + 3]);
    hi[3] = pack2(a1[4 * s + 2], a1[4 * s + 3]);
    lo[0] = pack2(a0[4 * s] - lo_bf(hi[0]), a0[4 * s + 1] - hi_bf(hi[0]));
    lo[1] = pack2(a1[4 * s] - lo_bf(hi[1]), a1[4 * s + 1] - hi_bf(hi[1]));
    lo[2] = pack2(a0[4 * s + 2] - lo_bf(hi[2]), a0[4 * s + 3] - hi_bf(hi[2]));
    lo[3] = pack2(a1[4 * s + 2] - lo_bf(hi[3]), a1[4 * s + 3] - hi_bf(hi[3]));
}

// The block's sums: thread t (< M * 8) gets row m = t / 8 and output o = 8 blockIdx.x + t % 8, v0 (and v1,
// the second tile's) already times the row's 1/rms where gain is given. False for a thread without one.
template <int EPI, int CH>
__device__ __forceinline__ bool tc_sums(const bf16* __restrict__ w, const float* __restrict__ x,
                                        const float* __restrict__ x2, const float* __restrict__ gain, int M, int N,
                                        int K, float eps, int half, int& m, int& o, float& v0, float& v1) {
    constexpr int NT = Tc<EPI>::NT;
    __shared__ float part[TC_WARPS][NT][16][9];  // each warp's tiles (rows, outputs), padded
    __shared__ float ssq[TC_WARPS][16];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int o0 = blockIdx.x * 8, chunks = K / 32;
    int r[2];
    Gemv<EPI>::rows(min(o0 + g, N - 1), N, half, r);
    // the weights into shared memory by cp.async (no registers held while they arrive), each lane's 16-byte
    // pieces at raw[(i NT + t) blockDim + thread]: it reads back only what it copied
    __shared__ uint4 raw[CH * NT * 32 * TC_WARPS];
#pragma unroll
    for (int i = 0; i < CH; i++) {
        const int q = warp + TC_WARPS * i;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            uint4* dst = raw + (i * NT + t) * blockDim.x + threadIdx.x;
            if (q < chunks && o0 + g < N)
                cp16(dst, w + (long long)r[t] * K + q * 32 + c * 8);
            else
                *dst = make_uint4(0, 0, 0, 0);
        }
    }
    cp_commit();
    pdl_wait();
    pdl_launch();
    float acc[NT][4], ss0 = 0.f, ss1 = 0.f;
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    // x (and the norm's gain) in passes of TC_PASS chunks, every load of a pass requested before the first
    // product; rows g + 8 only where there are more than 8
#pragma unroll
    for (int i0 = 0; i0 < CH; i0 += TC_PASS) {
        float a0[TC_PASS][8], a1[TC_PASS][8], gk[TC_PASS][8];
#pragma unroll
        for (int i = i0; i < i0 + TC_PASS && i < CH; i++) {
            const int k = (warp + TC_WARPS * i) * 32 + c * 8;
            if (k >= K) break;  // the same in every lane of the warp
            tc_x8(x, x2, g, M, K, k, a0[i - i0]);
            tc_x8(x, x2, M > 8 ? g + 8 : M, M, K, k, a1[i - i0]);
            if (gain != nullptr) tc_x8(gain, nullptr, 0, 1, 0, k, gk[i - i0]);
        }
#pragma unroll
        for (int i = i0; i < i0 + TC_PASS && i < CH; i++) {
            if ((warp + TC_WARPS * i) * 32 >= K) break;
            float (&u0)[8] = a0[i - i0], (&u1)[8] = a1[i - i0];
            if (gain != nullptr) {
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    ss0 += u0[e] * u0[e];
                    ss1 += u1[e] * u1[e];
                    u0[e] *= gk[i - i0][e];
                    u1[e] *= gk[i - i0][e];
                }
            }
            if (i == 0) cp_wait<0>();
#pragma unroll
            for (int s = 0; s < 2; s++) {
                unsigned hi[4], lo[4];
                tc_frags(u0, u1, s, hi, lo);
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    const uint4 wt = raw[(i * NT + t) * blockDim.x + threadIdx.x];
                    const unsigned b0 = s == 0 ? wt.x : wt.z, b1 = s == 0 ? wt.y : wt.w;
                    mma16816(acc[t], hi, b0, b1);
                    mma16816(acc[t], lo, b0, b1);
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {  // C fragment: rows g, g + 8; outputs 2c, 2c + 1
        part[warp][t][g][2 * c] = acc[t][0];
        part[warp][t][g][2 * c + 1] = acc[t][1];
        part[warp][t][g + 8][2 * c] = acc[t][2];
        part[warp][t][g + 8][2 * c + 1] = acc[t][3];
    }
    if (gain != nullptr) {
        ss0 += __shfl_xor_sync(0xffffffffu, ss0, 1);
        ss0 += __shfl_xor_sync(0xffffffffu, ss0, 2);
        ss1 += __shfl_xor_sync(0xffffffffu, ss1, 1);
        ss1 += __shfl_xor_sync(0xffffffffu, ss1, 2);
        if (c == 0) {
            ssq[warp][g] = ss0;
            ssq[warp][g + 8] = ss1;
        }
    }
    __syncthreads();
    m = threadIdx.x >> 3;
    o = o0 + (threadIdx.x & 7);
    if (m >= M || o >= N) return false;
    v0 = v1 = 0.f;
    float sq = 0.f;
#pragma unroll
    for (int u = 0; u < TC_WARPS; u++) {
        v0 += part[u][0][m][threadIdx.x & 7];
        if (NT == 2) v1 += part[u][NT - 1][m][threadIdx.x & 7];
        sq += ssq[u][m];
    }
    if (gain != nullptr) {
        const float scale = rsqrtf(sq / K + eps);
        v0 *= scale;
        v1 *= scale;
    }
    return true;
}

// y[m, o] = v (store), += v (add), silu(gate) * up (swiglu) for rows m < M: the few-row `gemv` on tensor cores.
template <int EPI, int CH>
__device__ void tgemv(const bf16* __restrict__ w, const float* __restrict__ x, const float* __restrict__ x2,
                      const float* __restrict__ gain, float* __restrict__ y, int M, int N, int K, float eps) {
    int m, o;
    float v0, v1;
    if (!tc_sums<EPI, CH>(w, x, x2, gain, M, N, K, eps, 1, m, o, v0, v1)) return;
    float* row = y + (long long)m * N;
    if (EPI == EPI_STORE) row[o] = v0;
    if (EPI == EPI_ADD) row[o] += v0;
    if (EPI == EPI_SWIGLU) row[o] = v0 / (1.f + __expf(-v0)) * v1;
}

// The qkv product of a few rows with RoPE and the cache write (as gemv_rope): output o is the pair (j, j + D/2)
// of a head; a block's 8 outputs lie in one head (D % 16 == 0).
template <int CH>
__device__ void tgemv_rope(const bf16* __restrict__ w, const float* __restrict__ x, const float* __restrict__ x2,
                           const float* __restrict__ gain, const RopeOut<bf16>& ro, int M, int K, float eps) {
    const int half = ro.D / 2, N = (ro.H + 2 * ro.Hkv) * half;
    int m, o;
    float v0, v1;
    if (!tc_sums<EPI_ROPE, CH>(w, x, x2, gain, M, N, K, eps, half, m, o, v0, v1)) return;
    const int pos = ro.meta[2 * M + m], j = o % half;
    rope_store<bf16>(ro, o, m, M, v0, v1, ro.cos_t[pos * half + j], ro.sin_t[pos * half + j]);
}

// A greedy chain's row m after a step (of M rows): its chosen id recorded in the step's place in the ring
// hist (cap steps; the host's pinned memory) and fed at the next position, kept below L. ctl = [ids, slots,
// positions (M each), top_k, step, temperature, top_p].
__device__ __forceinline__ void chain_row(int* ctl, int* hist, int M, int m, int id, int step, int cap, int L) {
    hist[(long long)(step % cap) * M + m] = id;
    ctl[m] = id;
    ctl[2 * M + m] = min(ctl[2 * M + m] + 1, L - 1);
}

// ---- head 0 and its argmax in one kernel (the one-row step) -------------------------------------------
// The logits of head 0 (two rows a warp, as EPI_STORE2; N pairs) are not stored: each block's best
// (the logit's order key, then ~index, so that the lowest index wins a tie as np.argmax; NaN counts
// lowest) goes to *best by atomicMax, and the last block to finish (counted in *arrive) takes the id:
// out[0], and with `chain` what argmax_chain does for one row (the step's record in hist, the next
// input id and position in ctl). It leaves *best and *arrive at zero for the next step.
template <typename W, int U>
__device__ void head_argmax(const W* __restrict__ w, const float* __restrict__ x, const float* __restrict__ x2,
                            const float* __restrict__ gain, int N, int K, float eps, unsigned long long* best,
                            int* arrive, int* out, int* ctl, int* hist, int cap, int L, int chain) {
    __shared__ unsigned long long bb[GEMV_WARPS];
    __shared__ bool last;
    float acc[2][GEMV_ROWS];
    int o, m0, rows;
    const bool ok = gemv_dots<W, EPI_STORE2, U>(w, x, x2, gain, 1, N, K, eps, 1, acc, o, m0, rows);
    auto key = [](float v, int i) {
        return ((unsigned long long)(v == v ? okey(v) : 0u) << 32) | (0xFFFFFFFFu - (unsigned)i);
    };
    if ((threadIdx.x & 31) == 0) {
        unsigned long long k = 0;
        if (ok) k = max(key(acc[0][0], 2 * o), key(acc[1][0], 2 * o + 1));
        bb[threadIdx.x >> 5] = k;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long k = 0;
        for (int i = 0; i < GEMV_WARPS; i++) k = max(k, bb[i]);
        atomicMax(best, k);
        __threadfence();
        last = atomicAdd(arrive, 1) == (int)gridDim.x - 1;
    }
    __syncthreads();
    if (!last || threadIdx.x != 0) return;
    __threadfence();
    const int id = (int)(0xFFFFFFFFu - (unsigned)(*(volatile unsigned long long*)best & 0xFFFFFFFFull));
    out[0] = id;
    if (chain) {  // ctl = [id, slot, position, top_k, step, temperature, top_p]
        const int step = ctl[4];
        chain_row(ctl, hist, 1, 0, id, step, cap, L);
        __threadfence_system();  // hist is the host's (pinned) memory
        ctl[4] = step + 1;
    }
    *best = 0ull;
    *arrive = 0;
}

// ---- RoPE on q and k, k and v written into the cache (the batched path) -------------------------------
// qkv (M, (H + 2 Hkv) D) float; q (M, H, D) float out; caches (slots, Hkv, L, D) of W.
// cos/sin (L, D/2): the tables of layers.rope_tables for every position of the context. With qh given
// (a prefill from position 0: row m at position m), q, k and v also go to qh (H, M, D), kh and vh
// (Hkv, M, D) as W, the tensor-core attention's operands, and q is not written.

template <typename W>
__device__ void rope_cache(const float* __restrict__ qkv, const int* __restrict__ meta, float* __restrict__ q,
                           W* __restrict__ kc, W* __restrict__ vc, const float* __restrict__ cos_t,
                           const float* __restrict__ sin_t, W* __restrict__ qh, W* __restrict__ kh,
                           W* __restrict__ vh, int M, int H, int Hkv, int D, int L) {
    pdl_wait();
    pdl_launch();
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
            if (qh != nullptr) {
                W* dst = qh + ((long long)head * M + m) * D;
                dst[j] = fromf<W>(y1);
                dst[j + half] = fromf<W>(y2);
            } else {
                q[((long long)m * H + head) * D + j] = y1;
                q[((long long)m * H + head) * D + j + half] = y2;
            }
        } else {
            W* dst = kc + (((long long)slot * Hkv + (head - H)) * L + pos) * D;
            dst[j] = fromf<W>(y1);
            dst[j + half] = fromf<W>(y2);
            if (kh != nullptr) {
                W* d2 = kh + ((long long)(head - H) * M + m) * D;
                d2[j] = fromf<W>(y1);
                d2[j + half] = fromf<W>(y2);
            }
        }
    }
    for (int i = threadIdx.x; i < Hkv * D; i += blockDim.x) {
        const int h = i / D, d = i % D;
        const W v = fromf<W>(row[(H + Hkv) * D + i]);
        vc[(((long long)slot * Hkv + h) * L + pos) * D + d] = v;
        if (vh != nullptr) vh[((long long)h * M + m) * D + d] = v;
    }
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

// grid (M, H): out (M, H, D) of O.
template <typename W, typename O, bool PRE>
__device__ void attend(const float* __restrict__ q, const W* __restrict__ kc, const W* __restrict__ vc,
                       const int* __restrict__ meta, O* __restrict__ out, int M, int H, int Hkv, int D, int L) {
    const int m = blockIdx.x, h = blockIdx.y;
    cache_prefetch<W>(kc, vc, meta, M, H, Hkv, D, L, m, h);
    attend_row<W, O, PRE>(q, kc, vc, meta, out + ((long long)m * H + h) * D, M, H, Hkv, D, L, m, h, [] {
        pdl_wait();
        pdl_launch();
    });
}

// ---- attention of many rows: a block per (row, key/value head), its query heads together ------------
// grid (M, Hkv), KV_WARPS warps: out (M, H, D) of O (the wide batch's GEMM operand). The G = H / Hkv query
// heads that share a key/value head read its cache rows once. A group of P = D / Vec lanes takes one key at
// a time (lane c of the group: the 16-byte piece c of the key and of the value row), so a warp holds 32 / P
// keys; the groups of the block take keys gi, gi + groups, ... and keep, per query head, a running max, sum
// and output piece (an online softmax), requesting KV_AHEAD keys' rows before using any. The groups' partial
// results meet in shared memory at the end: G * groups * (D + 2) floats. Needs 32 % P == 0 and G <= KV_MAXG
// (gpu.py checks; other shapes take attend_act).
#define KV_WARPS 8
#define KV_MAXG 4
#define KV_AHEAD 2
template <typename W, typename O>
__device__ void attend_kv(const float* __restrict__ q, const W* __restrict__ kc, const W* __restrict__ vc,
                          const int* __restrict__ meta, O* __restrict__ out, int M, int H, int Hkv, int D, int L) {
    extern __shared__ float sm[];
    constexpr int V = Vec<W>::N;
    const int m = blockIdx.x, kvh = blockIdx.y, G = H / Hkv, P = D / V;
    const int lane = threadIdx.x & 31, c = lane % P, per_warp = 32 / P;
    const int groups = (blockDim.x >> 5) * per_warp, gi = (threadIdx.x >> 5) * per_warp + lane / P;
    pdl_wait();
    pdl_launch();
    const int slot = meta[M + m], S = meta[2 * M + m] + 1;
    const W* kb = kc + ((long long)slot * Hkv + kvh) * L * D + c * V;
    const W* vb = vc + ((long long)slot * Hkv + kvh) * L * D + c * V;
    const float scale = rsqrtf((float)D);
    float qv[KV_MAXG][V], mx[KV_MAXG], sum[KV_MAXG], acc[KV_MAXG][V];
#pragma unroll
    for (int g = 0; g < KV_MAXG; g++) {
        mx[g] = NEG_INF;
        sum[g] = 0.f;
#pragma unroll
        for (int i = 0; i < V; i++) {
            acc[g][i] = 0.f;
            qv[g][i] = g < G ? q[((long long)m * H + kvh * G + g) * D + c * V + i] * scale : 0.f;
        }
    }
    // the warp's loop bounds come from its first group, so that all its lanes take part in every shuffle
    const int wg = (threadIdx.x >> 5) * per_warp;
    for (int j0 = wg; j0 < S; j0 += KV_AHEAD * groups) {
        uint4 kr[KV_AHEAD], vr[KV_AHEAD];
#pragma unroll
        for (int a = 0; a < KV_AHEAD; a++) {
            const int j = j0 + gi - wg + a * groups;
            if (j < S) {
                kr[a] = ld16(kb + (long long)j * D);
                vr[a] = ld16(vb + (long long)j * D);
            }
        }
#pragma unroll
        for (int a = 0; a < KV_AHEAD; a++) {
            if (j0 + a * groups >= S) break;  // the same in every lane of the warp
            const bool here = j0 + gi - wg + a * groups < S;  // the same in every lane of a group
            float kf[V], vf[V];
            Vec<W>::unpack(here ? kr[a] : make_uint4(0, 0, 0, 0), kf);
            Vec<W>::unpack(here ? vr[a] : make_uint4(0, 0, 0, 0), vf);
#pragma unroll
            for (int g = 0; g < KV_MAXG; g++) {
                if (g >= G) break;
                float s = 0.f;
#pragma unroll
                for (int i = 0; i < V; i++) s += qv[g][i] * kf[i];
                for (int o = P / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o, P);
                if (!here) continue;
                const float nm = fmaxf(mx[g], s), r = __expf(mx[g] - nm), p = __expf(s - nm);
                mx[g] = nm;
                sum[g] = sum[g] * r + p;
#pragma unroll
                for (int i = 0; i < V; i++) acc[g][i] = acc[g][i] * r + p * vf[i];
            }
        }
    }
    // partials: part[(g * groups + gi) * D + d], then the (max, sum) pairs after all G * groups * D
    float* part = sm;
    float* ms = sm + G * groups * D;
#pragma unroll
    for (int g = 0; g < KV_MAXG; g++) {
        if (g >= G) break;
#pragma unroll
        for (int i = 0; i < V; i++) part[(g * groups + gi) * D + c * V + i] = acc[g][i];
        if (c == 0) {
            ms[2 * (g * groups + gi)] = mx[g];
            ms[2 * (g * groups + gi) + 1] = sum[g];
        }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < G * D; t += blockDim.x) {
        const int g = t / D, d = t % D;
        float big = NEG_INF;
        for (int k = 0; k < groups; k++) big = fmaxf(big, ms[2 * (g * groups + k)]);
        float o = 0.f, l = 0.f;
        for (int k = 0; k < groups; k++) {
            const float w = __expf(ms[2 * (g * groups + k)] - big);  // 0 for a group that saw no key
            l += ms[2 * (g * groups + k) + 1] * w;
            o += part[(g * groups + k) * D + d] * w;
        }
        out[((long long)m * H + kvh * G + g) * D + d] = fromf<O>(o / l);
    }
}

// ---- attention and the o projection in one kernel: x += W_o att (+ dx, folded in) ---------------------
// A one-row step's layer is three kernels: qkv (gemv_rope), attend_o, swiglu_down; the two branches join the
// residual stream by atomicAdd, so that no kernel waits for a whole product before the next step. (A few
// rows take five, the products with more rows to a weight read: gemv_rope, attend, gemv_add (o),
// gemv_swiglu, gemv_add (down); they measured faster there.)
// grid (M H, splits): block (m H + h, s) attends row m with head h (attend_row, into shared
// memory), then adds its head's share of the o projection to the rows n of x in split s of C / splits:
// W_o[n, hD:(h+1)D] . att.
// A row's head slice is PR = D / Vec 16-byte pieces on PR neighbouring lanes, summed by shuffles; the H
// heads' shares meet in x. Head 0's blocks also fold in dx (the MLP branch of the layer before) and clear
// it for this layer's swiglu_down. The block's first O_PRE pieces a thread are requested before the wait.
// Shared: attend_row's (L + blockDim.x * (Vec + 1)) floats, then D.
#define O_PRE 4
template <typename W>
__device__ __forceinline__ float o_piece(uint4 u, const float* att) {
    float wf[Vec<W>::N], s = 0.f;
    Vec<W>::unpack(u, wf);
#pragma unroll
    for (int i = 0; i < Vec<W>::N; i++) s += wf[i] * att[i];
    return s;
}

// A block's share of the o projection: rows n0 .. n0 + C / splits of W_o, head h's D columns; piece i (a
// thread's j-th: i = threadIdx.x + j blockDim.x) is row n0 + i / PR, columns h D + (i % PR) Vec ... The
// first O_PRE pieces a thread are requested before the wait (load); add() adds each row's product with
// att (D floats, shared) to x[m] by atomicAdd, head 0's blocks also folding in dx (and clearing it).
template <typename W> struct OShare {
    const W* wo;
    int n0, PR, HD, hD, pieces;
    uint4 pre[O_PRE];
    __device__ OShare(const W* w, int split, int splits, int H, int D, int h, int C)
        : wo(w), n0(split * (C / splits)), PR(D / Vec<W>::N), HD(H * D), hD(h * D),
          pieces(C / splits * (D / Vec<W>::N)) {}
    __device__ const W* at(int i) const { return wo + (long long)(n0 + i / PR) * HD + hD + (i % PR) * Vec<W>::N; }
    __device__ void load() {
#pragma unroll
        for (int j = 0; j < O_PRE; j++) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i < pieces) pre[j] = ld16(at(i));
        }
    }
    __device__ void add(const float* att, int m, int C, bool fold, float* __restrict__ x,
                        float* __restrict__ dx) const {
        for (int j = 0; j * (int)blockDim.x < pieces; j++) {  // the same count in every lane (shuffles)
            const int i = threadIdx.x + j * blockDim.x;
            float s = 0.f;
            if (i < pieces) {
                uint4 u;
#pragma unroll
                for (int jj = 0; jj < O_PRE; jj++)
                    if (jj == j) u = pre[jj];
                if (j >= O_PRE) u = ld16(at(i));
                s = o_piece<W>(u, att + (i % PR) * Vec<W>::N);
            }
            for (int o = PR / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (i < pieces && i % PR == 0) {
                const long long n = (long long)m * C + n0 + i / PR;
                if (fold) {
                    s += dx[n];
                    dx[n] = 0.f;
                }
                atomicAdd(x + n, s);
            }
        }
    }
};

template <typename W>
__device__ void attend_o(const float* __restrict__ q, const W* __restrict__ kc, const W* __restrict__ vc,
                         const int* __restrict__ meta, const W* __restrict__ wo, float* __restrict__ x,
                         float* __restrict__ dx, int M, int H, int Hkv, int D, int L, int C) {
    extern __shared__ float sm[];
    constexpr int V = Vec<W>::N;
    const int m = blockIdx.x / H, h = blockIdx.x % H;
    OShare<W> share(wo, blockIdx.y, gridDim.y, H, D, h, C);
    share.load();
    cache_prefetch<W>(kc, vc, meta, M, H, Hkv, D, L, m, h);
    float* att = sm + L + blockDim.x * (V + 1);  // after attend_row's
    attend_row<W, float, true>(q, kc, vc, meta, att, M, H, Hkv, D, L, m, h, [] {
        pdl_wait();
        pdl_launch();
    });
    __syncthreads();
    share.add(att, m, C, h == 0, x, dx);
}

// ---- the same for one row with the keys split over a cluster of 8 blocks --------------------------------
// grid (M H, 8), clusters of the 8 blocks of a (row, head), OC_WARPS warps: block s attends over its eighth
// of the keys (contiguous), a group of P lanes a key (lane c: 16-byte piece c of the key and value rows,
// P = D / Vec rounded up to a power of two) with a running max, sum and output piece per group; a warp's
// groups meet by shuffles, the warps in shared memory, the 8 blocks' partial results through distributed
// shared memory (one cluster barrier), and each block then adds its split of the o projection to x, as
// attend_o does. Up to alone_keys keys every block attends over all of them and the cluster exchanges
// nothing (its barriers cost more than so few keys). Keys that earlier steps wrote (all but the row's own
// position) are requested before the wait, with the block's W_o pieces. Needs D % Vec == 0, D / Vec <= 32.
#define OC_WARPS 8
#define OC_SPLIT 8
#define OC_KEYS 2  // keys a group holds from before the wait (4: more registers, slower)
// Clusters need compute capability 9.0: below it the kernel compiles without them (so that the file builds
// for every GPU) and the host never launches it (gpu.py's attend_cluster).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define CLUSTER_DIMS __cluster_dims__(1, OC_SPLIT, 1)
#else
#define CLUSTER_DIMS
#endif
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r = 0;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}
__device__ __forceinline__ void cluster_arrive() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// a float of block `rank`'s shared memory, at the address p has in this block's
__device__ __forceinline__ float ld_cluster(const float* p, unsigned rank) {
    float v = *p;
#if __CUDA_ARCH__ >= 900
    unsigned a = smem_u32(p), r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(r) : "memory");
#endif
    return v;
}

template <typename W>
__device__ void attend_o_cluster(const float* __restrict__ q, const W* __restrict__ kc, const W* __restrict__ vc,
                                 const int* __restrict__ meta, const W* __restrict__ wo, float* __restrict__ x,
                                 float* __restrict__ dx, int M, int H, int Hkv, int D, int L, int C,
                                 int alone_keys) {
    constexpr int V = Vec<W>::N;
    __shared__ float gpart[OC_WARPS * 258];  // the warps' (max, sum, output D), D <= 256
    __shared__ float bpart[2 + 256];         // this block's
    __shared__ float att[256];
    const int m = blockIdx.x / H, h = blockIdx.x % H, split = cluster_rank();
    const int Pv = D / V, P = Pv <= 1 ? 1 : Pv <= 2 ? 2 : Pv <= 4 ? 4 : Pv <= 8 ? 8 : Pv <= 16 ? 16 : 32;
    const int lane = threadIdx.x & 31, c = lane % P, groups = blockDim.x / P, gi = threadIdx.x / P;
    const int slot = meta[M + m], S = meta[2 * M + m] + 1, old = S - 1 - m;
    const bool alone = S <= alone_keys;
    const int per = (S + OC_SPLIT - 1) / OC_SPLIT, j0 = alone ? 0 : split * per, j1 = alone ? S : min(S, j0 + per);
    const W* kb = kc + ((long long)slot * Hkv + h / (H / Hkv)) * L * D + c * V;
    const W* vb = vc + ((long long)slot * Hkv + h / (H / Hkv)) * L * D + c * V;
    // before the wait: the o projection's pieces (as attend_o) and the group's first keys of earlier steps
    OShare<W> share(wo, split, OC_SPLIT, H, D, h, C);
    share.load();
    uint4 kr[OC_KEYS], vr[OC_KEYS];
#pragma unroll
    for (int a = 0; a < OC_KEYS; a++) {
        const int j = j0 + gi + a * groups;
        if (c < Pv && j < j1 && j < old) {
            kr[a] = ld16(kb + (long long)j * D);
            vr[a] = ld16(vb + (long long)j * D);
        }
    }
    pdl_wait();
    pdl_launch();
    float qv[V], mx = NEG_INF, sum = 0.f, acc[V];
    const float scale = rsqrtf((float)D);
#pragma unroll
    for (int i = 0; i < V; i++) {
        qv[i] = c < Pv ? q[((long long)m * H + h) * D + c * V + i] * scale : 0.f;
        acc[i] = 0.f;
    }
    // the warp's loop bounds come from its first group (every lane takes part in every shuffle)
    const int wg = (threadIdx.x >> 5) * (32 / P);
    for (int jw = j0 + wg, a = 0; jw < j1; jw += groups, a++) {
        const int j = jw - wg + gi;
        const bool here = j < j1;
        uint4 ku = make_uint4(0, 0, 0, 0), vu = ku;
        if (here && c < Pv) {
            if (a < OC_KEYS && j < old) {
#pragma unroll
                for (int b = 0; b < OC_KEYS; b++)
                    if (b == a) { ku = kr[b]; vu = vr[b]; }
            } else {
                ku = ld16(kb + (long long)j * D);
                vu = ld16(vb + (long long)j * D);
            }
        }
        float kf[V], vf[V], sc = 0.f;
        Vec<W>::unpack(ku, kf);
        Vec<W>::unpack(vu, vf);
#pragma unroll
        for (int i = 0; i < V; i++) sc += qv[i] * kf[i];
        for (int o = P / 2; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o, P);
        if (!here) continue;
        const float nm = fmaxf(mx, sc), r = __expf(mx - nm), p = __expf(sc - nm);
        mx = nm;
        sum = sum * r + p;
#pragma unroll
        for (int i = 0; i < V; i++) acc[i] = acc[i] * r + p * vf[i];
    }
    // the warp's groups -> one partial (shuffles), the warps' -> the block's (bpart), the cluster's 8 -> att
    for (int off = P; off < 32; off <<= 1) {
        const float om = __shfl_xor_sync(0xffffffffu, mx, off), ol = __shfl_xor_sync(0xffffffffu, sum, off);
        const float nm = fmaxf(mx, om);
        const float wa = mx == NEG_INF ? 0.f : __expf(mx - nm), wb = om == NEG_INF ? 0.f : __expf(om - nm);
        sum = sum * wa + ol * wb;
#pragma unroll
        for (int i = 0; i < V; i++) acc[i] = acc[i] * wa + __shfl_xor_sync(0xffffffffu, acc[i], off) * wb;
        mx = nm;
    }
    const int warp = threadIdx.x >> 5;
    if (lane < P && c < Pv)
#pragma unroll
        for (int i = 0; i < V; i++) gpart[warp * (D + 2) + 2 + c * V + i] = acc[i];
    if (lane == 0) {
        gpart[warp * (D + 2)] = mx;
        gpart[warp * (D + 2) + 1] = sum;
    }
    __syncthreads();
    if (alone) {
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            float big = NEG_INF, l = 0.f, o = 0.f;
#pragma unroll
            for (int k = 0; k < OC_WARPS; k++) big = fmaxf(big, gpart[k * (D + 2)]);
#pragma unroll
            for (int k = 0; k < OC_WARPS; k++) {
                const float w = gpart[k * (D + 2)] == NEG_INF ? 0.f : __expf(gpart[k * (D + 2)] - big);
                l += gpart[k * (D + 2) + 1] * w;
                o += gpart[k * (D + 2) + 2 + d] * w;
            }
            att[d] = o / l;
        }
    }
    for (int t = threadIdx.x; t < D + 2 && !alone; t += blockDim.x) {  // bpart = (max, sum, outputs)
        float big = NEG_INF;
#pragma unroll
        for (int k = 0; k < OC_WARPS; k++) big = fmaxf(big, gpart[k * (D + 2)]);
        float v = big;
        if (t > 0) {
            v = 0.f;
#pragma unroll
            for (int k = 0; k < OC_WARPS; k++)  // a warp that saw no key weighs 0
                v += big == NEG_INF ? 0.f : gpart[k * (D + 2) + t] * __expf(gpart[k * (D + 2)] - big);
        }
        bpart[t] = v;
    }
    if (!alone) cluster_arrive();
    if (!alone) cluster_wait();  // every block's bpart is written
    for (int d = threadIdx.x; d < D && !alone; d += blockDim.x) {
        float mb[OC_SPLIT], lb[OC_SPLIT], ob[OC_SPLIT], big = NEG_INF, l = 0.f, o = 0.f;
#pragma unroll
        for (int b = 0; b < OC_SPLIT; b++) {  // all requested at once
            mb[b] = ld_cluster(bpart, b);
            lb[b] = ld_cluster(bpart + 1, b);
            ob[b] = ld_cluster(bpart + 2 + d, b);
        }
#pragma unroll
        for (int b = 0; b < OC_SPLIT; b++) big = fmaxf(big, mb[b]);
#pragma unroll
        for (int b = 0; b < OC_SPLIT; b++) {
            const float w = mb[b] == NEG_INF ? 0.f : __expf(mb[b] - big);
            l += lb[b] * w;
            o += ob[b] * w;
        }
        att[d] = o / l;
    }
    if (!alone) cluster_arrive();  // this block has read the others' bpart; it waits for theirs before it exits
    __syncthreads();
    share.add(att, m, C, h == 0, x, dx);
    if (!alone) cluster_wait();
}

// ---- the MLP in one kernel: dx += W_down (silu(W_gate n(x)) * W_up n(x)) -------------------------------
// grid (ceil(F / MLP_FC), row groups of R), MLP_FC warps (R = 1, the one-row step, instantiated: the
// registers of more rows leave no room for the next kernel's blocks): warp w computes f = f0 + w of the
// gate/up product (the GEMV pieces: its rows requested before the wait, the norm in the prologue); the
// block's MLP_FC values of h = silu(g) u go to shared memory; then each thread adds W_down[n, f0:f0+MLP_FC]
// . h to dx[m, n] for its rows n (atomicAdd: the F / MLP_FC blocks meet in dx, which starts at zero:
// embed clears it, attend_o clears it after folding it into x). The first row's W_down pieces are
// requested before the wait too. Shared: the staged rows (rows, C), then W_down's pieces of the rows past
// the block's threads ((C - blockDim.x) * MLP_FC of W).
#define MLP_FC 16
template <typename W, int U, int R>
__device__ void swiglu_down(const W* __restrict__ wgu, const W* __restrict__ wd, const float* __restrict__ x,
                            const float* __restrict__ gain, float* __restrict__ dx, int M, int F, int C, float eps) {
    extern __shared__ float xs[];
    __shared__ float sq[R][32];
    __shared__ float hs[R][MLP_FC];
    constexpr int V = Vec<W>::N, FP = MLP_FC / V;  // W_down pieces of a row's MLP_FC columns
    const int m0 = blockIdx.y * R, rows = min(R, M - m0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, f0 = blockIdx.x * MLP_FC, f = f0 + warp;
    const bool active = f < F, whole = F % V == 0 && f0 + MLP_FC <= F;  // whole: 16-byte W_down pieces
    const W* const wr[2] = {wgu + (long long)(active ? f : 0) * C, wgu + (long long)((active ? f : 0) + F) * C};
    uint4 raw[2][U], dpre[FP];
    const bool early = active && C % V == 0;
    if (early) gemv_load<W, 2, U>(wr, C, lane * V, raw);
    // W_down's pieces: a thread's first row into registers, its later rows into shared memory (by cp.async,
    // no registers held), all requested before the wait; each thread reads back only what it copied
    uint4* tile = reinterpret_cast<uint4*>(xs + ((R * C + 3) & ~3));  // (C - blockDim.x) rows of FP pieces
#pragma unroll
    for (int p = 0; p < FP; p++)
        if (whole && (int)threadIdx.x < C) dpre[p] = ld16(wd + (long long)threadIdx.x * F + f0 + p * V);
    if (whole)
        for (int n = threadIdx.x + blockDim.x; n < C; n += blockDim.x)
#pragma unroll
            for (int p = 0; p < FP; p++)
                cp16(tile + (n - blockDim.x) * FP + p, wd + (long long)n * F + f0 + p * V);
    cp_commit();
    pdl_wait();
    pdl_launch();
    stage_x<W, R>(x, nullptr, gain, m0, rows, C, xs, sq);
    float acc[2][R];
    warp_dots<W, 2, U, R>(wr, C, xs, rows, raw, early, acc);  // (an inactive warp's sums go unused)
    gemv_finish<2, R>(acc, sq, true, C, eps);
    if (lane == 0)
#pragma unroll
        for (int rr = 0; rr < R; rr++)
            hs[rr][warp] = active ? acc[0][rr] / (1.f + __expf(-acc[0][rr])) * acc[1][rr] : 0.f;
    cp_wait<0>();
    __syncthreads();
    for (int n = threadIdx.x; n < C; n += blockDim.x) {
        float wf[MLP_FC];
        if (whole) {
#pragma unroll
            for (int p = 0; p < FP; p++)
                Vec<W>::unpack(n == (int)threadIdx.x ? dpre[p] : tile[(n - blockDim.x) * FP + p], wf + p * V);
        } else {  // the last columns, or rows not 16-byte aligned
#pragma unroll
            for (int i = 0; i < MLP_FC; i++) wf[i] = f0 + i < F ? tof(wd[(long long)n * F + f0 + i]) : 0.f;
        }
#pragma unroll
        for (int rr = 0; rr < R; rr++) {
            if (rr >= rows) break;
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < MLP_FC; i++) s += wf[i] * hs[rr][i];
            atomicAdd(dx + (long long)(m0 + rr) * C + n, s);
        }
    }
}

// ---- the batched (cuBLAS) path's elementwise kernels --------------------------------------------------

// a[m] = W(x[m] / rms(x[m]) * gain): the operand of the next GEMM.
template <typename W>
__device__ void rmsnorm_act(const float* __restrict__ x, const float* __restrict__ gain, W* __restrict__ a,
                            int C, float eps) {
    __shared__ float red[32];
    pdl_wait();
    pdl_launch();
    const long long m = blockIdx.x;
    float ss = 0.f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) ss += x[m * C + c] * x[m * C + c];
    const float rstd = rsqrtf(block_sum(ss, red) / C + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x) a[m * C + c] = fromf<W>(x[m * C + c] * rstd * gain[c]);
}

// m = W(silu(gu[:, :F]) * gu[:, F:]), gu (M, 2F) float.
template <typename W>
__device__ void swiglu_act(const float* __restrict__ gu, W* __restrict__ out, int F) {
    pdl_wait();
    pdl_launch();
    const long long m = blockIdx.x;
    for (int f = threadIdx.x; f < F; f += blockDim.x) {
        const float g = gu[m * 2 * F + f], u = gu[m * 2 * F + F + f];
        out[m * F + f] = fromf<W>(g / (1.f + __expf(-g)) * u);
    }
}

// 3 blocks a multiprocessor (at most 85 registers): room for the next kernel's blocks beside a GEMV's, so
// that they start early and request their weights (the qkv GEMV, with fewer blocks, keeps more registers
// for its epilogue's values)
#define GEMV_BOUNDS __launch_bounds__(256, 3)
// at most 64 registers: 2 blocks a multiprocessor (rows of one keep it nearly free of spills)
#define SWIGLU_DOWN(W, NAME, U, R)                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * MLP_FC, 2) swiglu_down_u##U##_r##R##_##NAME(           \
        const W* wgu, const W* wd, const float* x, const float* gain, float* dx, int M, int F, int C, float eps) { \
        swiglu_down<W, U, R>(wgu, wd, x, gain, dx, M, F, C, eps);                                             \
    }
// gemv_<STEM>_u<U>_<NAME>: the GEMV with epilogue EPI
#define GEMV_KERNEL(W, NAME, U, STEM, EPI)                                                                    \
    extern "C" __global__ void GEMV_BOUNDS gemv_##STEM##_u##U##_##NAME(const W* w, const float* x, const float* x2,\
                                                           const float* gain, float* y, int M, int N, int K,  \
                                                           float eps) {                                       \
        gemv<W, EPI, U>(w, x, x2, gain, y, M, N, K, eps);                                                     \
    }
#define GEMV_KERNELS(W, NAME, U)                                                                              \
    GEMV_KERNEL(W, NAME, U, store, EPI_STORE)                                                                 \
    GEMV_KERNEL(W, NAME, U, store2, EPI_STORE2)                                                               \
    GEMV_KERNEL(W, NAME, U, add, EPI_ADD)                                                                     \
    GEMV_KERNEL(W, NAME, U, swiglu, EPI_SWIGLU)                                                               \
    extern "C" __global__ void GEMV_BOUNDS head_argmax_u##U##_##NAME(const W* w, const float* x, const float* x2, \
        const float* gain, int N, int K, float eps, unsigned long long* best, int* arrive, int* out, int* ctl, \
        int* hist, int cap, int L, int chain) {                                                               \
        head_argmax<W, U>(w, x, x2, gain, N, K, eps, best, arrive, out, ctl, hist, cap, L, chain);            \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 2) gemv_rope_u##U##_##NAME(                             \
        const W* w, const float* x, const float* x2, const float* gain, float* q, W* kc, W* vc, const int* meta, \
        const float* c, const float* s, int M, int H, int Hkv, int D, int L, int K, float eps) {             \
        gemv_rope<W, U>(w, x, x2, gain, RopeOut<W>{q, kc, vc, meta, c, s, H, Hkv, D, L}, M, K, eps);         \
    }                                                                                                         \
    SWIGLU_DOWN(W, NAME, U, 1)

#define DECODE_KERNELS(W, NAME)                                                                               \
    GEMV_KERNELS(W, NAME, 4)                                                                                  \
    GEMV_KERNELS(W, NAME, 8)                                                                                  \
    extern "C" __global__ void embed_##NAME(const int* meta, const W* emb, float* x, float* dx, int M, int C) { \
        embed<W>(meta, emb, x, dx, M, C);                                                                     \
    }                                                                                                         \
    extern "C" __global__ void rope_cache_##NAME(const float* qkv, const int* meta, float* q, W* kc, W* vc,   \
                                                 const float* c, const float* s, W* qh, W* kh, W* vh, int M,  \
                                                 int H, int Hkv, int D, int L) {                               \
        rope_cache<W>(qkv, meta, q, kc, vc, c, s, qh, kh, vh, M, H, Hkv, D, L);                               \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(512) attend_o_##NAME(                                        \
        const float* q, const W* kc, const W* vc, const int* meta, const W* wo, float* x, float* dx, int M,    \
        int H, int Hkv, int D, int L, int C) {                                                                \
        attend_o<W>(q, kc, vc, meta, wo, x, dx, M, H, Hkv, D, L, C);                                          \
    }                                                                                                         \
    extern "C" __global__ void CLUSTER_DIMS __launch_bounds__(32 * OC_WARPS) attend_o_cluster_##NAME(          \
        const float* q, const W* kc, const W* vc, const int* meta, const W* wo, float* x, float* dx, int M, int H, \
        int Hkv, int D, int L, int C, int alone_keys) {                                                       \
        attend_o_cluster<W>(q, kc, vc, meta, wo, x, dx, M, H, Hkv, D, L, C, alone_keys);                      \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(512) attend_##NAME(const float* q, const W* kc, const W* vc,   \
                                                               const int* meta, float* out, int M, int H,     \
                                                               int Hkv, int D, int L) {                       \
        attend<W, float, true>(q, kc, vc, meta, out, M, H, Hkv, D, L);                                        \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(512, 2) attend_act_##NAME(const float* q, const W* kc, const W* vc, const int* meta,   \
                                                 W* out, int M, int H, int Hkv, int D, int L) {               \
        attend<W, W, false>(q, kc, vc, meta, out, M, H, Hkv, D, L);                                                  \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * KV_WARPS, 2) attend_kv_act_##NAME(const float* q,           \
        const W* kc, const W* vc, const int* meta, W* out, int M, int H, int Hkv, int D, int L) {             \
        attend_kv<W, W>(q, kc, vc, meta, out, M, H, Hkv, D, L);                                               \
    }                                                                                                         \
    extern "C" __global__ void rmsnorm_act_##NAME(const float* x, const float* gain, W* a, int C, float eps) {\
        rmsnorm_act<W>(x, gain, a, C, eps);                                                                   \
    }                                                                                                         \
    extern "C" __global__ void swiglu_act_##NAME(const float* gu, W* out, int F) { swiglu_act<W>(gu, out, F); }

DECODE_KERNELS(bf16, bf16)
DECODE_KERNELS(float, f32)

// tgemv_<STEM>_c<CH>: the tensor-core GEMV of a few rows (bf16 weights only), up to CH chunks a warp
#define TGEMV_KERNEL(CH, STEM, EPI)                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * TC_WARPS, 2) tgemv_##STEM##_c##CH(                          \
        const bf16* w, const float* x, const float* x2, const float* gain, float* y, int M, int N, int K, float eps) { \
        tgemv<EPI, CH>(w, x, x2, gain, y, M, N, K, eps);                                                      \
    }
// (the paired epilogues, two weight tiles a warp, with 4 chunks only: 8 would take over 48 KB of shared memory)
#define TGEMV_KERNELS(CH)                                                                                     \
    TGEMV_KERNEL(CH, store, EPI_STORE)                                                                        \
    TGEMV_KERNEL(CH, add, EPI_ADD)
#define TGEMV_PAIRED(CH)                                                                                      \
    TGEMV_KERNEL(CH, swiglu, EPI_SWIGLU)                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * TC_WARPS, 2) tgemv_rope_c##CH(                              \
        const bf16* w, const float* x, const float* x2, const float* gain, float* q, bf16* kc, bf16* vc,       \
        const int* meta, const float* c, const float* s, int M, int H, int Hkv, int D, int L, int K, float eps) { \
        tgemv_rope<CH>(w, x, x2, gain, RopeOut<bf16>{q, kc, vc, meta, c, s, H, Hkv, D, L}, M, K, eps);        \
    }
TGEMV_KERNELS(4)
TGEMV_KERNELS(8)
TGEMV_PAIRED(4)

// ---- the next token ---------------------------------------------------------------------------------

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
// One block of 1024 threads per row; V <= 1024 * SAMPLE_PER_THREAD.
#define SAMPLE_PER_THREAD 64
extern "C" __global__ void __launch_bounds__(1024) sample_rows(const float* __restrict__ logits, int V,
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
