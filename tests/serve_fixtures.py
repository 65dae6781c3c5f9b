"""A chat model that has learned two answers, and a live `nanoeuler serve` app on a loopback port.

The model is the tiny test configuration fine-tuned for a few seconds on two Alpaca examples until
it answers them word for word, so a test can tell that the server applied the chat template."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from train_fixtures import TINY_MODEL, make_tokenizer

from nanoeuler.train.sft import encode_example, sft_batch

LEARNED = {"What is the capital of France?": "Paris.", "Name a color.": "Blue."}


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
    """Serve `model_path` on 127.0.0.1 (a free port) in a thread; yields (base URL, app). `config`: ServeConfig's
    fields, and `shutdown_grace_s`, `send_buffer` (SO_SNDBUF of the connections) and `speculative` (the backend's)."""
    import uvicorn

    from nanoeuler.serve.app import ServeConfig, create_app
    from nanoeuler.serve.backend import Backend
    from nanoeuler.serve.server import listen, uvicorn_config

    grace = config.pop("shutdown_grace_s", 10.0)
    send_buffer = config.pop("send_buffer", None)  # bytes: small, an unread answer fills it in moments
    speculative = config.pop("speculative", False)
    backend = Backend.load(
        model_path, "cpu", slots=config.get("max_batch", ServeConfig.max_batch), speculative=speculative
    )
    app = create_app(backend, ServeConfig(**config))
    sock = listen("127.0.0.1", 0)
    if send_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)  # connections accepted inherit it
    server = uvicorn.Server(uvicorn_config(app, app.state.config.client_timeout_s, grace, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


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


class CountingBackend:
    """A backend whose every stream yields 1, 2, 3, ... and whose step takes `step_s` (a GPU's stand-in): what
    the engine process runs in tests. Built there by `counting_backend` (a module-level factory: `spawn`)."""

    stop_ids = frozenset()
    prefixes = free_slots = engine = None
    speculative = False

    def __init__(self, step_s: float, broken_close: bool = False):
        self.step_s, self.broken_close = step_s, broken_close  # broken_close: closing a stream raises

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
