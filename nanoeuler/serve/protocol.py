"""The OpenAI request and response shapes: request bodies checked into typed requests, errors as bodies.

Every check names the field it rejects, as the OpenAI API does:

    >>> parse_chat(parse_json(b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": "hot"}'))
    Traceback (most recent call last):
    ...
    nanoeuler.serve.protocol.ApiError: temperature: expected a number, got a string

Fields of the OpenAI API that change nothing here (`user`, `logit_bias`, penalties, ...) are accepted
and ignored. `n` choices (at most MAX_N) are answered together; `logprobs` (with chat's `top_logprobs`, at
most MAX_TOP_LOGPROBS alternatives; completions' `logprobs`, at most 5) asks for log-probabilities;
`response_format` is "text", "json_object" or "json_schema" (read into the JSON schema the answer must
follow: any object for "json_object"). One extension: `ignore_eos` (as in vLLM) generates past the end
marker. Sampling defaults are OpenAI's: temperature 1, top_p 1, a fresh seed per request.
Sampling values pass the sampler's own check (`infer.sampling.checked_sampling`, shared with the commands):
a seed is in [0, 2**63), and a temperature under 1e-6 is greedy, as 0 is.

A body is parsed as strict JSON: NaN and Infinity, numbers that overflow a float, integers of more than
MAX_DIGITS digits and nesting deeper than Python's parser follows are each a 400, never a 500.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

from nanoeuler.infer.sampling import SamplingError, checked_sampling
from nanoeuler.serve.prompts import ROLES

MAX_STOPS = 4
MAX_N = 16  # choices of one request
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's chat API allows
MAX_DIGITS = 100  # an integer longer than this is no token id, seed or count: refused before int() works on it


class ApiError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Options:
    """What both endpoints share: the model, sampling, limits and streaming."""

    model: str | None
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool  # an extension (vLLM's name): go on past the end marker, for fixed-length load tests
    n: int = 1
    logprobs: int | None = None  # alternatives per token; None: no log-probabilities
    schema: dict | None = None  # the JSON schema of `response_format`; None: free text


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[tuple[str, str], ...]  # (role, text)
    options: Options


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | tuple[int, ...]  # text, or token ids
    options: Options


def parse_json(raw: bytes) -> dict:
    """A request body -> its JSON object; invalid UTF-8, malformed or non-strict JSON are errors (400)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text, parse_constant=_no_constant, parse_int=_bounded_int, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise ApiError(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError("the request body is not valid JSON: it is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


def _no_constant(name: str):
    raise ApiError(f"the request body is not valid JSON: {name} is not a JSON number")


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_DIGITS:
        raise ApiError(
            f"the request body holds an integer of {len(digits.lstrip('-'))} digits; at most {MAX_DIGITS} are accepted"
        )
    return int(digits)


def _finite_float(digits: str) -> float:
    value = float(digits)
    if not math.isfinite(value):
        raise ApiError(f"the request body holds the number {digits[:40]}, which overflows a float")
    return value


def _text(value, name: str) -> str:
    if not isinstance(value, str):
        raise ApiError(f"{name}: expected a string, got {_kind(value)}", name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(f"{name}: not valid UTF-8 (it holds a lone surrogate)", name) from None
    return value


def _kind(value) -> str:
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def _number(body, name, default, lo=None, hi=None, integer=False):
    """The field's number, checked for type and, given `lo`/`hi`, for the API's range [lo, hi]."""
    value = body.get(name)
    if value is None:
        return default
    ok = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok):
        raise ApiError(f"{name}: expected {'an integer' if integer else 'a number'}, got {_kind(value)}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ApiError(
            f"{name}: {value} is out of range (must be >= {lo}" + (f" and <= {hi})" if hi is not None else ")"), name
        )
    return value


def _flag(body, name) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ApiError(f"{name}: expected a boolean, got {_kind(value)}", name)
    return value


def _stops(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (_text(value, "stop"),) if value else ()
    if not isinstance(value, list) or len(value) > MAX_STOPS:
        raise ApiError(f"stop: expected a string or an array of at most {MAX_STOPS} strings", "stop")
    return tuple(_text(s, f"stop[{i}]") for i, s in enumerate(value) if s != "")


def parse_options(body: dict, max_tokens_key: str = "max_tokens") -> Options:
    model = body.get("model")
    if model is not None:
        _text(model, "model")
    n = _number(body, "n", 1, 1, MAX_N, integer=True)
    stream, ignore_eos = _flag(body, "stream"), _flag(body, "ignore_eos")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict) or not isinstance(stream_options.get("include_usage", False), bool):
        raise ApiError('stream_options: expected an object like {"include_usage": true}', "stream_options")
    seed = _number(body, "seed", None, integer=True)
    try:  # the sampler's own check; temperature has the API's upper bound too
        sampling = checked_sampling(
            _number(body, "temperature", 1.0, hi=2), 0, _number(body, "top_p", 1.0), 0 if seed is None else seed
        )
    except SamplingError as exc:
        raise ApiError(f"{exc.field}: {exc}", exc.field) from None
    return Options(
        model=model,
        max_tokens=_number(body, max_tokens_key, None, 1, integer=True),
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=seed,
        stop=_stops(body.get("stop")),
        stream=stream,
        include_usage=bool(stream_options.get("include_usage", False)),
        ignore_eos=ignore_eos,
        n=n,
        schema=_response_format(body.get("response_format")),
    )


def _response_format(value) -> dict | None:
    """The JSON schema that `response_format` asks for, or None for free text."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError("response_format.json_schema.schema: expected a JSON schema object", "response_format")
        return schema
    raise ApiError(
        'response_format: expected {"type": "text"}, {"type": "json_object"} or '
        '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
        "response_format",
    )


def _chat_logprobs(body: dict) -> int | None:
    """Chat's `logprobs` (a boolean) and `top_logprobs` (alternatives per token)."""
    top = _number(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
    if not _flag(body, "logprobs"):
        if top is not None:
            raise ApiError('top_logprobs: needs "logprobs": true', "top_logprobs")
        return None
    return top or 0


def _content(value, name: str) -> str:
    """A message's content: a string, or an array of {"type": "text", "text": ...} parts (joined)."""
    if value is None:
        return ""
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ApiError(
                    f'{name}[{i}]: only text parts ({{"type": "text", "text": ...}}) are supported', f"{name}[{i}]"
                )
            parts.append(_text(part.get("text"), f"{name}[{i}].text"))
        return "".join(parts)
    return _text(value, name)


def parse_chat(body: dict) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages: expected a non-empty array of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(f"messages[{i}]: expected an object, got {_kind(m)}", f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(
                f"messages[{i}].role: expected one of {', '.join(ROLES)}, got {role!r}", f"messages[{i}].role"
            )
        out.append((role, _content(m.get("content"), f"messages[{i}].content")))
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    options = parse_options(body, key)
    return ChatRequest(tuple(out), replace(options, logprobs=_chat_logprobs(body)))


def parse_completion(body: dict) -> CompletionRequest:
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, list):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ApiError("prompt: expected a string, an array of token ids, or an array of one of those", "prompt")
        prompt = tuple(prompt)
    else:
        prompt = _text(prompt, "prompt")
    options = parse_options(body)  # completions' `logprobs` is the count of alternatives itself
    return CompletionRequest(prompt, replace(options, logprobs=_number(body, "logprobs", None, 0, 5, integer=True)))
