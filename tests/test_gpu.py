"""The GPU engine (needs CuPy and a CUDA device; skipped otherwise): every kernel against its NumPy
reference, the whole model's gradients against float64, checkpoints moving between GPU and CPU, KV-cache
decoding, the training loop on the GPU, and the out-of-memory message."""

import types

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

FP32_TOL = 1e-5


def _rel(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _case_id(case):
    fn, _, label, _ = case
    return f"{fn.__name__[5:]}-{label}"


def _cases():
    from nanoeuler.checks.selftest import CASES

    return CASES


@pytest.mark.parametrize("case", _cases(), ids=_case_id)
def test_kernel_matches_reference(case):
    from nanoeuler.checks.selftest import poisoned_allocations, rel_err

    fn, shape, label, kwargs = case
    rng = np.random.default_rng()
    with poisoned_allocations():
        results = fn(rng, shape, **kwargs)
        errors = {kernel: rel_err(got, ref) for kernel, got, ref in results}
    bad = {k: e for k, e in errors.items() if not (np.isfinite(e) and e <= FP32_TOL)}
    assert not bad, bad


def test_ops_for_cupy_is_the_kernel_namespace():
    import cupy

    from nanoeuler.kernels import ops
    from nanoeuler.model import layers
    from nanoeuler.model.dispatch import ops_for

    assert ops_for(cupy) is ops
    public = {n for n in dir(layers) if n.endswith(("_forward", "_backward")) or n == "rope_tables"}
    assert public <= set(dir(ops))


def test_other_dtypes_fall_back_to_the_layers():
    import cupy

    from nanoeuler.kernels import ops
    from nanoeuler.model import layers

    x = cupy.asarray(np.random.default_rng(0).standard_normal((3, 5, 16)))  # float64
    w = cupy.ones(16)
    y, _ = ops.rmsnorm_forward(x, w, 1e-5)
    yr, _ = layers.rmsnorm_forward(x, w, 1e-5)
    assert y.dtype == cupy.float64 and float(abs(y - yr).max()) == 0.0


def _skewed_embedding_batch(rng, B=8, T=512, V=300, C=200):
    """ids with a few ids at most positions (as a text's commonest tokens), dx of mixed magnitudes: the
    float32 sums of one id's rows then depend on their order."""
    ids = np.minimum(rng.zipf(1.3, size=(B, T)) - 1, V - 1)
    dx = rng.standard_normal((B, T, C)) * rng.choice([1e-3, 1.0, 1e3], size=(B, T, 1))
    return ids, dx.astype(np.float32)


def test_embedding_backward_adds_in_position_order():
    """dw is the float32 sum of each id's rows in position order, bit for bit (NumPy's add.at adds in
    that order), on every call: again after unrelated work on another stream overlapped the launch."""
    import cupy

    from nanoeuler.kernels import ops
    from nanoeuler.model import layers

    rng = np.random.default_rng(0)
    ids, dx = _skewed_embedding_batch(rng)
    V = 300
    want = layers.embedding_backward(dx, ids, V)  # float32 on the CPU, row after row
    ids_d, dx_d = cupy.asarray(ids), cupy.asarray(dx)
    first = ops.embedding_backward(dx_d, ids_d, V).get()
    assert np.array_equal(first, want)
    side = cupy.cuda.Stream(non_blocking=True)
    a = cupy.asarray(rng.standard_normal((2048, 2048)), dtype=np.float32)
    for _ in range(3):
        with side:
            for _ in range(4):
                a = cupy.tanh(a @ a)
        again = ops.embedding_backward(dx_d, ids_d, V).get()
        assert np.array_equal(again, first)
    side.synchronize()


def test_embedding_backward_edges():
    """Ids outside [0, V) add nowhere, and ids of another length than dx's rows are refused."""
    import cupy

    from nanoeuler.kernels import ops
    from nanoeuler.model import layers

    rng = np.random.default_rng(1)
    ids = np.array([[3, -1, 5, 3, 6, 0]])
    dx = rng.standard_normal((1, 6, 40)).astype(np.float32)
    keep = (ids[0] >= 0) & (ids[0] < 6)
    dw = ops.embedding_backward(cupy.asarray(dx), cupy.asarray(ids), 6).get()
    assert np.array_equal(dw, layers.embedding_backward(dx[:, keep], ids[:, keep], 6))
    with pytest.raises(ValueError, match="ids hold 5 positions, dx 6"):
        ops.embedding_backward(cupy.asarray(dx), cupy.asarray(ids[:, :5]), 6)


def test_gpu_gradients_match_cpu_float64():
    from nanoeuler.checks.gradcheck_gpu import compare, problems

    for label, cfg, batch, T in problems():
        loss_err, rows = compare(cfg, batch, T, seed=1)
        assert loss_err <= FP32_TOL, label
        bad = {n: e for n, _, e in rows if not (np.isfinite(e) and e <= FP32_TOL)}
        assert not bad, (label, bad)


def test_selftest_and_gradcheck_commands(capsys):
    from nanoeuler.cli import main

    assert main(["selftest", "--seed", "7", "--only", "attention"]) == 0
    assert "attention fwd out" in capsys.readouterr().out
    from nanoeuler.checks import gradcheck_gpu

    assert gradcheck_gpu.run(types.SimpleNamespace(seed=3, threshold=1e-6)) == 0
    assert "max relative error" in capsys.readouterr().out


# ---- the model on the GPU ------------------------------------------------------------------------


def _cfg():
    from nanoeuler.model.config import ModelConfig

    return ModelConfig(vocab_size=300, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ctx_len=96, mtp_heads=3)


def _batch(cfg, rng, B=3, T=70):
    w = rng.integers(0, cfg.vocab_size, size=(B, T + cfg.mtp_heads))
    return w[:, :T], np.stack([w[:, 1 + k : T + 1 + k] for k in range(cfg.mtp_heads)], axis=-1)


def _train(params, cfg, xp, steps=4, seed=0):
    """A few AdamW steps on fixed random batches; params (a dict on xp) change in place."""
    from nanoeuler.model import transformer
    from nanoeuler.optim import AdamW, clip_grad_norm

    x, y = _batch(cfg, np.random.default_rng(seed))  # one fixed batch: the loss must fall
    opt = AdamW(params, weight_decay=0.1)
    losses = []
    for _ in range(steps):
        loss, grads = transformer.loss_and_grads(params, xp.asarray(x), xp.asarray(y), cfg)
        clip_grad_norm(grads, 1.0)
        if xp is np:
            opt.step(params, grads, 1e-2)
        else:
            opt.step(params, grads, 1e-2)
        losses.append(loss)
    return losses


@pytest.mark.parametrize("trained_on", ["gpu", "cpu"])
def test_checkpoint_logits_agree_across_devices(tmp_path, trained_on):
    import cupy

    from nanoeuler import checkpoint
    from nanoeuler.model import transformer

    cfg = _cfg()
    xp = cupy if trained_on == "gpu" else np
    params = {n: xp.asarray(p) for n, p in transformer.init_params(cfg, seed=0).items()}
    losses = _train(params, cfg, xp)
    assert losses[-1] < losses[0]
    path = tmp_path / "model.bin"
    checkpoint.save_model(path, params, cfg, step=4, tokenizer_json=None)
    host, cfg2, _ = checkpoint.load_model(path, expect=cfg)
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, size=(2, 77))
    cpu = transformer.logits(host, ids, cfg2)
    gpu = transformer.logits({n: cupy.asarray(p) for n, p in host.items()}, cupy.asarray(ids), cfg2)
    assert gpu.dtype == np.float32 and cpu.dtype == np.float32
    assert _rel(cupy.asnumpy(gpu), cpu) <= FP32_TOL


def test_gpu_and_cpu_training_track_each_other():
    import cupy

    from nanoeuler.model import transformer

    cfg = _cfg()
    host = transformer.init_params(cfg, seed=1)
    cpu_losses = _train({n: p.copy() for n, p in host.items()}, cfg, np, steps=3)
    gpu_losses = _train({n: cupy.asarray(p) for n, p in host.items()}, cfg, cupy, steps=3)
    assert np.allclose(gpu_losses, cpu_losses, rtol=1e-4), (gpu_losses, cpu_losses)


def test_kv_cache_decoding_matches_full_logits():
    import cupy

    from nanoeuler.model import transformer

    cfg = _cfg()
    params = {n: cupy.asarray(p) for n, p in transformer.init_params(cfg, seed=2).items()}
    ids = cupy.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, size=(2, 40)))
    full = transformer.logits(params, ids, cfg)
    cache = transformer.new_kv_cache(cfg, 2, 64, cupy, np.float32)
    parts = [transformer.forward_step(params, ids[:, :25], cache, cfg)]
    for t in range(25, 40):
        parts.append(transformer.forward_step(params, ids[:, t : t + 1], cache, cfg))
    assert _rel(cupy.asnumpy(cupy.concatenate(parts, axis=1)), cupy.asnumpy(full)) <= FP32_TOL


def test_training_loop_runs_on_the_gpu_and_its_model_loads_on_cpu(tmp_path):
    import cupy

    from nanoeuler import checkpoint
    from nanoeuler.config import validate
    from nanoeuler.model import transformer
    from nanoeuler.train import loop

    cfg = _cfg()
    sec = dict(
        validate({})["pretrain"],
        lr=1e-2,
        warmup_steps=1,
        batch_size=3,
        log_every=1,
        checkpoint_every=3,
        eval_every=1000,
    )
    rng = np.random.default_rng(0)

    class Batches:
        def batch(self, step, micro):
            return _batch(cfg, rng)

        def state(self):
            return {}

        def load_state(self, state):
            pass

    out = tmp_path / "base.bin"
    run = loop.Run(
        stage="pretrain",
        cfg=cfg,
        section=sec,
        total_steps=6,
        batches=Batches(),
        init_params=lambda: transformer.init_params(cfg, seed=0),
        tokenizer_json="{}",
        tokenizer_sha256="0" * 64,
        run_dir=tmp_path / "run",
        out=out,
        xp=cupy,
        progress=False,
    )
    last = loop.train(run)
    assert np.isfinite(last["loss"])
    host, _, _ = checkpoint.load_model(out, expect=cfg)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 50))
    cpu = transformer.logits(host, ids, cfg)
    gpu = transformer.logits({n: cupy.asarray(p) for n, p in host.items()}, cupy.asarray(ids), cfg)
    assert _rel(cupy.asnumpy(gpu), cpu) <= FP32_TOL


def test_out_of_memory_names_batch_and_context():
    import cupy

    from nanoeuler.backend import oom_guard
    from nanoeuler.errors import UserError

    with pytest.raises(UserError) as exc:
        with oom_guard(16, 512):
            cupy.empty(2**45, dtype=np.float32)  # 128 TiB
    assert "batch size 16" in str(exc.value) and "context 512" in str(exc.value)
