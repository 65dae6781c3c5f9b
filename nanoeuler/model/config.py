"""The transformer's shape as plain data.

    >>> cfg = ModelConfig.named("small")
    >>> cfg.head_dim, cfg.hidden, cfg.n_params()
    (32, 341, 1049216)

A config is frozen and hashable; `to_dict`/`from_dict` round-trip it through JSON (checkpoints
store it in their metadata), and `from_section` builds one from the config file's `model` section
plus the vocabulary size of the trained tokenizer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nanoeuler.errors import UserError


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ctx_len: int
    ffn_hidden: int = 0  # 0 -> floor(8 * dim / 3)
    mtp_heads: int = 4  # K output heads; head k predicts token t+1+k
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ctx_len", "mtp_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"model.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.ffn_hidden, int) or isinstance(self.ffn_hidden, bool) or self.ffn_hidden < 0:
            raise UserError(f"model.ffn_hidden must be an integer >= 0 (0: floor(8*dim/3)), got {self.ffn_hidden!r}")
        if self.dim % self.n_heads:
            raise UserError(f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise UserError(f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.n_kv_heads})")
        if (self.dim // self.n_heads) % 2:
            raise UserError(f"head dimension dim/n_heads = {self.dim // self.n_heads} must be even for RoPE")
        if not self.rope_theta > 0:
            raise UserError(f"model.rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.norm_eps > 0:
            raise UserError(f"model.norm_eps must be > 0, got {self.norm_eps!r}")
        # Normalise number types so equal configs compare (and hash) equal after a JSON round trip.
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        object.__setattr__(self, "norm_eps", float(self.norm_eps))

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def group(self) -> int:
        """Query heads per key/value head (GQA)."""
        return self.n_heads // self.n_kv_heads

    @property
    def hidden(self) -> int:
        """The SwiGLU hidden width, with the default resolved."""
        return self.ffn_hidden or (8 * self.dim) // 3

    @property
    def letters(self) -> tuple[int, ...]:
        """(L, C, H, Hkv, D, F, V, K): the sizes by the letters the kernels' shape comments use.

        >>> ModelConfig.named("gpu").letters
        (16, 768, 12, 4, 64, 2048, 4096, 4)
        """
        return (
            self.n_layers, self.dim, self.n_heads, self.n_kv_heads, self.head_dim, self.hidden, self.vocab_size,
            self.mtp_heads,
        )  # fmt: skip

    @classmethod
    def named(cls, name: str) -> "ModelConfig":
        if name not in PRESETS:
            raise UserError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)})")
        return cls(**PRESETS[name])

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        if not isinstance(d, dict):
            raise UserError(f"model config must be a mapping, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise UserError(f"model config has unknown key(s) {', '.join(unknown)}")
        missing = sorted(
            f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in d
        )
        if missing:
            raise UserError(f"model config lacks key(s) {', '.join(missing)}")
        return cls(**d)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's shape, in the canonical (HF Llama) order."""
        C, V, F, D = self.dim, self.vocab_size, self.hidden, self.head_dim
        kv = self.n_kv_heads * D
        shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (V, C)}
        for i in range(self.n_layers):
            p = f"layers.{i}."
            shapes[p + "input_layernorm.weight"] = (C,)
            shapes[p + "self_attn.q_proj.weight"] = (self.n_heads * D, C)
            shapes[p + "self_attn.k_proj.weight"] = (kv, C)
            shapes[p + "self_attn.v_proj.weight"] = (kv, C)
            shapes[p + "self_attn.o_proj.weight"] = (C, self.n_heads * D)
            shapes[p + "post_attention_layernorm.weight"] = (C,)
            shapes[p + "mlp.gate_proj.weight"] = (F, C)
            shapes[p + "mlp.up_proj.weight"] = (F, C)
            shapes[p + "mlp.down_proj.weight"] = (C, F)
        shapes["norm.weight"] = (C,)
        shapes["lm_head.weight"] = (V, C)
        for k in range(1, self.mtp_heads):
            shapes[f"mtp_heads.{k}.weight"] = (V, C)
        return shapes

    def n_params(self) -> int:
        total = 0
        for shape in self.param_shapes().values():
            n = 1
            for s in shape:
                n *= s
            total += n
        return total

    @classmethod
    def from_section(cls, section: dict, vocab_size: int) -> "ModelConfig":
        """The config file's `model` section: a preset, then any key that is not null overrides it.

        The vocabulary size always comes from the tokenizer, never from the preset.
        """
        section = dict(section or {})
        preset = section.pop("preset", "gpu")
        base = dict(PRESETS[preset]) if preset in PRESETS else None
        if base is None:
            raise UserError(f"config key 'model.preset' must be one of {list(PRESETS)}, got {preset!r}")
        known = {f.name for f in dataclasses.fields(cls)} - {"vocab_size"}
        for key, value in section.items():
            if key not in known:
                raise UserError(f"config key 'model.{key}' is not known")
            if value is not None:
                base[key] = value
        base["vocab_size"] = int(vocab_size)
        return cls(**base)


PRESETS: dict[str, dict] = {
    # ~1.05M parameters: the CPU showcase.
    "small": dict(
        vocab_size=512,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ctx_len=128,
        ffn_hidden=0,
        mtp_heads=4,
        rope_theta=10000.0,
        norm_eps=1e-5,
    ),
    # ~116M parameters: the full GPU run.
    "gpu": dict(
        vocab_size=4096,
        dim=768,
        n_layers=16,
        n_heads=12,
        n_kv_heads=4,
        ctx_len=512,
        ffn_hidden=0,
        mtp_heads=4,
        rope_theta=10000.0,
        norm_eps=1e-5,
    ),
    # ~278M parameters: head size 64 (every attention kernel), 3 query heads per KV head as `gpu`, and
    # widths that the fused GEMMs take (dim % 64, hidden 3072 % 128).
    "gpu-270m": dict(
        vocab_size=4096,
        dim=1152,
        n_layers=18,
        n_heads=18,
        n_kv_heads=6,
        ctx_len=512,
        ffn_hidden=0,
        mtp_heads=4,
        rope_theta=10000.0,
        norm_eps=1e-5,
    ),
}
