"""The server's backend on the GPU engine (needs CuPy and a CUDA device; skipped otherwise): streams asking for
log-probabilities go through `GpuBackend.decode_logits`; their tokens and log-probabilities against the NumPy
backend's, greedy, with streams of other settings in the same batch; prompts that reuse a cached prefix
(`GpuBackend.prefill_from`) answer as without reuse."""

import numpy as np
import pytest

from nanoeuler.infer.engine import DecodeEngine
from nanoeuler.infer.sampling import Sampling
from nanoeuler.model import transformer
from nanoeuler.model.config import ModelConfig
from serve_fixtures import joining_jobs, run_joining, run_streams

pytestmark = pytest.mark.gpu


class _Tok:
    end_id, eot_id = 298, 299


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("cupy")
    from nanoeuler.backend import gpu_unavailable_reason

    if gpu_unavailable_reason():
        pytest.skip(gpu_unavailable_reason())
    cfg = ModelConfig(vocab_size=300, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ctx_len=96, mtp_heads=4)
    params = transformer.init_params(cfg, seed=3, dtype=np.float64)
    for name in transformer.head_weight_names(cfg):
        params[name] = params[name] * 30  # far-from-uniform logits: no near-ties
    return params, cfg


def _assert_near_greedy(params, cfg, specs, got, want, dtype):
    """fp32: the NumPy backend's tokens exactly. bf16 may flip a near-tie (its KV cache and GEMV paths round
    differently, e.g. several streams prefilled as one batch), after which the streams differ: every token it
    picks must then be the float64 model's best next token, given the GPU's own prefix, within rounding."""
    if dtype == "fp32":
        assert got == want
        return
    for (prompt, *_), ids in zip(specs, got):
        seq = np.asarray([list(prompt) + ids[:-1]])
        logits = transformer.logits(params, seq, cfg)[0, len(prompt) - 1 :]  # (len(ids), V)
        picked = logits[np.arange(len(ids)), ids]
        assert np.all(logits.max(-1) - picked <= 0.05 * np.abs(logits).max()), (prompt, ids)


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-4), ("bf16", 5e-2)])
def test_gpu_logprobs_match_the_numpy_backend(model, dtype, tol):
    from nanoeuler.serve.backend import Backend

    params, cfg = model
    specs = [
        ([1, 2, 3], 10, Sampling(temperature=0), {"logprobs": 2}),
        ([5, 6], 8, Sampling(temperature=0), {}),
        ([9], 6, Sampling(temperature=0), {"logprobs": 0}),
    ]
    cpu = Backend(DecodeEngine.from_params(params, cfg, "cpu"), _Tok(), "m", 3, 0)
    gpu = Backend(DecodeEngine.from_params(params, cfg, "gpu", dtype=dtype), _Tok(), "m", 3, 0)
    cpu_tokens, cpu_streams = run_streams(cpu, specs)
    gpu_tokens, gpu_streams = run_streams(gpu, specs)
    _assert_near_greedy(params, cfg, specs, gpu_tokens, cpu_tokens, dtype)
    for c, g, cids, gids in zip(cpu_streams, gpu_streams, cpu_tokens, gpu_tokens):
        if cids != gids:  # a bf16 near-tie flipped: the records after it belong to another text
            continue
        assert len(g.records) == len(c.records)
        for (clp, calts), (glp, galts) in zip(c.records, g.records):
            assert abs(glp - clp) <= tol * max(1.0, abs(clp))
            assert [a for a, _ in galts] == [a for a, _ in calts]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_prefix_reuse_answers_as_a_whole_prefill(model, dtype):
    from nanoeuler.serve.backend import Backend

    params, cfg = model
    head = list(range(10, 50))  # 40 shared tokens; remainders on the GEMV (< 17 rows) and cuBLAS paths
    specs = [
        (head + [60, 61], 8, Sampling(temperature=0), {}),
        (head + [70], 8, Sampling(temperature=0), {}),
        (head + list(range(100, 130)), 8, Sampling(temperature=0), {}),
    ]
    outs = []
    for cache in (0, 8):
        backend = Backend(DecodeEngine.from_params(params, cfg, "gpu", dtype=dtype), _Tok(), "m", 1, cache)
        outs.append([run_streams(backend, [spec])[0][0] for spec in specs])
    assert outs[1] == outs[0] and backend.prefixes.hits == 2 and backend.prefixes.tokens == 2 * len(head)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_batched_speculation_answers_as_the_numpy_backend(model, dtype):
    """`GpuBackend.verify_argmax_many` (blocks of several slots in one pass, on the GEMV path for 2 streams and
    on cuBLAS for 5) under the server's speculation: the NumPy backend's greedy tokens, and its pass counts."""
    from nanoeuler.serve.backend import Backend

    params, cfg = model
    for n in (2, 5):
        specs = [([1 + i, 2, 3], 20 + 30 * (i == 0), Sampling(temperature=0), {}) for i in range(n)]
        backends = [
            Backend(DecodeEngine.from_params(params, cfg, dev, **kw), _Tok(), "m", n, 0, speculative=True)
            for dev, kw in (("cpu", {}), ("gpu", {"dtype": dtype}))
        ]
        (cpu_tokens, _), (gpu_tokens, _) = (run_streams(b, specs) for b in backends)
        _assert_near_greedy(params, cfg, specs, gpu_tokens, cpu_tokens, dtype)
        if dtype == "fp32":  # the same texts: the same drafts offered by each head
            assert backends[1].engine.stats.offered == backends[0].engine.stats.offered > [0] * (cfg.mtp_heads - 1)
        else:
            assert backends[1].engine.stats.offered > [0] * (cfg.mtp_heads - 1)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_greedy_chain_answers_as_the_numpy_backend(model, dtype):
    """Greedy streams on the GPU go through steps that feed themselves, queued ahead of the server
    (`GpuBackend.greedy_chain`): answers of several lengths (rows running on past their end), streams
    joining (the chain drained first) into reused slots, one sliding past the context (fp32: the bf16 check
    scores answers within one context), several tokens handed out in one step: the NumPy backend's greedy
    tokens, which decode one step at a time."""
    from nanoeuler.serve.backend import Backend

    params, cfg = model
    greedy = Sampling(temperature=0)
    specs = [
        ([1, 2, 3], 2 * cfg.ctx_len + 5 if dtype == "fp32" else cfg.ctx_len - 3, greedy),
        (list(range(5, 45)), 20, greedy),
        ([7], 9, greedy),
        ([9, 9], 12, greedy),
        ([4, 4, 4, 4], 1, greedy),
        ([11], 25, greedy),
    ]
    got = []
    for dev, kw in (("cpu", {}), ("gpu", {"dtype": dtype})):
        backend = Backend(DecodeEngine.from_params(params, cfg, dev, **kw), _Tok(), "m", 4, 0)
        got.append(run_joining(backend, specs, slots=4, join_at=5)[0])
    _assert_near_greedy(params, cfg, [(p, n, s, {}) for p, n, s in specs], got[1], got[0], dtype)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_streams_joining_a_running_chain_answer_as_the_numpy_backend(model, dtype, monkeypatch):
    """New greedy streams join the GPU's running chain (`_GreedyChain.join`: the prefill queued between its
    steps, the first token chosen and fed on the device), one after a reused prefix, one with a prompt the
    chain has no room for (it drains): the NumPy backend's greedy tokens. A warmed-up backend joins
    through recorded graphs and its row buffers only."""
    from nanoeuler.infer import gpu
    from nanoeuler.serve.backend import Backend

    params, cfg = model
    specs = joining_jobs(cfg.ctx_len)
    starts = []
    join = gpu._GreedyChain.join
    monkeypatch.setattr(gpu._GreedyChain, "join", lambda c, slot, ids, at: starts.append(at) or join(c, slot, ids, at))
    got = []
    for dev, kw in (("cpu", {}), ("gpu", {"dtype": dtype})):
        backend = Backend(DecodeEngine.from_params(params, cfg, dev, **kw), _Tok(), "m", 4, 8)
        if dev == "gpu":
            backend.warm_up()
            be = backend.engine.backend
            graphs, buffers = set(be._graphs), set(be._rows)
        got.append(run_joining(backend, specs, slots=4, join_at=2)[0])
    _assert_near_greedy(params, cfg, [(p, n, s, {}) for p, n, s in specs], got[1], got[0], dtype)
    assert len(starts) >= 2 and max(starts) > 0
    assert set(be._graphs) == graphs and set(be._rows) == buffers


def test_gpu_warm_up_records_every_shape_requests_take(model):
    """After `Backend.warm_up` on the GPU engine, requests of many prompt lengths (the few-row path, powers of
    two, the whole context), alone, in bunches and reusing a cached prefix, greedy (the chain), sampled and
    with log-probabilities at several widths, run only recorded CUDA graphs and allocate no new row buffers;
    the greedy answers are a backend's that never warmed up."""
    from nanoeuler.serve.backend import Backend

    params, cfg = model
    fresh, warm = (
        Backend(DecodeEngine.from_params(params, cfg, "gpu", dtype="bf16"), _Tok(), "m", 5, 8) for _ in range(2)
    )
    warm.warm_up()
    be = warm.engine.backend
    graphs, buffers = dict(be._graphs), set(be._rows)
    assert graphs and all(state != "seen" for state in graphs.values())  # each recorded, not only run once
    head = list(range(10, 50))
    greedy, hot = Sampling(temperature=0), Sampling(temperature=0.8, seed=3)
    batches = [
        [([1, 2, 3], 6, greedy, {})],
        [(list(range(1, 20)), 6, greedy, {}), ([4] * 7, 5, hot, {})],
        [(head + [60 + i], 8, greedy, {}) for i in range(4)],  # kept; the next batch reuses 39 rows of one
        [(list(range(2, 2 + cfg.ctx_len - 8)), 4, greedy, {"logprobs": 1}), (head, 6, hot, {"logprobs": 2})],
        [([5 + i, 6, 7], 4, greedy if i % 2 else hot, {}) for i in range(5)],
    ]
    for specs in batches:
        want, got = run_streams(fresh, specs)[0], run_streams(warm, specs)[0]
        assert [g for g, s in zip(got, specs) if s[2] is greedy] == [w for w, s in zip(want, specs) if s[2] is greedy]
    assert dict(be._graphs).keys() == graphs.keys() and set(be._rows) == buffers
    assert warm.prefixes.hits > 0
