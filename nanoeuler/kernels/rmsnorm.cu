// RMSNorm with a gain, float32. Reference: nanoeuler.model.layers.rmsnorm_forward / rmsnorm_backward.
//
// forward:  r = 1/sqrt(mean(x^2) + eps), y = x * r * w          (one block per row; saves r)
// backward: xhat = x * r, dxhat = dy * w,
//           dx = r * (dxhat - xhat * mean(dxhat * xhat))        (one block per row)
//           dw = sum over rows of dy * xhat                      (column sums in row segments, then
//                                                                 a small sum over segments on the host side)

template <int NT>
__device__ __forceinline__ float block_sum(float x, float* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < NT / 32; ++w) total += scratch[w];
    return total;
}

extern "C" __global__ void __launch_bounds__(256) rmsnorm_fwd(
    const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y, float* __restrict__ rstd,
    int C, float eps) {
    __shared__ float scratch[8];
    const long long row = blockIdx.x;
    const float* xr = x + row * C;
    float* yr = y + row * C;
    float ss = 0.f;
    for (int c = threadIdx.x; c < C; c += 256) ss = fmaf(xr[c], xr[c], ss);
    ss = block_sum<256>(ss, scratch);
    const float r = rsqrtf(ss / C + eps);
    for (int c = threadIdx.x; c < C; c += 256) yr[c] = xr[c] * r * w[c];
    if (threadIdx.x == 0) rstd[row] = r;
}

extern "C" __global__ void __launch_bounds__(256) rmsnorm_bwd_dx(
    const float* __restrict__ dy, const float* __restrict__ x, const float* __restrict__ w,
    const float* __restrict__ rstd, float* __restrict__ dx, int C) {
    __shared__ float scratch[8];
    const long long row = blockIdx.x;
    const float* dyr = dy + row * C;
    const float* xr = x + row * C;
    float* dxr = dx + row * C;
    const float r = rstd[row];
    float acc = 0.f;  // sum(dxhat * x); times r gives sum(dxhat * xhat)
    for (int c = threadIdx.x; c < C; c += 256) acc = fmaf(dyr[c] * w[c], xr[c], acc);
    acc = block_sum<256>(acc, scratch);
    const float proj = acc * r / C;  // mean(dxhat * xhat)
    for (int c = threadIdx.x; c < C; c += 256) dxr[c] = r * (dyr[c] * w[c] - xr[c] * r * proj);
}

// Block (32, 8): 32 columns, 8 row lanes; blockIdx.y picks a segment of `seg_rows` rows.
// partial[seg, c] = sum over the segment's rows of dy * x * r.
extern "C" __global__ void __launch_bounds__(256) rmsnorm_bwd_dw_partial(
    const float* __restrict__ dy, const float* __restrict__ x, const float* __restrict__ rstd,
    float* __restrict__ partial, long long N, int C, int seg_rows) {
    __shared__ float acc_s[8][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    const long long r0 = (long long)blockIdx.y * seg_rows;
    const long long r1 = min(N, r0 + seg_rows);
    float acc = 0.f;
    if (c < C)
        for (long long n = r0 + threadIdx.y; n < r1; n += 8) acc = fmaf(dy[n * C + c] * x[n * C + c], rstd[n], acc);
    acc_s[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float total = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) total += acc_s[i][threadIdx.x];
        partial[(long long)blockIdx.y * C + c] = total;
    }
}
