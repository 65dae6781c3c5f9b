"""Checkpoints in the safetensors layout, written and read by our own code.

File layout (the `safetensors` library reads these files):

    8 bytes   little-endian u64: length n of the header
    n bytes   JSON header, padded with spaces to a multiple of 8:
              {"__metadata__": {str: str, ...},
               "<tensor name>": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...}
    data      raw little-endian tensor bytes, back to back in header order; offsets are relative to here

`__metadata__` holds the caller's metadata with every value JSON-encoded (so `load` gives back ints, dicts,
strings...), plus three reserved keys: `format` ("nanoeuler"), `format_version` ("2") and `checksum`:
the hex sha256 of the header in canonical form (the JSON object without the checksum itself, keys sorted,
no spaces) followed by the whole data section. So every byte that changes what the file means is covered:
a tensor's dtype, shape or offsets, its name, the metadata, and its data. Bytes that change nothing
(header padding) are not.

Version 1 files (the checksum covered the data section only) still load, with that weaker check, so
runs and models from before keep working; a file of any other version is refused.

Writes are atomic: a temporary file in the same directory, flushed and fsynced, then renamed over the
target, so a crash never leaves a half-written checkpoint under the real name. Reading a truncated or
corrupt file, a file of another format version, or one whose checksum does not match raises `UserError`.

`save_model`/`load_model` store a model: the parameters (float32) with metadata `model_config`, `step` and
`tokenizer` (the tokenizer's JSON, so one file is enough to chat). Training checkpoints use `save` directly
and add optimizer moments as `optim.m.<name>`/`optim.v.<name>` tensors; `load_model` reads the model out of
those files too and ignores the other tensors.

`load_model` also takes a release folder (`nanoeuler release`): `model_file` finds the one model file
that its `SHA256SUMS` lists and checks the file against that line first.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from nanoeuler.backend import to_numpy
from nanoeuler.errors import UserError
from nanoeuler.files import CHECKPOINT, SMALL_JSON, JsonError, file_sha256, naming, open_input, parse_json, read_text
from nanoeuler.model.config import ModelConfig

FORMAT = "nanoeuler"
FORMAT_VERSION = "2"
READABLE_VERSIONS = ("1", FORMAT_VERSION)  # "1": the checksum covers the data section only
RESERVED = ("format", "format_version", "checksum")
MAX_HEADER = 100 * 1024 * 1024

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_NAMES = {np.dtype(t): name for name, t in _DTYPES.items()}


def _as_le_numpy(name, a) -> np.ndarray:
    a = np.asarray(to_numpy(a))
    if not a.flags.c_contiguous:  # (np.ascontiguousarray would turn a 0-d array into 1-d)
        a = a.copy(order="C")
    if a.dtype.newbyteorder("=") not in _NAMES and a.dtype not in _NAMES:
        raise ValueError(f"tensor {name!r} has dtype {a.dtype}, which checkpoints do not store")
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a


def _bytes_of(a: np.ndarray) -> memoryview:
    return memoryview(a.reshape(-1)).cast("B")


def write_safetensors(path, tensors: dict, raw_metadata: dict[str, str], checksum_key: str | None = None) -> str | None:
    """Write a safetensors file atomically: `tensors` in order, `raw_metadata` (str -> str) as
    `__metadata__`, plus under `checksum_key` (if given) the hex sha256 of the canonical header and the
    data section. Returns that digest (None without `checksum_key`)."""
    path = Path(path)
    arrays = {name: _as_le_numpy(name, a) for name, a in tensors.items()}
    header: dict = {}
    offset = 0
    for name, a in arrays.items():
        if name == "__metadata__":
            raise ValueError("a tensor cannot be named __metadata__")
        header[name] = {
            "dtype": _NAMES[a.dtype.newbyteorder("=")],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    meta = dict(raw_metadata)
    header = {"__metadata__": meta, **header}
    checksum = None
    if checksum_key:
        digest = hashlib.sha256(canonical_header(header, checksum_key))
        for a in arrays.values():
            digest.update(_bytes_of(a))
        meta[checksum_key] = checksum = digest.hexdigest()
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with naming(path), open(tmp, "wb") as f:  # a full disk names the checkpoint
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for a in arrays.values():
                f.write(_bytes_of(a))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return checksum


def canonical_header(header: dict, checksum_key: str = "checksum") -> bytes:
    """The header as the checksum sees it: without the checksum, keys sorted, no spaces, ASCII.

    >>> canonical_header({"__metadata__": {"checksum": "ab", "step": "1"}, "w": {"dtype": "F32"}})
    b'{"__metadata__":{"step":"1"},"w":{"dtype":"F32"}}'
    """
    meta = {k: v for k, v in header.get("__metadata__", {}).items() if k != checksum_key}
    return json.dumps({**header, "__metadata__": meta}, sort_keys=True, separators=(",", ":")).encode("ascii")


def fsync_dir(directory) -> None:
    """Make a rename in `directory` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def save(path, tensors: dict, metadata: dict) -> None:
    """Write `tensors` (name -> NumPy/CuPy array) and `metadata` (str -> JSON-able) to `path` atomically."""
    for key in metadata:
        if key in RESERVED or key == "__metadata__":
            raise ValueError(f"metadata key {key!r} is reserved")
    meta = {key: json.dumps(value, sort_keys=True) for key, value in metadata.items()}
    meta.update(format=FORMAT, format_version=FORMAT_VERSION)
    write_safetensors(path, tensors, meta, checksum_key="checksum")


def read_header(path) -> tuple[dict, dict, int]:
    """(tensor entries, raw __metadata__, data start) after checking the header; UserError if it is bad."""
    entries, meta, start, _ = _read_header(Path(path))
    return entries, meta, start


def _read_header(path: Path) -> tuple[dict, dict, int, bytes]:
    """read_header's answer plus the canonical header bytes that the checksum covers."""
    try:
        with open_input(path, "checkpoint", CHECKPOINT) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise UserError(f"checkpoint {path} is truncated ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise UserError(
                    f"checkpoint {path} is truncated or not a checkpoint (header length {n}, file size {size})"
                )
            raw = f.read(n)
    except OSError as exc:
        raise UserError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from None
    try:
        header = parse_json(raw, str(path))
    except JsonError:
        raise UserError(f"checkpoint {path} is corrupt (its header is not valid JSON)") from None
    if not isinstance(header, dict):
        raise UserError(f"checkpoint {path} is corrupt (its header is not a JSON object)")
    canonical = canonical_header(header) if isinstance(header.get("__metadata__"), dict) else b""
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UserError(f"{path} is not a nanoeuler checkpoint (no '__metadata__.format': '{FORMAT}')")
    if meta.get("format_version") not in READABLE_VERSIONS:
        raise UserError(
            f"checkpoint {path} has format version {meta.get('format_version')!r}; "
            f"this nanoeuler reads versions {', '.join(READABLE_VERSIONS)}"
        )
    data_size = size - 8 - n
    entries = []
    for name, e in header.items():
        try:
            dtype = np.dtype(_DTYPES[e["dtype"]])
            shape = tuple(int(s) for s in e["shape"])
            begin, end = (int(o) for o in e["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise UserError(f"checkpoint {path} is corrupt (bad header entry for tensor {name!r})") from None
        if end - begin != dtype.itemsize * math.prod(shape) or begin < 0 or min(shape, default=0) < 0:
            raise UserError(f"checkpoint {path} is corrupt (tensor {name!r}: size does not match its shape)")
        entries.append((begin, end, name, dtype, shape))
    entries.sort()
    expect = 0
    for begin, end, name, _, _ in entries:
        if begin != expect:
            raise UserError(f"checkpoint {path} is corrupt (tensor {name!r} does not follow its predecessor)")
        expect = end
    if expect > data_size:
        raise UserError(f"checkpoint {path} is truncated ({data_size} data bytes, header describes {expect})")
    if expect < data_size:
        raise UserError(f"checkpoint {path} is corrupt ({data_size - expect} stray bytes after the tensors)")
    tensors = {name: (dtype, shape, begin, end) for begin, end, name, dtype, shape in entries}
    order = [name for name in header]  # keep the writer's order for the caller
    return {name: tensors[name] for name in order}, meta, 8 + n, canonical


def load(path) -> tuple[dict, dict]:
    """Read a checkpoint -> (tensors: name -> NumPy array, metadata with JSON values decoded)."""
    path = Path(path)
    entries, meta, start, canonical = _read_header(path)
    # version 1 files: the checksum covers the data section only
    digest = hashlib.sha256(canonical if meta["format_version"] != "1" else b"")
    arrays = {}
    with open_input(path, "checkpoint", CHECKPOINT) as f:
        f.seek(start)
        for name, (dtype, shape, begin, end) in sorted(entries.items(), key=lambda kv: kv[1][2]):
            a = np.empty(shape, dtype=dtype.newbyteorder("<"))
            view = _bytes_of(a)
            if f.readinto(view) != len(view):
                raise UserError(f"checkpoint {path} is truncated (tensor {name!r} is cut short)")
            digest.update(view)
            arrays[name] = a
    if digest.hexdigest() != meta.get("checksum"):
        raise UserError(f"checkpoint {path} is corrupt (checksum mismatch: its header or tensor bytes were altered)")
    metadata = {}
    for key, value in meta.items():
        if key in RESERVED:
            continue
        if not isinstance(value, str):
            raise UserError(f"checkpoint {path} is corrupt (metadata {key!r} is not JSON)")
        try:
            metadata[key] = parse_json(value, f"{path}: metadata {key!r}")
        except JsonError:
            raise UserError(f"checkpoint {path} is corrupt (metadata {key!r} is not JSON)") from None
    return {name: arrays[name] for name in entries}, metadata


# ---- models ------------------------------------------------------------------------------------


def save_model(
    path, params: dict, cfg: ModelConfig, *, step: int, tokenizer_json: str | None, extra: dict | None = None
) -> None:
    """Parameters as float32 plus `model_config`, `step`, `tokenizer` (and `extra`) metadata."""
    metadata = {"model_config": cfg.to_dict(), "step": int(step), "tokenizer": tokenizer_json}
    metadata.update(extra or {})
    shapes = cfg.param_shapes()
    missing = [n for n in shapes if n not in params]
    if missing:
        raise ValueError(f"params lack {missing[:3]} for this config")
    save(path, {n: to_numpy(params[n]).astype(np.float32, copy=False) for n in shapes}, metadata)


def config_mismatch(got: ModelConfig, want: ModelConfig) -> str:
    """'dim 128 vs 64, ...' for every field that differs; '' when equal."""
    a, b = got.to_dict(), want.to_dict()
    return ", ".join(f"{k} {a[k]} vs {b[k]}" for k in a if a[k] != b[k])


def model_from(path, tensors: dict, metadata: dict, expect: ModelConfig | None = None):
    """(params float32, cfg) from already loaded tensors/metadata; UserError when something does not fit."""
    if "model_config" not in metadata:
        raise UserError(f"checkpoint {path} holds no model config (metadata 'model_config')")
    try:
        cfg = ModelConfig.from_dict(metadata["model_config"])
    except UserError as exc:
        raise UserError(f"checkpoint {path}: {exc}") from None
    except TypeError as exc:
        raise UserError(f"checkpoint {path}: bad model config ({exc})") from None
    if expect is not None and cfg != expect:
        raise UserError(
            f"checkpoint {path} does not match the configured model "
            f"(checkpoint vs config: {config_mismatch(cfg, expect)})"
        )
    params = {}
    for name, shape in cfg.param_shapes().items():
        if name not in tensors:
            raise UserError(f"checkpoint {path} lacks parameter {name!r}")
        a = tensors[name]
        if tuple(a.shape) != shape:
            raise UserError(
                f"checkpoint {path}: parameter {name!r} has shape {tuple(a.shape)}, its model config wants {shape}"
            )
        params[name] = a.astype(np.float32, copy=False)
    return params, cfg


def load_model(path, expect: ModelConfig | None = None):
    """-> (params: NumPy float32, cfg, metadata) of a model file or a release folder (`model_file`).
    Move params to a GPU with xp.asarray."""
    path = model_file(path)
    tensors, metadata = load(path)
    params, cfg = model_from(path, tensors, metadata, expect)
    return params, cfg, metadata


# ---- release folders ---------------------------------------------------------------------------

SUMS = "SHA256SUMS"  # a release folder's list of its files' digests, in `sha256sum`'s format


def format_sums(digests: dict[str, str]) -> str:
    """`sha256sum`'s text for {file name: hex digest}, so `sha256sum -c SHA256SUMS` checks a release.

    >>> format_sums({"chat.bin": "ab" * 32})[:8], format_sums({"chat.bin": "ab" * 32})[64:]
    ('abababab', '  chat.bin\\n')
    """
    return "".join(f"{digest}  {name}\n" for name, digest in sorted(digests.items()))


def parse_sums(text: str, where: str) -> dict[str, str]:
    """{file name: hex digest} from `sha256sum` lines (text `  ` or binary ` *` mode); UserError naming
    `where` and the line when one is not such a line, or names a file outside the folder."""
    out = {}
    for n, line in enumerate(text.splitlines(), 1):
        digest, sep, name = line[:64], line[64:66], line[66:]
        if len(digest) != 64 or set(digest) - set("0123456789abcdef") or sep not in ("  ", " *") or not name:
            raise UserError(f"{where}:{n}: not a `sha256sum` line (64 hex digits, two spaces, a file name)")
        if name in (".", "..") or "/" in name or "\\" in name:
            raise UserError(f"{where}:{n}: {name!r} is not a file of this folder")
        out[name] = digest
    return out


def model_file(path) -> Path:
    """The model file that a `--ckpt` names: `path` itself, or in a release folder the one `.bin` file
    its SHA256SUMS lists, after checking that file's sha256 against the list (so a changed or swapped
    file is refused before anything reads it).

    >>> model_file("results/chat.bin")
    PosixPath('results/chat.bin')
    """
    path = Path(path)
    if not path.is_dir():
        return path  # a file, or what `load` will name as missing, a device, ...
    sums = path / SUMS
    if not sums.is_file():
        raise UserError(f"checkpoint {path} is a directory, not a model file or a release folder (no {SUMS} in it)")
    listed = parse_sums(read_text(sums, "checksum list", SMALL_JSON), str(sums))
    models = sorted(name for name in listed if name.endswith(".bin"))
    if len(models) != 1:
        raise UserError(f"release {path}: {SUMS} lists {len(models)} model files (.bin), not one")
    model = path / models[0]
    if file_sha256(model, "checkpoint", CHECKPOINT) != listed[models[0]]:
        raise UserError(
            f"release {path}: {models[0]} does not match its sha256 in {SUMS} (the file was changed "
            "or replaced after the release was written)"
        )
    return model
