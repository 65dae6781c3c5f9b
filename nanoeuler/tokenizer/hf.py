"""Export our tokenizer as a Hugging Face `tokenizers` tokenizer.json (byte-level BPE).

HF's byte-level BPE works on strings, not bytes: every byte is shown as one printable character
(GPT-2's table: printable Latin-1 bytes stand for themselves, the other 68 bytes are moved to U+0100 and
up, so a space is "Ġ" and a newline "Ċ"). A token is the concatenation of its bytes' characters, and a
merge is written "left right" (no byte maps to a space, so the split is unambiguous).

The file needs only the `tokenizers` library to load (`Tokenizer.from_file`), and gives the same ids
as ours: the ByteLevel pre-tokenizer applies the GPT-2 pattern (use_regex, no prefix space), and the BPE
model applies merges by rank just as we do. Special tokens are "added tokens"; note that HF always
matches them in text, where our `encode` does so only when asked (`allowed_special`).
"""

from __future__ import annotations

import json
from functools import lru_cache

from nanoeuler.tokenizer.bpe import GPT2_PATTERN, Tokenizer


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, shifted = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def token_string(b: bytes) -> str:
    table = bytes_to_unicode()
    return "".join(table[x] for x in b)


def to_hf_json(tok: Tokenizer) -> str:
    """The HF tokenizer.json text for `tok` (deterministic: same tokenizer, same bytes)."""
    n_regular = 256 + len(tok.merges)
    strings = [token_string(tok.token_bytes(i)) for i in range(n_regular)]
    vocab = {s: i for i, s in enumerate(strings)}
    if len(vocab) != n_regular:  # cannot happen for tokenizers from train_bpe: merged bytes are unique
        raise ValueError("two tokens have the same bytes; HF's vocabulary cannot hold both")
    merges = [f"{strings[a]} {strings[b]}" for a, b in tok.merges]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if tok.pattern == GPT2_PATTERN:
        pre_tokenizer = byte_level
    else:  # another split pattern: split first, then map bytes without GPT-2's own regex
        pre_tokenizer = {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": tok.pattern}, "behavior": "Isolated", "invert": False},
                dict(byte_level, use_regex=False),
            ],
        }
    added = [
        {
            "id": i,
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for s, i in tok.special_tokens.items()
    ]
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
    return json.dumps(doc, ensure_ascii=False, indent=2) + "\n"
