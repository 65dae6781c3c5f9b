"""Regression tests for the reliability promises: each test names the failure it guards against.

The downloader's fault cases are in test_faults.py (a misbehaving loopback server), the parsers'
properties in test_properties.py (hypothesis).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct

import numpy as np
import pytest

from nanoeuler import checkpoint
from nanoeuler.errors import UserError


# ---- checkpoints: the checksum covers the header ------------------------------------------------


def _header_span(raw: bytes) -> tuple[int, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return n, raw[8:8 + n]


def test_a_changed_dtype_in_the_header_is_refused(tmp_path):
    # F32 -> I32 keeps every size and offset valid: only the header says the bytes mean something else
    path = tmp_path / "c.bin"
    checkpoint.save(path, {"w": np.arange(4, dtype=np.float32)}, {"step": 1})
    raw = path.read_bytes()
    assert raw.count(b'"F32"') == 1
    path.write_bytes(raw.replace(b'"F32"', b'"I32"'))
    with pytest.raises(UserError, match="checksum"):
        checkpoint.load(path)


def test_changed_metadata_and_tensor_names_are_refused(tmp_path):
    path = tmp_path / "c.bin"
    checkpoint.save(path, {"wa": np.ones(2, np.float32), "wb": np.zeros(2, np.float32)}, {"step": 7})
    raw = path.read_bytes()
    for old, new in ((b'"7"', b'"8"'), (b'"wa"', b'"wc"')):
        assert raw.count(old) == 1
        path.write_bytes(raw.replace(old, new))
        with pytest.raises(UserError, match="checksum"):
            checkpoint.load(path)


def test_header_padding_is_not_meaning(tmp_path):
    """Padding spaces may become other JSON whitespace: the file still means the same and loads."""
    path = tmp_path / "c.bin"
    checkpoint.save(path, {"w": np.ones(3, np.float32)}, {"step": 1})
    raw = bytearray(path.read_bytes())
    n, blob = _header_span(bytes(raw))
    if blob.endswith(b" "):
        raw[8 + n - 1] = ord("\n")
        path.write_bytes(bytes(raw))
        tensors, meta = checkpoint.load(path)
        assert meta == {"step": 1}


def test_version_1_files_still_load_with_their_data_checksum(tmp_path):
    path = tmp_path / "old.bin"
    w = np.arange(6, dtype=np.float32)
    meta = {"step": json.dumps(3), "format": "nanoeuler", "format_version": "1",
            "checksum": hashlib.sha256(w.tobytes()).hexdigest()}
    checkpoint.write_safetensors(path, {"w": w}, meta)
    tensors, got = checkpoint.load(path)
    np.testing.assert_array_equal(tensors["w"], w)
    assert got == {"step": 3}
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="checksum"):
        checkpoint.load(path)


# ---- file permissions ---------------------------------------------------------------------------


def test_atomic_text_outputs_get_the_usual_mode(tmp_path):
    """tokenizer.json, tokenizer.hf.json and manifest.json were written 0600 (mkstemp's mode)."""
    from nanoeuler.tokenizer.bpe import write_text_atomic

    old = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "t.json", "{}\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "t.json").stat().st_mode) == 0o644
