"""The bf16 engine's step variants on the GPU: gradient accumulation, activation checkpointing, the DPO
head through the stepper, and the memory plan (`plan.engine_bytes`) against what the engine allocates."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

CFG_ARGS = dict(vocab_size=256, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ctx_len=64, mtp_heads=2)


def _cfg(**kw):
    from nanoeuler.model.config import ModelConfig

    return ModelConfig(**{**CFG_ARGS, **kw})


def _settings(**kw):
    from nanoeuler.config import validate
    from nanoeuler.train.config import PretrainConfig

    return PretrainConfig.from_section({**validate({})["pretrain"], "precision": "bf16", **kw})


def _masked_batches(rng, steps, B, T, V, K):
    """Batches of B rows whose valid targets differ a lot from row to row (SFT-like masks)."""
    out = []
    for _ in range(steps):
        x = rng.integers(0, V, (B, T))
        y = rng.integers(0, V, (B, T, K))
        for b in range(B):
            y[b, : int(rng.integers(0, T - 4))] = -1  # a prompt of any length: rows hold 4..T targets
        y[:, :, K - 1][rng.random((B, T)) < 0.5] = -1
        out.append((x, y))
    return out


def _run(stepper, batches, lrs, split):
    """Losses, norms and final parameters of `stepper` over the batches, each cut into `split` micro-batches."""
    losses, norms = [], []
    for (x, y), lr in zip(batches, lrs):
        micro = [(a, b) for a, b in zip(np.array_split(x, split), np.array_split(y, split))]
        loss, norm = stepper.step(micro, lr)
        losses.append(loss)
        norms.append(norm)
    return np.array(losses), np.array(norms), {n: p.get() for n, p in stepper.params().items()}


def _close(a, b, tol):
    for n, p in b.items():
        assert np.linalg.norm(a[n] - p) <= tol * np.linalg.norm(p), n


@pytest.mark.parametrize("hook", [None, "in_graph"], ids=["plain", "collective"])
def test_accumulated_micro_batches_step_as_the_whole_batch(hook):
    """1 x B8 and 4 x B2 (uneven valid targets per micro-batch) give the same losses, norms and weights;
    a collective (in the captured step) runs once per update, after the accumulation."""
    import cupy

    from nanoeuler.model import transformer
    from nanoeuler.train.stepper import make_stepper

    cfg = _cfg()
    params = transformer.init_params(cfg, seed=0)
    batches = _masked_batches(np.random.default_rng(0), 4, 8, 64, cfg.vocab_size, cfg.mtp_heads)
    lrs = [1e-3, 1e-2, 1e-4, 3e-3]
    calls = {}

    def make(key, **kw):
        fn = None
        if hook:

            def fn(grads):  # doubles, as a sum over two equal ranks would
                calls[key] = calls.get(key, 0) + 1
                for g in grads.values():
                    g *= 2

            fn.in_graph = True
        return make_stepper(_settings(**kw), cfg, params, cupy, grad_hook=fn)

    whole = _run(make("whole", batch_size=8), batches, lrs, 1)
    split = _run(make("split", batch_size=2, grad_accum=4), batches, lrs, 4)
    np.testing.assert_allclose(split[0], whole[0], rtol=2e-3)
    np.testing.assert_allclose(split[1], whole[1], rtol=1e-2)
    _close(split[2], whole[2], 1e-2)
    if hook:  # captured: the hook's Python body runs at the eager step and at the capture only
        assert calls == {"whole": 2, "split": 2}, calls
    # the accumulating engine's phases are CUDA graphs from their second use
    stepper = make("again", batch_size=2, grad_accum=4)
    _run(stepper, batches[:3], lrs[:3], 4)
    assert set(stepper.engine._graphs) == {"micro", "update"}


def test_accumulation_equals_one_step_of_the_concatenated_batch_per_figure():
    """The figures of the accumulation check, printed for the record: max relative loss / weight difference."""
    import cupy

    from nanoeuler.model import transformer
    from nanoeuler.train.stepper import make_stepper

    cfg = _cfg()
    params = transformer.init_params(cfg, seed=1)
    batches = _masked_batches(np.random.default_rng(1), 5, 8, 64, cfg.vocab_size, cfg.mtp_heads)
    lrs = [3e-3] * 5
    whole = _run(make_stepper(_settings(batch_size=8), cfg, params, cupy), batches, lrs, 1)
    split = _run(make_stepper(_settings(batch_size=2, grad_accum=4), cfg, params, cupy), batches, lrs, 4)
    loss_rel = np.abs(split[0] / whole[0] - 1).max()
    w_rel = max(np.linalg.norm(split[2][n] - p) / np.linalg.norm(p) for n, p in whole[2].items())
    print(f"\naccum 4xB2 vs 1xB8, 5 steps: max loss rel diff {loss_rel:.2e}, max weight rel diff {w_rel:.2e}")
    assert loss_rel < 2e-3 and w_rel < 1e-2


@pytest.mark.parametrize("hidden", [0, 384], ids=["F341", "F384-fused"])
def test_checkpointing_gives_the_same_loss_and_gradients(hidden):
    """Recomputing each layer in the backward runs the same kernels on the same values: the loss and every
    gradient are bit-identical, except the embedding's (its backward adds with atomics in any order)."""
    from nanoeuler.kernels.bf16.engine import TrainEngine
    from nanoeuler.model import transformer

    cfg = _cfg(n_layers=3, ffn_hidden=hidden)
    params = transformer.init_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (4, 64)).astype(np.int32), rng.integers(-1, 256, (4, 64, 2)).astype(np.int32)
    out = {}
    for ckpt in (False, True):
        eng = TrainEngine(cfg, params, batch=4, seq=64, checkpoint=ckpt)
        eng.forward_backward(x, y)
        out[ckpt] = eng.last_loss(), {n: g.get() for n, g in eng.grads().items()}, eng.nbytes()
    assert out[True][0] == out[False][0]
    for n, g in out[False][1].items():
        if n == "embed_tokens.weight":
            np.testing.assert_allclose(out[True][1][n], g, rtol=1e-5, atol=1e-9)
        else:
            assert np.array_equal(out[True][1][n], g), n
    assert out[True][2] < out[False][2]


@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(checkpoint=True),
        dict(accum=True),
        dict(head="dpo"),
        dict(head="dpo", checkpoint=True, accum=True),
        dict(attention="fp32"),
        dict(attention="mma", fuse_swiglu=False, fuse_rope=False, checkpoint=True),
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default",
)
@pytest.mark.parametrize("hidden", [0, 384], ids=["F341", "F384"])
def test_engine_bytes_is_what_the_engine_allocates(opts, hidden):
    from nanoeuler.kernels.bf16.plan import engine_bytes
    from nanoeuler.kernels.bf16.engine import TrainEngine
    from nanoeuler.model import transformer

    cfg = _cfg(n_layers=3, ffn_hidden=hidden)
    eng = TrainEngine(cfg, transformer.init_params(cfg, seed=0), batch=4, seq=64, **opts)
    plan = engine_bytes(
        cfg,
        4,
        64,
        attention=eng.attention,
        fuse_swiglu=eng.fuse_swiglu,
        fuse_rope=eng.fuse_rope,
        accum=eng.accum,
        checkpoint=eng.checkpoint,
        head=eng.head,
    )
    assert sum(plan.values()) == eng.nbytes(), plan


def _pairs(rng, P, T, V, K):
    """P preference pairs as 2P rows (chosen first), responses of varying lengths marked in head 0."""
    x = rng.integers(0, V, (2 * P, T))
    y = np.full((2 * P, T, K), -1)
    for b in range(2 * P):
        start, stop = int(rng.integers(2, T // 3)), int(rng.integers(T // 2, T + 1))
        y[b, start:stop, 0] = rng.integers(0, V, stop - start)
    return x, y


def _dpo_stepper(precision, cfg, params, beta, eps, **kw):
    import cupy

    from nanoeuler.model.dpo import DpoHead
    from nanoeuler.train.stepper import make_stepper

    head = DpoHead(beta, eps)
    return make_stepper(_settings(precision=precision, **kw), cfg, params, cupy, head_loss=head), head


def _concat_pairs(parts, refs):
    """Micro-batches of pairs (chosen rows first in each) and their reference values as one batch."""
    halves = [(x.shape[0] // 2, x, y, r) for (x, y), r in zip(parts, refs)]
    x = np.concatenate([x[:p] for p, x, _, _ in halves] + [x[p:] for p, x, _, _ in halves])
    y = np.concatenate([y[:p] for p, _, y, _ in halves] + [y[p:] for p, _, y, _ in halves])
    r = np.concatenate([r[:p] for p, _, _, r in halves] + [r[p:] for p, _, _, r in halves])
    return [(x, y)], [r]


def test_dpo_on_the_engine_tracks_the_fp32_path():
    """The same pairs and weights through the fp32 xp stepper (dpo_head_loss) and the bf16 engine's DPO head:
    losses, norms and weights agree to bf16 tolerance, with one micro-batch a step, and for two micro-batches
    (the second short: padding pairs in the engine) against the fp32 step of their concatenation; the engine
    reports each pair's sequence log-probs."""
    from nanoeuler.model import transformer

    cfg = _cfg()
    params = {n: p * (3.0 if p.ndim == 2 else 1.0) for n, p in transformer.init_params(cfg, seed=0).items()}
    rng = np.random.default_rng(0)
    beta, eps = 0.1, 0.1
    steps = [[_pairs(rng, 4, 64, cfg.vocab_size, cfg.mtp_heads)] for _ in range(3)]
    steps += [[_pairs(rng, 4, 64, cfg.vocab_size, cfg.mtp_heads), _pairs(rng, 2, 64, cfg.vocab_size, cfg.mtp_heads)]]
    refs = [[rng.standard_normal(x.shape[0]) * 5 - 60 for x, _ in s] for s in steps]
    got = {}
    for precision in ("fp32", "bf16"):
        fixed, head = _dpo_stepper(precision, cfg, params, beta, eps, batch_size=4)
        if precision == "bf16":
            accum, head2 = _dpo_stepper(precision, cfg, params, beta, eps, batch_size=4, grad_accum=2)
        else:  # the reference: one step over the concatenated batch
            accum, head2 = _dpo_stepper(precision, cfg, params, beta, eps, batch_size=6)
        losses = []
        for s, r in zip(steps, refs):
            st, h = (fixed, head) if len(s) == 1 else (accum, head2)
            if len(s) > 1 and precision == "fp32":
                s, r = _concat_pairs(s, r)
            for ref in r:
                h.push(ref)
            losses.append(st.step(s, 1e-3))
        got[precision] = (
            np.array(losses),
            {
                **{n: p.get() for n, p in fixed.params().items()},
                **{"accum " + n: p.get() for n, p in accum.params().items()},
            },
        )
        if precision == "bf16":
            lp = accum.last_logps()
            assert lp.shape == (6, 2) and np.isfinite(lp).all() and (lp < 0).all()
    np.testing.assert_allclose(got["bf16"][0][:, 0], got["fp32"][0][:, 0], rtol=2e-2)
    np.testing.assert_allclose(got["bf16"][0][:, 1], got["fp32"][0][:, 1], rtol=5e-2)
    _close(got["bf16"][1], got["fp32"][1], 1e-2)


def test_dpo_held_out_metrics_agree_with_the_fp32_path():
    """DPO's held-out scores (loss, reward accuracy, margin, log-probs) from the engine's sequence log-probs
    agree with `train.pairs.sequence_logps` in fp32 on the same pairs and weights."""
    import cupy

    from nanoeuler.kernels.bf16.engine import TrainEngine
    from nanoeuler.model import dpo, transformer
    from nanoeuler.train.dpo import pair_metrics

    cfg = _cfg()
    params = {n: p * (3.0 if p.ndim == 2 else 1.0) for n, p in transformer.init_params(cfg, seed=2).items()}
    rng = np.random.default_rng(2)
    P, T = 8, 64
    x, y = _pairs(rng, P, T, cfg.vocab_size, cfg.mtp_heads)
    # the fp32 path's scoring (`train.pairs.sequence_logps`), on these rows
    lg = transformer.logits({n: cupy.asarray(p) for n, p in params.items()}, cupy.asarray(x), cfg)
    idx, tgt, seq = dpo.response_rows(cupy.asarray(y))
    tok, _ = dpo.token_logps(lg.reshape(-1, cfg.vocab_size)[idx], tgt)
    fp32 = cupy.asnumpy(dpo.sequence_logps(tok, seq, 2 * P)).astype(np.float64)
    ref = fp32 + rng.standard_normal(2 * P) * 20  # margins well away from zero
    eng = TrainEngine(cfg, params, batch=2 * P, seq=T, head="dpo", dpo_beta=0.1)
    eng.forward_backward(x.astype(np.int32), y.astype(np.int32), ref, np.full(P, 1.0 / P))
    bf16 = eng.last_logps()[0].astype(np.float64)
    two = lambda v: np.stack([v[:P], v[P:]], axis=1)  # noqa: E731
    m32, m16 = pair_metrics(two(fp32), two(ref), 0.1, 0.0), pair_metrics(two(bf16), two(ref), 0.1, 0.0)
    print("\nheld-out fp32:", m32, "\nheld-out bf16:", m16)
    assert m16["reward_accuracy"] == m32["reward_accuracy"]
    for k in ("val_loss", "margin", "chosen_logp", "rejected_logp"):
        assert m16[k] == pytest.approx(m32[k], rel=1e-2, abs=1e-2), k
    assert eng.last_loss() == pytest.approx(m32["val_loss"], rel=1e-2)


def test_the_dpo_stage_runs_on_the_engine(tmp_path):
    """`nanoeuler dpo` with dpo.precision bf16 (two micro-batches a step) tracks the fp32 run of the same pairs:
    the training losses and the held-out scores of each evaluation."""
    import json
    import subprocess
    import sys

    from train_fixtures import TINY_MODEL, make_tokenizer, save_random_model, write_config

    def nanoeuler(*args):
        proc = subprocess.run([sys.executable, "-m", "nanoeuler", *map(str, args)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return proc

    tok = make_tokenizer()
    model = {**TINY_MODEL, "dim": 64, "n_heads": 2, "n_kv_heads": 1}  # head size 32: the engine's attention
    save_random_model(tmp_path / "chat.bin", tok, model=model)
    pairs = [
        {"prompt": "Name a color.\n", "chosen": "Blue.", "rejected": "I will not."},
        {
            "prompt": "Give three tips for staying healthy.\n",
            "chosen": "Eat well, sleep well, walk.",
            "rejected": "the sea was calm " * 10,
        },
    ]
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps(pairs[i % 2]) + "\n" for i in range(24)))
    ref = tmp_path / "ref.npz"
    records = {}
    for precision in ("fp32", "bf16"):
        conf = write_config(
            tmp_path / f"{precision}.yaml",
            model=model,
            dpo={
                "epochs": 2,
                "batch_size": 4,
                "grad_accum": 2,
                "lr": 1e-3,
                "warmup_steps": 1,
                "val_pairs": 4,
                "log_every": 1,
                "eval_every": 2,
                "beta": 0.5,
                "precision": precision,
            },
        )
        if not ref.exists():
            nanoeuler(
                "ref-logps",
                "--config",
                conf,
                "--device",
                "gpu",
                "--ckpt",
                tmp_path / "chat.bin",
                "--prefs",
                prefs,
                "--out",
                ref,
                "--no-progress",
            )
        run = tmp_path / f"run_{precision}"
        nanoeuler(
            "dpo",
            "--config",
            conf,
            "--device",
            "gpu",
            "--ckpt",
            tmp_path / "chat.bin",
            "--prefs",
            prefs,
            "--ref",
            ref,
            "--out",
            tmp_path / f"dpo_{precision}.bin",
            "--run-dir",
            run,
            "--no-progress",
        )
        records[precision] = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines()]
    fp32, bf16 = records["fp32"], records["bf16"]
    keys = ("loss", "val_loss", "margin", "chosen_logp", "rejected_logp")
    assert [sorted(k for k in r if k in keys) for r in fp32] == [sorted(k for k in r if k in keys) for r in bf16]
    assert any("val_loss" in r for r in bf16)
    for a, b in zip(fp32, bf16):
        for key in keys:
            if key in a:
                assert abs(a[key] - b[key]) <= 2e-2 * abs(a[key]) + 2e-2, (key, a, b)
