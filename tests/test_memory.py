"""Device memory on the CPU: the memory model's arithmetic, the fitting of micro-batches and evaluation chunks
to a budget (faked here: a CPU run has none), micro-batched steps equal to uncut ones, the one-line refusal,
gradient checkpointing, and generation batches capped by the budget."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from nanoeuler import memory
from nanoeuler.cli import main
from nanoeuler.config import validate
from nanoeuler.errors import UserError
from nanoeuler.model import transformer
from nanoeuler.model.config import ModelConfig
from nanoeuler.train.config import PretrainConfig, SftConfig
from nanoeuler.train.stepper import make_stepper
from train_fixtures import make_tokenizer, save_random_model, write_alpaca, write_config, write_shards

GPU = ModelConfig.named("gpu")
CFG = ModelConfig(vocab_size=40, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ctx_len=8, mtp_heads=3)
CONTEXT = memory.context_for(8)  # an RTX 4070's


def _sft(**kw):
    return SftConfig.from_section(validate({"sft": kw})["sft"])


def _card(gigabytes: float) -> memory.Budget:
    return memory.Budget(gigabytes * 1e9, CONTEXT, "gpu_memory")


# ---- the arithmetic --------------------------------------------------------------------------------------


def test_gpu_memory_takes_bytes_sizes_and_auto_and_refuses_the_rest():
    assert memory.parse_bytes("auto") is None and memory.parse_bytes(7e9) == 7e9
    assert memory.parse_bytes("11GB") == 11e9 and memory.parse_bytes("1.5 GiB") == 1.5 * 2**30
    for bad in ("eleven", "11 parsecs", -1, 0, "0GB"):
        with pytest.raises(UserError, match="gpu_memory"):
            memory.parse_bytes(bad)
    assert validate({"gpu_memory": "11GB"})["gpu_memory"] == "11GB" and validate({})["gpu_memory"] == "auto"


def test_the_xp_step_is_state_plus_activations_that_grow_with_the_rows():
    one, two = memory.xp_train_parts(GPU, 4, 512), memory.xp_train_parts(GPU, 8, 512)
    n = GPU.n_params()
    assert one["params"] == one["grads"] == 4 * n and one["adamw"] == 8 * n and "grad_sum" not in one
    assert two["activations"] == 2 * one["activations"] - GPU.n_layers * 4 * (1280 + 2 * 2048) * 768  # weights once
    assert memory.xp_train_parts(GPU, 4, 512, micro_batches=2)["grad_sum"] == 4 * n
    ckpt = memory.xp_train_parts(GPU, 8, 512, checkpoint=True)
    assert ckpt["activations"] < two["activations"] / 8  # 16 layers: inputs alone and one layer's set


def test_the_model_matches_what_the_full_run_measured_before_evaluation_dropped_its_cache():
    """DPO at fp32 with 16 pairs of up to 512 tokens peaked at 16.9 GiB on an 80 GB card: the step's
    prediction with the context of an H100 comes within a tenth of it."""
    parts = memory.train_parts(GPU, _sft(), 32, 512, head="dpo")
    assert memory.peak(parts, memory.context_for(9)) / 2**30 == pytest.approx(16.9, rel=0.1)


def test_engine_parts_are_the_engines_own_figures_for_the_portable_path():
    from nanoeuler.kernels.bf16 import plan

    parts = memory.engine_parts(GPU, 32, 512, "portable")
    assert parts == plan.engine_bytes(GPU, 32, 512, attention="ldm", fuse_swiglu=False, fuse_rope=False)
    assert 6e9 < sum(parts.values()) < 7.5e9  # pretraining's engine at batch 32 fits a 12 GB card
    ckpt = memory.engine_parts(GPU, 32, 512, "portable", checkpoint=True, accum=True)
    assert ckpt["activations"] < parts["activations"] / 2 and ckpt["accumulator"] > 0


def test_zero_1_keeps_the_engines_moments_of_one_region_per_rank():
    """ZeRO-1 on the bf16 engine: the moments shrink to a region (about 1/N, at most a layer or the heads
    more), while the whole flat buffers stay, padded to N equal regions."""
    from nanoeuler.kernels.bf16.plan import plan_layout

    one = memory.engine_parts(GPU, 16, 512, "portable")
    for n in (2, 4, 8):
        parts = memory.engine_parts(GPU, 16, 512, "portable", zero_world=n)
        lay = plan_layout(GPU, shards=n)
        assert parts["moments"] == 2 * 4 * lay.span and parts["params"] == parts["grads"] == 4 * lay.total
        heads = 4 * GPU.mtp_heads * GPU.vocab_size * GPU.dim  # the largest unit: the output heads
        assert one["moments"] / n < parts["moments"] <= one["moments"] / n + 2 * heads
        assert {k: v for k, v in parts.items() if k not in ("params", "grads", "moments", "image")} == {
            k: v for k, v in one.items() if k not in ("params", "grads", "moments", "image")
        }
        assert sum(parts.values()) < sum(one.values())


def test_zero_1_lets_the_bf16_engine_fit_a_card_the_unsharded_one_does_not():
    """A card that holds rank 0's engine of a 4-rank ZeRO-1 run at batch 32 (and a quarter GB more, for the
    evaluation's forward beside it): the plan takes the whole batch there, and splits it without ZeRO, whose
    engine needs 0.6 GB more."""
    settings = _sft(precision="bf16")
    zero = sum(memory.train_parts(GPU, settings, 32, 512, zero_world=4).values())
    assert 0.55e9 < sum(memory.train_parts(GPU, settings, 32, 512).values()) - zero < 0.6e9
    pool = zero + 0.25e9
    card = memory.Budget(pool / memory.FIT_SHARE + memory.CUBLAS_WORKSPACE + CONTEXT, CONTEXT, "gpu_memory")
    assert memory.plan_training("sft", GPU, settings, card, eval_items=32, zero_world=4).micro == 32
    assert memory.plan_training("sft", GPU, settings, card, eval_items=32).micro < 32


def test_a_forward_without_a_backward_holds_one_block_not_all():
    train = memory.xp_train_parts(GPU, 32, 512)["activations"]
    forward = memory.forward_parts(GPU, 32, 512, params=False)
    assert forward["block"] < train / 10
    # the pairs' scoring takes a bounded chunk of logits at a time, HellaSwag's all of them at once
    pairs, logits = (memory.forward_parts(GPU, 32, 512, kind)["head"] for kind in ("pair_logps", "logits"))
    assert pairs < logits / 2 and pairs < 4 * memory.LOGITS_CHUNK + 4 * 2 * 32 * 512 * GPU.dim


def test_decode_cache_grows_with_the_slots():
    one, eight = memory.decode_parts(GPU, 1), memory.decode_parts(GPU, 8)
    assert eight["kv_cache"] == 8 * one["kv_cache"] == 8 * 2 * 2 * 16 * 4 * 512 * 64
    assert eight["weights"] == 2 * GPU.n_params()


# ---- fitting -------------------------------------------------------------------------------------------


def test_the_batch_splits_evenly_into_the_largest_micro_batches_that_fit(capsys):
    fit = memory.plan_training("sft", GPU, _sft(), _card(11), eval_items=32)
    assert fit.micro == 11 and fit.eval_items == 32 and fit.predicted <= 11e9  # 12 fit: 3 of 11
    assert "nanoeuler sft: batch 32 as 3 micro-batches of 11 to fit 11.0 GB (gpu_memory)" in capsys.readouterr().err
    assert memory.plan_training("sft", GPU, _sft(), _card(7), eval_items=32).micro == 7
    assert memory.plan_training("sft", GPU, _sft(), None, eval_items=32) == memory.TrainPlan(32, 32, 0.0)
    twelve = memory.Budget(12e8 / memory.FIT_SHARE + memory.CUBLAS_WORKSPACE + 1, 0, "gpu_memory")
    assert memory.fit_rows("x", 32, twelve, lambda m: {"a": 1e8 * m}) == 11  # 12 fit: 3 of 11


def test_checkpointing_and_bf16_fit_a_12_gb_card_whole():
    for settings in (_sft(checkpoint_activations=True), _sft(precision="bf16")):
        fit = memory.plan_training("sft", GPU, settings, _card(11), eval_items=32)
        assert fit.micro == 32 and fit.predicted < 11e9


def test_dpo_counts_pairs_and_fits_8_gb():
    fit = memory.plan_training(
        "dpo",
        GPU,
        _sft(batch_size=16),
        _card(7),
        eval_items=16,
        eval_kind="pair_logps",
        rows_per_item=2,
        unit=" pairs",
        head="dpo",
    )
    assert fit.micro == 3 and fit.predicted <= 7e9


def test_a_micro_batch_leaves_room_to_score_one_item_beside_what_it_keeps():
    # The bf16 engine keeps its micro-batch's buffers while the stage scores its held-out windows. Fitting
    # the step alone took micro-batches so large that not one window fit beside them: the 270M with
    # checkpointing was refused on cards of 7.4 to 7.9 GB that fit a smaller micro-batch.
    pretrain = {"precision": "bf16", "batch_size": 32, "checkpoint_activations": True}
    settings = PretrainConfig.from_section(validate({"pretrain": pretrain})["pretrain"])
    cfg = ModelConfig.named("gpu-270m")
    for gigabytes in (7.4, 7.6, 7.9):
        fit = memory.plan_training("pretrain", cfg, settings, _card(gigabytes), eval_items=32)
        assert fit.eval_items >= 1 and fit.predicted <= gigabytes * 1e9
    # one window that cannot fit beside the smallest micro-batch: its own line, no checkpointing advice
    with pytest.raises(UserError, match="to score one sequence of 512") as exc:
        memory.plan_training("pretrain", cfg, settings, _card(7.3), eval_items=32)
    assert "checkpoint_activations" not in str(exc.value)


def test_one_sequence_that_cannot_fit_is_one_line_naming_what_it_needs():
    with pytest.raises(UserError) as exc:
        memory.plan_training("sft", GPU, _sft(), _card(2.5), eval_items=32)
    msg = str(exc.value)
    assert msg.startswith("needs 3.") and "GB for one sequence of 512 at fp32; gpu_memory is 2.5 GB" in msg
    assert "sft.checkpoint_activations: true" in msg and "\n" not in msg
    with pytest.raises(UserError, match="for the model and one sequence's cache of 512"):
        memory.decode_batch("sample", _card(0.6), GPU, 8)


def test_evaluation_chunks_shrink_with_the_room_left():
    resident = memory.resident_parts(GPU, _sft(), 32, 512)
    wide, _ = memory.eval_items_for("sft", _card(22), GPU, 512, 64, "loss", resident)
    narrow, _ = memory.eval_items_for("sft", _card(3.5), GPU, 512, 64, "loss", resident)
    assert wide == 64 and 1 <= narrow < wide
    with pytest.raises(UserError, match="to score 4 sequences of 512"):
        memory.eval_items_for("hellaswag-eval", _card(1.9), GPU, 512, 16, "logits", resident, rows_per_item=4)


# ---- micro-batches step as the uncut batch ------------------------------------------------------------------


def _params(dtype=np.float32):
    return {n: p.astype(dtype) for n, p in transformer.init_params(CFG, seed=0).items()}


def _masked(seed, B=6):
    """SFT-like rows: each head's targets cover a different, random span (some rows none at all)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, CFG.vocab_size, size=(B, CFG.ctx_len))
    y = rng.integers(0, CFG.vocab_size, size=(B, CFG.ctx_len, CFG.mtp_heads))
    keep = rng.random(size=y.shape) < rng.random(size=(B, 1, 1))
    keep[0] = False  # a row without a target
    return x, np.where(keep, y, -1)


def _windows(seed, B=6):
    rng = np.random.default_rng(seed)
    w = rng.integers(0, CFG.vocab_size, size=(B, CFG.ctx_len + CFG.mtp_heads))
    return w[:, : CFG.ctx_len], np.stack([w[:, 1 + k : CFG.ctx_len + 1 + k] for k in range(CFG.mtp_heads)], axis=-1)


@pytest.mark.parametrize("data", [_masked, _windows])
def test_a_micro_batched_run_repeats_the_uncut_runs_losses(data):
    settings = PretrainConfig.from_section(validate({"pretrain": {"batch_size": 6}})["pretrain"])
    whole, cut = make_stepper(settings, CFG, _params(), np), make_stepper(settings, CFG, _params(), np)
    for step in range(5):
        batch = [data(step)]
        loss, norm = whole.step(batch, lr=3e-3)
        loss2, norm2 = cut.step(memory.split_rows(batch, 4), lr=3e-3)  # pieces of 4 and 2 rows
        assert loss2 == pytest.approx(loss, rel=1e-6) and norm2 == pytest.approx(norm, rel=1e-5)
    for n, p in whole.params().items():
        np.testing.assert_allclose(cut.params()[n], p, rtol=1e-4, atol=1e-6)  # AdamW: near-zero gradients


def test_dpo_pairs_split_with_their_reference_values_step_as_the_whole_batch():
    from nanoeuler.train.dpo import PairBatches

    x, y = _masked(7, B=6)
    y[:, :, 1:] = -1
    y[:, -1, 0] = 3  # every sequence scores at least one token
    ref = np.linspace(-3.0, -1.0, 6)
    settings = PretrainConfig.from_section(validate({"pretrain": {"batch_size": 3}})["pretrain"])
    losses = []
    for pieces in (3, 2, 1):
        batches = PairBatches([], np.zeros((0, 2)), dict(validate({})["dpo"], beta=0.5), CFG.mtp_heads, 0)
        stepper = make_stepper(settings, CFG, _params(np.float64), np, head_loss=batches.head)
        batches.head.push(ref)
        losses.append(stepper.step(batches.split([(x, y)], pieces), lr=1e-2)[0])
        params = stepper.params()
        if pieces == 3:
            first = params
        else:
            for n, p in first.items():
                np.testing.assert_allclose(params[n], p, rtol=1e-9, atol=1e-12)
    assert losses[1] == pytest.approx(losses[0], rel=1e-12) and losses[2] == pytest.approx(losses[0], rel=1e-12)


# ---- gradient checkpointing ---------------------------------------------------------------------------------


def test_checkpointing_gives_the_same_loss_and_gradients_in_float64():
    params, (x, y) = _params(np.float64), _masked(3)
    loss, grads = transformer.loss_and_grads(params, x, y, CFG)
    loss2, grads2 = transformer.loss_and_grads(params, x, y, CFG, checkpoint=True)
    assert loss2 == loss
    for n in grads:
        np.testing.assert_array_equal(grads2[n], grads[n])


def test_checkpointed_gradients_match_finite_differences():
    params, (x, y) = _params(np.float64), _windows(4, B=2)
    _, grads = transformer.loss_and_grads(params, x, y, CFG, checkpoint=True)
    rng, h = np.random.default_rng(0), 1e-5
    for name in (
        "layers.0.self_attn.q_proj.weight",
        "layers.1.mlp.down_proj.weight",
        "embed_tokens.weight",
        "layers.0.input_layernorm.weight",
    ):
        for _ in range(3):
            i = tuple(rng.integers(0, s) for s in params[name].shape)
            keep = params[name][i]
            params[name][i] = keep + h
            up = transformer.forward_loss(params, x, y, CFG)[0]
            params[name][i] = keep - h
            down = transformer.forward_loss(params, x, y, CFG)[0]
            params[name][i] = keep
            assert grads[name][i] == pytest.approx((up - down) / (2 * h), rel=1e-5, abs=1e-9)


# ---- the stages, with a faked card ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _fake_card(monkeypatch, total: float):
    monkeypatch.setattr(memory.Budget, "on_device", classmethod(lambda cls, setting, xp: _card(total / 1e9)))


def yaml_model(conf):
    import yaml

    return yaml.safe_load(open(conf))["model"]


def _losses(run_dir):
    return [r["loss"] for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "loss" in r]


def test_sft_cut_to_fit_a_small_card_trains_as_the_uncut_run(tmp_path, tok, monkeypatch, capsys):
    save_random_model(tmp_path / "base.bin", tok)
    write_alpaca(tmp_path / "alpaca.jsonl", n=40)
    sft = {"batch_size": 8, "epochs": 1, "max_examples": 40, "val_examples": 4, "eval_every": 2, "log_every": 1}
    conf = write_config(tmp_path / "c.yaml", sft=sft)
    args = [
        "sft",
        "--config",
        str(conf),
        "--base",
        str(tmp_path / "base.bin"),
        "--data",
        str(tmp_path / "alpaca.jsonl"),
        "--no-progress",
    ]
    assert main(args + ["--out", str(tmp_path / "a.bin"), "--run-dir", str(tmp_path / "a")]) == 0

    cfg = ModelConfig.from_section(yaml_model(conf), tok.vocab_size)
    three = sum(memory.train_parts(cfg, _sft(**sft), 3, cfg.ctx_len, micro_batches=3).values())
    total = three / memory.FIT_SHARE + memory.CUBLAS_WORKSPACE + CONTEXT + 1
    _fake_card(monkeypatch, total)
    capsys.readouterr()
    assert main(args + ["--out", str(tmp_path / "b.bin"), "--run-dir", str(tmp_path / "b")]) == 0
    assert "nanoeuler sft: batch 8 as 3 micro-batches of 3 to fit" in capsys.readouterr().err
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert len(a) == len(b) > 2 and b == pytest.approx(a, rel=1e-6)

    _fake_card(monkeypatch, CONTEXT + memory.CUBLAS_WORKSPACE + 1e5)
    assert main(args + ["--out", str(tmp_path / "c.bin"), "--run-dir", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("nanoeuler sft: error: needs ") and "for one sequence of 64 at fp32" in err[-1]
    assert not (tmp_path / "c.bin").exists()


def test_pretraining_cut_to_fit_trains_as_the_uncut_run(tmp_path, tok, monkeypatch):
    manifest = write_shards(tmp_path / "shards", tok)
    pre = {"batch_size": 6, "steps": 4, "log_every": 1, "eval_every": 2, "val_tokens": 256, "warmup_steps": 1}
    conf = write_config(tmp_path / "c.yaml", pretrain=pre)
    args = [
        "pretrain",
        "--config",
        str(conf),
        "--shards",
        str(manifest),
        "--tokenizer",
        str(tmp_path / "t.json"),
        "--no-progress",
    ]
    (tmp_path / "t.json").write_text(tok.to_json())
    assert main(args + ["--out", str(tmp_path / "a.bin"), "--run-dir", str(tmp_path / "a")]) == 0
    cfg = ModelConfig.from_section(yaml_model(conf), tok.vocab_size)
    two = sum(memory.train_parts(cfg, _sft(batch_size=6), 2, cfg.ctx_len, micro_batches=3).values())
    _fake_card(monkeypatch, two / memory.FIT_SHARE + memory.CUBLAS_WORKSPACE + CONTEXT + 1)
    assert main(args + ["--out", str(tmp_path / "b.bin"), "--run-dir", str(tmp_path / "b")]) == 0
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert len(a) == 4 and b == pytest.approx(a, rel=1e-6)


def test_dpo_and_its_reference_cut_to_fit_a_small_card_give_the_uncut_results(tmp_path, tok, monkeypatch, capsys):
    from nanoeuler.train.config import TrainConfig
    from test_dpo import write_pairs

    save_random_model(tmp_path / "chat.bin", tok)
    dpo = {
        "epochs": 1,
        "batch_size": 4,
        "lr": 1e-3,
        "warmup_steps": 1,
        "val_pairs": 4,
        "log_every": 1,
        "eval_every": 2,
        "beta": 0.5,
    }
    conf, prefs = write_config(tmp_path / "c.yaml", dpo=dpo), write_pairs(tmp_path / "prefs.jsonl")
    common = ["--config", str(conf), "--ckpt", str(tmp_path / "chat.bin"), "--prefs", str(prefs), "--no-progress"]

    def train(name):
        return main(
            [
                "dpo",
                *common,
                "--ref",
                str(tmp_path / "a.npz"),
                "--out",
                str(tmp_path / f"{name}.bin"),
                "--run-dir",
                str(tmp_path / name),
            ]
        )

    assert main(["ref-logps", *common, "--out", str(tmp_path / "a.npz")]) == 0 and train("a") == 0
    cfg = ModelConfig.from_section(yaml_model(conf), tok.vocab_size)
    one_pair = memory.eval_items_for(
        "ref-logps", None, cfg, cfg.ctx_len, 1, "pair_logps", {"params": 4 * cfg.n_params()}, rows_per_item=2
    )[1](1)
    _fake_card(monkeypatch, sum(one_pair.values()) / memory.FIT_SHARE + memory.CUBLAS_WORKSPACE + CONTEXT + 1)
    card = memory.Budget.on_device("auto", np)
    resident = {"params": 4 * cfg.n_params()}
    assert memory.eval_items_for("x", card, cfg, cfg.ctx_len, 8, "pair_logps", resident, 2)[0] == 1
    assert main(["ref-logps", *common, "--out", str(tmp_path / "b.npz")]) == 0  # a pair a forward
    with np.load(tmp_path / "a.npz") as a, np.load(tmp_path / "b.npz") as b:
        np.testing.assert_allclose(b["logps"], a["logps"], rtol=1e-6)

    settings = TrainConfig.from_section(validate({"dpo": dpo})["dpo"])
    two = sum(memory.train_parts(cfg, settings, 4, cfg.ctx_len, micro_batches=2, head="dpo").values())
    _fake_card(monkeypatch, two / memory.FIT_SHARE + memory.CUBLAS_WORKSPACE + CONTEXT + 1)
    capsys.readouterr()
    assert train("b") == 0
    assert "nanoeuler dpo: batch 4 pairs as 2 micro-batches of 2 pairs to fit" in capsys.readouterr().err
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")  # h = beta (logp - ref ...): float32 sums of
    assert len(a) == len(b) == 5 and b == pytest.approx(a, abs=1e-5)  # ~100 nats each, differenced


def test_hellaswag_scored_an_item_a_forward_picks_as_the_whole_batch(tmp_path, tok, monkeypatch):
    from test_hellaswag import SAMPLE

    save_random_model(tmp_path / "m.bin", tok)
    conf = write_config(tmp_path / "c.yaml", eval={"hellaswag_items": 6, "hellaswag_batch_size": 6})
    args = [
        "hellaswag-eval",
        "--config",
        str(conf),
        "--ckpt",
        str(tmp_path / "m.bin"),
        "--data",
        str(SAMPLE),
        "--name",
        "m",
    ]
    assert main(args + ["--out", str(tmp_path / "a.json")]) == 0
    cfg = ModelConfig.from_section(yaml_model(conf), tok.vocab_size)
    item = memory.eval_items_for(
        "hellaswag-eval", None, cfg, cfg.ctx_len, 1, "logits", memory.decode_parts(cfg, 0), rows_per_item=4
    )[1](1)
    _fake_card(monkeypatch, sum(item.values()) / memory.FIT_SHARE + memory.CUBLAS_WORKSPACE + CONTEXT + 1)
    card = memory.Budget.on_device("auto", np)
    assert memory.eval_items_for("x", card, cfg, cfg.ctx_len, 6, "logits", memory.decode_parts(cfg, 0), 4)[0] == 1
    assert main(args + ["--out", str(tmp_path / "b.json")]) == 0  # an item a forward
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    assert a["picks"] == b["picks"] and a["picks_norm"] == b["picks_norm"] and a["items"] == 6


# ---- generation -------------------------------------------------------------------------------------------


def test_more_prompts_than_the_cache_holds_run_in_groups_with_the_same_tokens(tmp_path, tok):
    from nanoeuler.infer.engine import load
    from nanoeuler.infer.sampling import Sampling

    save_random_model(tmp_path / "m.bin", tok)
    gen, _, _ = load(tmp_path / "m.bin", "cpu")
    prompts = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14], [15]]
    for sampling in (Sampling(temperature=0), Sampling(temperature=1.0, seed=3)):
        gen.max_batch = None
        whole = gen.generate(prompts, 6, sampling)
        gen.max_batch = 2
        seen = []
        assert gen.generate(prompts, 6, sampling, on_token=lambda b, t: seen.append(b)) == whole
        assert sorted(set(seen)) == [0, 1, 2, 3, 4]


class _CountingDevice:
    """NumPy in CuPy's place for the GPU backend's buffer class: counts the bytes it asks of the device
    (`zeros`); its pinned host memory is host memory and is not counted."""

    float32, int32, uint16, uint64 = np.float32, np.int32, np.uint16, np.uint64

    def __init__(self):
        self.bytes = 0
        self.cuda = SimpleNamespace(alloc_pinned_memory=bytearray)

    def zeros(self, shape, dtype):
        a = np.zeros(shape, dtype)
        self.bytes += a.nbytes
        return a


def _device_row_bytes(cfg, rows: int, dtype: str) -> int:
    """What `infer.gpu._Rows` allocates on the device for `rows` rows, as `GpuBackend._buffers` makes it."""
    from nanoeuler.infer import gpu

    dev = _CountingDevice()
    gpu._Rows(dev, cfg, rows, cfg.mtp_heads * cfg.vocab_size, dev.uint16 if dtype == "bf16" else dev.float32)
    return dev.bytes


def test_a_speculating_server_keeps_the_verify_buffers_the_model_counts(tmp_path, tok):
    """A speculating server verifies g streams at once as one pass of g x K rows, g = 1..slots (here on the
    CPU backend, whose calls the GPU's mirror), and the GPU backend keeps buffers for each row count it runs:
    `decode_parts` counts those the prefills' and decode steps' row counts do not already hold, byte for byte."""
    from nanoeuler.infer.sampling import Sampling
    from nanoeuler.serve.backend import Backend
    from serve_fixtures import run_streams

    _, cfg = save_random_model(tmp_path / "m.bin", tok)  # two heads: verify passes of 2, 4, ..., 10 rows
    slots = 5
    backend = Backend.load(tmp_path / "m.bin", "cpu", slots=slots, speculative=True)
    be, seen = backend.engine.backend, set()
    verify = be.verify_argmax_many
    be.verify_argmax_many = lambda s, blocks, pos: seen.add(np.asarray(blocks).size) or verify(s, blocks, pos)
    for g in range(1, slots + 1):
        run_streams(backend, [([5 + i, 6], 3, Sampling(temperature=0), {}) for i in range(g)])
    assert seen == {2 * g for g in range(1, slots + 1)}

    for dtype in ("bf16", "fp32"):
        for rows in (1, 6, cfg.ctx_len):
            assert memory.row_bytes(cfg, rows, dtype) == _device_row_bytes(cfg, rows, dtype)
        parts = memory.decode_parts(cfg, 10, dtype, speculative=True)  # 10 slots: passes of 2, 4, ..., 20 rows
        assert parts["speculation"] == sum(_device_row_bytes(cfg, m, dtype) for m in (18, 20))  # 9, 10 streams
        counts = [*range(1, 17), 32, 64]  # a prefill's 1 to 16 rows as they come, then powers of two (10 among them)
        assert parts["rows"] == sum(_device_row_bytes(cfg, m, dtype) for m in counts)
        assert "speculation" not in memory.decode_parts(cfg, slots, dtype)


def test_a_speculating_server_fits_fewer_slots():
    """On a 2.5 GB card the 116M model's 64 slots fit plainly; with their verify buffers (0.87 GB) fewer do."""
    card = _card(2.5)
    plain = memory.decode_batch("serve", card, GPU, 64)
    fewer = memory.decode_batch("serve", card, GPU, 64, speculative=True)
    assert plain == 64 and 1 <= fewer < plain
    assert card.fits(memory.decode_parts(GPU, fewer, speculative=True))
    assert not card.fits(memory.decode_parts(GPU, fewer + 1, speculative=True))


def test_the_meter_reports_nothing_on_the_cpu():
    meter = memory.PeakMeter(np)
    assert meter.measured() == 0.0 and meter.report("sft", 1e9) == {}


# ---- the device script's pieces that need no GPU ------------------------------------------------------------


ROWS = (
    "pretrain-fp32 pretrain-bf16 sft-fp32 sft-bf16 ref-logps dpo-fp32 dpo-bf16 hellaswag-eval evaluate sample"
).split()


SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_memory.sh"


def _script(tmp_path, *args, **env):
    env = {"PATH": "/usr/bin:/bin", "WORK": str(tmp_path), "OUT": str(tmp_path / "out"), **env}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env)


def test_the_device_script_writes_a_valid_full_config_for_every_row(tmp_path):
    from nanoeuler.config import load_config

    for row in ROWS:
        assert _script(tmp_path, "config", row, str(tmp_path / "c.yaml")).returncode == 0
        conf = load_config(tmp_path / "c.yaml")
        assert conf["device"] == "gpu" and conf["model"]["preset"] == "gpu" and conf["gpu_memory"] == "auto"
        stage = row.split("-")[0]
        if stage in ("pretrain", "sft", "dpo"):
            assert conf[stage]["precision"] == row.split("-")[1] and conf[stage]["batch_size"] in (16, 32)


def test_the_device_script_prints_its_table_from_the_rows_so_far(tmp_path):
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "rows.tsv").write_text(
        "sft-fp32\t7 GB\t7 of 32\t6.3\t6.1\t0.968\t4,100\nsft-fp32\t22 GB\t-\t17.3\t16.8\t0.971\t9,000\n"
    )
    r = _script(tmp_path, "table")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("| stage | cap | micro-batch")
    assert lines[2] == "| sft-fp32 | 7 GB | 7 of 32 | 6.3 | 6.1 | 0.968 | 4,100 |"
    assert (tmp_path / "out" / "memory_table.md").read_text() == r.stdout


def test_the_device_script_reads_each_stages_lines_into_its_table(tmp_path):
    """A stand-in for `python -m nanoeuler` prints what a stage prints on the GPU: a fitted run, a refused
    one; the script's own parsing runs on the real interpreter."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/bash
if [ "$1" = -m ]; then
  case "$CUPY_GPU_MEMORY_LIMIT" in
    7000000000) echo "nanoeuler sft: error: needs 8.1 GB for one sequence of 512 at fp32; gpu_memory is 7.4 GB: x" >&2
         exit 1 ;;
  esac
  echo "nanoeuler sft: batch 32 as 3 micro-batches of 11 to fit 11.4 GB (free on the card)" >&2
  echo "nanoeuler sft: device memory peak 9.9 GB measured, 10.2 GB predicted (0.971); micro-batch 11" >&2
  exit 0
fi
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    for _ in range(2):  # a row run again replaces its lines
        r = _script(tmp_path, "sft-fp32", PYTHON=str(fake), CAPS="7e9 11e9", HOME=os.environ.get("HOME", "/tmp"))
        assert r.returncode == 0, r.stderr
    table = (tmp_path / "out" / "memory_table.md").read_text().splitlines()
    assert table[2:] == [
        "| sft-fp32 | 7 GB | refused: needs 8.1 GB for one sequence of 512 at fp32; gpu_memory is 7.4 GB: x "
        "| - | - | - | - |",
        "| sft-fp32 | 11 GB | 11 of 32 | 10.2 | 9.9 | 0.971 | - |",
    ]


def test_serve_load_counts_the_verify_buffers_when_it_speculates(tmp_path, tok, monkeypatch):
    """`Backend.load(speculative=True)` sizes its slots with the verify buffers counted (`decode_batch`'s
    `speculative`); a server that does not speculate does not pay for them."""
    from nanoeuler.serve.backend import Backend

    save_random_model(tmp_path / "m.bin", tok)
    asked = []
    monkeypatch.setattr(memory, "decode_batch", lambda *a, speculative=False, **k: asked.append(speculative))
    for speculative in (True, False):
        Backend.load(tmp_path / "m.bin", "cpu", slots=2, speculative=speculative)
    assert asked == [True, False]
