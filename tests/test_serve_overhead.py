"""The server's hot path, held to what it replaced: a step's tokens cross to the HTTP process in one message, a stream
that fell behind gets them in one write (each still its own OpenAI chunk), chunks built from a template are
the JSON of the chunk objects, the latency histograms count as `prometheus_client`'s do, decode steps cover
only the slots in use, and streams that join together are prefilled together."""

import asyncio
import importlib.util
import json
import threading
from functools import cache, partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
prometheus_client = pytest.importorskip("prometheus_client")

from nanoeuler.infer.sampling import Sampling  # noqa: E402
from nanoeuler.serve.app import _event, _Shape, _stream, _Text  # noqa: E402
from nanoeuler.serve.backend import _TokenBytes  # noqa: E402
from nanoeuler.serve.metrics import ITL_BUCKETS, _Histogram  # noqa: E402
from nanoeuler.serve.engine_proc import EngineProcess, RemoteJob, _TokenText, _Wire  # noqa: E402
from nanoeuler.serve.scheduler import END, Scheduler  # noqa: E402
from serve_fixtures import joining_jobs, run_joining, run_streams  # noqa: E402
from train_fixtures import make_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def served(tok, name="m"):
    """What the HTTP layer asks of a backend, without an engine."""
    token_bytes = _TokenBytes(tok)
    return SimpleNamespace(
        name=name,
        tok=tok,
        stop_ids=frozenset({tok.end_id, tok.eot_id}),
        token_bytes=token_bytes,
        token_text=_TokenText(token_bytes),
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
    assert shape.event(index, piece, finish) == got  # the second time from `_Shape._TAILS`
    assert json.loads(got[len("data: ") :]) == shape.chunk(index, piece, finish)


def streamed(jobs, texts, shape, arrivals=None):
    """`_stream`'s writes (each a list of events and whether it ends the body), `arrivals()` run beside it."""
    writes = []

    async def write(events, last=False):
        writes.append((list(events), last))

    async def scenario():
        stream = asyncio.ensure_future(_stream(jobs, texts, shape, True, "rid", write))
        if arrivals is not None:
            await arrivals()
        await stream

    asyncio.run(scenario())
    return writes


def chunks(events):
    return [json.loads(e[len("data: ") :]) for e in events if e != "data: [DONE]\n\n"]


def test_a_stream_that_fell_behind_gets_its_pieces_and_its_end_in_one_write_each_its_own_chunk(tok):
    """Everything a job generated has arrived before the stream is read: one write of the pieces (an OpenAI
    chunk each), the finish, the usage and [DONE]."""
    ids = tok.encode("Paris is the capital.")
    backend = served(tok)
    job = RemoteJob(None, 0)
    job.generated, job.outcome = len(ids), "finished"  # as `EngineProcess._step` leaves an ended job
    job._arrive(ids + [END])
    writes = streamed([job], [_Text(job, backend, ())], _Shape("text", backend, 4, None))
    assert len(writes) == 1 and writes[0][1]  # the one write ends the body
    events = writes[0][0]
    got = chunks(events)
    assert len(events) == len(ids) + 3 and events[-1] == "data: [DONE]\n\n"
    assert "".join(c["choices"][0]["text"] for c in got[:-2]) == "Paris is the capital."
    assert [c["choices"][0]["index"] for c in got[:-1]] == [0] * (len(ids) + 1) and len({c["id"] for c in got}) == 1
    assert got[-2]["choices"][0]["finish_reason"] == "length" and got[-1]["usage"]["completion_tokens"] == len(ids)


def test_a_stream_that_keeps_up_writes_each_piece_as_it_comes_and_choices_that_fell_behind_write_once(tok):
    """Tokens that arrive one at a time, each read before the next: a write per piece (light load changes
    nothing), the end in one more. Two choices whose tokens have all arrived: one write, each piece its own
    chunk naming its choice, in the order of each choice's text."""
    ids = tok.encode("Blue sky.")
    backend = served(tok)
    job = RemoteJob(None, 0)

    async def one_at_a_time():
        for t in ids:
            job.generated += 1
            job._arrive([t])
            for _ in range(5):  # the stream's task runs and writes
                await asyncio.sleep(0)
        job.outcome = "finished"
        job._arrive([END])

    writes = streamed([job], [_Text(job, backend, ())], _Shape("chat", backend, 4, None), one_at_a_time)
    assert [len(events) for events, _ in writes] == [1] + [1] * len(ids) + [3]
    assert [last for _, last in writes] == [False] * (len(ids) + 1) + [True]
    got = [c["choices"][0] for c in chunks(sum((events for events, _ in writes), [])) if c["choices"]]
    assert "".join(c["delta"].get("content", "") for c in got) == "Blue sky."

    texts = ["Paris.", "Blue sky."]
    jobs = [RemoteJob(None, k) for k in range(2)]
    for job, text in zip(jobs, texts):
        job.outcome = "finished"
        job._arrive(tok.encode(text) + [tok.end_id, END])
    writes = streamed(jobs, [_Text(job, backend, ()) for job in jobs], _Shape("chat", backend, 4, None))
    assert len(writes) == 2  # the roles at once, then everything else
    got = chunks(writes[1][0])
    for i, text in enumerate(texts):
        mine = [c["choices"][0] for c in got if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(c["delta"].get("content", "") for c in mine) == text
        assert mine[-1]["finish_reason"] == "stop" and len(mine) == len(tok.encode(text)) + 1


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
    be.prefill_many = lambda slots, prompts, starts: (
        prefills.append(list(slots)),
        prefill_many(slots, prompts, starts),
    )[1]
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


def test_prompts_joining_with_cached_prefixes_are_prefilled_together_from_them(tok):
    """Three prompts that share a cached 12-token head join at one step: each copies the head's rows, then one
    `prefill_many` feeds the rest of all three (from their starts); the answers are a cache-less backend's."""
    from nanoeuler.infer.engine import DecodeEngine
    from nanoeuler.model.config import ModelConfig
    from nanoeuler.model.transformer import head_weight_names, init_params
    from nanoeuler.serve.backend import Backend
    from train_fixtures import TINY_MODEL

    cfg = ModelConfig.from_section(TINY_MODEL, tok.vocab_size)
    params = init_params(cfg, 5, dtype=np.float64)
    for name in head_weight_names(cfg):
        params[name] = params[name] * 20.0
    head = list(range(20, 32))
    specs = [(head + tail, 5, Sampling(temperature=0), {}) for tail in ([40], [41, 42], [43, 44, 45, 46])]
    plain = Backend(DecodeEngine.from_params(params, cfg, "cpu"), tok, "m", slots=4, prefix_cache=0)
    want, _ = run_streams(plain, specs)
    backend = Backend(DecodeEngine.from_params(params, cfg, "cpu"), tok, "m", slots=4, prefix_cache=8)
    run_streams(backend, [(head + [50], 1, Sampling(temperature=0), {})])  # the head into the cache
    be, calls = backend.engine.backend, []
    prefill_many = be.prefill_many
    be.prefill_many = lambda slots, prompts, starts: (calls.append(list(starts)), prefill_many(slots, prompts, starts))[
        1
    ]
    got, _ = run_streams(backend, specs)
    assert got == want and calls == [[len(head)] * 3] and backend.prefixes.hits == 3


def test_the_fake_engines_chain_takes_joining_streams_as_the_gpus_does(monkeypatch):
    """bench/serve_overhead.py's fake chain through the server's `Backend`: new streams join it (its `join`),
    and each answer is the fake's tokens for its slot and positions, as a step at a time would give them."""
    bench = _bench()
    joins = []
    join = bench.FakeChain.join
    monkeypatch.setattr(bench.FakeChain, "join", lambda self, *a: joins.append(a[2]) or join(self, *a))
    backend = bench.fake_backend(step_ms=1.0, prefill_us=1.0, host_us=0.0, max_batch=4)
    opened, open_ = [], backend.open
    backend.open = lambda *a, **k: opened.append(open_(*a, **k)) or opened[-1]
    jobs = joining_jobs(backend.cfg.ctx_len)
    got, _ = run_joining(backend, jobs, slots=4, join_at=2)
    ok = backend.fake.ok
    for i, ((prompt, n, _), s) in enumerate(zip(jobs, opened)):
        assert got[i] == [int(ok[(s.slot * 31 + (len(prompt) + k) * 7) % len(ok)]) for k in range(n)], i
    assert len(joins) >= 3 and max(joins) > 0, joins  # joins, one after a reused prefix


# ---- the app itself, a slow client ----------------------------------------------------------------------


@cache
def _bench():
    """bench/serve_overhead.py as a module (it drives the app over ASGI too: one scope builder for both)."""
    path = Path(__file__).resolve().parents[1] / "bench" / "serve_overhead.py"
    spec = importlib.util.spec_from_file_location("serve_overhead", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def asgi(app, method: str, path: str, body: dict | None = None, send_s: float = 0.0, leave_after=None):
    """One request through the app's ASGI interface, as uvicorn makes it: (status, [body messages]). Each body
    message is held `send_s` seconds, as a client that reads slowly holds back a server that writes to it;
    the client goes away after `leave_after` body messages."""
    raw = json.dumps(body).encode() if body is not None else b""
    scope = _bench().asgi_scope(method, path, raw)
    request = [{"type": "http.request", "body": raw, "more_body": False}]
    start, bodies, gone = {}, [], asyncio.Event()

    async def receive():
        if request:
            return request.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            start.update(message)
            return
        bodies.append(message)
        if len(bodies) == leave_after:
            gone.set()
        await asyncio.sleep(send_s)

    await app(scope, receive, send)
    return start["status"], bodies


def sse_chunks(bodies) -> tuple[list[dict], bool]:
    """The chunks of a streamed answer's body messages, and whether it ends with `data: [DONE]`."""
    events = b"".join(m["body"] for m in bodies).decode().split("\n\n")
    assert events[-1] == "" and all(e.startswith("data: ") for e in events[:-1])
    return [json.loads(e[6:]) for e in events[:-2]], events[-2] == "data: [DONE]"


def test_a_slow_client_gets_every_token_as_its_own_event_in_fewer_writes(tmp_path_factory, caplog):
    """The real app and engine process (the tiny chat model): a client that takes 20 ms per write falls behind
    the engine and gets several events a write, the same events, in the same order, as a client that keeps
    up, and the text of the whole answer; /metrics counts the events and the writes. A client that goes away
    mid-answer cancels its generation, and nothing is logged as an error."""
    from serve_fixtures import chat_model, served_backend

    from nanoeuler.serve.app import ServeConfig, create_app

    engine = EngineProcess(partial(served_backend, chat_model(tmp_path_factory), 4), 4, 8).start()
    app = create_app(engine, ServeConfig(max_tokens=10**6))
    body = {"prompt": "Name a color.", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    long = {**streamed, "max_tokens": 10**6}

    async def scenario():
        engine.attach()
        try:
            slow = await asgi(app, "POST", "/v1/completions", streamed, send_s=0.02)
            quick = await asgi(app, "POST", "/v1/completions", streamed)
            whole = await asgi(app, "POST", "/v1/completions", body)
            metrics = await asgi(app, "GET", "/metrics")
            _, left = await asyncio.wait_for(asgi(app, "POST", "/v1/completions", long, leave_after=3), 30)
            for _ in range(1000):  # the engine's word that the job has ended
                if not engine.stats()["active"]:
                    break
                await asyncio.sleep(0.01)
        finally:
            await engine.stop()
        return slow, quick, whole, metrics, left

    (status, slow), (_, quick), (_, whole), (_, metrics), left = asyncio.run(scenario())
    assert len(left) >= 3 and left[-1]["more_body"] and not [r for r in caplog.records if r.levelname == "ERROR"]
    stats = engine.stats()
    assert stats["cancelled"] == 1 and stats["finished"] == 3 and stats["active"] == 0
    assert status == 200 and [m["more_body"] for m in slow] == [True] * (len(slow) - 1) + [False]
    (slow_chunks, done), (quick_chunks, quick_done) = sse_chunks(slow), sse_chunks(quick)
    assert done and quick_done and [c["choices"] for c in slow_chunks] == [c["choices"] for c in quick_chunks]
    answer = json.loads(b"".join(m["body"] for m in whole))
    texts = [c["choices"][0]["text"] for c in slow_chunks if c["choices"] and c["choices"][0]["text"]]
    assert "".join(texts) == answer["choices"][0]["text"] and slow_chunks[-1]["usage"] == answer["usage"]
    assert answer["usage"]["completion_tokens"] == 40 and len(texts) >= 20  # a piece per token, but split characters
    events = len(slow_chunks) + 1  # and [DONE]
    assert len(slow) <= events // 3, f"{len(slow)} writes for {events} events"
    counted = {
        line.split()[0]: float(line.split()[1])
        for line in b"".join(m["body"] for m in metrics).decode().splitlines()
        if line.startswith("nanoeuler_stream_")
    }
    assert counted["nanoeuler_stream_events_total"] == events + len(quick_chunks) + 1
    assert counted["nanoeuler_stream_writes_total"] == len(slow) + len(quick)
