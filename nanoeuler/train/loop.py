"""The one training loop, shared by pretraining and SFT: batches in, checkpoints and metrics out.

A run lives in a directory (`results/pretrain/`, `results/sft/`) holding rotating checkpoints
`ckpt_{step:08d}.bin` and `metrics.jsonl`. Starting a run first looks for the newest checkpoint
that loads:

- it must hold the same model config and tokenizer, else the run stops with an error (the run dir
  belongs to another model; delete it to start over). SFT instead sets such checkpoints aside like
  the next case, since a new base model starts a new fine-tuning run anyway;
- it must come from the same run settings (`Run.identity`: the training section minus the keys
  that only affect logging, plus the data), else it belongs to an earlier run with other settings:
  its files move to `previous/` and training starts fresh;
- a checkpoint that does not load (truncated, bad checksum) is renamed `*.corrupt` with a warning
  and the one before it is tried.

The checkpoint stores parameters, AdamW moments and step count, and the batch source's state (the
data generator's `bit_generator.state`), so a resumed CPU run computes the same losses, bit for bit,
as one that was never interrupted. Metrics lines logged after the checkpoint's step are dropped on
resume and logged again.

Step `s` in metrics and checkpoint names counts finished optimizer updates (1-based); the learning
rate of update s is `lr_at(s - 1, ...)`.

A non-finite loss or gradient norm stops the run with an error naming the step; no checkpoint is
written from that state, so the last good one stays the newest.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from nanoeuler.backend import to_numpy
from nanoeuler.errors import UserError
from nanoeuler.train import rundir

# Training-section keys that change what is logged or kept, not the trajectory. (sft.val_examples is
# not one of them: the held-out records are not trained on.)
COSMETIC_KEYS = ("log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "val_tokens")


class Batches(Protocol):
    def batch(self, step: int, micro: int) -> tuple[np.ndarray, np.ndarray]:
        """inputs (B,T) and targets (B,T,K) of micro-batch `micro` of 0-based update `step` (NumPy, host)."""

    def state(self) -> dict: ...

    def load_state(self, state: dict) -> None: ...


@dataclass
class Run:
    stage: str  # "pretrain" | "sft": names the run in messages and checkpoints
    cfg: object  # ModelConfig
    section: dict  # the training section: optimizer and schedule keys, see the schema
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
    # Checkpoints of another model config or tokenizer: an error (pretraining: the run dir belongs to
    # another model), or set aside like other settings (SFT: a new base model means a new run anyway).
    foreign_model_is_error: bool = True
    head_loss: Callable | None = None  # the loss on the final normed state (None: transformer.mtp_cross_entropy)


def run_identity(run: Run) -> dict:
    settings = {k: v for k, v in sorted(run.section.items()) if k not in COSMETIC_KEYS}
    return {"stage": run.stage, "settings": settings, "total_steps": run.total_steps, **run.identity}


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
            _warn(run.stage, f"checkpoint {path} is unusable ({exc}); renamed it to {moved.name}, "
                             "falling back to the previous checkpoint")
            continue
        if not run.foreign_model_is_error and (
                meta.get("model_config") != want_cfg or meta.get("tokenizer_sha256") != run.tokenizer_sha256):
            prev = rundir.set_aside_all(run.run_dir)
            _warn(run.stage, f"checkpoints in {run.run_dir} belong to another model or tokenizer; "
                             f"moved them to {prev} and starting a fresh run")
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
            _warn(run.stage, f"checkpoints in {run.run_dir} come from other settings ({diff}); "
                             f"moved them to {prev} and starting a fresh run")
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


def _save_checkpoint(run: Run, params: dict, opt, step: int) -> Path:
    from nanoeuler import checkpoint

    tensors = {name: to_numpy(p) for name, p in params.items()}
    for name, t in opt.state_tensors().items():
        tensors[f"optim.{name}"] = to_numpy(t)
    meta = {
        "stage": run.stage,
        "model_config": run.cfg.to_dict(),
        "step": step,
        "optim_t": opt.t,
        "loader": run.batches.state(),
        "identity": run_identity(run),
        "tokenizer": run.tokenizer_json,
        "tokenizer_sha256": run.tokenizer_sha256,
    }
    path = rundir.checkpoint_path(run.run_dir, step)
    checkpoint.save(path, tensors, meta)
    rundir.rotate(run.run_dir, int(run.section["keep_checkpoints"]))
    return path


def train(run: Run) -> dict:
    """Train to `run.total_steps` (resuming when possible), then write `run.out`. Returns the last metrics."""
    from nanoeuler import checkpoint
    from nanoeuler.model import transformer
    from nanoeuler.backend import oom_guard
    from nanoeuler.optim import AdamW, clip_grad_norm, lr_at

    xp, sec, cfg = run.xp, run.section, run.cfg
    run.run_dir.mkdir(parents=True, exist_ok=True)
    rundir.remove_stale_temporaries(run.run_dir)
    log = rundir.MetricsLog(run.run_dir / "metrics.jsonl")

    resumed = _find_resume(run)
    if resumed is None:
        host_params = run.init_params()
        start = 0
    else:
        tensors, meta = resumed
        host_params = {name: tensors[name] for name in cfg.param_shapes()}
        start = int(meta["step"])
    params = {name: xp.asarray(p) for name, p in host_params.items()}
    del host_params
    opt = AdamW(params, betas=(sec["beta1"], sec["beta2"]), eps=sec["eps"], weight_decay=sec["weight_decay"])
    if resumed is not None:
        opt.load_state_tensors({k[len("optim."):]: v for k, v in tensors.items() if k.startswith("optim.")},
                               int(meta["optim_t"]))
        run.batches.load_state(meta["loader"])
        del tensors
        print(f"nanoeuler {run.stage}: resuming from step {start} ({rundir.checkpoint_path(run.run_dir, start)})",
              file=sys.stderr, flush=True)
    log.truncate_after(start)
    engine = _bf16_engine(run, params, opt)
    if engine is not None:
        params = engine.share_state(opt)  # the loop's params and AdamW moments become views of the engine's

    def schedule(step0: int) -> float:
        return lr_at(step0, max_lr=sec["lr"], min_lr=sec["min_lr"], warmup_steps=sec["warmup_steps"],
                     total_steps=run.total_steps)

    last: dict = {}
    last_ckpt = None
    bar = None
    if run.progress:
        from tqdm import tqdm

        bar = tqdm(total=run.total_steps, initial=start, desc=run.stage, unit="step", file=sys.stderr,
                   dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 10.0)
    tokens_since, t_since = 0, time.perf_counter()
    try:
        with oom_guard(int(sec["batch_size"]), cfg.ctx_len):  # a GPU OOM becomes one clear line
            for step0 in range(start, run.total_steps):
                step = step0 + 1
                lr = schedule(step0)
                loss, norm, n_tokens = _update(run, params, opt, step0, lr, transformer.loss_and_grads, clip_grad_norm,
                                                  engine)
                tokens_since += n_tokens

                final = step == run.total_steps
                if step % int(sec["log_every"]) == 0 or final:
                    now = time.perf_counter()
                    rate = tokens_since / max(now - t_since, 1e-9)
                    last = {"step": step, "loss": float(loss), "lr": lr, "grad_norm": norm, "tokens_per_s": rate}
                    log.append(last)
                    if bar is not None:
                        bar.set_postfix_str(f"loss {loss:.4f} lr {lr:.2e} {rate:,.0f} tok/s", refresh=False)
                    tokens_since, t_since = 0, now
                if run.evaluate is not None and (step % int(sec["eval_every"]) == 0 or final):
                    t0 = time.perf_counter()
                    val = run.evaluate(params)
                    log.append({"step": step, **val})
                    last = {**last, **val}
                    t_since += time.perf_counter() - t0  # keep evaluation out of tokens/s
                if step % int(sec["checkpoint_every"]) == 0 or final:
                    t0 = time.perf_counter()
                    last_ckpt = _save_checkpoint(run, params, opt, step)
                    t_since += time.perf_counter() - t0
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()

    if not last:  # nothing left to train: the run finished before, only the final file is missing
        last = _last_record(log)
    checkpoint.save_model(
        run.out, {n: to_numpy(p) for n, p in params.items()}, cfg, step=run.total_steps,
        tokenizer_json=run.tokenizer_json,
        extra={"stage": run.stage, "final_metrics": last, **run.extra_out},
    )
    if last_ckpt is None:
        last_ckpt = rundir.checkpoint_path(run.run_dir, run.total_steps)
    print(f"nanoeuler {run.stage}: wrote {run.out} after {run.total_steps} steps "
          f"(last checkpoint {last_ckpt})", file=sys.stderr, flush=True)
    return last


def _bf16_engine(run: Run, params: dict, opt):
    """The GPU's bf16 training-step engine for `precision: bf16`, else None (the fp32 xp path).

    The engine keeps fp32 master weights and AdamW moments in its own flat buffers, seeded from `params`
    and `opt` (fresh or restored from a checkpoint); the caller then shares them with the loop."""
    sec = run.section
    if sec.get("precision", "fp32") != "bf16":
        return None
    if run.xp is np:
        raise UserError(f"{run.stage}.precision bf16 runs on the GPU engine; use --device gpu, "
                        "or precision fp32 on the CPU")
    if int(sec["grad_accum"]) != 1:
        raise UserError(f"{run.stage}.precision bf16 takes grad_accum 1 (got {sec['grad_accum']}); "
                        "raise batch_size instead")
    from nanoeuler.kernels.engine import Engine

    return Engine.from_adamw(run.cfg, params, opt, batch=int(sec["batch_size"]), seq=run.cfg.ctx_len,
                             max_norm=float(sec["grad_clip"]))


def _engine_update(run: Run, engine, opt, step0: int, lr: float):
    """One bf16 engine step. The engine is built for a fixed (batch_size, ctx_len), so smaller batches (SFT:
    shorter sequences, an epoch's last batch) are padded at the end with ignored targets; causal attention keeps
    padding from touching the real tokens, and rows without targets do not change the mean loss.
    The update is applied before the loss is read (no host sync inside the step); a non-finite loss still
    stops the run before any checkpoint of the bad state is written."""
    x, y = run.batches.batch(step0, 0)
    n_tokens = x.size
    rows, cols = int(run.section["batch_size"]) - x.shape[0], run.cfg.ctx_len - x.shape[1]
    if rows or cols:
        x = np.pad(x, ((0, rows), (0, cols)))
        y = np.pad(y, ((0, rows), (0, cols), (0, 0)), constant_values=-1)
    xp = run.xp
    engine.step(xp.asarray(x, dtype=np.int32), xp.asarray(y, dtype=np.int32), lr)
    opt.t = engine.t
    loss, norm = engine.last_loss(), engine.grad_norm()
    for what, value in (("loss", loss), ("gradient norm", norm)):
        if not math.isfinite(value):
            _stop_nonfinite(run, what, value, step0 + 1)
    return loss, norm, n_tokens


def _update(run: Run, params: dict, opt, step0: int, lr: float, loss_and_grads, clip_grad_norm, engine=None):
    """One optimizer update (gradients summed over grad_accum micro-batches) -> (loss, grad norm, tokens).

    Everything stays on the params' device; the loss and the norm come back as Python floats, checked
    before the update so a non-finite value never reaches the parameters.
    """
    if engine is not None:
        return _engine_update(run, engine, opt, step0, lr)
    xp, accum, step = run.xp, int(run.section["grad_accum"]), step0 + 1
    loss, grads, n_tokens = 0.0, None, 0
    for micro in range(accum):
        x, y = run.batches.batch(step0, micro)
        n_tokens += x.size
        micro_loss, g = loss_and_grads(params, xp.asarray(x), xp.asarray(y), run.cfg,
                                       **({"head_loss": run.head_loss} if run.head_loss else {}))
        loss += micro_loss / accum
        if grads is None:
            grads = g
        else:
            for name in grads:
                grads[name] += g[name]
    if accum > 1:
        for name in grads:
            grads[name] *= 1.0 / accum
    if not math.isfinite(loss):
        _stop_nonfinite(run, "loss", loss, step)
    norm = clip_grad_norm(grads, float(run.section["grad_clip"]))
    if not math.isfinite(norm):
        _stop_nonfinite(run, "gradient norm", norm, step)
    opt.step(params, grads, lr)
    return loss, norm, n_tokens


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
