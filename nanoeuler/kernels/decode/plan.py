"""The decode engine's host-side arithmetic, without a GPU: the kernels' shape constants (each passed to
the compiler as a -D option, so that they are written down once), the variants `GpuBackend` runs for a
model and a GPU, and the grids, unrolls and shared memory that depend only on shapes.

    >>> from nanoeuler.model.config import ModelConfig
    >>> cfg = ModelConfig.named("gpu")
    >>> choose_variants(cfg, "bf16", cc=90)
    Variants(tensor_cores=True, attend_cluster=True, alone_keys=96, fuse_argmax=True, attend_kv=True, flash='wg')
    >>> defines()[:2]
    ('-DGEMV_ROWS=4', '-DGEMV_WARPS=8')
    >>> gemv_unroll(768, "bf16"), gemv_unroll(2048, "bf16"), tc_chunks(4, 2048, "bf16")
    (4, 8, 8)
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoeuler.errors import UserError
from nanoeuler.kernels.bf16.plan import MMA_HEAD_DIMS

# ---- the kernels' shape constants (decode.cuh has the same values as #ifndef defaults) ----------------
GEMV_ROWS = 4  # rows of x a GEMV block stages in shared memory (grid.y covers the rest)
GEMV_WARPS = 8  # a GEMV block's warps, one output each
TC_WARPS = 8  # a tensor-core GEMV block's warps, splitting K; a block owns 8 outputs
TC_PASS = 2  # chunks of x a tensor-core GEMV warp loads before its products
MLP_FC = 16  # hidden units (and warps) of a swiglu_down block
ATTEND_THREADS = 512  # a block of attend_row (one row and query head)
O_PRE = 4  # W_o pieces a thread of attend_o requests before its wait
OSPLIT = 8  # attend_o_cluster's cluster of blocks a (row, head), and attend_o's row splits at most
OC_WARPS = 8  # attend_o_cluster's warps a block
OC_KEYS = 2  # keys a lane group of attend_o_cluster holds from before its wait
KV_WARPS = 8  # attend_kv's warps a block
KV_MAXG = 4  # attend_kv's query heads a key/value head, at most
KV_AHEAD = 2  # keys a lane group of attend_kv requests before using any
SAMPLE_THREADS = 1024  # a block of the next-token kernels (one row)
SAMPLE_PER_THREAD = 64  # logits a thread of sample_rows holds
DEFINES = (
    "GEMV_ROWS",
    "GEMV_WARPS",
    "TC_WARPS",
    "TC_PASS",
    "MLP_FC",
    "ATTEND_THREADS",
    "O_PRE",
    "OSPLIT",
    "OC_WARPS",
    "OC_KEYS",
    "KV_WARPS",
    "KV_MAXG",
    "KV_AHEAD",
    "SAMPLE_THREADS",
    "SAMPLE_PER_THREAD",
)

# ---- the host's own ---------------------------------------------------------------------------------
GEMV_MAX_ROWS = 16  # passes of more rows take the cuBLAS path
TC_MAX_ROWS = 16  # the tensor-core GEMV's A tile: 16 rows
ALONE_KEYS = 96  # up to this many keys each block of attend_o_cluster attends over all of them
CHAIN_AHEAD, CHAIN_CAP = 3, 8  # greedy steps queued ahead of the host; the ring of their ids on the GPU
UNROLLS = (4, 8)  # the GEMVs' 16-byte pieces in flight a lane and weight row (gemv_unroll)
STORAGES = ("bf16", "fp32")  # weight and cache storage; kernel names end _bf16 or _f32
SMEM_DEFAULT = 48 * 1024  # shared memory (static + dynamic) a block gets without its kernel opting in to more


def defines() -> tuple[str, ...]:
    """The -D options of every decode kernel module: the shape constants above."""
    return tuple(f"-D{name}={globals()[name]}" for name in DEFINES)


def suffix(dtype: str) -> str:
    """The kernel-name suffix of a weight storage: "bf16" -> "bf16", "fp32" -> "f32"."""
    return {"bf16": "bf16", "fp32": "f32"}[dtype]


def vec(dtype: str) -> int:
    """Weights or cache values in one 16-byte load."""
    return 8 if dtype == "bf16" else 4


def itemsize(dtype: str) -> int:
    return 2 if dtype == "bf16" else 4


# ---- variants ---------------------------------------------------------------------------------------


@dataclass
class Variants:
    """The kernel paths of a backend (each a variant of bench/decode_steps_gpu.py; mutable so that a test or
    a bench can switch one off)."""

    tensor_cores: bool  # 2 to 16 rows of bf16 weights: the tensor-core GEMV (tgemv); off: the float GEMV
    attend_cluster: bool  # one row: attention over a cluster of OSPLIT blocks (attend_o_cluster); off: attend_o
    alone_keys: int  # up to this many keys each block of the cluster attends over all of them
    fuse_argmax: bool  # one row's greedy id in the head's own kernel (head_argmax)
    attend_kv: bool  # wide batches: a block per (row, key/value head) (attend_kv_act); off: attend_act
    flash: str | None  # a long prefill's attention: the training engine's "wg" or "ldm" kernels; None: attend_act


def check_model(cfg, dtype: str) -> None:
    """A ValueError for a model or storage the decode kernels do not handle."""
    if dtype not in STORAGES:
        raise ValueError(f"dtype must be bf16 or fp32, got {dtype!r}")
    if cfg.vocab_size > SAMPLE_THREADS * SAMPLE_PER_THREAD:
        raise ValueError(
            f"the GPU sampler handles vocabularies of up to {SAMPLE_THREADS * SAMPLE_PER_THREAD} "
            f"tokens, not {cfg.vocab_size}"
        )
    if cfg.dim % OSPLIT:  # attend_o's row splits (OSPLIT or a power of two below)
        raise ValueError(f"the GPU decode engine needs a width divisible by {OSPLIT}, not {cfg.dim}")


def choose_variants(cfg, dtype: str, cc: int) -> Variants:
    """The fastest kernel paths that apply to a model, storage and GPU (compute capability `cc`, e.g. 90).
    The cluster needs cc >= 90 and a key's 16-byte pieces on at most a warp's lanes; attend_kv's lane
    groups (D / vec lanes) must divide the warp, and its query heads a key/value head fit KV_MAXG."""
    check_model(cfg, dtype)
    D, v = cfg.head_dim, vec(dtype)
    flash = None
    if dtype == "bf16" and D in MMA_HEAD_DIMS:
        flash = "wg" if D == 64 and cc == 90 else "ldm"  # wgmma needs sm_90a, which only cc 9.0 builds for
    return Variants(
        tensor_cores=True,
        attend_cluster=D % v == 0 and D // v <= 32 and cc >= 90,
        alone_keys=ALONE_KEYS,
        fuse_argmax=True,
        attend_kv=D % v == 0 and 32 % (D // v) == 0 and cfg.n_heads // cfg.n_kv_heads <= KV_MAXG,
        flash=flash,
    )


# ---- row counts: each a CUDA graph and a set of row buffers of the backend -----------------------------


def prefill_rows(T: int, ctx_len: int, avoid: int = 0) -> int:
    """The rows a prefill chunk of T tokens runs as: up to GEMV_MAX_ROWS as they come (the few-row path),
    more padded to a power of two (the padding rows come last), at most the context. `avoid`: a row count
    whose buffers are busy (a running chain's), the next count up instead.

        >>> prefill_rows(5, 1024), prefill_rows(17, 1024), prefill_rows(700, 768)
        (5, 32, 768)
        >>> prefill_rows(17, 1024, avoid=32), prefill_rows(16, 1024, avoid=16), prefill_rows(5, 1024, avoid=8)
        (64, 32, 5)
    """
    P = T if T <= GEMV_MAX_ROWS else min(ctx_len, 1 << (T - 1).bit_length())
    return prefill_rows(P + 1, ctx_len) if P == avoid else P


def recorded_rows(ctx_len: int) -> list[int]:
    """Every row count a prefill of 1 to ctx_len tokens runs as (`prefill_rows`), ascending.

    >>> recorded_rows(128)[14:], len(recorded_rows(1024))
    ([15, 16, 32, 64, 128], 22)
    """
    return sorted({prefill_rows(T, ctx_len) for T in range(1, ctx_len + 1)})


def decode_width(rows: int, batch: int) -> int:
    """The rows a server's decode step over slots 0..rows-1 of `batch` runs as: a power of two, at most the batch.

    >>> decode_width(3, 8), decode_width(9, 12)
    (4, 12)
    """
    return min(batch, 1 << (rows - 1).bit_length())


def decode_widths(batch: int) -> list[int]:
    """Every row count a server's decode step over `batch` slots runs as (`decode_width`), ascending.

    >>> decode_widths(8), decode_widths(12)
    ([1, 2, 4, 8], [1, 2, 4, 8, 12])
    """
    return sorted({decode_width(rows, batch) for rows in range(1, batch + 1)})


# ---- grids, unrolls, shared memory --------------------------------------------------------------------


def gemv_unroll(K: int, dtype: str) -> int:
    """16-byte pieces a lane requests at once per weight row in a GEMV over rows of K: 4 where 4 * 32 pieces
    cover the row, else 8."""
    return 4 if -(-K // (32 * vec(dtype))) <= 4 else 8


def gemv_smem(M: int, K: int) -> int:
    """Dynamic shared memory of a GEMV block: its staged rows of x, float32."""
    return 4 * min(M, GEMV_ROWS) * K


def tc_chunks(M: int, K: int, dtype: str, tensor_cores: bool = True, paired: bool = False) -> int:
    """Chunks of 32 columns a warp of the tensor-core GEMV (4 or 8; 4 only for the `paired` epilogues,
    swiglu and rope) for M rows of K, or 0 where it does not apply (then the float GEMV runs)."""
    if dtype != "bf16" or not tensor_cores or not 2 <= M <= TC_MAX_ROWS or K % 32:
        return 0
    per_warp = -(-K // (32 * TC_WARPS))
    return 4 if per_warp <= 4 else 8 if per_warp <= 8 and not paired else 0


def attend_smem(ctx_len: int, dtype: str) -> int:
    """attend_row's dynamic shared memory: the scores, then the partial outputs in two rounds."""
    return 4 * (ctx_len + ATTEND_THREADS * (vec(dtype) + 1))


def attend_o_splits(M: int, H: int, n_sm: int) -> int:
    """attend_o's row splits of W_o: up to OSPLIT while its blocks (one a multiprocessor) fit the GPU at once."""
    splits = OSPLIT
    while splits > 1 and splits * M * H > n_sm:
        splits //= 2
    return splits


def kv_smem(H: int, Hkv: int, D: int) -> int:
    """attend_kv's dynamic shared memory: every warp's partial output, max and sum per query head."""
    return 4 * (H // Hkv) * KV_WARPS * (D + 2)


def mlp_smem(C: int, dtype: str) -> int:
    """swiglu_down's dynamic shared memory: the staged row of x (4-float aligned), then W_down's pieces of
    the rows past the block's threads."""
    return 4 * (-(-C // 4) * 4) + max(0, C - 32 * MLP_FC) * MLP_FC * itemsize(dtype)


def smem_opt_in(what: str, need: int, static: int, card_max: int) -> int:
    """The dynamic shared memory a kernel must be allowed (cudaFuncAttributeMaxDynamicSharedMemorySize) for
    launches of `need` bytes beside its `static` ones: 0 where the default SMEM_DEFAULT holds the block, else
    `need`; a block past the card's opt-in maximum `card_max` (cudaDevAttrMaxSharedMemoryPerBlockOptin) is a
    UserError naming `what`. swiglu_down (192 static bytes) on an H100 (227 KB):

        >>> smem_opt_in("swiglu_down", mlp_smem(768, "bf16"), 192, 232448)     # the gpu preset: the default
        0
        >>> smem_opt_in("swiglu_down", mlp_smem(2048, "bf16"), 192, 232448)    # 2048 wide: 56 KB
        57344
    """
    if need + static <= SMEM_DEFAULT:
        return 0
    if need + static > card_max:
        raise UserError(
            f"the GPU decode kernel {what} needs {need + static:,} bytes of shared memory a block; "
            f"this GPU allows {card_max:,}: decode on the CPU or with bf16 weights, or use a narrower model"
        )
    return need
