"""Structured output: `response_format` as a grammar that masks, at each step, the tokens it does not allow.

`llguidance` compiles a JSON schema (or "any JSON object") into a matcher over the model's own vocabulary,
read from the tokenizer exported in Hugging Face's format (`tokenizer.hf`). The tokenizer is built once per
model (about a second for a large vocabulary), and each schema is compiled once into a matcher kept in a
bounded cache (`Grammars.cache_size` schemas, least recently used out); each request gets its own `Guide`
on a copy of that matcher, so clients that send the same schema again pay for a copy, not a compile:

    >>> grammars = Grammars(tok)                                                    # doctest: +SKIP
    >>> guide = grammars.guide({"type": "integer"})                                # doctest: +SKIP
    >>> allowed = guide.allowed()          # (V,) bool: digits and "-" here          # doctest: +SKIP
    >>> guide.consume(tok.encode("4")[0]); guide.stopped                           # doctest: +SKIP

The end marker `</s>` is allowed once the text is complete; `stopped` says that nothing may follow.
Whitespace between JSON tokens is not free (`whitespace_flexible` off): a small model would otherwise
fill its answer with blank lines.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np

from nanoeuler.serve.protocol import ApiError


class Grammars:
    """The llguidance tokenizer of one model's vocabulary, the compiled schemas, and the `Guide` of each request.
    `compiles` counts the schemas compiled (a cache miss each)."""

    def __init__(self, tok, cache_size: int = 64):
        from llguidance import LLTokenizer

        from nanoeuler.tokenizer.hf import to_hf_json

        self.vocab = tok.vocab_size
        self.tokenizer = LLTokenizer(to_hf_json(tok), n_vocab=tok.vocab_size, eos_token=tok.end_id)
        self.cache_size, self.compiles = cache_size, 0
        self._compiled: OrderedDict[str, object] = OrderedDict()  # schema key -> matcher before any token
        self._lock = threading.Lock()  # requests build their guides on worker threads

    def guide(self, schema: dict) -> "Guide":
        """A fresh matcher for a JSON schema (`protocol`'s `response_format`); one llguidance refuses is a 400."""
        key = schema_key(schema)
        with self._lock:
            matcher = self._compiled.get(key)
            if matcher is not None:
                self._compiled.move_to_end(key)
        if matcher is None:
            matcher = self._compile(schema)
            with self._lock:
                self._compiled[key] = matcher
                while len(self._compiled) > self.cache_size:
                    self._compiled.popitem(last=False)
        return Guide(matcher.deep_copy(), self.vocab)  # the cached one stays at the start

    def _compile(self, schema: dict):
        from llguidance import LLMatcher

        self.compiles += 1
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
        problem = LLMatcher.validate_grammar(grammar, self.tokenizer)  # '' when it is usable
        if problem:
            raise ApiError(f"response_format: the schema cannot be used: {problem}", "response_format")
        matcher = LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():  # some problems show only once the grammar meets the vocabulary
            raise ApiError(f"response_format: the schema cannot be used: {matcher.get_error()}", "response_format")
        return matcher


def schema_key(schema) -> str:
    """The cache key of a schema: its compact JSON. Keys keep their order, since the order of `properties` is
    the order the answer writes its fields in (two schemas that differ only there are two grammars).

        >>> schema_key({"type": "object", "properties": {"b": {}, "a": {}}})
        '{"type":"object","properties":{"b":{},"a":{}}}'
    """
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


class Guide:
    """One request's grammar state: the tokens allowed next, advanced by each token chosen."""

    def __init__(self, matcher, vocab: int):
        from llguidance.numpy import allocate_token_bitmask

        self.matcher, self.vocab = matcher, vocab
        self._bits = allocate_token_bitmask(1, vocab)

    def allowed(self) -> np.ndarray:
        """(V,) bool: the tokens the grammar allows after what was consumed."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self._bits, 0)
        return np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")[: self.vocab].astype(bool)

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def stopped(self) -> bool:
        return self.matcher.is_stopped()
