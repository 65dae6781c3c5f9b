// Cross-entropy over the K output heads: the loss and the logits' gradient in one pass per row.
// Reference: nanoeuler.model.layers.cross_entropy_*, transformer.mtp_cross_entropy.

#include "common.cuh"

// Per head k: scale[k] = w[k] / (n_valid_k * W) where W = the sum of w over the heads with any valid target
// (0 for a head without one, or of weight 0). w: the heads' loss weights this step, read from the device so
// that a captured step sees each step's. targets (N, K) int32, -1 ignored. One block of 1024 threads.
extern "C" __global__ void __launch_bounds__(1024) ce_head_scale(const int* __restrict__ targets,
                                                                 const float* __restrict__ w, float* __restrict__ scale,
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
        float total = 0.f;
        for (int k = 0; k < K; ++k) total += cnt[k] > 0.f ? w[k] : 0.f;
        for (int k = 0; k < K; ++k) scale[k] = cnt[k] > 0.f && w[k] > 0.f ? w[k] / (cnt[k] * total) : 0.f;
    }
}

// The log-sum-exp of one row of V bf16 logits, over the block in two passes (the max, then the sum of the
// exponentials), 4 values at a time when V % 4 == 0, with a scalar tail loop; every thread gets it. `red`
// holds 32 floats (block_max, block_sum).
__device__ __forceinline__ float row_lse(const bf16* zr, int V, float* red) {
    const int V4 = (V & 3) == 0 ? V / 4 : 0, tail = 4 * V4;
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
    return mx + logf(s);
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
    const float lse = row_lse(zr, V, red);
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

// ---- the sequence log-probability head (DPO): head 0 only ----
// Reference: nanoeuler.model.dpo (token_logps, sequence_logps, pair_loss, dpo_head_loss).

// Pass 1 over head 0's logits (R, V) bf16 of rows r0 .. r0+R-1: each row's log-probability of its target,
// tok[r] = z[t] - lse, and lse[r] for pass 2 (both 0 for rows without a target). grid (R,), blockDim 256.
extern "C" __global__ void __launch_bounds__(256) seq_logp_rows(const bf16* __restrict__ z, const int* __restrict__ targets,
                                                                float* __restrict__ tok, float* __restrict__ lse, int V, int K) {
    __shared__ float red[32];
    const long long r = blockIdx.x;
    const bf16* zr = z + r * V;
    const int t = targets[r * K];
    if (t < 0) {
        if (threadIdx.x == 0) tok[r] = 0.f, lse[r] = 0.f;
        return;
    }
    const float l = row_lse(zr, V, red);
    if (threadIdx.x == 0) {
        tok[r] = ld1(zr, t) - l;
        lse[r] = l;
    }
}

// log(1 + exp(x)) without overflow.
__device__ __forceinline__ float softplus(float x) { return fmaxf(x, 0.f) + log1pf(expf(-fabsf(x))); }

// The DPO pair loss of B = 2P sequences of T rows each (P chosen, then the P rejected in the same order):
//   logp[b] = sum_t tok[b T + t];  h_i = beta ((logp[i] - ref[i]) - (logp[P+i] - ref[P+i]))
//   loss[0] = sum_i w[i] ((1-eps) softplus(-h_i) + eps softplus(h_i))
//   dlogp[i] = beta dh_i, dlogp[P+i] = -beta dh_i,  dh_i = w[i] (-(1-eps) (1 - sigmoid(h_i)) + eps sigmoid(h_i))
// w[i] weighs pair i in the step's mean (1 / pairs of the whole step; 0 for a padding pair). One block of 1024.
extern "C" __global__ void __launch_bounds__(1024) dpo_pair_loss(
    const float* __restrict__ tok, const float* __restrict__ ref, const float* __restrict__ w, float* __restrict__ logp,
    float* __restrict__ dlogp, float* __restrict__ loss, int B, int T, float beta, float eps) {
    __shared__ float red[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int b = warp; b < B; b += nw) {  // a warp per sequence
        float s = 0.f;
        for (int t = lane; t < T; t += 32) s += tok[(long long)b * T + t];
        s = warp_sum(s);
        if (lane == 0) logp[b] = s;
    }
    __syncthreads();
    const int P = B / 2;
    float acc = 0.f;
    for (int i = threadIdx.x; i < P; i += blockDim.x) {
        const float h = beta * ((logp[i] - ref[i]) - (logp[P + i] - ref[P + i]));
        acc += w[i] * ((1.f - eps) * softplus(-h) + eps * softplus(h));
        const float sig = expf(-softplus(-h));
        const float dh = w[i] * (-(1.f - eps) * (1.f - sig) + eps * sig);
        dlogp[i] = beta * dh;
        dlogp[P + i] = -beta * dh;
    }
    acc = block_sum(acc, red);
    if (threadIdx.x == 0) loss[0] = acc;
}

// Pass 2 over head 0's logits (R, V) bf16 of rows r0 .. r0+R-1 (the same values as pass 1), overwritten in
// place by the loss's gradient: z[r, j] <- dlogp[b] ([j == t] - exp(z[r, j] - lse[r])), b = (r0 + r) / T the
// row's sequence (0 for rows without a target). grid (R,), blockDim 256.
extern "C" __global__ void __launch_bounds__(256) seq_logp_grad(bf16* __restrict__ z, const int* __restrict__ targets,
                                                                const float* __restrict__ lse, const float* __restrict__ dlogp,
                                                                int V, int K, long long r0, int T) {
    const long long r = blockIdx.x;
    bf16* zr = z + r * V;
    uint2* z4 = reinterpret_cast<uint2*>(zr);
    const int V4 = (V & 3) == 0 ? V / 4 : 0, tail = 4 * V4;
    const int t = targets[r * K];
    if (t < 0) {
        for (int j = threadIdx.x; j < V4; j += blockDim.x) z4[j] = make_uint2(0u, 0u);
        for (int j = tail + threadIdx.x; j < V; j += blockDim.x) zr[j] = 0;
        return;
    }
    const float c = dlogp[(r0 + r) / T], l = lse[r];
    for (int j = threadIdx.x; j < V4; j += blockDim.x) {
        const float4 a = ld4(zr, j);
        const int j0 = 4 * j;
        z4[j] = make_uint2(
            pack2(c * ((j0 == t ? 1.f : 0.f) - expf(a.x - l)), c * ((j0 + 1 == t ? 1.f : 0.f) - expf(a.y - l))),
            pack2(c * ((j0 + 2 == t ? 1.f : 0.f) - expf(a.z - l)), c * ((j0 + 3 == t ? 1.f : 0.f) - expf(a.w - l))));
    }
    for (int j = tail + threadIdx.x; j < V; j += blockDim.x) zr[j] = f2bf(c * ((j == t ? 1.f : 0.f) - expf(ld1(zr, j) - l)));
}
