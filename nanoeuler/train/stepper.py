"""One optimizer update behind one interface: micro-batches and a learning rate in, loss and gradient norm out.

    >>> stepper = make_stepper(settings, cfg, params, np)             # doctest: +SKIP
    >>> loss, grad_norm = stepper.step([(inputs, targets)], lr=3e-4)    # one (x, y) per grad_accum  # doctest: +SKIP
    >>> stepper.step(batch, lr=3e-4, head_weights=[1.0, 0.5])       # the heads' loss weights    # doctest: +SKIP
    >>> stepper.params(), stepper.state_tensors(), stepper.t            # what a checkpoint keeps   # doctest: +SKIP

`XpStepper` runs `transformer.loss_and_grads` on NumPy or CuPy, sums the gradients of the
micro-batches (each normalised by the whole step's targets), clips their global norm and applies
the optimizer (AdamW, or Muon on the hidden matrices: `settings.optimizer`); `EngineStepper` hands
the same update to the bf16 engine on the GPU. Two hooks let a stage or
a launcher change the step without forking the loop: `head_loss` replaces the loss on the final
normed state (`transformer.mtp_cross_entropy` by default; on the engine only a `model.dpo.DpoHead`,
which it runs as its DPO head), and `grad_hook(grads)` runs on the summed gradients between the
backward and the clipping (the data-parallel average goes there). A non-finite loss or gradient
norm raises `NonFinite`: before the update on the xp path, after it on the engine (which never
waits for the device inside a step); either way no checkpoint of that state is written.
"""

from __future__ import annotations

import math
from typing import Callable, Protocol, Sequence

import numpy as np

from nanoeuler.backend import array_module
from nanoeuler.errors import UserError
from nanoeuler.model import transformer
from nanoeuler.optim import AdamW, Muon, clip_grad_norm

Batch = Sequence[tuple]  # micro-batches [(inputs (B,T), targets (B,T,K)), ...], NumPy on the host
GradHook = Callable[[dict], None]  # grads {name: array}, changed in place


class NonFinite(Exception):
    """The loss or the gradient norm of a step is inf or nan."""

    def __init__(self, what: str, value: float):
        super().__init__(f"{what} is {value}")
        self.what, self.value = what, value


class Stepper(Protocol):
    t: int  # optimizer updates done (AdamW's bias correction counts them)

    def step(self, batch: Batch, lr: float, head_weights=None) -> tuple[float, float]:
        """One update from the summed gradients of the micro-batches -> (mean loss, norm before clipping).
        head_weights: the output heads' loss weights this step (None: all 1; `mtp_cross_entropy`)."""

    def params(self) -> dict:
        """The live parameters on the device (views: copy before keeping)."""

    def state_tensors(self) -> dict:
        """The optimizer's state, {"m.<name>": ..., "v.<name>": ...} (views)."""

    def load_state_tensors(self, tensors: dict, t: int) -> None:
        """Restore the optimizer's state and step count (from a checkpoint)."""


class XpStepper:
    """loss_and_grads + summing over micro-batches + grad_hook + clip_grad_norm + AdamW, on `params`' device.

    Each micro-batch's loss is normalised by the whole step's valid targets and rows
    (`transformer.step_totals`), so a batch cut into micro-batches of any sizes steps as the uncut one
    does. `checkpoint`: recompute each block's forward in the backward (`loss_and_grads`)."""

    def __init__(
        self,
        cfg,
        params: dict,
        opt: AdamW | Muon,
        max_norm: float,
        head_loss=transformer.mtp_cross_entropy,
        grad_hook: GradHook | None = None,
        checkpoint: bool = False,
    ):
        self.cfg, self._params, self.opt, self.max_norm = cfg, params, opt, float(max_norm)
        self.head_loss, self.grad_hook, self.checkpoint = head_loss, grad_hook, bool(checkpoint)
        self.xp = array_module(params["embed_tokens.weight"])

    @property
    def t(self) -> int:
        return self.opt.t

    def gradients(self, batch: Batch, head_weights=None) -> tuple[float, dict]:
        """(loss, gradients) of the step's micro-batches, summed, before any hook, clipping or update."""
        xp = self.xp
        totals = transformer.step_totals([y for _, y in batch]) if len(batch) > 1 else None
        loss, grads = 0.0, None
        for x, y in batch:
            micro_loss, g = transformer.loss_and_grads(
                self._params,
                xp.asarray(x),
                xp.asarray(y),
                self.cfg,
                head_loss=self.head_loss,
                totals=totals,
                checkpoint=self.checkpoint,
                head_weights=head_weights,
            )
            loss += micro_loss
            if grads is None:
                grads = g
            else:
                for name in grads:
                    grads[name] += g[name]
            del g
        return loss, grads

    def step(self, batch: Batch, lr: float, head_weights=None) -> tuple[float, float]:
        loss, grads = self.gradients(batch, head_weights)
        if self.grad_hook is not None:  # first: a data-parallel hook is a collective every rank must join
            self.grad_hook(grads)
        if not math.isfinite(loss):
            raise NonFinite("loss", loss)
        norm = clip_grad_norm(grads, self.max_norm)
        if not math.isfinite(norm):
            raise NonFinite("gradient norm", norm)
        self.opt.step(self._params, grads, lr)
        return loss, norm

    def params(self) -> dict:
        return self._params

    def state_tensors(self) -> dict:
        return self.opt.state_tensors()

    def load_state_tensors(self, tensors: dict, t: int) -> None:
        self.opt.load_state_tensors(tensors, t)


class EngineStepper:
    """The bf16 engine's step (`kernels.bf16.engine.TrainEngine`), for micro-batches of at most (batch, ctx_len).

    The engine is built for a fixed shape, so smaller batches (SFT: shorter sequences, an epoch's last
    batch) are padded at the end with ignored targets; causal attention keeps padding from touching the
    real tokens, and rows without targets do not change the mean loss. Several micro-batches make one
    update (the engine's `step_accum`: the loss normalised over all of them, gradients summed, one clip
    and AdamW). Without a grad_hook, or with one marked `in_graph` (it only queues GPU work, as the
    data-parallel all-reduce does), a step is replays of the engine's CUDA graphs, the hook inside them,
    once an update; with another hook, the engine's forward/backward, the hook on its gradient views, the
    norm over them and the update run one after another. A ZeRO-1 engine (sharded by `make_stepper`) takes
    no hook: its captured step reduce-scatters, updates its region and all-gathers by itself.

    With a `DpoHead` (the engine built with head "dpo") a micro-batch of p pairs is laid out as the
    engine's P = batch/2 pair slots: chosen rows at 0..p-1, rejected at P..P+p-1, the rest padding pairs
    of weight 0; every pair weighs 1 / the step's pairs. `last_logps()` gives the policy's sequence
    log-probs of the last step."""

    def __init__(self, engine, grad_hook: GradHook | None = None, head=None):
        self.engine, self.grad_hook, self.head = engine, grad_hook, head
        self._pairs: list = []  # pairs of each micro-batch of the last step (DPO)
        if grad_hook is not None and getattr(grad_hook, "in_graph", False):
            engine.set_collective(grad_hook)

    @property
    def t(self) -> int:
        return self.engine.t

    def _padded(self, x, y) -> tuple:
        eng = self.engine
        rows, cols = eng.B - x.shape[0], eng.T - x.shape[1]
        if rows or cols:
            x = np.pad(x, ((0, rows), (0, cols)))
            y = np.pad(y, ((0, rows), (0, cols), (0, 0)), constant_values=-1)
        return np.asarray(x, dtype=np.int32), np.asarray(y, dtype=np.int32)

    def _micro_batches(self, batch: Batch) -> list:
        if self.head is None:
            return [self._padded(x, y) for x, y in batch]
        half = self.engine.B // 2
        self._pairs = [x.shape[0] // 2 for x, _ in batch]
        weight = 1.0 / sum(self._pairs)
        out = []
        for (x, y), p in zip(batch, self._pairs):
            ref = np.asarray(self.head.pop(), dtype=np.float32)
            if p > half or x.shape[0] != 2 * p or ref.shape != (2 * p,):
                raise ValueError(
                    f"a DPO micro-batch of at most {half} whole pairs (chosen rows, then rejected), "
                    f"with a reference log-prob each; got {x.shape[0]} rows, {ref.shape[0]} values"
                )
            x, y = self._padded(x, y)  # pairs in slots 0..p-1: the rejected rows move to slots P..P+p-1
            order = np.r_[0:p, 2 * p : p + half, p : 2 * p, p + half : 2 * half]
            refs = np.zeros(2 * half, dtype=np.float32)
            refs[:p], refs[half : half + p] = ref[:p], ref[p:]
            out.append((x[order], y[order], refs, np.r_[np.full(p, weight), np.zeros(half - p)].astype(np.float32)))
        return out

    def step(self, batch: Batch, lr: float, head_weights=None) -> tuple[float, float]:
        eng = self.engine
        micro = self._micro_batches(batch)
        in_graph = self.grad_hook is None or eng.collective is self.grad_hook
        if len(micro) == 1 and in_graph:
            eng.step(*micro[0][:2], lr, *micro[0][2:], head_weights=head_weights)
        elif len(micro) == 1:
            eng.forward_backward(*micro[0], head_weights=head_weights)
            self.grad_hook(eng.grads())
            eng.recompute_grad_norm()
            eng.optimizer_step(lr)
        elif eng.Gacc is None:
            raise ValueError(f"this engine takes one micro-batch a step (built without accum), got {len(micro)}")
        elif in_graph:
            eng.step_accum(micro, lr, head_weights=head_weights)
        else:
            eng.accumulate(micro, head_weights=head_weights)
            self.grad_hook(eng.grads(accumulated=True))
            eng.update(lr)
        loss, norm = eng.last_loss(), eng.grad_norm()
        for what, value in (("loss", loss), ("gradient norm", norm)):
            if not math.isfinite(value):
                raise NonFinite(what, value)
        return loss, norm

    def last_logps(self) -> np.ndarray:
        """DPO: the policy's sequence log-probs of the last step's pairs, (pairs, 2), chosen in column 0."""
        got, half = self.engine.last_logps(), self.engine.B // 2
        return (
            np.concatenate([np.stack([row[:p], row[half : half + p]], axis=1) for row, p in zip(got, self._pairs)])
            if self._pairs
            else np.zeros((0, 2))
        )

    def params(self) -> dict:
        return self.engine.params()

    def state_tensors(self) -> dict:
        return self.engine.state_tensors()

    def load_state_tensors(self, tensors: dict, t: int) -> None:
        self.engine.load_state_tensors(tensors, t)


def make_stepper(
    settings, cfg, params: dict, xp, *, stage: str = "train", head_loss=None, grad_hook: GradHook | None = None
) -> Stepper:
    """The stepper that `settings.precision` asks for (a `train.config.TrainConfig`), starting from
    `params` (NumPy or `xp` arrays) with fresh optimizer state; `stage` names the config section in errors.
    A grad_hook of a ZeRO-1 run (its `zero_comm`) makes the bf16 engine a sharded one of that rank."""
    lr_scale = settings.group_lr_scale(params)
    if settings.precision != "bf16":
        device_params = {name: xp.asarray(p) for name, p in params.items()}
        adam = dict(
            betas=(settings.beta1, settings.beta2),
            eps=settings.eps,
            weight_decay=settings.weight_decay,
            lr_scale=lr_scale,
        )
        opt = (
            Muon(device_params, momentum=settings.muon_momentum, **adam)
            if settings.optimizer == "muon"
            else AdamW(device_params, **adam)
        )
        return XpStepper(
            cfg,
            device_params,
            opt,
            settings.grad_clip,
            head_loss=head_loss or transformer.mtp_cross_entropy,
            grad_hook=grad_hook,
            checkpoint=settings.checkpoint_activations,
        )
    # ZeRO-1 (`DataParallel.grad_hook`): the engine keeps its region's moments and averages the gradients
    # itself (reduce-scatter), so the hook is not called
    zero = getattr(grad_hook, "zero_comm", None)
    if zero is not None and not getattr(grad_hook, "in_graph", False):
        raise UserError(f"{stage}.zero 1: this stage's own gradient hook needs every gradient; use zero 0")
    if xp is np:
        raise UserError(
            f"{stage}.precision bf16 runs on the GPU engine; use --device gpu, or precision fp32 on the CPU"
        )
    from nanoeuler.model.dpo import DpoHead

    dpo = head_loss if isinstance(head_loss, DpoHead) else None
    if head_loss is not None and dpo is None and head_loss is not transformer.mtp_cross_entropy:
        raise UserError(
            f"{stage}.precision bf16 trains the multi-token cross-entropy or DPO only; "
            "use precision fp32 for this stage's loss"
        )
    from nanoeuler.kernels import kernel_path_options
    from nanoeuler.kernels.bf16.engine import TrainEngine

    # DPO's batch_size counts pairs: two sequences each
    head = {} if dpo is None else dict(head="dpo", dpo_beta=dpo.beta, dpo_label_smoothing=dpo.label_smoothing)
    engine = TrainEngine(
        cfg,
        params,
        batch=settings.batch_size * (2 if dpo else 1),
        seq=cfg.ctx_len,
        betas=(settings.beta1, settings.beta2),
        eps=settings.eps,
        weight_decay=settings.weight_decay,
        max_norm=settings.grad_clip,
        accum=settings.grad_accum > 1,
        optimizer=settings.optimizer,
        muon_momentum=settings.muon_momentum,
        lr_scale=lr_scale,
        checkpoint=bool(getattr(settings, "checkpoint_activations", False)),
        shards=1 if zero is None else zero.size,
        rank=0 if zero is None else zero.rank,
        **head,
        **kernel_path_options(settings.kernels),
    )
    if zero is not None:
        engine.set_zero(zero)
        grad_hook = None
    return EngineStepper(engine, grad_hook=grad_hook, head=dpo)
