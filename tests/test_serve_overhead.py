"""The server's hot path, held to what it replaced: a step's tokens cross to the HTTP process in one message, a stream
that fell behind gets them in one write (each still its own OpenAI chunk), chunks built from a template are
the JSON of the chunk objects, the latency histograms count as `prometheus_client`'s do, decode steps cover
only the slots in use, and streams that join together are prefilled together."""

import asyncio
import json
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
prometheus_client = pytest.importorskip("prometheus_client")

from nanoeuler.infer.sampling import Sampling  # noqa: E402
from nanoeuler.serve.app import _event, _events, _Shape, _Text  # noqa: E402
from nanoeuler.serve.backend import _TokenBytes  # noqa: E402
from nanoeuler.serve.metrics import ITL_BUCKETS, _Histogram  # noqa: E402
from nanoeuler.serve.engine_proc import EngineProcess, RemoteJob, _Wire  # noqa: E402
from nanoeuler.serve.scheduler import END, Scheduler  # noqa: E402
from serve_fixtures import run_streams  # noqa: E402
from train_fixtures import make_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def served(tok, name="m"):
    """What the HTTP layer asks of a backend, without an engine."""
    return SimpleNamespace(
        name=name, tok=tok, stop_ids=frozenset({tok.end_id, tok.eot_id}), token_bytes=_TokenBytes(tok)
    )


# ---- the engine to the event loop ----------------------------------------------------------------------


class CountingBackend:
    """Every stream yields 1, 2, 3, ...; `step` waits for `gate`, so jobs submitted before it opens share steps."""

    stop_ids = frozenset()
    prefixes = free_slots = engine = None
    speculative = False

    def __init__(self):
        self.gate, self.steps = threading.Event(), 0

    def open(self, prompt_ids, max_new_tokens, sampling, stop_at_end=True):
        import itertools

        from nanoeuler.serve.backend import TokenStream

        return TokenStream(max_new_tokens, frozenset(), (t for t in itertools.count(1)))

    def step(self, streams):
        self.gate.wait()
        self.steps += 1
        return [[s.advance()] for s in streams]


class Pipe:
    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)


def test_a_steps_tokens_cross_in_one_message_and_a_late_reader_gets_them_together():
    """The engine's side (the scheduler, `_Wire`) into this side's (`EngineProcess._step`, `RemoteJob.batches`),
    the pipe between them a list: three jobs of five tokens are five messages, not fifteen, and a reader that
    comes once all have arrived gets each job's tokens in one batch."""
    backend, pipe = CountingBackend(), Pipe()
    wire = _Wire(pipe, backend)
    scheduler = wire.scheduler = Scheduler(backend, 4, 0, wire).start()

    async def scenario():
        engine = EngineProcess(None)
        specs = [([0], 5, Sampling(), True, {})] * 3
        jobs = engine.submit_many(specs)
        scheduler.submit_many(specs, keys=[job.key for job in jobs])
        backend.gate.set()
        while sum(end is not None for _, news in pipe.sent for *_, end in news[0]) < 3:
            await asyncio.sleep(0.01)
        for kind, payload in pipe.sent:
            assert kind == "step"
            engine._step(*payload)
        batches = [[b async for b in job.batches()] for job in jobs]
        return batches, engine.stats()

    batches, stats = asyncio.run(scenario())
    scheduler.stop()
    assert backend.steps == 5 and len(pipe.sent) == 5  # the end goes with the last tokens
    assert batches == [[[1, 2, 3, 4, 5]]] * 3 and stats["finished"] == 3 and stats["tokens"] == 15
    assert pipe.sent[-1][1][2]["free_slots"] is None  # the engine's counters come with the ends


def test_batches_give_the_tokens_before_a_failure_then_raise_it():
    async def scenario():
        job = RemoteJob(None, 0)
        job._arrive([7, 8])
        got = []
        with pytest.raises(RuntimeError, match="broke"):
            async for batch in job.batches():
                got.append(batch)
                if batch == [7, 8]:
                    job._arrive([9, RuntimeError("broke")])
        return got

    assert asyncio.run(scenario()) == [[7, 8], [9]]


# ---- server-sent events ---------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(["chat", "text"]),
    index=st.integers(0, 15),
    piece=st.text(max_size=12),
    finish=st.sampled_from([None, "stop", "length"]),
    name=st.text(min_size=1, max_size=8),
)
def test_an_event_from_the_template_is_the_json_of_its_chunk(tok, kind, index, piece, finish, name):
    shape = _Shape(kind, served(tok, name), 3, None)
    got = shape.event(index, piece, finish)
    assert got == _event(shape.chunk(index, piece, finish))
    assert json.loads(got[len("data: ") :]) == shape.chunk(index, piece, finish)


def test_a_stream_that_fell_behind_gets_its_pieces_in_one_write_each_its_own_chunk(tok):
    """Everything a job generated has arrived before the stream is read: one write of the pieces (an OpenAI
    chunk each), then one of the finish, the usage and [DONE]."""
    ids = tok.encode("Paris is the capital.")
    backend = served(tok)

    async def scenario():
        job = RemoteJob(None, 0)
        job.generated, job.outcome = len(ids), "finished"  # as `EngineProcess._step` leaves an ended job
        job._arrive(ids + [END])
        shape = _Shape("text", backend, 4, None)
        return [w async for w in _events([job], [_Text(job, backend, ())], shape, True, "rid")]

    writes = asyncio.run(scenario())
    assert len(writes) == 2
    chunks = [json.loads(e[len("data: ") :]) for e in writes[0].split("\n\n") if e]
    assert len(chunks) == len(ids) and "".join(c["choices"][0]["text"] for c in chunks) == "Paris is the capital."
    assert [c["choices"][0]["index"] for c in chunks] == [0] * len(ids) and len({c["id"] for c in chunks}) == 1
    tail = writes[1].split("\n\n")
    assert json.loads(tail[0][6:])["choices"][0]["finish_reason"] == "length"
    assert json.loads(tail[1][6:])["usage"]["completion_tokens"] == len(ids)
    assert tail[2] == "data: [DONE]" and tail[3] == ""


# ---- /metrics -------------------------------------------------------------------------------------------


def test_latency_histograms_read_as_prometheus_clients_own():
    values = [float(v) for v in np.random.default_rng(0).exponential(0.01, 300)] + [0.001, 0.0025, 2.5, 9.0, 0.0]
    ref_registry, ours_registry = prometheus_client.CollectorRegistry(), prometheus_client.CollectorRegistry()
    ref = prometheus_client.Histogram("x_seconds", "x", buckets=ITL_BUCKETS, registry=ref_registry)
    for v in values:
        ref.observe(v)
    ours = _Histogram("x_seconds", "x", ITL_BUCKETS)
    ours_registry.register(ours)
    ours.observe_many(values[:100])
    ours.observe_many([])
    ours.observe_many(values[100:])
    want = [
        line for line in prometheus_client.generate_latest(ref_registry).decode().splitlines() if "_created" not in line
    ]
    got = prometheus_client.generate_latest(ours_registry).decode().splitlines()
    assert got[:-1] == want[:-1]  # the buckets and the count; the sum as a float added in another order:
    assert float(got[-1].split()[-1]) == pytest.approx(float(want[-1].split()[-1]), rel=1e-12)


# ---- the engine's side ----------------------------------------------------------------------------------


def test_decode_steps_cover_the_slots_in_use_and_joining_prompts_are_prefilled_together(tok):
    """On 8 slots: one stream decodes 1 row, three decode 4 (the power of two holding slots 0-2), prefilled in
    one `prefill_many`; the tokens are those of each stream alone."""
    from nanoeuler.infer.engine import DecodeEngine
    from nanoeuler.model.config import ModelConfig
    from nanoeuler.model.transformer import head_weight_names, init_params
    from nanoeuler.serve.backend import Backend
    from train_fixtures import TINY_MODEL

    cfg = ModelConfig.from_section(TINY_MODEL, tok.vocab_size)
    params = init_params(cfg, 3, dtype=np.float64)
    for name in head_weight_names(cfg):
        params[name] = params[name] * 20.0  # sharp heads: no near-ties
    backend = Backend(DecodeEngine.from_params(params, cfg, "cpu"), tok, "m", slots=8, prefix_cache=0)
    be, widths, prefills = backend.engine.backend, [], []
    decode, prefill_many = be.decode, be.prefill_many
    be.decode = lambda tokens, *a: (widths.append(len(tokens)), decode(tokens, *a))[1]
    be.prefill_many = lambda slots, prompts: (prefills.append(list(slots)), prefill_many(slots, prompts))[1]
    specs = [
        ([1, 2, 3], 6, Sampling(temperature=0), {}),
        ([4, 5], 6, Sampling(temperature=0.8, seed=3), {}),
        ([6], 6, Sampling(temperature=0), {}),
    ]
    alone = [run_streams(backend, [spec])[0][0] for spec in specs]
    assert set(widths) == {1} and prefills == []
    widths.clear()
    together, _ = run_streams(backend, specs)
    assert together == alone and set(widths) == {4} and prefills == [[0, 1, 2]]
    assert backend.free_slots == 8
