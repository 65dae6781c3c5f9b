// SwiGLU's pointwise math, shared by the SwiGLU kernels (swiglu.cu) and the fused GEMMs that apply it
// in their epilogue (gemm_tma.cu).

#pragma once
#include "common.cuh"

// sigmoid by the fast exponential and division (a few float32 ulps; every result is stored as bf16). The
// forward, the backward and the fused backward all compute m = silu(gate) * up by these same operations,
// so the m that the backward recomputes is the forward's, bit for bit.
__device__ __forceinline__ float sigmoid_f(float g) { return __fdividef(1.f, 1.f + __expf(-g)); }
__device__ __forceinline__ float silu_f(float g) { return g * sigmoid_f(g); }

// The SwiGLU backward of one value: d = dL/dm, g = gate, u = up -> dg = dL/dgate, du = dL/dup.
__device__ __forceinline__ void swiglu_grad(float d, float g, float u, float& dg, float& du) {
    const float s = sigmoid_f(g);
    dg = d * u * s * (1.f + g * (1.f - s));
    du = d * g * s;
}
