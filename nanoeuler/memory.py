"""Device memory: what a GPU stage will need, what it has, and what it used.

    >>> from nanoeuler.model.config import ModelConfig
    >>> cfg = ModelConfig.named("gpu")
    >>> round(peak(xp_train_parts(cfg, rows=8, seq=512), context=0) / 1e9, 2)     # fp32 step of 8 x 512
    5.83
    >>> card = Budget(11e9, 0.4e9, "gpu_memory")                    # 11 GB, the context's 0.4 included
    >>> fit_rows("sft", 32, card, lambda m: xp_train_parts(cfg, m, 512))                   # 2 x 16 rows
    16
    >>> fit_rows("sft", 32, card, lambda m: xp_train_parts(cfg, m, 512, checkpoint=True))  # all at once
    32

A prediction is a dict of named byte counts (`xp_train_parts`, `engine_parts`, `forward_parts`,
`decode_parts`); its `peak` adds the CUDA context. It counts what CuPy's pool must hold at the busiest
moment, read off the code that allocates it: the training step's parameters, gradients and AdamW state,
the activations the backward keeps (`transformer._block_forward`'s cache through the GPU ops of
`kernels/ops.py`, which keep each norm's input beside its output), the backward's and the loss's
temporaries; the bf16 engine's buffers; a forward without a backward (evaluation, scoring); the
decode engine's weights, KV cache and row buffers (a speculating server's verify passes' too). A
`Budget` is the `gpu_memory` setting (or what the card has free at the start) and each stage sizes
its micro-batches (`fit_rows`) and evaluation chunks (`chunk_rows`) from it. `PeakMeter` measures a
stage's real peak, the pool's high-water mark plus what the process holds outside the pool, for the
line each stage logs at its end.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from typing import Callable

from nanoeuler.errors import UserError
from nanoeuler.kernels.decode import plan

MiB = 2**20
F32 = 4
# The CUDA context, CuPy's and cuBLAS's handles and the loaded kernels: outside CuPy's pool. A fixed
# figure per card class (compute capability's major version) where nothing is measured; a stage on the
# GPU measures its own before the first allocation (`Budget.on_device`).
CONTEXT_BYTES = {8: 400 * MiB, 9: 600 * MiB}  # sm_80-sm_89 (A100, RTX 30xx/40xx); sm_90 (H100, H200)
DEFAULT_CONTEXT = 500 * MiB
CUBLAS_WORKSPACE = 32 * MiB  # CuPy's cuBLAS handle takes its workspace itself, outside the pool
# The share of the pool's budget a prediction may fill: the pool rounds blocks up and fragments.
FIT_SHARE = 0.92
LOGITS_CHUNK = 64 * MiB  # kernels/ops.py's DEFAULT_CHUNK_BYTES: one chunk of an output head's logits
# Scoring holds (rows, V) float32 arrays beside the logits: hellaswag's shifted logits and their exp.
# The pairs' log-probs (`dpo.target_logps`) take LOGITS_CHUNK of logits at a time, with their shifted copy
# and its exp beside them.
SCORE_COPIES = {"loss": 0, "logits": 2, "pair_logps": 2}
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value, key: str = "gpu_memory") -> float | None:
    """A byte count from a number or a string with a unit; "auto" (or None) is None.

    >>> parse_bytes(11e9), parse_bytes("11GB"), parse_bytes("7.5 GiB"), parse_bytes("auto")
    (11000000000.0, 11000000000.0, 8053063680.0, None)
    """
    if value is None or value == "auto":
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise UserError(f"{key} must be auto, a number of bytes or a size such as 11GB or 10.5GiB, got {value!r}")
        number = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if number <= 0:
        raise UserError(f"{key} must be more than 0 bytes, got {value!r}")
    return number


def gb(n: float) -> str:
    """Bytes as gigabytes with one decimal: gb(11e9) == '11.0 GB'."""
    return f"{n / 1e9:.1f} GB"


# ---- predictions -----------------------------------------------------------------------------------


def _dims(cfg):
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    return cfg.dim, H * D, Hkv * D, (H + 2 * Hkv) * D, cfg.hidden


def layer_cache_bytes(cfg, rows: int, seq: int) -> int:
    """What one block's forward keeps for its backward on the float32 GPU path, per layer.

    Per position: the normed inputs h and h2, the two norms' inputs (the GPU norm keeps x itself),
    qkv (alive as v's view), q and k after RoPE, the attention output and its (B,T,HD) copy, the
    gate/up product (alive as the SwiGLU's views) and m; per row of a head the attention's logsumexp;
    per layer the stacked qkv and gate/up weights the forward concatenates."""
    C, HD, KD, QKV, F = _dims(cfg)
    N = rows * seq
    per_pos = 2 * C + 2 * C + QKV + HD + KD + 2 * HD + 2 * F + F + 2  # + the two 1/rms
    weights = (QKV + 2 * F) * C
    return F32 * (N * per_pos + rows * cfg.n_heads * seq + weights)


def _backward_temp_bytes(cfg, N: int) -> int:
    """The most one `_block_backward` holds at once: dm and d(gate|up) (locals to its end), the stream's
    gradient and two norm gradients, the attention's output gradient, its copy, dq/dk/dv, dqkv and a
    RoPE result."""
    C, HD, KD, QKV, F = _dims(cfg)
    return F32 * N * (3 * F + 3 * C + 4 * HD + 2 * KD + QKV)


def _head_loss_bytes(cfg, N: int) -> int:
    """`mtp_cross_entropy`: dxn, one head's dx and weight gradient, its chunk of logits, the final norm's
    input and output, the per-row loss and logsumexp, the int64 targets of one head."""
    C, V = cfg.dim, cfg.vocab_size
    return F32 * (4 * N * C + V * C + 2 * N) + 8 * N + LOGITS_CHUNK


def zero_share(cfg, world: int) -> int:
    """Parameters whose optimizer state one rank of ZeRO-1 keeps, at most (`train.parallel.plan_shards`
    cuts whole tensors: a rank's run exceeds n/world by at most the largest tensor).

        >>> from nanoeuler.model.config import ModelConfig
        >>> cfg = ModelConfig.named("gpu")
        >>> zero_share(cfg, 1) == cfg.n_params(), round(zero_share(cfg, 4) / cfg.n_params(), 3)
        (True, 0.277)
    """
    n = cfg.n_params()
    if world <= 1:
        return n
    largest = max(math.prod(s) for s in cfg.param_shapes().values())
    return min(n, -(-n // world) + largest)


def flat_parts(cfg, zero_world: int, dp_world: int) -> dict:
    """The float32 path's optimizer state and data-parallel buffer: AdamW's moments (of one rank's share
    under ZeRO-1), and with several ranks the flat gradients of `train.parallel.FlatGradients`, every rank's
    run padded to the longest (through which zero 0 and zero 1 both average).

        >>> from nanoeuler.model.config import ModelConfig
        >>> cfg = ModelConfig.named("gpu")
        >>> sorted(flat_parts(cfg, 1, 1)), sorted(flat_parts(cfg, 1, 4)), sorted(flat_parts(cfg, 4, 4))
        (['adamw'], ['adamw', 'flat_grads'], ['adamw', 'flat_grads'])
    """
    world = max(zero_world, dp_world)
    parts = {"adamw": 2 * F32 * zero_share(cfg, zero_world)}
    if world > 1:
        parts["flat_grads"] = F32 * world * zero_share(cfg, world)
    return parts


def xp_train_parts(
    cfg,
    rows: int,
    seq: int,
    *,
    micro_batches: int = 1,
    checkpoint: bool = False,
    zero_world: int = 1,
    dp_world: int = 1,
) -> dict:
    """Named byte counts of one float32 training step (`XpStepper`) on micro-batches of rows x seq.
    `dp_world` > 1: one rank of data parallel over that many ranks; `zero_world` > 1: of ZeRO-1
    (`train.parallel.ZeroStepper`), which keeps the moments of its share only (`flat_parts`)."""
    n, L, N = cfg.n_params(), cfg.n_layers, rows * seq
    layer = layer_cache_bytes(cfg, rows, seq)
    parts = {"params": F32 * n, "grads": F32 * n, **flat_parts(cfg, zero_world, dp_world)}
    if micro_batches > 1:  # the running sum beside the next micro-batch's gradients
        parts["grad_sum"] = F32 * n
    # with checkpointing each block keeps only its input; the one being differentiated is recomputed
    parts["activations"] = L * F32 * N * cfg.dim + layer if checkpoint else L * layer
    parts["batch"] = 8 * N * (1 + cfg.mtp_heads)
    parts["temporaries"] = max(_head_loss_bytes(cfg, N), F32 * 2 * N * cfg.dim + _backward_temp_bytes(cfg, N))
    return parts


def forward_parts(cfg, rows: int, seq: int, kind: str = "loss", params: bool = True) -> dict:
    """Named byte counts of one forward without a backward (`transformer.forward_loss` for "loss",
    `transformer.logits` and its scoring for "logits" and "pair_logps"): one block's working set at a
    time, then the output head. `params`: count the float32 weights (False: they are resident already)."""
    N, C, V = rows * seq, cfg.dim, cfg.vocab_size
    parts = {"params": F32 * cfg.n_params()} if params else {}
    parts["block"] = layer_cache_bytes(cfg, rows, seq) + F32 * N * C
    if kind == "loss":
        parts["head"] = F32 * (2 * N * C + 2 * N) + 8 * N + LOGITS_CHUNK
    elif kind == "pair_logps":  # the final state, its response rows, a chunk of logits and its copies
        r = min(N, score_chunk_rows(cfg))
        parts["head"] = F32 * (2 * N * C + (1 + SCORE_COPIES[kind]) * r * cfg.vocab_size + 2 * N) + 8 * 3 * N
    else:
        parts["head"] = F32 * (2 * N * C + (1 + SCORE_COPIES[kind]) * N * V)
    parts["batch"] = 8 * N * (1 + cfg.mtp_heads)
    return parts


def score_chunk_rows(cfg) -> int:
    """Rows of logits a scoring pass computes at once: LOGITS_CHUNK of float32 (4096 at V = 4096)."""
    return max(1, LOGITS_CHUNK // (F32 * cfg.vocab_size))


def engine_parts(
    cfg,
    batch: int,
    seq: int,
    kernels: str = "portable",
    sm90a: bool = False,
    checkpoint: bool = False,
    accum: bool = False,
    head: str = "ce",
    zero_world: int = 1,
) -> dict:
    """Named byte counts of the bf16 engine's buffers (`kernels.bf16.engine.TrainEngine`, all allocated at its start),
    from `bf16.plan.engine_bytes` for the variants the kernel path takes on this card (`sm90a`). `zero_world`
    > 1: one rank of ZeRO-1 over that many, whose moments cover its region of the flat buffers only.

        >>> from nanoeuler.model.config import ModelConfig
        >>> one, four = (engine_parts(ModelConfig.named("gpu"), 16, 512, zero_world=z) for z in (1, 4))
        >>> round((one["moments"] - four["moments"]) / 2**20), round((four["params"] - one["params"]) / 2**20)
        (648, 36)
    """
    from nanoeuler.kernels.bf16 import plan

    options = {} if kernels == "auto" else {"attention": "ldm", "fuse_swiglu": False, "fuse_rope": False}
    v = plan.choose_variants(cfg, seq, sm90a=sm90a, **options)
    return plan.engine_bytes(
        cfg,
        batch,
        seq,
        attention=v.attention,
        fuse_swiglu=v.fuse_swiglu,
        fuse_rope=v.fuse_rope,
        accum=accum,
        checkpoint=checkpoint,
        head=head,
        shards=zero_world,
    )


def row_bytes(cfg, rows: int, dtype: str = "bf16") -> int:
    """Device bytes of the GPU decode engine's buffers for one row count (`infer.gpu._Rows`): the rows'
    control words, float32 activations, every head's logits and chosen ids, the GEMM operands in `dtype`."""
    C, HD, KD, QKV, F = _dims(cfg)
    w = 2 if dtype == "bf16" else F32
    K, M = cfg.mtp_heads, rows
    control = F32 * (3 * M + 4) + F32 * M * K + F32 + 8  # ids/slots/positions/sampling; chosen ids; argmax state
    return control + F32 * M * (2 * C + QKV + 2 * HD + 3 * F + K * cfg.vocab_size) + w * M * max(C, F, HD)


def decode_parts(cfg, batch: int, dtype: str = "bf16", speculative: bool = False) -> dict:
    """Named byte counts of the GPU decode engine (`infer/gpu.py`): its weight image, the float32 weights
    kept for evaluation code, the KV cache of `batch` slots of the whole context, and the row buffers
    (activations and every head's logits) it keeps per row count: a prefill's (`plan.recorded_rows`: 1 to
    16 rows, then powers of two up to ctx_len) and a server's decode steps' (`plan.decode_widths`; all of
    them from the start, `Backend.warm_up`). `speculative`: a server whose greedy streams speculate in the
    batch (`serve --speculative`) also keeps the buffers of its verify passes, one per number of streams
    verified at once: g streams' blocks of K rows, g = 1..batch (less those counted already).

        >>> from nanoeuler.model.config import ModelConfig
        >>> round(decode_parts(ModelConfig.named("gpu"), 64, speculative=True)["speculation"] / 1e6)
        871
    """
    n = cfg.n_params()
    w = 2 if dtype == "bf16" else F32
    counts = set(plan.recorded_rows(cfg.ctx_len)) | set(plan.decode_widths(batch) if batch else ())
    parts = {
        "params": F32 * n,
        "weights": w * n,
        "kv_cache": 2 * w * cfg.n_layers * batch * cfg.n_kv_heads * cfg.ctx_len * cfg.head_dim,
        "rows": sum(row_bytes(cfg, m, dtype) for m in counts),
    }
    if speculative and cfg.mtp_heads > 1:
        verify = {g * cfg.mtp_heads for g in range(1, batch + 1)} - counts
        parts["speculation"] = sum(row_bytes(cfg, m, dtype) for m in verify)
    return parts


def peak(parts: dict, context: float) -> float:
    """Predicted peak device memory: the pool's share (the parts), cuBLAS's workspace and the context."""
    return sum(parts.values()) + CUBLAS_WORKSPACE + context


# ---- the budget and the fitting ----------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """What a stage may use on the device in all (`total`, the context included), the context, and where
    the figure came from ("gpu_memory" or "free on the card")."""

    total: float
    context: float
    source: str

    def pool(self) -> float:
        """Bytes the predictions of the pool may fill."""
        return FIT_SHARE * (self.total - self.context - CUBLAS_WORKSPACE)

    def fits(self, parts: dict) -> bool:
        return sum(parts.values()) <= self.pool()

    @classmethod
    def on_device(cls, setting, xp) -> "Budget | None":
        """The budget of this process on the current GPU (None on the CPU: no limit). `setting`: the config's
        gpu_memory; "auto" takes what the card has free now, within CuPy's pool limit
        (CUPY_GPU_MEMORY_LIMIT), plus the context this process already holds."""
        asked = parse_bytes(setting)
        if xp.__name__ == "numpy":
            return None
        free, total = xp.cuda.runtime.memGetInfo()
        context = device_context_bytes(xp)
        limit = xp.get_default_memory_pool().get_limit() or math.inf
        room = min(free + xp.get_default_memory_pool().total_bytes(), limit) + context
        if asked is None or asked > room:  # more than the card has free: what it has
            return cls(room, context, "free on the card")
        return cls(asked, context, "gpu_memory")


def device_context_bytes(xp) -> float:
    """What this process holds on the GPU outside CuPy's pool (the context, handles, kernels), now: the
    card's used memory less the pool's (on a card shared with other processes, theirs is counted too)."""
    free, total = xp.cuda.runtime.memGetInfo()
    return max(0.0, float(total - free - xp.get_default_memory_pool().total_bytes()))


def context_for(capability_major: int) -> int:
    return CONTEXT_BYTES.get(capability_major, DEFAULT_CONTEXT)


def fit_rows(
    stage: str, rows: int, budget: Budget | None, predict: Callable[[int], dict], what: str = "sequence", need: str = ""
) -> int:
    """The most rows (<= `rows`) a step of `predict(m)` may take inside `budget`, spread evenly: 32 rows
    of which 12 fit are 3 micro-batches of 11. None: no budget (the CPU), `rows`. When one row does not
    fit, a UserError names what one needs and what is there; `need` says how to need less."""
    if budget is None or budget.fits(predict(rows)):
        return rows
    lo, hi = 0, rows  # the most rows that fit lie in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if budget.fits(predict(mid)) else (lo, mid)
    if lo == 0:
        one = sum(predict(1).values()) / FIT_SHARE + CUBLAS_WORKSPACE + budget.context
        raise UserError(
            f"needs {gb(one)} for one {what}; {budget.source} is {gb(budget.total)}" + (f": {need}" if need else "")
        )
    parts = -(-rows // lo)
    return -(-rows // parts)


def chunk_rows(budget: Budget | None, predict: Callable[[int], dict], most: int) -> int:
    """Rows of one evaluation chunk: the most (<= `most`) whose forward `predict(m)` fits beside what the
    stage keeps resident (in `predict`), at least 1 (a stage checks at its start that one row fits)."""
    if budget is None or budget.fits(predict(most)):
        return most
    lo, hi = 1, most
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if budget.fits(predict(mid)) else (lo, mid)
    return lo


def split_rows(batch: list, rows: int) -> list:
    """Micro-batches [(x, y), ...] cut into pieces of at most `rows` rows each, in order.

    >>> import numpy as np
    >>> [x.shape[0] for x, _ in split_rows([(np.zeros((5, 2)), np.zeros((5, 2, 1)))], 2)]
    [2, 2, 1]
    """
    return [(x[i : i + rows], y[i : i + rows]) for x, y in batch for i in range(0, x.shape[0], rows)]


def say_fit(stage: str, rows: int, micro: int, budget: Budget | None, unit: str = "") -> None:
    """The one line a stage prints when it splits its batches:
    `sft: batch 32 as 4 micro-batches of 8 to fit 11.0 GB`."""
    if budget is not None and micro < rows:
        n = -(-rows // micro)
        print(
            f"nanoeuler {stage}: batch {rows}{unit} as {n} micro-batches of {micro}{unit} to fit "
            f"{gb(budget.total)} ({budget.source})",
            file=sys.stderr,
            flush=True,
        )


def decode_batch(
    stage: str,
    budget: Budget | None,
    cfg,
    most: int,
    resident: dict | None = None,
    dtype: str = "bf16",
    speculative: bool = False,
) -> int | None:
    """The most generation slots (<= `most`) whose KV cache fits beside the decode engine and `resident`
    (other models held at once), with a speculating server's verify buffers (`decode_parts`); None on the
    CPU. A model without room for one slot is a UserError."""
    if budget is None:
        return None
    resident = resident or {}

    def predict(b):
        return {**resident, **decode_parts(cfg, b, dtype, speculative)}

    if not budget.fits(predict(1)):
        need = sum(predict(1).values()) / FIT_SHARE + CUBLAS_WORKSPACE + budget.context
        raise UserError(
            f"needs {gb(need)} for the model and one sequence's cache of {cfg.ctx_len}; "
            f"{budget.source} is {gb(budget.total)}: use a card with more memory"
        )
    return chunk_rows(budget, predict, most)


# ---- a training stage's plan ----------------------------------------------------------------------------


def _dpo_head_bytes(cfg, N: int) -> int:
    """`model.dpo.dpo_head_loss` at most: the response rows' logits, shifted, exp and softmax (N, V), their
    normed states, dxn and its rows, and the head's weight gradient."""
    return F32 * (4 * N * cfg.vocab_size + 3 * N * cfg.dim + cfg.vocab_size * cfg.dim)


def kernel_path(settings) -> str:
    """The bf16 engine's kernel path a stage runs (NANOEULER_KERNELS wins over `<stage>.kernels`)."""
    import os

    return os.environ.get("NANOEULER_KERNELS") or getattr(settings, "kernels", "auto")


def train_parts(
    cfg,
    settings,
    rows: int,
    seq: int,
    *,
    micro_batches: int = 1,
    head: str = "mtp",
    sm90a: bool = False,
    zero_world: int = 1,
    dp_world: int = 1,
) -> dict:
    """One training step's named byte counts for a `train.config.TrainConfig` (precision, checkpointing;
    `zero_world`: the ranks of a ZeRO-1 run; `dp_world`: of a data-parallel one)."""
    if settings.precision == "bf16":
        return engine_parts(
            cfg,
            rows,
            seq,
            kernel_path(settings),
            sm90a,
            settings.checkpoint_activations,
            accum=micro_batches > 1,
            head="dpo" if head == "dpo" else "ce",
            zero_world=zero_world,
        )
    parts = xp_train_parts(
        cfg,
        rows,
        seq,
        micro_batches=micro_batches,
        checkpoint=settings.checkpoint_activations,
        zero_world=zero_world,
        dp_world=dp_world,
    )
    if head == "dpo":
        parts["temporaries"] = max(parts["temporaries"], _dpo_head_bytes(cfg, rows * seq))
    return parts


def resident_parts(
    cfg,
    settings,
    rows: int,
    seq: int,
    *,
    micro_batches: int = 1,
    head: str = "mtp",
    sm90a: bool = False,
    zero_world: int = 1,
    dp_world: int = 1,
) -> dict:
    """What stays on the device between steps, beside which evaluation runs: the engine's buffers, or the
    float32 parameters and AdamW's moments."""
    if settings.precision == "bf16":
        return train_parts(
            cfg, settings, rows, seq, micro_batches=micro_batches, head=head, sm90a=sm90a, zero_world=zero_world
        )
    return {"params": F32 * cfg.n_params(), **flat_parts(cfg, zero_world, dp_world)}


@dataclass(frozen=True)
class TrainPlan:
    micro: int  # items (sequences, or pairs) per micro-batch
    eval_items: int  # items of one evaluation forward
    predicted: float  # peak bytes, context included (0 on the CPU)


def plan_training(
    stage: str,
    cfg,
    settings,
    budget: Budget | None,
    *,
    eval_items: int,
    eval_kind: str = "loss",
    rows_per_item: int = 1,
    unit: str = "",
    head: str = "mtp",
    sm90a: bool = False,
    zero_world: int = 1,
    dp_world: int = 1,
) -> TrainPlan:
    """Micro-batch and evaluation chunk of a training stage inside `budget` (None: as configured), and the
    predicted peak; prints the one line of `say_fit` when it splits. Sequences are counted at the whole
    context, the longest a batch holds. `zero_world`: the ranks of a ZeRO-1 run (1: none); `dp_world`: of
    a data-parallel run."""
    T, B, accum = cfg.ctx_len, settings.batch_size, settings.grad_accum
    if budget is None:  # the CPU: as configured
        return TrainPlan(B, eval_items, 0.0)
    what = f"{'pair' if rows_per_item == 2 else 'sequence'} of {T} at {settings.precision}"

    common = dict(head=head, sm90a=sm90a, zero_world=zero_world, dp_world=dp_world)

    def step(m):
        return train_parts(cfg, settings, m * rows_per_item, T, micro_batches=accum * -(-B // m), **common)

    def resident(m):  # what a micro-batch of m keeps between steps
        return resident_parts(cfg, settings, m * rows_per_item, T, micro_batches=accum * -(-B // m), **common)

    def step_and_scoring(m):  # a micro-batch fits when its step does, and one scoring item beside what it keeps
        parts = (step(m), scoring_parts(cfg, resident(m), rows_per_item, T, eval_kind))
        return max(parts, key=lambda p: sum(p.values()))

    # one row of the step, then one scoring item beside it, each else its own error (checkpointing helps
    # only the step), then the most rows that leave room for both
    fit_rows(stage, 1, budget, step, what, _hint(stage, settings))
    eval_items_for(stage, budget, cfg, T, 1, eval_kind, resident(1), rows_per_item)
    micro = fit_rows(stage, B, budget, step_and_scoring, what)
    items, forward = eval_items_for(stage, budget, cfg, T, eval_items, eval_kind, resident(micro), rows_per_item)
    say_fit(stage, B, micro, budget, unit)
    return TrainPlan(micro, items, max(peak(step(micro), budget.context), peak(forward(items), budget.context)))


def _hint(stage: str, settings) -> str:
    if not settings.checkpoint_activations:
        return f"set {stage}.checkpoint_activations: true, or use a shorter model.ctx_len"
    return "use a shorter model.ctx_len or a card with more memory"


def scoring_parts(cfg, resident: dict, rows: int, seq: int, kind: str) -> dict:
    """A scoring forward of `kind` over `rows` rows of `seq` tokens (`forward_parts`, its parameters among
    `resident`), beside what the stage keeps resident."""
    return {**resident, **{f"eval_{k}": v for k, v in forward_parts(cfg, rows, seq, kind, params=False).items()}}


def eval_items_for(
    stage: str,
    budget: Budget | None,
    cfg,
    seq: int,
    most: int,
    kind: str,
    resident: dict,
    rows_per_item: int = 1,
    hint: str = "use a card with more memory or a shorter model.ctx_len",
):
    """(items of one forward of `kind` beside `resident` inside `budget`, at most `most`; the prediction as a
    function of the items and, optionally, their padded length). The one sizing of every evaluation and
    scoring chunk: a training stage's held-out loss, pretraining's and `evaluate`'s validation windows, the
    pairs' log-probs, HellaSwag.
    One item that cannot fit is a UserError naming what it needs."""

    def forward(m, length: int = seq):  # `length`: a chunk's padded length, when shorter than `seq`
        return scoring_parts(cfg, resident, m * rows_per_item, length, kind)

    if budget is not None and not budget.fits(forward(1)):
        need = sum(forward(1).values()) / FIT_SHARE + CUBLAS_WORKSPACE + budget.context
        what = (
            "a pair of sequences"
            if rows_per_item == 2
            else f"{rows_per_item} sequences"
            if rows_per_item > 1
            else "one sequence"
        )
        raise UserError(f"needs {gb(need)} to score {what} of {seq}; {budget.source} is {gb(budget.total)}: {hint}")
    return chunk_rows(budget, forward, max(1, most)), forward


def on_sm90a(xp) -> bool:
    """Whether the bf16 engine's Hopper kernels run here (its `auto` path differs in memory)."""
    if xp.__name__ == "numpy":
        return False
    from nanoeuler.kernels import has_sm90a

    return has_sm90a()


# ---- measuring ----------------------------------------------------------------------------------------


class PeakMeter:
    """A stage's measured peak: CuPy pool's high-water mark (its total bytes, which only an out-of-memory
    retry or `free_all_blocks` lowers; sampled by `sample`) plus what the process holds outside the pool.

        >>> import numpy as np
        >>> PeakMeter(np).measured()        # nothing to measure on the CPU
        0.0
    """

    def __init__(self, xp):
        self.xp = xp if xp.__name__ != "numpy" else None
        self.high = 0.0
        self.sample()

    def sample(self) -> None:
        if self.xp is not None:
            self.high = max(self.high, float(self.xp.get_default_memory_pool().total_bytes()))

    def measured(self) -> float:
        """Peak bytes: the pool's high-water mark plus the bytes outside the pool now."""
        if self.xp is None:
            return 0.0
        self.sample()
        return self.high + device_context_bytes(self.xp)

    def report(self, stage: str, predicted: float, log: Callable[[dict], None] | None = None, detail: str = "") -> dict:
        """One line `nanoeuler sft: device memory peak 9.1 GB measured, 9.4 GB predicted (0.97); micro-batch 8`
        (`detail` last), the same as a record for the stage's metrics log; nothing on the CPU."""
        if self.xp is None:
            return {}
        got = self.measured()
        rec = {
            "memory_peak_bytes": int(got),
            "memory_predicted_bytes": int(predicted),
            "memory_ratio": round(got / predicted, 3) if predicted else None,
        }
        print(
            f"nanoeuler {stage}: device memory peak {gb(got)} measured, {gb(predicted)} predicted "
            f"({rec['memory_ratio']})" + (f"; {detail}" if detail else ""),
            file=sys.stderr,
            flush=True,
        )
        if log is not None:
            log(rec)
        return rec
