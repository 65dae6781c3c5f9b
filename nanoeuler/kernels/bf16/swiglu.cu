// The SwiGLU m = silu(gate) * up, forward and backward, on the gate/up GEMM's output.
// Reference: nanoeuler.model.layers.swiglu_*.

#include "swiglu.cuh"

// SwiGLU kernels: grid x over groups of VEC columns (VEC = 8 when F % 8 == 0: 16-byte accesses; else 2,
// with a scalar path for odd F), grid y over rows (grid-stride). The host computes the same VEC.

// gu (N, 2F) bf16 = [gate | up] -> m (N, F) bf16 = silu(gate) * up.
extern "C" __global__ void swiglu_fwd_bf16(const bf16* __restrict__ gu, bf16* __restrict__ m, int F, int N) {
    const int vec = (F & 7) == 0 ? 8 : 2;
    const int j = vec * (blockIdx.x * blockDim.x + threadIdx.x);
    if (j >= F) return;
    for (int r = blockIdx.y; r < N; r += gridDim.y) {
        const bf16* gr = gu + (long long)r * 2 * F;
        bf16* mr = m + (long long)r * F;
        if (vec == 8) {
            const uint4 g4 = *reinterpret_cast<const uint4*>(gr + j), u4 = *reinterpret_cast<const uint4*>(gr + F + j);
            const unsigned gw[4] = {g4.x, g4.y, g4.z, g4.w}, uw[4] = {u4.x, u4.y, u4.z, u4.w};
            unsigned ow[4];
#pragma unroll
            for (int e = 0; e < 4; ++e)
                ow[e] = pack2(silu_f(lo_bf(gw[e])) * lo_bf(uw[e]), silu_f(hi_bf(gw[e])) * hi_bf(uw[e]));
            *reinterpret_cast<uint4*>(mr + j) = make_uint4(ow[0], ow[1], ow[2], ow[3]);
        } else if ((F & 1) == 0) {
            const unsigned g2 = ld32(gr + j), u2 = ld32(gr + F + j);
            *reinterpret_cast<unsigned*>(mr + j) = pack2(silu_f(lo_bf(g2)) * lo_bf(u2), silu_f(hi_bf(g2)) * hi_bf(u2));
        } else {
            for (int jj = j; jj < min(j + 2, F); ++jj) mr[jj] = f2bf(silu_f(bf2f(gr[jj])) * bf2f(gr[F + jj]));
        }
    }
}


// dm (N, F) bf16, gu (N, 2F) bf16 -> dgu (N, 2F) bf16 = [dgate | dup], and m (N, F) = silu(gate) * up again
// (bit-identical to the forward's, for the down projection's weight gradient): the backward recomputes m
// instead of keeping it, and doing it here saves a second read of gu. Same grid as the forward.
extern "C" __global__ void swiglu_bwd_bf16(const bf16* __restrict__ dm, const bf16* __restrict__ gu,
                                           bf16* __restrict__ dgu, bf16* __restrict__ m, int F, int N) {
    const int vec = (F & 7) == 0 ? 8 : 2;
    const int j = vec * (blockIdx.x * blockDim.x + threadIdx.x);
    if (j >= F) return;
    for (int r = blockIdx.y; r < N; r += gridDim.y) {
        const bf16* gr = gu + (long long)r * 2 * F;
        const bf16* dr = dm + (long long)r * F;
        bf16* out = dgu + (long long)r * 2 * F;
        bf16* mr = m + (long long)r * F;
        if (vec == 8) {
            const uint4 g4 = *reinterpret_cast<const uint4*>(gr + j), u4 = *reinterpret_cast<const uint4*>(gr + F + j);
            const uint4 d4 = *reinterpret_cast<const uint4*>(dr + j);
            const unsigned gw[4] = {g4.x, g4.y, g4.z, g4.w}, uw[4] = {u4.x, u4.y, u4.z, u4.w};
            const unsigned dw[4] = {d4.x, d4.y, d4.z, d4.w};
            unsigned og[4], ou[4], om[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float dg0, du0, dg1, du1;
                swiglu_grad(lo_bf(dw[e]), lo_bf(gw[e]), lo_bf(uw[e]), dg0, du0);
                swiglu_grad(hi_bf(dw[e]), hi_bf(gw[e]), hi_bf(uw[e]), dg1, du1);
                og[e] = pack2(dg0, dg1);
                ou[e] = pack2(du0, du1);
                om[e] = pack2(silu_f(lo_bf(gw[e])) * lo_bf(uw[e]), silu_f(hi_bf(gw[e])) * hi_bf(uw[e]));
            }
            *reinterpret_cast<uint4*>(out + j) = make_uint4(og[0], og[1], og[2], og[3]);
            *reinterpret_cast<uint4*>(out + F + j) = make_uint4(ou[0], ou[1], ou[2], ou[3]);
            *reinterpret_cast<uint4*>(mr + j) = make_uint4(om[0], om[1], om[2], om[3]);
        } else if ((F & 1) == 0) {
            const unsigned g2 = ld32(gr + j), u2 = ld32(gr + F + j), d2 = ld32(dr + j);
            float dg0, du0, dg1, du1;
            swiglu_grad(lo_bf(d2), lo_bf(g2), lo_bf(u2), dg0, du0);
            swiglu_grad(hi_bf(d2), hi_bf(g2), hi_bf(u2), dg1, du1);
            *reinterpret_cast<unsigned*>(out + j) = pack2(dg0, dg1);
            *reinterpret_cast<unsigned*>(out + F + j) = pack2(du0, du1);
            *reinterpret_cast<unsigned*>(mr + j) = pack2(silu_f(lo_bf(g2)) * lo_bf(u2), silu_f(hi_bf(g2)) * hi_bf(u2));
        } else {
            for (int jj = j; jj < min(j + 2, F); ++jj) {
                float dg, du;
                swiglu_grad(bf2f(dr[jj]), bf2f(gr[jj]), bf2f(gr[F + jj]), dg, du);
                out[jj] = f2bf(dg);
                out[F + jj] = f2bf(du);
                mr[jj] = f2bf(silu_f(bf2f(gr[jj])) * bf2f(gr[F + jj]));
            }
        }
    }
}
