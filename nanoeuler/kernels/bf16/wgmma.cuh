// Hopper warpgroup products (wgmma, sm_90a): swizzled tiles, descriptors, fences; shared by the
// warpgroup attention (flash_wg.cu) and the fused TMA GEMMs (gemm_tma.cu). Empty on other targets.

#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Shared-memory matrix descriptor (PTX "matrix descriptor"): start address, leading and stride byte
// offsets (16-byte units), 128-byte swizzle. Stride 1024 bytes: the next 8 rows of the tile. K-major
// operands (K here, rows = n, 64 contiguous k) start at +32 bytes per 16 k; the transposed operand
// (V, rows = k, 64 contiguous n) starts at +2048 bytes per 16 k, and its leading offset, the step to
// the next 64 n, never comes into play for n = 64.
__device__ __forceinline__ unsigned long long wg_desc(unsigned saddr, unsigned lead16) {
    return (unsigned long long)((saddr & 0x3FFFFu) >> 4) | ((unsigned long long)lead16 << 16) | (64ull << 32) |
           (1ull << 62);
}

// The 32 accumulator registers of a thread's share of a 64 x 64 wgmma result, as asm operands %0 .. %31.
#define WG_ACC_64X64(d)                                                                                          \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),     \
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), \
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), \
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
// d (64 x 64, float32, this thread's 32 values in the mma C layout) = (ACC ? d : 0) + A (64 x 16, this
// thread's 4 A registers) * B (16 x 64 from shared memory; TB = 1: stored with n contiguous).
// Asynchronous: the caller fences before, commits and waits after.
template <int TB, int ACC = 1>
__device__ __forceinline__ void wgmma_64x64x16(float (&d)[8][4], const unsigned (&a)[4], unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
        : WG_ACC_64X64(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TB), "n"(ACC));
}
// d (+)= A (64 x 64, 4 k-steps of A registers) * B, the 64 x 64 tile at shared address `tile`: read as
// [n][k] (TB = 0, K-major: 32 bytes further per 16 k) or as [k][n] (TB = 1: 2048 bytes further).
template <int TB, int ACC>
__device__ __forceinline__ void wgmma_64x64x64(float (&d)[8][4], const unsigned (&a)[4][4], unsigned tile) {
    wgmma_64x64x16<TB, ACC>(d, a[0], wg_desc(tile, TB ? 64 : 1));
#pragma unroll
    for (int kc = 1; kc < 4; ++kc) wgmma_64x64x16<TB, 1>(d, a[kc], wg_desc(tile + kc * (TB ? 2048 : 32), TB ? 64 : 1));
}
// d (+)= A * B with A, too, a 64 x 64 tile in shared memory (at `a_tile`, read as [m][k], K-major like
// B with TB = 0): an operand that stays the same for a whole block (its Q, K, V or dO rows) then needs
// no registers, which leaves room for more blocks per multiprocessor (flash.py: FLASH_WG_SMEM).
template <int TB, int ACC>
__device__ __forceinline__ void wgmma_64x64x64_ss(float (&d)[8][4], unsigned a_tile, unsigned b_tile) {
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) {
        const unsigned long long a = wg_desc(a_tile + kc * 32, 1);
        const unsigned long long b = wg_desc(b_tile + kc * (TB ? 2048 : 32), TB ? 64 : 1);
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
            "%32, %33, p, 1, 1, 0, %35;\n}\n"
            : WG_ACC_64X64(d)
            : "l"(a), "l"(b), "r"(kc > 0 || ACC ? 1 : 0), "n"(TB));
    }
}
// 4 A-register k-steps (16 rows x 64 columns of a warp, bf16) from 64 float accumulator columns
__device__ __forceinline__ void frags_of(unsigned (&a)[4][4], const float (&x)[8][4]) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        a[kk][0] = pack2(x[2 * kk][0], x[2 * kk][1]);
        a[kk][1] = pack2(x[2 * kk][2], x[2 * kk][3]);
        a[kk][2] = pack2(x[2 * kk + 1][0], x[2 * kk + 1][1]);
        a[kk][3] = pack2(x[2 * kk + 1][2], x[2 * kk + 1][3]);
    }
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>  // until at most the N most recently committed groups are still running
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void wg_commit_wait() {
    wg_commit();
    wg_wait<0>();
}
// Registers a wgmma reads or writes asynchronously: "used" here, after the wait, so the compiler
// neither reads the results early nor reuses the operands' registers while the wgmma runs.
template <int N>
__device__ __forceinline__ void wg_hold(float (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i][0]), "+f"(r[i][1]), "+f"(r[i][2]), "+f"(r[i][3])::"memory");
}
template <int N>
__device__ __forceinline__ void wg_hold(unsigned (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i][0]), "+r"(r[i][1]), "+r"(r[i][2]), "+r"(r[i][3])::"memory");
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
