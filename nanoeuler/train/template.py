"""The Stanford Alpaca instruction template, and the SFT examples and masks built from it.

An example is the rendered prompt, then the response text, then the `</s>` special token.
Only the response and `</s>` are trained: every other target is -1 (ignored by the loss).
With K multi-token-prediction heads, head k's target at position t is token t+1+k when that
position holds a response token, else -1:

    tokens  = [p0 p1 p2 r0 r1 </s>]        prompt p*, response r*
    inputs  = [p0 p1 p2 r0 r1]
    head 0  = [-1 -1 r0 r1 </s>]
    head 1  = [-1 r0 r1 </s> -1]
"""

from __future__ import annotations

import numpy as np

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def render_prompt(instruction: str, input: str = "") -> str:
    """The prompt text for one instruction (the template with or without its input block)."""
    if input and input.strip():
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=input)
    return PROMPT_NO_INPUT.format(instruction=instruction)


def encode_example(tokenizer, record: dict) -> tuple[list[int], int]:
    """(token ids of prompt + response + `</s>`, number of prompt tokens).

    User text is encoded with no special tokens allowed, so a literal "</s>" in the data is text;
    the end marker is appended by id.
    """
    prompt = tokenizer.encode(render_prompt(record["instruction"], record.get("input", "")))
    response = tokenizer.encode(record["output"]) + [tokenizer.end_id]
    return prompt + response, len(prompt)


def fit_example(ids: list[int], n_prompt: int, ctx_len: int, too_long: str) -> tuple[list[int], int] | None:
    """Make an example fit `ctx_len` inputs (ctx_len + 1 tokens): (ids, n_prompt), or None to drop it.

    `too_long`: "drop" discards an example that does not fit. "truncate" keeps the response's head:
    all of it that fits after the whole prompt, but at least ctx_len // 4 tokens; a prompt too long for
    that loses its start (left-truncation, as `nanoeuler chat` does with long prompts), so it still
    ends with "### Response:" followed by the response.

        >>> fit_example(list(range(12)), 4, ctx_len=8, too_long="truncate")   # prompt 0-3, response 4-11
        ([0, 1, 2, 3, 4, 5, 6, 7, 8], 4)
        >>> fit_example(list(range(12)), 10, ctx_len=8, too_long="truncate")  # prompt 0-9, response 10-11
        ([3, 4, 5, 6, 7, 8, 9, 10, 11], 7)
    """
    budget = ctx_len + 1
    if len(ids) <= budget:
        return ids, n_prompt
    if too_long == "drop":
        return None
    n_resp = len(ids) - n_prompt
    keep_resp = min(n_resp, max(budget - n_prompt, ctx_len // 4, 1))
    keep_prompt = budget - keep_resp
    return ids[n_prompt - keep_prompt : n_prompt + keep_resp], keep_prompt


def sft_batch(examples: list[tuple[list[int], int]], K: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Pad a batch of (ids, n_prompt) into inputs (B, T) and masked targets (B, T, K).

    T is the longest example's length minus one; padding positions hold `pad_id` as input and -1
    as target.
    """
    T = max(len(ids) for ids, _ in examples) - 1
    B = len(examples)
    inputs = np.full((B, T), pad_id, dtype=np.int64)
    targets = np.full((B, T, K), -1, dtype=np.int64)
    for b, (ids, n_prompt) in enumerate(examples):
        seq = np.asarray(ids, dtype=np.int64)
        L = seq.shape[0]
        inputs[b, : L - 1] = seq[: L - 1]
        for k in range(K):
            # position t's head-k target is seq[t+1+k]; trained only when that is a response token
            lo = max(n_prompt - 1 - k, 0)
            hi = L - 1 - k
            if hi > lo:
                targets[b, lo:hi, k] = seq[lo + 1 + k : hi + 1 + k]
    return inputs, targets
