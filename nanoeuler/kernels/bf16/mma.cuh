// The tensor-core attention's building blocks (mma.sync fragments, tile copies, the online softmax
// and the backward's probabilities), shared by flash_mma.cu and flash_wg.cu.

#pragma once
#include "common.cuh"

// ---- tensor-core FlashAttention (bf16 operands, float32 accumulation) --------------------------------
//
// Causal GQA attention for head size D (32 or 64) with mma.sync m16n8k16 (bf16 in, float32 out).
// Layouts: q (B,H,T,D), k/v (B,Hkv,T,D) bf16; O and dO in the o_proj operand layout (N, H*D) bf16 with
// row n = b*T + t; lse/delta (B,H,T) float32. The backward writes dq, dk (rotation undone) and dv as bf16
// straight into the qkv GEMM's gradient operand dqkv (N, (H+2Hkv)*D) and needs the RoPE tables for it.
// Reference: nanoeuler.model.layers.attention_forward / attention_backward (S == T).
//
// Grids: x over (batch, head) pairs, y over the 64-row tiles, ordered so that the blocks with the most
// work (the last query tiles; in dkdv the first key tiles) have the lowest y. The hardware starts
// blocks in order of x, then y, so the longest start first and the short ones fill the tail
// (docs/benchmarks-log.md, Kernel notes).
// Every block has 4 warps and owns 64 rows (queries, or keys in dkdv); each warp owns 16 of them and
// keeps its operand fragments in registers. Tiles of the other side (64 rows) pass through shared
// memory, once row-major (for products over d) and, where a product runs over the tile's rows, once
// transposed. Rows are padded by 8 bf16 so the fragment loads hit 32 distinct banks.
// mma fragment layout (PTX m16n8k16, g = lane/4, c = lane%4): A regs (row g | g+8) x (cols 2c,2c+1 |
// 2c+8,2c+9); B regs (k rows 2c,2c+1 | 2c+8,2c+9) x (col g); C (row g | g+8) x (cols 2c, 2c+1).
// Softmax runs in base 2: s2 = s * scale * log2(e); lse is stored in natural units.

#define FA_BR 64
// The backward kernels take the other side's 64-row tile in passes of FA_*_PASS columns (64 or 32),
// under launch bounds of FA_*_BLOCKS blocks per multiprocessor. S and dP of one pass live in
// registers: passes of 32 halve them, so the dq kernel, bound by latency, fits 4 blocks per
// multiprocessor; the dk/dv kernel keeps whole tiles (docs/benchmarks-log.md, Kernel notes). The -D
// options of NVRTC override these (bench sweeps).
#ifndef FA_DQ_PASS
#define FA_DQ_PASS 32
#endif
#ifndef FA_DQ_BLOCKS
#define FA_DQ_BLOCKS 4
#endif
#ifndef FA_DKDV_PASS
#define FA_DKDV_PASS 64
#endif
#ifndef FA_DKDV_BLOCKS
#define FA_DKDV_BLOCKS 1
#endif
// Column (within a 64-wide tile) of C-fragment element e of n-tile n held by a thread of quad column c.
__device__ __forceinline__ int qi_of(int n, int e, int c) { return n * 8 + 2 * c + (e & 1); }
#define FA_PAD 8
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

// 2^x in one instruction (MUFU.EX2). exp2f without fast-math wraps the same instruction in a
// denormal-range fix-up (a compare and two conditional multiplies per value); softmax weights below
// 2^-126 count as 0 either way, so the attention kernels skip the fix-up. -inf gives 0.
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}



// With LDM, B fragments come from shared memory through ldmatrix (x4: two n-tiles per instruction):
// ldsm_b reads a row-major [n][k] tile as is, ldsm_bt reads a row-major [k][n] tile transposed, so no
// transposed copy of a tile is ever stored. b[0], b[1] = (b0, b1) of n-tile n; b[2], b[3] of n-tile n+1.
template <int LD>
__device__ __forceinline__ void ldsm_b(unsigned (&b)[4], const bf16 (*tile)[LD], int n, int kc, int lane) {
    const int i = lane >> 3, r = lane & 7;
    const unsigned a = smem_u32(&tile[(n + (i >> 1)) * 8 + r][kc * 16 + (i & 1) * 8]);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(a));
}

template <int LD>
__device__ __forceinline__ void ldsm_bt(unsigned (&b)[4], const bf16 (*tile)[LD], int n, int kk, int lane) {
    const int i = lane >> 3, r = lane & 7;
    const unsigned a = smem_u32(&tile[kk * 16 + (i & 1) * 8 + r][(n + (i >> 1)) * 8]);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(a));
}

// A fragments of 16 rows x D from a row-major bf16 matrix (row stride ld elements); rows >= rmax read 0.
template <int D>
__device__ __forceinline__ void load_a_frags(unsigned (&a)[D / 16][4], const bf16* base, long long ld, int r0,
                                             int rmax, int g, int c) {
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
        const int col = kc * 16 + 2 * c;
        const bool okA = r0 + g < rmax, okB = r0 + g + 8 < rmax;
        const bf16* pa = base + (long long)(r0 + g) * ld + col;
        const bf16* pb = base + (long long)(r0 + g + 8) * ld + col;
        a[kc][0] = okA ? ld32(pa) : 0u;
        a[kc][1] = okB ? ld32(pb) : 0u;
        a[kc][2] = okA ? ld32(pa + 8) : 0u;
        a[kc][3] = okB ? ld32(pb + 8) : 0u;
    }
}

// Copies a 64-row tile (rows r0.., row stride ld) into shared memory, row-major (rm, may be null) and/or
// transposed (tr, may be null); rows >= rmax become zeros. 128 threads, 16-byte loads.
template <int D>
__device__ __forceinline__ void load_tile(bf16 (*rm)[D + FA_PAD], bf16 (*tr)[FA_BR + FA_PAD], const bf16* base,
                                          long long ld, int r0, int rmax) {
    for (int i = threadIdx.x; i < FA_BR * D / 8; i += blockDim.x) {
        const int row = i / (D / 8), c8 = (i % (D / 8)) * 8;
        uint4 val = make_uint4(0u, 0u, 0u, 0u);
        if (r0 + row < rmax) val = *reinterpret_cast<const uint4*>(base + (long long)(r0 + row) * ld + c8);
        if (rm) *reinterpret_cast<uint4*>(&rm[row][c8]) = val;
        if (tr) {
            const bf16* e = reinterpret_cast<const bf16*>(&val);
#pragma unroll
            for (int j = 0; j < 8; ++j) tr[c8 + j][row] = e[j];
        }
    }
}

// cp.async tile copy (the ldmatrix kernels keep tiles row-major, so a tile is a plain 16-byte copy and
// the next tile can stream in while the current one is used: two stages).
template <int D>
__device__ __forceinline__ void cp_tile(bf16 (*dst)[D + FA_PAD], const bf16* base, long long ld, int r0, int rmax) {
    for (int i = threadIdx.x; i < FA_BR * D / 8; i += blockDim.x) {
        const int row = i / (D / 8), c8 = (i % (D / 8)) * 8;
        if (r0 + row < rmax) {
            const unsigned sa = smem_u32(&dst[row][c8]);
            const bf16* src = base + (long long)(r0 + row) * ld + c8;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(src));
        } else {
            *reinterpret_cast<uint4*>(&dst[row][c8]) = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}
__device__ __forceinline__ void cp_f32(float* dst, const float* src) {  // one float, by cp.async
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(dst)), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// A warp's 16 rows x D of float32 accumulators (C fragments; rows tA = t0 + g and tB = t0 + g + 8 of
// sequence b) times `scale`, written as bf16 into columns col0 .. col0 + D - 1 of the dqkv rows b*T + t
// (row length W). With `rot` the half-split rotation is undone first (the gradient of q or k):
// dx1 = dy1 cos + dy2 sin, dx2 = dy2 cos - dy1 sin for the pair (i, i + D/2); a thread holds both
// halves of its pairs (n-tiles n and n + D/16), so this needs no exchange.
template <int D>
__device__ __forceinline__ void store_dqkv_rows(const float (&acc)[D / 8][4], bf16* __restrict__ dqkv, long long W,
                                                int b, int T, int t0, int col0, float scale, bool rot,
                                                const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                                int g, int c) {
    constexpr int NT = D / 8, HALF = D / 2;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int t = t0 + g + 8 * hr;
        if (t >= T) continue;
        bf16* out = dqkv + ((long long)b * T + t) * W + col0;
#pragma unroll
        for (int n = 0; n < NT / 2; ++n) {
            const int i = n * 8 + 2 * c;
            float y1a = acc[n][2 * hr] * scale, y1b = acc[n][2 * hr + 1] * scale;
            float y2a = acc[n + NT / 2][2 * hr] * scale, y2b = acc[n + NT / 2][2 * hr + 1] * scale;
            if (rot) {
                const float2 cs = *reinterpret_cast<const float2*>(cos_t + t * HALF + i);
                const float2 sn = *reinterpret_cast<const float2*>(sin_t + t * HALF + i);
                const float x1a = y1a * cs.x + y2a * sn.x, x2a = y2a * cs.x - y1a * sn.x;
                const float x1b = y1b * cs.y + y2b * sn.y, x2b = y2b * cs.y - y1b * sn.y;
                y1a = x1a; y2a = x2a; y1b = x1b; y2b = x2b;
            }
            *reinterpret_cast<unsigned*>(out + i) = pack2(y1a, y1b);
            *reinterpret_cast<unsigned*>(out + i + HALF) = pack2(y2a, y2b);
        }
    }
}

// S (16 rows x NC columns of the other side) += A (16 x D, fragments) * tile^T (tile row-major [NC][D];
// NC = 64, a whole tile, or 32, half of one: pass the tile's row pointer at the half's first row).
template <int D, bool LDM, int NC = FA_BR>
__device__ __forceinline__ void mma_rows_tile(float (&s)[NC / 8][4], const unsigned (&a)[D / 16][4],
                                              const bf16 (*tile)[D + FA_PAD], int g, int c, int lane) {
    if constexpr (LDM) {
#pragma unroll
        for (int n = 0; n < NC / 8; n += 2) {
#pragma unroll
            for (int kc = 0; kc < D / 16; ++kc) {
                unsigned bb[4];
                ldsm_b<D + FA_PAD>(bb, tile, n, kc, lane);
                mma16816(s[n], a[kc], bb[0], bb[1]);
                mma16816(s[n + 1], a[kc], bb[2], bb[3]);
            }
        }
    } else {
#pragma unroll
        for (int n = 0; n < NC / 8; ++n) {
#pragma unroll
            for (int kc = 0; kc < D / 16; ++kc)
                mma16816(s[n], a[kc], ld32(&tile[n * 8 + g][kc * 16 + 2 * c]), ld32(&tile[n * 8 + g][kc * 16 + 2 * c + 8]));
        }
    }
}

// acc (16 x D) += P (16 x NC, from float accumulators, rounded to bf16) * V, V an NC x D tile: row-major
// [NC][D] (LDM, read transposed by ldmatrix; the row pointer at the tile's first row) or already
// transposed [D][64] (vt, from column k0).
template <int D, bool LDM, int NC = FA_BR>
__device__ __forceinline__ void mma_p_tile(float (&acc)[D / 8][4], const float (&p)[NC / 8][4],
                                           const bf16 (*tile)[D + FA_PAD], const bf16 (*vt)[FA_BR + FA_PAD], int k0,
                                           int g, int c, int lane) {
#pragma unroll
    for (int kk = 0; kk < NC / 16; ++kk) {
        const unsigned pa[4] = {pack2(p[2 * kk][0], p[2 * kk][1]), pack2(p[2 * kk][2], p[2 * kk][3]),
                                pack2(p[2 * kk + 1][0], p[2 * kk + 1][1]), pack2(p[2 * kk + 1][2], p[2 * kk + 1][3])};
        if constexpr (LDM) {
#pragma unroll
            for (int n = 0; n < D / 8; n += 2) {
                unsigned bb[4];
                ldsm_bt<D + FA_PAD>(bb, tile, n, kk, lane);
                mma16816(acc[n], pa, bb[0], bb[1]);
                mma16816(acc[n + 1], pa, bb[2], bb[3]);
            }
        } else {
#pragma unroll
            for (int n = 0; n < D / 8; ++n)
                mma16816(acc[n], pa, ld32(&vt[n * 8 + g][k0 + kk * 16 + 2 * c]),
                         ld32(&vt[n * 8 + g][k0 + kk * 16 + 2 * c + 8]));
        }
    }
}

// One step of a kernel's loop over the other side's tiles 0 .. n-1, where load(i, s) brings tile i into
// shared-memory stage s. With LDM (two stages, cp.async), tile it is already in flight (started by the
// step before, or by the prologue's load(0, 0)); this starts tile it + 1 into the other stage, then
// waits for tile it. Without, it loads tile it synchronously into stage 0.
// WG: the tiles are read by wgmma (the async proxy), which needs a proxy fence after the copies land.
template <bool LDM, typename Load, bool WG = false>
__device__ __forceinline__ void tile_step(int it, int n, int st, Load&& load) {
    if constexpr (LDM) {
        if (it + 1 < n) {
            load(it + 1, st ^ 1);
            cp_commit();
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        if constexpr (WG) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
    } else {
        __syncthreads();
        load(it, 0);
        __syncthreads();
    }
}

// Zeroes a warp's accumulator fragments (N n-tiles of the mma C layout).
template <int N>
__device__ __forceinline__ void zero_frags(float (&x)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n) x[n][0] = x[n][1] = x[n][2] = x[n][3] = 0.f;
}

// The dk/dv kernels' per-query statistics of one query tile (queries t0 .. t0 + 63 of one (b, h); lse_h
// and delta_h point at its T values) into shared memory, by cp.async (ASYNC, completing with the tile's
// copies) or by plain loads; 0 past T.
template <bool ASYNC>
__device__ __forceinline__ void stage_query_stats(float* lse_d, float* delta_d, const float* __restrict__ lse_h,
                                                  const float* __restrict__ delta_h, int t0, int T) {
    for (int i = threadIdx.x; i < FA_BR; i += blockDim.x) {
        const int t = t0 + i;
        if (ASYNC && t < T) {
            cp_f32(&lse_d[i], lse_h + t);
            cp_f32(&delta_d[i], delta_h + t);
        } else {
            lse_d[i] = t < T ? lse_h[t] : 0.f;
            delta_d[i] = t < T ? delta_h[t] : 0.f;
        }
    }
}

// One key tile of the forward's online softmax, for a warp's rows rowA = r0 + g and rowB = r0 + g + 8:
// s holds the raw scores of the tile (mma C layout, keys key0 + column); on the diagonal tile (diag) the
// keys after each row, or past T, are masked first. Then acc, l and the running maxima m (base-2 units)
// are rescaled to the new maxima, and s becomes the (unnormalised) weights, summed into l.
template <int NT>
__device__ __forceinline__ void online_softmax_tile(float (&s)[FA_BR / 8][4], float (&acc)[NT][4], float& m0, float& m1,
                                                    float& l0, float& l1, float sl2, bool diag, int key0, int rowA,
                                                    int rowB, int T, int c) {
    constexpr int ST = FA_BR / 8;
    const float NEG = __int_as_float(0xff800000);
    float mx0 = NEG, mx1 = NEG;
    // Only the diagonal tile holds keys after a row (or past T). The mask's index arithmetic sits
    // behind this (block-uniform) branch: evaluated on every tile, it kept the integer pipe busier
    // than the tensor cores.
    if (diag) {
#pragma unroll
        for (int n = 0; n < ST; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key0 + n * 8 + 2 * c + (e & 1);
                if (key > (e < 2 ? rowA : rowB) || key >= T) s[n][e] = NEG;
            }
    }
#pragma unroll
    for (int n = 0; n < ST; ++n) {
        mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
        mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    // the maxima are taken over the raw scores and scaled once (scale > 0 keeps their order): the
    // exponent of each weight is then one fma, s * sl2 - base
    const float mn0 = fmaxf(m0, mx0 * sl2), mn1 = fmaxf(m1, mx1 * sl2);
    const float base0 = mn0 == NEG ? 0.f : mn0, base1 = mn1 == NEG ? 0.f : mn1;
    const float al0 = ex2(m0 - base0), al1 = ex2(m1 - base1);
    m0 = mn0;
    m1 = mn1;
    l0 *= al0;
    l1 *= al1;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        acc[n][0] *= al0; acc[n][1] *= al0;
        acc[n][2] *= al1; acc[n][3] *= al1;
    }
#pragma unroll
    for (int n = 0; n < ST; ++n) {
        s[n][0] = ex2(fmaf(s[n][0], sl2, -base0)); s[n][1] = ex2(fmaf(s[n][1], sl2, -base0));
        s[n][2] = ex2(fmaf(s[n][2], sl2, -base1)); s[n][3] = ex2(fmaf(s[n][3], sl2, -base1));
        l0 += s[n][0] + s[n][1];
        l1 += s[n][2] + s[n][3];
    }
}

// The forward's end for a warp's rows: O = acc / l as bf16 into the (N, H*D) rows of head h, and the
// logsumexp (natural units) of (b, h)'s rows.
template <int D>
__device__ __forceinline__ void store_o_lse(const float (&acc)[D / 8][4], float m0, float m1, float l0, float l1,
                                            bf16* __restrict__ o, float* __restrict__ lse, int b, int h, int H, int T,
                                            int rowA, int rowB, int c) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = 1.f / l0, inv1 = 1.f / l1;
    const long long HD = (long long)H * D, bh = (long long)b * H + h;
    if (rowA < T) {
        bf16* orow = o + ((long long)b * T + rowA) * HD + (long long)h * D;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<unsigned*>(orow + n * 8 + 2 * c) = pack2(acc[n][0] * inv0, acc[n][1] * inv0);
        if (c == 0) lse[bh * T + rowA] = (m0 + log2f(l0)) * LN2;
    }
    if (rowB < T) {
        bf16* orow = o + ((long long)b * T + rowB) * HD + (long long)h * D;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<unsigned*>(orow + n * 8 + 2 * c) = pack2(acc[n][2] * inv1, acc[n][3] * inv1);
        if (c == 0) lse[bh * T + rowB] = (m1 + log2f(l1)) * LN2;
    }
}

// The dk/dv kernels' weights for one pass of PN*8 queries (columns, the first t0; rows = a warp's keys
// keyA, keyB): S^T -> P^T = 2^(S^T * scale * log2(e) - lse * log2(e)), zero where a query precedes the
// key or either lies past T (only when `mask`: the diagonal or the last query tile); lse_q: the pass's
// queries' values. Then (dkdv_dscores) dP^T -> dS^T = P^T * (dP^T - delta).
template <int PN>
__device__ __forceinline__ void dkdv_probs(float (&s)[PN][4], const float* lse_q, float sl2, bool mask, int t0,
                                           int keyA, int keyB, int T, int c) {
#pragma unroll
    for (int n = 0; n < PN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = ex2(fmaf(s[n][e], sl2, -LOG2E * lse_q[qi_of(n, e, c)]));
    if (mask) {
#pragma unroll
        for (int n = 0; n < PN; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = t0 + qi_of(n, e, c), key = e < 2 ? keyA : keyB;
                if (t < key || t >= T || key >= T) s[n][e] = 0.f;
            }
    }
}
template <int PN>
__device__ __forceinline__ void dkdv_dscores(float (&dp)[PN][4], const float (&p)[PN][4], const float* delta_q, int c) {
#pragma unroll
    for (int n = 0; n < PN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[n][e] = p[n][e] * (dp[n][e] - delta_q[qi_of(n, e, c)]);
}

// The dq kernels' weights for one pass of PN*8 keys (columns, the first key0; rows = a warp's queries
// rowA, rowB with lse lA, lB in base-2 units): P = 2^(S * scale * log2(e) - lse), zero for keys after
// the row or past T (only when `mask`: the diagonal tile). Then (dq_dscores, with the rows' delta dA,
// dB) dS = P * (dP - delta).
template <int PN>
__device__ __forceinline__ void dq_probs(float (&s)[PN][4], float lA, float lB, float sl2, bool mask, int key0,
                                         int rowA, int rowB, int T, int c) {
#pragma unroll
    for (int n = 0; n < PN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = ex2(fmaf(s[n][e], sl2, -(e < 2 ? lA : lB)));
    if (mask) {
#pragma unroll
        for (int n = 0; n < PN; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key0 + qi_of(n, e, c), row = e < 2 ? rowA : rowB;
                if (key > row || key >= T || row >= T) s[n][e] = 0.f;
            }
    }
}
template <int PN>
__device__ __forceinline__ void dq_dscores(float (&dp)[PN][4], const float (&p)[PN][4], float dA, float dB) {
#pragma unroll
    for (int n = 0; n < PN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[n][e] = p[n][e] * (dp[n][e] - (e < 2 ? dA : dB));
}
