"""The shard loader: manifest checks, random windows (contiguous, seeded, resumable), the fixed val set."""

import json
import math

import numpy as np
import pytest

from nanoeuler.errors import UserError
from nanoeuler.train.loader import RandomWindows, ShardSplit, fixed_windows, read_manifest, split_window
from nanoeuler.train.metrics import bits_per_byte


def write_counting_shards(d, sizes, val_sizes=(500,)):
    """Shard i of a split holds 1000*i, 1000*i+1, ...: a window's tokens say where it came from."""
    splits = {}
    for split, sz in (("train", sizes), ("val", val_sizes)):
        shards = []
        for i, n in enumerate(sz):
            name = f"{split}_{i:04d}.npy"
            np.save(d / name, (1000 * i + np.arange(n)).astype(np.uint16))
            shards.append({"file": name, "tokens": n})
        splits[split] = {"shards": shards, "tokens": sum(sz), "bytes": 4 * sum(sz), "documents": 1}
    path = d / "manifest.json"
    path.write_text(
        json.dumps({"format": 1, "tokenizer_sha256": "x", "vocab_size": 65535, "dtype": "uint16", "splits": splits})
    )
    return path


def test_split_window_targets_are_shifted_by_one_plus_k():
    w = np.arange(20).reshape(2, 10)
    x, y = split_window(w, 7)
    assert x.shape == (2, 7) and y.shape == (2, 7, 3)
    for b in range(2):
        for t in range(7):
            for k in range(3):
                assert y[b, t, k] == w[b, t + 1 + k]


def test_windows_are_contiguous_within_one_shard_and_cover_every_shard(tmp_path):
    path = write_counting_shards(tmp_path, [300, 50, 400, 10])  # the 10-token shard is too short for a window
    split = ShardSplit(path, "train")
    assert split.tokens == 760 and split.bytes == 3040
    loader = RandomWindows(split, T=16, K=2, batch_size=64, seed=0)
    seen = set()
    for _ in range(20):
        x, y = loader.next_batch()
        assert x.shape == (64, 16) and y.shape == (64, 16, 2) and x.dtype == np.int64
        w = np.concatenate([x, y[:, -1:, 0], y[:, -1:, 1]], axis=1)  # the full 18-token window
        assert (np.diff(w, axis=1) == 1).all(), "window is not contiguous"
        shard = w // 1000
        assert (shard == shard[:, :1]).all(), "window crosses a shard boundary"
        seen.update(shard[:, 0].tolist())
        assert (w % 1000 < np.array([300, 50, 400, 10])[shard]).all()
    assert seen == {0, 1, 2}


def test_generator_state_resumes_the_exact_batch_sequence(tmp_path):
    split = ShardSplit(write_counting_shards(tmp_path, [500, 500]), "train")
    a = RandomWindows(split, T=8, K=2, batch_size=4, seed=7)
    for _ in range(3):
        a.next_batch()
    state = json.loads(json.dumps(a.state()))  # what a checkpoint stores
    expect = [a.next_batch()[0] for _ in range(3)]
    b = RandomWindows(split, T=8, K=2, batch_size=4, seed=999)
    b.load_state(state)
    for e in expect:
        np.testing.assert_array_equal(b.next_batch()[0], e)
    c = RandomWindows(split, T=8, K=2, batch_size=4, seed=7)
    d = RandomWindows(split, T=8, K=2, batch_size=4, seed=8)
    assert not np.array_equal(c.next_batch()[0], d.next_batch()[0])


def test_fixed_val_windows_are_consecutive_and_stable(tmp_path):
    split = ShardSplit(write_counting_shards(tmp_path, [100], val_sizes=(60, 60)), "val")
    x, y = fixed_windows(split, T=10, K=2, max_tokens=50)
    assert x.shape == (5, 10)
    np.testing.assert_array_equal(x[0], np.arange(10))
    np.testing.assert_array_equal(x[1], np.arange(12, 22))  # windows of T+K tokens, back to back
    assert y[4, -1, 1] == 59
    x2, _ = fixed_windows(split, T=10, K=2, max_tokens=50)
    np.testing.assert_array_equal(x, x2)
    # across the shard boundary the windows continue into the next shard
    x3, _ = fixed_windows(split, T=10, K=2, max_tokens=1000)
    assert x3.shape == (10, 10) and x3[5, 0] == 1000


def test_val_split_shorter_than_a_window_gives_one_short_window(tmp_path):
    split = ShardSplit(write_counting_shards(tmp_path, [100], val_sizes=(9,)), "val")
    x, y = fixed_windows(split, T=64, K=2, max_tokens=1000)
    assert x.shape == (1, 7) and y.shape == (1, 7, 2) and y[0, -1, 1] == 8


def test_bits_per_byte_definition():
    assert bits_per_byte(math.log(2), 100, 100) == pytest.approx(1.0)
    assert bits_per_byte(2 * math.log(2), 100, 400) == pytest.approx(0.5)  # 4 bytes per token
    assert math.isnan(bits_per_byte(1.0, 10, 0))


def test_manifest_problems_are_clear_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_manifest(tmp_path / "nope.json")
    path = write_counting_shards(tmp_path, [100])
    m = json.loads(path.read_text())
    m["splits"]["train"]["shards"][0]["tokens"] = 99
    path.write_text(json.dumps(m))
    with pytest.raises(UserError, match="holds 100 tokens"):
        ShardSplit(path, "train")
    (tmp_path / "train_0000.npy").unlink()
    with pytest.raises(UserError, match="train_0000.npy"):
        ShardSplit(path, "train")
    with pytest.raises(UserError, match="no 'test' split"):
        ShardSplit(path, "test")
    np.save(tmp_path / "val_0000.npy", np.arange(5, dtype=np.int32))
    with pytest.raises(UserError, match="uint16"):
        ShardSplit(path, "val")


def test_shards_too_short_for_a_window(tmp_path):
    split = ShardSplit(write_counting_shards(tmp_path, [20, 30]), "train")
    with pytest.raises(UserError, match="ctx_len \\+ mtp_heads = 66"):
        RandomWindows(split, T=64, K=2, batch_size=1, seed=0)
