"""The decode engine's GPU backend (needs CuPy and a CUDA device; skipped otherwise): logits against the
NumPy backend, greedy tokens against the reference `Generator`, speculative greedy equal to plain greedy,
the cuBLAS (wide batch) path equal to the GEMV path, and the sampling kernel's distribution."""

import numpy as np
import pytest

from nanoeuler.infer.engine import DecodeEngine
from nanoeuler.infer.generate import Generator
from nanoeuler.infer.sampling import Sampling, sampling_probs
from nanoeuler.model import transformer
from nanoeuler.model.config import ModelConfig

pytestmark = pytest.mark.gpu
GREEDY = Sampling(temperature=0.0)


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("cupy")
    from nanoeuler.backend import gpu_unavailable_reason

    if gpu_unavailable_reason():
        pytest.skip(gpu_unavailable_reason())
    cfg = ModelConfig(vocab_size=300, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ctx_len=48, mtp_heads=4)
    params = transformer.init_params(cfg, seed=3, dtype=np.float64)
    for name in transformer.head_weight_names(cfg):
        params[name] = params[name] * 30  # far-from-uniform logits: no near-ties
    return params, cfg


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("dtype,tol", [("fp32", 2e-5), ("bf16", 3e-2)])
def test_prefill_and_verify_logits_match_numpy(model, dtype, tol):
    params, cfg = model
    cpu = DecodeEngine.from_params(params, cfg, "cpu").backend
    gpu = DecodeEngine.from_params(params, cfg, "gpu", dtype=dtype).backend
    rng = np.random.default_rng(0)
    for T in (5, 40):  # the GEMV path and the cuBLAS path
        ids = rng.integers(0, cfg.vocab_size, T)
        cpu.start(1), gpu.start(1)
        assert _rel(gpu.prefill(0, ids), cpu.prefill(0, ids)) < tol
        block = rng.integers(0, cfg.vocab_size, 4)
        assert _rel(gpu.verify(block, T), cpu.verify(block, T)) < tol
        got, want = gpu.verify_argmax(block, T), cpu.verify_argmax(block, T)
        if dtype == "fp32":
            np.testing.assert_array_equal(got, want)
        else:  # bf16 may flip a near-tie: the id it picks must be within rounding of the best logit
            logits = cpu.verify(block, T)
            best = np.take_along_axis(logits, want[..., None], -1)[..., 0]
            picked = np.take_along_axis(logits, got[..., None], -1)[..., 0]
            assert np.all(best - picked <= 0.05 * np.abs(best).max())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_greedy_plain_speculative_and_batched(model, dtype):
    params, cfg = model
    ref = Generator(params, cfg)
    eng = DecodeEngine.from_params(params, cfg, "gpu", dtype=dtype)
    prompts = [[5, 17, 42, 8], [1], list(range(30, 60))]
    n = cfg.ctx_len + 20  # across a context slide
    want = [ref.generate(p, n, GREEDY) for p in prompts]
    plain = [list(eng.stream(p, n, GREEDY, speculative=False)) for p in prompts]
    spec = [list(eng.stream(p, n, GREEDY, speculative=True)) for p in prompts]
    assert spec == plain  # the engine's own greedy, token for token
    if dtype == "fp32":
        assert plain == want
    else:  # bf16: the same until a near-tie; these logits have none in the first steps
        for i, (a, b) in enumerate(zip(plain, want)):
            assert a[:8] == b[:8], f"prompt {i}: {a[:8]} against the reference's {b[:8]}"
    wide = [prompts[i % 3] for i in range(20)]  # 20 rows: the cuBLAS path inside the decode graph
    got = eng.generate(wide, 12, GREEDY)
    assert got == [[t for t in plain[i % 3][:12]] for i in range(20)] or dtype == "bf16"
    assert got[:3] == eng.generate(prompts, 12, GREEDY) or dtype == "bf16"


@pytest.mark.parametrize("dtype,tol", [("fp32", 2e-5), ("bf16", 3e-2)])
def test_prefill_many_matches_numpy_across_chunks(model, dtype, tol):
    """Ragged prompts of several slots in one go: 3 rows (the GEMV path) and 70 rows in two chunks of the
    context (48) through the cuBLAS path; the caches then serve a verify pass of each slot."""
    params, cfg = model
    cpu = DecodeEngine.from_params(params, cfg, "cpu").backend
    gpu = DecodeEngine.from_params(params, cfg, "gpu", dtype=dtype).backend
    rng = np.random.default_rng(4)
    for lens in ((1, 2), (5, 40, 1, 24)):
        prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in lens]
        cpu.start(len(lens)), gpu.start(len(lens))
        got = gpu.prefill_many(list(range(len(lens))), prompts)
        want = cpu.prefill_many(list(range(len(lens))), prompts)
        for b in range(len(lens)):
            assert _rel(got[b], want[b]) < tol
        block = rng.integers(0, cfg.vocab_size, 4)
        assert _rel(gpu.verify(block, lens[0]), cpu.verify(block, lens[0])) < tol  # slot 0's cache


@pytest.mark.parametrize("dtype,tol", [("fp32", 2e-5), ("bf16", 3e-2)])
def test_one_row_attention_over_a_cluster_matches_numpy(model, dtype, tol):
    """A one-row pass (the decode step's layer) attends with the keys split over a cluster of 8 blocks
    (attend_o_cluster): against NumPy, and against attend_o (every block over all keys), at positions
    where every block attends alone, and where some of the 8 blocks have no key, one, and several."""
    from nanoeuler.infer.gpu import GpuBackend

    params, cfg = model
    cpu = DecodeEngine.from_params(params, cfg, "cpu").backend
    split, whole = GpuBackend(params, cfg, dtype), GpuBackend(params, cfg, dtype)
    whole.variants.attend_cluster = False
    split.variants.alone_keys = 2  # the blocks exchange their partial results from 3 keys on
    if not split.variants.attend_cluster:
        pytest.skip("thread block clusters need compute capability 9.0")
    ids = np.random.default_rng(9).integers(0, cfg.vocab_size, cfg.ctx_len)
    for be in (cpu, split, whole):
        be.start(1)
        be.prefill(0, ids)
    for pos in (0, 3, 9, 30, cfg.ctx_len - 1):
        got, other, want = split.verify([ids[pos]], pos), whole.verify([ids[pos]], pos), cpu.verify([ids[pos]], pos)
        assert _rel(got, want) < tol and _rel(got, other) < max(tol / 10, 1e-5)


def test_one_row_greedy_id_is_the_argmax_of_head_zero(model):
    """A one-row greedy step takes its id in the head's own kernel (head_argmax): the argmax of the logits
    that the same layers give, and the lowest id where logits tie (np.argmax's choice)."""
    from nanoeuler.infer.gpu import GpuBackend

    params, cfg = model
    head0 = transformer.head_weight_names(cfg)[0]
    tied = dict(params, **{head0: np.tile(params[head0][5], (cfg.vocab_size, 1))})  # every logit the same
    ids = np.random.default_rng(10).integers(0, cfg.vocab_size, 20)
    for p, tie in ((params, False), (tied, True)):
        be = GpuBackend(p, cfg, "bf16")
        be.start(1)
        be.prefill(0, ids)
        for pos in (3, 11, 19):
            got = be.decode(np.array([ids[pos]]), np.array([pos]), GREEDY, 0, [None], np.ones(1, bool))
            want = 0 if tie else int(np.argmax(be.verify([ids[pos]], pos)[0, 0]))
            assert int(got[0]) == want


def test_tensor_core_gemv_matches_the_float_gemv():
    """2 to 16 rows of bf16 weights take the tensor-core GEMVs (x as bf16 hi + lo): against the float GEMV
    on the same bf16 weights far inside bf16's rounding, against NumPy within it. ffn_hidden 1536 puts
    the down projection on the 8-chunk kernels, the rest on the 4-chunk ones."""
    from nanoeuler.infer.gpu import GpuBackend

    cfg = ModelConfig(
        vocab_size=300, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ctx_len=48, mtp_heads=4, ffn_hidden=1536
    )
    params = transformer.init_params(cfg, seed=5, dtype=np.float64)
    cpu = DecodeEngine.from_params(params, cfg, "cpu").backend
    tc, ffma = GpuBackend(params, cfg, "bf16"), GpuBackend(params, cfg, "bf16")
    ffma.variants.tensor_cores = False
    rng = np.random.default_rng(8)
    ids = rng.integers(0, cfg.vocab_size, 12)
    for be in (cpu, tc, ffma):
        be.start(1)
        be.prefill(0, ids)
    for t in (2, 4, 7, 16):
        block = rng.integers(0, cfg.vocab_size, t)
        got, same, want = tc.verify(block, 12), ffma.verify(block, 12), cpu.verify(block, 12)
        assert _rel(got, same) < 5e-3 and _rel(got, want) < 3e-2


def test_programmatic_dependent_launch_changes_nothing(model):
    """PDL only lets kernels start early (each waits for the one before it inside): the same logits as
    ordinary launches, bit for bit for a cuBLAS-path prefill, to float rounding for a verify pass (GEMV
    kernels, where the one-row layer's branches join by atomicAdd in no fixed order), and the same greedy
    tokens of wide-batch decoding."""
    from nanoeuler.infer.gpu import GpuBackend

    params, cfg = model
    on, off = GpuBackend(params, cfg, "bf16", pdl=True), GpuBackend(params, cfg, "bf16", pdl=False)
    import cupy

    if int(cupy.cuda.Device().compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    assert on.pdl is not None and off.pdl is None
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, 21)
    for be in (on, off):
        be.start(1)
    np.testing.assert_array_equal(on.prefill(0, ids), off.prefill(0, ids))
    for _ in range(3):  # eager, recorded, replayed
        np.testing.assert_allclose(on.verify(ids[:4], 21), off.verify(ids[:4], 21), rtol=1e-4, atol=1e-4)
    prompts = [list(ids[: 3 + i % 7]) for i in range(20)]
    assert DecodeEngine(on, cfg).generate(prompts, 6, GREEDY, speculative=False) == DecodeEngine(off, cfg).generate(
        prompts, 6, GREEDY, speculative=False
    )


def test_sampling_kernel_draws_from_sampling_probs(model):
    import cupy as cp

    from nanoeuler.kernels.decode import Launch, sampling

    V, R = 50, 20000
    z = np.random.default_rng(1).normal(size=V).astype(np.float32) * 2
    logits = cp.asarray(np.tile(z, (R, 1)))
    go = Launch("fp32")
    for T, k, p in ((1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8), (1.0, 20, 0.9)):
        ctl = np.array([k, 7, 0, 0], np.int32)
        ctl[2:] = np.array([T, p], np.float32).view(np.int32)
        out = cp.zeros(R, cp.int32)
        seeds = cp.arange(R, dtype=cp.uint64) * 0x9E3779B97F4A7C15
        sampling.sample_rows(go, logits, V, V, cp.asarray(ctl), seeds, out, R)
        freq = np.bincount(out.get(), minlength=V) / R
        want = sampling_probs(z, T, k, p)
        assert np.all(freq[want == 0] == 0)
        np.testing.assert_allclose(freq, want, atol=0.012)
