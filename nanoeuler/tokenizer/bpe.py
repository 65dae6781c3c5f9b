"""Byte-level BPE: merge learning, encoding and decoding, and our tokenizer.json format.

Text is first cut into chunks by the GPT-2 pattern (a single leading space stays with the word that
follows it, digits/letters/punctuation/whitespace runs are kept apart), each chunk becomes its UTF-8
bytes, and learned merges join adjacent tokens into longer ones. Merges never cross chunk borders.

Ids: 0..255 are the raw bytes, merge number r (its rank) creates id 256 + r, and the special tokens
come after the last merge (`<|endoftext|>` first, then `</s>`).

A worked example. The classic string "aaabdaaabac" is one chunk (all letters). Its adjacent pairs are
aa ×4 (overlaps count), ab ×2, and bd, da, ba, ac once each:

    >>> tok = train_bpe("aaabdaaabac", vocab_size=256 + 3 + 2)
    >>> tok.merges        # 256 = a+a, 257 = a+b, 258 = 256+257, i.e. "aa"+"ab"
    [(97, 97), (97, 98), (256, 257)]
    >>> tok.encode("aaabdaaabac")          # "aaab" "d" "aaab" "a" "c"
    [258, 100, 258, 97, 99]
    >>> tok.decode([258, 100])
    'aaabd'

After the first merge the string reads [aa] a b d [aa] a b a c: both (aa, a) and (a, b) occur twice.
That tie is broken deterministically: the pair with the highest count wins; among equal counts the
pair of smaller ids, compared as (left id, right id), wins, so (97, 98) beats (256, 97). Since ids grow
with the order in which tokens were made, this prefers pairs of older tokens.

Special tokens are only produced when the caller allows them; otherwise their text is plain text:

    >>> tok.encode("a<|endoftext|>", allowed_special="all")[-1] == tok.eot_id
    True
    >>> tok.eot_id in tok.encode("a<|endoftext|>")
    False
"""

from __future__ import annotations

import hashlib
import heapq
import json
import re
import sys
from collections import Counter, defaultdict
from itertools import chain
from pathlib import Path
from typing import Iterable

import regex

from nanoeuler.errors import UserError

# GPT-2's split pattern: contractions, an optional space + letters, an optional space + digits, an optional
# space + other symbols, whitespace not followed by non-space (so one space is left to prefix the next word),
# and any remaining whitespace.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

EOT = "<|endoftext|>"  # separates documents in the pretraining stream
END = "</s>"  # ends a chat response (SFT)
SPECIAL_TOKENS = (EOT, END)

FORMAT_NAME = "nanoeuler-bpe"
FORMAT_VERSION = 1
MAX_VOCAB = 65535  # token ids are stored as uint16 in the shards

# chunk -> ids entries kept per tokenizer before the cache is emptied (~200 MB when full). A 1 GB corpus has
# more distinct chunks than 2^18: that size emptied the cache again and again and cost a third of the speed.
_CACHE_SIZE = 1 << 20

# Fast path for the GPT-2 pattern. On ASCII text it means the same as this pattern for the stdlib `re`
# (letters = A-Za-z, numbers = 0-9, \s = the six ASCII spaces), which runs about twice as fast as
# `regex` with Unicode properties. Text with some non-ASCII characters is cut at "safe" positions: a space
# whose left neighbour is not whitespace always starts a chunk (no chunk holds a space except as its
# first character, and whitespace chunks are never next to it on the left), and the chunks before it do
# not depend on what follows. Each island around non-ASCII characters, from safe position to safe
# position, goes through `regex`; the ASCII stretches in between go through `re`.
_GPT2_ASCII = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""", re.ASCII)
_NON_ASCII = re.compile(r"[^\x00-\x7f]+")
_WHITESPACE = frozenset(regex.findall(r"\s", "".join(map(chr, range(0x3001)))))  # every \s of `regex`
_GPT2_REGEX = regex.compile(GPT2_PATTERN)


def split_gpt2(text: str) -> list[str]:
    """The chunks of the GPT-2 pattern: the same list as `regex.findall(GPT2_PATTERN, text)`, faster."""
    if text.isascii():
        return _GPT2_ASCII.findall(text)
    slow, fast = _GPT2_REGEX.findall, _GPT2_ASCII.findall
    out: list[str] = []
    pos, n = 0, len(text)  # text[pos:] is still to split; pos is always a safe position
    for m in _NON_ASCII.finditer(text):
        start = m.start()
        if start < pos:
            continue  # inside the island just done
        # island: from the last safe position at or before `start` to the first one after the run
        b = text.rfind(" ", pos, start)
        while b > pos and text[b - 1] in _WHITESPACE:
            b = text.rfind(" ", pos, b)
        e = text.find(" ", m.end())
        while e != -1 and text[e - 1] in _WHITESPACE:
            e = text.find(" ", e + 1)
        if b > pos:
            out += fast(text, pos, b)
        else:
            b = pos
        if e == -1:
            e = n
        out += slow(text, b, e)
        pos = e
    if pos < n:
        out += fast(text, pos, n)
    return out


class _ChunkCache(dict):
    """chunk -> tuple of ids; a miss runs the merge loop. `__getitem__` of a hit stays in C."""

    __slots__ = ("_bpe", "_limit")

    def __init__(self, bpe, limit: int):
        super().__init__()
        self._bpe = bpe
        self._limit = limit

    def __missing__(self, chunk: str) -> tuple[int, ...]:
        ids = self._bpe(chunk)
        if len(self) >= self._limit:
            self.clear()  # crude but cheap: frequent chunks come straight back
        self[chunk] = ids
        return ids


class Tokenizer:
    """A byte-level BPE tokenizer: a split pattern, merges in rank order, and special tokens.

    `merges[r] = (a, b)` means: the adjacent tokens a, b become token 256 + r. Encoding applies, inside
    each chunk, the lowest-ranked merge present until none applies (the same rule as GPT-2, tiktoken and
    HF tokenizers), with a cache of chunk -> ids for frequent chunks.
    """

    def __init__(
        self,
        merges: Iterable[tuple[int, int]],
        special_tokens: Iterable[str] = SPECIAL_TOKENS,
        pattern: str = GPT2_PATTERN,
        cache_size: int = _CACHE_SIZE,
    ):
        self.merges: list[tuple[int, int]] = [(int(a), int(b)) for a, b in merges]
        self.pattern = pattern
        self._findall = regex.compile(pattern).findall
        self._split = split_gpt2 if pattern == GPT2_PATTERN else self._findall
        # token id -> its bytes; ranks: pair -> merged id (merged id order is rank order)
        self._bytes: list[bytes] = [bytes([i]) for i in range(256)]
        self._ranks: dict[tuple[int, int], int] = {}
        for a, b in self.merges:
            n = len(self._bytes)
            if not (0 <= a < n and 0 <= b < n):
                raise ValueError(f"merge {len(self._ranks)} ({a}, {b}) refers to a token not made yet")
            if (a, b) in self._ranks:
                raise ValueError(f"merge ({a}, {b}) appears twice")
            self._ranks[(a, b)] = n
            self._bytes.append(self._bytes[a] + self._bytes[b])
        first = len(self._bytes)
        names = list(special_tokens)
        if len(set(names)) != len(names) or not all(isinstance(s, str) and s for s in names):
            raise ValueError(f"special tokens must be distinct non-empty strings, got {names}")
        self.special_tokens: dict[str, int] = {s: first + i for i, s in enumerate(names)}
        self._bytes.extend(s.encode("utf-8") for s in names)
        self._special_re = {}  # frozenset of allowed names -> compiled splitter
        self._cache = _ChunkCache(self._bpe, cache_size)
        self._json: str | None = None

    # ---- basic facts ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._bytes)

    @property
    def eot_id(self) -> int:
        return self.special_tokens[EOT]

    @property
    def end_id(self) -> int:
        return self.special_tokens[END]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token (a special token's text for special ids)."""
        return self._bytes[self._check_id(token_id)]

    def _check_id(self, token_id) -> int:
        i = int(token_id)
        if not 0 <= i < len(self._bytes):
            raise ValueError(f"token id {i} is outside the vocabulary (0..{len(self._bytes) - 1})")
        return i

    # ---- encoding ------------------------------------------------------------------------------
    def _bpe(self, chunk: str) -> tuple[int, ...]:
        """Merge the bytes of one chunk: repeatedly apply the lowest-ranked merge present, leftmost first.

        `merged[i]` is the id that ids[i], ids[i+1] would merge into (ids grow with rank), or `never`.
        Merging one site changes only its two neighbours' entries, so each step costs one `min` and one
        `index` in C plus two dict lookups. Taking the leftmost site of the best pair each time is the same
        as merging all its sites left to right: a pair that contains the new token has a higher rank.
        """
        ids = list(chunk.encode("utf-8"))
        if len(ids) < 2:
            return tuple(ids)
        get = self._ranks.get
        never = 1 << 62
        merged = [get(pair, never) for pair in zip(ids, ids[1:])]
        while True:
            best = min(merged)
            if best == never:
                break
            i = merged.index(best)
            ids[i] = best
            del ids[i + 1]
            del merged[i]
            if i > 0:
                merged[i - 1] = get((ids[i - 1], best), never)
            if i < len(merged):
                merged[i] = get((best, ids[i + 1]), never)
            if not merged:
                break
        return tuple(ids)

    def encode_ordinary(self, text: str) -> list[int]:
        """Encode `text` treating every character as ordinary text (no special tokens)."""
        return list(chain.from_iterable(map(self._cache.__getitem__, self._split(text))))

    def _allowed(self, allowed_special) -> frozenset:
        if allowed_special is None or allowed_special == "none":
            return frozenset()
        if allowed_special == "all":
            return frozenset(self.special_tokens)
        if isinstance(allowed_special, str):
            raise ValueError(
                f"allowed_special must be 'all', 'none' or a set of special tokens, got {allowed_special!r}"
            )
        allowed = frozenset(allowed_special)
        unknown = allowed - set(self.special_tokens)
        if unknown:
            raise ValueError(f"unknown special tokens {sorted(unknown)}; known: {sorted(self.special_tokens)}")
        return allowed

    def encode(self, text: str, allowed_special: str | set = "none") -> list[int]:
        """Text -> ids. Special tokens in `text` become special ids only if allowed ("all" or a set of names)."""
        allowed = self._allowed(allowed_special)
        if not allowed:
            return self.encode_ordinary(text)
        splitter = self._special_re.get(allowed)
        if splitter is None:
            # longest first so that a special token that contains another one wins
            alts = "|".join(regex.escape(s) for s in sorted(allowed, key=lambda s: (-len(s), s)))
            splitter = self._special_re[allowed] = regex.compile(f"({alts})")
        out: list[int] = []
        for i, part in enumerate(splitter.split(text)):
            if i % 2:
                out.append(self.special_tokens[part])
            elif part:
                out.extend(self.encode_ordinary(part))
        return out

    def encode_batch(self, texts: Iterable[str], allowed_special: str | set = "none") -> list[list[int]]:
        return [self.encode(t, allowed_special) for t in texts]

    # ---- decoding ------------------------------------------------------------------------------
    def decode_bytes(self, ids) -> bytes:
        """ids -> raw bytes (for streaming output, where a character may span two calls)."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= len(self._bytes)):
            bad = next(i for i in ids if not 0 <= i < len(self._bytes))
            self._check_id(bad)
        return b"".join(map(self._bytes.__getitem__, ids))

    def decode(self, ids) -> str:
        """ids -> text; bytes that are not valid UTF-8 (a cut-off character) become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # ---- files ---------------------------------------------------------------------------------
    def to_json(self) -> str:
        """Our tokenizer.json: one merge per line so that diffs between two tokenizers are readable.

        {"format": "nanoeuler-bpe", "version": 1, "pattern": ..., "vocab_size": ...,
         "special_tokens": {"<|endoftext|>": id, "</s>": id},
         "merges": [[a, b], ...]}      # merges[r] = (a, b) makes id 256 + r; ids 0..255 are bytes
        """
        if self._json is None:
            head = {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "pattern": self.pattern,
                "vocab_size": self.vocab_size,
                "special_tokens": self.special_tokens,
            }
            lines = ["{"]
            for key, value in head.items():
                lines.append(f"  {json.dumps(key)}: {json.dumps(value, ensure_ascii=True)},")
            body = ",\n".join(f"    [{a}, {b}]" for a, b in self.merges)
            lines.append('  "merges": [' + ("\n" + body + "\n  " if body else "") + "]")
            lines.append("}")
            self._json = "\n".join(lines) + "\n"
        return self._json

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    @classmethod
    def from_json(cls, s: str) -> "Tokenizer":
        """Parse our tokenizer.json; anything malformed is a UserError saying what is wrong."""
        from nanoeuler.files import JsonError, parse_json

        if not isinstance(s, (str, bytes)):
            raise UserError(f"not JSON text but a {type(s).__name__}")
        try:
            d = parse_json(s, "tokenizer")
        except JsonError as exc:
            raise UserError(exc.why) from None
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise UserError(f'not a nanoeuler tokenizer file (expected "format": "{FORMAT_NAME}")')
        if d.get("version") != FORMAT_VERSION:
            raise UserError(
                f"tokenizer format version {d.get('version')!r} is not supported "
                f"(this nanoeuler reads version {FORMAT_VERSION}; re-run the tokenizer stage)"
            )
        pattern, merges, specials = d.get("pattern"), d.get("merges"), d.get("special_tokens")
        if not isinstance(pattern, str):
            raise UserError("key 'pattern' must be a string")
        try:
            regex.compile(pattern)
        except regex.error as exc:
            raise UserError(f"key 'pattern' is not a valid regular expression ({exc})") from None
        if not isinstance(merges, list) or not all(
            isinstance(m, list) and len(m) == 2 and all(type(x) is int for x in m) for m in merges
        ):
            raise UserError("key 'merges' must be a list of [id, id] pairs")
        if not isinstance(specials, dict) or not all(type(v) is int for v in specials.values()):
            raise UserError("key 'special_tokens' must map token text to an id")
        names = sorted(specials, key=specials.get)
        want = list(range(256 + len(merges), 256 + len(merges) + len(names)))
        if [specials[n] for n in names] != want:
            raise UserError(f"special token ids {sorted(specials.values())} must follow the merges ({want})")
        for required in SPECIAL_TOKENS:
            if required not in specials:
                raise UserError(f"special token {required!r} is missing")
        try:
            tok = cls([tuple(m) for m in merges], names, pattern)
        except ValueError as exc:
            raise UserError(f"key 'merges': {exc}") from None
        if d.get("vocab_size", tok.vocab_size) != tok.vocab_size:
            raise UserError(
                f"vocab_size {d.get('vocab_size')} does not match the merges and special tokens ({tok.vocab_size})"
            )
        return tok

    def save(self, path: str | Path) -> None:
        """Write atomically (temp file in the same directory, then rename)."""
        write_text_atomic(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        from nanoeuler.files import SMALL_JSON, read_text

        path = Path(path)
        text = read_text(path, "tokenizer file", SMALL_JSON)
        try:
            return cls.from_json(text)
        except UserError as exc:
            raise UserError(f"tokenizer file {path}: {exc}") from None

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, specials={list(self.special_tokens)})"
        )


def default_file_mode() -> int:
    """The mode `open(path, "w")` gives a new file: 0o666 less the umask (0o644 under umask 022)."""
    import os

    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_text_atomic(path: Path, text: str) -> None:
    import os
    import tempfile

    from nanoeuler.files import check_outputs, naming

    check_outputs(out=path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, default_file_mode())  # mkstemp makes 0600; outputs get what open() would give
        with naming(path), os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:  # a full disk names it
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


# ---- merge learning ------------------------------------------------------------------------------


def check_vocab_size(vocab_size: int, n_special: int = len(SPECIAL_TOKENS)) -> None:
    low = 256 + n_special
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise UserError(f"vocab_size must be an integer, got {vocab_size!r}")
    if vocab_size < low:
        raise UserError(
            f"vocab_size {vocab_size} is too small: it needs at least 256 byte tokens + "
            f"{n_special} special tokens = {low}"
        )
    if vocab_size > MAX_VOCAB:
        raise UserError(
            f"vocab_size {vocab_size} is too large: token ids are stored as uint16, so at most {MAX_VOCAB} tokens"
        )


def count_chunks(texts: str | Iterable[str], pattern: str = GPT2_PATTERN) -> Counter:
    """Pretokenize and count: unique chunk -> number of occurrences."""
    if isinstance(texts, str):
        texts = [texts]
    findall = split_gpt2 if pattern == GPT2_PATTERN else regex.compile(pattern).findall
    counts: Counter = Counter()
    for text in texts:
        counts.update(findall(text))
    return counts


def train_bpe(
    texts: str | Iterable[str] | Counter,
    vocab_size: int,
    *,
    pattern: str = GPT2_PATTERN,
    special_tokens: Iterable[str] = SPECIAL_TOKENS,
    progress: bool = False,
) -> Tokenizer:
    """Learn `vocab_size - 256 - len(special_tokens)` merges from text (a string, strings, or a chunk Counter).

    The algorithm works on unique chunks ("words") with their counts:
    1. count every adjacent pair once, weighted by word count, and remember which words hold each pair;
    2. pop the best pair from a max-heap (count, then smaller (left id, right id)); entries whose count
       is out of date are skipped when popped (lazy invalidation) instead of being removed;
    3. rewrite only the words that hold that pair, and update the counts of the pairs next to each merge
       site; every pair whose count changed gets a fresh heap entry.
    A pair whose merged bytes equal an existing token is never merged, so every token's bytes are unique
    (as tiktoken and HF tokenizers require). If the text runs out of pairs first, fewer merges are learned
    and a warning is printed.
    """
    specials = list(special_tokens)
    check_vocab_size(vocab_size, len(specials))
    n_merges = vocab_size - 256 - len(specials)
    counts = texts if isinstance(texts, Counter) else count_chunks(texts, pattern)
    if not counts or not any(counts.values()):
        raise UserError("the training text is empty: no text to learn merges from")

    words: list[list[int]] = []
    freqs: list[int] = []
    for chunk, c in counts.items():
        b = chunk.encode("utf-8")
        if len(b) > 1 and c > 0:
            words.append(list(b))
            freqs.append(c)

    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    where: dict[tuple[int, int], set[int]] = defaultdict(set)
    for wi, w in enumerate(words):
        f = freqs[wi]
        for p in zip(w, w[1:]):
            pair_counts[p] += f
            where[p].add(wi)
    heap = [(-c, p) for p, c in pair_counts.items()]
    heapq.heapify(heap)

    token_bytes = [bytes([i]) for i in range(256)]
    known = set(token_bytes)
    merges: list[tuple[int, int]] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n_merges, desc="merges", unit="merge", file=sys.stderr, mininterval=1.0)
    while len(merges) < n_merges and heap:
        negc, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -negc or negc == 0:
            continue  # stale entry: the pair's count changed after this entry was pushed
        a, b = pair
        merged = token_bytes[a] + token_bytes[b]
        if merged in known:
            pair_counts[pair] = -1  # never matches a heap entry again: banned
            continue
        new = len(token_bytes)
        token_bytes.append(merged)
        known.add(merged)
        merges.append(pair)

        delta: dict[tuple[int, int], int] = defaultdict(int)
        for wi in where.pop(pair, ()):
            w = words[wi]
            n = len(w)
            i = 0
            out = []
            while i < n:
                if w[i] == a and i + 1 < n and w[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            if len(out) == n:
                continue  # the index is lazy: this word lost the pair through an earlier merge
            f = freqs[wi]
            for p in zip(w, w[1:]):
                delta[p] -= f
            for p in zip(out, out[1:]):
                delta[p] += f
                if new in p:
                    where[p].add(wi)
            words[wi] = out
        for p, d in delta.items():
            if d:
                c = pair_counts[p] + d if pair_counts.get(p, 0) >= 0 else -1
                if c > 0:
                    pair_counts[p] = c
                    heapq.heappush(heap, (-c, p))
                elif c == 0:
                    del pair_counts[p]
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if len(merges) < n_merges:
        print(
            f"warning: the training text only supports {len(merges)} merges; vocab_size is "
            f"{256 + len(merges) + len(specials)} instead of {vocab_size}",
            file=sys.stderr,
        )
    return Tokenizer(merges, specials, pattern)
