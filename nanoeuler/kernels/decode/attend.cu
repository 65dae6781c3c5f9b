// The decode engine's attention of rows over their slots' KV cache (launchers in attend.py): a block per
// (row, query head) over attend_row (decode.cuh), float out for the GEMV path, W out for the cuBLAS path;
// and a block per (row, key/value head) for wide batches. Reference: layers.attention_forward of each row's
// query over its slot's keys 0..pos.
//
// Kernels, per storage of the cache (_bf16, _f32): attend, attend_act, attend_kv_act.

#include "decode.cuh"

// grid (M, H): out (M, H, D) of O.
template <typename W, typename O, bool PRE>
__device__ void attend(const float* __restrict__ q, const W* __restrict__ kc, const W* __restrict__ vc,
                       const int* __restrict__ meta, O* __restrict__ out, int M, int H, int Hkv, int D, int L) {
    const int m = blockIdx.x, h = blockIdx.y;
    cache_prefetch<W>(kc, vc, meta, M, H, Hkv, D, L, m, h);
    attend_row<W, O, PRE>(q, kc, vc, meta, out + ((long long)m * H + h) * D, M, H, Hkv, D, L, m, h, [] {
        pdl_wait();
        pdl_launch();
    });
}

// ---- attention of many rows: a block per (row, key/value head), its query heads together ------------
// grid (M, Hkv), KV_WARPS warps: out (M, H, D) of O (the wide batch's GEMM operand). The G = H / Hkv query
// heads that share a key/value head read its cache rows once (G a template argument, so that the heads'
// products interleave). A group of P = D / Vec lanes takes one key at a time (lane c of the group: the
// 16-byte piece c of the key and of the value row), so a warp holds 32 / P keys; the groups of the block
// take keys gi, gi + groups, ... and keep, per query head, a running max, sum and output piece (an online
// softmax), requesting KV_AHEAD keys' rows before using any. A warp folds its groups by shuffles, and the
// warps' partials meet in shared memory: G * KV_WARPS * (D + 2) floats. Needs 32 % P == 0 and G <= KV_MAXG
// (plan.choose_variants checks; other shapes take attend_act).

// (m, s, acc) of one query head folded with the same of the lane `off` away (empty: m = NEG_INF, s = 0)
template <int V>
__device__ __forceinline__ void fold_lanes(float& m, float& s, float* acc, int off) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off), s2 = __shfl_xor_sync(0xffffffffu, s, off);
    const float nm = fmaxf(m, m2);
    const float r1 = m == NEG_INF ? 0.f : __expf(m - nm), r2 = m2 == NEG_INF ? 0.f : __expf(m2 - nm);
#pragma unroll
    for (int i = 0; i < V; i++) acc[i] = acc[i] * r1 + __shfl_xor_sync(0xffffffffu, acc[i], off) * r2;
    s = s * r1 + s2 * r2;
    m = nm;
}

template <typename W, typename O, int G>
__device__ void attend_kv(const float* __restrict__ q, const W* __restrict__ kc, const W* __restrict__ vc,
                          const int* __restrict__ meta, O* __restrict__ out, int M, int H, int Hkv, int D, int L) {
    extern __shared__ float sm[];
    constexpr int V = Vec<W>::N;
    const int m = blockIdx.x, kvh = blockIdx.y, P = D / V, warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31, c = lane % P, per_warp = 32 / P;
    const int groups = KV_WARPS * per_warp, gi = warp * per_warp + lane / P;
    pdl_wait();
    pdl_launch();
    const int slot = meta[M + m], S = meta[2 * M + m] + 1;
    const W* kb = kc + ((long long)slot * Hkv + kvh) * L * D + c * V;
    const W* vb = vc + ((long long)slot * Hkv + kvh) * L * D + c * V;
    const float scale = rsqrtf((float)D);
    float qv[G][V], mx[G], sum[G], acc[G][V];
#pragma unroll
    for (int g = 0; g < G; g++) {
        mx[g] = NEG_INF;
        sum[g] = 0.f;
#pragma unroll
        for (int i = 0; i < V; i++) {
            acc[g][i] = 0.f;
            qv[g][i] = q[((long long)m * H + kvh * G + g) * D + c * V + i] * scale;
        }
    }
    // the warp's loop bounds come from its first group, so that all its lanes take part in every shuffle
    const int wg = warp * per_warp;
    for (int j0 = wg; j0 < S; j0 += KV_AHEAD * groups) {
        uint4 kr[KV_AHEAD], vr[KV_AHEAD];
#pragma unroll
        for (int a = 0; a < KV_AHEAD; a++) {
            const int j = j0 + gi - wg + a * groups;
            if (j < S) {
                kr[a] = ld16(kb + (long long)j * D);
                vr[a] = ld16(vb + (long long)j * D);
            }
        }
#pragma unroll
        for (int a = 0; a < KV_AHEAD; a++) {
            if (j0 + a * groups >= S) break;  // the same in every lane of the warp
            const bool here = j0 + gi - wg + a * groups < S;  // the same in every lane of a group
            float kf[V], vf[V], s[G];
            Vec<W>::unpack(here ? kr[a] : make_uint4(0, 0, 0, 0), kf);
            Vec<W>::unpack(here ? vr[a] : make_uint4(0, 0, 0, 0), vf);
#pragma unroll
            for (int g = 0; g < G; g++) {
                s[g] = 0.f;
#pragma unroll
                for (int i = 0; i < V; i++) s[g] += qv[g][i] * kf[i];
            }
            for (int o = P / 2; o > 0; o >>= 1) {
#pragma unroll
                for (int g = 0; g < G; g++) s[g] += __shfl_xor_sync(0xffffffffu, s[g], o, P);
            }
            if (!here) continue;
#pragma unroll
            for (int g = 0; g < G; g++) {
                const float nm = fmaxf(mx[g], s[g]), r = __expf(mx[g] - nm), p = __expf(s[g] - nm);
                mx[g] = nm;
                sum[g] = sum[g] * r + p;
#pragma unroll
                for (int i = 0; i < V; i++) acc[g][i] = acc[g][i] * r + p * vf[i];
            }
        }
    }
    // the warp's groups -> lanes 0..P-1 (the same piece c a lane across the groups), then to shared memory:
    // part[(g * KV_WARPS + warp) * D + d], then the (max, sum) pairs after all G * KV_WARPS * D
    float* part = sm;
    float* ms = sm + G * KV_WARPS * D;
#pragma unroll
    for (int g = 0; g < G; g++) {
        for (int off = P; off < 32; off <<= 1) fold_lanes<V>(mx[g], sum[g], acc[g], off);
        if (lane < P) {
#pragma unroll
            for (int i = 0; i < V; i++) part[(g * KV_WARPS + warp) * D + c * V + i] = acc[g][i];
        }
        if (lane == 0) {
            ms[2 * (g * KV_WARPS + warp)] = mx[g];
            ms[2 * (g * KV_WARPS + warp) + 1] = sum[g];
        }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < G * D; t += blockDim.x) {
        const int g = t / D, d = t % D;
        float big = NEG_INF;
#pragma unroll
        for (int k = 0; k < KV_WARPS; k++) big = fmaxf(big, ms[2 * (g * KV_WARPS + k)]);
        float o = 0.f, l = 0.f;
#pragma unroll
        for (int k = 0; k < KV_WARPS; k++) {
            const float w = __expf(ms[2 * (g * KV_WARPS + k)] - big);  // 0 for a warp that saw no key
            l += ms[2 * (g * KV_WARPS + k) + 1] * w;
            o += part[(g * KV_WARPS + k) * D + d] * w;
        }
        out[((long long)m * H + kvh * G + g) * D + d] = fromf<O>(o / l);
    }
}

// the instance of G = H / Hkv (1 to KV_MAXG)
template <typename W, typename O>
__device__ void attend_kv_any(const float* q, const W* kc, const W* vc, const int* meta, O* out, int M, int H,
                              int Hkv, int D, int L) {
    static_assert(KV_MAXG == 4, "attend_kv_any has a case for each G up to KV_MAXG");
    switch (H / Hkv) {
        case 1: attend_kv<W, O, 1>(q, kc, vc, meta, out, M, H, Hkv, D, L); break;
        case 2: attend_kv<W, O, 2>(q, kc, vc, meta, out, M, H, Hkv, D, L); break;
        case 3: attend_kv<W, O, 3>(q, kc, vc, meta, out, M, H, Hkv, D, L); break;
        default: attend_kv<W, O, 4>(q, kc, vc, meta, out, M, H, Hkv, D, L); break;
    }
}

// ---- entry points -------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(ATTEND_THREADS) attend_bf16(const float* q, const bf16* kc,
    const bf16* vc, const int* meta, float* out, int M, int H, int Hkv, int D, int L) {
    attend<bf16, float, true>(q, kc, vc, meta, out, M, H, Hkv, D, L);
}
extern "C" __global__ void __launch_bounds__(ATTEND_THREADS, 2) attend_act_bf16(const float* q, const bf16* kc,
    const bf16* vc, const int* meta, bf16* out, int M, int H, int Hkv, int D, int L) {
    attend<bf16, bf16, false>(q, kc, vc, meta, out, M, H, Hkv, D, L);
}
extern "C" __global__ void __launch_bounds__(32 * KV_WARPS, 2) attend_kv_act_bf16(const float* q, const bf16* kc,
    const bf16* vc, const int* meta, bf16* out, int M, int H, int Hkv, int D, int L) {
    attend_kv_any<bf16, bf16>(q, kc, vc, meta, out, M, H, Hkv, D, L);
}
extern "C" __global__ void __launch_bounds__(ATTEND_THREADS) attend_f32(const float* q, const float* kc,
    const float* vc, const int* meta, float* out, int M, int H, int Hkv, int D, int L) {
    attend<float, float, true>(q, kc, vc, meta, out, M, H, Hkv, D, L);
}
extern "C" __global__ void __launch_bounds__(ATTEND_THREADS, 2) attend_act_f32(const float* q, const float* kc,
    const float* vc, const int* meta, float* out, int M, int H, int Hkv, int D, int L) {
    attend<float, float, false>(q, kc, vc, meta, out, M, H, Hkv, D, L);
}
extern "C" __global__ void __launch_bounds__(32 * KV_WARPS, 2) attend_kv_act_f32(const float* q, const float* kc,
    const float* vc, const int* meta, float* out, int M, int H, int Hkv, int D, int L) {
    attend_kv_any<float, float>(q, kc, vc, meta, out, M, H, Hkv, D, L);
}
