"""Chat messages -> prompt token ids, and stop strings cut out of streamed text.

A conversation is laid out the way the fine-tuning examples were: every earlier exchange is a whole
example (the Alpaca prompt around the user's text, the assistant's answer, `</s>`), and the last user
turn is a prompt waiting for its answer:

    [prompt(u1) a1 </s>] [prompt(u2) a2 </s>] ... [prompt(u_last)]

Consecutive user messages form one turn (joined by a blank line). System (or developer) messages are
standing context: their text, joined by blank lines, fills the "### Input:" block of the last turn.
When the conversation does not fit the context with room left for the answer, the oldest exchanges
are dropped whole; a last turn that alone does not fit is an error.
"""

from __future__ import annotations

from nanoeuler.data.template import render_prompt

ROLES = ("system", "developer", "user", "assistant")


class PromptError(ValueError):
    """A conversation that cannot become a prompt; the message names the offending message.
    `code` is "context_length_exceeded" when the conversation is well formed but too long."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


def chat_turns(messages: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], str, str]:
    """(earlier exchanges as (user, assistant), last user text, system text) from (role, text) pairs.

    >>> chat_turns([("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello."), ("user", "Name a color.")])
    ([('Hi', 'Hello.')], 'Name a color.', 'Be brief.')
    """
    system, exchanges, pending = [], [], []
    for i, (role, text) in enumerate(messages):
        if role in ("system", "developer"):
            system.append(text)
        elif role == "user":
            pending.append(text)
        elif role == "assistant":
            if not pending:
                raise PromptError(f"messages[{i}]: an assistant message must follow a user message")
            exchanges.append(("\n\n".join(pending), text))
            pending = []
        else:
            raise PromptError(f"messages[{i}].role: {role!r} is not one of {', '.join(ROLES)}")
    if not pending:
        raise PromptError("messages: the conversation must end with a user message")
    return exchanges, "\n\n".join(pending), "\n\n".join(system)


def chat_prompt(tok, messages: list[tuple[str, str]], ctx_len: int, room: int) -> tuple[list[int], int]:
    """(prompt token ids, number of earlier exchanges dropped) for a conversation.

    The prompt keeps the newest exchanges that fit in `ctx_len - room` tokens next to the last turn;
    the last turn itself must leave at least one position for the answer.
    """
    exchanges, last, system = chat_turns(messages)
    ids = tok.encode(render_prompt(last, system))
    if len(ids) >= ctx_len:
        raise PromptError(
            f"messages: the last turn is {len(ids)} tokens with the chat template; the model's "
            f"context holds {ctx_len}, the answer included",
            code="context_length_exceeded",
        )
    kept: list[list[int]] = []
    used = len(ids)
    for user, answer in reversed(exchanges):
        example = tok.encode(render_prompt(user)) + tok.encode(answer) + [tok.end_id]
        if used + len(example) > ctx_len - room:
            break
        kept.append(example)
        used += len(example)
    history = [t for example in reversed(kept) for t in example]
    return history + ids, len(exchanges) - len(kept)


class StopText:
    """Cuts generated text at the first stop string, holding back a tail that may be the start of one.

    >>> s = StopText(["\\n\\n"])
    >>> s.feed("Paris.\\n"), s.feed("\\nMore"), s.stopped
    ('Paris.', '', True)
    """

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """The text that is safe to send now."""
        if not self.stops:  # nothing to hold back (a stream calls this per token)
            return piece
        text = self.held + piece
        hit, pending = self._first_hit(text), self._pending_start(text)
        if hit is not None and (pending is None or hit <= pending):
            self.stopped, self.held = True, ""
            return text[:hit]
        # a stop string that starts before the hit may still complete there: wait for more text
        cut = len(text) if pending is None else pending
        self.held = text[cut:]
        return text[:cut]

    def flush(self) -> str:
        """What was held back, once generation has ended (cut at a stop string it holds)."""
        text, self.held = self.held, ""
        hit = self._first_hit(text)
        if hit is not None:
            self.stopped = True
            return text[:hit]
        return text

    def _first_hit(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _pending_start(self, text: str) -> int | None:
        """The first position whose tail of `text` is a proper prefix of a stop string."""
        longest = max((len(s) for s in self.stops), default=1)
        for q in range(max(0, len(text) - longest + 1), len(text)):
            if any(len(s) > len(text) - q and s.startswith(text[q:]) for s in self.stops):
                return q
        return None
