// The decode engine's row-wise kernels (launchers in elementwise.py): the embedding that starts every
// pass, and the cuBLAS path's kernels between its GEMMs (the norm into a GEMM operand, RoPE with the cache
// write, SwiGLU). Reference: layers.embedding_forward, rmsnorm_forward, rope_forward, swiglu_forward.
//
// Kernels, per storage of the weights and GEMM operands (_bf16, _f32): embed, rope_cache, rmsnorm_act,
// swiglu_act.

#include "decode.cuh"

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

// a[m] = W(x[m] / rms(x[m]) * gain): the operand of the next GEMM. grid (M); a thread holds up to HOLD
// values of its row, all requested before the sum (one memory round trip, not one per value).
template <typename W>
__device__ void rmsnorm_act(const float* __restrict__ x, const float* __restrict__ gain, W* __restrict__ a,
                            int C, float eps) {
    constexpr int HOLD = 4;
    __shared__ float red[32];
    pdl_wait();
    pdl_launch();
    const float* xr = x + (long long)blockIdx.x * C;
    W* ar = a + (long long)blockIdx.x * C;
    float v[HOLD], ss = 0.f;
#pragma unroll
    for (int k = 0; k < HOLD; k++) {
        const int c = threadIdx.x + k * blockDim.x;
        v[k] = c < C ? xr[c] : 0.f;
    }
#pragma unroll
    for (int k = 0; k < HOLD; k++) ss += v[k] * v[k];
    for (int c = threadIdx.x + HOLD * blockDim.x; c < C; c += blockDim.x) ss += xr[c] * xr[c];  // a wide row
    const float rstd = rsqrtf(block_sum(ss, red) / C + eps);
#pragma unroll
    for (int k = 0; k < HOLD; k++) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c < C) ar[c] = fromf<W>(v[k] * rstd * gain[c]);
    }
    for (int c = threadIdx.x + HOLD * blockDim.x; c < C; c += blockDim.x) ar[c] = fromf<W>(xr[c] * rstd * gain[c]);
}

// m = W(silu(gu[:, :F]) * gu[:, F:]), gu (M, 2F) float. grid (M, F / blockDim): a value a thread.
template <typename W>
__device__ void swiglu_act(const float* __restrict__ gu, W* __restrict__ out, int F) {
    pdl_wait();
    pdl_launch();
    const long long m = blockIdx.x;
    const int f = blockIdx.y * blockDim.x + threadIdx.x;
    if (f >= F) return;
    const float g = gu[m * 2 * F + f], u = gu[m * 2 * F + F + f];
    out[m * F + f] = fromf<W>(g / (1.f + __expf(-g)) * u);
}

// ---- entry points -------------------------------------------------------------------------------------
extern "C" __global__ void embed_bf16(const int* meta, const bf16* emb, float* x, float* dx, int M, int C) {
    embed<bf16>(meta, emb, x, dx, M, C);
}
extern "C" __global__ void rope_cache_bf16(const float* qkv, const int* meta, float* q, bf16* kc, bf16* vc,
    const float* c, const float* s, bf16* qh, bf16* kh, bf16* vh, int M, int H, int Hkv, int D, int L) {
    rope_cache<bf16>(qkv, meta, q, kc, vc, c, s, qh, kh, vh, M, H, Hkv, D, L);
}
extern "C" __global__ void rmsnorm_act_bf16(const float* x, const float* gain, bf16* a, int C, float eps) {
    rmsnorm_act<bf16>(x, gain, a, C, eps);
}
extern "C" __global__ void swiglu_act_bf16(const float* gu, bf16* out, int F) {
    swiglu_act<bf16>(gu, out, F);
}
extern "C" __global__ void embed_f32(const int* meta, const float* emb, float* x, float* dx, int M, int C) {
    embed<float>(meta, emb, x, dx, M, C);
}
extern "C" __global__ void rope_cache_f32(const float* qkv, const int* meta, float* q, float* kc, float* vc,
    const float* c, const float* s, float* qh, float* kh, float* vh, int M, int H, int Hkv, int D, int L) {
    rope_cache<float>(qkv, meta, q, kc, vc, c, s, qh, kh, vh, M, H, Hkv, D, L);
}
extern "C" __global__ void rmsnorm_act_f32(const float* x, const float* gain, float* a, int C, float eps) {
    rmsnorm_act<float>(x, gain, a, C, eps);
}
extern "C" __global__ void swiglu_act_f32(const float* gu, float* out, int F) {
    swiglu_act<float>(gu, out, F);
}
