// Fused AdamW step over one float32 tensor (parameter, gradient, both moments in one pass).
// Reference: nanoeuler.optim.AdamW.step, same order of operations:
//   m = b1 m + (1-b1) g ;  v = b2 v + (1-b2) g^2
//   p *= decay                      (decay = 1 - lr*wd, or 1 for tensors without weight decay)
//   p -= step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps),   step_size = lr / (1 - b1^t),
//                                                          inv_sqrt_bc2 = 1 / sqrt(1 - b2^t)

extern "C" __global__ void __launch_bounds__(256) adamw_step(
    float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m, float* __restrict__ v, long long n,
    float b1, float b2, float decay, float step_size, float inv_sqrt_bc2, float eps) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float gi = g[i];
        const float mi = b1 * m[i] + (1.f - b1) * gi;
        const float vi = b2 * v[i] + (1.f - b2) * (gi * gi);
        m[i] = mi;
        v[i] = vi;
        const float denom = sqrtf(vi) * inv_sqrt_bc2 + eps;
        p[i] = p[i] * decay - step_size * (mi / denom);
    }
}
