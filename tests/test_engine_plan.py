"""The bf16 engine's plan on the CPU: kernel variants, the flat buffer layout, chunk and grid arithmetic."""

import numpy as np
import pytest

from nanoeuler.kernels.bf16 import plan
from nanoeuler.kernels.bf16.plan import ALIGN, choose_variants, plan_layout
from nanoeuler.model.config import ModelConfig
from nanoeuler.optim import HIDDEN_MATRICES, default_no_decay

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


# ---- ZeRO-1: the sharded layout ------------------------------------------------------------------------


def _unit(name: str) -> str:
    """What a region keeps whole: the embedding, a layer, or the final norm with the output heads."""
    if name.startswith("embed_tokens."):
        return "embed"
    return ".".join(name.split(".")[:2]) if name.startswith("layers.") else "tail"


def _brute_force_largest(sizes, parts):
    """The least largest run sum over every cut of `sizes` into `parts` runs, the first and last not empty."""
    import itertools

    n, best = len(sizes), float("inf")
    for inner in itertools.combinations_with_replacement(range(1, n), parts - 1):
        cuts = [0, *inner, n]
        if cuts[-2] == n:
            continue
        best = min(best, max(sum(sizes[a:b]) for a, b in zip(cuts, cuts[1:])))
    return best


def test_balance_finds_the_least_largest_run_and_keeps_the_ends_on_the_first_and_last_runs():
    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes = [int(s) for s in rng.integers(1, 20, size=int(rng.integers(2, 7)))]
        parts = int(rng.integers(1, 6))
        cuts = plan.balance(sizes, parts)
        assert len(cuts) == parts + 1 and cuts[0] == 0 and cuts[-1] == len(sizes)
        assert all(a <= b for a, b in zip(cuts, cuts[1:])), cuts
        assert cuts[1] > 0 and cuts[-2] < len(sizes), (sizes, parts, cuts)  # first and last runs not empty
        largest = max(sum(sizes[a:b]) for a, b in zip(cuts, cuts[1:]))
        assert largest == _brute_force_largest(sizes, parts), (sizes, parts, cuts)


@pytest.mark.parametrize("cfg", CFGS, ids=["preset-116M", "preset-1M", "odd"])
@pytest.mark.parametrize("shards", [2, 3, 4, 7])
def test_the_sharded_layout_gives_each_rank_whole_layers_in_its_own_padded_region(cfg, shards):
    lay, whole = plan_layout(cfg, shards=shards), plan_layout(cfg)
    shapes = cfg.param_shapes()
    size = {n: int(np.prod(s)) for n, s in shapes.items()}
    assert lay.total == shards * lay.span and lay.span % ALIGN == 0 and lay.fold_start is None
    spans = sorted((lay.offsets[n], lay.offsets[n] + size[n], n) for n in shapes)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        assert end <= start, (a, b)  # no overlap
    for n in shapes:  # inside its region
        r0, r1 = lay.region(lay.region_of[n])
        assert r0 <= lay.offsets[n] and lay.offsets[n] + size[n] <= r1, n
    owner = {}
    for n in shapes:  # a layer is one rank's
        assert owner.setdefault(_unit(n), lay.region_of[n]) == lay.region_of[n], n
    assert owner["embed"] == 0 and owner["tail"] == shards - 1
    layers = [owner[f"layers.{i}"] for i in range(cfg.n_layers)]
    assert layers == sorted(layers) and owner["embed"] <= layers[0] and layers[-1] <= owner["tail"]
    assert lay.group_of.keys() == whole.group_of.keys() and lay.gain_of == whole.gain_of
    for n, (a, b) in lay.group_of.items():  # the stacked GEMM operands stay stacked
        assert b - a == whole.group_of[n][1] - whole.group_of[n][0] and a % ALIGN == 0, n
    # balanced: no region holds more than its share and one unit (a layer, or the embedding or the heads)
    unit_size = {}
    for n, (a, b) in lay.group_of.items():
        unit_size.setdefault(_unit(n), {})[a] = -(-(b - a) // ALIGN) * ALIGN
    units = {u: sum(v.values()) for u, v in unit_size.items()}
    assert sum(units.values()) == whole.total
    assert lay.span <= whole.total / shards + max(units.values())


@pytest.mark.parametrize("cfg", CFGS, ids=["preset-116M", "preset-1M", "odd"])
@pytest.mark.parametrize("shards", [1, 2, 4, 7])
def test_each_regions_runs_update_gains_first_and_keep_the_muon_strides(cfg, shards):
    lay = plan_layout(cfg, shards=shards)
    shapes = cfg.param_shapes()
    for r in range(shards):
        runs = [run for run in lay.runs if run.region == r]
        r0, r1 = lay.region(r)
        if not runs:  # more ranks than layers: an empty region, all padding
            assert r not in lay.region_of.values() and 0 < r < shards - 1
            continue
        used = max([lay.offsets[n] + int(np.prod(shapes[n])) for n in shapes if lay.region_of[n] == r], default=r0)
        assert runs[0].start == r0 and [x.start for x in runs[1:]] == [x.end for x in runs[:-1]]
        assert used <= runs[-1].end <= r1
        folded = [x for x in runs if x.gain is not None]
        first_fold = min((x.start for x in folded), default=r1)
        assert all(x.gain is not None for x in runs if x.start >= first_fold)  # the folded matrices last
        for x in folded:  # AdamW updates each gain before the image that folds it in: same region, earlier
            assert lay.region_of[x.gain] == r and lay.offsets[x.gain] < first_fold
        for name in HIDDEN_MATRICES:  # Muon batches a matrix over the region's layers: a constant stride
            mine = [i for i in range(cfg.n_layers) if lay.region_of[f"layers.{i}.{name}.weight"] == r]
            for what in (name, "input_layernorm" if "attn" in name else "post_attention_layernorm"):
                offs = [lay.offsets[f"layers.{i}.{what}.weight"] for i in mine]
                assert len({b - a for a, b in zip(offs, offs[1:])}) <= 1, (r, what)
