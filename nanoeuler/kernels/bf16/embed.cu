// The token embedding, forward and backward. Reference: nanoeuler.model.layers.embedding_*.

#include "common.cuh"

// The embedding: a warp per row, 8 rows a block; 16-byte accesses when C % 4 == 0 (every tensor of the
// engine's buffers starts 256-byte aligned). A row per warp needs no per-value index division
// (docs/benchmarks-log.md, Kernel notes).

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
