// The decode engine's GEMVs of 2 to 16 rows on the tensor cores (bf16 weights only; launchers in tgemv.py):
// the products and epilogues of gemv.cu, mma.sync m16n8k16 with x split into bf16 hi + lo.
// Reference: layers.rmsnorm_forward, rope_forward, swiglu_forward.
//
// Kernels: tgemv_{store,add}_c<CH> (CH = 4 or 8 chunks of 32 columns a warp), tgemv_{swiglu,rope}_c4 (two
// weight tiles a warp, with 4 chunks only: 8 would take over 48 KB of shared memory).

#include "decode.cuh"

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

// ---- entry points -------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(32 * TC_WARPS, 2) tgemv_store_c4(const bf16* w, const float* x,
    const float* x2, const float* gain, float* y, int M, int N, int K, float eps) {
    tgemv<EPI_STORE, 4>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void __launch_bounds__(32 * TC_WARPS, 2) tgemv_add_c4(const bf16* w, const float* x,
    const float* x2, const float* gain, float* y, int M, int N, int K, float eps) {
    tgemv<EPI_ADD, 4>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void __launch_bounds__(32 * TC_WARPS, 2) tgemv_store_c8(const bf16* w, const float* x,
    const float* x2, const float* gain, float* y, int M, int N, int K, float eps) {
    tgemv<EPI_STORE, 8>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void __launch_bounds__(32 * TC_WARPS, 2) tgemv_add_c8(const bf16* w, const float* x,
    const float* x2, const float* gain, float* y, int M, int N, int K, float eps) {
    tgemv<EPI_ADD, 8>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void __launch_bounds__(32 * TC_WARPS, 2) tgemv_swiglu_c4(const bf16* w, const float* x,
    const float* x2, const float* gain, float* y, int M, int N, int K, float eps) {
    tgemv<EPI_SWIGLU, 4>(w, x, x2, gain, y, M, N, K, eps);
}
extern "C" __global__ void __launch_bounds__(32 * TC_WARPS, 2) tgemv_rope_c4(const bf16* w, const float* x,
    const float* x2, const float* gain, float* q, bf16* kc, bf16* vc, const int* meta, const float* c,
    const float* s, int M, int H, int Hkv, int D, int L, int K, float eps) {
    tgemv_rope<4>(w, x, x2, gain, RopeOut<bf16>{q, kc, vc, meta, c, s, H, Hkv, D, L}, M, K, eps);
}
