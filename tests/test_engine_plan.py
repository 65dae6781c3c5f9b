"""The bf16 engine's plan on the CPU: kernel variants, the flat buffer layout, chunk and grid arithmetic."""

import numpy as np
import pytest

from nanoeuler.kernels.bf16 import plan
from nanoeuler.kernels.bf16.plan import ALIGN, choose_variants, plan_layout
from nanoeuler.model.config import ModelConfig
from nanoeuler.optim import default_no_decay

CFGS = [
    ModelConfig.named("gpu"),
    ModelConfig.named("small"),
    ModelConfig(vocab_size=97, dim=48, n_layers=3, n_heads=3, n_kv_heads=1, ctx_len=32, mtp_heads=1),
]


@pytest.mark.parametrize("cfg", CFGS, ids=["preset-116M", "preset-1M", "odd"])
def test_layout_places_every_tensor_once_aligned_and_stacked(cfg):
    lay = plan_layout(cfg)
    shapes = cfg.param_shapes()
    spans = sorted((lay.offsets[n], lay.offsets[n] + int(np.prod(s)), n) for n, s in shapes.items())
    assert set(lay.offsets) == set(shapes)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        assert end <= start, (a, b)  # no overlap
    assert spans[-1][1] <= lay.total and lay.total % ALIGN == 0
    for i in range(cfg.n_layers):  # one GEMM operand: q, k, v (and gate, up) back to back
        p = f"layers.{i}."
        q, k, v = (p + f"self_attn.{x}_proj.weight" for x in "qkv")
        assert lay.offsets[k] == lay.offsets[q] + shapes[q][0] * cfg.dim
        assert lay.offsets[v] == lay.offsets[k] + shapes[k][0] * cfg.dim
        assert lay.group_of[q] == lay.group_of[v] and lay.offsets[q] % ALIGN == 0
        assert lay.gain_of[p + "mlp.up_proj.weight"] == p + "post_attention_layernorm.weight"


@pytest.mark.parametrize("cfg", CFGS, ids=["preset-116M", "preset-1M", "odd"])
def test_runs_cover_the_buffer_gains_first_and_decay_as_adamw(cfg):
    lay = plan_layout(cfg)
    assert [r.start for r in lay.runs[1:]] == [r.end for r in lay.runs[:-1]]
    assert lay.runs[0].start == 0 and lay.runs[-1].end == lay.total
    folded = [r for r in lay.runs if r.gain is not None]
    assert len(folded) == 2 * cfg.n_layers + 1 and lay.fold_start == folded[0].start
    assert all(r.gain is not None for r in lay.runs if r.start >= lay.fold_start)
    for r in folded:  # AdamW updates each gain before the image that folds it in
        assert lay.offsets[r.gain] < lay.fold_start and r.cols == cfg.dim
    shapes = cfg.param_shapes()
    for name, off in lay.offsets.items():
        run = next(r for r in lay.runs if r.start <= off < r.end)
        assert run.decayed == (not default_no_decay(name, shapes[name])), name


def test_variants_pick_the_fastest_that_applies_and_refuse_the_rest():
    gpu, small = ModelConfig.named("gpu"), ModelConfig.named("small")  # head sizes 64 and 32
    assert choose_variants(gpu, 512, sm90a=True) == plan.Variants("wg", True, True)
    assert choose_variants(gpu, 500, sm90a=True) == plan.Variants("wg", True, False)  # seq % 64 != 0
    assert choose_variants(small, 128, sm90a=True) == plan.Variants("ldm", False, False)  # F 341
    assert choose_variants(gpu, 512, "fp32", sm90a=True).fuse_rope is False
    with pytest.raises(ValueError, match="compute-capability-9.0"):
        choose_variants(gpu, 512, "wg", sm90a=False)
    with pytest.raises(ValueError, match="fuse_swiglu"):
        choose_variants(small, 128, fuse_swiglu=True, sm90a=True)
    with pytest.raises(ValueError, match="head_dim 6 not supported"):
        choose_variants(
            ModelConfig(vocab_size=9, dim=12, n_layers=1, n_heads=2, n_kv_heads=1, ctx_len=8), 8, sm90a=True
        )


@pytest.mark.parametrize("cfg", CFGS[:2], ids=["gpu-preset", "small"])
def test_engine_bytes_invariants(cfg):
    """What each option adds or saves: the accumulator is one more float32 gradient (and its loss);
    checkpointing keeps every layer's float32 input but one layer's activations; the activations grow
    with the batch in proportion; the flat buffers do not depend on the batch."""
    from nanoeuler.kernels.bf16.plan import engine_bytes

    var = choose_variants(cfg, 128, sm90a=False)
    kw = dict(attention=var.attention, fuse_swiglu=var.fuse_swiglu, fuse_rope=var.fuse_rope)
    base = engine_bytes(cfg, 8, 128, **kw)
    n = plan_layout(cfg).total
    assert base["params"] == base["grads"] == 4 * n and base["moments"] == 8 * n and base["image"] == 2 * n
    assert engine_bytes(cfg, 8, 128, accum=True, **kw)["accumulator"] == 4 * n + 4 and base["accumulator"] == 0
    ckpt = engine_bytes(cfg, 8, 128, checkpoint=True, **kw)
    N, L, C = 8 * 128, cfg.n_layers, cfg.dim
    per_layer = (base["activations"] - 2 * N * C * 4) // L  # two alternating stream buffers without
    assert ckpt["activations"] == per_layer + L * N * C * 4
    assert {k: v for k, v in ckpt.items() if k != "activations"} == {
        k: v for k, v in base.items() if k != "activations"
    }
    double = engine_bytes(cfg, 16, 128, **kw)
    assert double["activations"] == 2 * base["activations"]
    assert all(double[k] == base[k] for k in ("params", "grads", "moments", "image", "wdt"))
    dpo = engine_bytes(cfg, 8, 128, head="dpo", **kw)
    K = cfg.mtp_heads
    assert dpo["scratch"] - base["scratch"] == (2 * N + 3 * 8 + 4) * 4 - (N * K + 2 * K) * 4
    with pytest.raises(ValueError):
        engine_bytes(cfg, 8, 128, head="mse", **kw)
