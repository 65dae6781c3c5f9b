// Softmax cross-entropy over rows of logits, target -1 ignored, float32.
// Reference: nanoeuler.model.layers.cross_entropy_forward / cross_entropy_backward.
//
// ce_fwd: one block per row. Each thread keeps an online (max, sum of exp) over its strided share of
// the row, the block merges them into lse = log(sum(exp(z))); loss[row] = lse - z[target] (0 when the
// target is -1). With write_grad set it also writes grad = scale * (softmax(z) - onehot(target)) for
// the row (0 for ignored rows). grad may be the logits buffer itself: the gradient of a chunk of rows
// then replaces its logits in place, and no probabilities are ever stored.
// ce_bwd: the same gradient from saved lse, one thread per element.

#define NEG_INF __int_as_float(0xff800000)
#define NT 256

__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
    if (m2 == NEG_INF) return;
    if (m == NEG_INF) { m = m2; s = s2; return; }
    const float mx = fmaxf(m, m2);
    s = s * expf(m - mx) + s2 * expf(m2 - mx);
    m = mx;
}

extern "C" __global__ void __launch_bounds__(NT) ce_fwd(
    const float* logits, long long ld, const long long* __restrict__ targets, float* __restrict__ loss,
    float* __restrict__ lse_out, float* grad, long long gld, float scale, int V, int write_grad) {
    __shared__ float ms[NT / 32], ss[NT / 32];
    __shared__ float picked_s;
    const long long row = blockIdx.x;
    const float* z = logits + row * ld;
    const long long target = targets[row];
    const bool valid = target >= 0;
    if (threadIdx.x == 0) picked_s = (valid && target < V) ? z[target] : __int_as_float(0x7fc00000);
    float m = NEG_INF, s = 0.f;
    for (int c = threadIdx.x; c < V; c += NT) {
        const float x = z[c];
        if (x > m) { s = (m == NEG_INF ? 0.f : s * expf(m - x)) + 1.f; m = x; }
        else s += expf(x - m);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        merge(m, s, m2, s2);
    }
    if (threadIdx.x % 32 == 0) { ms[threadIdx.x / 32] = m; ss[threadIdx.x / 32] = s; }
    __syncthreads();  // also orders the read of z[target] before any in-place write below
    m = ms[0]; s = ss[0];
#pragma unroll
    for (int w = 1; w < NT / 32; ++w) merge(m, s, ms[w], ss[w]);
    const float lse = m + logf(s);
    if (threadIdx.x == 0) {
        loss[row] = valid ? lse - picked_s : 0.f;
        lse_out[row] = lse;
    }
    if (write_grad) {
        float* gr = grad + row * gld;
        for (int c = threadIdx.x; c < V; c += NT) {
            const float p = expf(z[c] - lse);
            gr[c] = valid ? scale * (p - (c == target ? 1.f : 0.f)) : 0.f;
        }
    }
}

extern "C" __global__ void __launch_bounds__(NT) ce_bwd(
    const float* __restrict__ logits, const long long* __restrict__ targets, const float* __restrict__ lse,
    float* __restrict__ grad, float scale, int V, long long n) {
    const long long i = (long long)blockIdx.x * NT + threadIdx.x;
    if (i >= n) return;
    const long long row = i / V;
    const int c = (int)(i % V);
    const long long target = targets[row];
    const float p = expf(logits[i] - lse[row]);
    grad[i] = target >= 0 ? scale * (p - (c == target ? 1.f : 0.f)) : 0.f;
}
