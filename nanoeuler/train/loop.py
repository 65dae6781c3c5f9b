"""The one training loop, shared by every training stage: batches in, checkpoints and metrics out.

    >>> last = train(Run(stage="pretrain", cfg=cfg, section=sec, total_steps=1000, ...))   # doctest: +SKIP

Each update is one `Stepper.step` (`train.stepper`: the xp layers or the bf16 engine). A run lives in a
directory of rotating checkpoints `ckpt_{step:08d}.bin` and `metrics.jsonl`; a new start resumes from
the newest checkpoint that loads, if it holds the same model config and tokenizer and the same
settings (`run_identity`); else the run dir belongs to another model or run, and its files move to
`previous/` with a notice. One that does not load is renamed `*.corrupt` and the one before it is tried.
A checkpoint holds the parameters, the optimizer state and the data source's state, so a resumed CPU
run repeats the losses of an uninterrupted one bit for bit; metrics logged after its step are logged
again. Step s counts finished updates (1-based) and trains at `lr_at(s - 1)` (and with the heads' loss
weights of step s - 1). A non-finite loss or gradient norm stops the run naming the step, before any
checkpoint of that state is written.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from nanoeuler.backend import to_numpy
from nanoeuler.errors import UserError
from nanoeuler.train import rundir
from nanoeuler.train.config import TrainConfig
from nanoeuler.train.stepper import NonFinite, make_stepper

# Training-section keys that change what is logged or kept, not the trajectory (`kernels` computes the
# same step with other kernels, so a run can resume on another GPU; `checkpoint_activations` the same
# step with less memory). (sft.val_examples is not one of them: the held-out records are not trained on.)
COSMETIC_KEYS = (
    "log_every",
    "eval_every",
    "checkpoint_every",
    "keep_checkpoints",
    "val_tokens",
    "kernels",
    "checkpoint_activations",
)
# How many processes train, and whether they shard the optimizer state (ZeRO-1 computes the same update):
# not settings of the trajectory itself; the global batch enters the identity (`run_identity`).
LAUNCH_KEYS = ("gpus", "zero")


class Batches(Protocol):
    def batch(self, step: int, micro: int) -> tuple[np.ndarray, np.ndarray]:
        """inputs (B,T) and targets (B,T,K) of micro-batch `micro` of 0-based update `step` (NumPy, host)."""

    def state(self) -> dict: ...

    def load_state(self, state: dict) -> None: ...


@dataclass
class Run:
    stage: str  # "pretrain" | "sft": names the run in messages and checkpoints
    cfg: object  # ModelConfig
    section: dict  # the validated training section (typed: `settings`); minus COSMETIC_KEYS, the run's identity
    total_steps: int
    batches: Batches
    init_params: Callable[[], dict]  # NumPy params when no checkpoint resumes
    tokenizer_json: str
    tokenizer_sha256: str
    run_dir: Path
    out: Path  # the final model (checkpoint.save_model)
    xp: object
    evaluate: Callable[[dict], dict] | None = None  # device params -> {"val_loss": ..., ...}
    identity: dict = field(default_factory=dict)  # data identity (manifest, base model ...)
    extra_out: dict = field(default_factory=dict)  # more metadata for the final model
    progress: bool = True
    # Checkpoints of another model config or tokenizer: set aside like other settings, or an error.
    foreign_model_is_error: bool = False
    head_loss: Callable | None = None  # the loss on the final normed state (None: transformer.mtp_cross_entropy)
    grad_hook: Callable[[dict], None] | None = None  # on the gradients between backward and clipping
    # One rank of a data-parallel run (`train.parallel.DataParallel`): the gradients and the loss are averaged
    # over the ranks, and rank 0 alone reads and writes the run directory. None: a single process.
    parallel: object | None = None
    # Rows a micro-batch may hold to fit the device (`memory.fit_rows`; 0: batch_size as configured): each
    # of the grad_accum batches is cut by `split` (default `memory.split_rows`) into pieces of at most this
    # many rows, which step exactly as the uncut batch does.
    micro_rows: int = 0
    split: Callable[[list, int], list] | None = None
    predicted_peak: float = 0.0  # bytes (`memory.peak`), logged beside the measured peak at the end

    def __post_init__(self):
        self.settings = TrainConfig.from_section(self.section)

    @property
    def step_settings(self) -> TrainConfig:
        """The settings the stepper is built with: micro-batches of `micro_rows`, as many as a step needs."""
        s = self.settings
        if not self.micro_rows or self.micro_rows >= s.batch_size:
            return s
        return replace(s, batch_size=self.micro_rows, grad_accum=s.grad_accum * -(-s.batch_size // self.micro_rows))

    def micro_batches(self, step0: int) -> list:
        """The micro-batches of 0-based update `step0`: the loader's grad_accum batches, cut to `micro_rows`."""
        from nanoeuler.memory import split_rows

        batch = [self.batches.batch(step0, micro) for micro in range(self.settings.grad_accum)]
        if not self.micro_rows or self.micro_rows >= self.settings.batch_size:
            return batch
        return (self.split or split_rows)(batch, self.micro_rows)


def run_identity(run: Run) -> dict:
    settings = {k: v for k, v in sorted(run.section.items()) if k not in COSMETIC_KEYS + LAUNCH_KEYS}
    ident = {"stage": run.stage, "settings": settings, "total_steps": run.total_steps, **run.identity}
    world = 1 if run.parallel is None else run.parallel.size
    if world > 1:  # N ranks of batch B train on the windows of one process of N*B: that is the batch
        settings["batch_size"] = settings["batch_size"] * world
        if run.stage != "pretrain":  # elsewhere each rank's mean counts alike: the world size weighs examples
            ident["world_size"] = world
    return ident


def _warn(stage: str, msg: str) -> None:
    rundir.warn(stage, msg)


def _find_resume(run: Run) -> tuple[dict, dict] | None:
    """(tensors, metadata) of the newest usable checkpoint, or None to start fresh."""
    from nanoeuler import checkpoint

    want_cfg = run.cfg.to_dict()
    want_id = run_identity(run)
    for step, path in rundir.list_checkpoints(run.run_dir):
        try:
            tensors, meta = checkpoint.load(path)
        except UserError as exc:
            moved = rundir.set_aside_corrupt(path)
            _warn(
                run.stage,
                f"checkpoint {path} is unusable ({exc}); renamed it to {moved.name}, "
                "falling back to the previous checkpoint",
            )
            continue
        change = rundir.model_change(meta, want_cfg, run.tokenizer_sha256)
        if change and not run.foreign_model_is_error:
            prev = rundir.set_aside_all(run.run_dir)
            _warn(
                run.stage,
                f"checkpoints in {run.run_dir} belong to another model or tokenizer ({change}); "
                f"moved them to {prev} and starting a fresh run",
            )
            return None
        if meta.get("model_config") != want_cfg:
            diff = _dict_diff(meta.get("model_config") or {}, want_cfg)
            raise UserError(
                f"checkpoint {path} was written for a different model config ({diff}); "
                f"delete {run.run_dir} to start this model from scratch"
            )
        if meta.get("tokenizer_sha256") != run.tokenizer_sha256:
            raise UserError(
                f"checkpoint {path} was trained with a different tokenizer (sha256 "
                f"{str(meta.get('tokenizer_sha256'))[:12]}… != {run.tokenizer_sha256[:12]}…); "
                f"delete {run.run_dir} to start over with the new tokenizer"
            )
        if meta.get("identity") != want_id:
            diff = _dict_diff(_flat(meta.get("identity") or {}), _flat(want_id))
            prev = rundir.set_aside_all(run.run_dir)
            _warn(
                run.stage,
                f"checkpoints in {run.run_dir} come from other settings ({diff}); "
                f"moved them to {prev} and starting a fresh run",
            )
            return None
        return tensors, meta
    return None


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _dict_diff(old: dict, new: dict) -> str:
    keys = sorted(set(old) | set(new))
    parts = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]
    return ", ".join(parts[:4]) + (", …" if len(parts) > 4 else "") or "no visible difference"


def _save_checkpoint(run: Run, stepper, step: int) -> Path:
    from nanoeuler import checkpoint

    tensors = {name: to_numpy(p) for name, p in stepper.params().items()}
    for name, t in stepper.state_tensors().items():
        tensors[f"optim.{name}"] = to_numpy(t)
    meta = {
        "stage": run.stage,
        "model_config": run.cfg.to_dict(),
        "step": step,
        "optim_t": stepper.t,
        "loader": run.batches.state(),
        "identity": run_identity(run),
        "tokenizer": run.tokenizer_json,
        "tokenizer_sha256": run.tokenizer_sha256,
    }
    path = rundir.checkpoint_path(run.run_dir, step)
    checkpoint.save(path, tensors, meta)
    rundir.rotate(run.run_dir, run.settings.keep_checkpoints)
    return path


def _find_resume_on_every_rank(run: Run) -> tuple[dict, dict] | None:
    """`_find_resume` on rank 0 (it may move files); the other ranks load the checkpoint it chose."""
    dp = run.parallel
    if dp is None:
        return _find_resume(run)
    from nanoeuler import checkpoint

    resumed = _find_resume(run) if dp.is_root else None
    step = dp.broadcast_int(int(resumed[1]["step"]) if resumed else -1)
    if dp.is_root or step < 0:
        return resumed
    return checkpoint.load(rundir.checkpoint_path(run.run_dir, step))


def _make_stepper(run: Run, params: dict):
    dp = run.parallel
    hook = run.grad_hook if dp is None else dp.grad_hook(then=run.grad_hook)
    stepper = make_stepper(
        run.step_settings, run.cfg, params, run.xp, stage=run.stage, head_loss=run.head_loss, grad_hook=hook
    )
    return stepper if dp is None else dp.wrap(stepper)


def _start(run: Run):
    """(stepper, first 0-based step): from the newest usable checkpoint, else from `run.init_params`."""
    resumed = _find_resume_on_every_rank(run)
    if resumed is None:
        return _make_stepper(run, run.init_params()), 0
    tensors, meta = resumed
    params = {name: tensors[name] for name in run.cfg.param_shapes()}
    stepper = _make_stepper(run, params)
    stepper.load_state_tensors(
        {k[len("optim.") :]: v for k, v in tensors.items() if k.startswith("optim.")}, int(meta["optim_t"])
    )
    run.batches.load_state(meta["loader"])
    start = int(meta["step"])
    if run.parallel is None or run.parallel.is_root:
        print(
            f"nanoeuler {run.stage}: resuming from step {start} ({rundir.checkpoint_path(run.run_dir, start)})",
            file=sys.stderr,
            flush=True,
        )
    return stepper, start


def train(run: Run) -> dict:
    """Train to `run.total_steps` (resuming when possible), then write `run.out`. Returns the last metrics.

    The process that writes the run directory holds it for the whole run (`rundir.writer_lock`)."""
    if run.parallel is not None and not run.parallel.is_root:
        return _train(run)
    with rundir.writer_lock(run.run_dir, run.stage):
        return _train(run)


def _train(run: Run) -> dict:
    from nanoeuler.backend import oom_guard
    from nanoeuler.memory import PeakMeter
    from nanoeuler.optim import lr_at

    s = run.settings
    root = run.parallel is None or run.parallel.is_root  # the one process that writes the run directory
    world = 1 if run.parallel is None else run.parallel.size
    if root:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        rundir.remove_stale_temporaries(run.run_dir)
    log = rundir.MetricsLog(run.run_dir / "metrics.jsonl")
    meter = PeakMeter(run.xp)
    head_weights = s.head_weight_schedule(run.cfg.mtp_heads, run.stage)  # None: the heads' plain mean
    stepper, start = _start(run)
    if root:
        log.truncate_after(start)
    last: dict = {}
    last_ckpt = None
    bar = _progress_bar(run, start) if root else None
    tokens_since, t_since = 0, time.perf_counter()
    try:
        with oom_guard(run.step_settings.batch_size, run.cfg.ctx_len):  # a GPU OOM becomes one clear line
            for step0 in range(start, run.total_steps):
                step, final = step0 + 1, step0 + 1 == run.total_steps
                lr = lr_at(
                    step0,
                    max_lr=s.lr,
                    min_lr=s.min_lr,
                    warmup_steps=s.warmup_steps,
                    total_steps=run.total_steps,
                    schedule=s.schedule,
                    cooldown_frac=s.cooldown_frac,
                )
                batch = run.micro_batches(step0)
                heads = head_weights(step0, run.total_steps) if head_weights else None
                try:
                    loss, norm = stepper.step(batch, lr, head_weights=heads)
                except NonFinite as exc:
                    _stop_nonfinite(run, exc.what, exc.value, step)
                tokens_since += world * sum(x.size for x, _ in batch)  # each rank as many (SFT: about)
                if root and (step % s.log_every == 0 or final):
                    now = time.perf_counter()
                    rate = tokens_since / max(now - t_since, 1e-9)
                    last = {"step": step, "loss": float(loss), "lr": lr, "grad_norm": norm, "tokens_per_s": rate}
                    log.append(last)
                    if bar is not None:
                        bar.set_postfix_str(f"loss {loss:.4f} lr {lr:.2e} {rate:,.0f} tok/s", refresh=False)
                    tokens_since, t_since = 0, now
                t0 = time.perf_counter()
                if root and run.evaluate is not None and (step % s.eval_every == 0 or final):
                    val = run.evaluate(stepper.params())
                    log.append({"step": step, **val})
                    last = {**last, **val}
                if root and (step % s.checkpoint_every == 0 or final):
                    last_ckpt = _save_checkpoint(run, stepper, step)
                elif step % s.checkpoint_every == 0 or final:
                    stepper.state_tensors()  # a sharded optimizer gathers its state: every rank joins rank 0's
                t_since += time.perf_counter() - t0  # keep evaluation and checkpoints out of tokens/s
                meter.sample()
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    if run.parallel is not None and not run.parallel.is_root:
        return last  # rank 0 writes the final model
    if start < run.total_steps:  # measured on a run that trained here
        meter.report(
            run.stage,
            run.predicted_peak,
            lambda rec: log.append({"step": run.total_steps, **rec}),
            f"micro-batch {run.step_settings.batch_size}",
        )
    return _finish(run, stepper, last or _last_record(log), last_ckpt)


def _progress_bar(run: Run, start: int):
    if not run.progress:
        return None
    from tqdm import tqdm

    return tqdm(
        total=run.total_steps,
        initial=start,
        desc=run.stage,
        unit="step",
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5 if sys.stderr.isatty() else 10.0,
    )


def _finish(run: Run, stepper, last: dict, last_ckpt: Path | None) -> dict:
    """The final model file (parameters, config, tokenizer, the last metrics), and a line saying so.
    `last` is read back from the metrics log when the run had finished before and only the file is missing."""
    from nanoeuler import checkpoint

    checkpoint.save_model(
        run.out,
        {n: to_numpy(p) for n, p in stepper.params().items()},
        run.cfg,
        step=run.total_steps,
        tokenizer_json=run.tokenizer_json,
        extra={"stage": run.stage, "final_metrics": last, **run.extra_out},
    )
    if last_ckpt is None:
        last_ckpt = rundir.checkpoint_path(run.run_dir, run.total_steps)
    print(
        f"nanoeuler {run.stage}: wrote {run.out} after {run.total_steps} steps (last checkpoint {last_ckpt})",
        file=sys.stderr,
        flush=True,
    )
    return last


def _last_record(log: rundir.MetricsLog) -> dict:
    merged: dict = {}
    for rec in log.read():
        merged.update(rec)
    return merged


def _stop_nonfinite(run: Run, what: str, value: float, step: int):
    ckpts = rundir.list_checkpoints(run.run_dir)
    keep = f"the last good checkpoint is {ckpts[0][1]}" if ckpts else "no checkpoint was written yet"
    raise UserError(
        f"{what} is {value} at step {step}; stopping ({keep}). "
        f"try a lower {run.stage}.lr, or a {run.stage}.grad_clip > 0"
    )
