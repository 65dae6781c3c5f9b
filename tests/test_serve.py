"""`nanoeuler serve`: the official openai client against a live loopback server (plain, streamed, errors),
the queue limit, cancellation on disconnect, the API key, and the pieces (prompts, stop strings, request
checks, the scheduler) on their own."""

import itertools
import json
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")

from nanoeuler.data.template import render_prompt  # noqa: E402
from nanoeuler.infer.sampling import Sampling  # noqa: E402
from nanoeuler.serve.backend import _prefill_from  # noqa: E402
from nanoeuler.serve.prompts import PromptError, StopText, chat_prompt, chat_turns  # noqa: E402
from nanoeuler.serve.protocol import ApiError, parse_chat, parse_completion, parse_json  # noqa: E402
from nanoeuler.serve.scheduler import END, QueueFull, Scheduler  # noqa: E402
from nanoeuler.serve.server import exposure_warning  # noqa: E402
from nanoeuler.train.sft import encode_example  # noqa: E402
from serve_fixtures import LEARNED, Outbox, chat_model, live_server, joining_jobs, run_joining, serve_argv  # noqa: E402
from train_fixtures import make_tokenizer  # noqa: E402

FRANCE, COLOR = list(LEARNED)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


# ---- the pieces ---------------------------------------------------------------------------------


def test_conversation_is_laid_out_as_fine_tuning_examples(tok):
    messages = [("system", "Be brief."), ("user", "Hi"), ("user", "there"), ("assistant", "Hello."), ("user", COLOR)]
    assert chat_turns(messages) == ([("Hi\n\nthere", "Hello.")], COLOR, "Be brief.")
    ids, dropped = chat_prompt(tok, messages, ctx_len=1000, room=10)
    first, _ = encode_example(tok, {"instruction": "Hi\n\nthere", "input": "", "output": "Hello."})
    assert dropped == 0 and ids == first + tok.encode(render_prompt(COLOR, "Be brief."))


def test_oldest_exchanges_are_dropped_whole_and_a_long_last_turn_is_an_error(tok):
    old = [("user", f"question {i}") for i in range(3)]
    messages = [m for q in old for m in (q, ("assistant", "answer"))] + [("user", COLOR)]
    last = tok.encode(render_prompt(COLOR))
    one = len(tok.encode(render_prompt("question 2"))) + len(tok.encode("answer")) + 1
    ids, dropped = chat_prompt(tok, messages, ctx_len=len(last) + one + 5, room=5)
    assert dropped == 2 and len(ids) == len(last) + one and ids[-len(last) :] == last
    with pytest.raises(PromptError, match="messages: the last turn is"):
        chat_prompt(tok, [("user", "word " * 200)], ctx_len=64, room=8)
    with pytest.raises(PromptError, match=r"messages\[0\]: an assistant message must follow"):
        chat_turns([("assistant", "x"), ("user", "y")])
    with pytest.raises(PromptError, match="must end with a user message"):
        chat_turns([("user", "x"), ("assistant", "y")])


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab\n.", max_size=30),
    stops=st.lists(st.text(alphabet="ab\n.", max_size=3), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=6),
)
def test_stop_strings_cut_streamed_text_as_they_cut_the_whole_text(text, stops, cuts):
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    want = text[: min(hits)] if hits else text
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    cut = StopText(stops)
    out = "".join(cut.feed(text[a:b]) for a, b in zip(bounds, bounds[1:]) if not cut.stopped)
    out += "" if cut.stopped else cut.flush()
    assert out == want and cut.stopped == bool(hits)


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"seed": "1"}, "seed"),
        ({"stop": 7}, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ["a", 1]}, "stop[1]"),
        ({"stream": "yes"}, "stream"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"model": 5}, "model"),
    ],
)
def test_bad_chat_fields_are_named(body, param):
    if "messages" not in body and param != "messages":
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(ApiError) as err:
        parse_chat(body)
    assert err.value.param == param and err.value.status == 400
    assert err.value.message.startswith(param.split("[")[0])


def test_bodies_and_prompts_that_are_not_json_objects_or_text():
    for raw, match in [(b"\xff{}", "not valid UTF-8"), (b"{", "not valid JSON"), (b"[1]", "must be a JSON object")]:
        with pytest.raises(ApiError, match=match):
            parse_json(raw)
    assert parse_completion({"prompt": [[1, 2, 3]]}).prompt == (1, 2, 3)
    assert parse_completion({"prompt": ["text"]}).prompt == "text"
    with pytest.raises(ApiError, match="prompt: expected a string, an array"):
        parse_completion({"prompt": [1, "x"]})
    request = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 7}
    assert parse_chat(request).options.max_tokens == 7


class ScriptedBackend:
    """Stands in for the model: every stream yields 1, 2, 3, ...; `step` waits for `gate` when one is set."""

    stop_ids = frozenset()

    def __init__(self):
        self.gate, self.steps = None, []

    def open(self, prompt_ids, max_new_tokens, sampling, stop_at_end=True):
        from nanoeuler.serve.backend import TokenStream

        return TokenStream(max_new_tokens, frozenset(), (t for t in itertools.count(1)))

    def step(self, streams):
        if self.gate is not None:
            self.gate.wait()
        self.steps.append(len(streams))
        if any(s.max_new_tokens == 13 for s in streams):
            raise RuntimeError("the engine broke")
        return [[s.advance()] for s in streams]


def test_scheduler_batches_limits_the_queue_cancels_and_survives_a_failure():
    backend, sent = ScriptedBackend(), Outbox()
    scheduler = Scheduler(backend, max_batch=2, max_queue=1, send=sent).start()
    try:
        backend.gate = threading.Event()
        jobs = [scheduler.submit([0], 3, Sampling()) for _ in range(3)]
        with pytest.raises(QueueFull, match="limit is 2 at once"):
            scheduler.submit([0], 3, Sampling())
        backend.gate.set()
        assert [sent.items(job) for job in jobs] == [[1, 2, 3, END]] * 3
        assert backend.steps[:3] == [2, 2, 2] and backend.steps[3:] == [1, 1, 1]
        broken = sent.items(scheduler.submit([0], 13, Sampling()))
        assert len(broken) == 1 and isinstance(broken[0], RuntimeError) and str(broken[0]) == "the engine broke"
        job = scheduler.submit([0], 10**6, Sampling())
        assert sent.items(job, at_least=5)[:5] == [1, 2, 3, 4, 5]
        job.cancel()
        assert sent.items(job)[-1] is END and job.outcome == "cancelled" and job.generated < 10**6
        stats = scheduler.stats()
    finally:
        scheduler.stop()
    assert stats["finished"] == 3 and stats["failed"] == 1 and stats["cancelled"] == 1 and stats["rejected"] == 1


def _sharp_model(tok, tmp_path):
    """A tiny float64 model with sharp heads (no engine's rounding meets a near-tie), saved, and the
    reference Generator of it."""
    from nanoeuler import checkpoint
    from nanoeuler.infer.generate import Generator
    from nanoeuler.model.config import ModelConfig
    from nanoeuler.model.transformer import head_weight_names, init_params
    from train_fixtures import TINY_MODEL

    cfg = ModelConfig.from_section(TINY_MODEL, tok.vocab_size)
    params = init_params(cfg, 3, dtype=np.float64)
    for name in head_weight_names(cfg):
        params[name] = params[name] * 20.0
    checkpoint.save_model(tmp_path / "m.bin", params, cfg, step=0, tokenizer_json=tok.to_json())
    return tmp_path / "m.bin", cfg, Generator(*checkpoint.load_model(tmp_path / "m.bin")[:2])


def test_a_worker_profile_into_a_missing_folder_is_one_clear_error(monkeypatch, tmp_path):
    from nanoeuler.errors import UserError

    monkeypatch.setenv("NANOEULER_PROFILE_WORKER", str(tmp_path / "missing" / "worker.prof"))
    with pytest.raises(UserError, match="NANOEULER_PROFILE_WORKER: .*missing.*its folder does not exist"):
        Scheduler(ScriptedBackend(), max_batch=2, max_queue=1, send=Outbox())
    monkeypatch.setenv("NANOEULER_PROFILE_WORKER", str(tmp_path / "worker.prof"))
    scheduler = Scheduler(ScriptedBackend(), max_batch=2, max_queue=1, send=Outbox()).start()
    scheduler.stop()
    assert (tmp_path / "worker.prof").stat().st_size > 0  # written when the worker stops


def test_streams_joining_and_leaving_the_batch_equal_one_at_a_time(tok, tmp_path):
    """The backend against the reference Generator, one prompt at a time: ragged prompts, greedy and two
    seeded samplers, streams joining mid-way, a slot reused, an answer sliding past the context."""
    from nanoeuler.serve.backend import Backend

    path, cfg, ref = _sharp_model(tok, tmp_path)
    hot = [Sampling(temperature=0.9, top_k=0, top_p=0.95, seed=s) for s in (4, 5)]
    jobs = [
        ([1, 2, 3], 2 * cfg.ctx_len + 5, Sampling(temperature=0)),
        (list(range(5, 45)), 20, hot[0]),
        ([7], 30, hot[1]),
        ([9, 9], 12, Sampling(temperature=0)),
    ]
    got, _ = run_joining(Backend.load(path, "cpu", slots=3), jobs, slots=3, join_at=3)
    for i, (prompt, n, sampling) in enumerate(jobs):
        assert got[i] == ref.generate(prompt, n, sampling), i


class _RunAhead:
    """A `greedy_chain` as the GPU's behaves, on the CPU engine: up to 3 steps are computed ahead of the
    reader (rows whose stream has ended run on and write their slot's cache), all of them `ready`."""

    def __init__(self, be, tokens, pos, steps: int):
        self.be, self.tokens, self.pos, self.steps = be, tokens, pos, steps
        self.fed = np.ones(len(tokens), dtype=bool)  # the GPU computes every row of the batch
        self.done: list = []
        self.queued = self.read = 0

    def fill(self) -> None:
        while self.queued - self.read < 3 and self.queued < self.steps:
            ids = self.be.decode(self.tokens, self.pos, Sampling(temperature=0), 0, [None] * len(self.fed), self.fed)
            self.tokens, self.pos = ids, np.minimum(self.pos + 1, self.be.cfg.ctx_len - 1)
            self.done.append(ids)
            self.queued += 1

    def ready(self) -> bool:
        return self.read < self.queued

    def left(self) -> bool:
        return self.read < self.queued or self.queued < self.steps

    def stop(self) -> None:
        self.steps = self.queued

    def next(self):
        self.fill()
        if self.read == self.queued:
            return None
        self.read += 1
        return self.done[self.read - 1]


def test_greedy_streams_chained_ahead_answer_as_one_at_a_time(tok, tmp_path):
    """Greedy streams decoded by steps that run ahead of the server (`greedy_chain`, as on the GPU): several
    tokens a step, streams joining (the chain drained first) and leaving (their rows running on past
    their end), a slot reused while a row ran on, an answer sliding past the context: each answer is the
    reference Generator's for its prompt alone."""
    from nanoeuler.serve.backend import Backend

    path, cfg, ref = _sharp_model(tok, tmp_path)
    backend = Backend.load(path, "cpu", slots=4)
    be = backend.engine.backend
    chains = []
    be.greedy_chain = lambda tokens, pos, steps: chains.append(_RunAhead(be, tokens, pos, steps)) or chains[-1]
    greedy = Sampling(temperature=0)
    jobs = [
        ([1, 2, 3], 2 * cfg.ctx_len + 5, greedy),
        (list(range(5, 45)), 20, greedy),
        ([7], 9, greedy),
        ([9, 9], 12, greedy),
        ([4, 4, 4, 4], 1, greedy),
        ([11], 25, greedy),
    ]
    got, most = run_joining(backend, jobs, slots=4, join_at=5)
    for i, (prompt, n, sampling) in enumerate(jobs):
        assert got[i] == ref.generate(prompt, n, sampling), i
    assert len(chains) > 3 and sum(c.read for c in chains) > 2 * cfg.ctx_len  # chained, and drained for joins
    assert most > 1  # the steps that had landed were handed out together


class _JoinableRunAhead(_RunAhead):
    """`_RunAhead` that a new stream may join, as the GPU's chain: the steps computed ahead keep the row's old
    stream (running on), the prompt's prefill comes after them, and the steps from the next on feed the new
    stream its greedy first token at the prompt's end. A step counts as landed only when read (a device
    slower than the host), so each `Backend.step` hands out one and streams arrive while steps are ahead."""

    def ready(self) -> bool:
        return False

    def __init__(self, be, tokens, pos, steps: int):
        super().__init__(be, tokens, pos, steps)
        self.width, self.firsts, self.starts = len(tokens), {}, []

    def join(self, slot: int, ids, start: int) -> int:
        logits = _prefill_from(self.be, slot, ids, start)
        self.firsts[slot] = int(np.argmax(logits[0]))
        self.tokens, self.pos = self.tokens.copy(), self.pos.copy()  # the steps done keep their own
        self.tokens[slot], self.pos[slot] = self.firsts[slot], len(ids)
        self.starts.append(start)
        return self.queued

    def joined(self, slot: int) -> int:
        return self.firsts.pop(slot)


def test_greedy_streams_joining_a_running_chain_answer_as_one_at_a_time(tok, tmp_path):
    """New greedy streams join the chain that runs ahead (their prefill queued behind its steps, their
    first token fed by its next ones) instead of draining it; a prompt that the chain has no room for
    drains it. Each answer is the reference Generator's for its prompt alone."""
    from nanoeuler.serve.backend import Backend

    path, cfg, ref = _sharp_model(tok, tmp_path)
    backend = Backend.load(path, "cpu", slots=4)
    be = backend.engine.backend
    chains = []
    be.greedy_chain = lambda t, p, n: chains.append(_JoinableRunAhead(be, t, p, n)) or chains[-1]
    jobs = joining_jobs(cfg.ctx_len)
    got, _ = run_joining(backend, jobs, slots=4, join_at=2)
    for i, (prompt, n, sampling) in enumerate(jobs):
        assert got[i] == ref.generate(prompt, n, sampling), i
    starts = [start for c in chains for start in c.starts]
    assert len(starts) >= 3 and max(starts) > 0  # joins, one after a reused prefix
    assert len(chains) > 2  # and drains: for slots past the chain's rows, for the prompt it had no room for


def test_greedy_streams_joining_step_by_step_answer_as_one_at_a_time(tok, tmp_path, monkeypatch):
    """The same on the CPU engine's own chain (`_Stepwise`, nothing ahead): joins feed the next step."""
    from nanoeuler.serve import backend as serve_backend

    path, cfg, ref = _sharp_model(tok, tmp_path)
    joins = []
    join = serve_backend._Stepwise.join
    monkeypatch.setattr(serve_backend._Stepwise, "join", lambda c, *a: joins.append(a[0]) or join(c, *a))
    jobs = joining_jobs(cfg.ctx_len)
    got, _ = run_joining(serve_backend.Backend.load(path, "cpu", slots=4), jobs, slots=4, join_at=2)
    for i, (prompt, n, sampling) in enumerate(jobs):
        assert got[i] == ref.generate(prompt, n, sampling), i
    assert len(joins) >= 3


def test_a_chain_that_fails_ends_its_streams_and_the_next_ones_start_clean(tok, tmp_path):
    """A greedy chain whose engine fails mid-way: the streams it fed end with the error (as `Scheduler` ends
    a step that raised), the slots go back, and streams opened after are the reference's."""
    from nanoeuler.serve.backend import Backend

    path, cfg, ref = _sharp_model(tok, tmp_path)
    backend = Backend.load(path, "cpu", slots=2)
    be = backend.engine.backend
    chains = []

    def failing(tokens, pos, steps):
        chain = _RunAhead(be, tokens, pos, steps)
        if not chains:  # the first chain breaks at its third read
            reads = chain.next
            chain.next = lambda: reads() if chain.read < 2 else (_ for _ in ()).throw(RuntimeError("device lost"))
        chains.append(chain)
        return chain

    be.greedy_chain = failing
    greedy = Sampling(temperature=0)
    streams = [backend.open(p, 20, greedy, stop_at_end=False) for p in ([1, 2], [3])]
    with pytest.raises(RuntimeError, match="device lost"):
        for _ in range(5):
            backend.step(streams)
    for stream in streams:
        stream.close()
    assert backend.free_slots == 2
    job = ([5, 6, 7], 9, greedy)
    got, _ = run_joining(backend, [job], slots=2, join_at=0)
    assert got[0] == ref.generate(*job) and len(chains) == 2


def test_a_warmed_up_backend_answers_as_a_fresh_one(tok, tmp_path):
    """`Backend.warm_up` (made-up streams of every kind at every batch width, run to their ends) leaves nothing
    behind: greedy, speculating, seeded sampled and log-probability streams sharing a prefix are answered
    token for token, log-probabilities and counters too, as by a backend that never warmed up."""
    from nanoeuler.serve.backend import Backend
    from serve_fixtures import run_streams

    path, cfg, _ = _sharp_model(tok, tmp_path)
    fresh, warm = (Backend.load(path, "cpu", slots=5, speculative=True) for _ in range(2))
    be, counts = (
        warm.engine.backend,
        {  # the rows of each call the warm-up makes
            "prefill": lambda slot, ids: len(ids),
            "prefill_many": lambda slots, prompts, starts=None: sum(map(len, prompts)) - sum(starts or []),
            "prefill_from": lambda slot, ids, start: len(ids) - start,
            "decode": lambda tokens, *_: len(tokens),
            "decode_logits": lambda tokens, *_: len(tokens),
        },
    )
    rows = {name: [] for name in counts}
    for name, count in counts.items():
        call = getattr(be, name)
        setattr(be, name, lambda *a, call=call, seen=rows[name], count=count: seen.append(count(*a)) or call(*a))
    prefills = 18 + 2 * 17 + 2  # prompts of 1..16, 32 and 64 tokens alone and split in two; one past a cached one
    greedy, widths = 1 + 2 + 3 + 4 + 5, 1 + 2 + 4 + 5  # speculation verifies any count; decodes take 1, 2, 4, 5
    mixed = widths - 1  # greedy beside sampled streams: 2 streams or more
    assert warm.warm_up() == 2 * (prefills + greedy + 2 * widths + mixed)  # twice: + sampled, log-probabilities
    assert set(rows["prefill"]) >= {*range(1, 17), 32, 64} and set(rows["prefill_many"]) >= {*range(2, 17), 32, 64}
    assert rows["prefill_from"] == [1, 1]  # on the GPU, prefill_many's one row
    assert set(rows["decode"]) == set(rows["decode_logits"]) == {1, 2, 4, 5}
    assert warm.free_slots == 5 and warm.prefixes.entries == {} and warm.prefixes.tokens == 0
    assert warm.engine.stats == fresh.engine.stats
    head = list(range(5, 25))
    specs = [
        (head + [1, 2], 12, Sampling(temperature=0), {}),
        (head + [3], 10, Sampling(temperature=0.9, top_k=0, top_p=0.95, seed=4), {}),
        (head + [7, 8, 9], 8, Sampling(temperature=0.7, seed=5), {"logprobs": 2}),
    ]
    for _ in range(2):  # the second round reuses the first's prefix
        (a, sa), (b, sb) = run_streams(fresh, specs), run_streams(warm, specs)
        assert a == b and [s.records for s in sa] == [s.records for s in sb]
    assert warm.engine.stats == fresh.engine.stats and warm.engine.stats.passes > 0
    assert (warm.prefixes.hits, warm.prefixes.tokens) == (fresh.prefixes.hits, fresh.prefixes.tokens) != (0, 0)


def test_any_address_but_loopback_gets_a_warning():
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("localhost", None) is None
    assert "no authentication" in exposure_warning("0.0.0.0", None)
    assert "plain HTTP" in exposure_warning("0.0.0.0", "key")


# ---- a live server and the openai client ------------------------------------------------------------


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return chat_model(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_path):
    with live_server(model_path, max_tokens=48) as (url, app):
        yield url, app


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_plain_chat_completion_answers_with_the_chat_template(client, tok, server):
    r = client.chat.completions.create(
        model="serve_chat", messages=[{"role": "user", "content": FRANCE}], temperature=0
    )
    assert r.object == "chat.completion" and r.model == "serve_chat" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == "Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(tok.encode(render_prompt(FRANCE)))
    assert r.usage.completion_tokens == len(tok.encode("Paris.")) + 1  # the end marker counts
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert [m.id for m in client.models.list().data] == ["serve_chat"]


def test_streamed_chat_completion_arrives_in_pieces_with_usage(client):
    chunks = list(
        client.chat.completions.create(
            model="serve_chat",
            messages=[{"role": "user", "content": COLOR}],
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 2 and "".join(pieces) == "Blue."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= len(pieces)
    assert len({c.id for c in chunks}) == 1


def test_the_raw_event_stream_ends_with_done(server):
    body = {"messages": [{"role": "user", "content": COLOR}], "temperature": 0, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "stop"


def test_completions_honour_max_tokens_seed_and_stop(client, tok):
    a = client.completions.create(model="serve_chat", prompt="It was the", max_tokens=5, temperature=1.0, seed=7)
    b = client.completions.create(model="serve_chat", prompt="It was the", max_tokens=5, temperature=1.0, seed=7)
    assert a.object == "text_completion" and a.choices[0].text == b.choices[0].text
    assert a.usage.prompt_tokens == len(tok.encode("It was the")) and a.usage.completion_tokens <= 5
    prompt = render_prompt(FRANCE)
    short = client.completions.create(model="serve_chat", prompt=prompt, max_tokens=2, temperature=0)
    assert short.usage.completion_tokens == 2 and short.choices[0].finish_reason == "length"
    assert "Paris.".startswith(short.choices[0].text) and len(short.choices[0].text) >= 2
    whole = client.completions.create(model="serve_chat", prompt=prompt, temperature=0)
    assert whole.choices[0].text == "Paris."
    cut = client.completions.create(model="serve_chat", prompt=prompt, temperature=0, stop=["is."])
    assert cut.choices[0].text == "Par" and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="serve_chat", prompt=prompt, temperature=0, stop="ri", stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "Pa"
    ids = client.completions.create(model="serve_chat", prompt=tok.encode(prompt), temperature=0)
    assert ids.choices[0].text == "Paris."


def test_top_p_near_zero_is_greedy(client):
    r = client.chat.completions.create(
        model="serve_chat", messages=[{"role": "user", "content": FRANCE}], temperature=1.5, top_p=1e-6, seed=3
    )
    assert r.choices[0].message.content == "Paris."


def test_errors_name_the_field_and_leave_the_server_up(client, server):
    user = [{"role": "user", "content": "hi"}]
    cases = [
        (dict(model="gpt-4", messages=user), "model", "model_not_found"),
        (dict(model="serve_chat", messages=user, max_tokens=49), "max_tokens", None),
        (dict(model="serve_chat", messages=user, temperature=-1), "temperature", None),
        (
            dict(model="serve_chat", messages=[{"role": "user", "content": "word " * 300}]),
            "messages",
            "context_length_exceeded",
        ),
        (dict(model="serve_chat", messages=[{"role": "assistant", "content": "x"}]), "messages", None),
    ]
    for kwargs, param, code in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**kwargs)
        assert err.value.status_code == 400 and err.value.param == param and err.value.code == code
    with pytest.raises(openai.BadRequestError, match=r"prompt: \d+ tokens; the model.s context holds 64"):
        client.completions.create(model="serve_chat", prompt="word " * 300)
    with pytest.raises(openai.BadRequestError, match=r"prompt\[1\]: token id 99999"):
        client.completions.create(model="serve_chat", prompt=[1, 99999])
    url = server[0]
    for raw, match in [(b"{not json", "not valid JSON"), (b'{"messages": "\xff"}', "not valid UTF-8")]:
        r = httpx.post(url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and match in r.json()["error"]["message"]
    r = httpx.get(url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"] == "GET /v1/nothing: not found"
    assert httpx.get(url + "/health").json()["status"] == "ok"
    page = httpx.get(url + "/")
    assert page.status_code == 200 and "<title>nanoeuler chat</title>" in page.text
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page.text)  # nothing from another host


def wait_idle(url, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = httpx.get(url + "/health").json()
        if stats["active"] == 0 and stats["waiting"] == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"the server is still busy: {stats}")


def test_queue_limit_429_and_disconnect_cancels_generation(model_path):
    with live_server(model_path, max_tokens=100000, max_batch=1, max_queue=0) as (url, _):
        body = {
            "messages": [{"role": "user", "content": COLOR}],
            "stream": True,
            "max_tokens": 100000,
            "ignore_eos": True,
        }
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()  # kept: a dropped iterator closes the stream
            next(line for line in lines if '"content": "' in line and '"content": ""' not in line)
            busy = httpx.get(url + "/health").json()  # answered while a generation runs: the loop is free
            assert busy["active"] == 1
            full = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False})
            assert full.status_code == 429 and full.headers["retry-after"] == "1"
            assert full.json()["error"]["code"] == "rate_limit_exceeded"
        stats = wait_idle(url)
        assert stats["cancelled"] == 1 and stats["rejected"] == 1 and stats["tokens"] < 100000
        with pytest.raises(httpx.ReadTimeout):  # a plain request whose client gives up is cancelled too
            httpx.post(
                url + "/v1/completions", json={"prompt": "It", "max_tokens": 100000, "ignore_eos": True}, timeout=1.0
            )
        stats = wait_idle(url)
        assert stats["cancelled"] == 2 and stats["tokens"] < 200000


def test_api_key_is_required_when_set(model_path):
    with live_server(model_path, api_key="sesame") as (url, _):
        user = [{"role": "user", "content": FRANCE}]
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model="serve_chat", messages=user)
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/health").status_code == 200
        right = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
        r = right.chat.completions.create(model="serve_chat", messages=user, temperature=0)
        assert r.choices[0].message.content == "Paris."


def test_serve_command_starts_and_reports_bad_input(model_path, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "nanoeuler", "serve", "--ckpt", str(tmp_path / "none.bin")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and r.stderr.strip().startswith("nanoeuler serve: error:")
    assert len(r.stderr.strip().splitlines()) == 1
    proc = subprocess.Popen(
        serve_argv(model_path, "warning"),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()
        url = re.search(r"at (http://127\.0\.0\.1:\d+)/", line).group(1)
        deadline = time.monotonic() + 30
        while True:
            try:
                assert httpx.get(url + "/health").json()["model"] == "serve_chat"
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
