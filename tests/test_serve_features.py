"""`nanoeuler serve` beyond one plain answer: `n` choices, log-probabilities (against the float64 reference),
grammar-constrained JSON (every answer parses and validates), prefix reuse, /tokenize, /detokenize, /metrics."""

import json

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")

from nanoeuler.infer.generate import Generator  # noqa: E402
from nanoeuler.infer.logprobs import log_softmax  # noqa: E402
from nanoeuler.data.template import render_prompt  # noqa: E402
from nanoeuler.infer.sampling import Sampling  # noqa: E402
from serve_fixtures import LEARNED, chat_model, live_server, run_streams, train_chat_model  # noqa: E402
from train_fixtures import make_tokenizer  # noqa: E402

FRANCE, COLOR = list(LEARNED)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def exact_model(tok):
    """A server backend over the tiny model in float64 with sharp heads (no near-ties), made by
    `backend(slots, prefix_cache)`, and the reference Generator over the same weights."""
    from nanoeuler.infer.engine import DecodeEngine
    from nanoeuler.model.config import ModelConfig
    from nanoeuler.model.transformer import head_weight_names, init_params
    from nanoeuler.serve.backend import Backend
    from train_fixtures import TINY_MODEL

    cfg = ModelConfig.from_section(TINY_MODEL, tok.vocab_size)
    params = init_params(cfg, 3, dtype=np.float64)
    for name in head_weight_names(cfg):
        params[name] = params[name] * 20.0

    def backend(slots, prefix_cache=8):
        return Backend(DecodeEngine.from_params(params, cfg, "cpu"), tok, "exact", slots, prefix_cache)

    return backend, Generator(params, cfg)


def reference_logprobs(ref, prompt, tokens):
    """Each token's float64 log-probability under the reference Generator, given everything before it."""
    return [log_softmax(np.asarray(ref._prefill(list(prompt) + tokens[:i])[1]))[t] for i, t in enumerate(tokens)]


def test_logprobs_match_the_float64_reference_with_and_without_prefix_reuse(exact_model):
    make, ref = exact_model
    shared = list(range(5, 35))  # a shared head of 30 tokens; the second prompt reuses its cached rows
    hot = Sampling(temperature=0.9, top_k=0, top_p=0.95, seed=4)
    specs = [
        (shared + [40, 41], 12, Sampling(temperature=0), {"logprobs": 3}),
        (shared + [50], 10, hot, {"logprobs": 0}),
        ([7, 8], 9, hot, {}),
    ]
    outs = {}
    for cache in (0, 8):
        backend = make(3, cache)
        first, streams = run_streams(backend, specs[:1])
        rest, more = run_streams(backend, specs[1:])
        outs[cache] = (first + rest, streams + more)
        assert (backend.prefixes is None) == (cache == 0)
    assert outs[8][0] == outs[0][0]
    assert backend.prefixes.hits == 1 and backend.prefixes.tokens == len(shared)
    for (prompt, n, sampling, _), tokens in zip(specs, outs[8][0]):
        assert tokens == ref.generate(prompt, n, sampling)  # the same tokens as without log-probabilities
    for cache in (0, 8):
        tokens, streams = outs[cache]
        for (prompt, *_), got, s in zip(specs[:2], tokens, streams):
            want = reference_logprobs(ref, prompt, got)
            assert np.allclose([lp for lp, _ in s.records], want, rtol=0, atol=1e-10)
            assert len(s.records) == len(got)
        greedy = streams[0].records
        assert all(
            alts[0][0] == t and len(alts) == 3 and alts[0][1] >= alts[1][1] >= alts[2][1]
            for (_, alts), t in zip(greedy, tokens[0])
        )
        assert streams[2].records == []


def test_a_grammar_masks_every_step_and_ends_the_stream(exact_model, tok):
    from nanoeuler.serve.structured import Grammars

    make, _ = exact_model
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    backend = make(2)
    grammars = Grammars(tok)
    specs = [
        ([1, 2, 3], 40, Sampling(temperature=1.0, top_k=0, top_p=1.0, seed=s), {"guide": grammars.guide(schema)})
        for s in (1, 2)
    ]
    got, streams = run_streams(backend, specs)
    for tokens, s in zip(got, streams):
        assert s.guide.stopped and json.loads(tok.decode(tokens).replace("</s>", "")) in ({"ok": True}, {"ok": False})


def test_batched_speculation_is_plain_greedy_and_counts_each_heads_drafts(tok, tmp_path):
    """Greedy streams that speculate in the batch (three heads: two drafts a pass) give the float64 reference's
    greedy tokens, beside sampled and log-probability streams in the same steps and across two context refills;
    a step hands out several tokens where drafts were kept, and SpecStats counts each head's drafts."""
    from nanoeuler import checkpoint
    from nanoeuler.infer.engine import DecodeEngine
    from nanoeuler.serve.backend import Backend

    train_chat_model(tmp_path / "k3.bin", mtp_heads=3)  # trained heads: their drafts are often right
    params, cfg = checkpoint.load_model(tmp_path / "k3.bin")[:2]
    params = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}  # no near-ties in rounding
    ref = Generator(params, cfg)
    france, color = (tok.encode(render_prompt(q)) for q in LEARNED)
    greedy, hot = Sampling(temperature=0), Sampling(temperature=0.9, top_k=0, top_p=0.95, seed=4)
    specs = [
        (france, 12, greedy, {}),
        (color, 2 * cfg.ctx_len + 5, greedy, {}),
        (france, 10, hot, {}),
        (color, 9, greedy, {"logprobs": 1}),
    ]
    backend = Backend(DecodeEngine.from_params(params, cfg, "cpu"), tok, "k3", 4, 8, speculative=True)
    assert backend.speculative
    steps, step = [], backend.step
    backend.step = lambda streams: steps.append(len(streams)) or step(streams)
    got, streams = run_streams(backend, specs)
    for (prompt, n, sampling, _), tokens in zip(specs, got):
        assert tokens == ref.generate(prompt, n, sampling)
    assert len(streams[3].records) == 9  # log-probabilities: a plain stream, one record a token
    st = backend.engine.stats
    assert len(steps) < 2 * cfg.ctx_len + 5  # the longest answer took fewer steps than tokens
    assert st.offered[0] == st.passes and st.offered[1] == st.accepted[0]  # draft 2 is checked after draft 1 stood
    assert st.accepted[0] > 0 and st.accepted[1] > 0 and st.tokens == st.passes + sum(st.accepted)
    plain = Backend(DecodeEngine.from_params(params, cfg, "cpu"), tok, "k3", 4, 8)
    assert run_streams(plain, specs)[0] == got and plain.engine.stats.passes == 0


# ---- the live server ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(chat_model(tmp_path_factory), max_tokens=48) as (url, app):
        yield url, app


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_n_choices_are_the_single_answers_of_consecutive_seeds(client):
    user = [{"role": "user", "content": COLOR}]
    many = client.chat.completions.create(
        model="serve_chat", messages=user, n=3, seed=11, temperature=1.5, max_tokens=6
    )
    singles = [
        client.chat.completions.create(model="serve_chat", messages=user, seed=11 + i, temperature=1.5, max_tokens=6)
        for i in range(3)
    ]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.message.content for c in many.choices] == [s.choices[0].message.content for s in singles]
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    chunks = list(
        client.completions.create(
            model="serve_chat",
            prompt="It was",
            n=2,
            seed=5,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    whole = client.completions.create(model="serve_chat", prompt="It was", n=2, seed=5, max_tokens=5)
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 10


def test_logprobs_of_chat_and_completions(client, tok):
    r = client.chat.completions.create(
        model="serve_chat", messages=[{"role": "user", "content": FRANCE}], temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert b"".join(bytes(t.bytes) for t in content).decode() == r.choices[0].message.content == "Paris."
    for t in content:  # greedy: the chosen token is the most likely one
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token and t.logprob <= 0
        assert t.top_logprobs[0].logprob == t.logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    streamed = list(
        client.chat.completions.create(
            model="serve_chat",
            messages=[{"role": "user", "content": FRANCE}],
            temperature=0,
            logprobs=True,
            stream=True,
        )
    )
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    # the same tokens; their float32 log-probs may differ in the last bits (the second request reuses the
    # first's prompt rows, so its products run on other row counts)
    assert [t.token for t in tokens] == [t.token for t in content]
    assert np.allclose([t.logprob for t in tokens], [t.logprob for t in content], rtol=1e-5, atol=1e-6)
    c = client.completions.create(
        model="serve_chat", prompt="It was", max_tokens=4, temperature=1.0, seed=2, logprobs=2
    )
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.token_logprobs) == 4
    # keyed by text, two alternatives that decode alike (pieces of one character) are one entry
    assert all(
        1 <= len(top) <= 2 and max(top.values()) >= chosen for top, chosen in zip(lp.top_logprobs, lp.token_logprobs)
    )
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    plain = client.chat.completions.create(
        model="serve_chat", messages=[{"role": "user", "content": FRANCE}], temperature=0
    )
    assert plain.choices[0].logprobs is None


SCHEMAS = [
    {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 6}},
        "required": ["answer"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
            "color": {"enum": ["red", "blue", "green"]},
        },
        "required": ["count", "color"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 4},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        },
        "required": ["city", "tags"],
        "additionalProperties": False,
    },
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["string", "enum-int", "array", "nested"])
def test_json_schema_answers_parse_and_validate(client, schema):
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    r = client.chat.completions.create(
        model="serve_chat",
        messages=[{"role": "user", "content": COLOR}],
        n=4,
        seed=3,
        temperature=1.0,
        max_tokens=48,
        response_format=fmt,
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_a_schema_is_compiled_once_and_its_cached_grammar_answers_alike(client, server, tok):
    """The second request with a schema (here 3 choices each) compiles nothing: its guides are copies of the
    cached matcher, whose answers still validate and are those of the first request's fresh one (same seed)."""
    jsonschema = pytest.importorskip("jsonschema")
    from nanoeuler.serve.structured import Grammars

    url = server[0]
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "w": {"enum": ["x", "yy"]}},
        "required": ["n", "w"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "cached", "schema": schema}}

    def ask():
        r = client.chat.completions.create(
            model="serve_chat",
            messages=[{"role": "user", "content": COLOR}],
            n=3,
            seed=5,
            temperature=1.0,
            max_tokens=48,
            response_format=fmt,
        )
        return [c.message.content for c in r.choices]

    before = metric_values(url)["nanoeuler_grammar_compiles_total"]  # counted in the engine process
    first = ask()
    assert metric_values(url)["nanoeuler_grammar_compiles_total"] == before + 1  # one compile for all three choices
    second = ask()
    assert metric_values(url)["nanoeuler_grammar_compiles_total"] == before + 1 and second == first
    for text in second:
        jsonschema.validate(json.loads(text), schema)

    small = Grammars(tok, cache_size=2)  # least recently used out
    a, b, c = ({"type": "integer"}, {"type": "boolean"}, {"enum": ["z"]})
    for s in (a, b, a, c, a, b):
        small.guide(s)
    assert small.compiles == 4  # a, b, c, then b again (pushed out by c); a stayed in use
    reordered = {"type": "object", "properties": {"w": schema["properties"]["w"], "n": schema["properties"]["n"]}}
    small.guide(reordered)
    small.guide({"properties": reordered["properties"], "type": "object"})
    assert small.compiles == 6  # field order is part of the grammar: no sorting of keys


def test_json_object_answers_are_objects_and_bad_formats_are_400(client, server):
    r = client.chat.completions.create(
        model="serve_chat",
        messages=[{"role": "user", "content": FRANCE}],
        n=3,
        seed=1,
        temperature=0.7,
        max_tokens=48,
        response_format={"type": "json_object"},
    )
    for choice in r.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # a free object can run past max_tokens; what was sent is an object's beginning
            assert choice.message.content.startswith("{")
    assert any(c.finish_reason == "stop" for c in r.choices)
    for fmt, match in [
        ({"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}, "cannot be used"),
        ({"type": "json_schema", "json_schema": {}}, "expected a JSON schema"),
    ]:
        with pytest.raises(openai.BadRequestError, match=match) as err:
            client.chat.completions.create(
                model="serve_chat", messages=[{"role": "user", "content": "x"}], response_format=fmt
            )
        assert err.value.param == "response_format"


def test_tokenize_detokenize_and_metrics(server, tok, client):
    url = server[0]
    r = httpx.post(url + "/tokenize", json={"content": "It was the"})
    assert r.status_code == 200 and r.json() == {"tokens": tok.encode("It was the")}
    pieces = httpx.post(url + "/tokenize", json={"content": "It was", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tok.encode("It was") and "".join(p["piece"] for p in pieces) == "It was"
    assert httpx.post(url + "/detokenize", json={"tokens": tok.encode("Paris.")}).json() == {"content": "Paris."}
    bad = httpx.post(url + "/detokenize", json={"tokens": [1, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(url + "/tokenize", json={"content": 3}).status_code == 400
    for q in (FRANCE, COLOR):  # the chat template's head is a prefix both prompts share
        client.chat.completions.create(
            model="serve_chat", messages=[{"role": "user", "content": q}], temperature=0, max_tokens=3
        )
    values = metric_values(url)
    assert values['nanoeuler_requests_total{status="200"}'] >= 2
    assert values['nanoeuler_requests_total{status="400"}'] >= 2
    assert values["nanoeuler_generation_tokens_total"] >= 6 and values["nanoeuler_prompt_tokens_total"] >= 20
    assert values["nanoeuler_time_to_first_token_seconds_count"] >= 2
    engine_ttft = values["nanoeuler_engine_time_to_first_token_seconds_count"]  # the engine's share, within
    assert engine_ttft >= 2 and 0 < values["nanoeuler_engine_time_to_first_token_seconds_sum"] / engine_ttft
    assert (
        values["nanoeuler_engine_time_to_first_token_seconds_sum"] / engine_ttft
        <= values["nanoeuler_time_to_first_token_seconds_sum"] / values["nanoeuler_time_to_first_token_seconds_count"]
    )
    assert values["nanoeuler_inter_token_latency_seconds_count"] >= 4
    assert values["nanoeuler_prefix_cache_hits_total"] >= 1 and values["nanoeuler_prefix_cache_tokens_total"] >= 8
    assert values["nanoeuler_queue_depth"] == 0 and 'nanoeuler_generations_total{outcome="finished"}' in values
    assert values["process_resident_memory_bytes"] > 10 * 2**20  # the soak test's flat-memory reading
    assert values["nanoeuler_engine_resident_memory_bytes"] > 10 * 2**20 and values["nanoeuler_engine_up"] == 1
    assert values["nanoeuler_engine_cpu_seconds_total"] > 0


def metric_values(url) -> dict:
    """/metrics as {series: value}."""
    text = httpx.get(url + "/metrics").text
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_a_speculating_server_answers_as_a_plain_one_and_reports_acceptance_per_head(tmp_path_factory, client, tok):
    """`--speculative`: the greedy answers are the plain server's; /metrics gives each draft head's counts, those
    of the same requests replayed on a speculating backend here."""
    from nanoeuler.serve.backend import Backend

    questions = [FRANCE, COLOR, FRANCE]
    plain = [
        client.chat.completions.create(
            model="serve_chat", messages=[{"role": "user", "content": q}], temperature=0, max_tokens=20
        )
        .choices[0]
        .message.content
        for q in questions
    ]
    model = chat_model(tmp_path_factory)
    with live_server(model, max_tokens=48, speculative=True) as (url, app):
        spec = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for q, want in zip(questions, plain):
            r = spec.chat.completions.create(
                model="serve_chat", messages=[{"role": "user", "content": q}], temperature=0, max_tokens=20, stream=True
            )
            assert "".join(c.choices[0].delta.content or "" for c in r if c.choices) == want
        values = metric_values(url)
    replay = Backend.load(model, "cpu", slots=8, speculative=True)
    for q in questions:  # one after another, as the server got them
        stream = replay.open(tok.encode(render_prompt(q)), 20, Sampling(temperature=0))
        while not stream.done:
            replay.step([stream])
        stream.close()
    stats = replay.engine.stats
    assert stats.passes > 0 and stats.accepted[0] > 0
    assert values['nanoeuler_spec_drafts_offered_total{head="1"}'] == stats.offered[0] == stats.passes
    assert values['nanoeuler_spec_drafts_accepted_total{head="1"}'] == stats.accepted[0]
    assert values['nanoeuler_spec_acceptance_ratio{head="1"}'] == pytest.approx(stats.accepted[0] / stats.offered[0])


def test_speculative_decoding_reports_target_logprobs_and_keeps_to_the_grammar(exact_model, tok):
    """Greedy speculation with a grammar gives the plain masked argmax of the reference, token for token; every
    token's log-probability is the float64 reference's; sampled answers follow the grammar."""
    from nanoeuler.infer.guided import speculative_logprobs
    from nanoeuler.serve.structured import Grammars

    make, ref = exact_model
    engine = make(1).engine
    grammars = Grammars(tok)
    schema = {
        "type": "object",
        "properties": {"w": {"enum": ["Paris", "Blue", "red"]}, "n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["w", "n"],
        "additionalProperties": False,
    }
    prompt = tok.encode("It was the")
    plain = list(engine.stream(prompt, 20, Sampling(temperature=0), speculative=True))
    spec = list(speculative_logprobs(engine, prompt, 20, Sampling(temperature=0), top=2))
    assert [t for t, _, _ in spec] == plain
    assert np.allclose([lp for _, lp, _ in spec], reference_logprobs(ref, prompt, plain), rtol=0, atol=1e-10)
    assert all(alts[0][0] == t for t, _, alts in spec)

    guide, masked = grammars.guide(schema), grammars.guide(schema)
    want = []  # the reference: head 0's float64 argmax among the tokens the grammar allows
    while not masked.stopped:
        z = np.asarray(ref._prefill(prompt + want)[1])
        want.append(int(np.argmax(np.where(masked.allowed(), z, -np.inf))))
        masked.consume(want[-1])
    engine.stats.offered = []
    got = list(speculative_logprobs(engine, prompt, 40, Sampling(temperature=0), guide=guide))
    assert [t for t, _, _ in got] == want and guide.stopped
    assert sum(engine.stats.offered) > sum(engine.stats.accepted)  # drafts were refused on the way
    assert np.allclose([lp for _, lp, _ in got], reference_logprobs(ref, prompt, want), rtol=0, atol=1e-10)
    for seed in range(3):
        guide = grammars.guide(schema)
        got = [t for t, _, _ in speculative_logprobs(engine, prompt, 40, Sampling(1.0, 0, 1.0, seed), guide=guide)]
        assert guide.stopped and set(json.loads(tok.decode(got).replace("</s>", ""))) == {"w", "n"}


SCHEMA_WORDS = [
    "type",
    "object",
    "string",
    "integer",
    "array",
    "items",
    "properties",
    "required",
    "enum",
    "minimum",
    "maxLength",
    "pattern",
    "$ref",
    "anyOf",
    "additionalProperties",
    "format",
]


def _schemas():
    from hypothesis import strategies as st

    leaf = st.one_of(st.sampled_from(SCHEMA_WORDS), st.integers(-3, 3), st.booleans(), st.none(), st.text(max_size=4))
    return st.recursive(
        leaf,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(SCHEMA_WORDS), inner, max_size=3),
        max_leaves=10,
    )


def test_random_response_formats_are_answered_or_refused_never_a_500(server):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    kinds = st.sampled_from(["json_schema", "json_object", "text"])
    shaped = st.fixed_dictionaries({"type": kinds, "json_schema": st.fixed_dictionaries({"schema": _schemas()})})
    formats = st.one_of(_schemas(), shaped)

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(fmt=formats)
    def check(fmt):
        body = {"prompt": "It", "max_tokens": 3, "response_format": fmt, "logprobs": 1}
        r = httpx.post(server[0] + "/v1/completions", json=body, timeout=60)
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            assert r.json()["error"]["param"] == "response_format"

    check()
