"""Small inputs for the training, generation and evaluation tests: a tokenizer, random-token shards,
Alpaca records, a config file and a trained-for-nothing model. Everything is tiny and offline."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import yaml

from nanoeuler.data.template import PROMPT_NO_INPUT, PROMPT_WITH_INPUT

TEXT = (PROMPT_WITH_INPUT + PROMPT_NO_INPUT) * 4 + (
    "It was the best of times, it was the worst of times. The sea was calm and the sky was blue. "
    "Once upon a time there lived a fox who liked to read books about the history of science. "
    "Give three tips for staying healthy: eat well, sleep well, and walk every day. "
) * 8

TINY_MODEL = {"preset": "small", "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ctx_len": 64, "mtp_heads": 2}


def make_tokenizer(vocab_size: int = 460):
    from nanoeuler.tokenizer.bpe import train_bpe

    return train_bpe(TEXT, vocab_size)


def write_shards(
    out_dir: Path, tok, n_train: int = 20000, n_val: int = 3000, seed: int = 0, shard_tokens: int = 8000
) -> Path:
    """Random uint16 tokens below the vocabulary size, split into shards, plus manifest.json."""
    rng = np.random.default_rng(seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, n in (("train", n_train), ("val", n_val)):
        tokens = rng.integers(0, tok.vocab_size, size=n).astype(np.uint16)
        shards = []
        for i, lo in enumerate(range(0, n, shard_tokens)):
            name = f"{split}_{i:04d}.npy"
            part = tokens[lo : lo + shard_tokens]
            np.save(out_dir / name, part)
            shards.append({"file": name, "tokens": int(part.shape[0])})
        splits[split] = {"shards": shards, "tokens": n, "bytes": 3 * n, "documents": 10}
    manifest = {
        "format": 1,
        "tokenizer_sha256": tok.sha256,
        "vocab_size": tok.vocab_size,
        "dtype": "uint16",
        "splits": splits,
    }
    path = out_dir / "manifest.json"
    path.write_text(json.dumps(manifest))
    return path


ALPACA = [
    {"instruction": "Give three tips for staying healthy.", "input": "", "output": "Eat well, sleep well, walk."},
    {"instruction": "Translate to French.", "input": "The sea", "output": "La mer"},
    {"instruction": "What is the capital of France?", "input": "", "output": "Paris."},
    {
        "instruction": "Summarize the text.",
        "input": "It was the best of times, it was the worst of times.",
        "output": "Times were mixed.",
    },
    {"instruction": "Name a color.", "input": "", "output": "Blue."},
    {"instruction": "Write a very long answer.", "input": "", "output": "the sea was calm " * 40},
]


def write_alpaca(path: Path, n: int = 48) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps(ALPACA[i % len(ALPACA)]) + "\n")
    return path


def write_config(path: Path, **sections) -> Path:
    conf = {"device": "cpu", "model": dict(TINY_MODEL)}
    for name, values in sections.items():
        conf.setdefault(name, {}).update(values)
    Path(path).write_text(yaml.safe_dump(conf))
    return Path(path)


def save_random_model(path: Path, tok, model: dict | None = None, seed: int = 0):
    from nanoeuler import checkpoint
    from nanoeuler.model.config import ModelConfig
    from nanoeuler.model.transformer import init_params

    cfg = ModelConfig.from_section(model or TINY_MODEL, tok.vocab_size)
    params = init_params(cfg, seed)
    checkpoint.save_model(path, params, cfg, step=0, tokenizer_json=tok.to_json())
    return params, cfg


def thread_mean_hooks(n: int) -> list:
    """Gradient hooks for n steppers stepping in n threads: each averages every rank's gradients in place
    (a thread barrier stands in for NCCL's all-reduce)."""
    barrier, slots = threading.Barrier(n), [None] * n

    def hook_of(rank):
        def hook(grads):
            slots[rank] = grads
            barrier.wait()
            total = {k: sum((s[k] for s in slots[1:]), slots[0][k]) for k in grads}  # rank 0's first
            barrier.wait()
            for k in grads:
                grads[k][...] = total[k] * (1.0 / n)

        return hook

    return [hook_of(r) for r in range(n)]


def step_in_threads(steppers, batches, lr: float) -> list:
    """Each stepper's step on its own batch, all at once in threads: their (loss, gradient norm)."""
    out = [None] * len(steppers)

    def run(r):
        out[r] = steppers[r].step([batches[r]], lr=lr)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(steppers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
