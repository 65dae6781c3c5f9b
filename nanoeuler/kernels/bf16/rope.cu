// RoPE and the attention layouts: qkv rows to rotated q/k/v heads and back, the o_proj operand, and
// delta = rowsum(dO * O) for the float32 attention. Reference: nanoeuler.model.layers.rope_*.

#include "common.cuh"

// qkv (N, (H+2Hkv)*D) bf16, rows n = b*T + t -> q (B,H,T,D), k (B,Hkv,T,D) rotated, v (B,Hkv,T,D); float32.
// One thread per pair (i, i + D/2) of one head of one row; half-split rotation by cos/sin (T, D/2).
extern "C" __global__ void qkv_rope_split(const bf16* __restrict__ qkv, const float* __restrict__ cos_t,
                                          const float* __restrict__ sin_t, float* __restrict__ q,
                                          float* __restrict__ k, float* __restrict__ v, int T, int H, int Hkv,
                                          int D, long long n_pairs) {
    const int half = D / 2, heads = H + 2 * Hkv;
    for (long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x; p < n_pairs;
         p += (long long)gridDim.x * blockDim.x) {
        const int i = (int)(p % half);
        const long long hp = p / half;
        const int hh = (int)(hp % heads);
        const long long n = hp / heads;
        const int t = (int)(n % T);
        const long long b = n / T;
        const bf16* src = qkv + n * (long long)heads * D + (long long)hh * D;
        const float x1 = bf2f(src[i]), x2 = bf2f(src[i + half]);
        float* dst;
        float y1 = x1, y2 = x2;
        if (hh < H + Hkv) {
            const float c = cos_t[t * half + i], s = sin_t[t * half + i];
            y1 = x1 * c - x2 * s;
            y2 = x2 * c + x1 * s;
        }
        if (hh < H) dst = q + ((b * H + hh) * T + t) * (long long)D;
        else if (hh < H + Hkv) dst = k + ((b * Hkv + (hh - H)) * T + t) * (long long)D;
        else dst = v + ((b * Hkv + (hh - H - Hkv)) * T + t) * (long long)D;
        dst[i] = y1;
        dst[i + half] = y2;
    }
}

// dq (B,H,T,D) float32, dk/dv (B,Hkv,T,D) float32 -> dqkv (N, (H+2Hkv)*D) bf16, the rotation undone on dq, dk.
// Grid: y over rows n = b*T + t (grid-stride), threads over the row's (H+2Hkv)*D/2 pairs.
extern "C" __global__ void rope_bwd_pack(const float* __restrict__ dq, const float* __restrict__ dk,
                                         const float* __restrict__ dv, const float* __restrict__ cos_t,
                                         const float* __restrict__ sin_t, bf16* __restrict__ dqkv, int T, int H,
                                         int Hkv, int D, int N) {
    const int half = D / 2, heads = H + 2 * Hkv, npairs = heads * half;
    for (int n = blockIdx.y; n < N; n += gridDim.y) {
        const int t = n % T, b = n / T;
        for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < npairs; p += gridDim.x * blockDim.x) {
            const int hh = p / half, i = p - hh * half;
            const float* src;
            if (hh < H) src = dq + (((long long)b * H + hh) * T + t) * D;
            else if (hh < H + Hkv) src = dk + (((long long)b * Hkv + (hh - H)) * T + t) * D;
            else src = dv + (((long long)b * Hkv + (hh - H - Hkv)) * T + t) * D;
            const float y1 = src[i], y2 = src[i + half];
            float x1 = y1, x2 = y2;
            if (hh < H + Hkv) {
                const float c = cos_t[t * half + i], s = sin_t[t * half + i];
                x1 = y1 * c + y2 * s;
                x2 = y2 * c - y1 * s;
            }
            bf16* dst = dqkv + (long long)n * heads * D + (long long)hh * D;
            dst[i] = f2bf(x1);
            dst[i + half] = f2bf(x2);
        }
    }
}

// out (B,H,T,D) float32 -> a (N, H*D) bf16 (rows n = b*T + t), the o_proj GEMM's operand.
extern "C" __global__ void attn_pack(const float* __restrict__ out, bf16* __restrict__ a, int T, int H, int D,
                                     long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const int d = (int)(i % D);
        const long long r = i / D;
        const int h = (int)(r % H);
        const long long bt = r / H;
        const int t = (int)(bt % T);
        const long long b = bt / T;
        a[i] = f2bf(out[((b * H + h) * T + t) * (long long)D + d]);
    }
}

// delta (B,H,T) = rowsum(dO * O), with O as the bf16 (N, H*D) operand a and dO as float32 (N, H*D).
// One warp per (row, head).
extern "C" __global__ void __launch_bounds__(256) attn_delta(const bf16* __restrict__ a, const float* __restrict__ da,
                                                             float* __restrict__ delta, int T, int H, int D,
                                                             long long rows) {
    const long long r = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= rows) return;  // r = n * H + h
    const long long n = r / H;
    const int h = (int)(r % H);
    const bf16* ar = a + r * D;
    const float* dr = da + r * D;
    float acc = 0.f;
    for (int d = lane; d < D; d += 32) acc = fmaf(bf2f(ar[d]), dr[d], acc);
    acc = warp_sum(acc);
    if (lane == 0) {
        const long long b = n / T;
        const int t = (int)(n % T);
        delta[(b * H + h) * T + t] = acc;
    }
}

// qkv (N, (H+2Hkv)*D) bf16 -> q (B,H,T,D), k (B,Hkv,T,D) rotated, v (B,Hkv,T,D), all bf16 (the tensor-core
// attention's operands). One thread per 8 pairs (i .. i+7 with i + D/2 .. i+D/2+7) of one head of one row:
// 16-byte loads and stores (needs D % 16 == 0; the engine's tensor-core attention has D 32 or 64).
// 1-D grid (grid-stride) over N * (H + 2Hkv) * D/16 items, 32-bit indices (the host checks the count).
extern "C" __global__ void qkv_rope_split_bf16(const bf16* __restrict__ qkv, const float* __restrict__ cos_t,
                                               const float* __restrict__ sin_t, bf16* __restrict__ q,
                                               bf16* __restrict__ k, bf16* __restrict__ v, int T, int H, int Hkv,
                                               int D, int N) {
    const int half = D / 2, octs = half / 8, heads = H + 2 * Hkv, items = N * heads * octs;
    for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < items; p += gridDim.x * blockDim.x) {
        const int i = (p % octs) * 8, r = p / octs, hh = r % heads, n = r / heads, t = n % T, b = n / T;
        const bf16* src = qkv + (long long)n * heads * D + hh * D;
        bf16* dst;
        if (hh < H) dst = q + (((long long)b * H + hh) * T + t) * D;
        else if (hh < H + Hkv) dst = k + (((long long)b * Hkv + (hh - H)) * T + t) * D;
        else dst = v + (((long long)b * Hkv + (hh - H - Hkv)) * T + t) * D;
        uint4 lo = *reinterpret_cast<const uint4*>(src + i), hi = *reinterpret_cast<const uint4*>(src + i + half);
        if (hh < H + Hkv) {
            const float* cp = cos_t + t * half + i;
            const float* sp = sin_t + t * half + i;
            const float4 c0 = *reinterpret_cast<const float4*>(cp), c1 = *reinterpret_cast<const float4*>(cp + 4);
            const float4 s0 = *reinterpret_cast<const float4*>(sp), s1 = *reinterpret_cast<const float4*>(sp + 4);
            const float cs[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
            const float sn[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
            bf16* x1 = reinterpret_cast<bf16*>(&lo);
            bf16* x2 = reinterpret_cast<bf16*>(&hi);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float a = bf2f(x1[j]), e = bf2f(x2[j]);
                x1[j] = f2bf(a * cs[j] - e * sn[j]);
                x2[j] = f2bf(e * cs[j] + a * sn[j]);
            }
        }
        *reinterpret_cast<uint4*>(dst + i) = lo;
        *reinterpret_cast<uint4*>(dst + i + half) = hi;
    }
}
