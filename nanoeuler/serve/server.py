"""`nanoeuler serve`: the chat model behind an OpenAI-compatible HTTP API and a web chat page.

    nanoeuler serve --ckpt results/chat.bin              # http://127.0.0.1:8000/
    nanoeuler serve --ckpt results/chat.bin --host 0.0.0.0 --api-key "$KEY"

Needs the `serve` extra (FastAPI + uvicorn). Binds to 127.0.0.1 unless told otherwise; any other
address prints a warning, since without `--api-key` (or NANOEULER_API_KEY) anyone who can reach the
port can use the model, and with it the key still travels in plain HTTP.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys

from nanoeuler.backend import add_device_argument
from nanoeuler.config import add_config_arguments, sections
from nanoeuler.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--ckpt", required=True, metavar="BIN", help="chat model file, e.g. results/chat.bin")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000; 0 = any free)")
    parser.add_argument("--model-name", metavar="NAME", help="the model's id in the API (default: the file's stem)")
    parser.add_argument("--api-key", metavar="KEY", default=os.environ.get("NANOEULER_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $NANOEULER_API_KEY, else none)")
    parser.add_argument("--max-tokens", type=int, default=256, metavar="N",
                        help="most new tokens one request may ask for, and the default (default: 256)")
    parser.add_argument("--max-batch", type=int, default=8, metavar="N",
                        help="requests generated together (default: 8)")
    parser.add_argument("--max-queue", type=int, default=64, metavar="N",
                        help="requests waiting beyond those; more are answered 429 (default: 64)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


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
        return (f"listening on {host}: there is no authentication, anyone who can reach this port can use "
                "the model (set --api-key, or bind to 127.0.0.1)")
    return f"listening on {host}: the API key travels in plain HTTP; put a TLS proxy in front for untrusted networks"


def listen(host: str, port: int) -> socket.socket:
    """A listening socket, so a taken port is one clear error before anything else starts."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
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

    for name in ("max_tokens", "max_batch"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_queue < 0:
        raise UserError("--max-queue must be >= 0")
    conf = sections(args, "device", "gpu_memory")
    backend = Backend.load(args.ckpt, args.device or conf["device"], args.model_name, slots=args.max_batch,
                           gpu_memory=conf["gpu_memory"])
    config = ServeConfig(max_tokens=args.max_tokens, max_batch=backend.capacity or args.max_batch,
                         max_queue=args.max_queue,
                         api_key=args.api_key or None)
    warning = exposure_warning(args.host, config.api_key)
    if warning:
        print(f"nanoeuler serve: warning: {warning}", file=sys.stderr, flush=True)
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
    print(f"nanoeuler serve: {args.ckpt} as model {backend.name!r} ({backend.cfg.n_params():,} "
          f"parameters, {backend.ctx_len}-token context) at http://{host}:{port}/ (API: http://{host}:{port}/v1)",
          file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(backend, config), log_level=args.log_level))
    server.run(sockets=[sock])
    return 0
