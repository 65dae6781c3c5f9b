// RMSNorm with its gain folded into the next GEMM's weights, forward and backward, and the folded
// weights' gradients. Reference: nanoeuler.model.layers.rmsnorm_*, folded_gain_grads.

#include "common.cuh"

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
// and at most 32 * 4 * RMS_V4 (1536: the 116M's 768 and the 270M's 1152), the row stays in registers
// (16-byte loads, RMS_V4 per lane at most); otherwise a scalar path reads it twice. xout may not alias x.
#define RMS_V4 12
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
// 32 * 4 * RB_VEC (1536) the row stays in registers, every load issued before the reduction: g as
// loaded (8-byte loads of bf16, 16 of float32) and xhat as its bf16 words, widened again for the second
// pass, so that a lane's 12 four-vectors fit its registers. Otherwise a scalar path reads the row twice.
#define RB_VEC 12
template <typename DY> struct Raw4;  // four values of a row as one load
template <> struct Raw4<bf16> {
    uint2 w;
    __device__ __forceinline__ void load(const bf16* p, int c) { w = reinterpret_cast<const uint2*>(p)[c]; }
    __device__ __forceinline__ float4 f() const { return make_float4(lo_bf(w.x), hi_bf(w.x), lo_bf(w.y), hi_bf(w.y)); }
};
template <> struct Raw4<float> {
    float4 v;
    __device__ __forceinline__ void load(const float* p, int c) { v = reinterpret_cast<const float4*>(p)[c]; }
    __device__ __forceinline__ float4 f() const { return v; }
};
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
        Raw4<DY> gr[RB_VEC];
        Raw4<bf16> hr[RB_VEC];
        float4 prev[RB_VEC];
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < RB_VEC; ++i) {
            const int c = lane + 32 * i;
            if (c < C4) {
                gr[i].load(g + off, c);
                hr[i].load(xhat + off, c);
                prev[i] = accumulate ? ld4(dx + off, c) : make_float4(0.f, 0.f, 0.f, 0.f);
                const float4 gv = gr[i].f(), hv = hr[i].f();
                dot = fmaf(gv.x, hv.x, fmaf(gv.y, hv.y, fmaf(gv.z, hv.z, fmaf(gv.w, hv.w, dot))));
            }
        }
        const float sm = rs * warp_sum(dot) / (float)C;
#pragma unroll
        for (int i = 0; i < RB_VEC; ++i) {
            const int c = lane + 32 * i;
            if (c < C4) {
                const float4 gv = gr[i].f(), hv = hr[i].f();
                float4 o;
                o.x = prev[i].x + (rs * gv.x - sm * hv.x);
                o.y = prev[i].y + (rs * gv.y - sm * hv.y);
                o.z = prev[i].z + (rs * gv.z - sm * hv.z);
                o.w = prev[i].w + (rs * gv.w - sm * hv.w);
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
