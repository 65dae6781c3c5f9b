"""`nanoeuler serve` against hostile and broken clients: one request's failure stays its own.

Random bodies and values never get a 500; a failing request among good ones leaves their answers as
they were without it; slots and counts go back to zero on every way out; bodies are bounded in size and
time (chunked ones too), JSON is strict, cross-site form posts are refused, headers have a deadline,
shutdown is bounded with streams nobody reads; bad numbers on the command line are one line."""

import contextlib
import glob
import json
import math
import os
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx2")

from nanoeuler.cli import main as cli_main  # noqa: E402
from nanoeuler.errors import UserError  # noqa: E402
from nanoeuler.infer.sampling import Sampling, SamplingError, checked_sampling  # noqa: E402
from nanoeuler.serve.backend import Backend  # noqa: E402
from nanoeuler.serve.protocol import ApiError, parse_json  # noqa: E402
from serve_fixtures import chat_model, live_server, serve_argv  # noqa: E402

BROKEN = 0.6180339887  # a temperature whose sampler fails in the module's server (`served_backend`)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return chat_model(tmp_path_factory)


@pytest.fixture(scope="module")
def knobs(tmp_path_factory):
    """The module's server's `ServedBackend` knobs: set(**values) for a while, then back to none."""
    path = tmp_path_factory.mktemp("knobs") / "knobs.json"

    @contextlib.contextmanager
    def turned(**values):
        path.write_text(json.dumps(values))
        try:
            yield path.parent
        finally:
            path.unlink()

    turned.path = path
    return turned


@pytest.fixture(scope="module")
def server(model_path, knobs):
    with live_server(
        model_path, max_tokens=400, max_batch=4, client_timeout_s=2.0, knobs=str(knobs.path), broken=BROKEN
    ) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0], timeout=60) as client:
        yield client


def wait_idle(http, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = http.get("/health").json()
        if stats["active"] == 0 and stats["waiting"] == 0:
            return stats
        time.sleep(0.02)
    raise AssertionError(f"the server is still busy: {stats}")


def assert_all_given_back(http, app):
    stats = wait_idle(http)
    assert stats["free_slots"] == app.state.engine.max_batch and stats["status"] == "ok"


# ---- the shared sampling check -------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, field",
    [
        ((math.nan, 0, 1.0, 0), "temperature"),
        ((math.inf, 0, 1.0, 0), "temperature"),
        ((-0.5, 0, 1.0, 0), "temperature"),
        ((1.0, -1, 1.0, 0), "top_k"),
        ((1.0, 0, math.nan, 0), "top_p"),
        ((1.0, 0, 0.0, 0), "top_p"),
        ((1.0, 0, 1.0, -1), "seed"),
        ((1.0, 0, 1.0, 2**63), "seed"),
    ],
)
def test_sampling_values_the_sampler_cannot_use_are_named(values, field):
    with pytest.raises(SamplingError) as err:
        checked_sampling(*values)
    assert err.value.field == field


def test_tiny_temperatures_are_greedy_and_the_rest_pass_unchanged():
    assert checked_sampling(5e-324, 0, 1.0, 0).temperature == 0.0
    assert checked_sampling(9.9e-7, 0, 1.0, 0).temperature == 0.0
    assert checked_sampling(1e-6, 3, 0.5, 2**63 - 1) == Sampling(1e-6, 3, 0.5, 2**63 - 1)


@pytest.mark.parametrize(
    "command, flag, value",
    [
        ("sample", "--temperature", "nan"),
        ("sample", "--seed", "-1"),
        ("sample", "--top-p", "inf"),
        ("chat", "--temperature", "nan"),
        ("chat", "--seed", "-1"),
    ],
)
def test_sample_and_chat_refuse_bad_numbers_in_one_line(command, flag, value, capsys, tmp_path):
    assert cli_main([command, "--ckpt", str(tmp_path / "m.bin"), flag, value]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"nanoeuler {command}: error: {flag}: ")


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--port", "70000"], "--port"),
        (["--port", "-1"], "--port"),
        (["--max-batch", "1000000"], "--max-batch"),
        (["--max-batch", "0"], "--max-batch"),
        (["--client-timeout", "nan"], "--client-timeout"),
        (["--shutdown-grace", "0"], "--shutdown-grace"),
    ],
)
def test_serve_refuses_bad_numbers_in_one_line(args, flag, capsys, tmp_path):
    assert cli_main(["serve", "--ckpt", str(tmp_path / "m.bin"), *args]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"nanoeuler serve: error: {flag}: ")


def test_slots_that_cannot_fit_in_memory_are_one_line_before_any_allocation(model_path):
    from nanoeuler.infer.engine import load

    engine, tok, _ = load(model_path, "cpu")
    with pytest.raises(UserError, match=r"^--max-batch 1000000000: the caches of 1000000000 generation slots"):
        Backend(engine, tok, "m", slots=10**9)


# ---- strict JSON -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, match",
    [
        (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
        (b'{"seed": ' + b"7" * 5000 + b"}", "an integer of 5000 digits"),
        (b'{"temperature": NaN}', "NaN is not a JSON number"),
        (b'{"temperature": -Infinity}', "-Infinity is not a JSON number"),
        (b'{"top_p": 1e999}', "overflows a float"),
    ],
)
def test_bodies_json_cannot_hold_are_400(raw, match, http):
    with pytest.raises(ApiError, match=match) as err:
        parse_json(raw)
    assert err.value.status == 400
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and match in r.json()["error"]["message"]


# ---- random bodies never get a 500 ---------------------------------------------------------------

NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 2**63, 2**64, 5e-324, 1e-7, 1e308, -0.0, 2.0000001, float("nan")]),
)
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=8)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
FIELDS = [
    "max_completion_tokens",
    "n",
    "stop",
    "stream",
    "stream_options",
    "ignore_eos",
    "model",
    "prompt",
    "messages",
    "logit_bias",
    "user",
    "logprobs",
    "top_logprobs",
    "response_format",
]
VALID = {"messages": [{"role": "user", "content": "hi"}], "prompt": "It", "max_tokens": 2}
BODIES = st.one_of(
    JSON,
    st.fixed_dictionaries({}, optional={name: NUMBERS for name in ("temperature", "top_p", "seed", "max_tokens")}).map(
        lambda numbers: {**VALID, **numbers}
    ),
    st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=4).map(lambda fields: {**VALID, **fields}),
)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(body=BODIES, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_random_bodies_and_values_never_get_a_500(body, path, http, server):
    raw = json.dumps(body).encode()  # NaN and Infinity go out as JSON cannot hold them
    with http.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
        text = r.read().decode()
    assert r.status_code < 500, text
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "server_error" not in text


# ---- one request's failure is its own ------------------------------------------------------------


def completions_together(url, app, knobs, bodies):
    """Stream `bodies` from /v1/completions, the last after the others; the first step waits until all of them
    are in. Returns each one's (status, events) and the batch size of each step."""
    engine = app.state.engine

    def in_flight():
        stats = engine.stats()
        return stats["active"] + stats["waiting"]

    gate, steps = knobs.path.parent / "gate", knobs.path.parent / "steps"
    gate.touch()
    steps.write_text("")
    outs = [None] * len(bodies)

    def run(i, body):
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            outs[i] = (r.status_code, [line for line in r.iter_lines() if line])

    with knobs(gate=str(gate), steps=str(steps)):
        threads = [threading.Thread(target=run, args=(i, b)) for i, b in enumerate(bodies)]
        for t in threads[:-1]:
            t.start()
        deadline = time.monotonic() + 10
        while in_flight() < len(bodies) - 1 and time.monotonic() < deadline:  # the last one comes last
            time.sleep(0.001)
        threads[-1].start()
        while in_flight() < len(bodies) and time.monotonic() < deadline:
            time.sleep(0.001)
        gate.unlink()  # the first step goes; the others join it
        for t in threads:
            t.join(timeout=60)
    return outs, [int(n) for n in steps.read_text().split()]


def texts(events):
    return "".join(
        json.loads(e[6:])["choices"][0]["text"]
        for e in events
        if e.startswith("data: {") and "choices" in json.loads(e[6:])
    )


GOOD = [{"prompt": "It was", "max_tokens": 300, "temperature": 1.0, "seed": s, "ignore_eos": True} for s in (1, 2)]


@pytest.mark.parametrize(
    "bad, status",
    [
        ({"temperature": 5e-324}, 200),  # inside the API's range; the sampler alone would overflow
        ({"temperature": BROKEN}, 500),  # the sampler fails for this request only (`served_backend`)
    ],
)
def test_a_failing_request_leaves_the_others_as_they_were_without_it(bad, status, server, http, knobs, caplog):
    url, app = server
    alone = [texts(events) for _, events in completions_together(url, app, knobs, GOOD)[0]]
    together, steps = completions_together(url, app, knobs, GOOD + [{**GOOD[0], "seed": 9, **bad}])
    assert max(steps) == 3  # the bad request was in a batch with the good ones
    assert [texts(events) for _, events in together[:2]] == alone
    assert all("error" not in e for _, events in together[:2] for e in events)
    events = together[2][1]
    if status == 200:
        assert "error" not in " ".join(events) and events[-1] == "data: [DONE]"
    else:
        error = json.loads(next(e for e in events if '"error"' in e)[6:])["error"]
        assert error["type"] == "server_error" and "the sampler broke" in error["message"]
        rid = error["message"].rsplit("request id ", 1)[1].rstrip(")")
        logged = [r for r in caplog.records if rid in r.getMessage()]
        assert logged and logged[0].exc_info[0] is FloatingPointError  # the engine's exception, rebuilt here
        assert "in sample" in str(logged[0].exc_info[1].__cause__)  # with its traceback there
    assert_all_given_back(http, app)


def test_a_plain_500_names_its_request_id_in_the_header_the_body_and_the_log(server, http, caplog):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "temperature": BROKEN})
    rid = r.headers["x-request-id"]
    assert r.status_code == 500 and r.json()["error"]["message"].endswith(f"(request id {rid})")
    assert any(rid in rec.getMessage() and rec.exc_info for rec in caplog.records)
    assert http.get("/health").headers["x-request-id"] != rid


def test_a_seed_the_generator_refuses_gives_its_slot_back(model_path):
    backend = Backend.load(model_path, "cpu", slots=2)
    for _ in range(3):
        with pytest.raises(ValueError):
            backend.open([1, 2], 4, Sampling(temperature=1.0, seed=-1))
    assert backend.free_slots == 2
    streams = [backend.open([1, 2], 4, Sampling(temperature=1.0, seed=s)) for s in (0, 1)]
    assert backend.free_slots == 0
    assert all(len(new) == 1 and isinstance(new[0], int) for new in backend.step(streams))
    for s in streams:
        s.close()
    assert backend.free_slots == 2


def test_every_way_out_gives_slots_and_counts_back(server, http, knobs):
    url, app = server
    with knobs(delay_s=0.005):  # 400 tokens > 2 s
        user = [{"role": "user", "content": "hi"}]
        for _ in range(10):  # more than the slots: a leak would show as a 500 below
            assert http.post("/v1/chat/completions", json={"messages": user, "seed": -1}).status_code == 400
        assert http.post("/v1/chat/completions", json={"messages": user, "temperature": BROKEN}).status_code == 500
        body = {"prompt": "It", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            next(line for line in r.iter_lines() if line)  # then the client goes away
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={**body, "stream": False}, timeout=0.3)
        r = http.post("/v1/completions", json={"prompt": "It", "max_tokens": 5, "stop": ["e"], "temperature": 0})
        assert r.status_code == 200
        assert_all_given_back(http, app)
    assert http.post("/v1/completions", json={"prompt": "It", "max_tokens": 2}).status_code == 200


# ---- bodies, headers and origins -------------------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_chunked_body_past_the_limit_is_413_and_never_read_whole(server, http):
    host, port = server[0].removeprefix("http://").split(":")
    chunk = b"x" * 65536
    before, sent, answer = rss_bytes(), 0, b""
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        s.setblocking(False)
        while sent < 64 << 20 and not answer:
            try:
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
            except (BlockingIOError, OSError):
                time.sleep(0.01)
            try:
                answer = s.recv(4096)
            except BlockingIOError:
                pass
    assert answer.startswith(b"HTTP/1.1 413") and b"connection: close" in answer.lower()
    assert sent < 16 << 20 and rss_bytes() - before < 32 << 20
    assert http.get("/health").json()["status"] == "ok"


def test_a_body_that_does_not_arrive_in_time_is_408(server):
    host, port = server[0].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt"'
        )
        start = time.monotonic()
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 5


def test_headers_that_do_not_arrive_in_time_close_the_connection(server):
    host, port = server[0].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        start = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\n")
        for _ in range(4):  # a header now and then, never the end of them
            time.sleep(0.5)
            try:
                s.sendall(b"X-Slow: 1\r\n")
            except OSError:
                break
        s.settimeout(10)
        try:  # closed, unanswered: an orderly close, or a reset when a header arrived after it stopped reading
            answer = s.recv(4096)
        except ConnectionResetError:
            answer = b""
        assert answer == b""
    assert time.monotonic() - start < 5


def test_an_answer_nobody_reads_is_dropped_and_its_generation_stopped(model_path):
    body = json.dumps({"prompt": "It", "max_tokens": 10**6, "ignore_eos": True, "stream": True}).encode()
    with live_server(model_path, max_tokens=10**6, client_timeout_s=1.0, send_buffer=4096) as (url, app):
        host, port = url.removeprefix("http://").split(":")
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect((host, int(port)))
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            deadline = time.monotonic() + 60  # the buffers fill in moments, then one timeout
            while app.state.engine.stats()["cancelled"] == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            stats = app.state.engine.stats()
            assert stats["cancelled"] == 1 and stats["active"] == 0 and stats["tokens"] < 10**6


@pytest.mark.parametrize(
    "headers",
    [
        {"content-type": "text/plain", "origin": "http://elsewhere.example"},
        {"content-type": "application/x-www-form-urlencoded"},
        {},
    ],
)
def test_posts_that_are_not_json_are_refused_unrun(headers, http):
    before = wait_idle(http)["tokens"]
    r = http.post("/v1/completions", content=b'{"prompt": "It", "max_tokens": 3}', headers=headers)
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    assert wait_idle(http)["tokens"] == before


# ---- shutdown --------------------------------------------------------------------------------------


def test_shutdown_with_streams_nobody_reads_ends_within_the_grace(model_path):
    body = json.dumps({"prompt": "It", "max_tokens": 100000, "ignore_eos": True, "stream": True}).encode()
    with live_server(model_path, max_tokens=100000, max_batch=2, shutdown_grace_s=1.0) as (url, app):
        host, port = url.removeprefix("http://").split(":")
        readers = []
        for _ in range(2):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect((host, int(port)))
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            readers.append(s)  # never read
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health").json()["active"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        start = time.monotonic()
    took = time.monotonic() - start
    for s in readers:
        s.close()
    assert took < 6, f"shutdown took {took:.1f} s"
    stats = app.state.engine.stats()
    assert stats["active"] == 0 and stats["waiting"] == 0 and app.state.engine._proc.exitcode == 0


def test_sigterm_ends_the_command_within_the_grace_with_a_stream_nobody_reads(model_path):
    import re
    import signal
    import subprocess

    proc = subprocess.Popen(
        serve_argv(model_path, "error", "--max-tokens", "100000", "--shutdown-grace", "1"),
        stderr=subprocess.PIPE,
        text=True,
    )
    reader = None
    try:
        url = re.search(r"at (http://127\.0\.0\.1:\d+)/", proc.stderr.readline()).group(1)
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url + "/health")
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"prompt": "It", "max_tokens": 100000, "ignore_eos": True, "stream": True}).encode()
        reader = socket.create_connection((host, int(port)))
        reader.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        while httpx.get(url + "/health").json()["active"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        children = children_of(proc.pid)  # the engine among them
        assert children
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) in (0, -signal.SIGTERM)  # uvicorn raises the signal again once it is done
        assert time.monotonic() - start < 8
        while any(os.path.exists(f"/proc/{pid}") for pid in children):  # none outlives the server
            assert time.monotonic() - start < 10
            time.sleep(0.05)
    finally:
        if reader is not None:
            reader.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid` (read from /proc)."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
        except OSError:  # it ended meanwhile
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.split("/")[2]))
    return out
