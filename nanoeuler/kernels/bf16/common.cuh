// The bf16 engine's shared device code: bf16 storage and conversions, vector loads, warp and
// block reductions, shared-memory addresses. Every .cu file of this folder includes it; the loader
// (nanoeuler/kernels/__init__.py) inlines included headers, so CuPy's cache sees their text.
//
// bf16 values are stored as raw 16-bit words (unsigned short), widened by a shift and narrowed by the
// hardware conversion in inline PTX (round to nearest even), so the file needs no CUDA header and
// compiles the same under NVRTC and nvcc. All arithmetic is float32; bf16 is only a storage format for
// GEMM operands and activations.

#pragma once

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

// The 32-bit shared-memory address of a generic pointer into shared memory (ldmatrix, wgmma, TMA).
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(a) : "l"(p));
    return a;
}
