"""Validation metrics on the fixed val set: loss, head-0 cross-entropy, bits per byte.

- `val_loss`: the training objective (mean over MTP heads of each head's mean cross-entropy), nats.
- `val_ce`: head 0's mean cross-entropy per token, nats; the next-token loss that generation uses.
- `val_bpb`: bits per UTF-8 byte = val_ce / ln 2 * (val split tokens / val split bytes), with the
  token and byte counts of the whole val split from the shard manifest. It does not depend on the
  vocabulary, so tokenizers of different sizes compare.

Pretraining logs them as it trains and `nanoeuler evaluate` reports them for each model, so they live
with training, below evaluation.
"""

from __future__ import annotations

import math

# Input positions per evaluation forward on the CPU. On the GPU the stage sizes its chunks from its
# memory budget instead (`memory.eval_items_for`).
EVAL_CHUNK_TOKENS = 2048


def evaluate_windows(
    params: dict, cfg, inputs, targets, batch_size: int, xp, chunk_tokens: int | None = EVAL_CHUNK_TOKENS
) -> tuple[float, float]:
    """(mean loss over heads, head-0 cross-entropy) over fixed windows, each window weighted equally.

    `inputs` (N, T) and `targets` (N, T, K) are NumPy; batches of at most `batch_size` windows and
    `chunk_tokens` positions (at least one window; None: `batch_size` alone) move to the params' device.
    """
    from nanoeuler.model import transformer

    total = ce0 = 0.0
    n = inputs.shape[0]
    if chunk_tokens is not None:
        batch_size = max(1, min(batch_size, chunk_tokens // max(1, inputs.shape[1])))
    for lo in range(0, n, batch_size):
        x = xp.asarray(inputs[lo : lo + batch_size])
        y = xp.asarray(targets[lo : lo + batch_size])
        loss, heads = transformer.forward_loss(params, x, y, cfg)
        total += float(loss) * x.shape[0]
        ce0 += float(heads[0]) * x.shape[0]
    return total / n, ce0 / n


def val_metrics(
    params: dict, cfg, val: tuple, split_tokens: int, split_bytes: int, batch_size: int, xp, sized: bool = False
) -> dict:
    """`sized`: `batch_size` windows were sized to the device's memory (`memory.eval_items_for`), so no
    cap of positions applies."""
    inputs, targets = val
    loss, ce = evaluate_windows(params, cfg, inputs, targets, batch_size, xp, None if sized else EVAL_CHUNK_TOKENS)
    return {
        "val_loss": loss,
        "val_ce": ce,
        "val_bpb": bits_per_byte(ce, split_tokens, split_bytes),
        "val_tokens": int(inputs.size),
    }


def bits_per_byte(ce_nats: float, tokens: int, n_bytes: int) -> float:
    """Bits per UTF-8 byte of text from a mean per-token cross-entropy in nats.

    bpb = ce_nats / ln 2 * tokens / bytes, where tokens/bytes is the split's token count over its
    UTF-8 byte count (from the manifest). NaN when the byte count is unknown.
    """
    if n_bytes <= 0:
        return float("nan")
    return ce_nats / math.log(2) * tokens / n_bytes
