"""The model behind the server: the one adapter between the HTTP layer and the generation engine.

The server asks three things of an engine: the tokenizer, a token stream per request (`open`), and a
batch step that advances many streams by one token each (`step`). Only this module knows which
engine answers; today it is `infer.generate.Generator`, which decodes one sequence per forward pass,
so a step advances the streams one after another. An engine with batched decoding answers `step` with
one forward pass over all of them, and nothing outside this file changes.

    >>> backend = Backend.load("results/chat.bin", device="cpu")
    >>> a = backend.open(backend.tok.encode("Once"), max_new_tokens=2, sampling=Sampling(temperature=0))
    >>> b = backend.open(backend.tok.encode("It was"), max_new_tokens=1, sampling=Sampling(temperature=0))
    >>> ids = backend.step([a, b])   # one token id for each stream
    >>> a.done, b.done               # b has reached its one token
    (False, True)
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from nanoeuler.infer.generate import Sampling, load

__all__ = ["Backend", "Sampling", "TokenStream"]


class TokenStream:
    """One request's generation: token ids one `step` at a time, `done` after a stop id or its last token."""

    def __init__(self, tokens: Iterator[int], max_new_tokens: int, stop_ids: frozenset[int]):
        self._tokens = tokens
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_ids
        self.generated = 0
        self.done = max_new_tokens <= 0

    def advance(self) -> int:
        token = next(self._tokens)
        self.generated += 1
        self.done = token in self.stop_ids or self.generated >= self.max_new_tokens
        return token

    def close(self) -> None:
        """Let go of the engine's state (the KV cache) now rather than when the stream is collected."""
        self._tokens.close()
        self.done = True


class Backend:
    """A chat model file, loaded once: its tokenizer, context length and token streams."""

    def __init__(self, generator, tok, name: str):
        self.generator, self.tok, self.name = generator, tok, name
        self.stop_ids = frozenset({tok.end_id, tok.eot_id})

    @classmethod
    def load(cls, path, device: str = "auto", name: str | None = None) -> "Backend":
        generator, tok, _ = load(path, device)
        return cls(generator, tok, name or Path(path).stem)

    @property
    def ctx_len(self) -> int:
        return self.generator.cfg.ctx_len

    def open(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling,
             stop_at_end: bool = True) -> TokenStream:
        """A stream for one prompt; nothing is computed until its first `step` (the prefill).
        `stop_at_end=False` goes on past `</s>` and `<|endoftext|>` (fixed-length answers for load tests)."""
        stop_ids = self.stop_ids if stop_at_end else frozenset()
        tokens = self.generator.stream(prompt_ids, max_new_tokens, sampling, stop_ids)
        return TokenStream(tokens, max_new_tokens, stop_ids)

    def step(self, streams: list[TokenStream]) -> list[int]:
        """The batch entry: the next token of every stream (none of them may be `done`)."""
        return [s.advance() for s in streams]
