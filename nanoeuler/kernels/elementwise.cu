// Elementwise layers, float32: RoPE (half-split pairing), SwiGLU, the token-embedding backward.
// References: nanoeuler.model.layers.rope_forward / rope_backward, swiglu_forward / swiglu_backward,
// embedding_backward.

// ---- RoPE ----------------------------------------------------------------------------------------
// x (B,H,T,D) strided (D contiguous), cos/sin (T, D/2) contiguous -> y (B,H,T,D) C-contiguous.
// One thread per pair (i, i + D/2):
//   y[i] = x[i] cos - x[i+D/2] sin * sign ;  y[i+D/2] = x[i+D/2] cos + x[i] sin * sign
// sign = +1 rotates forward; sign = -1 is the transpose (the backward).
extern "C" __global__ void __launch_bounds__(256) rope_rotate(
    const float* __restrict__ x, long long sb, long long sh, long long st, const float* __restrict__ cos_t,
    const float* __restrict__ sin_t, float* __restrict__ y, int H, int T, int D, float sign, long long pairs) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= pairs) return;
    const int half = D / 2;
    const int i = (int)(idx % half);
    const long long row = idx / half;  // (b, h, t) flattened
    const int t = (int)(row % T);
    const long long bh = row / T;
    const long long b = bh / H, h = bh % H;
    const float* xr = x + b * sb + h * sh + (long long)t * st;
    const float x1 = xr[i], x2 = xr[i + half];
    const float c = cos_t[(long long)t * half + i];
    const float s = sin_t[(long long)t * half + i] * sign;
    float* yr = y + row * D;
    yr[i] = x1 * c - x2 * s;
    yr[i + half] = x2 * c + x1 * s;
}

// ---- SwiGLU --------------------------------------------------------------------------------------
// h = silu(g) * u = g * sigmoid(g) * u over n = N*F elements. g and u are (N, F) with row strides
// gld, uld (so the two halves of one stacked gate/up GEMM output are read in place); h, dh, dg, du
// are contiguous (N, F).
__device__ __forceinline__ float sigmoidf(float g) { return 1.f / (1.f + expf(-g)); }

extern "C" __global__ void __launch_bounds__(256) swiglu_fwd(
    const float* __restrict__ g, long long gld, const float* __restrict__ u, long long uld, float* __restrict__ h,
    int F, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long r = i / F, c = i % F;
    const float gi = g[r * gld + c];
    h[i] = gi * sigmoidf(gi) * u[r * uld + c];
}

// dg = dh * u * (s + g s (1 - s)) ; du = dh * g * s
extern "C" __global__ void __launch_bounds__(256) swiglu_bwd(
    const float* __restrict__ dh, const float* __restrict__ g, long long gld, const float* __restrict__ u,
    long long uld, float* __restrict__ dg, float* __restrict__ du, int F, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long r = i / F, c = i % F;
    const float gi = g[r * gld + c], s = sigmoidf(gi), d = dh[i];
    const float silu = gi * s;
    du[i] = d * silu;
    dg[i] = d * u[r * uld + c] * (s + silu * (1.f - s));
}

// ---- embedding backward ---------------------------------------------------------------------------
// dw (V,C) zeroed by the caller; dw[v, c] = sum of dx[n, c] over the rows n with ids[n] == v, added in the
// order of n. No atomics: the sums are the same bits on every run, which ZeRO-1's bit-for-bit check against
// plain data parallelism needs. keys = sorted ids[n] * N + n puts each id's rows together in position
// order; the block (x, y) adds every run of one id whose first key lies in keys[x*span, (x+1)*span), for the
// columns y*blockDim.x + threadIdx.x. Keys outside [0, V*N) (ids outside [0, V)) add nowhere.
#define EMB_BATCH 16  // rows loaded before they are added: loads in flight instead of one latency a row

extern "C" __global__ void __launch_bounds__(128) embedding_bwd(
    const float* __restrict__ dx, const long long* __restrict__ keys, float* __restrict__ dw, long long N, int C,
    int V, int span) {
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const long long end = (long long)V * N;
    const long long i1 = min(N, (long long)(blockIdx.x + 1) * span);
    for (long long i = (long long)blockIdx.x * span; i < i1; ++i) {
        const long long k = keys[i];
        if (k < 0 || k >= end) continue;
        const long long id = k / N, lo = id * N, hi = lo + N;  // the keys of id's run lie in [lo, hi)
        if (i > 0 && keys[i - 1] >= lo) continue;              // not the run's first key: another block's run
        float acc = 0.f;
        for (long long j = i; j < N && keys[j] < hi; j += EMB_BATCH) {
            long long kb[EMB_BATCH];
            float v[EMB_BATCH];
#pragma unroll
            for (int u = 0; u < EMB_BATCH; ++u) kb[u] = j + u < N ? keys[j + u] : hi;  // the keys first, then
#pragma unroll
            for (int u = 0; u < EMB_BATCH; ++u) v[u] = kb[u] < hi ? dx[(kb[u] - lo) * C + c] : 0.f;  // the rows
#pragma unroll
            for (int u = 0; u < EMB_BATCH; ++u)
                if (kb[u] < hi) acc += v[u];
        }
        dw[id * C + c] = acc;
    }
}
