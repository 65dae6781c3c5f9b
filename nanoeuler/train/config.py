"""A training stage's settings as typed data, built from its validated config section.

    >>> from nanoeuler.config import validate
    >>> s = PretrainConfig.from_section(validate({"pretrain": {"lr": 1e-3}})["pretrain"])
    >>> s.lr, s.batch_size, s.precision, s.steps
    (0.001, 32, 'fp32', 20000)

`TrainConfig` holds what the shared loop and the stepper read (optimizer, schedule, logging), so every
training stage's schema section carries these keys; `PretrainConfig` and `SftConfig` add their own.
Defaults and descriptions live in the schema (`workflow/schemas/config.schema.yaml`), which has already
checked every value's type and range, so `from_section` only picks the fields and fixes their types.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainConfig:
    lr: float
    min_lr: float
    warmup_steps: int
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    precision: str  # "fp32": the xp layers; "bf16": the GPU engine
    grad_clip: float  # <= 0: no clipping
    batch_size: int
    grad_accum: int
    seed: int
    log_every: int
    eval_every: int
    checkpoint_every: int
    keep_checkpoints: int
    kernels: str = "auto"  # the bf16 engine's kernel path: "auto" or "portable" (kernels.kernel_path_options)
    checkpoint_activations: bool = False  # recompute each block's forward in the backward (less memory)
    optimizer: str = "adamw"  # "adamw" | "muon" (Muon on the hidden matrices, AdamW on the rest)
    muon_lr: float = 0.006  # the hidden matrices' peak lr under Muon
    muon_momentum: float = 0.95
    schedule: str = "cosine"  # "cosine" | "wsd" (optim.lr_at)
    cooldown_frac: float = 0.2  # wsd: the last fraction of the steps, a linear decay
    lr_scale: dict = dataclasses.field(default_factory=dict)  # {group: multiple of the scheduled lr}
    mtp_weights: list | None = None  # the output heads' loss weights at the first step (None: all 1)
    mtp_weights_end: list | None = None  # at the last step, reached linearly (None: mtp_weights throughout)

    def group_lr_scale(self, names) -> dict:
        """{name: multiple of the scheduled lr}: `lr_scale` by group, and under Muon the hidden matrices'
        muon_lr / lr (optim.param_group names the groups).

            >>> from nanoeuler.config import validate
            >>> s = TrainConfig.from_section(validate({"pretrain": {"optimizer": "muon", "lr": 1e-3,
            ...     "muon_lr": 4e-3, "lr_scale": {"embed": 2.0}}})["pretrain"])
            >>> s.group_lr_scale(["embed_tokens.weight", "layers.0.mlp.up_proj.weight", "norm.weight"])
            {'embed_tokens.weight': 2.0, 'layers.0.mlp.up_proj.weight': 4.0, 'norm.weight': 1.0}
        """
        from nanoeuler.optim import group_lr_scale

        scales = dict(self.lr_scale)
        if self.optimizer == "muon":
            scales["hidden"] = scales.get("hidden", 1.0) * self.muon_lr / self.lr
        return group_lr_scale(names, scales)

    def head_weight_schedule(self, heads: int, stage: str):
        """fn(step, total_steps) -> the `heads` output heads' loss weights at 0-based step
        (`optim.head_weights_at`), or None when neither mtp_weights key is set (the plain mean of the heads).
        A list of another length, or one with no positive weight, is an error naming its key.

            >>> from nanoeuler.config import validate
            >>> s = TrainConfig.from_section(validate({"pretrain": {"mtp_weights_end": [1, 0]}})["pretrain"])
            >>> s.head_weight_schedule(2, "pretrain")(50, 101)
            [1.0, 0.5]
        """
        from nanoeuler.errors import UserError
        from nanoeuler.optim import head_weights_at

        if self.mtp_weights is None and self.mtp_weights_end is None:
            return None
        start = [1.0] * heads if self.mtp_weights is None else list(self.mtp_weights)
        for key, weights in (("mtp_weights", start), ("mtp_weights_end", self.mtp_weights_end or start)):
            if len(weights) != heads:
                raise UserError(
                    f"{stage}.{key} has {len(weights)} weights, but the model has {heads} output "
                    "heads (model.mtp_heads)"
                )
            if not any(w > 0 for w in weights):
                raise UserError(f"{stage}.{key} must give at least one output head a positive weight")
        return lambda step, total_steps: head_weights_at(step, total_steps, start, self.mtp_weights_end)

    @classmethod
    def from_section(cls, section: dict):
        """The fields of `cls` from a validated section (keys of other stages' fields are left out)."""
        kinds = {"int": int, "float": float, "str": str, "bool": bool}
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        fields = [f for f in dataclasses.fields(cls) if f.name in section or f.name in required]
        return cls(**{f.name: kinds.get(f.type, lambda v: v)(section[f.name]) for f in fields})


@dataclass(frozen=True, kw_only=True)
class PretrainConfig(TrainConfig):
    steps: int
    val_tokens: int
    zero_init_out: bool = False  # o_proj and down_proj start at zero


@dataclass(frozen=True, kw_only=True)
class SftConfig(TrainConfig):
    epochs: int
    too_long: str  # "truncate" | "drop"
    max_examples: int  # 0: all
    val_examples: int
