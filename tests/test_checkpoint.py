"""The checkpoint format: our writer and reader, the safetensors library as an outside reader, and every
way a file can be wrong."""

import json
import os
import struct

import numpy as np
import pytest

from nanoeuler import checkpoint
from nanoeuler.errors import UserError
from nanoeuler.model import transformer
from nanoeuler.model.config import ModelConfig

CFG = ModelConfig(vocab_size=40, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ctx_len=8, mtp_heads=2)


def tensors():
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((3, 5)).astype(np.float32),
        "d": rng.standard_normal(4),
        "h": np.arange(6, dtype=np.float16).reshape(2, 3),
        "tokens": np.arange(7, dtype=np.uint16),
        "i": np.array([-1, 2**40], dtype=np.int64),
        "flags": np.array([True, False]),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def test_round_trip_keeps_order_dtypes_and_metadata(tmp_path):
    t = tensors()
    meta = {"step": 12, "model_config": CFG.to_dict(), "tokenizer": '{"a": 1}', "rng": {"state": [1, 2**70]}}
    checkpoint.save(tmp_path / "c.bin", t, meta)
    got, got_meta = checkpoint.load(tmp_path / "c.bin")
    assert list(got) == list(t)
    for name in t:
        assert got[name].dtype == t[name].dtype and got[name].shape == t[name].shape
        np.testing.assert_array_equal(got[name], t[name])
    assert got_meta == meta  # values come back decoded; reserved keys are not returned


def test_the_safetensors_library_reads_our_files(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    t = tensors()
    checkpoint.save(tmp_path / "c.bin", t, {"step": 3})
    theirs = load_file(tmp_path / "c.bin")
    assert set(theirs) == set(t)
    for name in t:
        np.testing.assert_array_equal(theirs[name], t[name])
    with safe_open(tmp_path / "c.bin", framework="np") as f:
        meta = f.metadata()
    assert meta["format"] == "nanoeuler" and meta["format_version"] == "2" and json.loads(meta["step"]) == 3
    assert len(meta["checksum"]) == 64


def test_header_is_padded_and_data_little_endian(tmp_path):
    checkpoint.save(tmp_path / "c.bin", {"x": np.array([1.0], dtype=">f4")}, {})
    raw = (tmp_path / "c.bin").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and raw[8 + n :] == struct.pack("<f", 1.0)


def test_truncated_file_is_a_user_error(tmp_path):
    path = tmp_path / "c.bin"
    checkpoint.save(path, tensors(), {"step": 1})
    raw = path.read_bytes()
    for cut in (3, 20, len(raw) - 1):
        path.write_bytes(raw[:cut])
        with pytest.raises(UserError, match="truncated"):
            checkpoint.load(path)


def test_flipped_byte_fails_the_checksum(tmp_path):
    path = tmp_path / "c.bin"
    checkpoint.save(path, tensors(), {"step": 1})
    raw = bytearray(path.read_bytes())
    raw[-20] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="checksum"):
        checkpoint.load(path)


def test_garbage_header_and_foreign_files(tmp_path):
    path = tmp_path / "c.bin"
    path.write_bytes(struct.pack("<Q", 8) + b"{not json")
    with pytest.raises(UserError, match="truncated|corrupt"):
        checkpoint.load(path)
    path.write_bytes(struct.pack("<Q", 8) + b"[1,2,3] ")
    with pytest.raises(UserError, match="corrupt"):
        checkpoint.load(path)
    from safetensors.numpy import save_file

    save_file({"x": np.ones(3, np.float32)}, str(path))  # a safetensors file, but not ours
    with pytest.raises(UserError, match="not a nanoeuler checkpoint"):
        checkpoint.load(path)
    with pytest.raises(UserError, match="does not exist"):
        checkpoint.load(tmp_path / "missing.bin")


def test_other_format_version_is_refused(tmp_path):
    path = tmp_path / "c.bin"
    checkpoint.write_safetensors(
        path, {"x": np.ones(2, np.float32)}, {"format": "nanoeuler", "format_version": "3"}, checksum_key="checksum"
    )
    with pytest.raises(UserError, match="format version '3'"):
        checkpoint.load(path)


def test_writes_are_atomic(tmp_path, monkeypatch):
    path = tmp_path / "c.bin"
    checkpoint.save(path, {"x": np.zeros(3, np.float32)}, {"step": 1})
    before = path.read_bytes()

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        checkpoint.save(path, {"x": np.ones(3, np.float32)}, {"step": 2})
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["c.bin"]  # no temporary file left behind


def test_reserved_metadata_keys_are_refused(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        checkpoint.save(tmp_path / "c.bin", {}, {"checksum": "x"})


# ---- models -------------------------------------------------------------------------------------


def test_model_round_trip(tmp_path):
    params = transformer.init_params(CFG, seed=1)
    checkpoint.save_model(tmp_path / "m.bin", params, CFG, step=5, tokenizer_json='{"v": 1}', extra={"note": "x"})
    got, cfg, meta = checkpoint.load_model(tmp_path / "m.bin", expect=CFG)
    assert cfg == CFG and meta["step"] == 5 and meta["tokenizer"] == '{"v": 1}' and meta["note"] == "x"
    assert list(got) == list(params)
    assert all(got[n].dtype == np.float32 and np.array_equal(got[n], params[n]) for n in params)


def test_float64_params_are_stored_as_float32(tmp_path):
    params = transformer.init_params(CFG, seed=1, dtype=np.float64)
    checkpoint.save_model(tmp_path / "m.bin", params, CFG, step=0, tokenizer_json=None)
    got, _, _ = checkpoint.load_model(tmp_path / "m.bin")
    assert got["lm_head.weight"].dtype == np.float32


def test_config_mismatch_is_a_user_error(tmp_path):
    checkpoint.save_model(tmp_path / "m.bin", transformer.init_params(CFG, seed=1), CFG, step=0, tokenizer_json=None)
    other = ModelConfig(**{**CFG.to_dict(), "dim": 32, "ctx_len": 16})
    with pytest.raises(UserError, match="does not match") as exc:
        checkpoint.load_model(tmp_path / "m.bin", expect=other)
    assert "dim 16 vs 32" in str(exc.value) and "ctx_len 8 vs 16" in str(exc.value)


def test_missing_or_misshapen_parameter_is_a_user_error(tmp_path):
    params = transformer.init_params(CFG, seed=1)
    meta = {"model_config": CFG.to_dict(), "step": 0}
    checkpoint.save(tmp_path / "a.bin", {n: p for n, p in params.items() if n != "norm.weight"}, meta)
    with pytest.raises(UserError, match="lacks parameter 'norm.weight'"):
        checkpoint.load_model(tmp_path / "a.bin")
    checkpoint.save(tmp_path / "b.bin", {**params, "norm.weight": np.ones(3, np.float32)}, meta)
    with pytest.raises(UserError, match="shape"):
        checkpoint.load_model(tmp_path / "b.bin")
    checkpoint.save(tmp_path / "c.bin", params, {"step": 0})
    with pytest.raises(UserError, match="no model config"):
        checkpoint.load_model(tmp_path / "c.bin")


def test_training_checkpoint_with_optimizer_state_loads_as_a_model(tmp_path):
    from nanoeuler.optim import AdamW

    params = transformer.init_params(CFG, seed=1)
    opt = AdamW(params)
    tensors = dict(params)
    tensors.update({f"optim.{k}": v for k, v in opt.state_tensors().items()})
    checkpoint.save(tmp_path / "t.bin", tensors, {"model_config": CFG.to_dict(), "step": 9, "tokenizer": None})
    got, cfg, meta = checkpoint.load_model(tmp_path / "t.bin")
    assert list(got) == list(params) and meta["step"] == 9


@pytest.mark.gpu
def test_weights_move_between_backends(tmp_path):
    import cupy as cp

    params = {n: cp.asarray(p) for n, p in transformer.init_params(CFG, seed=1).items()}
    checkpoint.save_model(tmp_path / "m.bin", params, CFG, step=0, tokenizer_json=None)  # written from the GPU
    got, _, _ = checkpoint.load_model(tmp_path / "m.bin")  # read on the CPU
    assert all(isinstance(a, np.ndarray) for a in got.values())
    x = np.random.default_rng(0).integers(0, CFG.vocab_size, size=(1, 8))
    on_gpu = cp.asnumpy(transformer.logits({n: cp.asarray(a) for n, a in got.items()}, x, CFG))
    np.testing.assert_allclose(on_gpu, transformer.logits(got, x, CFG), atol=1e-4)
