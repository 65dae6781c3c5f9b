"""One optimizer update behind one interface: micro-batches and a learning rate in, loss and gradient norm out.

    >>> stepper = make_stepper(settings, cfg, params, np)             # doctest: +SKIP
    >>> loss, grad_norm = stepper.step([(inputs, targets)], lr=3e-4)    # one (x, y) per grad_accum
    >>> stepper.params(), stepper.state_tensors(), stepper.t            # what a checkpoint keeps

`XpStepper` runs `transformer.loss_and_grads` on NumPy or CuPy, averages the gradients of the
micro-batches, clips their global norm and applies AdamW; `EngineStepper` hands the same update to
the bf16 engine on the GPU. Two hooks let a stage or a launcher change the step without forking the
loop: `head_loss` replaces the loss on the final normed state (`transformer.mtp_cross_entropy` by
default; the xp path only), and `grad_hook(grads)` runs on the averaged gradients between the
backward and the clipping (a data-parallel all-reduce goes there). A non-finite loss or gradient
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
from nanoeuler.optim import AdamW, clip_grad_norm

Batch = Sequence[tuple]  # micro-batches [(inputs (B,T), targets (B,T,K)), ...], NumPy on the host
GradHook = Callable[[dict], None]  # grads {name: array}, changed in place


class NonFinite(Exception):
    """The loss or the gradient norm of a step is inf or nan."""

    def __init__(self, what: str, value: float):
        super().__init__(f"{what} is {value}")
        self.what, self.value = what, value


class Stepper(Protocol):
    t: int  # optimizer updates done (AdamW's bias correction counts them)

    def step(self, batch: Batch, lr: float) -> tuple[float, float]:
        """One update from the summed gradients of the micro-batches -> (mean loss, norm before clipping)."""

    def params(self) -> dict:
        """The live parameters on the device (views: copy before keeping)."""

    def state_tensors(self) -> dict:
        """The optimizer's state, {"m.<name>": ..., "v.<name>": ...} (views)."""

    def load_state_tensors(self, tensors: dict, t: int) -> None:
        """Restore the optimizer's state and step count (from a checkpoint)."""


class XpStepper:
    """loss_and_grads + averaging over micro-batches + grad_hook + clip_grad_norm + AdamW, on `params`' device."""

    def __init__(self, cfg, params: dict, opt: AdamW, max_norm: float,
                 head_loss=transformer.mtp_cross_entropy, grad_hook: GradHook | None = None):
        self.cfg, self._params, self.opt, self.max_norm = cfg, params, opt, float(max_norm)
        self.head_loss, self.grad_hook = head_loss, grad_hook
        self.xp = array_module(params["embed_tokens.weight"])

    @property
    def t(self) -> int:
        return self.opt.t

    def step(self, batch: Batch, lr: float) -> tuple[float, float]:
        xp, accum = self.xp, len(batch)
        loss, grads = 0.0, None
        for x, y in batch:
            micro_loss, g = transformer.loss_and_grads(self._params, xp.asarray(x), xp.asarray(y), self.cfg,
                                                       head_loss=self.head_loss)
            loss += micro_loss / accum
            if grads is None:
                grads = g
            else:
                for name in grads:
                    grads[name] += g[name]
        if accum > 1:
            for name in grads:
                grads[name] *= 1.0 / accum
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
    """The bf16 engine's step (`nanoeuler.kernels.engine.Engine`), for batches of at most (batch, ctx_len).

    The engine is built for a fixed shape, so smaller batches (SFT: shorter sequences, an epoch's last
    batch) are padded at the end with ignored targets; causal attention keeps padding from touching the
    real tokens, and rows without targets do not change the mean loss. Without a grad_hook, or with one
    marked `in_graph` (it only queues GPU work, as the data-parallel all-reduce does), a step is one replay
    of the engine's CUDA graph, the hook inside it; with another hook, the engine's forward/backward, the
    hook on its gradient views, the norm over them and the update run one after another."""

    def __init__(self, engine, grad_hook: GradHook | None = None):
        self.engine, self.grad_hook = engine, grad_hook
        if grad_hook is not None and getattr(grad_hook, "in_graph", False):
            engine.set_collective(grad_hook)

    @property
    def t(self) -> int:
        return self.engine.t

    def step(self, batch: Batch, lr: float) -> tuple[float, float]:
        if len(batch) != 1:
            raise ValueError(f"the bf16 engine takes one micro-batch a step, got {len(batch)}")
        x, y = batch[0]
        eng = self.engine
        rows, cols = eng.B - x.shape[0], eng.T - x.shape[1]
        if rows or cols:
            x = np.pad(x, ((0, rows), (0, cols)))
            y = np.pad(y, ((0, rows), (0, cols), (0, 0)), constant_values=-1)
        x, y = np.asarray(x, dtype=np.int32), np.asarray(y, dtype=np.int32)
        if self.grad_hook is None or eng.collective is self.grad_hook:
            eng.step(x, y, lr)
        else:
            eng.forward_backward(x, y)
            self.grad_hook(eng.grads())
            eng.recompute_grad_norm()
            eng.optimizer_step(lr)
        loss, norm = eng.last_loss(), eng.grad_norm()
        for what, value in (("loss", loss), ("gradient norm", norm)):
            if not math.isfinite(value):
                raise NonFinite(what, value)
        return loss, norm

    def params(self) -> dict:
        return self.engine.params()

    def state_tensors(self) -> dict:
        return self.engine.state_tensors()

    def load_state_tensors(self, tensors: dict, t: int) -> None:
        self.engine.load_state_tensors(tensors, t)


def make_stepper(settings, cfg, params: dict, xp, *, stage: str = "train", head_loss=None,
                 grad_hook: GradHook | None = None) -> Stepper:
    """The stepper that `settings.precision` asks for (a `train.config.TrainConfig`), starting from
    `params` (NumPy or `xp` arrays) with fresh optimizer state; `stage` names the config section in errors."""
    if settings.precision != "bf16":
        device_params = {name: xp.asarray(p) for name, p in params.items()}
        opt = AdamW(device_params, betas=(settings.beta1, settings.beta2), eps=settings.eps,
                    weight_decay=settings.weight_decay)
        return XpStepper(cfg, device_params, opt, settings.grad_clip,
                         head_loss=head_loss or transformer.mtp_cross_entropy, grad_hook=grad_hook)
    if xp is np:
        raise UserError(f"{stage}.precision bf16 runs on the GPU engine; use --device gpu, "
                        "or precision fp32 on the CPU")
    if settings.grad_accum != 1:
        raise UserError(f"{stage}.precision bf16 takes grad_accum 1 (got {settings.grad_accum}); "
                        "raise batch_size instead")
    if head_loss is not None and head_loss is not transformer.mtp_cross_entropy:
        raise UserError(f"{stage}.precision bf16 trains the multi-token cross-entropy only; "
                        "use precision fp32 for this stage's loss")
    from nanoeuler.kernels import kernel_path_options
    from nanoeuler.kernels.engine import Engine

    engine = Engine(cfg, params, batch=settings.batch_size, seq=cfg.ctx_len, betas=(settings.beta1, settings.beta2),
                    eps=settings.eps, weight_decay=settings.weight_decay, max_norm=settings.grad_clip,
                    **kernel_path_options(settings.kernels))
    return EngineStepper(engine, grad_hook=grad_hook)
