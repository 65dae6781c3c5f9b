// GEMMs with an epilogue inside, fed and drained by TMA (wgmma, sm_90a): the SwiGLU forward and
// backward, the qkv product with RoPE, and the transposed image of Wd that the backward reads.

#include "swiglu.cuh"
#include "wgmma.cuh"

// ---- the SwiGLU backward inside its GEMM (wgmma and TMA, sm_90a) -----------------------------------
// In the backward of the MLP, dm = dy Wd (dy (N, C): the gradient of the down branch; Wd (C, F): the
// down projection) is a GEMM whose output only the SwiGLU backward reads. swiglu_bwd_gemm computes a
// 128 x 128 tile of dm in float32 registers and applies the SwiGLU backward to it there: dgate and dup
// into dgu, and m = silu(gate) * up again (bit-identical to the forward's, for the down projection's
// weight gradient), as swiglu_bwd_bf16 does. dm never goes to memory (nor through bf16).
//
// Persistent: a block per multiprocessor takes tiles blockIdx.x, + gridDim.x, ... Its 288 threads:
// - warp 8, the producer: one lane copies the operands' k steps (64 wide) into a ring of SG_STAGES
//   shared-memory stages by TMA (cp.async.bulk.tensor, 128-byte swizzle: the layout wgmma reads),
//   a stage's "full" mbarrier counting the bytes in, its "empty" one the warpgroup done with it.
//   It runs ahead into the next tile while the warpgroups finish the last one.
// - warps 0-7, two warpgroups in ping-pong (sg_products): warpgroup w multiplies every other tile, all
//   its 128 rows by its 128 columns (wgmma.m64n128k16 on each 64-row half, both operands from shared
//   memory), then runs the epilogue while the other warpgroup multiplies the next tile. Whole 128-row
//   tiles keep the tensor cores busy and load each weight tile once (docs/benchmarks-log.md, Kernel notes).
// Operands: dy, and wdt, the fused kernel's image of Wd: transposed (F, C; k contiguous, as wgmma
// reads shared memory untransposed) and its rows permuted by 128-row block (wdt_image): hidden column
// j of a tile is row sg_row(j) of the staged tile, i.e. accumulator column n = sg_row(j). The wgmma C
// layout gives lane l of a warp the accumulator columns n = 8 nc + 2 (l % 4) + e (nc the 8-column chunk,
// e = 0, 1), which sg_row maps to hidden columns 32 (nc / 4) + 8 (l % 4) + 2 (nc % 4) + e: each lane
// holds 8 consecutive hidden columns of each 32-column group, so the epilogue reads gate/up and writes
// dgate, dup and m with 16-byte accesses.
// The epilogue's data moves by TMA too, per warpgroup and quarter of its tile (64 rows x 64 hidden columns),
// through two buffers: a quarter's gate and up come into shared memory (the first half's two while the
// tile is multiplied, each of the second half's once the first half's quarter in its buffer has left), the
// epilogue writes d(gate) and d(up) over them and m beside them, and TMA stores take them to memory.
// Needs C % 64 == 0 and F % 128 == 0 (the engine checks); rows past N are zeros (TMA fills them) in the
// products, and TMA stores leave them out.
#define SG_BK 64
#define SG_STAGES 4
// shared memory: 1 KiB alignment + SG_STAGES x 32 KiB, then per kernel the epilogue's boxes and the
// mbarriers (gemm_tma.py: SWIGLU_FWD_GEMM_SMEM, SWIGLU_BWD_GEMM_SMEM, QKV_ROPE_GEMM_SMEM)

// Tile column j (0..127) -> the row n of the staged Wd^T tile that holds it.
__device__ __forceinline__ int sg_row(int j) {
    return ((((j >> 5) << 2) + ((j >> 1) & 3)) << 3) + (((j >> 3) & 3) << 1) + (j & 1);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d (64 x N, float32, this thread's N/2 values in the C layout) += A (64 x 16) B (16 x N), both from
// shared memory (descriptors; K-major). Asynchronous, as wgmma_64x64x16.
__device__ __forceinline__ void wgmma_ss(float (&d)[16][4], unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
          "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
          "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
          "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
          "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "l"(a), "l"(b));
}
// Wait until the mbarrier at shared address `bar` completes the phase of this parity.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_init(unsigned bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// Before a thread's first copy through the tensor map at `map` (kernel-argument memory written by the host).
__device__ __forceinline__ void tma_acquire(const void* map) {
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(map) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// The box at (c0 inner, c1 outer) of the 2-D tensor map at `map` (a global address) into shared memory.
__device__ __forceinline__ void tma_2d(unsigned dst, const void* map, int c0, int c1, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
// The 5-D box at (c0, 0, 0, 0, c4) of the tensor map at `map` into shared memory.
__device__ __forceinline__ void tma_5d(unsigned dst, const void* map, int c0, int c4, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3, %3, %3, %4}], [%5];\n"
                 ::"r"(dst), "l"(map), "r"(c0), "r"(0), "r"(c4), "r"(bar) : "memory");
}
// Shared memory at `src` -> the box at (c0, c1) of the 2-D tensor map at `map` (rows past its edge are
// not written), in the issuing thread's current bulk group.
__device__ __forceinline__ void tma_store_2d(const void* map, int c0, int c1, unsigned src) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
                 ::"l"(map), "r"(c0), "r"(c1), "r"(src) : "memory");
}
// The same into the box at (c0, c1, c2) of a 3-D tensor map.
__device__ __forceinline__ void tma_store_3d(const void* map, int c0, int c1, int c2, unsigned src) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n"
                 ::"l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(src) : "memory");
}
// 16 or 4 bytes at a shared-memory address (the epilogues' boxes).
__device__ __forceinline__ void lds128(unsigned (&v)[4], unsigned a) {
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "r"(a));
}
__device__ __forceinline__ void sts128(unsigned a, const unsigned (&v)[4]) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]));
}
__device__ __forceinline__ void sts32(unsigned a, unsigned v) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(a), "r"(v));
}
__device__ __forceinline__ void bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The pieces the fused kernels share: the ring's mbarriers, the producer's loop and a warpgroup's products
// for one tile. A stage holds the tile's 128 rows of the left operand (at 0) and its 128 rows of the right
// one (at SG_TILE), 64 k each: 16 KiB each, 128-byte swizzled.
#define SG_TILE (128 * SG_BK * 2)
#define SG_STAGE (2 * SG_TILE)

// Thread 0: the stages' "full" mbarriers (one arrival: the producer's, plus the bytes) and "empty" ones
// (one arrival: the warpgroup that multiplied from the stage), then `extra` more mbarriers of one arrival
// right after the empty ones (a kernel's own), and the fence that shows them to the TMA unit.
__device__ __forceinline__ void sg_init_ring(unsigned full, unsigned empty, int extra = 0) {
    for (int s = 0; s < SG_STAGES; ++s) {
        mbar_init(full + 8 * s, 1);
        mbar_init(empty + 8 * s, 1);
    }
    for (int i = 0; i < extra; ++i) mbar_init(empty + 8 * (SG_STAGES + i), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The producer lane: acquire the operands' tensor maps, then for each of this block's tiles (blockIdx.x,
// + gridDim.x, ...) and each of its KT k steps, wait until the next stage is free, announce its bytes, and
// have `issue(tile, kt, stage address, full mbarrier)` start the copies into it.
template <typename Issue>
__device__ __forceinline__ void sg_produce(const void* a_map, const void* b_map, int tiles, int KT, unsigned stages,
                                           unsigned full, unsigned empty, Issue issue) {
    tma_acquire(a_map);
    tma_acquire(b_map);
    int g = 0;  // k steps issued, over all tiles: stage g % SG_STAGES, its use number g / SG_STAGES
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x)
        for (int kt = 0; kt < KT; ++kt, ++g) {
            const int s = g % SG_STAGES;
            mbar_wait(empty + 8 * s, ((g / SG_STAGES) & 1) ^ 1);  // the stage's previous use is done
            mbar_expect(full + 8 * s, SG_STAGE);
            issue(tile, kt, stages + s * SG_STAGE, full + 8 * s);
        }
}

// How many of the `tiles` this block takes (tiles blockIdx.x, + gridDim.x, ...).
__device__ __forceinline__ int sg_block_tiles(int tiles) {
    return (tiles - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
}

// Warpgroup wg (thread t of it), ping-pong: it multiplies whole tiles, the block's tiles k = wg, wg + 2, ...
// of its n (tile k = blockIdx.x + k gridDim.x), so that one warpgroup's epilogue runs while the other
// multiplies. acc[i] = rows 64 i .. 64 i + 63 of tile k times its 128 columns, over the KT k steps of the
// ring from step k KT on: two wgmma per 16 k, sharing the right operand. The warpgroups take turns at
// issuing their products (named barriers 4 and 5; a turn passes once the last k step is issued, while it
// still runs), so the stages are consumed in the producer's order. Each stage is handed back (its empty
// mbarrier) once the products from it are done. `late()` runs once k step max(KT - 3, 0) is issued.
template <typename Late>
__device__ __forceinline__ void sg_products(float (&acc)[2][16][4], int k, int n, int KT, unsigned stages,
                                            unsigned full, unsigned empty, int wg, int t, Late late) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int c = 0; c < 16; ++c) acc[i][c][0] = acc[i][c][1] = acc[i][c][2] = acc[i][c][3] = 0.f;
    int g = k * KT;
    if (k > 0) bar_sync(4 + wg, 256);  // the other warpgroup has issued tile k - 1's products
    for (int kt = 0; kt < KT; ++kt, ++g) {
        const int s = g % SG_STAGES;
        mbar_wait(full + 8 * s, (g / SG_STAGES) & 1);
        const unsigned as = stages + s * SG_STAGE, bs = as + SG_TILE;
        wg_fence();
#pragma unroll
        for (int kc = 0; kc < SG_BK / 16; ++kc) {
            wgmma_ss(acc[0], wg_desc(as + kc * 32, 1), wg_desc(bs + kc * 32, 1));
            wgmma_ss(acc[1], wg_desc(as + SG_TILE / 2 + kc * 32, 1), wg_desc(bs + kc * 32, 1));
        }
        wg_commit();
        if (kt == KT - 1 && k + 1 < n) bar_arrive(4 + (wg ^ 1), 256);  // the other warpgroup's turn
        if (kt == max(KT - 3, 0)) late();
        wg_wait<1>();  // step g - 1 done: its stage is free
        wg_hold(acc[0]);
        wg_hold(acc[1]);
        if (kt > 0 && t == 0) mbar_arrive(empty + 8 * ((g - 1) % SG_STAGES));
    }
    wg_wait<0>();
    wg_hold(acc[0]);
    wg_hold(acc[1]);
    if (t == 0) mbar_arrive(empty + 8 * ((g - 1) % SG_STAGES));
}
#endif

extern "C" __global__ void __launch_bounds__(288, 1) swiglu_bwd_gemm(const void* __restrict__ dy_map,
                                                                    const void* __restrict__ wdt_map, int wdt_row0,
                                                                    const void* __restrict__ gu_map,
                                                                    const void* __restrict__ dgu_map,
                                                                    const void* __restrict__ m_map, int N, int C, int F) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BOX = 64 * 64 * 2;
    extern __shared__ __align__(128) unsigned char sg_smem[];
    const int wg = threadIdx.x >> 7, t = threadIdx.x & 127, warp = t >> 5, lane = t & 31, q = lane & 3;
    const unsigned stages = (smem_u32(sg_smem) + 1023u) & ~1023u, gus = stages + SG_STAGES * SG_STAGE;
    const unsigned ms = gus + 8 * BOX, full = ms + 4 * BOX, empty = full + 8 * SG_STAGES;
    const unsigned gubar = empty + 8 * SG_STAGES + 16 * wg;  // this warpgroup's two: buffer 0's, buffer 1's
    const int KT = C / SG_BK, ncols = F / 128, tiles = (N + 127) / 128 * ncols;
    if (threadIdx.x == 0) sg_init_ring(full, empty, 4);  // and the 4 gate/up buffers' mbarriers
    __syncthreads();
    if (wg == 2) {  // the producer warp
        if (threadIdx.x == 256)
            sg_produce(dy_map, wdt_map, tiles, KT, stages, full, empty,
                       [&](int tile, int kt, unsigned dst, unsigned bar) {
                tma_2d(dst, dy_map, kt * SG_BK, tile / ncols * 128, bar);
                tma_2d(dst + SG_TILE, wdt_map, kt * SG_BK, wdt_row0 + tile % ncols * 128, bar);
            });
        return;
    }
    if (t == 0) tma_acquire(gu_map), tma_acquire(dgu_map), tma_acquire(m_map);
    // This warpgroup's boxes hold two quarters of its tile (64 rows x 64 hidden columns) at a time, in two
    // buffers: buffer j has the gate box gb + j BOX, the up box gb + (2 + j) BOX (d(gate) and d(up) then
    // written over them) and the m box mb + j BOX. They are 128-byte swizzled (16-byte chunk c of row r at
    // chunk c ^ (r % 8)), so the 8 rows that a warp's access covers fall in different banks.
    const unsigned gb = gus + wg * 4 * BOX, mb = ms + wg * 2 * BOX;
    const int n = sg_block_tiles(tiles);
    for (int k = wg; k < n; k += 2) {
        const int tile = blockIdx.x + k * gridDim.x, row0 = tile / ncols * 128, col0 = tile % ncols * 128;
        auto fetch = [&](int j, int r) {  // gate/up of rows r .. r + 63, hidden columns col0 + 64 j .., into buffer j
            mbar_expect(gubar + 8 * j, 2 * BOX);
            tma_2d(gb + j * BOX, gu_map, col0 + 64 * j, r, gubar + 8 * j);
            tma_2d(gb + (2 + j) * BOX, gu_map, F + col0 + 64 * j, r, gubar + 8 * j);
        };
        float acc[2][16][4];
        // three k steps before the end, the first half's quarters come in: late enough that the last tile's
        // stores have left the boxes without stalling the products (docs/benchmarks-log.md, Kernel notes)
        sg_products(acc, k, n, KT, stages, full, empty, wg, t, [&] {
            if (t == 0) {
                asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // the boxes are free
                fetch(0, row0);
                fetch(1, row0);
            }
        });
        // quarter (half, j): rows row0 + 64 half .., hidden columns col0 + 64 j ..; the second half's quarter
        // j comes into buffer j as soon as the first half's results have left it, while the warpgroup works
        // on the other buffer, so that fetch is hidden (docs/benchmarks-log.md, Kernel notes)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                mbar_wait(gubar + 8 * j, half);  // each buffer's mbarrier completes two phases a tile
#pragma unroll
                for (int h = 0; h < 2; ++h) {  // this lane's rows rl and rl + 8; per 32-column group gi, 8 columns
                    const int rl = warp * 16 + (lane >> 2) + 8 * h;
#pragma unroll
                    for (int gj = 0; gj < 2; ++gj) {  // group gi = 2 j + gj: columns 32 gi + 8 q .. + 7, chunk 4 gj + q
                        const int gi = 2 * j + gj;
                        const unsigned off = j * BOX + rl * 128 + (((4 * gj + q) ^ (rl & 7)) << 4);
                        const unsigned a = gb + off;
                        unsigned gw[4], uw[4];
                        lds128(gw, a);
                        lds128(uw, a + 2 * BOX);
                        unsigned og[4], ou[4], om[4];
#pragma unroll
                        for (int e = 0; e < 4; ++e) {  // hidden columns + 2e, + 2e + 1: accumulator chunk 4 gi + e
                            float dg0, du0, dg1, du1;
                            const float g0 = lo_bf(gw[e]), g1 = hi_bf(gw[e]), u0 = lo_bf(uw[e]), u1 = hi_bf(uw[e]);
                            swiglu_grad(acc[half][4 * gi + e][2 * h], g0, u0, dg0, du0);
                            swiglu_grad(acc[half][4 * gi + e][2 * h + 1], g1, u1, dg1, du1);
                            og[e] = pack2(dg0, dg1);
                            ou[e] = pack2(du0, du1);
                            om[e] = pack2(silu_f(g0) * u0, silu_f(g1) * u1);
                        }
                        sts128(a, og);
                        sts128(a + 2 * BOX, ou);
                        sts128(mb + off, om);
                    }
                }
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the writes, seen by the TMA stores
                bar_sync(2 + wg, 128);
                if (t == 0) {
                    const int r = row0 + 64 * half;
                    if (r < N) {
                        tma_store_2d(dgu_map, col0 + 64 * j, r, gb + j * BOX);
                        tma_store_2d(dgu_map, F + col0 + 64 * j, r, gb + (2 + j) * BOX);
                        tma_store_2d(m_map, col0 + 64 * j, r, mb + j * BOX);
                    }
                    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
                    if (half == 0) {
                        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
                        fetch(j, row0 + 64);
                    }
                }
            }
    }
    if (t == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#else
    __trap();  // built for another target: the engine launches this kernel only on sm_90a builds
#endif
}

// ---- the gate/up projection with the SwiGLU forward inside (wgmma and TMA, sm_90a) -----------------
// gu = xhat2 Wgu^T (xhat2 (N, C): the second norm's output; Wgu (2F, C): gate rows, then up rows) and m =
// silu(gate) * up, in one kernel: swiglu_fwd_bf16 no longer reads gu back. The design is swiglu_bwd_gemm's
// (persistent, a producer warp feeding the ring by TMA, two warpgroups in ping-pong on 128 x 128 tiles),
// without the gate/up prefetch. A tile is 128 rows x 64 hidden units: its 128 right-operand rows are the
// units' 64 gate rows, then their 64 up rows, so a lane holds the gate and up of the same units. The order of the
// rows within each 64 is the lanes': accumulator column n = 8 nc + 2 (l % 4) + e of lane l
// (nc < 8) is gate unit 16 (l % 4) + 2 nc + e, column 64 + n the same unit's up; each lane then holds 16
// consecutive units of its two rows and stores gate, up and m 16 bytes at a time. That order is a view of
// Wgu, not a copy: the tensor map (tma.gate_up_map) is 5-D, (k, e, l % 4, nc, block of 64 units), with
// the row strides 1, 16, 2 and 64, and one box of (64, 2, 4, 8, 1) is 64 rows in the lanes' order.
// gate and up are rounded to bf16 before m is computed from them, as swiglu_fwd_bf16 does from the stored
// gu: m is bit-identical to the unfused path's, and to what the backward recomputes.
// The outputs leave by TMA stores: a warpgroup writes its tile's gate, up and m into shared memory (64 x 64
// boxes, two per output) and one of its threads hands the boxes to the TMA unit, which writes them to
// memory while the warpgroup goes on (docs/benchmarks-log.md, Kernel notes).
// Needs C % 64 == 0 and F % 64 == 0.

extern "C" __global__ void __launch_bounds__(288, 1) swiglu_fwd_gemm(const void* __restrict__ x_map,
                                                                    const void* __restrict__ w_map,
                                                                    const void* __restrict__ gu_map,
                                                                    const void* __restrict__ m_map, int N, int C, int F) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int OUT = 64 * 64 * 2;  // one 64 x 64 bf16 box of the output: 8 KiB
    extern __shared__ __align__(128) unsigned char sg_smem[];
    const int wg = threadIdx.x >> 7, t = threadIdx.x & 127, warp = t >> 5, lane = t & 31, q = lane & 3;
    const unsigned stages = (smem_u32(sg_smem) + 1023u) & ~1023u, outs = stages + SG_STAGES * SG_STAGE;
    const unsigned full = outs + 12 * OUT, empty = full + 8 * SG_STAGES;
    const int KT = C / SG_BK, units = F / 64, tiles = (N + 127) / 128 * units;
    if (threadIdx.x == 0) sg_init_ring(full, empty);
    __syncthreads();
    if (wg == 2) {  // the producer warp
        if (threadIdx.x == 256)
            sg_produce(x_map, w_map, tiles, KT, stages, full, empty,
                       [&](int tile, int kt, unsigned dst, unsigned bar) {
                const int u = tile % units;
                tma_2d(dst, x_map, kt * SG_BK, tile / units * 128, bar);
                tma_5d(dst + SG_TILE, w_map, kt * SG_BK, u, bar);                       // gate rows
                tma_5d(dst + SG_TILE + SG_TILE / 2, w_map, kt * SG_BK, units + u, bar);  // up rows
            });
        return;
    }
    if (t == 0) tma_acquire(gu_map), tma_acquire(m_map);
    // This warpgroup's tile leaves through shared memory: per 64-row half, gate, up and m, a 64 x 64 box each,
    // in the 128-byte swizzle that the TMA store reads (16-byte chunk c of row r at chunk c ^ (r % 8): the 8
    // rows that a warp's store covers fall in different banks).
    const unsigned out = outs + wg * 6 * OUT;
    const int n = sg_block_tiles(tiles);
    for (int k = wg; k < n; k += 2) {
        const int tile = blockIdx.x + k * gridDim.x, row0 = tile / units * 128, unit0 = tile % units * 64;
        float acc[2][16][4];
        sg_products(acc, k, n, KT, stages, full, empty, wg, t, [] {});
        if (t == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // its last tile's boxes are out
        bar_sync(2 + wg, 128);
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // this lane's rows rl and rl + 8 of the half, units unit0 + 16 q .. + 15
                const int rl = warp * 16 + (lane >> 2) + 8 * h;
#pragma unroll
                for (int v = 0; v < 2; ++v) {  // 8 units at a time: one 16-byte chunk of each output
                    unsigned og[4], ou[4], om[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {  // units 16 q + 2 nc, + 1, nc = 4 v + i
                        const int nc = 4 * v + i;
                        og[i] = pack2(acc[half][nc][2 * h], acc[half][nc][2 * h + 1]);
                        ou[i] = pack2(acc[half][nc + 8][2 * h], acc[half][nc + 8][2 * h + 1]);
                        om[i] = pack2(silu_f(lo_bf(og[i])) * lo_bf(ou[i]), silu_f(hi_bf(og[i])) * hi_bf(ou[i]));
                    }
                    const unsigned a = out + half * 3 * OUT + rl * 128 + (((2 * q + v) ^ (rl & 7)) << 4);
                    sts128(a, og);
                    sts128(a + OUT, ou);
                    sts128(a + 2 * OUT, om);
                }
            }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the writes, seen by the TMA stores
        bar_sync(2 + wg, 128);
        if (t == 0) {
            for (int half = 0; half < 2; ++half) {
                const int r = row0 + 64 * half;
                if (r >= N) break;  // rows past N are left out
                const unsigned o = out + half * 3 * OUT;
                tma_store_2d(gu_map, unit0, r, o);
                tma_store_2d(gu_map, F + unit0, r, o + OUT);
                tma_store_2d(m_map, unit0, r, o + 2 * OUT);
            }
            asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        }
    }
    if (t == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#else
    __trap();  // built for another target: the engine launches this kernel only on sm_90a builds
#endif
}

// ---- the qkv projection with RoPE and the attention layouts inside (wgmma and TMA, sm_90a) -----------
// qkv = xhat1 Wqkv^T (xhat1 (N, C): the first norm's output, rows n = b T + t; Wqkv ((H + 2 Hkv) 64, C):
// q rows, k rows, v rows), then q and k rotated by RoPE (half split: d and d + 32 of a head, by cos/sin
// (T, 32) at position t) and every head written in the attention kernels' layouts, q (B, H, T, 64) and
// k, v (B, Hkv, T, 64), in one kernel: qkv_rope_split_bf16 no longer reads the qkv product back. The
// design is swiglu_fwd_gemm's (persistent, a producer warp feeding the ring by TMA, two warpgroups in
// ping-pong on 128 x 128 tiles); a tile is 128 rows x two heads, the weight rows in their own order. In
// the wgmma C layout lane l holds the columns 8 nc + 2 (l % 4) + e, so head dimension d (chunk nc = d / 8
// of the head) and its partner d + 32 (chunk nc + 4) are in the same lane: the rotation needs no exchange.
// As in the unfused path, each product is rounded to bf16 before it is rotated, so q/k/v are bit-identical
// to qkv_rope_split_bf16 of the same bf16 product.
// A warpgroup writes its tile into four 64 x 64 boxes of shared memory (two heads of each 64-row half;
// 128-byte swizzle), and TMA stores move each box to its head through 3-D maps (64, T, B heads)
// (tma.heads_map): a box at (0, t0, b H + h) is positions t0 .. t0 + 63 of head h of sequence b.
// Needs head size 64, C % 64 == 0 and T % 64 == 0 (a warpgroup's 64 rows then lie in one sequence); a
// tile's second head past the last v head is not stored, nor rows past N.
extern "C" __global__ void __launch_bounds__(288, 1) qkv_rope_gemm(const void* __restrict__ x_map,
                                                                  const void* __restrict__ w_map,
                                                                  const void* __restrict__ q_map,
                                                                  const void* __restrict__ k_map,
                                                                  const void* __restrict__ v_map,
                                                                  const float* __restrict__ cos_t,
                                                                  const float* __restrict__ sin_t, int N, int C,
                                                                  int T, int H, int Hkv) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BOX = 64 * 64 * 2;  // one head's 64 rows, bf16: 8 KiB
    extern __shared__ __align__(128) unsigned char sg_smem[];
    const int wg = threadIdx.x >> 7, t = threadIdx.x & 127, warp = t >> 5, lane = t & 31, q = lane & 3;
    const unsigned stages = (smem_u32(sg_smem) + 1023u) & ~1023u, outs = stages + SG_STAGES * SG_STAGE;
    const unsigned full = outs + 8 * BOX, empty = full + 8 * SG_STAGES;
    const int heads = H + 2 * Hkv, ncols = (heads + 1) / 2, KT = C / SG_BK, tiles = (N + 127) / 128 * ncols;
    if (threadIdx.x == 0) sg_init_ring(full, empty);
    __syncthreads();
    if (wg == 2) {  // the producer warp
        if (threadIdx.x == 256)
            sg_produce(x_map, w_map, tiles, KT, stages, full, empty,
                       [&](int tile, int kt, unsigned dst, unsigned bar) {
                tma_2d(dst, x_map, kt * SG_BK, tile / ncols * 128, bar);
                tma_2d(dst + SG_TILE, w_map, kt * SG_BK, tile % ncols * 128, bar);
            });
        return;
    }
    if (t == 0) tma_acquire(q_map), tma_acquire(k_map), tma_acquire(v_map);
    const unsigned out = outs + wg * 4 * BOX;  // this warpgroup's: per 64-row half, the two heads
    const int n = sg_block_tiles(tiles);
    for (int k = wg; k < n; k += 2) {
        const int tile = blockIdx.x + k * gridDim.x, row0 = tile / ncols * 128, head0 = tile % ncols * 2;
        float acc[2][16][4];
        sg_products(acc, k, n, KT, stages, full, empty, wg, t, [] {});
        if (t == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // its last tile's boxes are out
        bar_sync(2 + wg, 128);
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // this lane's rows rl and rl + 8; head dimensions 8 j + 2 q + e, + 32
                const int rl = warp * 16 + (lane >> 2) + 8 * h, pos = (row0 + 64 * half + rl) % T;
                float2 cs[4], sn[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    cs[j] = *reinterpret_cast<const float2*>(cos_t + pos * 32 + 8 * j + 2 * q);
                    sn[j] = *reinterpret_cast<const float2*>(sin_t + pos * 32 + 8 * j + 2 * q);
                }
#pragma unroll
                for (int hd = 0; hd < 2; ++hd) {
                    const bool rotate = head0 + hd < H + Hkv;  // q and k heads; v as it is
                    const unsigned row = out + (2 * half + hd) * BOX + rl * 128 + 4 * q;
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const unsigned w1 = pack2(acc[half][8 * hd + j][2 * h], acc[half][8 * hd + j][2 * h + 1]);
                        const unsigned w2 = pack2(acc[half][8 * hd + j + 4][2 * h],
                                                  acc[half][8 * hd + j + 4][2 * h + 1]);
                        unsigned y1 = w1, y2 = w2;
                        if (rotate) {
                            const float a0 = lo_bf(w1), a1 = hi_bf(w1), b0 = lo_bf(w2), b1 = hi_bf(w2);
                            y1 = pack2(a0 * cs[j].x - b0 * sn[j].x, a1 * cs[j].y - b1 * sn[j].y);
                            y2 = pack2(b0 * cs[j].x + a0 * sn[j].x, b1 * cs[j].y + a1 * sn[j].y);
                        }
                        sts32(row + ((j ^ (rl & 7)) << 4), y1);
                        sts32(row + (((j + 4) ^ (rl & 7)) << 4), y2);
                    }
                }
            }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the writes, seen by the TMA stores
        bar_sync(2 + wg, 128);
        if (t == 0) {
            for (int half = 0; half < 2; ++half) {
                const int r = row0 + 64 * half;
                if (r >= N) break;  // rows past N are left out
                for (int hd = 0; hd < 2; ++hd) {
                    const int hh = head0 + hd;
                    if (hh >= heads) break;
                    const void* map = hh < H ? q_map : hh < H + Hkv ? k_map : v_map;
                    const int nh = hh < H ? H : Hkv, hl = hh < H ? hh : hh < H + Hkv ? hh - H : hh - H - Hkv;
                    tma_store_3d(map, 0, r % T, r / T * nh + hl, out + (2 * half + hd) * BOX);
                }
            }
            asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        }
    }
    if (t == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#else
    __trap();  // built for another target: the engine launches this kernel only on sm_90a builds
#endif
}

// The fused kernel's image of the down projections: `count` matrices Wd (rows x cols, bf16; cols % 128
// == 0) at base + offs[z] -> dst, each transposed (cols x rows) with its rows permuted within blocks of
// 128: column c of Wd becomes row (c / 128) 128 + sg_row(c % 128). Grid (ceil(cols / 32), ceil(rows / 32),
// count), block (32, 8): a 32 x 32 tile through shared memory (padded against bank conflicts), so reads
// and writes go along rows.
extern "C" __global__ void wdt_image(const bf16* __restrict__ base, const long long* __restrict__ offs,
                                     bf16* __restrict__ dst, int rows, int cols) {
    __shared__ bf16 tile[32][34];
    const bf16* src = base + offs[blockIdx.z];
    bf16* out = dst + (long long)blockIdx.z * rows * cols;
    const int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32, x = threadIdx.x;
    for (int i = threadIdx.y; i < 32; i += 8)
        if (r0 + i < rows && c0 + x < cols) tile[i][x] = src[(long long)(r0 + i) * cols + c0 + x];
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += 8) {
        const int c = c0 + i;
        if (c < cols && r0 + x < rows) out[(long long)((c & ~127) + sg_row(c & 127)) * rows + r0 + x] = tile[x][i];
    }
}
