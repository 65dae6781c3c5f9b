"""The server's backend on the GPU engine (needs CuPy and a CUDA device; skipped otherwise): streams asking for
log-probabilities go through `GpuBackend.decode_logits`; their tokens and log-probabilities against the NumPy
backend's, greedy, with streams of other settings in the same batch; prompts that reuse a cached prefix
(`GpuBackend.prefill_from`) answer as without reuse."""

import numpy as np
import pytest

from nanoeuler.infer.engine import Engine
from nanoeuler.infer.generate import Sampling
from nanoeuler.model import transformer
from nanoeuler.model.config import ModelConfig
from serve_fixtures import run_streams

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


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-4), ("bf16", 5e-2)])
def test_gpu_logprobs_match_the_numpy_backend(model, dtype, tol):
    from nanoeuler.serve.backend import Backend

    params, cfg = model
    specs = [([1, 2, 3], 10, Sampling(temperature=0), {"logprobs": 2}), ([5, 6], 8, Sampling(temperature=0), {}),
             ([9], 6, Sampling(temperature=0), {"logprobs": 0})]
    cpu_tokens, cpu_streams = run_streams(Backend(Engine.from_params(params, cfg, "cpu"), _Tok(), "m", 3, 0), specs)
    gpu_engine = Engine.from_params(params, cfg, "gpu", dtype=dtype)
    gpu_tokens, gpu_streams = run_streams(Backend(gpu_engine, _Tok(), "m", 3, 0), specs)
    assert gpu_tokens == cpu_tokens
    for c, g in zip(cpu_streams, gpu_streams):
        assert len(g.records) == len(c.records)
        for (clp, calts), (glp, galts) in zip(c.records, g.records):
            assert abs(glp - clp) <= tol * max(1.0, abs(clp))
            assert [a for a, _ in galts] == [a for a, _ in calts]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_prefix_reuse_answers_as_a_whole_prefill(model, dtype):
    from nanoeuler.serve.backend import Backend

    params, cfg = model
    head = list(range(10, 50))  # 40 shared tokens; remainders on the GEMV (< 17 rows) and cuBLAS paths
    specs = [(head + [60, 61], 8, Sampling(temperature=0), {}), (head + [70], 8, Sampling(temperature=0), {}),
             (head + list(range(100, 130)), 8, Sampling(temperature=0), {})]
    outs = []
    for cache in (0, 8):
        backend = Backend(Engine.from_params(params, cfg, "gpu", dtype=dtype), _Tok(), "m", 1, cache)
        outs.append([run_streams(backend, [spec])[0][0] for spec in specs])
    assert outs[1] == outs[0] and backend.prefixes.hits == 2 and backend.prefixes.tokens == 2 * len(head)
