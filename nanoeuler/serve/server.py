"""`nanoeuler serve`: the chat model behind an OpenAI-compatible HTTP API and a web chat page.

    nanoeuler serve --ckpt results/chat.bin              # http://127.0.0.1:8000/
    nanoeuler serve --ckpt results/chat.bin --host 0.0.0.0 --api-key "$KEY"

Needs the `serve` extra (FastAPI + uvicorn). Binds to 127.0.0.1 unless told otherwise; any other
address prints a warning, since without `--api-key` (or NANOEULER_API_KEY) anyone who can reach the
port can use the model, and with it the key still travels in plain HTTP.

The model loads and generates in a process of its own (`engine_proc`): the HTTP server here never
touches the GPU, and its event loop does not share a GIL with the decode loop. A model that cannot be
loaded is one line and exit code 1 before anything listens; an engine that dies later turns /health and
new requests into 503s.

A client gets --client-timeout seconds for a request's headers (then the connection is closed), again
for its body (408), and may leave an answer unread for as long (then the connection is dropped and the
generation stops). SIGTERM or Ctrl-C stops taking connections and lets answers in progress finish for
up to --shutdown-grace seconds; what is left then (a stream whose client stopped reading) is cut.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import socket
import sys
from functools import partial

from nanoeuler.backend import add_device_argument
from nanoeuler.config import add_config_arguments, sections
from nanoeuler.errors import UserError

MAX_BATCH = 1024  # a bound before memory is even counted (`backend._slots` counts it)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--ckpt", required=True, metavar="BIN", help="chat model file, e.g. results/chat.bin")
    from nanoeuler.infer.engine import add_threads_argument

    add_threads_argument(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000; 0 = any free)")
    parser.add_argument("--model-name", metavar="NAME", help="the model's id in the API (default: the file's stem)")
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        default=os.environ.get("NANOEULER_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $NANOEULER_API_KEY, else none)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=256,
        metavar="N",
        help="most new tokens one request may ask for, and the default (default: 256)",
    )
    parser.add_argument(
        "--max-batch", type=int, default=8, metavar="N", help="requests generated together (default: 8)"
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="N",
        help="requests waiting beyond those; more are answered 429 (default: 64)",
    )
    parser.add_argument(
        "--prefix-cache",
        type=int,
        default=8,
        metavar="N",
        help="recent prompts whose cache rows a prompt sharing their beginning copies instead of "
        "computing (0: off; default: 8)",
    )
    parser.add_argument(
        "--speculative",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="greedy requests (temperature 0, no logprobs or response_format) decode by "
        "self-speculation in the batch: the MTP heads draft, one pass verifies every such "
        "stream's drafts; the same tokens, more of them per step where the heads are "
        "trained (acceptance per head: /metrics). Default: off",
    )
    parser.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a GPU, serve made-up requests at every batch width before listening, so that no real "
        "request waits for kernels to load or a step's CUDA graph to be recorded (default: on)",
    )
    parser.add_argument(
        "--client-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a client may stall: sending a request's headers, its body, or taking an answer (default: 30)",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds answers in progress get to finish after SIGTERM (default: 10)",
    )
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def check_arguments(args: argparse.Namespace) -> None:
    """Numbers in range before anything is loaded; each problem is one line."""
    bounds = {
        "port": (0, 65535),
        "max_tokens": (1, None),
        "max_batch": (1, MAX_BATCH),
        "max_queue": (0, None),
        "prefix_cache": (0, 1024),
    }
    for name, (lo, hi) in bounds.items():
        value = getattr(args, name)
        if value < lo or (hi is not None and value > hi):
            upper = f" and <= {hi}" if hi is not None else ""
            raise UserError(f"--{name.replace('_', '-')}: {value} is out of range (must be >= {lo}{upper})")
    for name in ("client_timeout", "shutdown_grace"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise UserError(f"--{name.replace('_', '-')}: {value} is not a number of seconds > 0")


def uvicorn_config(app, client_timeout_s: float, shutdown_grace_s: float, log_level: str = "info"):
    """uvicorn's settings for `app`: h11 with deadlines on stalled clients (`Protocol`), a bounded shutdown."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        """h11 with two deadlines uvicorn lacks, both `client_timeout_s`: a connection whose next request's
        headers have not all arrived that long after it opened (or after its last answer) is closed, and
        one whose client has taken no part of an answer for that long is dropped (its generation stops)."""

        _headers_due = _stall_due = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._headers_due = self._rearm(self._headers_due, self._headers_late)

        def on_response_complete(self):
            super().on_response_complete()
            self._headers_due = self._rearm(self._headers_due, self._headers_late)

        def pause_writing(self):  # the client's buffers are full: it is not reading
            super().pause_writing()
            self._stall_due = self._rearm(self._stall_due, self.transport.abort)

        def resume_writing(self):
            super().resume_writing()
            self._stall_due = self._rearm(self._stall_due, None)

        def connection_lost(self, exc):
            self._rearm(self._headers_due, None)
            self._rearm(self._stall_due, None)
            super().connection_lost(exc)

        def _rearm(self, timer, then):
            if timer is not None:
                timer.cancel()
            return self.loop.call_later(client_timeout_s, then) if then else None

        def _headers_late(self):
            waiting = self.cycle is None or self.cycle.response_complete  # no request under way
            if waiting and not self.transport.is_closing():
                self.transport.close()

    return uvicorn.Config(app, http=Protocol, log_level=log_level, timeout_graceful_shutdown=shutdown_grace_s)


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning for an address other than loopback, or None.

    >>> exposure_warning("127.0.0.1", None) is None
    True
    """
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        if host == "localhost":
            return None
    if api_key is None:
        return (
            f"listening on {host}: there is no authentication, anyone who can reach this port can use "
            "the model (set --api-key, or bind to 127.0.0.1)"
        )
    return f"listening on {host}: the API key travels in plain HTTP; put a TLS proxy in front for untrusted networks"


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (`bound`, then listening)."""
    sock = bound(host, port)
    sock.listen(128)
    return sock


def bound(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, so a taken port is one clear error before anything else starts; it
    listens once the server runs (asyncio's `create_server` calls `listen`)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from nanoeuler.serve.app import ServeConfig, create_app
    except ImportError as exc:
        raise UserError(f"serving needs the 'serve' extra ({exc.name} is missing): pip install 'nanoeuler[serve]'")
    from nanoeuler.serve.backend import Backend
    from nanoeuler.serve.engine_proc import EngineProcess

    check_arguments(args)
    conf = sections(args, "device", "gpu_memory")
    make_backend = partial(  # called in the engine process: the weights never load here
        Backend.load,
        args.ckpt,
        args.device or conf["device"],
        args.model_name,
        slots=args.max_batch,
        gpu_memory=conf["gpu_memory"],
        threads=args.threads,
        prefix_cache=args.prefix_cache,
        speculative=args.speculative,
        warm_up=args.warm_up,
    )
    config = ServeConfig(max_tokens=args.max_tokens, api_key=args.api_key or None, client_timeout_s=args.client_timeout)
    warning = exposure_warning(args.host, config.api_key)
    if warning:
        print(f"nanoeuler serve: warning: {warning}", file=sys.stderr, flush=True)
    sock = bound(args.host, args.port)  # a taken port is an error before the model loads; none listens till it has
    try:
        engine = EngineProcess(make_backend, args.max_batch, args.max_queue).start()
    except BaseException:
        sock.close()
        raise
    model = engine.model
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
    print(
        f"nanoeuler serve: {args.ckpt} as model {model.name!r} ({model.params:,} parameters, {model.ctx_len}-token "
        f"context) at http://{host}:{port}/ (API: http://{host}:{port}/v1)",
        file=sys.stderr,
        flush=True,
    )
    app = create_app(engine, config)
    server = uvicorn.Server(uvicorn_config(app, args.client_timeout, args.shutdown_grace, args.log_level))
    server.run(sockets=[sock])
    return 0
