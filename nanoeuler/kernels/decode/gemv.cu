// The decode engine's GEMVs over a few rows (float FMA; launchers in gemv.py): y = W norm(x + x2) with the
// epilogues of decode.cuh's GEMV pieces, the qkv product with RoPE and the cache write, and head 0 with its
// argmax. Reference: layers.rmsnorm_forward, rope_forward, swiglu_forward; np.argmax.
//
// Kernels, per weight storage (_bf16, _f32) and pieces in flight a lane and row (U = 4 or 8: U * 32 pieces
// cover a row of K, gemv.py's choice): gemv_{store,store2,add,swiglu}_u<U>, gemv_rope_u<U>, head_argmax_u<U>.

#include "decode.cuh"

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

// ---- entry points -------------------------------------------------------------------------------------
// 3 blocks a multiprocessor (at most 85 registers): room for the next kernel's blocks beside a GEMV's, so
// that they start early and request their weights (the qkv GEMV, with fewer blocks, keeps more registers
// for its epilogue's values).
#define GEMV_BOUNDS __launch_bounds__(32 * GEMV_WARPS, 3)

extern "C" __global__ void GEMV_BOUNDS gemv_store_u4_bf16(const bf16* w, const float* x, const float* x2,
    const float* gain, float* y, int M, int N, int K, float eps) {
    gemv<bf16, EPI_STORE, 4>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void GEMV_BOUNDS gemv_store2_u4_bf16(const bf16* w, const float* x, const float* x2,
    const float* gain, float* y, int M, int N, int K, float eps) {
    gemv<bf16, EPI_STORE2, 4>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void GEMV_BOUNDS gemv_add_u4_bf16(const bf16* w, const float* x, const float* x2,
    const float* gain, float* y, int M, int N, int K, float eps) {
    gemv<bf16, EPI_ADD, 4>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void GEMV_BOUNDS gemv_swiglu_u4_bf16(const bf16* w, const float* x, const float* x2,
    const float* gain, float* y, int M, int N, int K, float eps) {
    gemv<bf16, EPI_SWIGLU, 4>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS, 2) gemv_rope_u4_bf16(const bf16* w,
    const float* x, const float* x2, const float* gain, float* q, bf16* kc, bf16* vc, const int* meta,
    const float* c, const float* s, int M, int H, int Hkv, int D, int L, int K, float eps) {
    gemv_rope<bf16, 4>(w, x, x2, gain, RopeOut<bf16>{q, kc, vc, meta, c, s, H, Hkv, D, L}, M, K, eps);
}
extern "C" __global__ void GEMV_BOUNDS head_argmax_u4_bf16(const bf16* w, const float* x, const float* x2,
    const float* gain, int N, int K, float eps, unsigned long long* best, int* arrive, int* out, int* ctl,
    int* hist, int cap, int L, int chain) {
    head_argmax<bf16, 4>(w, x, x2, gain, N, K, eps, best, arrive, out, ctl, hist, cap, L, chain);
}

extern "C" __global__ void GEMV_BOUNDS gemv_store_u8_bf16(const bf16* w, const float* x, const float* x2,
    const float* gain, float* y, int M, int N, int K, float eps) {
    gemv<bf16, EPI_STORE, 8>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void GEMV_BOUNDS gemv_store2_u8_bf16(const bf16* w, const float* x, const float* x2,
    const float* gain, float* y, int M, int N, int K, float eps) {
    gemv<bf16, EPI_STORE2, 8>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void GEMV_BOUNDS gemv_add_u8_bf16(const bf16* w, const float* x, const float* x2,
    const float* gain, float* y, int M, int N, int K, float eps) {
    gemv<bf16, EPI_ADD, 8>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void GEMV_BOUNDS gemv_swiglu_u8_bf16(const bf16* w, const float* x, const float* x2,
    const float* gain, float* y, int M, int N, int K, float eps) {
    gemv<bf16, EPI_SWIGLU, 8>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS, 2) gemv_rope_u8_bf16(const bf16* w,
    const float* x, const float* x2, const float* gain, float* q, bf16* kc, bf16* vc, const int* meta,
    const float* c, const float* s, int M, int H, int Hkv, int D, int L, int K, float eps) {
    gemv_rope<bf16, 8>(w, x, x2, gain, RopeOut<bf16>{q, kc, vc, meta, c, s, H, Hkv, D, L}, M, K, eps);
}
extern "C" __global__ void GEMV_BOUNDS head_argmax_u8_bf16(const bf16* w, const float* x, const float* x2,
    const float* gain, int N, int K, float eps, unsigned long long* best, int* arrive, int* out, int* ctl,
    int* hist, int cap, int L, int chain) {
    head_argmax<bf16, 8>(w, x, x2, gain, N, K, eps, best, arrive, out, ctl, hist, cap, L, chain);
}

extern "C" __global__ void GEMV_BOUNDS gemv_store_u4_f32(const float* w, const float* x, const float* x2,
    const float* gain, float* y, int M, int N, int K, float eps) {
    gemv<float, EPI_STORE, 4>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void GEMV_BOUNDS gemv_store2_u4_f32(const float* w, const float* x, const float* x2,
    const float* gain, float* y, int M, int N, int K, float eps) {
    gemv<float, EPI_STORE2, 4>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void GEMV_BOUNDS gemv_add_u4_f32(const float* w, const float* x, const float* x2,
    const float* gain, float* y, int M, int N, int K, float eps) {
    gemv<float, EPI_ADD, 4>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void GEMV_BOUNDS gemv_swiglu_u4_f32(const float* w, const float* x, const float* x2,
    const float* gain, float* y, int M, int N, int K, float eps) {
    gemv<float, EPI_SWIGLU, 4>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS, 2) gemv_rope_u4_f32(const float* w,
    const float* x, const float* x2, const float* gain, float* q, float* kc, float* vc, const int* meta,
    const float* c, const float* s, int M, int H, int Hkv, int D, int L, int K, float eps) {
    gemv_rope<float, 4>(w, x, x2, gain, RopeOut<float>{q, kc, vc, meta, c, s, H, Hkv, D, L}, M, K, eps);
}
extern "C" __global__ void GEMV_BOUNDS head_argmax_u4_f32(const float* w, const float* x, const float* x2,
    const float* gain, int N, int K, float eps, unsigned long long* best, int* arrive, int* out, int* ctl,
    int* hist, int cap, int L, int chain) {
    head_argmax<float, 4>(w, x, x2, gain, N, K, eps, best, arrive, out, ctl, hist, cap, L, chain);
}

extern "C" __global__ void GEMV_BOUNDS gemv_store_u8_f32(const float* w, const float* x, const float* x2,
    const float* gain, float* y, int M, int N, int K, float eps) {
    gemv<float, EPI_STORE, 8>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void GEMV_BOUNDS gemv_store2_u8_f32(const float* w, const float* x, const float* x2,
    const float* gain, float* y, int M, int N, int K, float eps) {
    gemv<float, EPI_STORE2, 8>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void GEMV_BOUNDS gemv_add_u8_f32(const float* w, const float* x, const float* x2,
    const float* gain, float* y, int M, int N, int K, float eps) {
    gemv<float, EPI_ADD, 8>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void GEMV_BOUNDS gemv_swiglu_u8_f32(const float* w, const float* x, const float* x2,
    const float* gain, float* y, int M, int N, int K, float eps) {
    gemv<float, EPI_SWIGLU, 8>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS, 2) gemv_rope_u8_f32(const float* w,
    const float* x, const float* x2, const float* gain, float* q, float* kc, float* vc, const int* meta,
    const float* c, const float* s, int M, int H, int Hkv, int D, int L, int K, float eps) {
    gemv_rope<float, 8>(w, x, x2, gain, RopeOut<float>{q, kc, vc, meta, c, s, H, Hkv, D, L}, M, K, eps);
}
extern "C" __global__ void GEMV_BOUNDS head_argmax_u8_f32(const float* w, const float* x, const float* x2,
    const float* gain, int N, int K, float eps, unsigned long long* best, int* arrive, int* out, int* ctl,
    int* hist, int cap, int L, int chain) {
    head_argmax<float, 8>(w, x, x2, gain, N, K, eps, best, arrive, out, ctl, hist, cap, L, chain);
}
