"""A chat model that has learned two answers, and a live `nanoeuler serve` app on a loopback port.

The model is the tiny test configuration fine-tuned for a few seconds on two Alpaca examples until
it answers them word for word, so a test can tell that the server applied the chat template."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from functools import partial

from train_fixtures import TINY_MODEL, make_tokenizer

from nanoeuler.train.sft import encode_example, sft_batch

LEARNED = {"What is the capital of France?": "Paris.", "Name a color.": "Blue."}


def serve_argv(model_path, log_level: str, *extra: str) -> list[str]:
    """`nanoeuler serve` of `model_path` on the CPU, on a free loopback port, as a subprocess's argv."""
    ckpt = ["--ckpt", str(model_path), "--device", "cpu", "--port", "0", "--log-level", log_level]
    return [sys.executable, "-m", "nanoeuler", "serve", *ckpt, *extra]


def chat_model(tmp_path_factory) -> str:
    """The trained model file, made once per test session (a few seconds)."""
    path = tmp_path_factory.getbasetemp() / "serve_chat.bin"
    if not path.exists():
        train_chat_model(path)
    return str(path)


def train_chat_model(path, steps: int = 100, mtp_heads: int | None = None):
    """Fine-tune the tiny model (with `mtp_heads` output heads: default the tiny config's) on LEARNED (full
    batch, AdamW) and save it with its tokenizer."""
    from nanoeuler import checkpoint
    from nanoeuler.model.config import ModelConfig
    from nanoeuler.model.transformer import init_params, loss_and_grads
    from nanoeuler.optim import AdamW

    tok = make_tokenizer()
    cfg = ModelConfig.from_section({**TINY_MODEL, **({"mtp_heads": mtp_heads} if mtp_heads else {})}, tok.vocab_size)
    params = init_params(cfg, 0)
    examples = [encode_example(tok, {"instruction": q, "input": "", "output": a}) for q, a in LEARNED.items()]
    inputs, targets = sft_batch(examples, cfg.mtp_heads, tok.eot_id)
    opt = AdamW(params, weight_decay=0.0)
    for _ in range(steps):
        _, grads = loss_and_grads(params, inputs, targets, cfg)
        opt.step(params, grads, 3e-3)
    checkpoint.save_model(path, params, cfg, step=steps, tokenizer_json=tok.to_json())
    return tok


@contextlib.contextmanager
def live_server(model_path, **config):
    """Serve `model_path` on 127.0.0.1 (a free port) as `nanoeuler serve` does: the engine in a process of its
    own, uvicorn in a thread here; yields (base URL, app). `config`: ServeConfig's fields, `max_batch` and
    `max_queue` (the engine's), `shutdown_grace_s`, `send_buffer` (SO_SNDBUF of the connections), and
    `served_backend`'s `speculative`, `knobs` and `broken`."""
    import uvicorn

    from nanoeuler.serve.app import ServeConfig, create_app
    from nanoeuler.serve.engine_proc import EngineProcess
    from nanoeuler.serve.server import listen, uvicorn_config

    grace = config.pop("shutdown_grace_s", 10.0)
    send_buffer = config.pop("send_buffer", None)  # bytes: small, an unread answer fills it in moments
    max_batch, max_queue = config.pop("max_batch", 8), config.pop("max_queue", 64)
    made = {k: config.pop(k) for k in ("speculative", "knobs", "broken") if k in config}
    engine = EngineProcess(partial(served_backend, str(model_path), max_batch, **made), max_batch, max_queue).start()
    app = create_app(engine, ServeConfig(**config))
    sock = listen("127.0.0.1", 0)
    if send_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)  # connections accepted inherit it
    server = uvicorn.Server(uvicorn_config(app, app.state.config.client_timeout_s, grace, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        if engine._proc.is_alive():  # the server never started (its shutdown stops the engine otherwise)
            engine._proc.kill()
            engine._proc.join()


class ServedBackend:
    """Knobs on the server's `Backend`, turned from the test's process while the engine runs in its own: a JSON
    file (`knobs`) read before each step, with any of {"delay_s": sleep this long first, "gate": hold the step
    while this file exists (at most 10 s), "steps": append the step's batch size to this file}. Mixed into
    `Backend` by `served_backend`."""

    knobs: str | None = None

    def step(self, streams):
        knobs = {}
        if self.knobs and os.path.exists(self.knobs):
            with open(self.knobs) as f:
                knobs = json.load(f)
        time.sleep(knobs.get("delay_s", 0))
        deadline = time.monotonic() + 10
        while knobs.get("gate") and os.path.exists(knobs["gate"]) and time.monotonic() < deadline:
            time.sleep(0.001)
        if knobs.get("steps"):
            with open(knobs["steps"], "a") as f:
                f.write(f"{len(streams)}\n")
        return super().step(streams)


def served_backend(path: str, slots: int, speculative=False, knobs=None, broken=None):
    """The engine's backend in the tests (a module-level function: the engine process calls it after `spawn`):
    `path` on the CPU with `ServedBackend`'s knobs; sampling at temperature `broken` raises FloatingPointError,
    at a prefill and in a decode step alike."""
    from nanoeuler.serve.backend import Backend

    if broken is not None:
        import nanoeuler.infer.cpu
        import nanoeuler.serve.backend
        from nanoeuler.infer.sampling import sample_token

        def sample(logits, rng, temperature, top_k=0, top_p=1.0):
            if temperature == broken:
                raise FloatingPointError("the sampler broke")
            return sample_token(logits, rng, temperature, top_k, top_p)

        nanoeuler.infer.cpu.sample_token = nanoeuler.serve.backend.sample_token = sample
    kind = type("Served", (ServedBackend, Backend), {"knobs": knobs})
    return kind.load(path, "cpu", slots=slots, speculative=speculative)


def run_streams(backend, specs):
    """Open every (prompt, n, sampling, options) on a server `Backend` at once and step them to the end:
    (their token lists, the streams). Each stream is closed at the end, so its slot goes back."""
    streams = [backend.open(p, n, s, stop_at_end=False, **o) for p, n, s, o in specs]
    got = [[] for _ in streams]
    while any(not s.done for s in streams):
        live = [i for i, s in enumerate(streams) if not s.done]
        for i, new in zip(live, backend.step([streams[i] for i in live])):
            assert not isinstance(new, Exception), new
            got[i] += new
    for s in streams:
        s.close()
    return got, streams


def run_joining(backend, specs, slots: int, join_at: int):
    """Every (prompt, n, sampling) through `backend.step`, as a server admits them: the first two start
    together, the others join from step `join_at` on as slots come free; finished streams are closed (their
    slots reused). (each spec's tokens, the most tokens a stream got from one step)."""
    got, active, waiting, step, most = [[] for _ in specs], [], list(enumerate(specs)), 0, 0
    while waiting or active:
        while waiting and len(active) < slots and (step >= join_at or len(active) < 2):
            i, (prompt, n, sampling) = waiting.pop(0)
            active.append((i, backend.open(prompt, n, sampling, stop_at_end=False)))
        for (i, stream), new in zip(active, backend.step([s for _, s in active])):
            assert not isinstance(new, Exception), new
            got[i] += new
            most = max(most, len(new))
        for i, stream in [a for a in active if a[1].done]:
            stream.close()
        active = [a for a in active if not a[1].done]
        step += 1
    return got, most


def joining_jobs(ctx_len: int) -> list:
    """Greedy (prompt, n, sampling) for `run_joining` on 4 slots with streams that join a running chain:
    ragged prompts, two sharing a 40-token prefix (the second reuses its rows), one of 1 token, and one
    whose prompt leaves the chain no room (it drains the chain)."""
    from nanoeuler.infer.sampling import Sampling

    greedy = Sampling(temperature=0)
    shared = list(range(5, 45))
    lengths = [([1, 2, 3], 30), (shared, 12), ([7], 9), ([9, 9], 20), (shared + [3, 4], 8), ([4, 4, 4, 4], 1)]
    lengths += [(list(range(1, ctx_len - 1)), 2), ([11], 25), ([12, 13], 14), ([14], 10)]
    return [(prompt, n, greedy) for prompt, n in lengths]


class Outbox:
    """A `Scheduler`'s `send` that keeps what it is sent, per job; `calls`: the batches, one per call."""

    def __init__(self):
        self.calls, self._got, self._cond = [], {}, threading.Condition()

    def __call__(self, batch: list) -> None:
        with self._cond:
            self.calls.append(batch)
            for job, items in batch:
                self._got.setdefault(job, []).extend(items)
            self._cond.notify_all()

    def items(self, job, at_least: int | None = None, timeout: float = 10) -> list:
        """The job's items so far, once it has ended (or once there are `at_least` of them)."""
        from nanoeuler.serve.scheduler import END

        def ready():
            got = self._got.get(job, [])
            return (at_least is not None and len(got) >= at_least) or (
                got and (got[-1] is END or isinstance(got[-1], BaseException))
            )

        with self._cond:
            assert self._cond.wait_for(ready, timeout), f"the job sent only {self._got.get(job)}"
            return list(self._got[job])


class CountingBackend:
    """A backend whose every stream yields 1, 2, 3, ... and whose step takes `step_s` (a GPU's stand-in): what
    the engine process runs in tests. Built there by `counting_backend` (a module-level factory: `spawn`)."""

    name, ctx_len, capacity = "counting", 64, None
    stop_ids = frozenset()
    prefixes = free_slots = engine = None
    speculative = False

    def __init__(self, step_s: float, broken_close: bool = False):
        from nanoeuler.model.config import ModelConfig
        from train_fixtures import TINY_MODEL, make_tokenizer

        self.step_s, self.broken_close = step_s, broken_close  # broken_close: closing a stream raises
        self.tok = make_tokenizer()
        self.cfg = ModelConfig.from_section(TINY_MODEL, self.tok.vocab_size)

    def open(self, prompt_ids, max_new_tokens, sampling, stop_at_end=True):
        import itertools

        from nanoeuler.serve.backend import TokenStream

        tokens = itertools.count(1) if self.broken_close else (t for t in itertools.count(1))  # a count has no close
        return TokenStream(max_new_tokens, frozenset(), tokens)

    def step(self, streams):
        time.sleep(self.step_s)
        return [[s.advance()] for s in streams]


def counting_backend(step_s: float = 0.001, broken_close: bool = False) -> CountingBackend:
    return CountingBackend(step_s, broken_close)
