"""Token windows from the memory-mapped shards (`results/shards/manifest.json`).

Pretraining draws random windows of `T + K` tokens (context plus the K multi-token-prediction
targets) from one seeded `numpy.random.Generator`. The generator's `bit_generator.state` is the
loader's whole position, so a checkpoint that stores it resumes the exact batch sequence.

Validation uses a fixed set: consecutive non-overlapping windows from the start of the val split,
the same every time it is evaluated.

    >>> w = np.arange(6)[None]                 # one window, T = 3, K = 3
    >>> x, y = split_window(w, 3)
    >>> x.tolist(), y[0].tolist()
    ([[0, 1, 2]], [[1, 2, 3], [2, 3, 4], [3, 4, 5]])
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from nanoeuler.errors import UserError
from nanoeuler.files import SMALL_JSON, check_input, parse_json, read_text


def read_manifest(path: str | Path) -> dict:
    path = Path(path)
    if not os.path.lexists(path):
        raise UserError(f"shard manifest {path} does not exist (run `nanoeuler tokenize` first)")
    text = read_text(path, "shard manifest", SMALL_JSON)
    manifest = parse_json(text, f"shard manifest {path}")
    if not isinstance(manifest, dict) or "splits" not in manifest:
        raise UserError(f"shard manifest {path} has no 'splits' key")
    manifest["_sha256"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return manifest


class ShardSplit:
    """One split (train or val) of the shards, memory-mapped: `arrays`, `tokens`, `bytes`."""

    def __init__(self, manifest_path: str | Path, split: str, manifest: dict | None = None):
        manifest_path = Path(manifest_path)
        manifest = manifest if manifest is not None else read_manifest(manifest_path)
        if not isinstance(manifest["splits"], dict) or split not in manifest["splits"]:
            raise UserError(f"shard manifest {manifest_path} has no '{split}' split")
        info = _split_entry(manifest["splits"][split], manifest_path, split)
        self.name = split
        self.manifest = manifest
        self.arrays: list[np.ndarray] = []
        for shard in info.get("shards", []):
            path = manifest_path.parent / shard["file"]
            if not os.path.lexists(path):
                raise UserError(f"shard {path} listed in {manifest_path} does not exist")
            check_input(path, "shard")  # a device or FIFO cannot be mapped
            try:
                arr = np.load(path, mmap_mode="r")
            except ValueError as exc:
                raise UserError(f"shard {path} is not a readable .npy file: {exc}") from None
            if arr.ndim != 1 or arr.dtype != np.uint16:
                raise UserError(f"shard {path} must be a 1-D uint16 array, got {arr.dtype} of shape {arr.shape}")
            if "tokens" in shard and int(shard["tokens"]) != arr.shape[0]:
                raise UserError(f"shard {path} holds {arr.shape[0]} tokens but {manifest_path} says {shard['tokens']}")
            self.arrays.append(arr)
        self.tokens = int(sum(a.shape[0] for a in self.arrays))
        self.bytes = int(info.get("bytes", 0))
        if self.tokens == 0:
            raise UserError(f"the '{split}' split of {manifest_path} holds no tokens")

    def head(self, n: int) -> np.ndarray:
        """The first `n` tokens of the split (across shards), as int64."""
        parts, need = [], n
        for arr in self.arrays:
            if need <= 0:
                break
            parts.append(np.asarray(arr[:need], dtype=np.int64))
            need -= parts[-1].shape[0]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _split_entry(info, manifest_path: Path, split: str) -> dict:
    """A split's manifest entry after checking its shape: {"shards": [{"file": str, ...}], ...}."""
    shards = info.get("shards", []) if isinstance(info, dict) else None
    if not isinstance(shards, list) or not all(
        isinstance(s, dict) and isinstance(s.get("file"), str) and isinstance(s.get("tokens", 0), int) for s in shards
    ):
        raise UserError(
            f"shard manifest {manifest_path}: split '{split}' must hold a list 'shards' of "
            '{"file": name, "tokens": count} objects'
        )
    if not isinstance(info.get("bytes", 0), int):
        raise UserError(f"shard manifest {manifest_path}: split '{split}' key 'bytes' must be an integer")
    return info


def split_window(windows: np.ndarray, T: int) -> tuple[np.ndarray, np.ndarray]:
    """(B, T+K) token windows -> inputs (B, T) and targets (B, T, K), targets[b, t, k] = w[b, t+1+k]."""
    K = windows.shape[1] - T
    inputs = windows[:, :T]
    targets = np.stack([windows[:, 1 + k : 1 + k + T] for k in range(K)], axis=-1)
    return np.ascontiguousarray(inputs), np.ascontiguousarray(targets)


class RandomWindows:
    """Batches of random windows of `T + K` tokens, drawn from a seeded Generator.

    A window never crosses a shard boundary; each start position of each shard is equally likely.
    Rank `rank` of `world` data-parallel ranks draws the `world * batch_size` windows of the whole step
    (the same draws on every rank) and keeps windows rank, rank + world, ...
    """

    def __init__(self, split: ShardSplit, T: int, K: int, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        self.split, self.T, self.K, self.batch_size = split, T, K, batch_size
        self.rank, self.world = rank, world
        self.window = T + K
        self.starts = np.array([max(0, a.shape[0] - self.window + 1) for a in split.arrays], dtype=np.int64)
        self.cum = np.cumsum(self.starts)
        if self.cum[-1] == 0:
            longest = max(a.shape[0] for a in split.arrays)
            raise UserError(
                f"the '{split.name}' shards are too short: the longest holds {longest} tokens, "
                f"a training window needs ctx_len + mtp_heads = {self.window}"
            )
        self.rng = np.random.default_rng(seed)

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """inputs (B, T) int64 and targets (B, T, K) int64."""
        g = self.rng.integers(0, int(self.cum[-1]), size=self.batch_size * self.world)[self.rank :: self.world]
        shard = np.searchsorted(self.cum, g, side="right")
        offset = g - (self.cum[shard] - self.starts[shard])
        windows = np.stack([self.split.arrays[s][o : o + self.window] for s, o in zip(shard, offset)])
        return split_window(windows.astype(np.int64), self.T)

    def state(self) -> dict:
        return {"bit_generator": self.rng.bit_generator.state}

    def load_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state["bit_generator"]


def fixed_windows(split: ShardSplit, T: int, K: int, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The fixed validation set: consecutive non-overlapping windows from the start of `split`.

    Uses at most `max_tokens` input positions (at least one window). A split shorter than one
    window gives a single shorter window, so tiny corpora still get a validation number.
    """
    window = T + K
    n = max(1, max_tokens // T)
    if split.tokens < window:
        T = split.tokens - K
        if T < 1:
            raise UserError(f"the '{split.name}' split holds {split.tokens} tokens, too few to validate on")
        window, n = split.tokens, 1
    n = min(n, split.tokens // window)
    tokens = split.head(n * window)
    return split_window(tokens.reshape(n, window), T)
