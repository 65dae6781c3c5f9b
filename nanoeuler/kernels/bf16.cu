// Kernels of the bf16 training-step engine (nanoeuler/kernels/engine.py).
//
// bf16 values are stored as raw 16-bit words (unsigned short) and converted by hand (round to nearest
// even), so the file needs no CUDA header and compiles the same under NVRTC and nvcc. All arithmetic
// is float32; bf16 is only a storage format for GEMM operands and activations.
//
// References (NumPy, float64 in the self-test): nanoeuler.model.layers rmsnorm_*, rope_*, swiglu_*,
// cross_entropy_*, embedding_*; nanoeuler.optim.AdamW.step and clip_grad_norm.

typedef unsigned short bf16;

__device__ __forceinline__ float bf2f(bf16 h) { return __uint_as_float(((unsigned)h) << 16); }

__device__ __forceinline__ bf16 f2bf(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// Sum over a block of up to 1024 threads; every thread gets the result. `red` holds 32 floats.
__device__ __forceinline__ float block_sum(float x, float* red) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    x = warp_sum(x);
    __syncthreads();
    if (lane == 0) red[wid] = x;
    __syncthreads();
    float t = lane < nw ? red[lane] : 0.f;
    return warp_sum(t);
}

__device__ __forceinline__ float block_max(float x, float* red) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    x = warp_max(x);
    __syncthreads();
    if (lane == 0) red[wid] = x;
    __syncthreads();
    float t = lane < nw ? red[lane] : __int_as_float(0xff800000);
    return warp_max(t);
}

// ---- conversions, embedding ----------------------------------------------------------------------

extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, bf16* __restrict__ y, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = f2bf(x[i]);
}

// x (N,C) float32 = E[ids] ; ids int32 (N,)
extern "C" __global__ void embed_fwd(const int* __restrict__ ids, const float* __restrict__ E, float* __restrict__ x,
                                     int C, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / C;
        x[i] = E[(long long)ids[r] * C + (i - r * C)];
    }
}

// dE[ids[r]] += dx[r]  (dE zeroed by the caller)
extern "C" __global__ void embed_bwd(const float* __restrict__ dx, const int* __restrict__ ids, float* __restrict__ dE,
                                     int C, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / C;
        atomicAdd(dE + (long long)ids[r] * C + (i - r * C), dx[i]);
    }
}

// ---- RMSNorm ---------------------------------------------------------------------------------------

// One warp per row: y = bf16(x * rstd * w), rstd = 1/sqrt(mean(x^2) + eps). Block = 4 warps.
extern "C" __global__ void __launch_bounds__(128) rmsnorm_fwd_bf16(
    const float* __restrict__ x, const float* __restrict__ w, bf16* __restrict__ y, float* __restrict__ rstd,
    int N, int C, float eps) {
    const int row = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return;
    const float* xr = x + (long long)row * C;
    float ss = 0.f;
    for (int j = lane; j < C; j += 32) ss = fmaf(xr[j], xr[j], ss);
    ss = warp_sum(ss);
    const float r = 1.f / sqrtf(ss / (float)C + eps);
    bf16* yr = y + (long long)row * C;
    for (int j = lane; j < C; j += 32) yr[j] = f2bf(xr[j] * r * w[j]);
    if (lane == 0 && rstd) rstd[row] = r;
}

// Backward of y = x * rstd * w for `rows` rows per block (blockDim 256, C <= 256 * RB_MAX):
//   dxn = rstd * (dy*w - xhat * mean(dy*w*xhat)),  xhat = x * rstd
//   dx  = (accumulate ? dx : 0) + dxn  (float32, in place), dxb = bf16(dx)  (the next GEMM's operand)
//   dw += sum over rows of dy * xhat  (one atomic add per column and block; dw zeroed by the caller)
#define RB_MAX 8
extern "C" __global__ void __launch_bounds__(256) rmsnorm_bwd_bf16(
    const float* __restrict__ dy, const float* __restrict__ x, const float* __restrict__ w,
    const float* __restrict__ rstd, float* __restrict__ dx, bf16* __restrict__ dxb, float* __restrict__ dw,
    int N, int C, int rows, int accumulate) {
    __shared__ float red[32];
    float dwacc[RB_MAX];
    float wv[RB_MAX];
#pragma unroll
    for (int i = 0; i < RB_MAX; ++i) {
        const int j = threadIdx.x + i * 256;
        dwacc[i] = 0.f;
        wv[i] = j < C ? w[j] : 0.f;
    }
    const int r0 = blockIdx.x * rows, r1 = min(N, r0 + rows);
    for (int r = r0; r < r1; ++r) {
        const long long off = (long long)r * C;
        const float rs = rstd[r];
        float dyv[RB_MAX], xh[RB_MAX];
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < RB_MAX; ++i) {
            const int j = threadIdx.x + i * 256;
            dyv[i] = 0.f;
            xh[i] = 0.f;
            if (j < C) {
                dyv[i] = dy[off + j];
                xh[i] = x[off + j] * rs;
                dot = fmaf(dyv[i] * wv[i], xh[i], dot);
                dwacc[i] = fmaf(dyv[i], xh[i], dwacc[i]);
            }
        }
        const float mean = block_sum(dot, red) / (float)C;
#pragma unroll
        for (int i = 0; i < RB_MAX; ++i) {
            const int j = threadIdx.x + i * 256;
            if (j < C) {
                float d = rs * (dyv[i] * wv[i] - xh[i] * mean);
                if (accumulate) d += dx[off + j];
                dx[off + j] = d;
                dxb[off + j] = f2bf(d);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < RB_MAX; ++i) {
        const int j = threadIdx.x + i * 256;
        if (j < C) atomicAdd(dw + j, dwacc[i]);
    }
}

// ---- RoPE and the attention layouts --------------------------------------------------------------

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

// dq (B,H,T,D), dk/dv (B,Hkv,T,D) float32 -> dqkv (N, (H+2Hkv)*D) bf16, the rotation undone on dq, dk.
extern "C" __global__ void rope_bwd_pack(const float* __restrict__ dq, const float* __restrict__ dk,
                                         const float* __restrict__ dv, const float* __restrict__ cos_t,
                                         const float* __restrict__ sin_t, bf16* __restrict__ dqkv, int T, int H,
                                         int Hkv, int D, long long n_pairs) {
    const int half = D / 2, heads = H + 2 * Hkv;
    for (long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x; p < n_pairs;
         p += (long long)gridDim.x * blockDim.x) {
        const int i = (int)(p % half);
        const long long hp = p / half;
        const int hh = (int)(hp % heads);
        const long long n = hp / heads;
        const int t = (int)(n % T);
        const long long b = n / T;
        const float* src;
        if (hh < H) src = dq + ((b * H + hh) * T + t) * (long long)D;
        else if (hh < H + Hkv) src = dk + ((b * Hkv + (hh - H)) * T + t) * (long long)D;
        else src = dv + ((b * Hkv + (hh - H - Hkv)) * T + t) * (long long)D;
        const float y1 = src[i], y2 = src[i + half];
        float x1 = y1, x2 = y2;
        if (hh < H + Hkv) {
            const float c = cos_t[t * half + i], s = sin_t[t * half + i];
            x1 = y1 * c + y2 * s;
            x2 = y2 * c - y1 * s;
        }
        bf16* dst = dqkv + n * (long long)heads * D + (long long)hh * D;
        dst[i] = f2bf(x1);
        dst[i + half] = f2bf(x2);
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

// ---- SwiGLU ----------------------------------------------------------------------------------------

// gu (N, 2F) bf16 = [gate | up] -> m (N, F) bf16 = silu(gate) * up.
extern "C" __global__ void swiglu_fwd_bf16(const bf16* __restrict__ gu, bf16* __restrict__ m, int F, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / F;
        const int j = (int)(i - r * F);
        const float g = bf2f(gu[r * 2 * F + j]), u = bf2f(gu[r * 2 * F + F + j]);
        m[i] = f2bf(g / (1.f + expf(-g)) * u);
    }
}

// dm (N, F) float32, gu (N, 2F) bf16 -> dgu (N, 2F) bf16 = [dgate | dup].
extern "C" __global__ void swiglu_bwd_bf16(const float* __restrict__ dm, const bf16* __restrict__ gu,
                                           bf16* __restrict__ dgu, int F, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / F;
        const int j = (int)(i - r * F);
        const float g = bf2f(gu[r * 2 * F + j]), u = bf2f(gu[r * 2 * F + F + j]);
        const float s = 1.f / (1.f + expf(-g));
        const float d = dm[i];
        dgu[r * 2 * F + j] = f2bf(d * u * s * (1.f + g * (1.f - s)));
        dgu[r * 2 * F + F + j] = f2bf(d * g * s);
    }
}

// ---- cross-entropy over the K output heads ---------------------------------------------------------

// Per head k: scale[k] = 1 / (n_valid_k * active) where active = heads with any valid target (0 if none).
// targets (N, K) int32, -1 ignored. One block of 1024 threads.
extern "C" __global__ void __launch_bounds__(1024) ce_head_scale(const int* __restrict__ targets, float* __restrict__ scale,
                                                                 long long N, int K) {
    __shared__ float red[32];
    __shared__ float cnt[16];
    for (int k = 0; k < K; ++k) {
        float c = 0.f;
        for (long long r = threadIdx.x; r < N; r += blockDim.x) c += targets[r * K + k] >= 0 ? 1.f : 0.f;
        c = block_sum(c, red);
        if (threadIdx.x == 0) cnt[k] = c;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int active = 0;
        for (int k = 0; k < K; ++k) active += cnt[k] > 0.f;
        for (int k = 0; k < K; ++k) scale[k] = cnt[k] > 0.f ? 1.f / (cnt[k] * (float)active) : 0.f;
    }
}

// logits (R, K*V) float32 for rows r0 .. r0+R-1; grid (R, K), blockDim 256.
//   loss[r, k] = lse - z[t]            (0 for ignored rows)
//   dlg[r, k*V + j] = scale[k] * (softmax_j - [j == t])   bf16 (0 for ignored rows)
extern "C" __global__ void __launch_bounds__(256) ce_heads_fwd_bwd(
    const float* __restrict__ logits, const int* __restrict__ targets, const float* __restrict__ scale,
    float* __restrict__ loss, bf16* __restrict__ dlg, int V, int K) {
    __shared__ float red[32];
    const long long r = blockIdx.x;
    const int k = blockIdx.y;
    const float* z = logits + (r * K + k) * (long long)V;
    bf16* g = dlg + (r * K + k) * (long long)V;
    const int t = targets[r * K + k];
    if (t < 0) {
        for (int j = threadIdx.x; j < V; j += blockDim.x) g[j] = 0;
        if (threadIdx.x == 0) loss[r * K + k] = 0.f;
        return;
    }
    float mx = __int_as_float(0xff800000);
    for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, z[j]);
    mx = block_max(mx, red);
    float s = 0.f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) s += expf(z[j] - mx);
    s = block_sum(s, red);
    const float lse = mx + logf(s);
    const float sc = scale[k];
    for (int j = threadIdx.x; j < V; j += blockDim.x) g[j] = f2bf(sc * (expf(z[j] - lse) - (j == t ? 1.f : 0.f)));
    if (threadIdx.x == 0) loss[r * K + k] = lse - z[t];
}

// out[0] = sum_k scale[k] * sum_r loss[r, k]. One block of 1024 threads.
extern "C" __global__ void __launch_bounds__(1024) ce_loss_reduce(const float* __restrict__ loss,
                                                                  const float* __restrict__ scale,
                                                                  float* __restrict__ out, long long N, int K) {
    __shared__ float red[32];
    float acc = 0.f;
    for (long long i = threadIdx.x; i < N * K; i += blockDim.x) acc += loss[i] * scale[i % K];
    acc = block_sum(acc, red);
    if (threadIdx.x == 0) out[0] = acc;
}

// ---- optimizer ---------------------------------------------------------------------------------------

// acc[0] += sum g^2 (acc zeroed by the caller). blockDim 256.
extern "C" __global__ void __launch_bounds__(256) sumsq(const float* __restrict__ g, long long n, float* __restrict__ acc) {
    __shared__ float red[32];
    float s = 0.f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        s = fmaf(g[i], g[i], s);
    s = block_sum(s, red);
    if (threadIdx.x == 0) atomicAdd(acc, s);
}

// AdamW over a flat range, with global-norm clipping read from the device (no host round trip):
//   norm = sqrt(sumsq[0]); c = (max_norm > 0 && norm > max_norm) ? max_norm / (norm + 1e-6) : 1; g *= c
//   m = b1 m + (1-b1) g ; v = b2 v + (1-b2) g^2 ; p = p * decay - step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps)
//   pb = bf16(p)  (the GEMM copy of the weights)
extern "C" __global__ void __launch_bounds__(256) adamw_clip_bf16(
    float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m, float* __restrict__ v,
    bf16* __restrict__ pb, long long n, const float* __restrict__ sumsq_acc, float max_norm, float b1, float b2,
    float decay, float step_size, float inv_sqrt_bc2, float eps) {
    const float norm = sqrtf(sumsq_acc[0]);
    const float c = (max_norm > 0.f && norm > max_norm && norm <= 3.0e38f) ? max_norm / (norm + 1e-6f) : 1.f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float gi = g[i] * c;
        const float mi = b1 * m[i] + (1.f - b1) * gi;
        const float vi = b2 * v[i] + (1.f - b2) * (gi * gi);
        m[i] = mi;
        v[i] = vi;
        const float pi = p[i] * decay - step_size * (mi / (sqrtf(vi) * inv_sqrt_bc2 + eps));
        p[i] = pi;
        pb[i] = f2bf(pi);
    }
}
