// Causal grouped-query attention, FlashAttention style, float32.
//
// Reference: nanoeuler.model.layers.attention_forward / attention_backward.
// q (B,H,T,D), k/v (B,Hkv,S,D) with S >= T: query t sits at position S-T+t and sees keys 0..S-T+t.
// Query head h reads key/value head h / (H/Hkv). The inputs may be strided views (B,H,T stride free,
// D contiguous); every output is C-contiguous.
//
// Forward: one block owns BR query rows of one (b, h); K/V tiles of BC rows stream through shared
// memory and each row keeps a running max m, a running sum l and an unnormalised output (online
// softmax), so no T x S score matrix ever exists. It saves lse = m + log(l) per row.
//
// Backward recomputes the probabilities from lse: p = exp(q.k * scale - lse), with
// delta = rowsum(dO * O) precomputed, ds = p * (dO.v - delta). Two kernels, no atomics:
//   dkdv: one block per BC key rows of one (b, hk); loops over the G query heads of the group and the
//         query rows that see those keys, accumulating dk, dv in registers;
//   dq:   one block per BR query rows of one (b, h); loops over the visible key tiles.
//
// Thread layout: a row (query or key) is handled by G consecutive threads, each owning DPT = D/G
// contiguous elements in registers; dot products are finished with G-lane shuffles. Loops over the
// other side's rows are uniform across the block (masking instead of early exits), so every shuffle
// sees all its lanes and every shared-memory read is a broadcast.

#define NEG_INF __int_as_float(0xff800000)

template <int G>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

template <int N>
__device__ __forceinline__ void load_row(float (&r)[N], const float* __restrict__ p) {
    const float4* p4 = reinterpret_cast<const float4*>(p);
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
        float4 a = p4[i];
        r[4 * i] = a.x; r[4 * i + 1] = a.y; r[4 * i + 2] = a.z; r[4 * i + 3] = a.w;
    }
}

template <int N>
__device__ __forceinline__ void store_row(float* __restrict__ p, const float (&r)[N], float scale) {
    float4* p4 = reinterpret_cast<float4*>(p);
#pragma unroll
    for (int i = 0; i < N / 4; ++i)
        p4[i] = make_float4(r[4 * i] * scale, r[4 * i + 1] * scale, r[4 * i + 2] * scale, r[4 * i + 3] * scale);
}

template <int N>
__device__ __forceinline__ float dot_row(const float (&r)[N], const float* __restrict__ s) {
    const float4* s4 = reinterpret_cast<const float4*>(s);
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
        float4 a = s4[i];
        acc = fmaf(r[4 * i], a.x, acc);
        acc = fmaf(r[4 * i + 1], a.y, acc);
        acc = fmaf(r[4 * i + 2], a.z, acc);
        acc = fmaf(r[4 * i + 3], a.w, acc);
    }
    return acc;
}

template <int N>
__device__ __forceinline__ void axpy_row(float (&r)[N], float a, const float* __restrict__ s) {
    const float4* s4 = reinterpret_cast<const float4*>(s);
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
        float4 b = s4[i];
        r[4 * i] = fmaf(a, b.x, r[4 * i]);
        r[4 * i + 1] = fmaf(a, b.y, r[4 * i + 1]);
        r[4 * i + 2] = fmaf(a, b.z, r[4 * i + 2]);
        r[4 * i + 3] = fmaf(a, b.w, r[4 * i + 3]);
    }
}

// Copy `rows` rows of D floats, starting at row `row0` of a strided matrix, into shared memory;
// rows at or past `limit` are zero-filled.
template <int D, int NT>
__device__ __forceinline__ void tile_to_shared(float* __restrict__ dst, const float* __restrict__ src,
                                               long long row_stride, int row0, int rows, int limit) {
    constexpr int V4 = D / 4;
    float4* d4 = reinterpret_cast<float4*>(dst);
    for (int idx = threadIdx.x; idx < rows * V4; idx += NT) {
        const int r = idx / V4, c = idx % V4;
        const int row = row0 + r;
        float4 val = make_float4(0.f, 0.f, 0.f, 0.f);
        if (row < limit) val = reinterpret_cast<const float4*>(src + (long long)row * row_stride)[c];
        d4[idx] = val;
    }
}

// ---- forward -------------------------------------------------------------------------------------

template <int D, int G, int BR, int BC>
__device__ __forceinline__ void flash_fwd_impl(
    const float* __restrict__ q, long long qsb, long long qsh, long long qst,
    const float* __restrict__ k, long long ksb, long long ksh, long long kst,
    const float* __restrict__ v, long long vsb, long long vsh, long long vst,
    float* __restrict__ out, float* __restrict__ lse, int H, int Hkv, int T, int S, float scale) {
    constexpr int DPT = D / G;
    constexpr int NT = BR * G;
    constexpr int KC = 8;  // keys scored per online-softmax rescale
    __shared__ __align__(16) float Ks[BC * D];
    __shared__ __align__(16) float Vs[BC * D];

    const int tid = threadIdx.x;
    const int r = tid / G, g = tid % G;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, hk = h / (H / Hkv);
    const int t0 = blockIdx.x * BR, t = t0 + r;
    const int offset = S - T;
    const bool row_ok = t < T;

    float qr[DPT], acc[DPT];
    load_row(qr, q + b * qsb + h * qsh + (long long)min(t, T - 1) * qst + g * DPT);
#pragma unroll
    for (int i = 0; i < DPT; ++i) acc[i] = 0.f;
    float m = NEG_INF, l = 0.f;

    const float* kb = k + b * ksb + hk * ksh;
    const float* vb = v + b * vsb + hk * vsh;
    const int kv_end = min(S, min(T, t0 + BR) + offset);  // keys the block's last row sees
    const int my_last = t + offset;                        // this row's last visible key

    for (int j0 = 0; j0 < kv_end; j0 += BC) {
        __syncthreads();
        tile_to_shared<D, NT>(Ks, kb, kst, j0, BC, S);
        tile_to_shared<D, NT>(Vs, vb, vst, j0, BC, S);
        __syncthreads();
        const int n = min(BC, kv_end - j0);
        for (int c0 = 0; c0 < n; c0 += KC) {
            float s[KC];
            float mc = m;
#pragma unroll
            for (int kk = 0; kk < KC; ++kk) {
                const int c = min(c0 + kk, BC - 1);
                const float dot = group_sum<G>(dot_row(qr, Ks + c * D + g * DPT)) * scale;
                const bool vis = (c0 + kk < n) && (j0 + c0 + kk <= my_last);
                s[kk] = vis ? dot : NEG_INF;
                mc = fmaxf(mc, s[kk]);
            }
            // Every valid row sees key 0 in the first chunk, so mc is finite from then on.
            const float alpha = (mc == NEG_INF) ? 1.f : expf(m - mc);
            l *= alpha;
#pragma unroll
            for (int i = 0; i < DPT; ++i) acc[i] *= alpha;
#pragma unroll
            for (int kk = 0; kk < KC; ++kk) {
                const int c = min(c0 + kk, BC - 1);
                const float p = (s[kk] == NEG_INF) ? 0.f : expf(s[kk] - mc);
                l += p;
                axpy_row(acc, p, Vs + c * D + g * DPT);
            }
            m = mc;
        }
    }
    if (row_ok) {
        const long long row = (long long)bh * T + t;
        store_row(out + row * D + g * DPT, acc, 1.f / l);
        if (g == 0) lse[row] = m + logf(l);
    }
}

// ---- backward: delta = rowsum(dO * O) ---------------------------------------------------------------

// One warp per row of (B,H,T); o is C-contiguous, dO strided.
extern "C" __global__ void __launch_bounds__(256) flash_bwd_delta(
    const float* __restrict__ o, const float* __restrict__ dout, long long dsb, long long dsh, long long dst,
    float* __restrict__ delta, int H, int T, int D, long long rows) {
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const long long bh = row / T;
    const int t = (int)(row % T);
    const long long b = bh / H, h = bh % H;
    const float* orow = o + row * D;
    const float* drow = dout + b * dsb + h * dsh + (long long)t * dst;
    float acc = 0.f;
    for (int d = lane; d < D; d += 32) acc = fmaf(orow[d], drow[d], acc);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) delta[row] = acc;
}

// ---- backward: dk, dv ---------------------------------------------------------------------------

template <int D, int G, int BC, int BR>
__device__ __forceinline__ void flash_bwd_dkdv_impl(
    const float* __restrict__ q, long long qsb, long long qsh, long long qst,
    const float* __restrict__ k, long long ksb, long long ksh, long long kst,
    const float* __restrict__ v, long long vsb, long long vsh, long long vst,
    const float* __restrict__ dout, long long dsb, long long dsh, long long dst,
    const float* __restrict__ lse, const float* __restrict__ delta,
    float* __restrict__ dk, float* __restrict__ dv, int H, int Hkv, int T, int S, float scale) {
    constexpr int DPT = D / G;
    constexpr int NT = BC * G;
    __shared__ __align__(16) float Qs[BR * D];
    __shared__ __align__(16) float Os[BR * D];  // dO rows
    __shared__ float Ls[BR];
    __shared__ float Ds[BR];

    const int tid = threadIdx.x;
    const int c = tid / G, g = tid % G;
    const int bk = blockIdx.y, b = bk / Hkv, hk = bk % Hkv;
    const int j0 = blockIdx.x * BC, j = j0 + c;
    const int offset = S - T;
    const bool col_ok = j < S;
    const int grp = H / Hkv;

    float kr[DPT], vr[DPT], dkr[DPT], dvr[DPT];
    load_row(kr, k + b * ksb + hk * ksh + (long long)min(j, S - 1) * kst + g * DPT);
    load_row(vr, v + b * vsb + hk * vsh + (long long)min(j, S - 1) * vst + g * DPT);
#pragma unroll
    for (int i = 0; i < DPT; ++i) { dkr[i] = 0.f; dvr[i] = 0.f; }

    const int t_first = max(0, j0 - offset);  // first query row that sees any key of this block
    for (int hh = 0; hh < grp; ++hh) {
        const int h = hk * grp + hh;
        const long long bh = (long long)b * H + h;
        const float* qb = q + b * qsb + h * qsh;
        const float* ob = dout + b * dsb + h * dsh;
        for (int i0 = t_first; i0 < T; i0 += BR) {
            __syncthreads();
            tile_to_shared<D, NT>(Qs, qb, qst, i0, BR, T);
            tile_to_shared<D, NT>(Os, ob, dst, i0, BR, T);
            for (int r = tid; r < BR; r += NT) {
                const bool ok = i0 + r < T;
                Ls[r] = ok ? lse[bh * T + i0 + r] : 0.f;
                Ds[r] = ok ? delta[bh * T + i0 + r] : 0.f;
            }
            __syncthreads();
            const int n = min(BR, T - i0);
            for (int r = 0; r < n; ++r) {
                const float* qrow = Qs + r * D + g * DPT;
                const float* orow = Os + r * D + g * DPT;
                const float s = group_sum<G>(dot_row(kr, qrow)) * scale;
                const float dp = group_sum<G>(dot_row(vr, orow));
                const bool vis = col_ok && (j <= i0 + r + offset);
                const float p = vis ? expf(s - Ls[r]) : 0.f;
                const float ds = p * (dp - Ds[r]);
                axpy_row(dvr, p, orow);
                axpy_row(dkr, ds, qrow);
            }
        }
    }
    if (col_ok) {
        const long long row = (long long)bk * S + j;
        store_row(dk + row * D + g * DPT, dkr, scale);
        store_row(dv + row * D + g * DPT, dvr, 1.f);
    }
}

// ---- backward: dq -------------------------------------------------------------------------------

template <int D, int G, int BR, int BC>
__device__ __forceinline__ void flash_bwd_dq_impl(
    const float* __restrict__ q, long long qsb, long long qsh, long long qst,
    const float* __restrict__ k, long long ksb, long long ksh, long long kst,
    const float* __restrict__ v, long long vsb, long long vsh, long long vst,
    const float* __restrict__ dout, long long dsb, long long dsh, long long dst,
    const float* __restrict__ lse, const float* __restrict__ delta,
    float* __restrict__ dq, int H, int Hkv, int T, int S, float scale) {
    constexpr int DPT = D / G;
    constexpr int NT = BR * G;
    __shared__ __align__(16) float Ks[BC * D];
    __shared__ __align__(16) float Vs[BC * D];

    const int tid = threadIdx.x;
    const int r = tid / G, g = tid % G;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, hk = h / (H / Hkv);
    const int t0 = blockIdx.x * BR, t = t0 + r;
    const int offset = S - T;
    const bool row_ok = t < T;
    const int tt = min(t, T - 1);

    float qr[DPT], dor[DPT], dqr[DPT];
    load_row(qr, q + b * qsb + h * qsh + (long long)tt * qst + g * DPT);
    load_row(dor, dout + b * dsb + h * dsh + (long long)tt * dst + g * DPT);
#pragma unroll
    for (int i = 0; i < DPT; ++i) dqr[i] = 0.f;
    const float L = lse[(long long)bh * T + tt];
    const float Dl = delta[(long long)bh * T + tt];

    const float* kb = k + b * ksb + hk * ksh;
    const float* vb = v + b * vsb + hk * vsh;
    const int kv_end = min(S, min(T, t0 + BR) + offset);
    const int my_last = t + offset;

    for (int j0 = 0; j0 < kv_end; j0 += BC) {
        __syncthreads();
        tile_to_shared<D, NT>(Ks, kb, kst, j0, BC, S);
        tile_to_shared<D, NT>(Vs, vb, vst, j0, BC, S);
        __syncthreads();
        const int n = min(BC, kv_end - j0);
        for (int c = 0; c < n; ++c) {
            const float* krow = Ks + c * D + g * DPT;
            const float s = group_sum<G>(dot_row(qr, krow)) * scale;
            const float dp = group_sum<G>(dot_row(dor, Vs + c * D + g * DPT));
            const bool vis = row_ok && (j0 + c <= my_last);
            const float p = vis ? expf(s - L) : 0.f;
            axpy_row(dqr, p * (dp - Dl), krow);
        }
    }
    if (row_ok) store_row(dq + ((long long)bh * T + t) * D + g * DPT, dqr, scale);
}

// ---- instantiations (one extern "C" name per head size, so nvcc -c checks them all) -------------

#define QKV_ARGS                                                                          \
    const float *q, long long qsb, long long qsh, long long qst, const float *k, long long ksb, \
        long long ksh, long long kst, const float *v, long long vsb, long long vsh, long long vst
#define QKV_PASS q, qsb, qsh, qst, k, ksb, ksh, kst, v, vsb, vsh, vst

// D, threads per row G, rows per block, rows per shared-memory tile (<= 32 KB of tiles per block).
#define FLASH_KERNELS(D, G, ROWS, TILE)                                                               \
    extern "C" __global__ void __launch_bounds__((ROWS) * (G)) flash_fwd_d##D(                          \
        QKV_ARGS, float *out, float *lse, int H, int Hkv, int T, int S, float scale) {                  \
        flash_fwd_impl<D, G, ROWS, TILE>(QKV_PASS, out, lse, H, Hkv, T, S, scale);                      \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__((ROWS) * (G)) flash_bwd_dkdv_d##D(                     \
        QKV_ARGS, const float *dout, long long dsb, long long dsh, long long dst, const float *lse,      \
        const float *delta, float *dk, float *dv, int H, int Hkv, int T, int S, float scale) {          \
        flash_bwd_dkdv_impl<D, G, ROWS, TILE>(QKV_PASS, dout, dsb, dsh, dst, lse, delta, dk, dv, H, Hkv, \
                                              T, S, scale);                                             \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__((ROWS) * (G)) flash_bwd_dq_d##D(                       \
        QKV_ARGS, const float *dout, long long dsb, long long dsh, long long dst, const float *lse,      \
        const float *delta, float *dq, int H, int Hkv, int T, int S, float scale) {                     \
        flash_bwd_dq_impl<D, G, ROWS, TILE>(QKV_PASS, dout, dsb, dsh, dst, lse, delta, dq, H, Hkv, T, S, \
                                            scale);                                                     \
    }

FLASH_KERNELS(16, 1, 128, 64)
FLASH_KERNELS(32, 1, 128, 64)
FLASH_KERNELS(64, 2, 64, 64)
FLASH_KERNELS(128, 4, 32, 32)
