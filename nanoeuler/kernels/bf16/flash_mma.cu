// Tensor-core FlashAttention with mma.sync (bf16 operands, float32 accumulation), head sizes 32 and 64.
// Reference: nanoeuler.model.layers.attention_forward / attention_backward.

#include "mma.cuh"

template <int D, bool LDM>
__device__ __forceinline__ void flash_fwd_mma_impl(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                   const bf16* __restrict__ v, bf16* __restrict__ o,
                                                   float* __restrict__ lse, int H, int Hkv, int T, float scale) {
    constexpr int KC = D / 16, NT = D / 8, ST = FA_BR / 8, NS = LDM ? 2 : 1;
    __shared__ __align__(16) bf16 Ks[NS][FA_BR][D + FA_PAD];
    __shared__ __align__(16) bf16 Vs[NS][LDM ? FA_BR : 1][D + FA_PAD];  // V as is (LDM)
    __shared__ __align__(16) bf16 Vt[LDM ? 1 : D][FA_BR + FA_PAD];      // V transposed (without LDM)
    const int nqb = (T + FA_BR - 1) / FA_BR;
    const int qb = nqb - 1 - blockIdx.y;  // longest rows first (see "Grids" above)
    const int bh = blockIdx.x, b = bh / H, h = bh % H, hk = h / (H / Hkv);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const bf16* qh = q + (long long)bh * T * D;
    const bf16* kh = k + ((long long)b * Hkv + hk) * T * D;
    const bf16* vh = v + ((long long)b * Hkv + hk) * T * D;
    const int r0 = qb * FA_BR + warp * 16;
    auto load = [&](int t, int st) {  // key tile t (see tile_step)
        if constexpr (LDM) {
            cp_tile<D>(Ks[st], kh, D, t * FA_BR, T);
            cp_tile<D>(Vs[st], vh, D, t * FA_BR, T);
        } else {
            load_tile<D>(Ks[0], nullptr, kh, D, t * FA_BR, T);
            load_tile<D>(nullptr, Vt, vh, D, t * FA_BR, T);
        }
    };
    if constexpr (LDM) {
        load(0, 0);
        cp_commit();
    }
    unsigned qa[KC][4];
    load_a_frags<D>(qa, qh, D, r0, T, g, c);
    float acc[NT][4];
    zero_frags(acc);
    const float NEG = __int_as_float(0xff800000);
    float m0 = NEG, m1 = NEG, l0 = 0.f, l1 = 0.f;
    const float sl2 = scale * LOG2E;
    const int rowA = r0 + g, rowB = r0 + g + 8;
    for (int kb = 0; kb <= qb; ++kb) {
        const int st = LDM ? (kb & 1) : 0;
        tile_step<LDM>(kb, qb + 1, st, load);
        float s[ST][4];
        zero_frags(s);
        mma_rows_tile<D, LDM>(s, qa, Ks[st], g, c, lane);
        online_softmax_tile(s, acc, m0, m1, l0, l1, sl2, kb == qb, kb * FA_BR, rowA, rowB, T, c);
        mma_p_tile<D, LDM>(acc, s, Vs[st], Vt, 0, g, c, lane);
        if constexpr (LDM) __syncthreads();  // stage st is refilled by the next iteration
    }
    store_o_lse<D>(acc, m0, m1, l0, l1, o, lse, b, h, H, T, rowA, rowB, c);
}

// A dk/dv kernel's rows: the K and V A fragments of a warp's 16 keys r0.. of the (batch, kv head) pair
// bhk, and its dK, dV accumulators, zeroed.
template <int D>
__device__ __forceinline__ void dkdv_rows(unsigned (&ka)[D / 16][4], unsigned (&va)[D / 16][4], float (&dka)[D / 8][4],
                                          float (&dva)[D / 8][4], const bf16* __restrict__ k,
                                          const bf16* __restrict__ v, int bhk, int T, int r0, int g, int c) {
    load_a_frags<D>(ka, k + (long long)bhk * T * D, D, r0, T, g, c);
    load_a_frags<D>(va, v + (long long)bhk * T * D, D, r0, T, g, c);
    zero_frags(dka);
    zero_frags(dva);
}

// dk, dv for 64 keys of one (b, kv head): loops over the group's query heads and the query tiles at or
// after the keys' tile (with LDM: flattened into one loop, the next Q/dO tiles streaming in by cp.async).
template <int D, bool LDM>
__device__ __forceinline__ void flash_bwd_dkdv_mma_impl(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const bf16* __restrict__ dO,
    const float* __restrict__ lse, const float* __restrict__ delta, bf16* __restrict__ dqkv,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t, int H, int Hkv, int T, float scale) {
    constexpr int KC = D / 16, NT = D / 8, PC = FA_DKDV_PASS, PN = PC / 8, NS = LDM ? 2 : 1;
    __shared__ __align__(16) bf16 Qs[NS][FA_BR][D + FA_PAD];
    __shared__ __align__(16) bf16 Ds[NS][FA_BR][D + FA_PAD];
    __shared__ __align__(16) bf16 Qt[LDM ? 1 : D][FA_BR + FA_PAD];
    __shared__ __align__(16) bf16 Dt[LDM ? 1 : D][FA_BR + FA_PAD];
    __shared__ float lse_s[NS][FA_BR], delta_s[NS][FA_BR];
    const int nb = (T + FA_BR - 1) / FA_BR;
    const int kb = blockIdx.y;  // the first keys see the most queries: they start first
    const int bhk = blockIdx.x, b = bhk / Hkv, hk = bhk % Hkv, G = H / Hkv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const long long HD = (long long)H * D;
    const int r0 = kb * FA_BR + warp * 16;  // this warp's first key
    const int nq = nb - kb, iters = G * nq;
    // the Q/dO tiles (and their lse, delta) of iteration `it` into stage `st` (see tile_step)
    auto load = [&](int it, int st) {
        const int h = hk * G + it / nq, qb = kb + it % nq;
        const long long bh = (long long)b * H + h;
        if constexpr (LDM) {
            cp_tile<D>(Qs[st], q + bh * T * D, D, qb * FA_BR, T);
            cp_tile<D>(Ds[st], dO + (long long)b * T * HD + (long long)h * D, HD, qb * FA_BR, T);
        } else {
            load_tile<D>(Qs[st], Qt, q + bh * T * D, D, qb * FA_BR, T);
            load_tile<D>(Ds[st], Dt, dO + (long long)b * T * HD + (long long)h * D, HD, qb * FA_BR, T);
        }
        stage_query_stats<LDM>(lse_s[st], delta_s[st], lse + bh * T, delta + bh * T, qb * FA_BR, T);  // LDM: no stall
    };
    if constexpr (LDM) {
        load(0, 0);
        cp_commit();
    }
    unsigned ka[KC][4], va[KC][4];
    float dka[NT][4], dva[NT][4];
    dkdv_rows<D>(ka, va, dka, dva, k, v, bhk, T, r0, g, c);
    const float sl2 = scale * LOG2E;
    const int keyA = r0 + g, keyB = r0 + g + 8;
    for (int it = 0; it < iters; ++it) {
        const int qb = kb + it % nq;
        const int st = LDM ? (it & 1) : 0;
        tile_step<LDM>(it, iters, st, load);
        // the query tile in passes of PC columns (see FA_DKDV_PASS)
#pragma unroll 1
        for (int q0 = 0; q0 < FA_BR; q0 += PC) {
            if (qb == kb && q0 + PC <= warp * 16) continue;  // (warp-uniform) every query before every key
            float s[PN][4], dp[PN][4];
            zero_frags(s);
            zero_frags(dp);
            mma_rows_tile<D, LDM, PC>(s, ka, Qs[st] + q0, g, c, lane);   // S^T = K Q^T
            mma_rows_tile<D, LDM, PC>(dp, va, Ds[st] + q0, g, c, lane);  // dP^T = V dO^T
            // P^T and dS^T = P^T * (dP^T - delta); rows = keys, columns = queries; masked on the causal
            // diagonal and in the last query tile (queries past T)
            dkdv_probs(s, lse_s[st] + q0, sl2, qb == kb || qb == nb - 1, qb * FA_BR + q0, keyA, keyB, T, c);
            dkdv_dscores(dp, s, delta_s[st] + q0, c);
            mma_p_tile<D, LDM, PC>(dva, s, Ds[st] + q0, Dt, q0, g, c, lane);   // dV += P^T dO
            mma_p_tile<D, LDM, PC>(dka, dp, Qs[st] + q0, Qt, q0, g, c, lane);  // dK += dS^T Q
        }
        if constexpr (LDM) __syncthreads();
    }
    const long long W = (long long)(H + 2 * Hkv) * D;
    store_dqkv_rows<D>(dka, dqkv, W, b, T, kb * FA_BR + warp * 16, (H + hk) * D, scale, true, cos_t, sin_t, g, c);
    store_dqkv_rows<D>(dva, dqkv, W, b, T, kb * FA_BR + warp * 16, (H + Hkv + hk) * D, 1.f, false, cos_t, sin_t, g, c);
}

// A dq kernel's rows: the Q and dO A fragments of a warp's 16 rows r0.. of (b, h), their logsumexp in
// base-2 units (lA: row r0 + g, lB: row r0 + g + 8), and delta = rowsum(dO * O) from dO's fragments and
// O's (rows g | g + 8 in regs 0, 2 | 1, 3), summed over the quad's four threads and also stored for the
// dk/dv kernel, which runs after the dq kernel.
template <int D>
__device__ __forceinline__ void dq_rows(unsigned (&qa)[D / 16][4], unsigned (&doa)[D / 16][4], float& lA, float& lB,
                                        float& dA, float& dB, const bf16* __restrict__ q, const bf16* __restrict__ dO,
                                        const bf16* __restrict__ o, const float* __restrict__ lse,
                                        float* __restrict__ delta, int b, int h, int H, int T, int r0, int g, int c) {
    const long long HD = (long long)H * D, bh = (long long)b * H + h;
    load_a_frags<D>(qa, q + bh * T * D, D, r0, T, g, c);
    load_a_frags<D>(doa, dO + (long long)b * T * HD + (long long)h * D, HD, r0, T, g, c);
    lA = r0 + g < T ? lse[bh * T + r0 + g] * LOG2E : 0.f;
    lB = r0 + g + 8 < T ? lse[bh * T + r0 + g + 8] * LOG2E : 0.f;
    unsigned oa[D / 16][4];
    load_a_frags<D>(oa, o + (long long)b * T * HD + (long long)h * D, HD, r0, T, g, c);
    dA = dB = 0.f;
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
        dA += lo_bf(doa[kc][0]) * lo_bf(oa[kc][0]) + hi_bf(doa[kc][0]) * hi_bf(oa[kc][0]) +
              lo_bf(doa[kc][2]) * lo_bf(oa[kc][2]) + hi_bf(doa[kc][2]) * hi_bf(oa[kc][2]);
        dB += lo_bf(doa[kc][1]) * lo_bf(oa[kc][1]) + hi_bf(doa[kc][1]) * hi_bf(oa[kc][1]) +
              lo_bf(doa[kc][3]) * lo_bf(oa[kc][3]) + hi_bf(doa[kc][3]) * hi_bf(oa[kc][3]);
    }
    dA += __shfl_xor_sync(0xffffffffu, dA, 1);
    dA += __shfl_xor_sync(0xffffffffu, dA, 2);
    dB += __shfl_xor_sync(0xffffffffu, dB, 1);
    dB += __shfl_xor_sync(0xffffffffu, dB, 2);
    if (c == 0 && r0 + g < T) delta[bh * T + r0 + g] = dA;
    if (c == 0 && r0 + g + 8 < T) delta[bh * T + r0 + g + 8] = dB;
}

// dq for 64 queries of one (b, h): loops over the key tiles up to the diagonal.
template <int D, bool LDM>
__device__ __forceinline__ void flash_bwd_dq_mma_impl(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const bf16* __restrict__ dO,
    const bf16* __restrict__ o, const float* __restrict__ lse, float* __restrict__ delta, bf16* __restrict__ dqkv,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t, int H, int Hkv, int T, float scale) {
    constexpr int KC = D / 16, NT = D / 8, PC = FA_DQ_PASS, PN = PC / 8, NS = LDM ? 2 : 1;
    __shared__ __align__(16) bf16 Ks[NS][FA_BR][D + FA_PAD];
    __shared__ __align__(16) bf16 Vs[NS][FA_BR][D + FA_PAD];
    __shared__ __align__(16) bf16 Kt[LDM ? 1 : D][FA_BR + FA_PAD];
    const int nb = (T + FA_BR - 1) / FA_BR;
    const int qb = nb - 1 - blockIdx.y;  // longest rows first
    const int bh = blockIdx.x, b = bh / H, h = bh % H, hk = h / (H / Hkv);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int r0 = qb * FA_BR + warp * 16;
    const int rowA = r0 + g, rowB = r0 + g + 8;
    const bf16* kh = k + ((long long)b * Hkv + hk) * T * D;
    const bf16* vh = v + ((long long)b * Hkv + hk) * T * D;
    auto load = [&](int t, int st) {  // key tile t (see tile_step)
        if constexpr (LDM) {
            cp_tile<D>(Ks[st], kh, D, t * FA_BR, T);
            cp_tile<D>(Vs[st], vh, D, t * FA_BR, T);
        } else {
            load_tile<D>(Ks[0], Kt, kh, D, t * FA_BR, T);
            load_tile<D>(Vs[0], nullptr, vh, D, t * FA_BR, T);
        }
    };
    if constexpr (LDM) {
        load(0, 0);
        cp_commit();
    }
    unsigned qa[KC][4], doa[KC][4];
    float lA, lB, dA, dB;
    dq_rows<D>(qa, doa, lA, lB, dA, dB, q, dO, o, lse, delta, b, h, H, T, r0, g, c);
    float acc[NT][4];
    zero_frags(acc);
    const float sl2 = scale * LOG2E;
    for (int kb = 0; kb <= qb; ++kb) {
        const int st = LDM ? (kb & 1) : 0;
        tile_step<LDM>(kb, qb + 1, st, load);
        // the key tile in passes of PC columns (see FA_DQ_PASS)
#pragma unroll 1
        for (int k0 = 0; k0 < FA_BR; k0 += PC) {
            if (kb == qb && k0 >= warp * 16 + 16) continue;  // (warp-uniform) every key after every row
            float s[PN][4], dp[PN][4];
            zero_frags(s);
            zero_frags(dp);
            mma_rows_tile<D, LDM, PC>(s, qa, Ks[st] + k0, g, c, lane);    // S = Q K^T
            mma_rows_tile<D, LDM, PC>(dp, doa, Vs[st] + k0, g, c, lane);  // dP = dO V^T
            dq_probs(s, lA, lB, sl2, kb == qb, kb * FA_BR + k0, rowA, rowB, T, c);
            dq_dscores(dp, s, dA, dB);
            mma_p_tile<D, LDM, PC>(acc, dp, Ks[st] + k0, Kt, k0, g, c, lane);  // dQ += dS K
        }
        if constexpr (LDM) __syncthreads();
    }
    store_dqkv_rows<D>(acc, dqkv, (long long)(H + 2 * Hkv) * D, b, T, qb * FA_BR + warp * 16, h * D, scale, true,
                       cos_t, sin_t, g, c);
}

// VAR: mma (B fragments by 32-bit shared loads, transposed tile copies) or ldm (ldmatrix); LDM: its flag.
#define FLASH_MMA_KERNELS_V(D, VAR, LDM)                                                                      \
    extern "C" __global__ void __launch_bounds__(128) flash_fwd_##VAR##_d##D(                                    \
        const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, int H, int Hkv, int T, float scale) {     \
        flash_fwd_mma_impl<D, LDM>(q, k, v, o, lse, H, Hkv, T, scale);                                            \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(128, FA_DKDV_BLOCKS) flash_bwd_dkdv_##VAR##_d##D(                               \
        const bf16* q, const bf16* k, const bf16* v, const bf16* dO, const float* lse, const float* delta,       \
        bf16* dqkv, const float* cos_t, const float* sin_t, int H, int Hkv, int T, float scale) {               \
        flash_bwd_dkdv_mma_impl<D, LDM>(q, k, v, dO, lse, delta, dqkv, cos_t, sin_t, H, Hkv, T, scale);           \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(128, FA_DQ_BLOCKS) flash_bwd_dq_##VAR##_d##D(                                 \
        const bf16* q, const bf16* k, const bf16* v, const bf16* dO, const bf16* o, const float* lse,            \
        float* delta, bf16* dqkv, const float* cos_t, const float* sin_t, int H, int Hkv, int T, float scale) {  \
        flash_bwd_dq_mma_impl<D, LDM>(q, k, v, dO, o, lse, delta, dqkv, cos_t, sin_t, H, Hkv, T, scale);          \
    }
#define FLASH_MMA_KERNELS(D) FLASH_MMA_KERNELS_V(D, mma, false) FLASH_MMA_KERNELS_V(D, ldm, true)

FLASH_MMA_KERNELS(32)
FLASH_MMA_KERNELS(64)
