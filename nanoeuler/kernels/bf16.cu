// Kernels of the bf16 training-step engine (nanoeuler/kernels/engine.py).
//
// bf16 values are stored as raw 16-bit words (unsigned short), widened by a shift and narrowed by the
// hardware conversion in inline PTX (round to nearest even), so the file needs no CUDA header and
// compiles the same under NVRTC and nvcc. All arithmetic is float32; bf16 is only a storage format for
// GEMM operands and activations.
//
// References (NumPy, float64 in the self-test): nanoeuler.model.layers rmsnorm_*, rope_*, swiglu_*,
// cross_entropy_*, embedding_*; nanoeuler.optim.AdamW.step and clip_grad_norm.

typedef unsigned short bf16;

__device__ __forceinline__ float bf2f(bf16 h) { return __uint_as_float(((unsigned)h) << 16); }
// the low / high bf16 of a 32-bit word
__device__ __forceinline__ float lo_bf(unsigned w) { return bf2f((bf16)(w & 0xffffu)); }
__device__ __forceinline__ float hi_bf(unsigned w) { return bf2f((bf16)(w >> 16)); }
// The dot product of two vectors of 8 bf16 (16 bytes each), in float32.
__device__ __forceinline__ float dot_bf16x8(uint4 a, uint4 b) {
    return lo_bf(a.x) * lo_bf(b.x) + hi_bf(a.x) * hi_bf(b.x) + lo_bf(a.y) * lo_bf(b.y) + hi_bf(a.y) * hi_bf(b.y) +
           lo_bf(a.z) * lo_bf(b.z) + hi_bf(a.z) * hi_bf(b.z) + lo_bf(a.w) * lo_bf(b.w) + hi_bf(a.w) * hi_bf(b.w);
}
// Element g of a row read as 4-vectors, float32 or bf16 (kernels templated on an input's storage):
// ld4 = floats 4g .. 4g+3 (a 16- or 8-byte load), ld1 = float j.
__device__ __forceinline__ float4 ld4(const float* p, int g) { return reinterpret_cast<const float4*>(p)[g]; }
__device__ __forceinline__ float4 ld4(const bf16* p, int g) {
    const uint2 b = reinterpret_cast<const uint2*>(p)[g];
    return make_float4(lo_bf(b.x), hi_bf(b.x), lo_bf(b.y), hi_bf(b.y));
}
__device__ __forceinline__ float ld1(const float* p, long long j) { return p[j]; }
__device__ __forceinline__ float ld1(const bf16* p, long long j) { return bf2f(p[j]); }

// float -> bf16, round to nearest even (NaN stays NaN), by the hardware conversion (sm_80 and later):
// one instruction per value, or per pair in pack2 (lo in the low half), where the integer rounding
// sequence it replaces took six.
__device__ __forceinline__ bf16 f2bf(float f) {
    bf16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ unsigned ld32(const bf16* p) { return *reinterpret_cast<const unsigned*>(p); }

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

// Element e's factor of a gain-folded matrix of C columns (1 where gain is null): gain[e % C]. The
// engine keeps every folded matrix under 2^31 elements.
__device__ __forceinline__ float gain_at(const float* gain, int C, long long e) {
    return gain ? gain[(unsigned)e % (unsigned)C] : 1.f;
}
// The factors of elements e .. e+3 (e a multiple of 4).
__device__ __forceinline__ float4 gain_at4(const float* gain, int C, long long e) {
    if (!gain) return make_float4(1.f, 1.f, 1.f, 1.f);
    if ((C & 3) == 0) return reinterpret_cast<const float4*>(gain)[((unsigned)e % (unsigned)C) >> 2];
    return make_float4(gain_at(gain, C, e), gain_at(gain, C, e + 1), gain_at(gain, C, e + 2), gain_at(gain, C, e + 3));
}

// y = bf16(x * gain[i % C]): the GEMM image of a weight matrix with a norm gain folded in; gain null: y = bf16(x).
extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, bf16* __restrict__ y, long long n,
                                       const float* __restrict__ gain, int C) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = f2bf(x[i] * gain_at(gain, C, i));
}

// The embedding: a warp per row, 8 rows a block; 16-byte accesses when C % 4 == 0 (every tensor of the
// engine's buffers starts 256-byte aligned). (One thread per value, each dividing a 64-bit index by C,
// took 0.14 ms at B64xT512 for what is a 100 MB copy.)

// x (N, C) float32 = E[ids]; ids int32 (N,).
extern "C" __global__ void __launch_bounds__(256) embed_fwd(const int* __restrict__ ids, const float* __restrict__ E,
                                                            float* __restrict__ x, int C, int N) {
    const int r = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= N) return;
    const float* src = E + (long long)ids[r] * C;
    float* dst = x + (long long)r * C;
    if ((C & 3) == 0) {
        for (int j = lane; j < C / 4; j += 32)
            reinterpret_cast<float4*>(dst)[j] = reinterpret_cast<const float4*>(src)[j];
    } else {
        for (int j = lane; j < C; j += 32) dst[j] = src[j];
    }
}

// dE[ids[r]] += dx[r] (dE zeroed by the caller); on sm_90, 4 values per atomic (red.global.add.v4.f32).
extern "C" __global__ void __launch_bounds__(256) embed_bwd(const float* __restrict__ dx, const int* __restrict__ ids,
                                                            float* __restrict__ dE, int C, int N) {
    const int r = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= N) return;
    const float* src = dx + (long long)r * C;
    float* dst = dE + (long long)ids[r] * C;
    if ((C & 3) == 0) {
        for (int j = lane; j < C / 4; j += 32) {
            const float4 v = reinterpret_cast<const float4*>(src)[j];
#if __CUDA_ARCH__ >= 900
            asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n"
                         ::"l"(dst + 4 * j), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
#else
            atomicAdd(dst + 4 * j, v.x);
            atomicAdd(dst + 4 * j + 1, v.y);
            atomicAdd(dst + 4 * j + 2, v.z);
            atomicAdd(dst + 4 * j + 3, v.w);
#endif
        }
    } else {
        for (int j = lane; j < C; j += 32) atomicAdd(dst + j, src[j]);
    }
}

// ---- RMSNorm ---------------------------------------------------------------------------------------
//
// The engine folds each norm's gain into the weights of the GEMM that reads the norm's output: with
// xhat = x * rstd, the product (xhat * gain) W^T equals xhat (W * gain)^T, where W * gain scales column j
// of W by gain[j]. So the forward writes xhat alone (bf16), the GEMM reads it with the folded weights,
// the backward's GEMM through the same folded weights gives dL/dxhat directly, and the norm's backward
// needs only xhat and rstd: no float32 input, no branch, no gain. The gain's and the weights' own
// gradients come from the weight gradient of the folded product (gain_fold_grad, below).

// One warp per row, blocks of 4 warps:
//   xr = x + y + y2  (`nadd` = 0, 1 or 2 of the bf16 branches, added in that order: y and y2 are GEMM
//                     outputs, the branches that join the residual stream: a layer's input is the
//                     previous one's input plus its o_proj branch plus its down branch)
//   xout = xr        (float32, only with `store`: the residual stream carries on from there)
//   xhat = bf16(xr * rstd),  rstd = 1/sqrt(mean(xr^2) + eps)
// The residual GEMMs (o_proj, down) write their branch as bf16 and this kernel adds it in, because
// cuBLAS took about twice as long to read and write the float32 stream itself (beta = 1) as to write
// a bf16 output; the rounding is the one PyTorch's autocast makes there too. When C is a multiple of 4
// and at most 32 * 4 * RMS_V4, the row stays in registers (16-byte loads, RMS_V4 per lane at most);
// otherwise a scalar path reads it twice. xout may not alias x.
#define RMS_V4 8
extern "C" __global__ void __launch_bounds__(128) rmsnorm_fwd_bf16(
    const float* __restrict__ x, const bf16* __restrict__ y, const bf16* __restrict__ y2, bf16* __restrict__ xhat,
    float* __restrict__ rstd, float* __restrict__ xout, int N, int C, float eps, int nadd, int store) {
    const int row = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return;
    const long long off = (long long)row * C;
    if ((C & 3) == 0 && C <= 128 * RMS_V4) {
        const int C4 = C >> 2;
        float4 v[RMS_V4];
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < RMS_V4; ++j) {
            const int g = lane + 32 * j;
            if (g < C4) {
                v[j] = ld4(x + off, g);
                if (nadd > 0) {
                    const float4 b = ld4(y + off, g);
                    v[j].x += b.x, v[j].y += b.y, v[j].z += b.z, v[j].w += b.w;
                }
                if (nadd > 1) {
                    const float4 b = ld4(y2 + off, g);
                    v[j].x += b.x, v[j].y += b.y, v[j].z += b.z, v[j].w += b.w;
                }
                ss = fmaf(v[j].x, v[j].x, fmaf(v[j].y, v[j].y, fmaf(v[j].z, v[j].z, fmaf(v[j].w, v[j].w, ss))));
            }
        }
        const float r = 1.f / sqrtf(warp_sum(ss) / (float)C + eps);
#pragma unroll
        for (int j = 0; j < RMS_V4; ++j) {
            const int g = lane + 32 * j;
            if (g < C4) {
                if (store) reinterpret_cast<float4*>(xout + off)[g] = v[j];
                reinterpret_cast<uint2*>(xhat + off)[g] = make_uint2(pack2(v[j].x * r, v[j].y * r),
                                                                     pack2(v[j].z * r, v[j].w * r));
            }
        }
        if (lane == 0 && rstd) rstd[row] = r;
        return;
    }
    auto xr = [&](int j) {
        float v = x[off + j];
        if (nadd > 0) v += bf2f(y[off + j]);
        if (nadd > 1) v += bf2f(y2[off + j]);
        return v;
    };
    float ss = 0.f;
    for (int j = lane; j < C; j += 32) {
        const float v = xr(j);
        ss = fmaf(v, v, ss);
    }
    const float r = 1.f / sqrtf(warp_sum(ss) / (float)C + eps);
    for (int j = lane; j < C; j += 32) {
        const float v = xr(j);
        if (store) xout[off + j] = v;
        xhat[off + j] = f2bf(v * r);
    }
    if (lane == 0 && rstd) rstd[row] = r;
}

// Backward of xhat = x * rstd, one warp per row, 8 rows per block of 8 warps:
//   dx = (accumulate ? dx : 0) + rstd * (g - xhat * mean(g * xhat)),  dxb = bf16(dx)  (the next GEMM's operand)
// g = dL/dxhat is the output of the GEMM that read xhat through the gain-folded weights: bf16 for the
// layers' norms (rmsnorm_bwd_bf16), float32 for the final norm, whose g the output heads sum
// (rmsnorm_bwd_bf16_f32dy). xhat is the forward's bf16 output. When C is a multiple of 4 and at most
// 32 * 4 * RB_VEC the row stays in registers (16-byte loads of g and dx, 8-byte of xhat); otherwise a
// scalar path reads it twice.
#define RB_VEC 8
template <typename DY>
__device__ __forceinline__ void rmsnorm_bwd_impl(const DY* __restrict__ g, const bf16* __restrict__ xhat,
                                                 const float* __restrict__ rstd, float* __restrict__ dx,
                                                 bf16* __restrict__ dxb, int N, int C, int accumulate) {
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return;
    const long long off = (long long)row * C;
    const float rs = rstd[row];
    if ((C & 3) == 0 && C <= 128 * RB_VEC) {
        const int C4 = C >> 2;
        float4 gv[RB_VEC], hv[RB_VEC], prev[RB_VEC];
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < RB_VEC; ++i) {
            const int c = lane + 32 * i;
            if (c < C4) {
                gv[i] = ld4(g + off, c);
                hv[i] = ld4(xhat + off, c);
                prev[i] = accumulate ? ld4(dx + off, c) : make_float4(0.f, 0.f, 0.f, 0.f);
                dot = fmaf(gv[i].x, hv[i].x, fmaf(gv[i].y, hv[i].y, fmaf(gv[i].z, hv[i].z, fmaf(gv[i].w, hv[i].w, dot))));
            }
        }
        const float sm = rs * warp_sum(dot) / (float)C;
#pragma unroll
        for (int i = 0; i < RB_VEC; ++i) {
            const int c = lane + 32 * i;
            if (c < C4) {
                float4 o;
                o.x = prev[i].x + (rs * gv[i].x - sm * hv[i].x);
                o.y = prev[i].y + (rs * gv[i].y - sm * hv[i].y);
                o.z = prev[i].z + (rs * gv[i].z - sm * hv[i].z);
                o.w = prev[i].w + (rs * gv[i].w - sm * hv[i].w);
                reinterpret_cast<float4*>(dx + off)[c] = o;
                reinterpret_cast<uint2*>(dxb + off)[c] = make_uint2(pack2(o.x, o.y), pack2(o.z, o.w));
            }
        }
        return;
    }
    float dot = 0.f;
    for (int j = lane; j < C; j += 32) dot = fmaf(ld1(g, off + j), bf2f(xhat[off + j]), dot);
    const float sm = rs * warp_sum(dot) / (float)C;
    for (int j = lane; j < C; j += 32) {
        float d = rs * ld1(g, off + j) - sm * bf2f(xhat[off + j]);
        if (accumulate) d += dx[off + j];
        dx[off + j] = d;
        dxb[off + j] = f2bf(d);
    }
}
#define RMSNORM_BWD(NAME, DY)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) NAME(const DY* g, const bf16* xhat, const float* rstd,  \
                                                           float* dx, bf16* dxb, int N, int C, int accumulate) { \
        rmsnorm_bwd_impl<DY>(g, xhat, rstd, dx, dxb, N, C, accumulate);                                      \
    }
RMSNORM_BWD(rmsnorm_bwd_bf16, bf16)
RMSNORM_BWD(rmsnorm_bwd_bf16_f32dy, float)

// The gradients of a weight matrix W (R, C) read by a GEMM with a norm's gain folded in (W' = W * gain,
// column j scaled by gain[j]), from that GEMM's float32 weight gradient dW' = dy^T xhat, held in G:
//   G = dW = dW' * gain                                   (in place)
//   part[s, j] = sum over the rows of split s of W * dW'   (column_sums of part = the gain's gradient)
//   acc[0] += sum of dW^2                                 (these tensors' share of the gradient norm)
// Block of 8 warps: a warp's lanes take FOLD_COLS adjacent columns (4 per lane, 16-byte accesses, when C
// is a multiple of 4; else 1 per lane), the warps every 8th row of the split's `rows` rows; grid
// (ceil(C / FOLD_COLS), splits). The gain's gradient is summed in a fixed order (no atomics).
extern "C" __global__ void __launch_bounds__(256) gain_fold_grad(
    const float* __restrict__ W, float* __restrict__ G, const float* __restrict__ gain, float* __restrict__ part,
    int R, int C, int rows, float* __restrict__ acc) {
    __shared__ float4 cols[8][32];
    __shared__ float red[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = blockIdx.y * rows, r1 = min(R, r0 + rows);
    const bool v4 = (C & 3) == 0;
    const int j = blockIdx.x * (v4 ? 128 : 32) + (v4 ? 4 : 1) * lane;  // this lane's first column
    float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
    float sq = 0.f;
    if (v4 && j < C) {
        const float4 s = reinterpret_cast<const float4*>(gain)[j >> 2];
#pragma unroll 4
        for (int r = r0 + warp; r < r1; r += 8) {
            const long long o = ((long long)r * C + j) >> 2;
            const float4 d = reinterpret_cast<const float4*>(G)[o], w = reinterpret_cast<const float4*>(W)[o];
            t.x = fmaf(w.x, d.x, t.x), t.y = fmaf(w.y, d.y, t.y), t.z = fmaf(w.z, d.z, t.z), t.w = fmaf(w.w, d.w, t.w);
            const float4 dw = make_float4(d.x * s.x, d.y * s.y, d.z * s.z, d.w * s.w);
            reinterpret_cast<float4*>(G)[o] = dw;
            sq = fmaf(dw.x, dw.x, fmaf(dw.y, dw.y, fmaf(dw.z, dw.z, fmaf(dw.w, dw.w, sq))));
        }
    } else if (!v4 && j < C) {
        const float s = gain[j];
#pragma unroll 4
        for (int r = r0 + warp; r < r1; r += 8) {
            const long long o = (long long)r * C + j;
            const float d = G[o];
            t.x = fmaf(W[o], d, t.x);
            const float dw = d * s;
            G[o] = dw;
            sq = fmaf(dw, dw, sq);
        }
    }
    cols[warp][lane] = t;
    sq = block_sum(sq, red);  // ends in a barrier after cols is written
    if (warp == 0 && j < C) {
        float4 u = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int k = 0; k < 8; ++k) u.x += cols[k][lane].x, u.y += cols[k][lane].y, u.z += cols[k][lane].z, u.w += cols[k][lane].w;
        float* out = part + (long long)blockIdx.y * C + j;
        out[0] = u.x;
        if (v4) out[1] = u.y, out[2] = u.z, out[3] = u.w;
    }
    if (threadIdx.x == 0) atomicAdd(acc, sq);
}

// out[j] = sum over p < nparts of part[p, j] (overwrites), in a fixed order. Block (32, 32): x over 32
// columns, y over the parts (strided), then the 32 partial sums of a column added in shared memory.
// Grid x: ceil(C / 32).
extern "C" __global__ void __launch_bounds__(1024) column_sums(
    const float* __restrict__ part, float* __restrict__ out, int nparts, int C) {
    __shared__ float s[32][33];
    const int j = blockIdx.x * 32 + threadIdx.x;
    float t = 0.f;
    if (j < C) {
#pragma unroll 4
        for (int p = threadIdx.y; p < nparts; p += 32) t += part[(long long)p * C + j];
    }
    s[threadIdx.y][threadIdx.x] = t;
    __syncthreads();
    if (threadIdx.y == 0 && j < C) {
        float u = 0.f;
#pragma unroll
        for (int k = 0; k < 32; ++k) u += s[k][threadIdx.x];
        out[j] = u;
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

// ---- SwiGLU ----------------------------------------------------------------------------------------

// sigmoid by the fast exponential and division (a few float32 ulps; every result is stored as bf16). The
// forward, the backward and the fused backward all compute m = silu(gate) * up by these same operations,
// so the m that the backward recomputes is the forward's, bit for bit.
__device__ __forceinline__ float sigmoid_f(float g) { return __fdividef(1.f, 1.f + __expf(-g)); }
__device__ __forceinline__ float silu_f(float g) { return g * sigmoid_f(g); }

// SwiGLU kernels: grid x over groups of VEC columns (VEC = 8 when F % 8 == 0: 16-byte accesses; else 2,
// with a scalar path for odd F), grid y over rows (grid-stride). The host computes the same VEC.

// gu (N, 2F) bf16 = [gate | up] -> m (N, F) bf16 = silu(gate) * up.
extern "C" __global__ void swiglu_fwd_bf16(const bf16* __restrict__ gu, bf16* __restrict__ m, int F, int N) {
    const int vec = (F & 7) == 0 ? 8 : 2;
    const int j = vec * (blockIdx.x * blockDim.x + threadIdx.x);
    if (j >= F) return;
    for (int r = blockIdx.y; r < N; r += gridDim.y) {
        const bf16* gr = gu + (long long)r * 2 * F;
        bf16* mr = m + (long long)r * F;
        if (vec == 8) {
            const uint4 g4 = *reinterpret_cast<const uint4*>(gr + j), u4 = *reinterpret_cast<const uint4*>(gr + F + j);
            const unsigned gw[4] = {g4.x, g4.y, g4.z, g4.w}, uw[4] = {u4.x, u4.y, u4.z, u4.w};
            unsigned ow[4];
#pragma unroll
            for (int e = 0; e < 4; ++e)
                ow[e] = pack2(silu_f(lo_bf(gw[e])) * lo_bf(uw[e]), silu_f(hi_bf(gw[e])) * hi_bf(uw[e]));
            *reinterpret_cast<uint4*>(mr + j) = make_uint4(ow[0], ow[1], ow[2], ow[3]);
        } else if ((F & 1) == 0) {
            const unsigned g2 = ld32(gr + j), u2 = ld32(gr + F + j);
            *reinterpret_cast<unsigned*>(mr + j) = pack2(silu_f(lo_bf(g2)) * lo_bf(u2), silu_f(hi_bf(g2)) * hi_bf(u2));
        } else {
            for (int jj = j; jj < min(j + 2, F); ++jj) mr[jj] = f2bf(silu_f(bf2f(gr[jj])) * bf2f(gr[F + jj]));
        }
    }
}

// dm (N, F) bf16, gu (N, 2F) bf16 -> dgu (N, 2F) bf16 = [dgate | dup], and m (N, F) = silu(gate) * up again
// (bit-identical to the forward's, for the down projection's weight gradient): the backward recomputes m
// instead of keeping it, and doing it here saves a second read of gu. Same grid as the forward.
__device__ __forceinline__ void swiglu_grad(float d, float g, float u, float& dg, float& du) {
    const float s = sigmoid_f(g);
    dg = d * u * s * (1.f + g * (1.f - s));
    du = d * g * s;
}

extern "C" __global__ void swiglu_bwd_bf16(const bf16* __restrict__ dm, const bf16* __restrict__ gu,
                                           bf16* __restrict__ dgu, bf16* __restrict__ m, int F, int N) {
    const int vec = (F & 7) == 0 ? 8 : 2;
    const int j = vec * (blockIdx.x * blockDim.x + threadIdx.x);
    if (j >= F) return;
    for (int r = blockIdx.y; r < N; r += gridDim.y) {
        const bf16* gr = gu + (long long)r * 2 * F;
        const bf16* dr = dm + (long long)r * F;
        bf16* out = dgu + (long long)r * 2 * F;
        bf16* mr = m + (long long)r * F;
        if (vec == 8) {
            const uint4 g4 = *reinterpret_cast<const uint4*>(gr + j), u4 = *reinterpret_cast<const uint4*>(gr + F + j);
            const uint4 d4 = *reinterpret_cast<const uint4*>(dr + j);
            const unsigned gw[4] = {g4.x, g4.y, g4.z, g4.w}, uw[4] = {u4.x, u4.y, u4.z, u4.w};
            const unsigned dw[4] = {d4.x, d4.y, d4.z, d4.w};
            unsigned og[4], ou[4], om[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float dg0, du0, dg1, du1;
                swiglu_grad(lo_bf(dw[e]), lo_bf(gw[e]), lo_bf(uw[e]), dg0, du0);
                swiglu_grad(hi_bf(dw[e]), hi_bf(gw[e]), hi_bf(uw[e]), dg1, du1);
                og[e] = pack2(dg0, dg1);
                ou[e] = pack2(du0, du1);
                om[e] = pack2(silu_f(lo_bf(gw[e])) * lo_bf(uw[e]), silu_f(hi_bf(gw[e])) * hi_bf(uw[e]));
            }
            *reinterpret_cast<uint4*>(out + j) = make_uint4(og[0], og[1], og[2], og[3]);
            *reinterpret_cast<uint4*>(out + F + j) = make_uint4(ou[0], ou[1], ou[2], ou[3]);
            *reinterpret_cast<uint4*>(mr + j) = make_uint4(om[0], om[1], om[2], om[3]);
        } else if ((F & 1) == 0) {
            const unsigned g2 = ld32(gr + j), u2 = ld32(gr + F + j), d2 = ld32(dr + j);
            float dg0, du0, dg1, du1;
            swiglu_grad(lo_bf(d2), lo_bf(g2), lo_bf(u2), dg0, du0);
            swiglu_grad(hi_bf(d2), hi_bf(g2), hi_bf(u2), dg1, du1);
            *reinterpret_cast<unsigned*>(out + j) = pack2(dg0, dg1);
            *reinterpret_cast<unsigned*>(out + F + j) = pack2(du0, du1);
            *reinterpret_cast<unsigned*>(mr + j) = pack2(silu_f(lo_bf(g2)) * lo_bf(u2), silu_f(hi_bf(g2)) * hi_bf(u2));
        } else {
            for (int jj = j; jj < min(j + 2, F); ++jj) {
                float dg, du;
                swiglu_grad(bf2f(dr[jj]), bf2f(gr[jj]), bf2f(gr[F + jj]), dg, du);
                out[jj] = f2bf(dg);
                out[F + jj] = f2bf(du);
                mr[jj] = f2bf(silu_f(bf2f(gr[jj])) * bf2f(gr[F + jj]));
            }
        }
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

// Head k's logits (R, V) bf16 for rows r0 .. r0+R-1 (targets and loss start at row r0), overwritten in
// place by their gradient; grid (R,), blockDim 256.
//   loss[r, k] = lse - z[t]            (0 for ignored rows)
//   z[r, j] <- scale[k] * (softmax_j - [j == t])   bf16 (0 for ignored rows)
// The logits are bf16 as autocast's linear layers give them; max, sum and lse are float32. When V is a
// multiple of 4 and at most 4 * 256 * CE_V4 (4096 values: 16 a thread), the row is read once into
// registers (8-byte loads), its exponentials kept there for the gradient, and written once. Otherwise
// three passes over the row (max, sum, gradient; the later two mostly hit L1), 4 values at a time when
// V % 4 == 0, with scalar tail loops. In place is safe: each value is read and then written by the same
// thread, and z[t] is read before any write (barriers in between).
#define CE_V4 4
extern "C" __global__ void __launch_bounds__(256) ce_heads_fwd_bwd(
    bf16* __restrict__ z, const int* __restrict__ targets, const float* __restrict__ scale,
    float* __restrict__ loss, int V, int K, int k) {
    __shared__ float red[32];
    const long long r = blockIdx.x;
    bf16* zr = z + r * V;
    uint2* z4 = reinterpret_cast<uint2*>(zr);  // the gradient's 4-value stores
    const int V4 = (V & 3) == 0 ? V / 4 : 0, tail = 4 * V4;
    const int t = targets[r * K + k];
    if (t < 0) {
        for (int j = threadIdx.x; j < V4; j += blockDim.x) z4[j] = make_uint2(0u, 0u);
        for (int j = tail + threadIdx.x; j < V; j += blockDim.x) zr[j] = 0;
        if (threadIdx.x == 0) loss[r * K + k] = 0.f;
        return;
    }
    const float zt = ld1(zr, t);
    const float sc = scale[k];
    if (V4 && V4 <= 256 * CE_V4) {
        const float NEG = __int_as_float(0xff800000);
        float4 e[CE_V4];
        float mx = NEG;
#pragma unroll
        for (int i = 0; i < CE_V4; ++i) {
            const int j = threadIdx.x + 256 * i;
            e[i] = j < V4 ? ld4(zr, j) : make_float4(NEG, NEG, NEG, NEG);
            mx = fmaxf(mx, fmaxf(fmaxf(e[i].x, e[i].y), fmaxf(e[i].z, e[i].w)));
        }
        mx = block_max(mx, red);
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < CE_V4; ++i) {  // exp(-inf - mx) = 0 for the padding
            e[i] = make_float4(expf(e[i].x - mx), expf(e[i].y - mx), expf(e[i].z - mx), expf(e[i].w - mx));
            s += (e[i].x + e[i].y) + (e[i].z + e[i].w);
        }
        s = block_sum(s, red);
        const float inv = sc / s;
#pragma unroll
        for (int i = 0; i < CE_V4; ++i) {
            const int j = threadIdx.x + 256 * i;
            if (j < V4) {
                const int j0 = 4 * j;
                z4[j] = make_uint2(pack2(e[i].x * inv - (j0 == t ? sc : 0.f), e[i].y * inv - (j0 + 1 == t ? sc : 0.f)),
                                   pack2(e[i].z * inv - (j0 + 2 == t ? sc : 0.f), e[i].w * inv - (j0 + 3 == t ? sc : 0.f)));
            }
        }
        if (threadIdx.x == 0) loss[r * K + k] = mx + logf(s) - zt;
        return;
    }
    float mx = __int_as_float(0xff800000);
    for (int j = threadIdx.x; j < V4; j += blockDim.x) {
        const float4 a = ld4(zr, j);
        mx = fmaxf(mx, fmaxf(fmaxf(a.x, a.y), fmaxf(a.z, a.w)));
    }
    for (int j = tail + threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, ld1(zr, j));
    mx = block_max(mx, red);
    float s = 0.f;
    for (int j = threadIdx.x; j < V4; j += blockDim.x) {
        const float4 a = ld4(zr, j);
        s += (expf(a.x - mx) + expf(a.y - mx)) + (expf(a.z - mx) + expf(a.w - mx));
    }
    for (int j = tail + threadIdx.x; j < V; j += blockDim.x) s += expf(ld1(zr, j) - mx);
    s = block_sum(s, red);
    const float lse = mx + logf(s);
    for (int j = threadIdx.x; j < V4; j += blockDim.x) {
        const float4 a = ld4(zr, j);
        const int j0 = 4 * j;
        z4[j] = make_uint2(
            pack2(sc * (expf(a.x - lse) - (j0 == t ? 1.f : 0.f)), sc * (expf(a.y - lse) - (j0 + 1 == t ? 1.f : 0.f))),
            pack2(sc * (expf(a.z - lse) - (j0 + 2 == t ? 1.f : 0.f)), sc * (expf(a.w - lse) - (j0 + 3 == t ? 1.f : 0.f))));
    }
    for (int j = tail + threadIdx.x; j < V; j += blockDim.x) zr[j] = f2bf(sc * (expf(ld1(zr, j) - lse) - (j == t ? 1.f : 0.f)));
    if (threadIdx.x == 0) loss[r * K + k] = lse - zt;
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
//   The values that change from step to step are read from the device, hyper = (step_size, inv_sqrt_bc2,
//   the decay factor of decayed ranges), so that a captured CUDA graph of the step stays valid; decay is
//   that factor where `decayed`, else 1.
//   pb = bf16(p * gain[i % C])  (the GEMM image of the weights; gain null: bf16(p)). A range with a gain
//        is one matrix of C columns that a GEMM reads with that norm gain folded in; the engine updates
//        the gains first, so the image holds the new weights times the new gain.
// Four elements per thread with 16-byte accesses (8-byte for pb): the engine's ranges start 64-element
// aligned; a range whose length is not a multiple of 4 ends in a scalar tail.
struct AdamWArgs {
    float c, b1, b2, decay, step_size, inv_sqrt_bc2, eps;
};

__device__ __forceinline__ float adamw_one(float& p, float g, float& m, float& v, const AdamWArgs& a) {
    g *= a.c;
    m = a.b1 * m + (1.f - a.b1) * g;
    v = a.b2 * v + (1.f - a.b2) * (g * g);
    p = p * a.decay - a.step_size * (m / (sqrtf(v) * a.inv_sqrt_bc2 + a.eps));
    return p;
}

extern "C" __global__ void __launch_bounds__(256) adamw_clip_bf16(
    float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m, float* __restrict__ v,
    bf16* __restrict__ pb, long long n, const float* __restrict__ sumsq_acc, const float* __restrict__ hyper,
    int decayed, float max_norm, float b1, float b2, float eps, const float* __restrict__ gain, int C) {
    const float norm = sqrtf(sumsq_acc[0]);
    const float c = (max_norm > 0.f && norm > max_norm && norm <= 3.0e38f) ? max_norm / (norm + 1e-6f) : 1.f;
    const AdamWArgs a = {c, b1, b2, decayed ? hyper[2] : 1.f, hyper[0], hyper[1], eps};
    const long long n4 = n >> 2, stride = (long long)gridDim.x * blockDim.x;
    float4* p4 = reinterpret_cast<float4*>(p);
    float4* m4 = reinterpret_cast<float4*>(m);
    float4* v4 = reinterpret_cast<float4*>(v);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
        float4 pv = p4[i], mv = m4[i], vv = v4[i];
        const float4 gv = reinterpret_cast<const float4*>(g)[i];
        const float4 s = gain_at4(gain, C, 4 * i);
        const float x = adamw_one(pv.x, gv.x, mv.x, vv.x, a), y = adamw_one(pv.y, gv.y, mv.y, vv.y, a);
        const float z = adamw_one(pv.z, gv.z, mv.z, vv.z, a), w = adamw_one(pv.w, gv.w, mv.w, vv.w, a);
        p4[i] = pv;
        m4[i] = mv;
        v4[i] = vv;
        reinterpret_cast<uint2*>(pb)[i] = make_uint2(pack2(x * s.x, y * s.y), pack2(z * s.z, w * s.w));
    }
    for (long long i = 4 * n4 + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        pb[i] = f2bf(adamw_one(p[i], g[i], m[i], v[i], a) * gain_at(gain, C, i));
}

// ---- tensor-core FlashAttention (bf16 operands, float32 accumulation) --------------------------------
//
// Causal GQA attention for head size D (32 or 64) with mma.sync m16n8k16 (bf16 in, float32 out).
// Layouts: q (B,H,T,D), k/v (B,Hkv,T,D) bf16; O and dO in the o_proj operand layout (N, H*D) bf16 with
// row n = b*T + t; lse/delta (B,H,T) float32. The backward writes dq, dk (rotation undone) and dv as bf16
// straight into the qkv GEMM's gradient operand dqkv (N, (H+2Hkv)*D) and needs the RoPE tables for it.
// Reference: nanoeuler.model.layers.attention_forward / attention_backward (S == T).
//
// Grids: x over (batch, head) pairs, y over the 64-row tiles, ordered so that the blocks with the most
// work (the last query tiles; in dkdv the first key tiles) have the lowest y. The hardware starts
// blocks in order of x, then y, so the longest start first and the short ones fill the tail: with the
// tiles on x instead, long blocks of the last heads started last, and the multiprocessors sat idle
// 10-17% of each kernel's time (ncu: SM active cycles against elapsed cycles).
// Every block has 4 warps and owns 64 rows (queries, or keys in dkdv); each warp owns 16 of them and
// keeps its operand fragments in registers. Tiles of the other side (64 rows) pass through shared
// memory, once row-major (for products over d) and, where a product runs over the tile's rows, once
// transposed. Rows are padded by 8 bf16 so the fragment loads hit 32 distinct banks.
// mma fragment layout (PTX m16n8k16, g = lane/4, c = lane%4): A regs (row g | g+8) x (cols 2c,2c+1 |
// 2c+8,2c+9); B regs (k rows 2c,2c+1 | 2c+8,2c+9) x (col g); C (row g | g+8) x (cols 2c, 2c+1).
// Softmax runs in base 2: s2 = s * scale * log2(e); lse is stored in natural units.

#define FA_BR 64
// The backward kernels take the other side's 64-row tile in passes of FA_*_PASS columns (64 or 32),
// under launch bounds of FA_*_BLOCKS blocks per multiprocessor. S and dP of one pass live in
// registers: passes of 32 halve them, which lets the dq kernel run 4 blocks (16 warps) per
// multiprocessor instead of 3; dq is bound by latency, not arithmetic (ncu: issue slots 45% busy), and
// runs 8-10% faster so. The dk/dv kernel gained nothing from it (2 -> 3 blocks, at the price of a
// small spill) and keeps whole tiles. The -D options of NVRTC override these (bench sweeps).
#ifndef FA_DQ_PASS
#define FA_DQ_PASS 32
#endif
#ifndef FA_DQ_BLOCKS
#define FA_DQ_BLOCKS 4
#endif
#ifndef FA_DKDV_PASS
#define FA_DKDV_PASS 64
#endif
#ifndef FA_DKDV_BLOCKS
#define FA_DKDV_BLOCKS 1
#endif
// Column (within a 64-wide tile) of C-fragment element e of n-tile n held by a thread of quad column c.
__device__ __forceinline__ int qi_of(int n, int e, int c) { return n * 8 + 2 * c + (e & 1); }
#define FA_PAD 8
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

// 2^x in one instruction (MUFU.EX2). exp2f without fast-math wraps the same instruction in a
// denormal-range fix-up (a compare and two conditional multiplies per value); softmax weights below
// 2^-126 count as 0 either way, so the attention kernels skip the fix-up. -inf gives 0.
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}


__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(a) : "l"(p));
    return a;
}

// With LDM, B fragments come from shared memory through ldmatrix (x4: two n-tiles per instruction):
// ldsm_b reads a row-major [n][k] tile as is, ldsm_bt reads a row-major [k][n] tile transposed, so no
// transposed copy of a tile is ever stored. b[0], b[1] = (b0, b1) of n-tile n; b[2], b[3] of n-tile n+1.
template <int LD>
__device__ __forceinline__ void ldsm_b(unsigned (&b)[4], const bf16 (*tile)[LD], int n, int kc, int lane) {
    const int i = lane >> 3, r = lane & 7;
    const unsigned a = smem_u32(&tile[(n + (i >> 1)) * 8 + r][kc * 16 + (i & 1) * 8]);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(a));
}

template <int LD>
__device__ __forceinline__ void ldsm_bt(unsigned (&b)[4], const bf16 (*tile)[LD], int n, int kk, int lane) {
    const int i = lane >> 3, r = lane & 7;
    const unsigned a = smem_u32(&tile[kk * 16 + (i & 1) * 8 + r][(n + (i >> 1)) * 8]);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(a));
}

// A fragments of 16 rows x D from a row-major bf16 matrix (row stride ld elements); rows >= rmax read 0.
template <int D>
__device__ __forceinline__ void load_a_frags(unsigned (&a)[D / 16][4], const bf16* base, long long ld, int r0,
                                             int rmax, int g, int c) {
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
        const int col = kc * 16 + 2 * c;
        const bool okA = r0 + g < rmax, okB = r0 + g + 8 < rmax;
        const bf16* pa = base + (long long)(r0 + g) * ld + col;
        const bf16* pb = base + (long long)(r0 + g + 8) * ld + col;
        a[kc][0] = okA ? ld32(pa) : 0u;
        a[kc][1] = okB ? ld32(pb) : 0u;
        a[kc][2] = okA ? ld32(pa + 8) : 0u;
        a[kc][3] = okB ? ld32(pb + 8) : 0u;
    }
}

// Copies a 64-row tile (rows r0.., row stride ld) into shared memory, row-major (rm, may be null) and/or
// transposed (tr, may be null); rows >= rmax become zeros. 128 threads, 16-byte loads.
template <int D>
__device__ __forceinline__ void load_tile(bf16 (*rm)[D + FA_PAD], bf16 (*tr)[FA_BR + FA_PAD], const bf16* base,
                                          long long ld, int r0, int rmax) {
    for (int i = threadIdx.x; i < FA_BR * D / 8; i += blockDim.x) {
        const int row = i / (D / 8), c8 = (i % (D / 8)) * 8;
        uint4 val = make_uint4(0u, 0u, 0u, 0u);
        if (r0 + row < rmax) val = *reinterpret_cast<const uint4*>(base + (long long)(r0 + row) * ld + c8);
        if (rm) *reinterpret_cast<uint4*>(&rm[row][c8]) = val;
        if (tr) {
            const bf16* e = reinterpret_cast<const bf16*>(&val);
#pragma unroll
            for (int j = 0; j < 8; ++j) tr[c8 + j][row] = e[j];
        }
    }
}

// cp.async tile copy (the ldmatrix kernels keep tiles row-major, so a tile is a plain 16-byte copy and
// the next tile can stream in while the current one is used: two stages).
template <int D>
__device__ __forceinline__ void cp_tile(bf16 (*dst)[D + FA_PAD], const bf16* base, long long ld, int r0, int rmax) {
    for (int i = threadIdx.x; i < FA_BR * D / 8; i += blockDim.x) {
        const int row = i / (D / 8), c8 = (i % (D / 8)) * 8;
        if (r0 + row < rmax) {
            const unsigned sa = smem_u32(&dst[row][c8]);
            const bf16* src = base + (long long)(r0 + row) * ld + c8;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(src));
        } else {
            *reinterpret_cast<uint4*>(&dst[row][c8]) = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}
__device__ __forceinline__ void cp_f32(float* dst, const float* src) {  // one float, by cp.async
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(dst)), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// A warp's 16 rows x D of float32 accumulators (C fragments; rows tA = t0 + g and tB = t0 + g + 8 of
// sequence b) times `scale`, written as bf16 into columns col0 .. col0 + D - 1 of the dqkv rows b*T + t
// (row length W). With `rot` the half-split rotation is undone first (the gradient of q or k):
// dx1 = dy1 cos + dy2 sin, dx2 = dy2 cos - dy1 sin for the pair (i, i + D/2); a thread holds both
// halves of its pairs (n-tiles n and n + D/16), so this needs no exchange.
template <int D>
__device__ __forceinline__ void store_dqkv_rows(const float (&acc)[D / 8][4], bf16* __restrict__ dqkv, long long W,
                                                int b, int T, int t0, int col0, float scale, bool rot,
                                                const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                                int g, int c) {
    constexpr int NT = D / 8, HALF = D / 2;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int t = t0 + g + 8 * hr;
        if (t >= T) continue;
        bf16* out = dqkv + ((long long)b * T + t) * W + col0;
#pragma unroll
        for (int n = 0; n < NT / 2; ++n) {
            const int i = n * 8 + 2 * c;
            float y1a = acc[n][2 * hr] * scale, y1b = acc[n][2 * hr + 1] * scale;
            float y2a = acc[n + NT / 2][2 * hr] * scale, y2b = acc[n + NT / 2][2 * hr + 1] * scale;
            if (rot) {
                const float2 cs = *reinterpret_cast<const float2*>(cos_t + t * HALF + i);
                const float2 sn = *reinterpret_cast<const float2*>(sin_t + t * HALF + i);
                const float x1a = y1a * cs.x + y2a * sn.x, x2a = y2a * cs.x - y1a * sn.x;
                const float x1b = y1b * cs.y + y2b * sn.y, x2b = y2b * cs.y - y1b * sn.y;
                y1a = x1a; y2a = x2a; y1b = x1b; y2b = x2b;
            }
            *reinterpret_cast<unsigned*>(out + i) = pack2(y1a, y1b);
            *reinterpret_cast<unsigned*>(out + i + HALF) = pack2(y2a, y2b);
        }
    }
}

// S (16 rows x NC columns of the other side) += A (16 x D, fragments) * tile^T (tile row-major [NC][D];
// NC = 64, a whole tile, or 32, half of one: pass the tile's row pointer at the half's first row).
template <int D, bool LDM, int NC = FA_BR>
__device__ __forceinline__ void mma_rows_tile(float (&s)[NC / 8][4], const unsigned (&a)[D / 16][4],
                                              const bf16 (*tile)[D + FA_PAD], int g, int c, int lane) {
    if constexpr (LDM) {
#pragma unroll
        for (int n = 0; n < NC / 8; n += 2) {
#pragma unroll
            for (int kc = 0; kc < D / 16; ++kc) {
                unsigned bb[4];
                ldsm_b<D + FA_PAD>(bb, tile, n, kc, lane);
                mma16816(s[n], a[kc], bb[0], bb[1]);
                mma16816(s[n + 1], a[kc], bb[2], bb[3]);
            }
        }
    } else {
#pragma unroll
        for (int n = 0; n < NC / 8; ++n) {
#pragma unroll
            for (int kc = 0; kc < D / 16; ++kc)
                mma16816(s[n], a[kc], ld32(&tile[n * 8 + g][kc * 16 + 2 * c]), ld32(&tile[n * 8 + g][kc * 16 + 2 * c + 8]));
        }
    }
}

// acc (16 x D) += P (16 x NC, from float accumulators, rounded to bf16) * V, V an NC x D tile: row-major
// [NC][D] (LDM, read transposed by ldmatrix; the row pointer at the tile's first row) or already
// transposed [D][64] (vt, from column k0).
template <int D, bool LDM, int NC = FA_BR>
__device__ __forceinline__ void mma_p_tile(float (&acc)[D / 8][4], const float (&p)[NC / 8][4],
                                           const bf16 (*tile)[D + FA_PAD], const bf16 (*vt)[FA_BR + FA_PAD], int k0,
                                           int g, int c, int lane) {
#pragma unroll
    for (int kk = 0; kk < NC / 16; ++kk) {
        const unsigned pa[4] = {pack2(p[2 * kk][0], p[2 * kk][1]), pack2(p[2 * kk][2], p[2 * kk][3]),
                                pack2(p[2 * kk + 1][0], p[2 * kk + 1][1]), pack2(p[2 * kk + 1][2], p[2 * kk + 1][3])};
        if constexpr (LDM) {
#pragma unroll
            for (int n = 0; n < D / 8; n += 2) {
                unsigned bb[4];
                ldsm_bt<D + FA_PAD>(bb, tile, n, kk, lane);
                mma16816(acc[n], pa, bb[0], bb[1]);
                mma16816(acc[n + 1], pa, bb[2], bb[3]);
            }
        } else {
#pragma unroll
            for (int n = 0; n < D / 8; ++n)
                mma16816(acc[n], pa, ld32(&vt[n * 8 + g][k0 + kk * 16 + 2 * c]),
                         ld32(&vt[n * 8 + g][k0 + kk * 16 + 2 * c + 8]));
        }
    }
}

// One step of a kernel's loop over the other side's tiles 0 .. n-1, where load(i, s) brings tile i into
// shared-memory stage s. With LDM (two stages, cp.async), tile it is already in flight (started by the
// step before, or by the prologue's load(0, 0)); this starts tile it + 1 into the other stage, then
// waits for tile it. Without, it loads tile it synchronously into stage 0.
// WG: the tiles are read by wgmma (the async proxy), which needs a proxy fence after the copies land.
template <bool LDM, typename Load, bool WG = false>
__device__ __forceinline__ void tile_step(int it, int n, int st, Load&& load) {
    if constexpr (LDM) {
        if (it + 1 < n) {
            load(it + 1, st ^ 1);
            cp_commit();
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        if constexpr (WG) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
    } else {
        __syncthreads();
        load(it, 0);
        __syncthreads();
    }
}

// Zeroes a warp's accumulator fragments (N n-tiles of the mma C layout).
template <int N>
__device__ __forceinline__ void zero_frags(float (&x)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n) x[n][0] = x[n][1] = x[n][2] = x[n][3] = 0.f;
}

// The dk/dv kernels' per-query statistics of one query tile (queries t0 .. t0 + 63 of one (b, h); lse_h
// and delta_h point at its T values) into shared memory, by cp.async (ASYNC, completing with the tile's
// copies) or by plain loads; 0 past T.
template <bool ASYNC>
__device__ __forceinline__ void stage_query_stats(float* lse_d, float* delta_d, const float* __restrict__ lse_h,
                                                  const float* __restrict__ delta_h, int t0, int T) {
    for (int i = threadIdx.x; i < FA_BR; i += blockDim.x) {
        const int t = t0 + i;
        if (ASYNC && t < T) {
            cp_f32(&lse_d[i], lse_h + t);
            cp_f32(&delta_d[i], delta_h + t);
        } else {
            lse_d[i] = t < T ? lse_h[t] : 0.f;
            delta_d[i] = t < T ? delta_h[t] : 0.f;
        }
    }
}

// One key tile of the forward's online softmax, for a warp's rows rowA = r0 + g and rowB = r0 + g + 8:
// s holds the raw scores of the tile (mma C layout, keys key0 + column); on the diagonal tile (diag) the
// keys after each row, or past T, are masked first. Then acc, l and the running maxima m (base-2 units)
// are rescaled to the new maxima, and s becomes the (unnormalised) weights, summed into l.
template <int NT>
__device__ __forceinline__ void online_softmax_tile(float (&s)[FA_BR / 8][4], float (&acc)[NT][4], float& m0, float& m1,
                                                    float& l0, float& l1, float sl2, bool diag, int key0, int rowA,
                                                    int rowB, int T, int c) {
    constexpr int ST = FA_BR / 8;
    const float NEG = __int_as_float(0xff800000);
    float mx0 = NEG, mx1 = NEG;
    // Only the diagonal tile holds keys after a row (or past T). The mask's index arithmetic sits
    // behind this (block-uniform) branch: evaluated on every tile, it kept the integer pipe busier
    // than the tensor cores.
    if (diag) {
#pragma unroll
        for (int n = 0; n < ST; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key0 + n * 8 + 2 * c + (e & 1);
                if (key > (e < 2 ? rowA : rowB) || key >= T) s[n][e] = NEG;
            }
    }
#pragma unroll
    for (int n = 0; n < ST; ++n) {
        mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
        mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    // the maxima are taken over the raw scores and scaled once (scale > 0 keeps their order): the
    // exponent of each weight is then one fma, s * sl2 - base
    const float mn0 = fmaxf(m0, mx0 * sl2), mn1 = fmaxf(m1, mx1 * sl2);
    const float base0 = mn0 == NEG ? 0.f : mn0, base1 = mn1 == NEG ? 0.f : mn1;
    const float al0 = ex2(m0 - base0), al1 = ex2(m1 - base1);
    m0 = mn0;
    m1 = mn1;
    l0 *= al0;
    l1 *= al1;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        acc[n][0] *= al0; acc[n][1] *= al0;
        acc[n][2] *= al1; acc[n][3] *= al1;
    }
#pragma unroll
    for (int n = 0; n < ST; ++n) {
        s[n][0] = ex2(fmaf(s[n][0], sl2, -base0)); s[n][1] = ex2(fmaf(s[n][1], sl2, -base0));
        s[n][2] = ex2(fmaf(s[n][2], sl2, -base1)); s[n][3] = ex2(fmaf(s[n][3], sl2, -base1));
        l0 += s[n][0] + s[n][1];
        l1 += s[n][2] + s[n][3];
    }
}

// The forward's end for a warp's rows: O = acc / l as bf16 into the (N, H*D) rows of head h, and the
// logsumexp (natural units) of (b, h)'s rows.
template <int D>
__device__ __forceinline__ void store_o_lse(const float (&acc)[D / 8][4], float m0, float m1, float l0, float l1,
                                            bf16* __restrict__ o, float* __restrict__ lse, int b, int h, int H, int T,
                                            int rowA, int rowB, int c) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = 1.f / l0, inv1 = 1.f / l1;
    const long long HD = (long long)H * D, bh = (long long)b * H + h;
    if (rowA < T) {
        bf16* orow = o + ((long long)b * T + rowA) * HD + (long long)h * D;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<unsigned*>(orow + n * 8 + 2 * c) = pack2(acc[n][0] * inv0, acc[n][1] * inv0);
        if (c == 0) lse[bh * T + rowA] = (m0 + log2f(l0)) * LN2;
    }
    if (rowB < T) {
        bf16* orow = o + ((long long)b * T + rowB) * HD + (long long)h * D;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<unsigned*>(orow + n * 8 + 2 * c) = pack2(acc[n][2] * inv1, acc[n][3] * inv1);
        if (c == 0) lse[bh * T + rowB] = (m1 + log2f(l1)) * LN2;
    }
}

// The dk/dv kernels' weights for one pass of PN*8 queries (columns, the first t0; rows = a warp's keys
// keyA, keyB): S^T -> P^T = 2^(S^T * scale * log2(e) - lse * log2(e)), zero where a query precedes the
// key or either lies past T (only when `mask`: the diagonal or the last query tile); lse_q: the pass's
// queries' values. Then (dkdv_dscores) dP^T -> dS^T = P^T * (dP^T - delta).
template <int PN>
__device__ __forceinline__ void dkdv_probs(float (&s)[PN][4], const float* lse_q, float sl2, bool mask, int t0,
                                           int keyA, int keyB, int T, int c) {
#pragma unroll
    for (int n = 0; n < PN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = ex2(fmaf(s[n][e], sl2, -LOG2E * lse_q[qi_of(n, e, c)]));
    if (mask) {
#pragma unroll
        for (int n = 0; n < PN; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = t0 + qi_of(n, e, c), key = e < 2 ? keyA : keyB;
                if (t < key || t >= T || key >= T) s[n][e] = 0.f;
            }
    }
}
template <int PN>
__device__ __forceinline__ void dkdv_dscores(float (&dp)[PN][4], const float (&p)[PN][4], const float* delta_q, int c) {
#pragma unroll
    for (int n = 0; n < PN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[n][e] = p[n][e] * (dp[n][e] - delta_q[qi_of(n, e, c)]);
}

// The dq kernels' weights for one pass of PN*8 keys (columns, the first key0; rows = a warp's queries
// rowA, rowB with lse lA, lB in base-2 units): P = 2^(S * scale * log2(e) - lse), zero for keys after
// the row or past T (only when `mask`: the diagonal tile). Then (dq_dscores, with the rows' delta dA,
// dB) dS = P * (dP - delta).
template <int PN>
__device__ __forceinline__ void dq_probs(float (&s)[PN][4], float lA, float lB, float sl2, bool mask, int key0,
                                         int rowA, int rowB, int T, int c) {
#pragma unroll
    for (int n = 0; n < PN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = ex2(fmaf(s[n][e], sl2, -(e < 2 ? lA : lB)));
    if (mask) {
#pragma unroll
        for (int n = 0; n < PN; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key0 + qi_of(n, e, c), row = e < 2 ? rowA : rowB;
                if (key > row || key >= T || row >= T) s[n][e] = 0.f;
            }
    }
}
template <int PN>
__device__ __forceinline__ void dq_dscores(float (&dp)[PN][4], const float (&p)[PN][4], float dA, float dB) {
#pragma unroll
    for (int n = 0; n < PN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[n][e] = p[n][e] * (dp[n][e] - (e < 2 ? dA : dB));
}

template <int D, bool LDM>
__device__ __forceinline__ void flash_fwd_mma_impl(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                   const bf16* __restrict__ v, bf16* __restrict__ o,
                                                   float* __restrict__ lse, int H, int Hkv, int T, float scale) {
    constexpr int KC = D / 16, NT = D / 8, ST = FA_BR / 8, NS = LDM ? 2 : 1;
    __shared__ __align__(16) bf16 Ks[NS][FA_BR][D + FA_PAD];
    __shared__ __align__(16) bf16 Vs[NS][LDM ? FA_BR : 1][D + FA_PAD];  // V as is (LDM)
    __shared__ __align__(16) bf16 Vt[LDM ? 1 : D][FA_BR + FA_PAD];      // V transposed (without LDM)
    const int nqb = (T + FA_BR - 1) / FA_BR;
    const int qb = nqb - 1 - blockIdx.y;  // longest rows first (see "Grids" above)
    const int bh = blockIdx.x, b = bh / H, h = bh % H, hk = h / (H / Hkv);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const bf16* qh = q + (long long)bh * T * D;
    const bf16* kh = k + ((long long)b * Hkv + hk) * T * D;
    const bf16* vh = v + ((long long)b * Hkv + hk) * T * D;
    const int r0 = qb * FA_BR + warp * 16;
    auto load = [&](int t, int st) {  // key tile t (see tile_step)
        if constexpr (LDM) {
            cp_tile<D>(Ks[st], kh, D, t * FA_BR, T);
            cp_tile<D>(Vs[st], vh, D, t * FA_BR, T);
        } else {
            load_tile<D>(Ks[0], nullptr, kh, D, t * FA_BR, T);
            load_tile<D>(nullptr, Vt, vh, D, t * FA_BR, T);
        }
    };
    if constexpr (LDM) {
        load(0, 0);
        cp_commit();
    }
    unsigned qa[KC][4];
    load_a_frags<D>(qa, qh, D, r0, T, g, c);
    float acc[NT][4];
    zero_frags(acc);
    const float NEG = __int_as_float(0xff800000);
    float m0 = NEG, m1 = NEG, l0 = 0.f, l1 = 0.f;
    const float sl2 = scale * LOG2E;
    const int rowA = r0 + g, rowB = r0 + g + 8;
    for (int kb = 0; kb <= qb; ++kb) {
        const int st = LDM ? (kb & 1) : 0;
        tile_step<LDM>(kb, qb + 1, st, load);
        float s[ST][4];
        zero_frags(s);
        mma_rows_tile<D, LDM>(s, qa, Ks[st], g, c, lane);
        online_softmax_tile(s, acc, m0, m1, l0, l1, sl2, kb == qb, kb * FA_BR, rowA, rowB, T, c);
        mma_p_tile<D, LDM>(acc, s, Vs[st], Vt, 0, g, c, lane);
        if constexpr (LDM) __syncthreads();  // stage st is refilled by the next iteration
    }
    store_o_lse<D>(acc, m0, m1, l0, l1, o, lse, b, h, H, T, rowA, rowB, c);
}

// A dk/dv kernel's rows: the K and V A fragments of a warp's 16 keys r0.. of the (batch, kv head) pair
// bhk, and its dK, dV accumulators, zeroed.
template <int D>
__device__ __forceinline__ void dkdv_rows(unsigned (&ka)[D / 16][4], unsigned (&va)[D / 16][4], float (&dka)[D / 8][4],
                                          float (&dva)[D / 8][4], const bf16* __restrict__ k,
                                          const bf16* __restrict__ v, int bhk, int T, int r0, int g, int c) {
    load_a_frags<D>(ka, k + (long long)bhk * T * D, D, r0, T, g, c);
    load_a_frags<D>(va, v + (long long)bhk * T * D, D, r0, T, g, c);
    zero_frags(dka);
    zero_frags(dva);
}

// dk, dv for 64 keys of one (b, kv head): loops over the group's query heads and the query tiles at or
// after the keys' tile (with LDM: flattened into one loop, the next Q/dO tiles streaming in by cp.async).
template <int D, bool LDM>
__device__ __forceinline__ void flash_bwd_dkdv_mma_impl(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const bf16* __restrict__ dO,
    const float* __restrict__ lse, const float* __restrict__ delta, bf16* __restrict__ dqkv,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t, int H, int Hkv, int T, float scale) {
    constexpr int KC = D / 16, NT = D / 8, PC = FA_DKDV_PASS, PN = PC / 8, NS = LDM ? 2 : 1;
    __shared__ __align__(16) bf16 Qs[NS][FA_BR][D + FA_PAD];
    __shared__ __align__(16) bf16 Ds[NS][FA_BR][D + FA_PAD];
    __shared__ __align__(16) bf16 Qt[LDM ? 1 : D][FA_BR + FA_PAD];
    __shared__ __align__(16) bf16 Dt[LDM ? 1 : D][FA_BR + FA_PAD];
    __shared__ float lse_s[NS][FA_BR], delta_s[NS][FA_BR];
    const int nb = (T + FA_BR - 1) / FA_BR;
    const int kb = blockIdx.y;  // the first keys see the most queries: they start first
    const int bhk = blockIdx.x, b = bhk / Hkv, hk = bhk % Hkv, G = H / Hkv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const long long HD = (long long)H * D;
    const int r0 = kb * FA_BR + warp * 16;  // this warp's first key
    const int nq = nb - kb, iters = G * nq;
    // the Q/dO tiles (and their lse, delta) of iteration `it` into stage `st` (see tile_step)
    auto load = [&](int it, int st) {
        const int h = hk * G + it / nq, qb = kb + it % nq;
        const long long bh = (long long)b * H + h;
        if constexpr (LDM) {
            cp_tile<D>(Qs[st], q + bh * T * D, D, qb * FA_BR, T);
            cp_tile<D>(Ds[st], dO + (long long)b * T * HD + (long long)h * D, HD, qb * FA_BR, T);
        } else {
            load_tile<D>(Qs[st], Qt, q + bh * T * D, D, qb * FA_BR, T);
            load_tile<D>(Ds[st], Dt, dO + (long long)b * T * HD + (long long)h * D, HD, qb * FA_BR, T);
        }
        stage_query_stats<LDM>(lse_s[st], delta_s[st], lse + bh * T, delta + bh * T, qb * FA_BR, T);  // LDM: no stall
    };
    if constexpr (LDM) {
        load(0, 0);
        cp_commit();
    }
    unsigned ka[KC][4], va[KC][4];
    float dka[NT][4], dva[NT][4];
    dkdv_rows<D>(ka, va, dka, dva, k, v, bhk, T, r0, g, c);
    const float sl2 = scale * LOG2E;
    const int keyA = r0 + g, keyB = r0 + g + 8;
    for (int it = 0; it < iters; ++it) {
        const int qb = kb + it % nq;
        const int st = LDM ? (it & 1) : 0;
        tile_step<LDM>(it, iters, st, load);
        // the query tile in passes of PC columns (see FA_DKDV_PASS)
#pragma unroll 1
        for (int q0 = 0; q0 < FA_BR; q0 += PC) {
            if (qb == kb && q0 + PC <= warp * 16) continue;  // (warp-uniform) every query before every key
            float s[PN][4], dp[PN][4];
            zero_frags(s);
            zero_frags(dp);
            mma_rows_tile<D, LDM, PC>(s, ka, Qs[st] + q0, g, c, lane);   // S^T = K Q^T
            mma_rows_tile<D, LDM, PC>(dp, va, Ds[st] + q0, g, c, lane);  // dP^T = V dO^T
            // P^T and dS^T = P^T * (dP^T - delta); rows = keys, columns = queries; masked on the causal
            // diagonal and in the last query tile (queries past T)
            dkdv_probs(s, lse_s[st] + q0, sl2, qb == kb || qb == nb - 1, qb * FA_BR + q0, keyA, keyB, T, c);
            dkdv_dscores(dp, s, delta_s[st] + q0, c);
            mma_p_tile<D, LDM, PC>(dva, s, Ds[st] + q0, Dt, q0, g, c, lane);   // dV += P^T dO
            mma_p_tile<D, LDM, PC>(dka, dp, Qs[st] + q0, Qt, q0, g, c, lane);  // dK += dS^T Q
        }
        if constexpr (LDM) __syncthreads();
    }
    const long long W = (long long)(H + 2 * Hkv) * D;
    store_dqkv_rows<D>(dka, dqkv, W, b, T, kb * FA_BR + warp * 16, (H + hk) * D, scale, true, cos_t, sin_t, g, c);
    store_dqkv_rows<D>(dva, dqkv, W, b, T, kb * FA_BR + warp * 16, (H + Hkv + hk) * D, 1.f, false, cos_t, sin_t, g, c);
}

// A dq kernel's rows: the Q and dO A fragments of a warp's 16 rows r0.. of (b, h), their logsumexp in
// base-2 units (lA: row r0 + g, lB: row r0 + g + 8), and delta = rowsum(dO * O) from dO's fragments and
// O's (rows g | g + 8 in regs 0, 2 | 1, 3), summed over the quad's four threads and also stored for the
// dk/dv kernel, which runs after the dq kernel.
template <int D>
__device__ __forceinline__ void dq_rows(unsigned (&qa)[D / 16][4], unsigned (&doa)[D / 16][4], float& lA, float& lB,
                                        float& dA, float& dB, const bf16* __restrict__ q, const bf16* __restrict__ dO,
                                        const bf16* __restrict__ o, const float* __restrict__ lse,
                                        float* __restrict__ delta, int b, int h, int H, int T, int r0, int g, int c) {
    const long long HD = (long long)H * D, bh = (long long)b * H + h;
    load_a_frags<D>(qa, q + bh * T * D, D, r0, T, g, c);
    load_a_frags<D>(doa, dO + (long long)b * T * HD + (long long)h * D, HD, r0, T, g, c);
    lA = r0 + g < T ? lse[bh * T + r0 + g] * LOG2E : 0.f;
    lB = r0 + g + 8 < T ? lse[bh * T + r0 + g + 8] * LOG2E : 0.f;
    unsigned oa[D / 16][4];
    load_a_frags<D>(oa, o + (long long)b * T * HD + (long long)h * D, HD, r0, T, g, c);
    dA = dB = 0.f;
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
        dA += lo_bf(doa[kc][0]) * lo_bf(oa[kc][0]) + hi_bf(doa[kc][0]) * hi_bf(oa[kc][0]) +
              lo_bf(doa[kc][2]) * lo_bf(oa[kc][2]) + hi_bf(doa[kc][2]) * hi_bf(oa[kc][2]);
        dB += lo_bf(doa[kc][1]) * lo_bf(oa[kc][1]) + hi_bf(doa[kc][1]) * hi_bf(oa[kc][1]) +
              lo_bf(doa[kc][3]) * lo_bf(oa[kc][3]) + hi_bf(doa[kc][3]) * hi_bf(oa[kc][3]);
    }
    dA += __shfl_xor_sync(0xffffffffu, dA, 1);
    dA += __shfl_xor_sync(0xffffffffu, dA, 2);
    dB += __shfl_xor_sync(0xffffffffu, dB, 1);
    dB += __shfl_xor_sync(0xffffffffu, dB, 2);
    if (c == 0 && r0 + g < T) delta[bh * T + r0 + g] = dA;
    if (c == 0 && r0 + g + 8 < T) delta[bh * T + r0 + g + 8] = dB;
}

// dq for 64 queries of one (b, h): loops over the key tiles up to the diagonal.
template <int D, bool LDM>
__device__ __forceinline__ void flash_bwd_dq_mma_impl(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const bf16* __restrict__ dO,
    const bf16* __restrict__ o, const float* __restrict__ lse, float* __restrict__ delta, bf16* __restrict__ dqkv,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t, int H, int Hkv, int T, float scale) {
    constexpr int KC = D / 16, NT = D / 8, PC = FA_DQ_PASS, PN = PC / 8, NS = LDM ? 2 : 1;
    __shared__ __align__(16) bf16 Ks[NS][FA_BR][D + FA_PAD];
    __shared__ __align__(16) bf16 Vs[NS][FA_BR][D + FA_PAD];
    __shared__ __align__(16) bf16 Kt[LDM ? 1 : D][FA_BR + FA_PAD];
    const int nb = (T + FA_BR - 1) / FA_BR;
    const int qb = nb - 1 - blockIdx.y;  // longest rows first
    const int bh = blockIdx.x, b = bh / H, h = bh % H, hk = h / (H / Hkv);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int r0 = qb * FA_BR + warp * 16;
    const int rowA = r0 + g, rowB = r0 + g + 8;
    const bf16* kh = k + ((long long)b * Hkv + hk) * T * D;
    const bf16* vh = v + ((long long)b * Hkv + hk) * T * D;
    auto load = [&](int t, int st) {  // key tile t (see tile_step)
        if constexpr (LDM) {
            cp_tile<D>(Ks[st], kh, D, t * FA_BR, T);
            cp_tile<D>(Vs[st], vh, D, t * FA_BR, T);
        } else {
            load_tile<D>(Ks[0], Kt, kh, D, t * FA_BR, T);
            load_tile<D>(Vs[0], nullptr, vh, D, t * FA_BR, T);
        }
    };
    if constexpr (LDM) {
        load(0, 0);
        cp_commit();
    }
    unsigned qa[KC][4], doa[KC][4];
    float lA, lB, dA, dB;
    dq_rows<D>(qa, doa, lA, lB, dA, dB, q, dO, o, lse, delta, b, h, H, T, r0, g, c);
    float acc[NT][4];
    zero_frags(acc);
    const float sl2 = scale * LOG2E;
    for (int kb = 0; kb <= qb; ++kb) {
        const int st = LDM ? (kb & 1) : 0;
        tile_step<LDM>(kb, qb + 1, st, load);
        // the key tile in passes of PC columns (see FA_DQ_PASS)
#pragma unroll 1
        for (int k0 = 0; k0 < FA_BR; k0 += PC) {
            if (kb == qb && k0 >= warp * 16 + 16) continue;  // (warp-uniform) every key after every row
            float s[PN][4], dp[PN][4];
            zero_frags(s);
            zero_frags(dp);
            mma_rows_tile<D, LDM, PC>(s, qa, Ks[st] + k0, g, c, lane);    // S = Q K^T
            mma_rows_tile<D, LDM, PC>(dp, doa, Vs[st] + k0, g, c, lane);  // dP = dO V^T
            dq_probs(s, lA, lB, sl2, kb == qb, kb * FA_BR + k0, rowA, rowB, T, c);
            dq_dscores(dp, s, dA, dB);
            mma_p_tile<D, LDM, PC>(acc, dp, Ks[st] + k0, Kt, k0, g, c, lane);  // dQ += dS K
        }
        if constexpr (LDM) __syncthreads();
    }
    store_dqkv_rows<D>(acc, dqkv, (long long)(H + 2 * Hkv) * D, b, T, qb * FA_BR + warp * 16, h * D, scale, true,
                       cos_t, sin_t, g, c);
}

// VAR: mma (B fragments by 32-bit shared loads, transposed tile copies) or ldm (ldmatrix); LDM: its flag.
#define FLASH_MMA_KERNELS_V(D, VAR, LDM)                                                                      \
    extern "C" __global__ void __launch_bounds__(128) flash_fwd_##VAR##_d##D(                                    \
        const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, int H, int Hkv, int T, float scale) {     \
        flash_fwd_mma_impl<D, LDM>(q, k, v, o, lse, H, Hkv, T, scale);                                            \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(128, FA_DKDV_BLOCKS) flash_bwd_dkdv_##VAR##_d##D(                               \
        const bf16* q, const bf16* k, const bf16* v, const bf16* dO, const float* lse, const float* delta,       \
        bf16* dqkv, const float* cos_t, const float* sin_t, int H, int Hkv, int T, float scale) {               \
        flash_bwd_dkdv_mma_impl<D, LDM>(q, k, v, dO, lse, delta, dqkv, cos_t, sin_t, H, Hkv, T, scale);           \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(128, FA_DQ_BLOCKS) flash_bwd_dq_##VAR##_d##D(                                 \
        const bf16* q, const bf16* k, const bf16* v, const bf16* dO, const bf16* o, const float* lse,            \
        float* delta, bf16* dqkv, const float* cos_t, const float* sin_t, int H, int Hkv, int T, float scale) {  \
        flash_bwd_dq_mma_impl<D, LDM>(q, k, v, dO, o, lse, delta, dqkv, cos_t, sin_t, H, Hkv, T, scale);          \
    }
#define FLASH_MMA_KERNELS(D) FLASH_MMA_KERNELS_V(D, mma, false) FLASH_MMA_KERNELS_V(D, ldm, true)

FLASH_MMA_KERNELS(32)
FLASH_MMA_KERNELS(64)

// ---- Hopper warpgroup attention (wgmma, sm_90a) ----------------------------------------------------------
// flash_{fwd,bwd_dq,bwd_dkdv}_wg_d64 have a body only when built for sm_90a (the module is, on a
// compute-capability-9.0 device: see kernels/__init__.py); elsewhere the engine uses the ldm kernels.
// Same arithmetic, grids and outputs as those, with the block's 4 warps acting as one warpgroup: every
// product is a whole 64 x 64 tile in 4 wgmma.m64n64k16. The tiles come from shared memory, which the
// tensor cores read themselves (no ldmatrix) in the 128-byte-swizzled layout below, as [n][k] or,
// transposed, as [k][n]: the streamed ones (two stages) and the block's own rows (Q; in dq also dO, in
// dk/dv K and V), copied once. The softmax weights and dS, whose accumulator layout is the A-fragment
// layout, are the A operand from registers. The accumulators have the
// mma.sync C layout per warp (warp w holds rows 16w .. 16w+15), so the softmax and weight steps are the
// ldm kernels' own device functions.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// A 64 x 64 bf16 tile (128-byte rows) as wgmma reads it with 128-byte swizzling: the 16-byte chunk j
// of row r lies at chunk j ^ (r % 8) of that row, and the tile starts 1024-byte aligned.
__device__ __forceinline__ unsigned sw128(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

// cp.async of a 64-row tile (rows r0.., row stride ld) into the swizzled tile at shared address dst;
// rows >= rmax become zeros. 128 threads: thread t copies chunk t % 8 of rows t / 8 + 16 j, j = 0 .. 3,
// which all share one swizzle (row % 8), so the four copies differ only by constant offsets. Unrolled
// and free of per-chunk index arithmetic: written as a loop over blockDim.x, the copies took a third
// of the forward's instructions, in a kernel bound by instruction issue.
__device__ __forceinline__ void cp_tile_sw(unsigned dst, const bf16* base, long long ld, int r0, int rmax) {
    const int row = threadIdx.x >> 3;
    const unsigned sa = dst + sw128(row, threadIdx.x & 7);
    const bf16* src = base + (long long)(r0 + row) * ld + (threadIdx.x & 7) * 8;
    const bool whole = r0 + FA_BR <= rmax;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if (whole || r0 + row + 16 * j < rmax)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa + j * 2048), "l"(src + 16 * j * ld));
        else
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(sa + j * 2048), "r"(0u));
    }
}

// The warpgroup kernels' 64 x 64 tiles (8 KiB each) lie in dynamic shared memory, the first 1024-byte
// aligned: the host gives each kernel 1 KiB more than its tiles (engine.FLASH_WG_SMEM). Static arrays
// are limited to 48 KiB, which the dq and dk/dv kernels' six tiles exceed.
__device__ __forceinline__ unsigned wg_tiles() {
    extern __shared__ __align__(128) unsigned char fa_smem[];
    return (smem_u32(fa_smem) + 1023u) & ~1023u;
}

// Shared-memory matrix descriptor (PTX "matrix descriptor"): start address, leading and stride byte
// offsets (16-byte units), 128-byte swizzle. Stride 1024 bytes: the next 8 rows of the tile. K-major
// operands (K here, rows = n, 64 contiguous k) start at +32 bytes per 16 k; the transposed operand
// (V, rows = k, 64 contiguous n) starts at +2048 bytes per 16 k, and its leading offset, the step to
// the next 64 n, never comes into play for n = 64.
__device__ __forceinline__ unsigned long long wg_desc(unsigned saddr, unsigned lead16) {
    return (unsigned long long)((saddr & 0x3FFFFu) >> 4) | ((unsigned long long)lead16 << 16) | (64ull << 32) |
           (1ull << 62);
}

// The 32 accumulator registers of a thread's share of a 64 x 64 wgmma result, as asm operands %0 .. %31.
#define WG_ACC_64X64(d)                                                                                          \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),     \
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), \
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), \
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
// d (64 x 64, float32, this thread's 32 values in the mma C layout) = (ACC ? d : 0) + A (64 x 16, this
// thread's 4 A registers) * B (16 x 64 from shared memory; TB = 1: stored with n contiguous).
// Asynchronous: the caller fences before, commits and waits after.
template <int TB, int ACC = 1>
__device__ __forceinline__ void wgmma_64x64x16(float (&d)[8][4], const unsigned (&a)[4], unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
        : WG_ACC_64X64(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TB), "n"(ACC));
}
// d (+)= A (64 x 64, 4 k-steps of A registers) * B, the 64 x 64 tile at shared address `tile`: read as
// [n][k] (TB = 0, K-major: 32 bytes further per 16 k) or as [k][n] (TB = 1: 2048 bytes further).
template <int TB, int ACC>
__device__ __forceinline__ void wgmma_64x64x64(float (&d)[8][4], const unsigned (&a)[4][4], unsigned tile) {
    wgmma_64x64x16<TB, ACC>(d, a[0], wg_desc(tile, TB ? 64 : 1));
#pragma unroll
    for (int kc = 1; kc < 4; ++kc) wgmma_64x64x16<TB, 1>(d, a[kc], wg_desc(tile + kc * (TB ? 2048 : 32), TB ? 64 : 1));
}
// d (+)= A * B with A, too, a 64 x 64 tile in shared memory (at `a_tile`, read as [m][k], K-major like
// B with TB = 0): an operand that stays the same for a whole block (its Q, K, V or dO rows) then needs
// no registers, which leaves room for more blocks per multiprocessor (engine.FLASH_WG_SMEM).
template <int TB, int ACC>
__device__ __forceinline__ void wgmma_64x64x64_ss(float (&d)[8][4], unsigned a_tile, unsigned b_tile) {
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) {
        const unsigned long long a = wg_desc(a_tile + kc * 32, 1);
        const unsigned long long b = wg_desc(b_tile + kc * (TB ? 2048 : 32), TB ? 64 : 1);
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
            "%32, %33, p, 1, 1, 0, %35;\n}\n"
            : WG_ACC_64X64(d)
            : "l"(a), "l"(b), "r"(kc > 0 || ACC ? 1 : 0), "n"(TB));
    }
}
// 4 A-register k-steps (16 rows x 64 columns of a warp, bf16) from 64 float accumulator columns
__device__ __forceinline__ void frags_of(unsigned (&a)[4][4], const float (&x)[8][4]) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        a[kk][0] = pack2(x[2 * kk][0], x[2 * kk][1]);
        a[kk][1] = pack2(x[2 * kk][2], x[2 * kk][3]);
        a[kk][2] = pack2(x[2 * kk + 1][0], x[2 * kk + 1][1]);
        a[kk][3] = pack2(x[2 * kk + 1][2], x[2 * kk + 1][3]);
    }
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>  // until at most the N most recently committed groups are still running
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void wg_commit_wait() {
    wg_commit();
    wg_wait<0>();
}
// Registers a wgmma reads or writes asynchronously: "used" here, after the wait, so the compiler
// neither reads the results early nor reuses the operands' registers while the wgmma runs.
template <int N>
__device__ __forceinline__ void wg_hold(float (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i][0]), "+f"(r[i][1]), "+f"(r[i][2]), "+f"(r[i][3])::"memory");
}
template <int N>
__device__ __forceinline__ void wg_hold(unsigned (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i][0]), "+r"(r[i][1]), "+r"(r[i][2]), "+r"(r[i][3])::"memory");
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// 5 blocks per multiprocessor (96 registers, a spill of a few bytes): 8% faster than 4 at B64xT512.
extern "C" __global__ void __launch_bounds__(128, 5) flash_fwd_wg_d64(const bf16* __restrict__ q,
                                                                    const bf16* __restrict__ k,
                                                                    const bf16* __restrict__ v, bf16* __restrict__ o,
                                                                    float* __restrict__ lse, int H, int Hkv, int T,
                                                                    float scale) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int D = 64, NT = D / 8, ST = FA_BR / 8, TILE = FA_BR * D * 2;
    const unsigned sbase = wg_tiles();  // K stage 0, 1, V stage 0, 1, then Q
    const int nqb = (T + FA_BR - 1) / FA_BR;
    const int qb = nqb - 1 - blockIdx.y;  // longest rows first (see "Grids" above)
    const int bh = blockIdx.x, b = bh / H, h = bh % H, hk = h / (H / Hkv);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const bf16* kh = k + ((long long)b * Hkv + hk) * T * D;
    const bf16* vh = v + ((long long)b * Hkv + hk) * T * D;
    const int r0 = qb * FA_BR + warp * 16;
    auto load = [&](int t, int st) {  // key tile t into stage st
        cp_tile_sw(sbase + st * TILE, kh, D, t * FA_BR, T);
        cp_tile_sw(sbase + (2 + st) * TILE, vh, D, t * FA_BR, T);
    };
    const unsigned qs = sbase + 4 * TILE;  // this block's queries
    cp_tile_sw(qs, q + (long long)bh * T * D, D, qb * FA_BR, T);
    load(0, 0);
    cp_commit();
    float acc[NT][4];
    zero_frags(acc);
    const float NEG = __int_as_float(0xff800000);
    float m0 = NEG, m1 = NEG, l0 = 0.f, l1 = 0.f;
    const float sl2 = scale * LOG2E;
    const int rowA = r0 + g, rowB = r0 + g + 8;
    for (int kb = 0; kb <= qb; ++kb) {
        const int st = kb & 1;
        tile_step<true, decltype(load)&, true>(kb, qb + 1, st, load);
        float s[ST][4];
        wg_fence();
        wgmma_64x64x64_ss<0, 0>(s, qs, sbase + st * TILE);  // S = Q K^T
        wg_commit_wait();
        wg_hold(s);
        online_softmax_tile(s, acc, m0, m1, l0, l1, sl2, kb == qb, kb * FA_BR, rowA, rowB, T, c);
        unsigned pa[4][4];
        frags_of(pa, s);
        wg_fence();
        wgmma_64x64x64<1, 1>(acc, pa, sbase + (2 + st) * TILE);  // O += P V
        wg_commit_wait();
        wg_hold(acc);
        wg_hold(pa);
        __syncthreads();  // stage st is refilled by the next iteration
    }
    store_o_lse<D>(acc, m0, m1, l0, l1, o, lse, b, h, H, T, rowA, rowB, c);
#else
    __trap();  // built for another target: the engine launches this kernel only on sm_90a builds
#endif
}

// dk, dv for 64 keys of one (b, kv head), as flash_bwd_dkdv_mma_impl with whole 64-query passes: per
// query tile S^T = K Q^T and dP^T = V dO^T (the block's K, V tiles and the Q, dO tiles, read [n][k]),
// then dV += P^T dO and dK += dS^T Q (P^T, dS^T from registers; the same tiles read [k][n]). 3 blocks
// per multiprocessor, where K and V in registers allowed 2. At 166 registers ptxas serializes the wgmma
// (and spills 16 bytes); still faster than 2 blocks at 182 registers without either (0.188 against
// 0.193 ms at B64xT512, level at B16xT1024).
extern "C" __global__ void __launch_bounds__(128, 3) flash_bwd_dkdv_wg_d64(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const bf16* __restrict__ dO,
    const float* __restrict__ lse, const float* __restrict__ delta, bf16* __restrict__ dqkv,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t, int H, int Hkv, int T, float scale) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int D = 64, KC = D / 16, NT = D / 8, TILE = FA_BR * D * 2;
    __shared__ float lse_s[2][FA_BR], delta_s[2][FA_BR];
    const unsigned sbase = wg_tiles();  // Q stage 0, 1, dO stage 0, 1, then K, V
    const int nb = (T + FA_BR - 1) / FA_BR;
    const int kb = blockIdx.y;  // the first keys see the most queries: they start first
    const int bhk = blockIdx.x, b = bhk / Hkv, hk = bhk % Hkv, G = H / Hkv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const long long HD = (long long)H * D;
    const int r0 = kb * FA_BR + warp * 16;  // this warp's first key
    const int nq = nb - kb, iters = G * nq;
    auto load = [&](int it, int st) {  // the Q/dO tiles, lse and delta of iteration `it` into stage `st`
        const int h = hk * G + it / nq, qb = kb + it % nq;
        const long long bh = (long long)b * H + h;
        cp_tile_sw(sbase + st * TILE, q + bh * T * D, D, qb * FA_BR, T);
        cp_tile_sw(sbase + (2 + st) * TILE, dO + (long long)b * T * HD + (long long)h * D, HD, qb * FA_BR, T);
        stage_query_stats<true>(lse_s[st], delta_s[st], lse + bh * T, delta + bh * T, qb * FA_BR, T);
    };
    const unsigned ks = sbase + 4 * TILE, vs = sbase + 5 * TILE;  // this block's keys and values
    cp_tile_sw(ks, k + (long long)bhk * T * D, D, kb * FA_BR, T);
    cp_tile_sw(vs, v + (long long)bhk * T * D, D, kb * FA_BR, T);
    load(0, 0);
    cp_commit();
    float dka[NT][4], dva[NT][4];
    zero_frags(dka);
    zero_frags(dva);
    const float sl2 = scale * LOG2E;
    const int keyA = r0 + g, keyB = r0 + g + 8;
    for (int it = 0; it < iters; ++it) {
        const int qb = kb + it % nq, st = it & 1;
        tile_step<true, decltype(load)&, true>(it, iters, st, load);
        const unsigned qs = sbase + st * TILE, ds = sbase + (2 + st) * TILE;
        // four groups of products, each overlapping the arithmetic that follows it: P^T is formed while
        // dP^T is multiplied, dS^T while dV is
        float s[NT][4], dp[NT][4];
        wg_fence();
        wgmma_64x64x64_ss<0, 0>(s, ks, qs);  // S^T = K Q^T
        wg_commit();
        wgmma_64x64x64_ss<0, 0>(dp, vs, ds);  // dP^T = V dO^T
        wg_commit();
        wg_wait<1>();
        wg_hold(s);
        dkdv_probs(s, lse_s[st], sl2, qb == kb || qb == nb - 1, qb * FA_BR, keyA, keyB, T, c);
        unsigned pa[KC][4], dsa[KC][4];
        frags_of(pa, s);
        wg_fence();
        wgmma_64x64x64<1, 1>(dva, pa, ds);  // dV += P^T dO
        wg_commit();
        wg_wait<1>();
        wg_hold(dp);
        dkdv_dscores(dp, s, delta_s[st], c);
        frags_of(dsa, dp);
        wg_fence();
        wgmma_64x64x64<1, 1>(dka, dsa, qs);  // dK += dS^T Q
        wg_commit_wait();
        wg_hold(dva);
        wg_hold(dka);
        wg_hold(pa);
        wg_hold(dsa);
        __syncthreads();  // stage st is refilled by the next iteration
    }
    const long long W = (long long)(H + 2 * Hkv) * D;
    store_dqkv_rows<D>(dka, dqkv, W, b, T, kb * FA_BR + warp * 16, (H + hk) * D, scale, true, cos_t, sin_t, g, c);
    store_dqkv_rows<D>(dva, dqkv, W, b, T, kb * FA_BR + warp * 16, (H + Hkv + hk) * D, 1.f, false, cos_t, sin_t, g, c);
#else
    __trap();
#endif
}

// dq for 64 queries of one (b, h), as flash_bwd_dq_mma_impl with whole 64-key passes: per key tile
// S = Q K^T and dP = dO V^T (the block's Q, dO tiles and the K, V tiles, read [n][k]), then
// dQ += dS K (the K tile read [k][n]). 4 blocks per multiprocessor, where Q and dO in registers allowed 3.
extern "C" __global__ void __launch_bounds__(128, 4) flash_bwd_dq_wg_d64(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const bf16* __restrict__ dO,
    const bf16* __restrict__ o, const float* __restrict__ lse, float* __restrict__ delta, bf16* __restrict__ dqkv,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t, int H, int Hkv, int T, float scale) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int D = 64, KC = D / 16, NT = D / 8, TILE = FA_BR * D * 2;
    const unsigned sbase = wg_tiles();  // K stage 0, 1, V stage 0, 1, then Q, dO
    const int nb = (T + FA_BR - 1) / FA_BR;
    const int qb = nb - 1 - blockIdx.y;  // longest rows first
    const int bh = blockIdx.x, b = bh / H, h = bh % H, hk = h / (H / Hkv);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int r0 = qb * FA_BR + warp * 16;
    const int rowA = r0 + g, rowB = r0 + g + 8;
    const bf16* kh = k + ((long long)b * Hkv + hk) * T * D;
    const bf16* vh = v + ((long long)b * Hkv + hk) * T * D;
    auto load = [&](int t, int st) {  // key tile t into stage st
        cp_tile_sw(sbase + st * TILE, kh, D, t * FA_BR, T);
        cp_tile_sw(sbase + (2 + st) * TILE, vh, D, t * FA_BR, T);
    };
    const unsigned qs = sbase + 4 * TILE, dos = sbase + 5 * TILE;  // this block's queries and their dO
    cp_tile_sw(qs, q + (long long)bh * T * D, D, qb * FA_BR, T);
    cp_tile_sw(dos, dO + (long long)b * T * H * D + (long long)h * D, (long long)H * D, qb * FA_BR, T);
    load(0, 0);
    cp_commit();
    const float lA = rowA < T ? lse[(long long)bh * T + rowA] * LOG2E : 0.f;  // base-2 units
    const float lB = rowB < T ? lse[(long long)bh * T + rowB] * LOG2E : 0.f;
    // delta = rowsum(dO * O) of the block's rows, two threads a row, each 32 columns in 16-byte loads,
    // into `delta` for the dk/dv kernel and into shared memory for the warps' own rows. (Loaded 4 bytes
    // at a time in the mma layout, as the ldm kernel's dq_rows does, dO and O took a fifth of this
    // kernel's time; this way the kernel is 5% faster.)
    __shared__ float delta_s[FA_BR];
    {
        const int row = threadIdx.x >> 1, t = qb * FA_BR + row;
        float d = 0.f;
        if (t < T) {
            const long long off = ((long long)b * T + t) * H * D + (long long)h * D + (threadIdx.x & 1) * 32;
#pragma unroll
            for (int j = 0; j < 4; ++j)
                d += dot_bf16x8(reinterpret_cast<const uint4*>(dO + off)[j], reinterpret_cast<const uint4*>(o + off)[j]);
        }
        d += __shfl_xor_sync(0xffffffffu, d, 1);
        if ((threadIdx.x & 1) == 0) {
            delta_s[row] = d;
            if (t < T) delta[(long long)bh * T + t] = d;
        }
    }
    __syncthreads();
    const float dA = delta_s[warp * 16 + g], dB = delta_s[warp * 16 + g + 8];
    float acc[NT][4];
    zero_frags(acc);
    const float sl2 = scale * LOG2E;
    for (int kb = 0; kb <= qb; ++kb) {
        const int st = kb & 1;
        tile_step<true, decltype(load)&, true>(kb, qb + 1, st, load);
        const unsigned ks = sbase + st * TILE, vs = sbase + (2 + st) * TILE;
        float s[NT][4], dp[NT][4];
        wg_fence();
        wgmma_64x64x64_ss<0, 0>(s, qs, ks);  // S = Q K^T
        wg_commit();
        wgmma_64x64x64_ss<0, 0>(dp, dos, vs);  // dP = dO V^T, multiplied while P is formed
        wg_commit();
        wg_wait<1>();
        wg_hold(s);
        dq_probs(s, lA, lB, sl2, kb == qb, kb * FA_BR, rowA, rowB, T, c);
        wg_wait<0>();
        wg_hold(dp);
        dq_dscores(dp, s, dA, dB);
        unsigned dsa[KC][4];
        frags_of(dsa, dp);
        wg_fence();
        wgmma_64x64x64<1, 1>(acc, dsa, ks);  // dQ += dS K
        wg_commit_wait();
        wg_hold(acc);
        wg_hold(dsa);
        __syncthreads();  // stage st is refilled by the next iteration
    }
    store_dqkv_rows<D>(acc, dqkv, (long long)(H + 2 * Hkv) * D, b, T, qb * FA_BR + warp * 16, h * D, scale, true,
                       cos_t, sin_t, g, c);
#else
    __trap();
#endif
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

// ---- the SwiGLU backward inside its GEMM (wgmma and TMA, sm_90a) -----------------------------------
// In the backward of the MLP, dm = dy Wd (dy (N, C): the gradient of the down branch; Wd (C, F): the
// down projection) is a GEMM whose output only the SwiGLU backward reads. swiglu_bwd_gemm computes a
// 128 x 128 tile of dm in float32 registers and applies the SwiGLU backward to it there: dgate and dup
// into dgu, and m = silu(gate) * up again (bit-identical to the forward's, for the down projection's
// weight gradient), as swiglu_bwd_bf16 does. dm never goes to memory (nor through bf16).
//
// Persistent: a block per multiprocessor takes tiles blockIdx.x, + gridDim.x, ... Its 288 threads:
// - warp 8, the producer: one lane copies the operands' k steps (64 wide) into a ring of SG_STAGES
//   shared-memory stages by TMA (cp.async.bulk.tensor, 128-byte swizzle: the layout wgmma reads),
//   a stage's "full" mbarrier counting the bytes in, its "empty" one the warpgroup done with it.
//   It runs ahead into the next tile while the warpgroups finish the last one.
// - warps 0-7, two warpgroups in ping-pong (sg_products): warpgroup w multiplies every other tile, all
//   its 128 rows by its 128 columns (wgmma.m64n128k16 on each 64-row half, both operands from shared
//   memory), then runs the epilogue while the other warpgroup multiplies the next tile. (An earlier
//   ping-pong on 64-row tiles was slower than both warpgroups on one tile: one m64n128 product at a time
//   did not keep the tensor cores busy, and every 64 rows loaded the weight tile again.)
// Operands: dy, and wdt, the fused kernel's image of Wd: transposed (F, C; k contiguous, as wgmma
// reads shared memory untransposed) and its rows permuted by 128-row block (wdt_image): hidden column
// j of a tile is row sg_row(j) of the staged tile, i.e. accumulator column n = sg_row(j). The wgmma C
// layout gives lane l of a warp the accumulator columns n = 8 nc + 2 (l % 4) + e (nc the 8-column chunk,
// e = 0, 1), which sg_row maps to hidden columns 32 (nc / 4) + 8 (l % 4) + 2 (nc % 4) + e: each lane
// holds 8 consecutive hidden columns of each 32-column group, so the epilogue reads gate/up and writes
// dgate, dup and m with 16-byte accesses.
// The epilogue's data moves by TMA too, per warpgroup and quarter of its tile (64 rows x 64 hidden columns),
// through two buffers: a quarter's gate and up come into shared memory (the first half's two while the
// tile is multiplied, each of the second half's once the first half's quarter in its buffer has left), the
// epilogue writes d(gate) and d(up) over them and m beside them, and TMA stores take them to memory.
// Needs C % 64 == 0 and F % 128 == 0 (the engine checks); rows past N are zeros (TMA fills them) in the
// products, and TMA stores leave them out.
#define SG_BK 64
#define SG_STAGES 4
// shared memory: 1 KiB alignment + SG_STAGES x 32 KiB, then per kernel the epilogue's boxes and the
// mbarriers (engine.py: SWIGLU_FWD_GEMM_SMEM, SWIGLU_BWD_GEMM_SMEM, QKV_ROPE_GEMM_SMEM)

// Tile column j (0..127) -> the row n of the staged Wd^T tile that holds it.
__device__ __forceinline__ int sg_row(int j) {
    return ((((j >> 5) << 2) + ((j >> 1) & 3)) << 3) + (((j >> 3) & 3) << 1) + (j & 1);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d (64 x N, float32, this thread's N/2 values in the C layout) += A (64 x 16) B (16 x N), both from
// shared memory (descriptors; K-major). Asynchronous, as wgmma_64x64x16.
__device__ __forceinline__ void wgmma_ss(float (&d)[16][4], unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
          "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
          "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
          "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
          "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "l"(a), "l"(b));
}
// Wait until the mbarrier at shared address `bar` completes the phase of this parity.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_init(unsigned bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// Before a thread's first copy through the tensor map at `map` (kernel-argument memory written by the host).
__device__ __forceinline__ void tma_acquire(const void* map) {
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(map) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// The box at (c0 inner, c1 outer) of the 2-D tensor map at `map` (a global address) into shared memory.
__device__ __forceinline__ void tma_2d(unsigned dst, const void* map, int c0, int c1, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
// The 5-D box at (c0, 0, 0, 0, c4) of the tensor map at `map` into shared memory.
__device__ __forceinline__ void tma_5d(unsigned dst, const void* map, int c0, int c4, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3, %3, %3, %4}], [%5];\n"
                 ::"r"(dst), "l"(map), "r"(c0), "r"(0), "r"(c4), "r"(bar) : "memory");
}
// Shared memory at `src` -> the box at (c0, c1) of the 2-D tensor map at `map` (rows past its edge are
// not written), in the issuing thread's current bulk group.
__device__ __forceinline__ void tma_store_2d(const void* map, int c0, int c1, unsigned src) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
                 ::"l"(map), "r"(c0), "r"(c1), "r"(src) : "memory");
}
// The same into the box at (c0, c1, c2) of a 3-D tensor map.
__device__ __forceinline__ void tma_store_3d(const void* map, int c0, int c1, int c2, unsigned src) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n"
                 ::"l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(src) : "memory");
}
// 16 or 4 bytes at a shared-memory address (the epilogues' boxes).
__device__ __forceinline__ void lds128(unsigned (&v)[4], unsigned a) {
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "r"(a));
}
__device__ __forceinline__ void sts128(unsigned a, const unsigned (&v)[4]) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]));
}
__device__ __forceinline__ void sts32(unsigned a, unsigned v) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(a), "r"(v));
}
__device__ __forceinline__ void bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The pieces the fused kernels share: the ring's mbarriers, the producer's loop and a warpgroup's products
// for one tile. A stage holds the tile's 128 rows of the left operand (at 0) and its 128 rows of the right
// one (at SG_TILE), 64 k each: 16 KiB each, 128-byte swizzled.
#define SG_TILE (128 * SG_BK * 2)
#define SG_STAGE (2 * SG_TILE)

// Thread 0: the stages' "full" mbarriers (one arrival: the producer's, plus the bytes) and "empty" ones
// (one arrival: the warpgroup that multiplied from the stage), then `extra` more mbarriers of one arrival
// right after the empty ones (a kernel's own), and the fence that shows them to the TMA unit.
__device__ __forceinline__ void sg_init_ring(unsigned full, unsigned empty, int extra = 0) {
    for (int s = 0; s < SG_STAGES; ++s) {
        mbar_init(full + 8 * s, 1);
        mbar_init(empty + 8 * s, 1);
    }
    for (int i = 0; i < extra; ++i) mbar_init(empty + 8 * (SG_STAGES + i), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The producer lane: acquire the operands' tensor maps, then for each of this block's tiles (blockIdx.x,
// + gridDim.x, ...) and each of its KT k steps, wait until the next stage is free, announce its bytes, and
// have `issue(tile, kt, stage address, full mbarrier)` start the copies into it.
template <typename Issue>
__device__ __forceinline__ void sg_produce(const void* a_map, const void* b_map, int tiles, int KT, unsigned stages,
                                           unsigned full, unsigned empty, Issue issue) {
    tma_acquire(a_map);
    tma_acquire(b_map);
    int g = 0;  // k steps issued, over all tiles: stage g % SG_STAGES, its use number g / SG_STAGES
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x)
        for (int kt = 0; kt < KT; ++kt, ++g) {
            const int s = g % SG_STAGES;
            mbar_wait(empty + 8 * s, ((g / SG_STAGES) & 1) ^ 1);  // the stage's previous use is done
            mbar_expect(full + 8 * s, SG_STAGE);
            issue(tile, kt, stages + s * SG_STAGE, full + 8 * s);
        }
}

// How many of the `tiles` this block takes (tiles blockIdx.x, + gridDim.x, ...).
__device__ __forceinline__ int sg_block_tiles(int tiles) {
    return (tiles - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
}

// Warpgroup wg (thread t of it), ping-pong: it multiplies whole tiles, the block's tiles k = wg, wg + 2, ...
// of its n (tile k = blockIdx.x + k gridDim.x), so that one warpgroup's epilogue runs while the other
// multiplies. acc[i] = rows 64 i .. 64 i + 63 of tile k times its 128 columns, over the KT k steps of the
// ring from step k KT on: two wgmma per 16 k, sharing the right operand. The warpgroups take turns at
// issuing their products (named barriers 4 and 5; a turn passes once the last k step is issued, while it
// still runs), so the stages are consumed in the producer's order. Each stage is handed back (its empty
// mbarrier) once the products from it are done. `late()` runs once k step max(KT - 3, 0) is issued.
template <typename Late>
__device__ __forceinline__ void sg_products(float (&acc)[2][16][4], int k, int n, int KT, unsigned stages,
                                            unsigned full, unsigned empty, int wg, int t, Late late) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int c = 0; c < 16; ++c) acc[i][c][0] = acc[i][c][1] = acc[i][c][2] = acc[i][c][3] = 0.f;
    int g = k * KT;
    if (k > 0) bar_sync(4 + wg, 256);  // the other warpgroup has issued tile k - 1's products
    for (int kt = 0; kt < KT; ++kt, ++g) {
        const int s = g % SG_STAGES;
        mbar_wait(full + 8 * s, (g / SG_STAGES) & 1);
        const unsigned as = stages + s * SG_STAGE, bs = as + SG_TILE;
        wg_fence();
#pragma unroll
        for (int kc = 0; kc < SG_BK / 16; ++kc) {
            wgmma_ss(acc[0], wg_desc(as + kc * 32, 1), wg_desc(bs + kc * 32, 1));
            wgmma_ss(acc[1], wg_desc(as + SG_TILE / 2 + kc * 32, 1), wg_desc(bs + kc * 32, 1));
        }
        wg_commit();
        if (kt == KT - 1 && k + 1 < n) bar_arrive(4 + (wg ^ 1), 256);  // the other warpgroup's turn
        if (kt == max(KT - 3, 0)) late();
        wg_wait<1>();  // step g - 1 done: its stage is free
        wg_hold(acc[0]);
        wg_hold(acc[1]);
        if (kt > 0 && t == 0) mbar_arrive(empty + 8 * ((g - 1) % SG_STAGES));
    }
    wg_wait<0>();
    wg_hold(acc[0]);
    wg_hold(acc[1]);
    if (t == 0) mbar_arrive(empty + 8 * ((g - 1) % SG_STAGES));
}
#endif

extern "C" __global__ void __launch_bounds__(288, 1) swiglu_bwd_gemm(const void* __restrict__ dy_map,
                                                                    const void* __restrict__ wdt_map, int wdt_row0,
                                                                    const void* __restrict__ gu_map,
                                                                    const void* __restrict__ dgu_map,
                                                                    const void* __restrict__ m_map, int N, int C, int F) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BOX = 64 * 64 * 2;
    extern __shared__ __align__(128) unsigned char sg_smem[];
    const int wg = threadIdx.x >> 7, t = threadIdx.x & 127, warp = t >> 5, lane = t & 31, q = lane & 3;
    const unsigned stages = (smem_u32(sg_smem) + 1023u) & ~1023u, gus = stages + SG_STAGES * SG_STAGE;
    const unsigned ms = gus + 8 * BOX, full = ms + 4 * BOX, empty = full + 8 * SG_STAGES;
    const unsigned gubar = empty + 8 * SG_STAGES + 16 * wg;  // this warpgroup's two: buffer 0's, buffer 1's
    const int KT = C / SG_BK, ncols = F / 128, tiles = (N + 127) / 128 * ncols;
    if (threadIdx.x == 0) sg_init_ring(full, empty, 4);  // and the 4 gate/up buffers' mbarriers
    __syncthreads();
    if (wg == 2) {  // the producer warp
        if (threadIdx.x == 256)
            sg_produce(dy_map, wdt_map, tiles, KT, stages, full, empty,
                       [&](int tile, int kt, unsigned dst, unsigned bar) {
                tma_2d(dst, dy_map, kt * SG_BK, tile / ncols * 128, bar);
                tma_2d(dst + SG_TILE, wdt_map, kt * SG_BK, wdt_row0 + tile % ncols * 128, bar);
            });
        return;
    }
    if (t == 0) tma_acquire(gu_map), tma_acquire(dgu_map), tma_acquire(m_map);
    // This warpgroup's boxes hold two quarters of its tile (64 rows x 64 hidden columns) at a time, in two
    // buffers: buffer j has the gate box gb + j BOX, the up box gb + (2 + j) BOX (d(gate) and d(up) then
    // written over them) and the m box mb + j BOX. They are 128-byte swizzled (16-byte chunk c of row r at
    // chunk c ^ (r % 8)), so the 8 rows that a warp's access covers fall in different banks.
    const unsigned gb = gus + wg * 4 * BOX, mb = ms + wg * 2 * BOX;
    const int n = sg_block_tiles(tiles);
    for (int k = wg; k < n; k += 2) {
        const int tile = blockIdx.x + k * gridDim.x, row0 = tile / ncols * 128, col0 = tile % ncols * 128;
        auto fetch = [&](int j, int r) {  // gate/up of rows r .. r + 63, hidden columns col0 + 64 j .., into buffer j
            mbar_expect(gubar + 8 * j, 2 * BOX);
            tma_2d(gb + j * BOX, gu_map, col0 + 64 * j, r, gubar + 8 * j);
            tma_2d(gb + (2 + j) * BOX, gu_map, F + col0 + 64 * j, r, gubar + 8 * j);
        };
        float acc[2][16][4];
        // three k steps before the end, the first half's quarters come in (waiting for the last tile's stores
        // at the first k step stalled the products: 0.35 against 0.30 ms at B64xT512, before the ping-pong)
        sg_products(acc, k, n, KT, stages, full, empty, wg, t, [&] {
            if (t == 0) {
                asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // the boxes are free
                fetch(0, row0);
                fetch(1, row0);
            }
        });
        // quarter (half, j): rows row0 + 64 half .., hidden columns col0 + 64 j ..; the second half's quarter
        // j comes into buffer j as soon as the first half's results have left it, while the warpgroup works
        // on the other buffer (by halves, the second half's fetch waited for both boxes' stores and was not
        // hidden at all: 0.267 against 0.253 ms at B64xT512)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                mbar_wait(gubar + 8 * j, half);  // each buffer's mbarrier completes two phases a tile
#pragma unroll
                for (int h = 0; h < 2; ++h) {  // this lane's rows rl and rl + 8; per 32-column group gi, 8 columns
                    const int rl = warp * 16 + (lane >> 2) + 8 * h;
#pragma unroll
                    for (int gj = 0; gj < 2; ++gj) {  // group gi = 2 j + gj: columns 32 gi + 8 q .. + 7, chunk 4 gj + q
                        const int gi = 2 * j + gj;
                        const unsigned off = j * BOX + rl * 128 + (((4 * gj + q) ^ (rl & 7)) << 4);
                        const unsigned a = gb + off;
                        unsigned gw[4], uw[4];
                        lds128(gw, a);
                        lds128(uw, a + 2 * BOX);
                        unsigned og[4], ou[4], om[4];
#pragma unroll
                        for (int e = 0; e < 4; ++e) {  // hidden columns + 2e, + 2e + 1: accumulator chunk 4 gi + e
                            float dg0, du0, dg1, du1;
                            const float g0 = lo_bf(gw[e]), g1 = hi_bf(gw[e]), u0 = lo_bf(uw[e]), u1 = hi_bf(uw[e]);
                            swiglu_grad(acc[half][4 * gi + e][2 * h], g0, u0, dg0, du0);
                            swiglu_grad(acc[half][4 * gi + e][2 * h + 1], g1, u1, dg1, du1);
                            og[e] = pack2(dg0, dg1);
                            ou[e] = pack2(du0, du1);
                            om[e] = pack2(silu_f(g0) * u0, silu_f(g1) * u1);
                        }
                        sts128(a, og);
                        sts128(a + 2 * BOX, ou);
                        sts128(mb + off, om);
                    }
                }
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the writes, seen by the TMA stores
                bar_sync(2 + wg, 128);
                if (t == 0) {
                    const int r = row0 + 64 * half;
                    if (r < N) {
                        tma_store_2d(dgu_map, col0 + 64 * j, r, gb + j * BOX);
                        tma_store_2d(dgu_map, F + col0 + 64 * j, r, gb + (2 + j) * BOX);
                        tma_store_2d(m_map, col0 + 64 * j, r, mb + j * BOX);
                    }
                    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
                    if (half == 0) {
                        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
                        fetch(j, row0 + 64);
                    }
                }
            }
    }
    if (t == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#else
    __trap();  // built for another target: the engine launches this kernel only on sm_90a builds
#endif
}

// ---- the gate/up projection with the SwiGLU forward inside (wgmma and TMA, sm_90a) -----------------
// gu = xhat2 Wgu^T (xhat2 (N, C): the second norm's output; Wgu (2F, C): gate rows, then up rows) and m =
// silu(gate) * up, in one kernel: swiglu_fwd_bf16 no longer reads gu back. The design is swiglu_bwd_gemm's
// (persistent, a producer warp feeding the ring by TMA, two warpgroups in ping-pong on 128 x 128 tiles),
// without the gate/up prefetch. A tile is 128 rows x 64 hidden units: its 128 right-operand rows are the
// units' 64 gate rows, then their 64 up rows, so a lane holds the gate and up of the same units. The order of the
// rows within each 64 is the lanes': accumulator column n = 8 nc + 2 (l % 4) + e of lane l
// (nc < 8) is gate unit 16 (l % 4) + 2 nc + e, column 64 + n the same unit's up; each lane then holds 16
// consecutive units of its two rows and stores gate, up and m 16 bytes at a time. That order is a view of
// Wgu, not a copy: the tensor map (tma.gate_up_map) is 5-D, (k, e, l % 4, nc, block of 64 units), with
// the row strides 1, 16, 2 and 64, and one box of (64, 2, 4, 8, 1) is 64 rows in the lanes' order.
// gate and up are rounded to bf16 before m is computed from them, as swiglu_fwd_bf16 does from the stored
// gu: m is bit-identical to the unfused path's, and to what the backward recomputes.
// The outputs leave by TMA stores: a warpgroup writes its tile's gate, up and m into shared memory (64 x 64
// boxes, two per output) and one of its threads hands the boxes to the TMA unit, which writes them to
// memory. (Written with st.global from the registers instead, before the ping-pong, the epilogue took as
// long as the products: every block reached it at the same moment, and the stores of all of them then
// queued for memory while the tensor cores waited.)
// Needs C % 64 == 0 and F % 64 == 0.

extern "C" __global__ void __launch_bounds__(288, 1) swiglu_fwd_gemm(const void* __restrict__ x_map,
                                                                    const void* __restrict__ w_map,
                                                                    const void* __restrict__ gu_map,
                                                                    const void* __restrict__ m_map, int N, int C, int F) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int OUT = 64 * 64 * 2;  // one 64 x 64 bf16 box of the output: 8 KiB
    extern __shared__ __align__(128) unsigned char sg_smem[];
    const int wg = threadIdx.x >> 7, t = threadIdx.x & 127, warp = t >> 5, lane = t & 31, q = lane & 3;
    const unsigned stages = (smem_u32(sg_smem) + 1023u) & ~1023u, outs = stages + SG_STAGES * SG_STAGE;
    const unsigned full = outs + 12 * OUT, empty = full + 8 * SG_STAGES;
    const int KT = C / SG_BK, units = F / 64, tiles = (N + 127) / 128 * units;
    if (threadIdx.x == 0) sg_init_ring(full, empty);
    __syncthreads();
    if (wg == 2) {  // the producer warp
        if (threadIdx.x == 256)
            sg_produce(x_map, w_map, tiles, KT, stages, full, empty,
                       [&](int tile, int kt, unsigned dst, unsigned bar) {
                const int u = tile % units;
                tma_2d(dst, x_map, kt * SG_BK, tile / units * 128, bar);
                tma_5d(dst + SG_TILE, w_map, kt * SG_BK, u, bar);                       // gate rows
                tma_5d(dst + SG_TILE + SG_TILE / 2, w_map, kt * SG_BK, units + u, bar);  // up rows
            });
        return;
    }
    if (t == 0) tma_acquire(gu_map), tma_acquire(m_map);
    // This warpgroup's tile leaves through shared memory: per 64-row half, gate, up and m, a 64 x 64 box each,
    // in the 128-byte swizzle that the TMA store reads (16-byte chunk c of row r at chunk c ^ (r % 8): the 8
    // rows that a warp's store covers fall in different banks).
    const unsigned out = outs + wg * 6 * OUT;
    const int n = sg_block_tiles(tiles);
    for (int k = wg; k < n; k += 2) {
        const int tile = blockIdx.x + k * gridDim.x, row0 = tile / units * 128, unit0 = tile % units * 64;
        float acc[2][16][4];
        sg_products(acc, k, n, KT, stages, full, empty, wg, t, [] {});
        if (t == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // its last tile's boxes are out
        bar_sync(2 + wg, 128);
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // this lane's rows rl and rl + 8 of the half, units unit0 + 16 q .. + 15
                const int rl = warp * 16 + (lane >> 2) + 8 * h;
#pragma unroll
                for (int v = 0; v < 2; ++v) {  // 8 units at a time: one 16-byte chunk of each output
                    unsigned og[4], ou[4], om[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {  // units 16 q + 2 nc, + 1, nc = 4 v + i
                        const int nc = 4 * v + i;
                        og[i] = pack2(acc[half][nc][2 * h], acc[half][nc][2 * h + 1]);
                        ou[i] = pack2(acc[half][nc + 8][2 * h], acc[half][nc + 8][2 * h + 1]);
                        om[i] = pack2(silu_f(lo_bf(og[i])) * lo_bf(ou[i]), silu_f(hi_bf(og[i])) * hi_bf(ou[i]));
                    }
                    const unsigned a = out + half * 3 * OUT + rl * 128 + (((2 * q + v) ^ (rl & 7)) << 4);
                    sts128(a, og);
                    sts128(a + OUT, ou);
                    sts128(a + 2 * OUT, om);
                }
            }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the writes, seen by the TMA stores
        bar_sync(2 + wg, 128);
        if (t == 0) {
            for (int half = 0; half < 2; ++half) {
                const int r = row0 + 64 * half;
                if (r >= N) break;  // rows past N are left out
                const unsigned o = out + half * 3 * OUT;
                tma_store_2d(gu_map, unit0, r, o);
                tma_store_2d(gu_map, F + unit0, r, o + OUT);
                tma_store_2d(m_map, unit0, r, o + 2 * OUT);
            }
            asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        }
    }
    if (t == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#else
    __trap();  // built for another target: the engine launches this kernel only on sm_90a builds
#endif
}

// ---- the qkv projection with RoPE and the attention layouts inside (wgmma and TMA, sm_90a) -----------
// qkv = xhat1 Wqkv^T (xhat1 (N, C): the first norm's output, rows n = b T + t; Wqkv ((H + 2 Hkv) 64, C):
// q rows, k rows, v rows), then q and k rotated by RoPE (half split: d and d + 32 of a head, by cos/sin
// (T, 32) at position t) and every head written in the attention kernels' layouts, q (B, H, T, 64) and
// k, v (B, Hkv, T, 64), in one kernel: qkv_rope_split_bf16 no longer reads the qkv product back. The
// design is swiglu_fwd_gemm's (persistent, a producer warp feeding the ring by TMA, two warpgroups in
// ping-pong on 128 x 128 tiles); a tile is 128 rows x two heads, the weight rows in their own order. In
// the wgmma C layout lane l holds the columns 8 nc + 2 (l % 4) + e, so head dimension d (chunk nc = d / 8
// of the head) and its partner d + 32 (chunk nc + 4) are in the same lane: the rotation needs no exchange.
// As in the unfused path, each product is rounded to bf16 before it is rotated, so q/k/v are bit-identical
// to qkv_rope_split_bf16 of the same bf16 product.
// A warpgroup writes its tile into four 64 x 64 boxes of shared memory (two heads of each 64-row half;
// 128-byte swizzle), and TMA stores move each box to its head through 3-D maps (64, T, B heads)
// (tma.heads_map): a box at (0, t0, b H + h) is positions t0 .. t0 + 63 of head h of sequence b.
// Needs head size 64, C % 64 == 0 and T % 64 == 0 (a warpgroup's 64 rows then lie in one sequence); a
// tile's second head past the last v head is not stored, nor rows past N.
extern "C" __global__ void __launch_bounds__(288, 1) qkv_rope_gemm(const void* __restrict__ x_map,
                                                                  const void* __restrict__ w_map,
                                                                  const void* __restrict__ q_map,
                                                                  const void* __restrict__ k_map,
                                                                  const void* __restrict__ v_map,
                                                                  const float* __restrict__ cos_t,
                                                                  const float* __restrict__ sin_t, int N, int C,
                                                                  int T, int H, int Hkv) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BOX = 64 * 64 * 2;  // one head's 64 rows, bf16: 8 KiB
    extern __shared__ __align__(128) unsigned char sg_smem[];
    const int wg = threadIdx.x >> 7, t = threadIdx.x & 127, warp = t >> 5, lane = t & 31, q = lane & 3;
    const unsigned stages = (smem_u32(sg_smem) + 1023u) & ~1023u, outs = stages + SG_STAGES * SG_STAGE;
    const unsigned full = outs + 8 * BOX, empty = full + 8 * SG_STAGES;
    const int heads = H + 2 * Hkv, ncols = (heads + 1) / 2, KT = C / SG_BK, tiles = (N + 127) / 128 * ncols;
    if (threadIdx.x == 0) sg_init_ring(full, empty);
    __syncthreads();
    if (wg == 2) {  // the producer warp
        if (threadIdx.x == 256)
            sg_produce(x_map, w_map, tiles, KT, stages, full, empty,
                       [&](int tile, int kt, unsigned dst, unsigned bar) {
                tma_2d(dst, x_map, kt * SG_BK, tile / ncols * 128, bar);
                tma_2d(dst + SG_TILE, w_map, kt * SG_BK, tile % ncols * 128, bar);
            });
        return;
    }
    if (t == 0) tma_acquire(q_map), tma_acquire(k_map), tma_acquire(v_map);
    const unsigned out = outs + wg * 4 * BOX;  // this warpgroup's: per 64-row half, the two heads
    const int n = sg_block_tiles(tiles);
    for (int k = wg; k < n; k += 2) {
        const int tile = blockIdx.x + k * gridDim.x, row0 = tile / ncols * 128, head0 = tile % ncols * 2;
        float acc[2][16][4];
        sg_products(acc, k, n, KT, stages, full, empty, wg, t, [] {});
        if (t == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // its last tile's boxes are out
        bar_sync(2 + wg, 128);
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // this lane's rows rl and rl + 8; head dimensions 8 j + 2 q + e, + 32
                const int rl = warp * 16 + (lane >> 2) + 8 * h, pos = (row0 + 64 * half + rl) % T;
                float2 cs[4], sn[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    cs[j] = *reinterpret_cast<const float2*>(cos_t + pos * 32 + 8 * j + 2 * q);
                    sn[j] = *reinterpret_cast<const float2*>(sin_t + pos * 32 + 8 * j + 2 * q);
                }
#pragma unroll
                for (int hd = 0; hd < 2; ++hd) {
                    const bool rotate = head0 + hd < H + Hkv;  // q and k heads; v as it is
                    const unsigned row = out + (2 * half + hd) * BOX + rl * 128 + 4 * q;
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const unsigned w1 = pack2(acc[half][8 * hd + j][2 * h], acc[half][8 * hd + j][2 * h + 1]);
                        const unsigned w2 = pack2(acc[half][8 * hd + j + 4][2 * h],
                                                  acc[half][8 * hd + j + 4][2 * h + 1]);
                        unsigned y1 = w1, y2 = w2;
                        if (rotate) {
                            const float a0 = lo_bf(w1), a1 = hi_bf(w1), b0 = lo_bf(w2), b1 = hi_bf(w2);
                            y1 = pack2(a0 * cs[j].x - b0 * sn[j].x, a1 * cs[j].y - b1 * sn[j].y);
                            y2 = pack2(b0 * cs[j].x + a0 * sn[j].x, b1 * cs[j].y + a1 * sn[j].y);
                        }
                        sts32(row + ((j ^ (rl & 7)) << 4), y1);
                        sts32(row + (((j + 4) ^ (rl & 7)) << 4), y2);
                    }
                }
            }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the writes, seen by the TMA stores
        bar_sync(2 + wg, 128);
        if (t == 0) {
            for (int half = 0; half < 2; ++half) {
                const int r = row0 + 64 * half;
                if (r >= N) break;  // rows past N are left out
                for (int hd = 0; hd < 2; ++hd) {
                    const int hh = head0 + hd;
                    if (hh >= heads) break;
                    const void* map = hh < H ? q_map : hh < H + Hkv ? k_map : v_map;
                    const int nh = hh < H ? H : Hkv, hl = hh < H ? hh : hh < H + Hkv ? hh - H : hh - H - Hkv;
                    tma_store_3d(map, 0, r % T, r / T * nh + hl, out + (2 * half + hd) * BOX);
                }
            }
            asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        }
    }
    if (t == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#else
    __trap();  // built for another target: the engine launches this kernel only on sm_90a builds
#endif
}




// The fused kernel's image of the down projections: `count` matrices Wd (rows x cols, bf16; cols % 128
// == 0) at base + offs[z] -> dst, each transposed (cols x rows) with its rows permuted within blocks of
// 128: column c of Wd becomes row (c / 128) 128 + sg_row(c % 128). Grid (ceil(cols / 32), ceil(rows / 32),
// count), block (32, 8): a 32 x 32 tile through shared memory (padded against bank conflicts), so reads
// and writes go along rows.
extern "C" __global__ void wdt_image(const bf16* __restrict__ base, const long long* __restrict__ offs,
                                     bf16* __restrict__ dst, int rows, int cols) {
    __shared__ bf16 tile[32][34];
    const bf16* src = base + offs[blockIdx.z];
    bf16* out = dst + (long long)blockIdx.z * rows * cols;
    const int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32, x = threadIdx.x;
    for (int i = threadIdx.y; i < 32; i += 8)
        if (r0 + i < rows && c0 + x < cols) tile[i][x] = src[(long long)(r0 + i) * cols + c0 + x];
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += 8) {
        const int c = c0 + i;
        if (c < cols && r0 + x < rows) out[(long long)((c & ~127) + sg_row(c & 127)) * rows + r0 + x] = tile[x][i];
    }
}
