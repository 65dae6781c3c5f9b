"""The HTTP API: OpenAI-compatible routes, the chat page, and errors as OpenAI error bodies.

    GET  /                      the chat page (one HTML file, no external resources)
    GET  /health                {"status": "ok", "model", "active", "waiting", "free_slots", ...}; no key needed;
                                503 with "status": "error" once the engine process has stopped
    GET  /v1/models             the one model served, named after its file (chat.bin -> "chat")
    POST /v1/chat/completions   messages -> an answer (`stream`: server-sent events ending `data: [DONE]`)
    POST /v1/completions        prompt -> its continuation (the same options)
    POST /tokenize              {"content": text, "with_pieces"?} -> {"tokens": [ids]} (llama.cpp's shapes)
    POST /detokenize            {"tokens": [ids]} -> {"content": text}
    GET  /metrics               the Prometheus text format (`metrics`)

A request is checked (`protocol`), made into prompt ids (on a worker thread when long: tokenizing a long
prompt takes a while), queued for the engine process (`engine_proc`, which generates; 429 when full, 503
once it has stopped) and answered as its tokens arrive. Its text is
decoded incrementally, so a character split over tokens is sent whole, and cut at the first stop
string; `</s>` and `<|endoftext|>` end an answer and are not sent. `usage.completion_tokens` counts
every token generated, the end marker included. A client that goes away cancels its generation. The `n`
choices of a request are queued together (all or none) and decode as rows of the same batches, choice i
sampling with seed + i.

Hostile or broken clients harm only their own request: a POST must say `Content-Type: application/json`
(415 otherwise, so a page on another site cannot send one without the browser asking first); its body is
read as it arrives, within `client_timeout_s` (408) and `max_body_bytes` (413, the connection closed); and
every answer carries an `X-Request-Id`, which a 500 also names in its message and in the server's log,
with the exception's traceback.
"""

from __future__ import annotations

import asyncio
import codecs
import hmac
import json
import logging
import secrets
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoeuler.infer.sampling import SEED_LIMIT
from nanoeuler.serve.backend import Sampling
from nanoeuler.serve.engine_proc import EngineGone, EngineProcess, Model, RemoteJob
from nanoeuler.serve.metrics import CONTENT_TYPE, Metrics
from nanoeuler.serve.prompts import PromptError, StopText, chat_prompt
from nanoeuler.serve.protocol import ApiError, Options, parse_chat, parse_completion, parse_json
from nanoeuler.serve.scheduler import QueueFull

log = logging.getLogger("nanoeuler.serve")
INLINE_CHARS = 2048  # prompts up to this long are tokenized on the event loop (`_tokenized`)
TAIL_CACHE = 1 << 16  # pieces whose event ends `_Shape.event` keeps, per kind (a vocabulary's worth)


@dataclass(frozen=True)
class ServeConfig:
    """Limits and access. `max_tokens` is both the per-request limit and the default of `max_tokens`."""

    max_tokens: int = 256
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    client_timeout_s: float = 30.0  # for a request's body here; headers and unread answers: `server.uvicorn_config`


def create_app(engine: EngineProcess, config: ServeConfig = ServeConfig()) -> FastAPI:
    """The app in front of a started engine process (`EngineProcess.start`); it stops the engine when it stops."""
    model = engine.model
    engine.metrics = metrics = Metrics(engine)

    @asynccontextmanager
    async def lifespan(app):
        engine.attach()
        yield
        await engine.stop()

    app = FastAPI(title="nanoeuler", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.config, app.state.metrics = engine, config, metrics
    app.add_middleware(_RequestIds, on_status=metrics.answered)
    page = resources.files("nanoeuler.serve").joinpath("static/chat.html").read_text(encoding="utf-8")
    _add_error_handlers(app)

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        return HTMLResponse(page)

    @app.get("/health")
    async def health():
        body = {
            "status": "ok",
            "model": model.name,
            "context": model.ctx_len,
            "max_tokens": config.max_tokens,
            "auth": config.api_key is not None,
            "free_slots": engine.engine_stats.get("free_slots"),
            **engine.stats(),
        }
        if engine.alive:
            return body
        return JSONResponse({**body, "status": "error", "error": _engine_gone(engine).message}, status_code=503)

    @app.get("/v1/models")
    async def models(request: Request):
        _authorize(request, config)
        return {
            "object": "list",
            "data": [{"id": model.name, "object": "model", "created": 0, "owned_by": "nanoeuler"}],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        _authorize(request, config)
        req = parse_chat(await _read_json(request, config))
        max_new = _max_new_tokens(req.options, model, config)
        room = min(max_new, model.ctx_len // 4)
        try:
            ids, _ = await _tokenized(
                sum(len(text) for _, text in req.messages),
                chat_prompt,
                model.tok,
                list(req.messages),
                model.ctx_len,
                room,
            )
        except PromptError as exc:
            raise ApiError(str(exc), "messages", code=exc.code) from None
        return await _answer(request, "chat", ids, max_new, req.options, model, engine)

    @app.post("/v1/completions")
    async def completions(request: Request):
        _authorize(request, config)
        req = parse_completion(await _read_json(request, config))
        max_new = _max_new_tokens(req.options, model, config)
        ids = await _tokenized(
            len(req.prompt) if isinstance(req.prompt, str) else 0, _completion_ids, req.prompt, model
        )
        return await _answer(request, "text", ids, max_new, req.options, model, engine)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        _authorize(request, config)
        body = await _read_json(request, config)
        text = body.get("content")
        if not isinstance(text, str):
            raise ApiError("content: expected a string", "content")
        pieces = body.get("with_pieces", False)
        if not isinstance(pieces, bool):
            raise ApiError("with_pieces: expected a boolean", "with_pieces")
        ids = await _tokenized(len(text), model.tok.encode, text)
        if not pieces:
            return {"tokens": ids}
        return {"tokens": [{"id": t, "piece": _piece(model.tok.decode_bytes([t]))} for t in ids]}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        _authorize(request, config)
        ids = (await _read_json(request, config)).get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ApiError("tokens: expected an array of token ids", "tokens")
        for i, t in enumerate(ids):
            if not 0 <= t < model.tok.vocab_size:
                raise ApiError(f"tokens[{i}]: token id {t} is outside [0, {model.tok.vocab_size})", "tokens")
        return {"content": model.tok.decode_bytes(ids).decode("utf-8", errors="replace")}

    @app.get("/metrics")
    async def prometheus(request: Request):
        _authorize(request, config)
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    return app


async def _tokenized(chars: int, encode, *args):
    """encode(*args) for a prompt of `chars` characters: on the event loop when it is short (a hop to a thread
    and back costs more than encoding a few hundred characters), else on a worker thread (a long prompt takes
    a while, and the loop must go on streaming meanwhile)."""
    if chars <= INLINE_CHARS:
        return encode(*args)
    return await asyncio.to_thread(encode, *args)


def _piece(raw: bytes):
    """A token's text as llama.cpp's /tokenize gives it: a string, or its bytes when they are no UTF-8 text."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        if exc.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        if exc.status in (408, 413):  # the rest of the body is not read: the connection cannot carry another request
            headers = {"Connection": "close"}
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        what = "not found" if exc.status_code == 404 else exc.detail
        body = ApiError(f"{request.method} {request.url.path}: {what}", status=exc.status_code).body()
        return JSONResponse(body, status_code=exc.status_code)


class _RequestIds:
    """ASGI middleware: an id for every request, sent back as `X-Request-Id`; what escapes the routes is
    logged with its traceback under that id and answered 500 (a response already started is cut short)."""

    def __init__(self, app, on_status=None):
        self.app, self.on_status = app, on_status  # on_status(code): told of every answer's status

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if self.on_status is not None:
                    self.on_status(message["status"])
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            error = _server_error(rid, f"{scope['method']} {scope['path']}", exc)
            if not started:
                await JSONResponse(error.body(), status_code=500)(scope, receive, send_with_id)


def _server_error(rid: str, what: str, exc: BaseException) -> ApiError:
    """Log `exc` with its traceback under request id `rid`; the 500 that says so to the client."""
    log.error("request %s: %s failed", rid, what, exc_info=exc)
    return ApiError(f"{what} failed: {type(exc).__name__}: {exc} (request id {rid})", type="server_error", status=500)


def _authorize(request: Request, config: ServeConfig) -> None:
    if config.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, key = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), config.api_key.encode()):
        raise ApiError(
            "missing or incorrect API key (send 'Authorization: Bearer <key>')", status=401, code="invalid_api_key"
        )


async def _read_json(request: Request, config: ServeConfig) -> dict:
    """The body as JSON, read as it arrives (chunked or not): never more than `max_body_bytes` held."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise ApiError(
            f"the request body must be sent as 'Content-Type: application/json' (got {kind or 'none'!r})", status=415
        )
    limit = config.max_body_bytes
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ApiError(f"the request body is {length} bytes; the limit is {limit}", status=413)
    try:
        raw = await asyncio.wait_for(_read_body(request, limit), config.client_timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(f"the request body did not arrive within {config.client_timeout_s:g} s", status=408) from None
    return parse_json(raw)


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(f"the request body is more than {limit} bytes, the limit", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


def _max_new_tokens(options: Options, model: Model, config: ServeConfig) -> int:
    if options.model is not None and options.model != model.name:
        raise ApiError(
            f"model: {options.model!r} is not served here (this server serves {model.name!r})",
            "model",
            code="model_not_found",
        )
    if options.max_tokens is None:
        return config.max_tokens
    if options.max_tokens > config.max_tokens:
        raise ApiError(
            f"max_tokens: {options.max_tokens} is above this server's limit of {config.max_tokens}", "max_tokens"
        )
    return options.max_tokens


def _completion_ids(prompt, model: Model) -> list[int]:
    tok = model.tok
    if isinstance(prompt, str):
        ids = tok.encode(prompt) if prompt else [tok.eot_id]  # an empty prompt starts a new document
    else:
        for i, t in enumerate(prompt):
            if not 0 <= t < tok.vocab_size:
                raise ApiError(f"prompt[{i}]: token id {t} is outside [0, {tok.vocab_size})", "prompt")
        ids = list(prompt) or [tok.eot_id]
    if len(ids) >= model.ctx_len:
        raise ApiError(
            f"prompt: {len(ids)} tokens; the model's context holds {model.ctx_len}, the answer included",
            "prompt",
            code="context_length_exceeded",
        )
    return ids


class _Text:
    """A job's answer as (text piece, the (index, id) of the tokens it came from): decoded incrementally, cut at stop
    strings, then `finish_reason`. The end marker sends no text and no token."""

    def __init__(self, job: RemoteJob, model: Model, stops):
        self.job, self.model, self.stops = job, model, stops
        self.finish_reason = "length"
        self.ended = False  # an end marker or a stop string has ended the answer: its last parts come at once

    @property
    def ready(self) -> bool:
        """Whether the answer's next parts (or its end) have arrived, so `batches` gives them without waiting."""
        return self.ended or self.job.ready or self.job.outcome is not None

    async def batches(self):
        """Lists of (piece, held): the pieces of all the tokens that had arrived when read (one token's piece
        each, or none while a character is split over tokens)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        cut, stop_ids = StopText(self.stops), self.model.stop_ids
        token_bytes, token_text = self.model.token_bytes, self.model.token_text
        index, held = -1, []  # the tokens of text not yet sent (a character split over tokens)
        split = False  # the decoder holds the first bytes of a character: the next token goes through it too
        async for tokens in self.job.batches():
            out = []
            for token in tokens:
                index += 1
                if token in stop_ids:
                    if self.job.stop_at_end:
                        self.finish_reason, self.ended = "stop", True
                        break
                    continue  # ignore_eos: the marker is generated, not sent
                held.append((index, token))
                text = None if split else token_text[token]  # a whole character or more: no decoder needed
                if text is None:
                    text = decoder.decode(token_bytes[token])
                    split = bool(decoder.getstate()[0])
                piece = cut.feed(text)
                if piece:
                    out.append((piece, held))
                    held = []
                if cut.stopped:
                    self.finish_reason, self.ended = "stop", True
                    self.job.cancel()
                    if out:
                        yield out
                    return
            if out:
                yield out
            if self.ended:
                break
        else:  # no end marker: a grammar that is complete stops the answer too
            if self.job.grammar_stopped:
                self.finish_reason = "stop"
        tail = cut.feed(decoder.decode(b"", final=True))
        tail += "" if cut.stopped else cut.flush()
        if cut.stopped:
            self.finish_reason = "stop"
        if tail or held:
            yield [(tail, held)]


async def _answer(request, kind, ids, max_new, options: Options, model: Model, engine: EngineProcess):
    """Queue the request's `n` jobs and answer them: a JSON body, or server-sent events when `stream` is set."""
    seed = options.seed if options.seed is not None else secrets.randbits(63)
    if options.n > engine.max_batch + engine.max_queue:
        raise ApiError(
            f"n: {options.n} choices are more than this server holds at once "
            f"({engine.max_batch} answered + {engine.max_queue} waiting)",
            "n",
        )
    specs = [
        (
            ids,
            max_new,
            Sampling(options.temperature, 0, options.top_p, (seed + i) % SEED_LIMIT),
            not options.ignore_eos,
            {"logprobs": options.logprobs, "schema": options.schema},
        )
        for i in range(options.n)
    ]
    shape = _Shape(kind, model, len(ids), options.logprobs)
    try:
        jobs = engine.submit_many(specs)
    except QueueFull as exc:
        raise ApiError(
            f"the server is busy ({exc}); retry later", status=429, type="rate_limit_error", code="rate_limit_exceeded"
        ) from None
    except EngineGone:
        raise _engine_gone(engine) from None
    if options.schema is not None:  # the engine compiles the grammar: a schema it refuses is a 400, unanswered
        problem = await jobs[0].guided
        if problem is not None:
            raise ApiError(*problem)
    engine.metrics.prompt_tokens.inc(len(ids) * len(jobs))
    texts = [_Text(job, model, options.stop) for job in jobs]
    if options.stream:
        return _EventStream(
            partial(_stream, jobs, texts, shape, options.include_usage, request.state.request_id), engine.metrics
        )
    watcher = asyncio.create_task(_cancel_on_disconnect(request, jobs))

    async def whole(text: _Text) -> list:
        return [part async for parts in text.batches() for part in parts]

    try:
        answers = await asyncio.gather(*(whole(t) for t in texts))
    except Exception as exc:
        raise _generation_error(request.state.request_id, exc) from None
    finally:
        watcher.cancel()
        for job in jobs:
            job.cancel()
    choices = [shape.choice(i, text, parts) for i, (text, parts) in enumerate(zip(texts, answers))]
    return shape.whole(choices, sum(job.generated for job in jobs))


def _engine_gone(engine: EngineProcess) -> ApiError:
    """The 503 of a server whose engine process has ended (/health says so too)."""
    return ApiError(
        f"the generation process has stopped ({engine.error or 'it is not running'}); this server cannot answer",
        status=503,
        type="server_error",
        code="engine_unavailable",
    )


def _generation_error(rid: str, exc: BaseException) -> ApiError:
    """What a generation that failed is answered: a 503 when the engine has gone, else a 500 (logged)."""
    if isinstance(exc, EngineGone):
        log.error("request %s: %s", rid, exc)
        return ApiError(f"{exc} (request id {rid})", status=503, type="server_error", code="engine_unavailable")
    return _server_error(rid, "generation", exc)


async def _cancel_on_disconnect(request: Request, jobs: list[RemoteJob]) -> None:
    """Cancel `jobs` when their client goes away (the body is read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for job in jobs:
        job.cancel()


class _EventStream(Response):
    """The ASGI response of a streamed answer: `stream(write)` calls `write(events)` with lists of server-sent
    events, one body message each (`last=True`: the body ends with it, no empty message after), and a client
    that goes away cancels it. Leaner than Starlette's `StreamingResponse` (no task group per answer, no text
    encoded chunk by chunk), whose sends a profile at 32 streams found to be most of the event loop's time. A
    `Response` only so that FastAPI passes it on as it is."""

    HEADERS = [
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),  # a proxy in front must pass each write on at once
        (b"content-type", b"text/event-stream; charset=utf-8"),
    ]

    status_code = 200

    def __init__(self, stream, metrics: Metrics):
        self.stream, self.metrics = stream, metrics
        self.background = None  # FastAPI's background tasks, run once the answer is sent (none are made here)

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.HEADERS})
        metrics = self.metrics

        async def write(events: list[str], last: bool = False) -> None:
            metrics.stream_events += len(events)
            metrics.stream_writes += 1
            await send({"type": "http.response.body", "body": "".join(events).encode(), "more_body": not last})

        streaming = asyncio.ensure_future(self.stream(write))
        leaving = asyncio.ensure_future(_disconnect(receive))
        try:
            await asyncio.wait((streaming, leaving), return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
            streaming.cancel()  # the client has gone (or the server is stopping): its `finally` cancels the jobs
            await asyncio.wait((streaming,))
        if not streaming.cancelled():
            streaming.result()  # what escaped it: the middleware logs it
        if self.background is not None:
            await self.background()


async def _disconnect(receive) -> None:
    """Returns when the client has gone (the request's body is read, so the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _stream(jobs: list[RemoteJob], texts: list[_Text], shape: "_Shape", include_usage: bool, rid: str, write):
    """The answer as server-sent events, the choices' pieces as they come (each chunk names its choice's `index`).
    A write holds every event that had arrived when it was made: one piece each under light load; several
    when the stream fell behind (the event loop busy, or the client slow to read), and the end (the last
    pieces, finishes, usage, `[DONE]`) in one. Cancelled (the client went away), it cancels the jobs."""
    out, left = [], len(jobs)  # events not yet written; choices not yet ended
    try:
        if shape.kind == "chat":  # the role comes first, as OpenAI sends it
            await write([_event(shape.chunk(i, "", None, first=True)) for i in range(len(jobs))])
        async with aclosing(_arrivals(texts)) as arrivals:
            async for i, parts, more in arrivals:
                if parts is None:
                    left -= 1
                    out.append(shape.event(i, "", texts[i].finish_reason))
                else:
                    out += [shape.event(i, piece, None, shape.logprobs(jobs[i], held)) for piece, held in parts]
                if left and not more:  # nothing else is here yet: send what is
                    await write(out)
                    out = []
        if include_usage:
            usage = shape.usage(sum(job.generated for job in jobs))
            out.append(_event({**shape.chunk(0, "", None), "choices": [], "usage": usage}))
    except Exception as exc:
        out.append(_event(_generation_error(rid, exc).body()))
    finally:
        for job in jobs:
            job.cancel()
    out.append("data: [DONE]\n\n")
    await write(out, last=True)


async def _arrivals(texts: list[_Text]):
    """(choice index, its pieces, more), and (index, None, more) at its end, the choices' in arrival order;
    `more`: the next one is here already, so a writer may wait for it."""
    if len(texts) == 1:  # one choice: nothing to merge
        text = texts[0]
        async for parts in text.batches():
            yield 0, parts, text.ready
        yield 0, None, False
        return
    arrived: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, text: _Text) -> None:
        try:
            async for parts in text.batches():
                arrived.put_nowait((i, parts))
            arrived.put_nowait((i, None))
        except Exception as exc:
            arrived.put_nowait((i, exc))

    pumps = [asyncio.create_task(pump(i, text)) for i, text in enumerate(texts)]
    try:
        left = len(texts)
        while left:
            i, parts = await arrived.get()
            if isinstance(parts, Exception):
                raise parts
            left -= parts is None
            yield i, parts, not arrived.empty()
    finally:
        for task in pumps:
            task.cancel()


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Shape:
    """The OpenAI response objects of one request: chat (`chat.completion`) or text (`text_completion`)."""

    _TAILS: dict[str, dict[str, str]] = {"chat": {}, "text": {}}  # per kind: a piece -> `event`'s end of it

    def __init__(self, kind: str, model: Model, prompt_tokens: int, top: int | None):
        self.kind, self.model, self.token_bytes = kind, model.name, model.token_bytes
        self.prompt_tokens, self.top = prompt_tokens, top  # top: alternatives per token; None: no logprobs
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self._offsets: dict[int, int] = {}  # a completion choice's text sent so far, in characters
        self._tails = _Shape._TAILS[kind]
        self.created = int(time.time())
        # `event`'s start of every chunk: json.dumps of `chunk`'s object up to its choice's index
        self._head = (
            "data: "
            + json.dumps(self._wrap(".chunk" if kind == "chat" else "", []), ensure_ascii=False)[: -len("[]}")]
            + '[{"index": '
        )

    def usage(self, completion_tokens: int) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def _wrap(self, obj_suffix: str, choices: list[dict]) -> dict:
        obj = ("chat.completion" if self.kind == "chat" else "text_completion") + obj_suffix
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def choice(self, index: int, text: _Text, parts: list) -> dict:
        content = "".join(piece for piece, _ in parts)
        logprobs = self.logprobs(text.job, [t for _, held in parts for t in held])
        if self.kind == "chat":
            return {
                "index": index,
                "message": {"role": "assistant", "content": content},
                "logprobs": logprobs,
                "finish_reason": text.finish_reason,
            }
        return {"index": index, "text": content, "logprobs": logprobs, "finish_reason": text.finish_reason}

    def whole(self, choices: list[dict], completion_tokens: int) -> dict:
        return {**self._wrap("", choices), "usage": self.usage(completion_tokens)}

    def chunk(
        self, index: int, piece: str, finish_reason: str | None, logprobs: dict | None = None, first: bool = False
    ) -> dict:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if first else ({"content": piece} if piece else {})
            return self._wrap(
                ".chunk", [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
            )
        return self._wrap("", [{"index": index, "text": piece, "logprobs": logprobs, "finish_reason": finish_reason}])

    def event(self, index: int, piece: str, finish_reason: str | None, logprobs: dict | None = None) -> str:
        """`_event(self.chunk(...))`, the same text, built from `_head` and the end of the chunk after its index:
        a stream sends one per token, and encoding the whole object costs several times more. A piece's end
        (no finish, no logprobs) is made once per piece and kept in `_TAILS`, shared by every stream."""
        if logprobs is not None:
            return _event(self.chunk(index, piece, finish_reason, logprobs))
        if finish_reason is not None:
            return f"{self._head}{index}{self._tail(piece, json.dumps(finish_reason))}"
        tail = self._tails.get(piece)
        if tail is None:
            if len(self._tails) >= TAIL_CACHE:  # pieces beyond tokens' (stop-string cuts, split characters)
                self._tails.clear()
            tail = self._tails[piece] = self._tail(piece, "null")
        return f"{self._head}{index}{tail}"

    def _tail(self, piece: str, finish: str) -> str:
        """A chunk's JSON after its choice's index, and the event's end: `piece` as its text, `finish` as JSON."""
        text = json.dumps(piece, ensure_ascii=False)
        if self.kind == "chat":
            delta = f'{{"content": {text}}}' if piece else "{}"
            return f', "delta": {delta}, "logprobs": null, "finish_reason": {finish}}}]}}\n\n'
        return f', "text": {text}, "logprobs": null, "finish_reason": {finish}}}]}}\n\n'

    def logprobs(self, job: RemoteJob, held: list[tuple[int, int]]) -> dict | None:
        """The `logprobs` object of the tokens `held` ((index, id) of the job's tokens); None when not asked."""
        if self.top is None:
            return None
        records = [(t, *job.records[i]) for i, t in held]
        if self.kind == "chat":
            return {
                "content": [
                    {**self._token(t, lp), "top_logprobs": [self._token(a, alp) for a, alp in alts]}
                    for t, lp, alts in records
                ],
                "refusal": None,
            }
        texts = [self._token(t, lp)["token"] for t, lp, _ in records]
        offsets = []  # where each token's text starts in the choice's text (counted on from earlier chunks)
        for text in texts:
            offsets.append(self._offsets.get(id(job), 0))
            self._offsets[id(job)] = offsets[-1] + len(text)
        return {
            "tokens": texts,
            "token_logprobs": [lp for _, lp, _ in records],
            "top_logprobs": [{self._token(a, 0)["token"]: alp for a, alp in alts} for _, _, alts in records],
            "text_offset": offsets,
        }

    def _token(self, t: int, logprob: float) -> dict:
        raw = self.token_bytes[t]
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}
