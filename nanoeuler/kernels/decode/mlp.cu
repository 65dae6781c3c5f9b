// The one-row decode step's MLP in one kernel (launchers in mlp.py): dx += W_down (silu(W_gate n(x)) *
// W_up n(x)), the gate/up product by decode.cuh's GEMV pieces. Reference: layers.rmsnorm_forward,
// swiglu_forward, then the down projection.
//
// Kernels, per weight storage (_bf16, _f32) and U (as gemv.cu's): swiglu_down_u<U>_r1, one row a block.

#include "decode.cuh"

// ---- the MLP in one kernel: dx += W_down (silu(W_gate n(x)) * W_up n(x)) -------------------------------
// grid (ceil(F / MLP_FC), row groups of R), MLP_FC warps (R = 1, the one-row step, is the one instantiated:
// docs/decode-kernels-log.md): warp w computes f = f0 + w of the
// gate/up product (the GEMV pieces: its rows requested before the wait, the norm in the prologue); the
// block's MLP_FC values of h = silu(g) u go to shared memory; then each thread adds W_down[n, f0:f0+MLP_FC]
// . h to dx[m, n] for its rows n (atomicAdd: the F / MLP_FC blocks meet in dx, which starts at zero:
// embed clears it, attend_o clears it after folding it into x). The first row's W_down pieces are
// requested before the wait too. Shared: the staged rows (rows, C), then W_down's pieces of the rows past
// the block's threads ((C - blockDim.x) * MLP_FC of W): past 48 KB from a width of about 1,800 (bf16), where
// the launcher raises the kernel's limit first (plan.smem_opt_in).
template <typename W, int U, int R>
__device__ void swiglu_down(const W* __restrict__ wgu, const W* __restrict__ wd, const float* __restrict__ x,
                            const float* __restrict__ gain, float* __restrict__ dx, int M, int F, int C, float eps) {
    extern __shared__ float xs[];
    __shared__ float sq[R][32];
    __shared__ float hs[R][MLP_FC];
    constexpr int V = Vec<W>::N, FP = MLP_FC / V;  // W_down pieces of a row's MLP_FC columns
    const int m0 = blockIdx.y * R, rows = min(R, M - m0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, f0 = blockIdx.x * MLP_FC, f = f0 + warp;
    const bool active = f < F, whole = F % V == 0 && f0 + MLP_FC <= F;  // whole: 16-byte W_down pieces
    const W* const wr[2] = {wgu + (long long)(active ? f : 0) * C, wgu + (long long)((active ? f : 0) + F) * C};
    uint4 raw[2][U], dpre[FP];
    const bool early = active && C % V == 0;
    if (early) gemv_load<W, 2, U>(wr, C, lane * V, raw);
    // W_down's pieces: a thread's first row into registers, its later rows into shared memory (by cp.async,
    // no registers held), all requested before the wait; each thread reads back only what it copied
    uint4* tile = reinterpret_cast<uint4*>(xs + ((R * C + 3) & ~3));  // (C - blockDim.x) rows of FP pieces
#pragma unroll
    for (int p = 0; p < FP; p++)
        if (whole && (int)threadIdx.x < C) dpre[p] = ld16(wd + (long long)threadIdx.x * F + f0 + p * V);
    if (whole)
        for (int n = threadIdx.x + blockDim.x; n < C; n += blockDim.x)
#pragma unroll
            for (int p = 0; p < FP; p++)
                cp16(tile + (n - blockDim.x) * FP + p, wd + (long long)n * F + f0 + p * V);
    cp_commit();
    pdl_wait();
    pdl_launch();
    stage_x<W, R>(x, nullptr, gain, m0, rows, C, xs, sq);
    float acc[2][R];
    warp_dots<W, 2, U, R>(wr, C, xs, rows, raw, early, acc);  // (an inactive warp's sums go unused)
    gemv_finish<2, R>(acc, sq, true, C, eps);
    if (lane == 0)
#pragma unroll
        for (int rr = 0; rr < R; rr++)
            hs[rr][warp] = active ? acc[0][rr] / (1.f + __expf(-acc[0][rr])) * acc[1][rr] : 0.f;
    cp_wait<0>();
    __syncthreads();
    for (int n = threadIdx.x; n < C; n += blockDim.x) {
        float wf[MLP_FC];
        if (whole) {
#pragma unroll
            for (int p = 0; p < FP; p++)
                Vec<W>::unpack(n == (int)threadIdx.x ? dpre[p] : tile[(n - blockDim.x) * FP + p], wf + p * V);
        } else {  // the last columns, or rows not 16-byte aligned
#pragma unroll
            for (int i = 0; i < MLP_FC; i++) wf[i] = f0 + i < F ? tof(wd[(long long)n * F + f0 + i]) : 0.f;
        }
#pragma unroll
        for (int rr = 0; rr < R; rr++) {
            if (rr >= rows) break;
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < MLP_FC; i++) s += wf[i] * hs[rr][i];
            atomicAdd(dx + (long long)(m0 + rr) * C + n, s);
        }
    }
}

// ---- entry points -------------------------------------------------------------------------------------
// at most 64 registers: 2 blocks a multiprocessor, room for the next kernel's
extern "C" __global__ void __launch_bounds__(32 * MLP_FC, 2) swiglu_down_u4_r1_bf16(const bf16* wgu,
    const bf16* wd, const float* x, const float* gain, float* dx, int M, int F, int C, float eps) {
    swiglu_down<bf16, 4, 1>(wgu, wd, x, gain, dx, M, F, C, eps);
}
extern "C" __global__ void __launch_bounds__(32 * MLP_FC, 2) swiglu_down_u8_r1_bf16(const bf16* wgu,
    const bf16* wd, const float* x, const float* gain, float* dx, int M, int F, int C, float eps) {
    swiglu_down<bf16, 8, 1>(wgu, wd, x, gain, dx, M, F, C, eps);
}
extern "C" __global__ void __launch_bounds__(32 * MLP_FC, 2) swiglu_down_u4_r1_f32(const float* wgu,
    const float* wd, const float* x, const float* gain, float* dx, int M, int F, int C, float eps) {
    swiglu_down<float, 4, 1>(wgu, wd, x, gain, dx, M, F, C, eps);
}
extern "C" __global__ void __launch_bounds__(32 * MLP_FC, 2) swiglu_down_u8_r1_f32(const float* wgu,
    const float* wd, const float* x, const float* gain, float* dx, int M, int F, int C, float eps) {
    swiglu_down<float, 8, 1>(wgu, wd, x, gain, dx, M, F, C, eps);
}
