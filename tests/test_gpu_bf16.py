"""The bf16 engine: host-side checks everywhere, the device self-test rows where a GPU is present."""

import re

import numpy as np
import pytest

from nanoeuler.kernels import KERNEL_DIR
from nanoeuler.checks.selftest_bf16 import CASES_BF16, bf16_round, from_bf16, to_bf16


def test_bf16_rounding_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(-8, 8, 10000),
            np.array([0.0, -0.0, 1.0, 65504.0, 3.0e38, 1e-40], dtype=np.float32),
        ]
    )
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(to_bf16(x), ref)
    assert np.array_equal(from_bf16(ref), torch.from_numpy(x).to(torch.bfloat16).double().numpy())
    assert np.abs(bf16_round(x[:10000]) / x[:10000] - 1).max() <= 2.0**-8


def _defined(text: str) -> set:
    """The extern "C" kernels of a bf16 family's .cu text, the macro-made ones included."""
    defined = set(re.findall(r'extern "C" __global__ void(?: __launch_bounds__\([^)]*\))? (\w+)\(', text))
    defined.discard("__launch_bounds__")  # the macro-made flash kernels, named by FLASH_MMA_KERNELS
    for d in re.findall(r"^FLASH_MMA_KERNELS\((\d+)\)", text, flags=re.M):
        defined |= {f"flash_{k}_{v}_d{d}" for k in ("fwd", "bwd_dkdv", "bwd_dq") for v in ("mma", "ldm")}
    defined.discard("NAME")  # the RMSNORM_BWD macro's body; its instances:
    defined |= set(re.findall(r"^RMSNORM_BWD\((\w+),", text, flags=re.M))  # one per storage type of dy
    return defined


def test_engine_kernels_exist_in_their_family_files():
    from nanoeuler.kernels.bf16 import FAMILIES

    bf16 = KERNEL_DIR / "bf16"
    defined = set()
    for family, names in FAMILIES.items():  # the table of families is exactly what each file defines
        assert _defined((bf16 / f"{family}.cu").read_text()) == set(names), family
        defined |= set(names)
    wg = {f"flash_{k}_wg_d64" for k in ("fwd", "bwd_dkdv", "bwd_dq")}  # launched through flash.flash_kernels
    launchers = "".join(p.read_text() for p in bf16.glob("*.py"))
    wanted = set(re.findall(r'kernel\("bf16/\w+", "(\w+)"\)', launchers))
    wanted |= {"rmsnorm_bwd_bf16", "rmsnorm_bwd_bf16_f32dy"}  # norms.rmsnorm_bwd names one by g's dtype
    wanted |= set(re.findall(r'fused_gemm\("(\w+)"\)', (bf16 / "engine.py").read_text()))  # gemm_tma.py
    assert len(wanted) >= 15
    assert wanted <= defined, wanted - defined
    flash_names = {n for n in defined if n.startswith("flash_")}
    assert defined - flash_names <= wanted, (defined - flash_names) - wanted  # every other kernel has a launcher
    tests = (KERNEL_DIR.parent / "checks" / "selftest_bf16.py").read_text()
    # every bf16 kernel has a self-test row that launches it, on its own or inside the whole engine
    via_engine = {
        "f32_to_bf16",
        "embed_fwd",
        "embed_bwd",
        "sumsq",
        "adamw_clip_bf16",
        "muon_momentum",
        "muon_normalize",
        "muon_update",
        "muon_poly_init",
    }
    for name in defined - flash_names - via_engine:
        assert f'_k("{name}")' in tests, name
    assert "case_engine" in tests and "case_engine_muon" in tests
    # the flash kernels, by variant and head size through flash.flash_kernels, each of its three names
    flash = (bf16 / "flash.py").read_text()
    assert "flash_kernels(var, D)" in tests and 'f"{name}_{variant}_d{D}"' in flash
    for name in ("flash_fwd", "flash_bwd_dkdv", "flash_bwd_dq"):
        assert f'flash["{name}"]' in tests and f'"{name}"' in flash, name
    assert re.search(r'\(case_bf16_flash, \(.*64, "wg"\)', tests) and wg <= defined


def test_flash_wg_shared_memory_covers_each_kernels_tiles():
    """flash.FLASH_WG_SMEM gives each warpgroup attention kernel 1 KiB of alignment and every 8 KiB tile
    its body addresses (`sbase + i * TILE`, `sbase + (i + st) * TILE` for a stage st of 0 or 1): a tile
    beyond its dynamic shared memory would be an illegal address on the GPU only."""
    text = (KERNEL_DIR / "bf16" / "flash_wg.cu").read_text()
    flash = (KERNEL_DIR / "bf16" / "flash.py").read_text()
    sizes = eval(re.search(r"^FLASH_WG_SMEM = (\{.*\})$", flash, flags=re.M).group(1), {"__builtins__": {}})
    assert set(sizes) == {"flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv"}
    for name, smem in sizes.items():
        body = text[text.index(f" {name}_wg_d64(") :]
        body = body[: body.index("#else")]
        last = [int(i) for i in re.findall(r"sbase \+ (\d+) \* TILE", body)]
        last += [int(i) + 1 for i in re.findall(r"sbase \+ \((\d+) \+ st\) \* TILE", body)]
        assert "wg_tiles()" in body and last, name
        assert smem == 1024 + (max(last) + 1) * 8192, (name, smem, max(last))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES_BF16, ids=lambda c: c[2])
def test_bf16_selftest_case(case):
    from nanoeuler.checks.selftest import poisoned_allocations, rel_err

    fn, shape, label, kwargs = case
    rng = np.random.default_rng()
    with poisoned_allocations():
        rows = fn(rng, shape, **kwargs)
    for name, got, ref, tol in rows:
        err = rel_err(got, ref)
        assert np.isfinite(err) and err <= tol, f"{name} {label}: {err:.2e} > {tol:.0e}"


def _bench_train_gpu():
    """bench/train_gpu.py as a module (bench/ is a folder of scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("train_gpu", Path(__file__).parents[1] / "bench" / "train_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_modes_name_engine_options():
    """bench/train_gpu.py's `ours-bf16-<flag>...` modes: the flags' engine options, unknown flags refused."""
    import doctest

    bench = _bench_train_gpu()
    assert doctest.testmod(bench).failed == 0
    assert bench.engine_options("ours-bf16-wg") == {"attention": "wg"}
    assert bench.engine_options("ours-bf16-nofuse-eager") == {"fuse_swiglu": False, "fuse_rope": False, "graph": False}
    assert bench.engine_options("ours-bf16-norope") == {"fuse_rope": False}
    with pytest.raises(ValueError, match="unknown flag 'fast'"):
        bench.engine_options("ours-bf16-fast")


def test_bench_clock_sampler_without_nvml():
    """Without NVML (no NVIDIA driver) the benchmark still runs: its clock columns are dashes."""
    bench = _bench_train_gpu()
    power = bench.PowerSampler("0", library="libnanoeuler-no-such-library.so")
    with power, power.span() as w:
        pass
    assert power.summary(w) is None
    assert bench.clocks_columns(power.summary(w)).split() == ["-", "-", "-"]


def test_bench_torch_model_matches_ours_on_cpu():
    """bench/train_gpu.py's PyTorch model is our architecture: same loss and gradients (float32, CPU)."""
    torch = pytest.importorskip("torch")
    from nanoeuler.model import transformer
    from nanoeuler.model.config import ModelConfig

    bench = _bench_train_gpu()
    cfg = ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ctx_len=32, mtp_heads=3)
    params = {n: (p * 5 if p.ndim == 2 else p) for n, p in transformer.init_params(cfg, seed=1).items()}
    rng = np.random.default_rng(0)
    w = rng.integers(0, cfg.vocab_size, size=(2, 20 + cfg.mtp_heads))
    ids = w[:, :20]
    tg = np.stack([w[:, 1 + k : 21 + k] for k in range(cfg.mtp_heads)], axis=-1)
    model = bench.torch_model(cfg, params, torch.device("cpu"))
    loss = model(torch.tensor(ids), torch.tensor(tg))
    loss.backward()
    ref, grads = transformer.loss_and_grads({n: p.astype(np.float64) for n, p in params.items()}, ids, tg, cfg)
    assert abs(float(loss.detach()) - ref) < 1e-5 * ref
    qkv = np.concatenate([grads[f"layers.1.self_attn.{x}_proj.weight"] for x in "qkv"])
    got = model.blocks[1].wqkv.grad.numpy()
    assert np.linalg.norm(got - qkv) <= 1e-4 * np.linalg.norm(qkv)
    head = grads["mtp_heads.2.weight"]
    assert np.linalg.norm(model.heads[2].grad.numpy() - head) <= 1e-4 * np.linalg.norm(head)
    assert bench.flops_per_token(ModelConfig.named("gpu"), 512) == 717_225_984


def _loop_run(tmp_path, precision, total_steps, *, short=False, **extra):
    """A `loop.Run` of a head-size-64 model on the GPU, trained on a fixed repeating pattern.
    short=True gives SFT-like batches: shorter than the context, prompt targets -1."""
    import cupy

    from nanoeuler.config import validate
    from nanoeuler.model import transformer
    from nanoeuler.model.config import ModelConfig
    from nanoeuler.train import loop

    cfg = ModelConfig(vocab_size=64, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ctx_len=32, mtp_heads=2)
    sec = dict(
        validate({})["pretrain"],
        lr=3e-3,
        warmup_steps=2,
        batch_size=4,
        log_every=1,
        checkpoint_every=5,
        eval_every=1000,
        precision=precision,
        **extra,
    )
    B, T, K = 4, cfg.ctx_len - (7 if short else 0), cfg.mtp_heads
    seq = (np.arange(T + K + B)[None, :] * 5 + np.arange(B)[:, None] * 3) % cfg.vocab_size  # learnable

    class Batches:
        def batch(self, step, micro):
            w = np.stack([seq[b, b : b + T + K] for b in range(B)])
            y = np.stack([w[:, 1 + k : T + 1 + k] for k in range(K)], axis=-1)
            if short:
                y[:, :5] = -1  # the "prompt": not trained
                if step % 3 == 2:  # an epoch's last, smaller batch
                    return w[: B - 1, :T], y[: B - 1]
            return w[:, :T], y

        def state(self):
            return {}

        def load_state(self, state):
            pass

    return loop.Run(
        stage="pretrain",
        cfg=cfg,
        section=sec,
        total_steps=total_steps,
        batches=Batches(),
        init_params=lambda: transformer.init_params(cfg, seed=0),
        tokenizer_json="{}",
        tokenizer_sha256="0" * 64,
        run_dir=tmp_path / precision / "run",
        out=tmp_path / precision / "base.bin",
        xp=cupy,
        progress=False,
    )


def _losses(run):
    import json

    return [r["loss"] for r in map(json.loads, open(run.run_dir / "metrics.jsonl")) if "loss" in r]


@pytest.mark.gpu
@pytest.mark.parametrize("short", [False, True], ids=["pretrain-batches", "padded-sft-batches"])
def test_training_loop_in_bf16_tracks_fp32(tmp_path, short):
    from nanoeuler.train import loop

    runs = {p: _loop_run(tmp_path, p, 20, short=short) for p in ("fp32", "bf16")}
    for run in runs.values():
        loop.train(run)
    fp32, bf16 = _losses(runs["fp32"]), _losses(runs["bf16"])
    assert len(fp32) == len(bf16) == 20
    assert bf16[-1] < 0.5 * bf16[0]  # it learns
    assert abs(bf16[-1] - fp32[-1]) <= 0.05 * fp32[-1] + 0.02, (fp32, bf16)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [0, 384], ids=["F341", "F384"])  # F384: the fused SwiGLU backward on sm_90a
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_engine_graph_replay_matches_kernel_by_kernel(hidden, optimizer):
    """Steps replayed from the captured CUDA graph compute what the kernel-by-kernel steps compute, with
    the batch and the learning rate of each step (AdamW's per-step values live on the device)."""
    import cupy

    from nanoeuler.kernels.bf16.engine import TrainEngine
    from nanoeuler.model import transformer
    from nanoeuler.model.config import ModelConfig

    cfg = ModelConfig(
        vocab_size=256, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ctx_len=64, mtp_heads=2, ffn_hidden=hidden
    )
    params = transformer.init_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 256, (4, 64)), rng.integers(-1, 256, (4, 64, 2))) for _ in range(4)]
    lrs = [1e-3, 1e-2, 1e-4, 3e-3]  # a learning rate frozen into the graph at its capture (step 2) would show
    runs = {}
    for graph in (False, True):
        eng = TrainEngine(cfg, params, batch=4, seq=64, graph=graph, optimizer=optimizer)
        losses = []
        for (x, y), lr in zip(batches, lrs):
            eng.step(cupy.asarray(x, dtype=np.int32), cupy.asarray(y, dtype=np.int32), lr=lr)
            losses.append(eng.last_loss())
        assert (eng._graph is not None) == graph and eng.t == len(batches)
        runs[graph] = losses, {n: p.get() for n, p in eng.params().items()}
    # rtol: kernel-by-kernel runs of this engine differ among themselves by up to 1.2e-5 in the losses of
    # steps 2-4 (the atomics below); a learning rate frozen at capture moves them by about 1e-2.
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=5e-5)
    # Not bit-exact: the embedding gradient and the gradient norm add with atomics, and AdamW turns the
    # last-bit differences of near-zero gradients into steps of size lr (two kernel-by-kernel runs differ
    # by up to 3e-3 here, the embedding most). Step 2's learning rate frozen into the graph would move
    # every weight by about 1e-2 in step 3 instead of 1e-4: weights of order 0.02 would change by half.
    # Muon moves every weight by about lr whatever its gradient's size, and its Newton-Schulz steps grow
    # such last-bit differences further (the directions of small singular values): 3e-2 (two
    # kernel-by-kernel-vs-graph runs differ by 1.1-1.7e-2); a frozen lr would still move weights by half.
    tol = 1e-2 if optimizer == "adamw" else 3e-2
    for n, p in runs[False][1].items():
        assert np.linalg.norm(runs[True][1][n] - p) <= tol * np.linalg.norm(p), n


@pytest.mark.gpu
def test_engine_head_weights_reach_the_captured_step():
    """The output heads' loss weights are read from the device each step: along a schedule that fades heads
    1 and 2 out, the graph-replayed steps' losses equal the kernel-by-kernel ones, each is the float64
    weighted loss of the weights the step started from, and after the last step (weights 1, 0, 0) heads 1
    and 2 have zero gradients (weights frozen at the capture, step 2's, would train them)."""
    import cupy

    from nanoeuler.kernels.bf16.engine import TrainEngine
    from nanoeuler.model import transformer
    from nanoeuler.model.config import ModelConfig
    from nanoeuler.optim import head_weights_at

    cfg = ModelConfig(vocab_size=256, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ctx_len=64, mtp_heads=3)
    params = transformer.init_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 256, (4, 64)), rng.integers(-1, 256, (4, 64, 3))) for _ in range(5)]
    weights = [head_weights_at(s, 5, [1.0, 0.5, 0.25], [1.0, 0.0, 0.0]) for s in range(5)]
    runs = {}
    for graph in (False, True):
        eng = TrainEngine(cfg, params, batch=4, seq=64, graph=graph)
        losses = []
        for (x, y), w in zip(batches, weights):
            before = {n: p.get().astype(np.float64) for n, p in eng.params().items()}
            eng.step(cupy.asarray(x, dtype=np.int32), cupy.asarray(y, dtype=np.int32), lr=1e-3, head_weights=w)
            losses.append(eng.last_loss())
            ref = transformer.forward_loss(before, x, y, cfg, head_weights=w)[0]
            assert losses[-1] == pytest.approx(ref, rel=1e-2)
        assert (eng._graph is not None) == graph
        grads = eng.grads()
        assert not grads["mtp_heads.1.weight"].any() and not grads["mtp_heads.2.weight"].any()
        assert grads["lm_head.weight"].any()
        runs[graph] = losses
    np.testing.assert_allclose(runs[True], runs[False], rtol=5e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_engine_update_from_equal_gradients_is_bit_identical(optimizer):
    """Two engines with the same weights given the same gradients, as every data-parallel rank is after the
    all-reduce, make the same updates to the last bit, step after step: the gradient norm (clipping is on
    here) and Muon's matrix norms add their partial sums in a fixed order, where float atomics would add
    them in the order the blocks finish."""
    import cupy

    from nanoeuler.kernels.bf16.engine import TrainEngine
    from nanoeuler.model import transformer
    from nanoeuler.model.config import ModelConfig

    cfg = ModelConfig(vocab_size=512, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ctx_len=64, mtp_heads=2)
    params = transformer.init_params(cfg, seed=0)
    rng = np.random.default_rng(1)
    engines = [TrainEngine(cfg, params, batch=2, seq=64, optimizer=optimizer) for _ in range(2)]
    for _ in range(3):
        grads = {n: (0.01 * rng.standard_normal(p.shape)).astype(np.float32) for n, p in params.items()}
        for eng in engines:
            for n, view in eng.grads().items():
                view[...] = cupy.asarray(grads[n])
            eng.recompute_grad_norm()
            eng.optimizer_step(1e-2)
        cupy.cuda.get_current_stream().synchronize()
        a, b = engines
        assert a.grad_norm() > 1.0  # clipped: the norm's last bit reaches every weight
        for buf in ("sq", "P", "Pb", "Mo", "Vo"):
            assert cupy.array_equal(getattr(a, buf), getattr(b, buf)), buf


@pytest.mark.gpu
def test_engine_doctests():
    import doctest

    from nanoeuler.kernels.bf16 import engine

    assert doctest.testmod(engine).failed == 0


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_training_loop_in_bf16_resumes_from_its_checkpoint(tmp_path, optimizer):
    from nanoeuler import checkpoint
    from nanoeuler.train import loop

    extra = {} if optimizer == "adamw" else dict(optimizer="muon", schedule="wsd", muon_lr=3e-3)
    run = _loop_run(tmp_path, "bf16", 10, **extra)
    loop.train(run)
    full = _losses(run)
    final, _ = checkpoint.load(run.run_dir / "ckpt_00000010.bin")
    assert ("optim.v.layers.0.mlp.down_proj.weight" in final) == (optimizer == "adamw")
    (run.run_dir / "ckpt_00000010.bin").unlink()
    run.out.unlink()
    loop.train(_loop_run(tmp_path, "bf16", 10, **extra))  # resumes from step 5
    resumed = _losses(run)
    assert len(resumed) == 10
    assert np.allclose(resumed, full, rtol=1e-3), (full, resumed)
    again, meta = checkpoint.load(run.run_dir / "ckpt_00000010.bin")
    assert int(meta["optim_t"]) == 10
    # Not bit-exact: the embedding backward and the gradient norm add float32 with atomics, in an order
    # that varies, and AdamW turns such last-digit differences of a near-zero gradient into a whole
    # step of size lr for that weight, so single weights may differ by ~lr. A broken resume (moments,
    # step count or data order lost) moves every weight: compare the whole tensors.
    # Under Muon every weight moves by about lr a step and the Newton-Schulz steps grow last-bit
    # differences (7e-3 seen at muon_lr 1e-2); a lost momentum or step count moves weights by tens of %.
    for w in ("layers.0.mlp.down_proj.weight", "embed_tokens.weight"):
        rel = np.linalg.norm(again[w] - final[w]) / np.linalg.norm(final[w])
        assert rel < (1e-3 if optimizer == "adamw" else 2e-2), (w, rel)


@pytest.mark.gpu
def test_tensor_maps_encode_bf16_matrices_and_refuse_others():
    """A tensor map is 128 bytes on the device; float32 data or a misaligned row stride is refused with
    the reason, before the driver sees it."""
    import cupy

    from nanoeuler.kernels.tma import gate_up_map, heads_map, tile_map

    words = cupy.zeros((300, 768), dtype=np.uint16)
    m = tile_map(words, 128)
    assert m.shape == (128,) and m.dtype == np.uint8 and int(m.any()) == 1
    with pytest.raises(ValueError, match="bf16 words"):
        tile_map(cupy.zeros((300, 768), dtype=np.float32), 128)
    with pytest.raises(ValueError, match="row stride"):
        tile_map(cupy.zeros((300, 770), dtype=np.uint16)[:, :768], 128)
    g = gate_up_map(cupy.zeros((4096, 768), dtype=np.uint16))  # the 5-D view of a gate/up weight
    assert g.shape == (128,) and int(g.any()) == 1
    with pytest.raises(ValueError, match="F % 64 == 0"):
        gate_up_map(cupy.zeros((2 * 96, 768), dtype=np.uint16))
    h = heads_map(cupy.zeros((2, 12, 512, 64), dtype=np.uint16))  # q (B, H, T, 64): a box per head and 64 positions
    assert h.shape == (128,) and int(h.any()) == 1
    with pytest.raises(ValueError, match="T % 64 == 0"):
        heads_map(cupy.zeros((2, 12, 200, 64), dtype=np.uint16))
    with pytest.raises(ValueError, match=r"\(B, heads, T, 64\)"):
        heads_map(cupy.zeros((2, 12, 512, 32), dtype=np.uint16))


@pytest.mark.gpu
def test_engine_stepper_grad_hook_path_matches_the_graph_step():
    """The bf16 stepper with a grad_hook (forward/backward, the hook on the engine's gradient views, the
    norm again, the update) computes what the captured step computes; a hook that doubles the gradients,
    as a sum over two equal data-parallel ranks would, doubles the norm."""
    import cupy

    from nanoeuler.config import validate
    from nanoeuler.model import transformer
    from nanoeuler.model.config import ModelConfig
    from nanoeuler.train.config import PretrainConfig
    from nanoeuler.train.stepper import make_stepper

    cfg = ModelConfig(vocab_size=256, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ctx_len=64, mtp_heads=2)
    settings = PretrainConfig.from_section(dict(validate({})["pretrain"], batch_size=4, precision="bf16"))
    params = transformer.init_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 256, (4, 64)), rng.integers(-1, 256, (4, 64, 2))) for _ in range(4)]
    calls = []
    plain = make_stepper(settings, cfg, params, cupy)
    hooked = make_stepper(settings, cfg, params, cupy, grad_hook=lambda g: calls.append(len(g)))
    # Not bit-exact, as in the graph test above: the embedding gradient and the gradient norm add with
    # atomics (and the hook path sums the squares in another order), and AdamW turns last-bit differences
    # of near-zero gradients into steps of size lr; a norm not recomputed after the hook would be far off.
    for (x, y), lr in zip(batches, [1e-3, 1e-2, 1e-4, 3e-3]):
        (loss, norm), (ref_loss, ref_norm) = hooked.step([(x, y)], lr), plain.step([(x, y)], lr)
        assert loss == pytest.approx(ref_loss, rel=5e-5) and norm == pytest.approx(ref_norm, rel=1e-3)
    assert calls == [len(params)] * 4 and hooked.t == plain.t == 4

    def double(grads):
        for g in grads.values():
            g *= 2

    fresh = make_stepper(settings, cfg, params, cupy)
    doubled = make_stepper(settings, cfg, params, cupy, grad_hook=double)
    norm = fresh.step([batches[0]], 1e-3)[1]
    assert doubled.step([batches[0]], 1e-3)[1] == pytest.approx(2 * norm, rel=1e-5)

    # a hook that only queues GPU work (`in_graph`, as the data-parallel all-reduce) runs inside the step's
    # CUDA graph: the same losses and norms as the hook run kernel by kernel, steps after the first replayed
    def double_in_graph(grads):
        double(grads)

    double_in_graph.in_graph = True

    eager = make_stepper(settings, cfg, params, cupy, grad_hook=double)
    graphed = make_stepper(settings, cfg, params, cupy, grad_hook=double_in_graph)
    for (x, y), lr in zip(batches, [1e-3, 1e-2, 1e-4, 3e-3]):
        (loss, norm), (ref_loss, ref_norm) = graphed.step([(x, y)], lr), eager.step([(x, y)], lr)
        assert loss == pytest.approx(ref_loss, rel=5e-5) and norm == pytest.approx(ref_norm, rel=1e-3)
    assert graphed.engine._graph is not None and eager.engine._graph is None
