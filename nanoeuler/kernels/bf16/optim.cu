// The optimizer: the gradient norm, AdamW with clipping, and the bf16 GEMM image of the weights (with
// the norm gains folded in). Reference: nanoeuler.optim.AdamW.step, clip_grad_norm.

#include "common.cuh"

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

// A sum over the blocks of a grid in a fixed order, where float atomics would add in the order the blocks
// happen to finish, which varies from run to run: two data-parallel ranks given the same gradients would
// then compute norms that differ in the last bit and drift apart. Each block of row blockIdx.y of the
// grid writes its sum s (held by every thread) to part[y * gridDim.x + x]; the last of the row's blocks to
// arrive (an integer counter, count[y]) adds the row's partials up in block order, out[y] += that, and
// sets the counter back to 0 for the next launch. part and count are the launcher's scratch.
__device__ __forceinline__ void ordered_sum(float s, float* __restrict__ part, unsigned* __restrict__ count,
                                            float* __restrict__ out, float* red) {
    __shared__ bool last;
    const unsigned nb = gridDim.x, row = blockIdx.y;
    if (threadIdx.x == 0) {
        part[row * nb + blockIdx.x] = s;
        __threadfence();  // the partial is visible before the counter says so
        last = atomicAdd(count + row, 1u) == nb - 1;
    }
    __syncthreads();
    if (!last) return;  // (the whole block returns: `last` is shared)
    __threadfence();
    const volatile float* p = part + row * nb;  // volatile: read from L2, not a stale L1 line
    float t = 0.f;
    for (unsigned i = threadIdx.x; i < nb; i += blockDim.x) t += p[i];
    t = block_sum(t, red);
    if (threadIdx.x == 0) {
        out[row] += t;
        count[row] = 0u;
    }
}

// acc[0] += sum g^2 (acc zeroed by the caller), in a fixed order (ordered_sum). blockDim 256.
extern "C" __global__ void __launch_bounds__(256) sumsq(const float* __restrict__ g, long long n,
                                                        float* __restrict__ acc, float* __restrict__ part,
                                                        unsigned* __restrict__ count) {
    __shared__ float red[32];
    float s = 0.f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        s = fmaf(g[i], g[i], s);
    s = block_sum(s, red);
    ordered_sum(s, part, count, acc, red);
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

// Gradient accumulation over micro-batches: acc += g (a flat range; 16-byte accesses, a scalar tail), and
// loss_acc[0] += loss[0]. Each micro-batch's g is a whole gradient (its loss already carries the step's
// normalisation), so the sum is the gradient of the concatenated batch.
extern "C" __global__ void __launch_bounds__(256) grad_accumulate(const float* __restrict__ g, float* __restrict__ acc,
                                                                  long long n, const float* __restrict__ loss,
                                                                  float* __restrict__ loss_acc) {
    const long long n4 = n >> 2, stride = (long long)gridDim.x * blockDim.x, i0 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long i = i0; i < n4; i += stride) {
        const float4 a = reinterpret_cast<const float4*>(g)[i];
        float4 b = reinterpret_cast<float4*>(acc)[i];
        b.x += a.x, b.y += a.y, b.z += a.z, b.w += a.w;
        reinterpret_cast<float4*>(acc)[i] = b;
    }
    for (long long i = 4 * n4 + i0; i < n; i += stride) acc[i] += g[i];
    if (i0 == 0) loss_acc[0] += loss[0];
}

// ---- Muon (reference: nanoeuler.optim.Muon) ---------------------------------------------------------
// One launch covers one shape of hidden matrix in every layer (all layers' q, say): blockIdx.y is the
// layer l, whose matrix of n elements starts at l * stride in the flat buffers (float32) and at
// l * xstride in the bf16 Newton-Schulz operand x.

// Clip g as adamw_clip_bf16 does (c from sumsq_acc), then Nesterov momentum:
//   m = mu m + c g ; u = c g + mu m ; x = bf16(u) ; ss[l] += sum u^2   (ss zeroed by the caller; the sum
//   in a fixed order, ordered_sum, so that every rank scales u alike)
extern "C" __global__ void __launch_bounds__(256) muon_momentum(
    const float* __restrict__ g, float* __restrict__ m, bf16* __restrict__ x, long long n, long long stride,
    long long xstride, float* __restrict__ ss, const float* __restrict__ sumsq_acc, float max_norm, float mu,
    float* __restrict__ part, unsigned* __restrict__ count) {
    __shared__ float red[32];
    const float norm = sqrtf(sumsq_acc[0]);
    const float c = (max_norm > 0.f && norm > max_norm && norm <= 3.0e38f) ? max_norm / (norm + 1e-6f) : 1.f;
    const long long l = blockIdx.y;
    g += l * stride, m += l * stride, x += l * xstride;
    float s = 0.f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float gi = c * g[i], mi = fmaf(mu, m[i], gi), u = fmaf(mu, mi, gi);
        m[i] = mi;
        x[i] = f2bf(u);
        s = fmaf(u, u, s);
    }
    s = block_sum(s, red);
    ordered_sum(s, part, count, ss, red);
}

// x = bf16(x / (sqrt(ss[l]) + 1e-7)): each matrix scaled to Frobenius norm 1, so that its singular values
// lie in (0, 1], where the Newton-Schulz iteration converges.
extern "C" __global__ void __launch_bounds__(256) muon_normalize(bf16* __restrict__ x, long long n, long long xstride,
                                                                 const float* __restrict__ ss) {
    const long long l = blockIdx.y;
    const float r = 1.f / (sqrtf(ss[l]) + 1e-7f);
    x += l * xstride;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = f2bf(bf2f(x[i]) * r);
}

// The update from the orthogonalised o (bf16): p = p * decay - hyper[0] * scale * o, and the GEMM image
// pb = bf16(p * gain[e % C]) (gain of layer l at gain + l * gstride; null: none). hyper = (the group's lr,
// unused, its decay factor), on the device like AdamW's; decay is 1 where not `decayed`.
extern "C" __global__ void __launch_bounds__(256) muon_update(
    float* __restrict__ p, const bf16* __restrict__ o, bf16* __restrict__ pb, long long n, long long stride,
    long long ostride, const float* __restrict__ hyper, int decayed, float scale, const float* __restrict__ gain,
    long long gstride, int C) {
    const long long l = blockIdx.y;
    const float step = hyper[0] * scale, decay = decayed ? hyper[2] : 1.f;
    p += l * stride, pb += l * stride, o += l * ostride;
    if (gain) gain += l * gstride;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float pi = fmaf(p[i], decay, -step * bf2f(o[i]));
        p[i] = pi;
        pb[i] = f2bf(pi * gain_at(gain, C, i));
    }
}

// The Newton-Schulz step's polynomial before its product: b = cb * a + ca * I for `count` m x m bf16
// matrices (packed), so that the step's two remaining products (b += cc * a a, then x' = b x) need no
// copy of x for its linear term. Grid (blocks over one matrix, count): blockIdx.y is the matrix, so the
// row and column come from 32-bit arithmetic (m < 65536), once per 8 values (16-byte accesses) when
// m % 8 == 0, the engine's shapes; one value at a time otherwise. It runs 5 times a step for each of the
// 7 shapes, over every layer's m x m matrix: 64-bit divisions per value made it compute-bound.
__device__ __forceinline__ float poly_one(float a, unsigned r, unsigned c, float ca, float cb) {
    return fmaf(cb, a, r == c ? ca : 0.f);
}

extern "C" __global__ void __launch_bounds__(256) muon_poly_init(const bf16* __restrict__ a, bf16* __restrict__ b,
                                                                 long long m, long long count, float ca, float cb) {
    const unsigned mu = (unsigned)m, mm = mu * mu, stride = gridDim.x * blockDim.x;
    a += (long long)blockIdx.y * mm, b += (long long)blockIdx.y * mm;
    if ((mu & 7u) == 0u) {
        const uint4* a8 = reinterpret_cast<const uint4*>(a);
        uint4* b8 = reinterpret_cast<uint4*>(b);
        for (unsigned j = blockIdx.x * blockDim.x + threadIdx.x; j < mm / 8u; j += stride) {
            const unsigned r = (8u * j) / mu, c = 8u * j - r * mu;  // values (r, c .. c+7)
            const uint4 v = a8[j];
            b8[j] = make_uint4(pack2(poly_one(lo_bf(v.x), r, c, ca, cb), poly_one(hi_bf(v.x), r, c + 1, ca, cb)),
                               pack2(poly_one(lo_bf(v.y), r, c + 2, ca, cb), poly_one(hi_bf(v.y), r, c + 3, ca, cb)),
                               pack2(poly_one(lo_bf(v.z), r, c + 4, ca, cb), poly_one(hi_bf(v.z), r, c + 5, ca, cb)),
                               pack2(poly_one(lo_bf(v.w), r, c + 6, ca, cb), poly_one(hi_bf(v.w), r, c + 7, ca, cb)));
        }
        return;
    }
    for (unsigned e = blockIdx.x * blockDim.x + threadIdx.x; e < mm; e += stride)
        b[e] = f2bf(poly_one(bf2f(a[e]), e / mu, e % mu, ca, cb));
}
