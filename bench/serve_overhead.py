"""The server's own cost per step and per request, on the CPU: the real app in front of a fake engine.

    python bench/serve_overhead.py                            # 1, 8, 32 and 64 streaming clients, 0.3+0.7 ms steps
    python bench/serve_overhead.py --levels 32 --profile      # and where the server's time goes (cProfile)
    python bench/serve_overhead.py --step-ms 0.25 --levels 1  # a one-row GPU step
    python bench/serve_overhead.py --levels 32 --stepwise     # no greedy chain: a wait on every step
    python bench/serve_overhead.py --asgi --levels 32,64       # the HTTP side's CPU per token alone, no sockets

The engine is the GPU's stand-in: a slot backend (`start`, `prefill`, `decode`, prefix rows) whose decode
step first runs --host-us of busy Python (a GPU step's kernel launches: host work that holds the GIL), then
sleeps --step-ms (a sleep lets go of the GIL, as a CUDA wait does) and returns a token per row, and
whose prefill sleeps --prefill-us per prompt token. Greedy streams (all of the bench's) go through its
`greedy_chain`, timed as a GPU runs a queue: each step's launch is --host-us of busy Python, the steps land
--step-ms apart, up to 3 queued ahead of the server, and a new stream joins it with its prefill queued
between steps (`FakeChain`); --stepwise takes it away, so the server waits on every step, as it did before
the chain. Everything else is what `nanoeuler serve` runs: the
`Backend` adapter and the scheduler's worker thread in the engine process, the FastAPI app and uvicorn in
the HTTP process, started as a child on loopback (a 512-token BPE, so detokenizing is real). So what the
fake does not sleep is the server's cost.

For each level, L clients each send --requests streamed /v1/completions requests back to back (`ignore_eos`,
--max-tokens tokens, usage asked for) through a lean HTTP/1.1 client (a keep-alive connection each, chunked
bodies read by hand, no JSON parsed but the last chunk's usage), so the client costs little beside the server.
Per level it prints: tokens/s, and that against the ideal (every step fully used: rows / step time, the fake's
host work and sleep as measured alone; with the chain the sleep alone, its launches being queued ahead); the
scheduler thread's host ms per step (time between the fake's calls, not in them) and its CPU ms per step (the
rest of host time is waiting for the GIL); the event loop's CPU per step and per token (the HTTP process's
cost, less moved by other work on a busy machine than the times are); server-sent events per body write
(above 1 where streams fell behind, `/metrics`' stream counters); p50/p99 of the time between a stream's
reads; failures. Then the time to first token of one-token answers, one request at a time (streamed and not),
and with --profile a cProfile of the event loop's thread and of the scheduler's thread at the top level. The
server CPU per request counts both processes.

--asgi measures the HTTP process's own code alone, which a busy machine moves less than it moves the times
above: in one process, L streamed requests go through the app's ASGI interface (the middleware and routes
included, a `send` that keeps nothing: no uvicorn, no sockets) and a loop hands `EngineProcess._step` one
token per stream per step, letting the event loop turn after every 1 and every 4 steps (a stream that
keeps up, and one that fell 4 steps behind). It prints the loop's CPU microseconds per token and the
writes per stream, the median of --repeats runs.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import re
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

PROMPT = "Below is an instruction that describes a task.\n\n### Instruction:\nName a color.\n\n### Response:\n"


# ---- the server side (the child process) ---------------------------------------------------------------


class FakeSlots:
    """A slot engine that spends fixed times sleeping instead of computing: `decode` --step-ms per call, a
    prefill --prefill-us per token fed. Row r's token at position p is a function of (r, p); never an end id."""

    def __init__(self, cfg, step_s: float, prefill_s_per_token: float, tok, host_s: float = 0.0, profile_dir=None):
        self.cfg, self.step_s, self.prefill_s, self.host_s = cfg, step_s, prefill_s_per_token, host_s
        self.profile_dir = profile_dir  # --profile: the worker profiles itself while profile_dir/on exists
        self.vocab = tok.vocab_size
        self.ok = np.array([t for t in range(self.vocab) if t not in (tok.end_id, tok.eot_id) and _text(tok, t)])
        self.steps = self.rows = 0
        self.cpu = 0.0  # the calling thread's CPU seconds, read at each decode (the scheduler's thread)
        self.first = self.last = None  # monotonic time of the first decode call, and of the end of the last
        self.profile = None  # the cProfile.Profile the scheduler's thread runs while profile_dir/on exists
        # what one sleep of step_s takes on this machine with no other thread about (an oversleep is the
        # machine's, not the server's): the median of 200
        self.sleep_s = float(np.median([self._timed_step(host_s) for _ in range(200)]))
        self.device_s = float(np.median([self._timed_step(0.0) for _ in range(200)]))  # the sleep alone
        self.greedy_chain = self._chain  # unset by `fake_backend(chain=False)`

    def _timed_step(self, host_s: float) -> float:
        t0 = time.monotonic()
        _spin(host_s)
        time.sleep(self.step_s)
        return time.monotonic() - t0

    def _logits(self, row: int, pos: int) -> np.ndarray:
        out = np.zeros((self.cfg.mtp_heads, self.vocab), np.float32)
        out[:, self.ok[(row * 31 + pos * 7) % len(self.ok)]] = 1.0
        return out

    def start(self, batch: int, seeds=None) -> None:
        pass

    def prefill(self, slot: int, ids) -> np.ndarray:
        time.sleep(self.prefill_s * len(ids))
        return self._logits(slot, len(ids))

    def prefill_from(self, slot: int, ids, start: int) -> np.ndarray:
        time.sleep(self.prefill_s * (len(ids) - start))
        return self._logits(slot, len(ids))

    def read_rows(self, slot: int, n: int):
        return n

    def write_rows(self, slot: int, rows, n: int) -> None:
        pass

    def decode(self, tokens, pos, sampling, step, rngs, mask) -> np.ndarray:
        now, cpu = time.monotonic(), time.thread_time()
        if self.profile_dir is not None:
            self._follow_switch()
        if self.first is None:
            self.first = now
        self.cpu += cpu - getattr(self, "_cpu_mark", cpu)
        _spin(self.host_s)
        time.sleep(self.step_s)
        self.steps += 1
        self.rows += int(np.count_nonzero(mask))
        self.last, self._cpu_mark = time.monotonic(), time.thread_time()
        return self.ok[(np.arange(len(tokens)) * 31 + (np.asarray(pos) + 1) * 7) % len(self.ok)]

    def decode_logits(self, tokens, pos, mask):
        raise NotImplementedError("the fake engine does not give logits")

    def _chain(self, tokens, pos, steps: int) -> "FakeChain":
        return FakeChain(self, tokens, pos, steps)

    def _follow_switch(self) -> None:
        """Start profiling this thread when profile_dir/on appears; when it goes, write profile_dir/worker.prof."""
        on = os.path.exists(os.path.join(self.profile_dir, "on"))
        if on and self.profile is None:
            self.profile = cProfile.Profile()
            self.profile.enable()
        elif not on and self.profile is not None:
            self.profile.disable()
            self.profile.dump_stats(os.path.join(self.profile_dir, "worker.prof"))
            self.profile = None


class FakeChain:
    """The fake's `greedy_chain`, timed as the GPU runs a queue: queuing a step costs --host-us of busy Python
    (its launch), and it lands --step-ms after the later of its queuing and the step before it; up to 3
    steps are queued ahead of the reader; a new stream may `join` it. Its ids are `decode`'s."""

    def __init__(self, fake: FakeSlots, tokens, pos, steps: int):
        self.fake, self.pos, self.steps = fake, np.asarray(pos).copy(), steps
        self.width = len(self.pos)
        self.fed = int(np.count_nonzero(self.pos < fake.cfg.ctx_len - 1))  # rows not fed sit at the last position
        self.firsts = {}  # slot -> the first id of the stream that joined there
        self.lands, self.ids = [], []  # per queued step: when it lands, its ids
        self.queued = self.read = 0
        self.free_at = time.monotonic()  # when the "GPU" is done with what is queued

    def fill(self) -> None:
        f = self.fake
        while self.queued - self.read < 3 and self.queued < self.steps:
            _spin(f.host_s)
            self.free_at = max(self.free_at, time.monotonic()) + f.step_s
            self.lands.append(self.free_at)
            self.ids.append(f.ok[(np.arange(len(self.pos)) * 31 + (self.pos + 1) * 7) % len(f.ok)])
            self.pos = np.minimum(self.pos + 1, f.cfg.ctx_len - 1)
            self.queued += 1
            f.steps += 1
            f.rows += self.fed
            if f.first is None:
                f.first = time.monotonic()

    def join(self, slot: int, ids, start: int) -> int:
        """A new stream in row `slot`, as the GPU's chain takes one: its launches cost --host-us, its prefill
        (--prefill-us a token fed) lands after the steps queued so far, and the steps queued from now on feed
        its first id at position len(ids). Returns the number of the first of them."""
        f = self.fake
        _spin(f.host_s)
        self.free_at = max(self.free_at, time.monotonic()) + f.prefill_s * (len(ids) - start)
        self.firsts[slot] = int(np.argmax(f._logits(slot, len(ids))[0]))
        self.fed += int(self.pos[slot] >= f.cfg.ctx_len - 1)
        self.pos[slot] = len(ids)
        return self.queued

    def joined(self, slot: int) -> int:
        return self.firsts.pop(slot)

    def ready(self) -> bool:
        return self.read < self.queued and time.monotonic() >= self.lands[self.read]

    def left(self) -> bool:
        return self.read < self.queued or self.queued < self.steps

    def stop(self) -> None:
        self.steps = self.queued

    def next(self):
        f = self.fake
        if f.profile_dir is not None:
            f._follow_switch()
        cpu = time.thread_time()
        f.cpu += cpu - getattr(f, "_cpu_mark", cpu)
        self.fill()
        if self.read == self.queued:
            return None
        time.sleep(max(0.0, self.lands[self.read] - time.monotonic()))  # the wait for an event lets go of the GIL
        self.read += 1
        f.last, f._cpu_mark = time.monotonic(), time.thread_time()
        return self.ids[self.read - 1]


def _spin(seconds: float) -> None:
    """Busy Python for `seconds`, holding the GIL throughout: a GPU step's kernel launches, which are host work
    in the interpreter (a sleep would let go of the GIL, as only the wait for the GPU does)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _text(tok, t: int) -> bool:
    """Whether token t is text on its own (so each token is one chunk of the stream)."""
    try:
        return bool(tok.decode_bytes([t]).decode("utf-8").strip())
    except UnicodeDecodeError:
        return False


def fake_backend(
    step_ms: float,
    prefill_us: float,
    host_us: float,
    max_batch: int,
    profile_dir=None,
    chain: bool = True,
):
    """The server's `Backend` over a `FakeSlots` (a module-level function: the engine process builds it);
    `extra_stats` adds the fake's counts to the engine's, which the bench's stats route reads. `chain=False`:
    no `greedy_chain`, so greedy streams decode a step at a time, as on an engine without one."""
    from nanoeuler.infer.engine import DecodeEngine
    from nanoeuler.model.config import ModelConfig
    from nanoeuler.serve.backend import Backend

    tok = tokenizer()
    cfg = ModelConfig.from_section({"preset": "gpu"}, tok.vocab_size)
    fake = FakeSlots(cfg, step_ms / 1e3, prefill_us / 1e6, tok, host_us / 1e6, profile_dir)
    if not chain:
        del fake.greedy_chain
    backend = Backend(DecodeEngine(fake, cfg), tok, "fake", slots=max_batch, prefix_cache=8)
    backend.fake = fake
    backend.extra_stats = lambda: {
        "steps": fake.steps,
        "rows": fake.rows,
        "cpu": fake.cpu,
        "first": fake.first,
        "last": fake.last,
        # what a server that cost nothing would take per step: a step's sleep, and its launches too unless
        # they are queued ahead (the chain)
        "sleep_s": fake.device_s if chain else fake.sleep_s,
    }
    return backend


def serve(args) -> None:
    """The child: `nanoeuler serve`'s app and engine process on the fake engine, with routes of its own."""
    import tempfile

    import uvicorn

    from nanoeuler.serve.app import ServeConfig, create_app
    from nanoeuler.serve.backend import Sampling
    from nanoeuler.serve.engine_proc import EngineProcess
    from nanoeuler.serve.server import listen, uvicorn_config

    profile_dir = tempfile.mkdtemp(prefix="serve_overhead_") if args.profile else None
    made = partial(
        fake_backend,
        args.step_ms,
        args.prefill_us,
        args.host_us,
        args.max_batch,
        profile_dir,
        not args.stepwise,
    )
    engine = EngineProcess(made, args.max_batch, 4 * args.max_batch).start()
    app = create_app(engine, ServeConfig(max_tokens=max(args.max_tokens, 1)))
    loop_profile = []

    @app.get("/bench/stats")
    async def stats():
        there = engine.engine_stats  # sent with every job's end: fresh once a level's answers are in
        own = {"loop_cpu": time.thread_time(), "process_cpu": time.process_time() + there["cpu_s"]}
        own.update(events=app.state.metrics.stream_events, writes=app.state.metrics.stream_writes)
        return {**there, **own}

    @app.post("/bench/profile/{what}")
    async def profile(what: str):
        switch = os.path.join(profile_dir, "on")
        if what == "on":
            open(switch, "w").close()
            loop_profile[:] = [cProfile.Profile()]
            loop_profile[0].enable()
            return {}
        loop_profile[0].disable()
        os.unlink(switch)
        job = engine.submit([0], 2, Sampling(temperature=0))  # a decode step, in which the worker sees the switch off
        [t async for t in job.batches()]
        worker = os.path.join(profile_dir, "worker.prof")
        return {"loop": hot_spots(loop_profile[0], args.top), "worker": hot_spots(worker, args.top)}

    sock = listen("127.0.0.1", 0)
    print(f"listening at http://127.0.0.1:{sock.getsockname()[1]}/", file=sys.stderr, flush=True)
    uvicorn.Server(uvicorn_config(app, 30.0, 5.0, log_level="warning")).run(sockets=[sock])


def tokenizer():
    """A 512-token BPE learned on the shipped Alpaca sample (as bench/serve_load.py's model has)."""
    from nanoeuler.tokenizer.bpe import train_bpe

    records = json.loads((ROOT / "data/sample/alpaca_data.json").read_text())
    return train_bpe("\n\n".join(r["instruction"] + "\n" + r["input"] + "\n" + r["output"] for r in records), 512)


def hot_spots(prof, top: int) -> str:
    """The `top` functions by own time of a cProfile.Profile, or of the profile a file holds."""
    out = io.StringIO()
    try:
        stats = pstats.Stats(prof, stream=out)
    except TypeError:  # it saw no calls
        return "(no calls)\n"
    stats.sort_stats("tottime").print_stats(top)
    text = out.getvalue()
    return text[text.find("   ncalls") :] if "   ncalls" in text else text


# ---- the HTTP side alone (--asgi) ---------------------------------------------------------------------


def asgi_scope(method: str, path: str, raw: bytes) -> dict:
    """The ASGI scope uvicorn makes of an HTTP/1.1 request with the JSON body `raw`, for driving the app
    without a socket.

        >>> asgi_scope("GET", "/health", b"")["headers"][1]
        (b'content-length', b'0')
    """
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }


def asgi_cost(streams: int, every: int, max_tokens: int) -> tuple[float, float]:
    """(the loop's CPU us per token, writes per stream) of `streams` answers of `max_tokens` tokens, the loop
    turning after every `every` steps."""
    from nanoeuler.serve.app import ServeConfig, create_app
    from nanoeuler.serve.engine_proc import EngineProcess, Model

    tok = tokenizer()
    texts = [t for t in range(tok.vocab_size) if _text(tok, t)]
    engine = EngineProcess(None, max_batch=streams, max_queue=0)  # no process: `_step` is called here
    engine.model = Model("fake", 512, 1, tok.to_json())
    engine._send = lambda message: None
    app = create_app(engine, ServeConfig(max_tokens=max_tokens))
    body = {"prompt": PROMPT, "stream": True, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    raw = json.dumps({**body, "stream_options": {"include_usage": True}}).encode()
    writes = 0

    async def request():
        nonlocal writes
        scope = asgi_scope("POST", "/v1/completions", raw)
        messages = [{"type": "http.request", "body": raw, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # the client stays

        async def send(message):
            nonlocal writes
            writes += message["type"] == "http.response.body" and bool(message.get("body"))

        await app(scope, receive, send)

    async def run() -> float:
        answers = [asyncio.ensure_future(request()) for _ in range(streams)]
        while len(engine._jobs) < streams:
            await asyncio.sleep(0)
        cpu = time.thread_time()
        for pos in range(max_tokens):
            end = ("finished", None, False) if pos == max_tokens - 1 else None
            engine._step([(key, [texts[(key * 31 + pos * 7) % len(texts)]], [], end) for key in engine._jobs], 0, None)
            if pos % every == every - 1 or end:
                for _ in range(8):  # the streams' tasks run (each wakes, writes, waits again)
                    await asyncio.sleep(0)
        await asyncio.gather(*answers)
        return time.thread_time() - cpu

    cpu = asyncio.run(run())
    return cpu / (streams * max_tokens) * 1e6, writes / streams


def asgi_main(args) -> int:
    print(f"the HTTP side over ASGI: {args.max_tokens} tokens a stream, median of {args.repeats} runs")
    print(f"{'streams':>7} {'steps a turn':>12} {'us/token':>9} {'writes/stream':>13}")
    for streams in [int(x) for x in args.levels.split(",")]:
        for every in (1, 4):
            runs = [asgi_cost(streams, every, args.max_tokens) for _ in range(args.repeats)]
            cost = float(np.median([us for us, _ in runs]))
            print(f"{streams:>7} {every:>12} {cost:>9.2f} {runs[0][1]:>13.1f}")
    return 0


# ---- the clients --------------------------------------------------------------------------------------


class Connection:
    """One keep-alive HTTP/1.1 connection: a request, then its (chunked or sized) body as it arrives."""

    def __init__(self, host: str, port: int):
        self.host, self.port, self.reader, self.writer = host, port, None, None

    async def request(self, method: str, path: str, body: bytes = b""):
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        status = int(head.split(" ", 2)[1])
        if "transfer-encoding: chunked" in head:
            return status, self._chunks()
        size = int(re.search(r"content-length: (\d+)", head).group(1))
        return status, _one(await self.reader.readexactly(size))

    async def _chunks(self):
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await self.reader.readexactly(size + 2)
            if size == 0:
                return
            yield data[:-2]

    def close(self):
        if self.writer is not None:
            self.writer.close()


async def _one(data: bytes):
    yield data


async def stream_request(conn: Connection, max_tokens: int) -> dict:
    body = json.dumps(
        {
            "prompt": PROMPT,
            "stream": True,
            "temperature": 0,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    t0 = time.perf_counter()
    status, chunks = await conn.request("POST", "/v1/completions", body)
    reads, tail, events = [], b"", 0
    async for data in chunks:
        reads.append(time.perf_counter())
        events += data.count(b"data: ")
        tail = (tail + data)[-4096:]
    done = tail.endswith(b"data: [DONE]\n\n")
    last = [e for e in tail.split(b"\n\n") if e.startswith(b"data: {")]
    usage = json.loads(last[-1][6:]).get("usage") if last and done else None
    tokens = (usage or {}).get("completion_tokens", 0)
    # the events: a chunk per piece of text (a token here), the finish chunk, the usage chunk, [DONE]
    ok = status == 200 and done and tokens == max_tokens and events == max_tokens + 3
    return {"ok": ok, "tokens": tokens, "ttft": reads[0] - t0 if reads else float("nan"), "gaps": np.diff(reads)}


async def get_json(host, port, method: str, path: str) -> dict:
    """One request on a connection of its own (an idle one is closed by the server after its timeout)."""
    conn = Connection(host, port)
    try:
        _, chunks = await conn.request(method, path)
        return json.loads(b"".join([c async for c in chunks]))
    finally:
        conn.close()


async def level(host, port, clients: int, args) -> dict:
    conns = [Connection(host, port) for _ in range(clients)]
    try:
        before = await get_json(host, port, "GET", "/bench/stats")

        async def one_client(conn):
            return [await stream_request(conn, args.max_tokens) for _ in range(args.requests)]

        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(one_client(c) for c in conns)) for r in rs]
        wall = time.perf_counter() - t0
        after = await get_json(host, port, "GET", "/bench/stats")
    finally:
        for c in conns:
            c.close()
    ok = [r for r in results if r["ok"]]
    gaps = np.concatenate([r["gaps"] for r in ok]) * 1e3 if ok else np.zeros(1)
    steps = after["steps"] - before["steps"]
    span = after["last"] - (before["last"] if before["last"] is not None else after["first"])
    step_wall = span / max(steps, 1)
    # what a server that cost nothing would take per step: the fake's sleep (as long as one takes here)
    engine = after["sleep_s"]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "clients": clients,
        "failures": len(results) - len(ok),
        "tokens_per_s": tokens / wall,
        "ideal": clients / engine,
        "step_ms": step_wall * 1e3,
        "host_ms": (step_wall - engine) * 1e3,
        "cpu_ms": (after["cpu"] - before["cpu"]) / max(steps, 1) * 1e3,
        "loop_cpu_ms": (after["loop_cpu"] - before["loop_cpu"]) / max(steps, 1) * 1e3,
        "rows": (after["rows"] - before["rows"]) / max(steps, 1),
        "loop_us_token": (after["loop_cpu"] - before["loop_cpu"]) / max(after["rows"] - before["rows"], 1) * 1e6,
        "per_write": (after["events"] - before["events"]) / max(after["writes"] - before["writes"], 1),
        "sleep_ms": engine * 1e3,
        "ttft_p50": float(np.median([r["ttft"] for r in ok])) * 1e3 if ok else float("nan"),
        # the engine process's share: queued there to first token handed out (its mean)
        "engine_ttft": (after["first_tokens"][1] - before["first_tokens"][1])
        / max(after["first_tokens"][0] - before["first_tokens"][0], 1)
        * 1e3,
        "gap_p50": float(np.percentile(gaps, 50)),
        "gap_p99": float(np.percentile(gaps, 99)),
    }


async def first_token(host, port, args) -> tuple[float, float, float, float]:
    """Ms to a one-token answer, one request at a time: streamed (to its first read) and whole, the median and
    the least of each; and the server process's CPU ms per request (unlike the times, not lengthened by
    other work on a busy machine)."""
    conn = Connection(host, port)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1, "temperature": 0}).encode()
    before = await get_json(host, port, "GET", "/bench/stats")
    try:
        streamed, whole = [], []
        for _ in range(args.ttft_repeats):
            streamed.append((await stream_request(conn, 1))["ttft"])
            t0 = time.perf_counter()
            _, chunks = await conn.request("POST", "/v1/completions", body)
            [c async for c in chunks]
            whole.append(time.perf_counter() - t0)
    finally:
        conn.close()
    after = await get_json(host, port, "GET", "/bench/stats")
    cpu = (after["process_cpu"] - before["process_cpu"]) / (2 * args.ttft_repeats)  # the stats requests' too
    return float(np.median(streamed)) * 1e3, float(np.median(whole)) * 1e3, min(streamed + whole) * 1e3, cpu * 1e3


async def profiled(host, port, clients: int, args) -> tuple[dict, dict]:
    """cProfile of the server at `clients` streams, then during the one-token answers."""
    await get_json(host, port, "POST", "/bench/profile/on")
    await level(host, port, clients, args)
    load = await get_json(host, port, "POST", "/bench/profile/off")
    await get_json(host, port, "POST", "/bench/profile/on")
    await first_token(host, port, args)
    return load, await get_json(host, port, "POST", "/bench/profile/off")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", default="1,8,32,64", help="concurrent clients, comma-separated")
    ap.add_argument("--requests", type=int, default=3, help="requests per client at each level")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per answer")
    ap.add_argument("--step-ms", type=float, default=0.7, help="the fake engine's decode step")
    ap.add_argument("--prefill-us", type=float, default=2.0, help="the fake engine's prefill, per prompt token")
    ap.add_argument(
        "--host-us", type=float, default=300.0, help="the fake engine's GIL-holding host work per step (launches)"
    )
    ap.add_argument("--ttft-repeats", type=int, default=30)
    ap.add_argument(
        "--stepwise", action="store_true", help="no greedy chain: the server decodes a step at a time and waits on each"
    )
    ap.add_argument("--profile", action="store_true", help="profile the server at the top level (a run of its own)")
    ap.add_argument("--top", type=int, default=25, help="functions per profile")
    ap.add_argument("--asgi", action="store_true", help="only the HTTP side's CPU per token, in this process")
    ap.add_argument("--repeats", type=int, default=5, help="--asgi: runs per row")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child
    ap.add_argument("--max-batch", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    if args.serve:
        serve(args)
        return 0
    if args.asgi:
        return asgi_main(args)
    cmd = (
        [
            sys.executable,
            __file__,
            "--serve",
            "--max-batch",
            str(max(levels)),
            "--step-ms",
            str(args.step_ms),
            "--prefill-us",
            str(args.prefill_us),
            "--host-us",
            str(args.host_us),
            "--max-tokens",
            str(args.max_tokens),
            "--top",
            str(args.top),
        ]
        + (["--profile"] if args.profile else [])
        + (["--stepwise"] if args.stepwise else [])
    )
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    line = proc.stderr.readline()
    found = re.search(r"http://([\d.]+):(\d+)/", line)
    if not found:
        proc.kill()
        raise SystemExit(f"the server did not start: {line}{proc.stderr.read()}")
    host, port = found.group(1), int(found.group(2))
    # the server's log (warnings only) passes through: a full pipe must not stall it
    threading.Thread(target=lambda: sys.stderr.writelines(proc.stderr), daemon=True).start()
    try:
        asyncio.run(level(host, port, 1, argparse.Namespace(**{**vars(args), "requests": 1})))  # warm-up
        rows = [asyncio.run(level(host, port, c, args)) for c in levels]
        ttft = asyncio.run(first_token(host, port, args))
        prof = asyncio.run(profiled(host, port, max(levels), args)) if args.profile else None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(
        f"\nfake engine{' (stepwise)' if args.stepwise else ''}: {args.step_ms} ms a step + {args.host_us:g} us of "
        "GIL-holding host work "
        f"({rows[0]['sleep_ms']:.3f} ms as this machine runs one alone), "
        f"{args.prefill_us} us a prompt token; {args.requests} requests per client, {args.max_tokens} tokens each; "
        f"max_batch {max(levels)}"
    )
    print(
        f"{'clients':>7} {'tokens/s':>9} {'ideal':>8} {'/ideal':>6} {'rows/step':>9} {'step ms':>8} {'host ms':>8} "
        f"{'cpu ms':>7} {'loop cpu':>8} {'us/token':>8} {'ev/write':>8} {'TTFT p50':>9} {'gap p50':>8} {'gap p99':>8} "
        f"{'engine':>7} {'failures':>8}"
    )
    for r in rows:
        print(
            f"{r['clients']:>7} {r['tokens_per_s']:>9.0f} {r['ideal']:>8.0f} {r['tokens_per_s'] / r['ideal']:>5.2f}x "
            f"{r['rows']:>9.1f} {r['step_ms']:>8.3f} {r['host_ms']:>8.3f} {r['cpu_ms']:>7.3f} {r['loop_cpu_ms']:>8.3f} "
            f"{r['loop_us_token']:>8.1f} {r['per_write']:>8.2f} "
            f"{r['ttft_p50']:>7.1f}ms {r['gap_p50']:>6.2f}ms {r['gap_p99']:>6.2f}ms {r['engine_ttft']:>5.1f}ms "
            f"{r['failures']:>8}"
        )
    print(
        "(step ms: the scheduler thread's time per decode step; host ms: of that, outside the fake engine; cpu ms:"
        " the scheduler thread's CPU per step; loop cpu: the event loop thread's CPU per step, us/token: per token"
        " generated; ev/write: server-sent events per body write of the streams; engine: the engine process's mean"
        " share of the time to first token)"
    )
    prompt_tokens = len(tokenizer().encode(PROMPT))
    print(
        f"one-token answer ({prompt_tokens} prompt tokens, {prompt_tokens * args.prefill_us / 1e3:.2f} ms of fake "
        f"prefill): time to first token {ttft[0]:.2f} ms streamed, {ttft[1]:.2f} ms whole (median of "
        f"{args.ttft_repeats}; least {ttft[2]:.2f} ms); server CPU {ttft[3]:.2f} ms a request"
    )
    if prof:
        print(f"\nprofile at {max(levels)} clients: the event loop's thread\n{prof[0]['loop']}")
        print(f"the scheduler's thread\n{prof[0]['worker']}")
        print(f"profile of the one-token answers: the event loop's thread\n{prof[1]['loop']}")
    return 1 if any(r["failures"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
