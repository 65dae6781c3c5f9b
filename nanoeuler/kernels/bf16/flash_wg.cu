// The warpgroup FlashAttention (wgmma, sm_90a), head size 64. Reference: as flash_mma.cu.

#include "mma.cuh"
#include "wgmma.cuh"

// ---- Hopper warpgroup attention (wgmma, sm_90a) ----------------------------------------------------------
// flash_{fwd,bwd_dq,bwd_dkdv}_wg_d64 have a body only when built for sm_90a (the module is, on a
// compute-capability-9.0 device: see kernels/__init__.py); elsewhere the engine uses the ldm kernels.
// Same arithmetic, grids and outputs as those, with the block's 4 warps acting as one warpgroup: every
// product is a whole 64 x 64 tile in 4 wgmma.m64n64k16. The tiles come from shared memory, which the
// tensor cores read themselves (no ldmatrix) in the 128-byte-swizzled layout below, as [n][k] or,
// transposed, as [k][n]: the streamed ones (two stages) and the block's own rows (Q; in dq also dO, in
// dk/dv K and V), copied once. The softmax weights and dS, whose accumulator layout is the A-fragment
// layout, are the A operand from registers. The accumulators have the
// mma.sync C layout per warp (warp w holds rows 16w .. 16w+15), so the softmax and weight steps are the
// ldm kernels' own device functions.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// A 64 x 64 bf16 tile (128-byte rows) as wgmma reads it with 128-byte swizzling: the 16-byte chunk j
// of row r lies at chunk j ^ (r % 8) of that row, and the tile starts 1024-byte aligned.
__device__ __forceinline__ unsigned sw128(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

// cp.async of a 64-row tile (rows r0.., row stride ld) into the swizzled tile at shared address dst;
// rows >= rmax become zeros. 128 threads: thread t copies chunk t % 8 of rows t / 8 + 16 j, j = 0 .. 3,
// which all share one swizzle (row % 8), so the four copies differ only by constant offsets. Unrolled,
// with no per-chunk index arithmetic: the attention kernels are bound by instruction issue
// (docs/benchmarks-log.md, Kernel notes).
__device__ __forceinline__ void cp_tile_sw(unsigned dst, const bf16* base, long long ld, int r0, int rmax) {
    const int row = threadIdx.x >> 3;
    const unsigned sa = dst + sw128(row, threadIdx.x & 7);
    const bf16* src = base + (long long)(r0 + row) * ld + (threadIdx.x & 7) * 8;
    const bool whole = r0 + FA_BR <= rmax;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if (whole || r0 + row + 16 * j < rmax)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa + j * 2048), "l"(src + 16 * j * ld));
        else
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(sa + j * 2048), "r"(0u));
    }
}

// The warpgroup kernels' 64 x 64 tiles (8 KiB each) lie in dynamic shared memory, the first 1024-byte
// aligned: the host gives each kernel 1 KiB more than its tiles (flash.py: FLASH_WG_SMEM). Static arrays
// are limited to 48 KiB, which the dq and dk/dv kernels' six tiles exceed.
__device__ __forceinline__ unsigned wg_tiles() {
    extern __shared__ __align__(128) unsigned char fa_smem[];
    return (smem_u32(fa_smem) + 1023u) & ~1023u;
}
#endif

// 5 blocks per multiprocessor: more warpgroups hide each one's wait for its own products
// (docs/benchmarks-log.md, Kernel notes).
extern "C" __global__ void __launch_bounds__(128, 5) flash_fwd_wg_d64(const bf16* __restrict__ q,
                                                                    const bf16* __restrict__ k,
                                                                    const bf16* __restrict__ v, bf16* __restrict__ o,
                                                                    float* __restrict__ lse, int H, int Hkv, int T,
                                                                    float scale) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int D = 64, NT = D / 8, ST = FA_BR / 8, TILE = FA_BR * D * 2;
    const unsigned sbase = wg_tiles();  // K stage 0, 1, V stage 0, 1, then Q
    const int nqb = (T + FA_BR - 1) / FA_BR;
    const int qb = nqb - 1 - blockIdx.y;  // longest rows first (see "Grids" above)
    const int bh = blockIdx.x, b = bh / H, h = bh % H, hk = h / (H / Hkv);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const bf16* kh = k + ((long long)b * Hkv + hk) * T * D;
    const bf16* vh = v + ((long long)b * Hkv + hk) * T * D;
    const int r0 = qb * FA_BR + warp * 16;
    auto load = [&](int t, int st) {  // key tile t into stage st
        cp_tile_sw(sbase + st * TILE, kh, D, t * FA_BR, T);
        cp_tile_sw(sbase + (2 + st) * TILE, vh, D, t * FA_BR, T);
    };
    const unsigned qs = sbase + 4 * TILE;  // this block's queries
    cp_tile_sw(qs, q + (long long)bh * T * D, D, qb * FA_BR, T);
    load(0, 0);
    cp_commit();
    float acc[NT][4];
    zero_frags(acc);
    const float NEG = __int_as_float(0xff800000);
    float m0 = NEG, m1 = NEG, l0 = 0.f, l1 = 0.f;
    const float sl2 = scale * LOG2E;
    const int rowA = r0 + g, rowB = r0 + g + 8;
    for (int kb = 0; kb <= qb; ++kb) {
        const int st = kb & 1;
        tile_step<true, decltype(load)&, true>(kb, qb + 1, st, load);
        float s[ST][4];
        wg_fence();
        wgmma_64x64x64_ss<0, 0>(s, qs, sbase + st * TILE);  // S = Q K^T
        wg_commit_wait();
        wg_hold(s);
        online_softmax_tile(s, acc, m0, m1, l0, l1, sl2, kb == qb, kb * FA_BR, rowA, rowB, T, c);
        unsigned pa[4][4];
        frags_of(pa, s);
        wg_fence();
        wgmma_64x64x64<1, 1>(acc, pa, sbase + (2 + st) * TILE);  // O += P V
        wg_commit_wait();
        wg_hold(acc);
        wg_hold(pa);
        __syncthreads();  // stage st is refilled by the next iteration
    }
    store_o_lse<D>(acc, m0, m1, l0, l1, o, lse, b, h, H, T, rowA, rowB, c);
#else
    __trap();  // built for another target: the engine launches this kernel only on sm_90a builds
#endif
}

// dk, dv for 64 keys of one (b, kv head), as flash_bwd_dkdv_mma_impl with whole 64-query passes: per
// query tile S^T = K Q^T and dP^T = V dO^T (the block's K, V tiles and the Q, dO tiles, read [n][k]),
// then dV += P^T dO and dK += dS^T Q (P^T, dS^T from registers; the same tiles read [k][n]). 3 blocks
// per multiprocessor, which K and V in shared memory make room for; 3 beat 2 although ptxas then
// serializes the wgmma (docs/benchmarks-log.md, Kernel notes).
extern "C" __global__ void __launch_bounds__(128, 3) flash_bwd_dkdv_wg_d64(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const bf16* __restrict__ dO,
    const float* __restrict__ lse, const float* __restrict__ delta, bf16* __restrict__ dqkv,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t, int H, int Hkv, int T, float scale) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int D = 64, KC = D / 16, NT = D / 8, TILE = FA_BR * D * 2;
    __shared__ float lse_s[2][FA_BR], delta_s[2][FA_BR];
    const unsigned sbase = wg_tiles();  // Q stage 0, 1, dO stage 0, 1, then K, V
    const int nb = (T + FA_BR - 1) / FA_BR;
    const int kb = blockIdx.y;  // the first keys see the most queries: they start first
    const int bhk = blockIdx.x, b = bhk / Hkv, hk = bhk % Hkv, G = H / Hkv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const long long HD = (long long)H * D;
    const int r0 = kb * FA_BR + warp * 16;  // this warp's first key
    const int nq = nb - kb, iters = G * nq;
    auto load = [&](int it, int st) {  // the Q/dO tiles, lse and delta of iteration `it` into stage `st`
        const int h = hk * G + it / nq, qb = kb + it % nq;
        const long long bh = (long long)b * H + h;
        cp_tile_sw(sbase + st * TILE, q + bh * T * D, D, qb * FA_BR, T);
        cp_tile_sw(sbase + (2 + st) * TILE, dO + (long long)b * T * HD + (long long)h * D, HD, qb * FA_BR, T);
        stage_query_stats<true>(lse_s[st], delta_s[st], lse + bh * T, delta + bh * T, qb * FA_BR, T);
    };
    const unsigned ks = sbase + 4 * TILE, vs = sbase + 5 * TILE;  // this block's keys and values
    cp_tile_sw(ks, k + (long long)bhk * T * D, D, kb * FA_BR, T);
    cp_tile_sw(vs, v + (long long)bhk * T * D, D, kb * FA_BR, T);
    load(0, 0);
    cp_commit();
    float dka[NT][4], dva[NT][4];
    zero_frags(dka);
    zero_frags(dva);
    const float sl2 = scale * LOG2E;
    const int keyA = r0 + g, keyB = r0 + g + 8;
    for (int it = 0; it < iters; ++it) {
        const int qb = kb + it % nq, st = it & 1;
        tile_step<true, decltype(load)&, true>(it, iters, st, load);
        const unsigned qs = sbase + st * TILE, ds = sbase + (2 + st) * TILE;
        // four groups of products, each overlapping the arithmetic that follows it: P^T is formed while
        // dP^T is multiplied, dS^T while dV is
        float s[NT][4], dp[NT][4];
        wg_fence();
        wgmma_64x64x64_ss<0, 0>(s, ks, qs);  // S^T = K Q^T
        wg_commit();
        wgmma_64x64x64_ss<0, 0>(dp, vs, ds);  // dP^T = V dO^T
        wg_commit();
        wg_wait<1>();
        wg_hold(s);
        dkdv_probs(s, lse_s[st], sl2, qb == kb || qb == nb - 1, qb * FA_BR, keyA, keyB, T, c);
        unsigned pa[KC][4], dsa[KC][4];
        frags_of(pa, s);
        wg_fence();
        wgmma_64x64x64<1, 1>(dva, pa, ds);  // dV += P^T dO
        wg_commit();
        wg_wait<1>();
        wg_hold(dp);
        dkdv_dscores(dp, s, delta_s[st], c);
        frags_of(dsa, dp);
        wg_fence();
        wgmma_64x64x64<1, 1>(dka, dsa, qs);  // dK += dS^T Q
        wg_commit_wait();
        wg_hold(dva);
        wg_hold(dka);
        wg_hold(pa);
        wg_hold(dsa);
        __syncthreads();  // stage st is refilled by the next iteration
    }
    const long long W = (long long)(H + 2 * Hkv) * D;
    store_dqkv_rows<D>(dka, dqkv, W, b, T, kb * FA_BR + warp * 16, (H + hk) * D, scale, true, cos_t, sin_t, g, c);
    store_dqkv_rows<D>(dva, dqkv, W, b, T, kb * FA_BR + warp * 16, (H + Hkv + hk) * D, 1.f, false, cos_t, sin_t, g, c);
#else
    __trap();
#endif
}

// dq for 64 queries of one (b, h), as flash_bwd_dq_mma_impl with whole 64-key passes: per key tile
// S = Q K^T and dP = dO V^T (the block's Q, dO tiles and the K, V tiles, read [n][k]), then
// dQ += dS K (the K tile read [k][n]). 4 blocks per multiprocessor, where Q and dO in registers allowed 3.
extern "C" __global__ void __launch_bounds__(128, 4) flash_bwd_dq_wg_d64(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const bf16* __restrict__ dO,
    const bf16* __restrict__ o, const float* __restrict__ lse, float* __restrict__ delta, bf16* __restrict__ dqkv,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t, int H, int Hkv, int T, float scale) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int D = 64, KC = D / 16, NT = D / 8, TILE = FA_BR * D * 2;
    const unsigned sbase = wg_tiles();  // K stage 0, 1, V stage 0, 1, then Q, dO
    const int nb = (T + FA_BR - 1) / FA_BR;
    const int qb = nb - 1 - blockIdx.y;  // longest rows first
    const int bh = blockIdx.x, b = bh / H, h = bh % H, hk = h / (H / Hkv);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int r0 = qb * FA_BR + warp * 16;
    const int rowA = r0 + g, rowB = r0 + g + 8;
    const bf16* kh = k + ((long long)b * Hkv + hk) * T * D;
    const bf16* vh = v + ((long long)b * Hkv + hk) * T * D;
    auto load = [&](int t, int st) {  // key tile t into stage st
        cp_tile_sw(sbase + st * TILE, kh, D, t * FA_BR, T);
        cp_tile_sw(sbase + (2 + st) * TILE, vh, D, t * FA_BR, T);
    };
    const unsigned qs = sbase + 4 * TILE, dos = sbase + 5 * TILE;  // this block's queries and their dO
    cp_tile_sw(qs, q + (long long)bh * T * D, D, qb * FA_BR, T);
    cp_tile_sw(dos, dO + (long long)b * T * H * D + (long long)h * D, (long long)H * D, qb * FA_BR, T);
    load(0, 0);
    cp_commit();
    const float lA = rowA < T ? lse[(long long)bh * T + rowA] * LOG2E : 0.f;  // base-2 units
    const float lB = rowB < T ? lse[(long long)bh * T + rowB] * LOG2E : 0.f;
    // delta = rowsum(dO * O) of the block's rows, two threads a row, each 32 columns in 16-byte loads
    // (whole sectors, unlike loads in the mma layout), into `delta` for the dk/dv kernel and into shared
    // memory for the warps' own rows (docs/benchmarks-log.md, Kernel notes).
    __shared__ float delta_s[FA_BR];
    {
        const int row = threadIdx.x >> 1, t = qb * FA_BR + row;
        float d = 0.f;
        if (t < T) {
            const long long off = ((long long)b * T + t) * H * D + (long long)h * D + (threadIdx.x & 1) * 32;
#pragma unroll
            for (int j = 0; j < 4; ++j)
                d += dot_bf16x8(reinterpret_cast<const uint4*>(dO + off)[j], reinterpret_cast<const uint4*>(o + off)[j]);
        }
        d += __shfl_xor_sync(0xffffffffu, d, 1);
        if ((threadIdx.x & 1) == 0) {
            delta_s[row] = d;
            if (t < T) delta[(long long)bh * T + t] = d;
        }
    }
    __syncthreads();
    const float dA = delta_s[warp * 16 + g], dB = delta_s[warp * 16 + g + 8];
    float acc[NT][4];
    zero_frags(acc);
    const float sl2 = scale * LOG2E;
    for (int kb = 0; kb <= qb; ++kb) {
        const int st = kb & 1;
        tile_step<true, decltype(load)&, true>(kb, qb + 1, st, load);
        const unsigned ks = sbase + st * TILE, vs = sbase + (2 + st) * TILE;
        float s[NT][4], dp[NT][4];
        wg_fence();
        wgmma_64x64x64_ss<0, 0>(s, qs, ks);  // S = Q K^T
        wg_commit();
        wgmma_64x64x64_ss<0, 0>(dp, dos, vs);  // dP = dO V^T, multiplied while P is formed
        wg_commit();
        wg_wait<1>();
        wg_hold(s);
        dq_probs(s, lA, lB, sl2, kb == qb, kb * FA_BR, rowA, rowB, T, c);
        wg_wait<0>();
        wg_hold(dp);
        dq_dscores(dp, s, dA, dB);
        unsigned dsa[KC][4];
        frags_of(dsa, dp);
        wg_fence();
        wgmma_64x64x64<1, 1>(acc, dsa, ks);  // dQ += dS K
        wg_commit_wait();
        wg_hold(acc);
        wg_hold(dsa);
        __syncthreads();  // stage st is refilled by the next iteration
    }
    store_dqkv_rows<D>(acc, dqkv, (long long)(H + 2 * Hkv) * D, b, T, qb * FA_BR + warp * 16, h * D, scale, true,
                       cos_t, sin_t, g, c);
#else
    __trap();
#endif
}
