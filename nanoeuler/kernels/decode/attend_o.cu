// The one-row decode step's attention with the o projection in one kernel (launchers in attend_o.py):
// x += dx + W_o attention(q over the row's cache), dx cleared. attend_o: every block of a (row, head)
// attends over all keys; attend_o_cluster: the keys split over a thread block cluster (compute capability
// 9.0). Reference: layers.attention_forward, then the o projection and the residual add.
//
// Kernels, per storage of the weights and cache (_bf16, _f32): attend_o, attend_o_cluster.

#include "decode.cuh"

// ---- attention and the o projection in one kernel: x += W_o att (+ dx, folded in) ---------------------
// A one-row step's layer is three kernels: qkv (gemv_rope), attend_o, swiglu_down; the two branches join the
// residual stream by atomicAdd, so that no kernel waits for a whole product before the next step (a few
// rows take five kernels instead: docs/decode-kernels-log.md).
// grid (M H, splits): block (m H + h, s) attends row m with head h (attend_row, into shared
// memory), then adds its head's share of the o projection to the rows n of x in split s of C / splits:
// W_o[n, hD:(h+1)D] . att.
// A row's head slice is PR = D / Vec 16-byte pieces on PR neighbouring lanes, summed by shuffles; the H
// heads' shares meet in x. Head 0's blocks also fold in dx (the MLP branch of the layer before) and clear
// it for this layer's swiglu_down. The block's first O_PRE pieces a thread are requested before the wait.
// Shared: attend_row's (L + blockDim.x * (Vec + 1)) floats, then D.
template <typename W>
__device__ __forceinline__ float o_piece(uint4 u, const float* att) {
    float wf[Vec<W>::N], s = 0.f;
    Vec<W>::unpack(u, wf);
#pragma unroll
    for (int i = 0; i < Vec<W>::N; i++) s += wf[i] * att[i];
    return s;
}

// A block's share of the o projection: rows n0 .. n0 + C / splits of W_o, head h's D columns; piece i (a
// thread's j-th: i = threadIdx.x + j blockDim.x) is row n0 + i / PR, columns h D + (i % PR) Vec ... The
// first O_PRE pieces a thread are requested before the wait (load); add() adds each row's product with
// att (D floats, shared) to x[m] by atomicAdd, head 0's blocks also folding in dx (and clearing it).
template <typename W> struct OShare {
    const W* wo;
    int n0, PR, HD, hD, pieces;
    uint4 pre[O_PRE];
    __device__ OShare(const W* w, int split, int splits, int H, int D, int h, int C)
        : wo(w), n0(split * (C / splits)), PR(D / Vec<W>::N), HD(H * D), hD(h * D),
          pieces(C / splits * (D / Vec<W>::N)) {}
    __device__ const W* at(int i) const { return wo + (long long)(n0 + i / PR) * HD + hD + (i % PR) * Vec<W>::N; }
    __device__ void load() {
#pragma unroll
        for (int j = 0; j < O_PRE; j++) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i < pieces) pre[j] = ld16(at(i));
        }
    }
    __device__ void add(const float* att, int m, int C, bool fold, float* __restrict__ x,
                        float* __restrict__ dx) const {
        for (int j = 0; j * (int)blockDim.x < pieces; j++) {  // the same count in every lane (shuffles)
            const int i = threadIdx.x + j * blockDim.x;
            float s = 0.f;
            if (i < pieces) {
                uint4 u;
#pragma unroll
                for (int jj = 0; jj < O_PRE; jj++)
                    if (jj == j) u = pre[jj];
                if (j >= O_PRE) u = ld16(at(i));
                s = o_piece<W>(u, att + (i % PR) * Vec<W>::N);
            }
            for (int o = PR / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (i < pieces && i % PR == 0) {
                const long long n = (long long)m * C + n0 + i / PR;
                if (fold) {
                    s += dx[n];
                    dx[n] = 0.f;
                }
                atomicAdd(x + n, s);
            }
        }
    }
};

template <typename W>
__device__ void attend_o(const float* __restrict__ q, const W* __restrict__ kc, const W* __restrict__ vc,
                         const int* __restrict__ meta, const W* __restrict__ wo, float* __restrict__ x,
                         float* __restrict__ dx, int M, int H, int Hkv, int D, int L, int C) {
    extern __shared__ float sm[];
    constexpr int V = Vec<W>::N;
    const int m = blockIdx.x / H, h = blockIdx.x % H;
    OShare<W> share(wo, blockIdx.y, gridDim.y, H, D, h, C);
    share.load();
    cache_prefetch<W>(kc, vc, meta, M, H, Hkv, D, L, m, h);
    float* att = sm + L + blockDim.x * (V + 1);  // after attend_row's
    attend_row<W, float, true>(q, kc, vc, meta, att, M, H, Hkv, D, L, m, h, [] {
        pdl_wait();
        pdl_launch();
    });
    __syncthreads();
    share.add(att, m, C, h == 0, x, dx);
}

// ---- the same for one row with the keys split over a cluster of 8 blocks --------------------------------
// grid (M H, 8), clusters of the 8 blocks of a (row, head), OC_WARPS warps: block s attends over its eighth
// of the keys (contiguous), a group of P lanes a key (lane c: 16-byte piece c of the key and value rows,
// P = D / Vec rounded up to a power of two) with a running max, sum and output piece per group; a warp's
// groups meet by shuffles, the warps in shared memory, the 8 blocks' partial results through distributed
// shared memory (one cluster barrier), and each block then adds its split of the o projection to x, as
// attend_o does. Up to alone_keys keys every block attends over all of them and the cluster exchanges
// nothing (its barriers would cost more than the split saves). Keys that earlier steps wrote (all but the row's own
// position) are requested before the wait, with the block's W_o pieces. Needs D % Vec == 0, D / Vec <= 32.
// Clusters need compute capability 9.0: below it the kernel compiles without them (so that the file builds
// for every GPU) and the host never launches it (plan.choose_variants' attend_cluster).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define CLUSTER_DIMS __cluster_dims__(1, OSPLIT, 1)
#else
#define CLUSTER_DIMS
#endif
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r = 0;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}
__device__ __forceinline__ void cluster_arrive() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// a float of block `rank`'s shared memory, at the address p has in this block's
__device__ __forceinline__ float ld_cluster(const float* p, unsigned rank) {
    float v = *p;
#if __CUDA_ARCH__ >= 900
    unsigned a = smem_u32(p), r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(r) : "memory");
#endif
    return v;
}

template <typename W>
__device__ void attend_o_cluster(const float* __restrict__ q, const W* __restrict__ kc, const W* __restrict__ vc,
                                 const int* __restrict__ meta, const W* __restrict__ wo, float* __restrict__ x,
                                 float* __restrict__ dx, int M, int H, int Hkv, int D, int L, int C,
                                 int alone_keys) {
    constexpr int V = Vec<W>::N;
    __shared__ float gpart[OC_WARPS * 258];  // the warps' (max, sum, output D), D <= 256
    __shared__ float bpart[2 + 256];         // this block's
    __shared__ float att[256];
    const int m = blockIdx.x / H, h = blockIdx.x % H, split = cluster_rank();
    const int Pv = D / V, P = Pv <= 1 ? 1 : Pv <= 2 ? 2 : Pv <= 4 ? 4 : Pv <= 8 ? 8 : Pv <= 16 ? 16 : 32;
    const int lane = threadIdx.x & 31, c = lane % P, groups = blockDim.x / P, gi = threadIdx.x / P;
    const int slot = meta[M + m], S = meta[2 * M + m] + 1, old = S - 1 - m;
    const bool alone = S <= alone_keys;
    const int per = (S + OSPLIT - 1) / OSPLIT, j0 = alone ? 0 : split * per, j1 = alone ? S : min(S, j0 + per);
    const W* kb = kc + ((long long)slot * Hkv + h / (H / Hkv)) * L * D + c * V;
    const W* vb = vc + ((long long)slot * Hkv + h / (H / Hkv)) * L * D + c * V;
    // before the wait: the o projection's pieces (as attend_o) and the group's first keys of earlier steps
    OShare<W> share(wo, split, OSPLIT, H, D, h, C);
    share.load();
    uint4 kr[OC_KEYS], vr[OC_KEYS];
#pragma unroll
    for (int a = 0; a < OC_KEYS; a++) {
        const int j = j0 + gi + a * groups;
        if (c < Pv && j < j1 && j < old) {
            kr[a] = ld16(kb + (long long)j * D);
            vr[a] = ld16(vb + (long long)j * D);
        }
    }
    pdl_wait();
    pdl_launch();
    float qv[V], mx = NEG_INF, sum = 0.f, acc[V];
    const float scale = rsqrtf((float)D);
#pragma unroll
    for (int i = 0; i < V; i++) {
        qv[i] = c < Pv ? q[((long long)m * H + h) * D + c * V + i] * scale : 0.f;
        acc[i] = 0.f;
    }
    // the warp's loop bounds come from its first group (every lane takes part in every shuffle)
    const int wg = (threadIdx.x >> 5) * (32 / P);
    for (int jw = j0 + wg, a = 0; jw < j1; jw += groups, a++) {
        const int j = jw - wg + gi;
        const bool here = j < j1;
        uint4 ku = make_uint4(0, 0, 0, 0), vu = ku;
        if (here && c < Pv) {
            if (a < OC_KEYS && j < old) {
#pragma unroll
                for (int b = 0; b < OC_KEYS; b++)
                    if (b == a) { ku = kr[b]; vu = vr[b]; }
            } else {
                ku = ld16(kb + (long long)j * D);
                vu = ld16(vb + (long long)j * D);
            }
        }
        float kf[V], vf[V], sc = 0.f;
        Vec<W>::unpack(ku, kf);
        Vec<W>::unpack(vu, vf);
#pragma unroll
        for (int i = 0; i < V; i++) sc += qv[i] * kf[i];
        for (int o = P / 2; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o, P);
        if (!here) continue;
        const float nm = fmaxf(mx, sc), r = __expf(mx - nm), p = __expf(sc - nm);
        mx = nm;
        sum = sum * r + p;
#pragma unroll
        for (int i = 0; i < V; i++) acc[i] = acc[i] * r + p * vf[i];
    }
    // the warp's groups -> one partial (shuffles), the warps' -> the block's (bpart), the cluster's 8 -> att
    for (int off = P; off < 32; off <<= 1) {
        const float om = __shfl_xor_sync(0xffffffffu, mx, off), ol = __shfl_xor_sync(0xffffffffu, sum, off);
        const float nm = fmaxf(mx, om);
        const float wa = mx == NEG_INF ? 0.f : __expf(mx - nm), wb = om == NEG_INF ? 0.f : __expf(om - nm);
        sum = sum * wa + ol * wb;
#pragma unroll
        for (int i = 0; i < V; i++) acc[i] = acc[i] * wa + __shfl_xor_sync(0xffffffffu, acc[i], off) * wb;
        mx = nm;
    }
    const int warp = threadIdx.x >> 5;
    if (lane < P && c < Pv)
#pragma unroll
        for (int i = 0; i < V; i++) gpart[warp * (D + 2) + 2 + c * V + i] = acc[i];
    if (lane == 0) {
        gpart[warp * (D + 2)] = mx;
        gpart[warp * (D + 2) + 1] = sum;
    }
    __syncthreads();
    if (alone) {
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            float big = NEG_INF, l = 0.f, o = 0.f;
#pragma unroll
            for (int k = 0; k < OC_WARPS; k++) big = fmaxf(big, gpart[k * (D + 2)]);
#pragma unroll
            for (int k = 0; k < OC_WARPS; k++) {
                const float w = gpart[k * (D + 2)] == NEG_INF ? 0.f : __expf(gpart[k * (D + 2)] - big);
                l += gpart[k * (D + 2) + 1] * w;
                o += gpart[k * (D + 2) + 2 + d] * w;
            }
            att[d] = o / l;
        }
    }
    for (int t = threadIdx.x; t < D + 2 && !alone; t += blockDim.x) {  // bpart = (max, sum, outputs)
        float big = NEG_INF;
#pragma unroll
        for (int k = 0; k < OC_WARPS; k++) big = fmaxf(big, gpart[k * (D + 2)]);
        float v = big;
        if (t > 0) {
            v = 0.f;
#pragma unroll
            for (int k = 0; k < OC_WARPS; k++)  // a warp that saw no key weighs 0
                v += big == NEG_INF ? 0.f : gpart[k * (D + 2) + t] * __expf(gpart[k * (D + 2)] - big);
        }
        bpart[t] = v;
    }
    if (!alone) cluster_arrive();
    if (!alone) cluster_wait();  // every block's bpart is written
    for (int d = threadIdx.x; d < D && !alone; d += blockDim.x) {
        float mb[OSPLIT], lb[OSPLIT], ob[OSPLIT], big = NEG_INF, l = 0.f, o = 0.f;
#pragma unroll
        for (int b = 0; b < OSPLIT; b++) {  // all requested at once
            mb[b] = ld_cluster(bpart, b);
            lb[b] = ld_cluster(bpart + 1, b);
            ob[b] = ld_cluster(bpart + 2 + d, b);
        }
#pragma unroll
        for (int b = 0; b < OSPLIT; b++) big = fmaxf(big, mb[b]);
#pragma unroll
        for (int b = 0; b < OSPLIT; b++) {
            const float w = mb[b] == NEG_INF ? 0.f : __expf(mb[b] - big);
            l += lb[b] * w;
            o += ob[b] * w;
        }
        att[d] = o / l;
    }
    if (!alone) cluster_arrive();  // this block has read the others' bpart; it waits for theirs before it exits
    __syncthreads();
    share.add(att, m, C, h == 0, x, dx);
    if (!alone) cluster_wait();
}

// ---- entry points -------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(ATTEND_THREADS) attend_o_bf16(const float* q, const bf16* kc,
    const bf16* vc, const int* meta, const bf16* wo, float* x, float* dx, int M, int H, int Hkv, int D, int L,
    int C) {
    attend_o<bf16>(q, kc, vc, meta, wo, x, dx, M, H, Hkv, D, L, C);
}
extern "C" __global__ void CLUSTER_DIMS __launch_bounds__(32 * OC_WARPS) attend_o_cluster_bf16(const float* q,
    const bf16* kc, const bf16* vc, const int* meta, const bf16* wo, float* x, float* dx, int M, int H, int Hkv,
    int D, int L, int C, int alone_keys) {
    attend_o_cluster<bf16>(q, kc, vc, meta, wo, x, dx, M, H, Hkv, D, L, C, alone_keys);
}
extern "C" __global__ void __launch_bounds__(ATTEND_THREADS) attend_o_f32(const float* q, const float* kc,
    const float* vc, const int* meta, const float* wo, float* x, float* dx, int M, int H, int Hkv, int D, int L,
    int C) {
    attend_o<float>(q, kc, vc, meta, wo, x, dx, M, H, Hkv, D, L, C);
}
extern "C" __global__ void CLUSTER_DIMS __launch_bounds__(32 * OC_WARPS) attend_o_cluster_f32(const float* q,
    const float* kc, const float* vc, const int* meta, const float* wo, float* x, float* dx, int M, int H, int Hkv,
    int D, int L, int C, int alone_keys) {
    attend_o_cluster<float>(q, kc, vc, meta, wo, x, dx, M, H, Hkv, D, L, C, alone_keys);
}
