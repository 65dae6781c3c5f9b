"""The server's backend on the GPU engine (needs CuPy and a CUDA device; skipped otherwise): streams asking for
log-probabilities go through `GpuBackend.decode_logits`; their tokens and log-probabilities against the NumPy
backend's, greedy, with streams of other settings in the same batch."""

import numpy as np
import pytest

from nanoeuler.infer.engine import Engine
from nanoeuler.infer.generate import Sampling
from nanoeuler.model import transformer
from nanoeuler.model.config import ModelConfig

pytestmark = pytest.mark.gpu


class _Tok:
    end_id, eot_id = 298, 299


def _run(backend, specs):
    streams = [backend.open(p, n, s, stop_at_end=False, **o) for p, n, s, o in specs]
    got = [[] for _ in streams]
    while any(not s.done for s in streams):
        live = [i for i, s in enumerate(streams) if not s.done]
        for i, t in zip(live, backend.step([streams[i] for i in live])):
            assert not isinstance(t, Exception), t
            got[i].append(t)
    return got, streams


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-4), ("bf16", 5e-2)])
def test_gpu_logprobs_match_the_numpy_backend(dtype, tol):
    pytest.importorskip("cupy")
    from nanoeuler.backend import gpu_unavailable_reason
    from nanoeuler.serve.backend import Backend

    if gpu_unavailable_reason():
        pytest.skip(gpu_unavailable_reason())
    cfg = ModelConfig(vocab_size=300, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ctx_len=48, mtp_heads=4)
    params = transformer.init_params(cfg, seed=3, dtype=np.float64)
    for name in transformer.head_weight_names(cfg):
        params[name] = params[name] * 30  # far-from-uniform logits: no near-ties
    specs = [([1, 2, 3], 10, Sampling(temperature=0), {"logprobs": 2}), ([5, 6], 8, Sampling(temperature=0), {}),
             ([9], 6, Sampling(temperature=0), {"logprobs": 0})]
    cpu_tokens, cpu_streams = _run(Backend(Engine.from_params(params, cfg, "cpu"), _Tok(), "m", 3, 0), specs)
    gpu_tokens, gpu_streams = _run(Backend(Engine.from_params(params, cfg, "gpu", dtype=dtype), _Tok(), "m", 3, 0),
                                   specs)
    assert gpu_tokens == cpu_tokens
    for c, g in zip(cpu_streams, gpu_streams):
        assert len(g.records) == len(c.records)
        for (clp, calts), (glp, galts) in zip(c.records, g.records):
            assert abs(glp - clp) <= tol * max(1.0, abs(clp))
            assert [a for a, _ in galts] == [a for a, _ in calts]
