"""The bf16 training engine (`engine.TrainEngine`) and its kernels: one `.cu` file per family, and beside
it a `.py` file of named launchers.

    >>> FAMILY_OF["rmsnorm_fwd_bf16"], FAMILY_OF["flash_fwd_wg_d64"]
    ('norms', 'flash_wg')

Families: `embed` (token embedding), `norms` (RMSNorm with its gain folded into the next GEMM, and the
folded weights' gradients), `rope` (RoPE and the attention layouts), `swiglu`, `heads` (cross-entropy
over the output heads; DPO's sequence log-probabilities), `optim` (gradient norm, AdamW, gradient
accumulation, the bf16 weight image, Muon's momentum and update), `flash_mma` / `flash_wg`
(tensor-core attention by mma.sync / by Hopper wgmma; launchers in `flash.py`) and `gemm_tma` (GEMMs
with the SwiGLU or RoPE inside, fed by TMA). Shared device code sits in `common.cuh`, `mma.cuh`,
`wgmma.cuh` and `swiglu.cuh`, which the loader inlines (`nanoeuler.kernels.source`). `plan.py` holds
the engine's host-side arithmetic (variants, buffer layout, grids) and needs no GPU.
"""

from __future__ import annotations

_FLASH_MMA = tuple(
    f"flash_{k}_{v}_d{d}" for d in (32, 64) for v in ("mma", "ldm") for k in ("fwd", "bwd_dkdv", "bwd_dq")
)

FAMILIES = {
    "embed": ("embed_fwd", "embed_bwd"),
    "norms": ("rmsnorm_fwd_bf16", "rmsnorm_bwd_bf16", "rmsnorm_bwd_bf16_f32dy", "gain_fold_grad", "column_sums"),
    "rope": ("qkv_rope_split", "qkv_rope_split_bf16", "rope_bwd_pack", "attn_pack", "attn_delta"),
    "swiglu": ("swiglu_fwd_bf16", "swiglu_bwd_bf16"),
    "heads": ("ce_head_scale", "ce_heads_fwd_bwd", "ce_loss_reduce", "seq_logp_rows", "dpo_pair_loss", "seq_logp_grad"),
    "optim": (
        "f32_to_bf16",
        "sumsq",
        "adamw_clip_bf16",
        "grad_accumulate",
        "muon_momentum",
        "muon_normalize",
        "muon_update",
        "muon_poly_init",
    ),
    "flash_mma": _FLASH_MMA,
    "flash_wg": ("flash_fwd_wg_d64", "flash_bwd_dkdv_wg_d64", "flash_bwd_dq_wg_d64"),
    "gemm_tma": ("swiglu_fwd_gemm", "swiglu_bwd_gemm", "qkv_rope_gemm", "wdt_image"),
}
FAMILY_OF = {name: family for family, names in FAMILIES.items() for name in names}


def bf16_kernel(name: str):
    """The kernel `name` from its family's file (self-tests and benches that launch kernels by name)."""
    from nanoeuler.kernels import kernel

    return kernel(f"bf16/{FAMILY_OF[name]}", name)


def grid_1d(n: int, threads: int = 256, cap: int = 65535 * 8) -> tuple:
    """A 1-D grid of `threads`-wide blocks over n items, capped (the kernels loop grid-stride)."""
    return (max(1, min(cap, (n + threads - 1) // threads)),)
