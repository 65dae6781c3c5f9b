"""Reading the files a user names, bounded, with every error in one line naming the file.

Every stage reads its inputs through these functions, so whatever is wrong with a path the answer is
the same kind of line: a missing file, a directory, a device or FIFO that never ends (`/dev/zero`), a
symlink loop, a file far larger than any real one of its kind (a disk image named by mistake), bytes
that are not UTF-8, JSON that is broken, nested too deeply or holds a lone surrogate (`"\\ud800"`).
Nothing is read before its size is known to fit, and JSON lines are read one bounded line at a time.

    >>> size_text(64 << 20)
    '64 MiB'
    >>> parse_json('{"a": [1, 2]}', "x.json")
    {'a': [1, 2]}
    >>> parse_json('"\\\\ud800"', "x.json")
    Traceback (most recent call last):
    nanoeuler.files.JsonError: x.json: not valid JSON text (a lone surrogate U+D800 in a string)

Writing: `naming(path)` puts the path into an OSError that lacks one (a full disk seen by `write`).
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import json
import os
import stat
import zlib
from pathlib import Path
from typing import BinaryIO, Iterator

from nanoeuler.errors import UserError

MiB = 1 << 20
GiB = 1 << 30

# The most a file of each kind may hold: far above any real file, so that a wrong path is refused
# before it fills the memory rather than after.
SMALL_JSON = 64 * MiB  # tokenizer.json, shard manifest, metrics.json, HellaSwag results, samples.md
DATA_JSON = 1 * GiB  # a whole-file JSON data set held in memory (Alpaca's 22 MB alpaca_data.json)
DATA_JSONL = 1 * GiB  # JSON lines data (Alpaca, preference pairs, HellaSwag), decompressed
LINE = 16 * MiB  # one line of a JSON lines file
BOOK = 256 * MiB  # one plain-text book (the longest on Project Gutenberg are about 10 MB)
ARRAYS = 4 * GiB  # the reference log-probabilities (.npz)
CHECKPOINT = 256 * GiB  # a model file (read tensor by tensor against its header)


class JsonError(UserError):
    """Text that is not JSON we can use; `why` says what is wrong without saying where."""

    def __init__(self, where: str, why: str):
        super().__init__(f"{where}: {why}")
        self.why = why


def size_text(n: int) -> str:
    """Bytes in the largest binary unit that divides nicely: 1.5 GiB, 64 MiB, 300 bytes."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} bytes"


# ---- opening --------------------------------------------------------------------------------------


def open_input(path: str | os.PathLike, what: str, limit: int | None = None) -> BinaryIO:
    """`path` opened for binary reading after checking it is a regular file of at most `limit` bytes.

    `what` names the kind of file in the message ("tokenizer file", "Alpaca data"). The path is looked
    at before it is opened, so a device or FIFO is refused without being opened, and the open file is
    looked at again (it may have been swapped in between).
    """
    try:
        _check_regular(os.stat(path), path, what, limit)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # O_NONBLOCK: a FIFO never waits
    except OSError as exc:
        raise UserError(f"{what} {path} {_open_problem(exc)}") from None
    try:
        _check_regular(os.fstat(fd), path, what, limit)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _check_regular(info: os.stat_result, path, what: str, limit: int | None) -> None:
    kind = _not_regular(info.st_mode)
    if kind:
        raise UserError(f"{what} {path} is {kind}, not a regular file")
    if limit is not None and info.st_size > limit:
        raise UserError(
            f"{what} {path} is {size_text(info.st_size)}, more than the {size_text(limit)} read from such a file"
        )


def _open_problem(exc: OSError) -> str:
    """Why a path did not open, as the end of a sentence that starts with the path."""
    if exc.errno == errno.ENOENT:
        return "does not exist"
    if exc.errno == errno.ELOOP:
        return "is a symlink loop (too many levels of symbolic links)"
    if exc.errno == errno.ENOTDIR:
        return "does not exist (a part of its path is a file, not a directory)"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "cannot be read (permission denied)"
    return f"cannot be opened ({exc.strerror or exc})"


def _not_regular(mode: int) -> str:
    """'' for a regular file, else what it is instead."""
    if stat.S_ISREG(mode):
        return ""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a socket or other special file"


def check_input(path: str | os.PathLike, what: str, limit: int | None = None) -> Path:
    """`path` after the checks of `open_input`, for readers that open the file themselves (parquet, mmap)."""
    open_input(path, what, limit).close()
    return Path(path)


# ---- whole files -----------------------------------------------------------------------------------


def read_bytes(path: str | os.PathLike, what: str, limit: int, *, gunzip: bool = False) -> bytes:
    """The bytes of `path`, at most `limit` of them (after decompression when `gunzip` and it is gzip)."""
    chunks, seen = [], 0
    with _reader(path, what, limit, gunzip) as f:
        while chunk := f.read(MiB):  # in pieces: read(limit) would set aside `limit` bytes at once
            seen += len(chunk)
            if seen > limit:  # grew since it was checked, or decompressed past the limit
                raise UserError(f"{what} {path} holds more than the {size_text(limit)} read from such a file")
            chunks.append(chunk)
    return b"".join(chunks)


def read_text(path: str | os.PathLike, what: str, limit: int, *, gunzip: bool = False) -> str:
    """The UTF-8 text of `path` (see `read_bytes`); bytes that are not UTF-8 are named by offset."""
    data = read_bytes(path, what, limit, gunzip=gunzip)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{what} {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def read_json(path: str | os.PathLike, what: str, limit: int = SMALL_JSON, *, gunzip: bool = False):
    """The JSON value of a whole file (see `read_text` and `parse_json`)."""
    return parse_json(read_text(path, what, limit, gunzip=gunzip), f"{what} {path}")


def file_sha256(path: str | os.PathLike, what: str, limit: int) -> str:
    """The SHA-256 of a file, read in bounded pieces."""
    digest, seen = hashlib.sha256(), 0
    with open_input(path, what, limit) as f:
        while chunk := f.read(MiB):
            seen += len(chunk)
            if seen > limit:
                raise UserError(f"{what} {path} holds more than the {size_text(limit)} read from such a file")
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _reader(path, what: str, limit: int, gunzip: bool) -> Iterator[BinaryIO]:
    """The file opened by `open_input`, through a gzip decoder when asked and it starts like gzip.

    A compressed file is checked against `limit` after decompression by its reader, so its own size
    only has to fit the limit too.
    """
    with open_input(path, what, limit) as f:
        if gunzip and f.peek(2)[:2] == b"\x1f\x8b":
            with gzip.GzipFile(fileobj=f) as z, _gzip_errors(path, what):
                yield z
        else:
            yield f


@contextlib.contextmanager
def _gzip_errors(path, what: str) -> Iterator[None]:
    try:
        yield
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise UserError(f"{what} {path} is not readable: a truncated gzip file? ({exc})") from None


# ---- JSON ---------------------------------------------------------------------------------------


def parse_json(text: str | bytes, where: str):
    """The JSON value of `text`, or a JsonError naming `where` (a file, or `file:line`).

    Refused: invalid JSON, nesting too deep for the parser, and strings holding a lone surrogate
    (`"\\ud800"` is valid JSON syntax but no Unicode text: nothing could write it out again).
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JsonError(where, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise JsonError(where, f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise JsonError(where, "not readable JSON (nested too deeply)") from None
    surrogate = _lone_surrogate(value)
    if surrogate is not None:
        raise JsonError(where, f"not valid JSON text (a lone surrogate U+{surrogate:04X} in a string)")
    return value


def _lone_surrogate(value) -> int | None:
    """The first lone surrogate in any string or key of a parsed JSON value, else None.

    Walks with a stack, not recursion: the value may be as deep as the parser allowed.
    """
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            texts = (v,)
        elif isinstance(v, dict):
            texts = v.keys()
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
            continue
        else:
            continue
        for t in texts:
            try:
                t.encode("utf-8")
            except UnicodeEncodeError as exc:
                return ord(t[exc.start])
    return None


def lines(
    path: str | os.PathLike, what: str, *, limit: int = DATA_JSONL, line_limit: int = LINE, gunzip: bool = False
) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each line of a file, read one line at a time.

    A line longer than `line_limit` or a file (after decompression) over `limit` is an error naming it.
    """
    seen = 0
    with _reader(path, what, limit, gunzip) as f:
        for n, raw in enumerate(iter(lambda: f.readline(line_limit + 1), b""), 1):
            if len(raw) > line_limit:
                raise UserError(f"{path}:{n}: a line longer than {size_text(line_limit)} (is this {what}?)")
            seen += len(raw)
            if seen > limit:
                raise UserError(f"{what} {path} holds more than the {size_text(limit)} read from such a file")
            yield n, raw


def json_lines(path: str | os.PathLike, what: str, **bounds) -> Iterator[tuple[int, object]]:
    """(line number, JSON value) of each non-blank line of a JSON lines file (see `lines`, `parse_json`).

    >>> list(json_lines("pairs.jsonl", "preference pairs"))   # doctest: +SKIP
    [(1, {'prompt': ..., 'chosen': ..., 'rejected': ...}), ...]
    """
    for n, raw in lines(path, what, **bounds):
        if raw.strip():
            yield n, parse_json(raw, f"{path}:{n}")


# ---- writing ------------------------------------------------------------------------------------


def check_outputs(**outputs) -> None:
    """Refuse output files that name a directory, before a stage spends its time: option=path pairs.

    >>> check_outputs(out=".")
    Traceback (most recent call last):
    nanoeuler.errors.UserError: --out . is a directory; name a file to write
    """
    for option, path in outputs.items():
        if path is not None and Path(path).is_dir():
            raise UserError(f"--{option.replace('_', '-')} {path} is a directory; name a file to write")


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """Let an OSError that names no file (a full disk seen by `write`, NumPy's short write) name `path`.

    >>> with naming("out/x.npy"):
    ...     raise OSError("20000 requested and 10176 written")
    Traceback (most recent call last):
    OSError: [Errno None] 20000 requested and 10176 written: 'out/x.npy'
    """
    try:
        yield
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror or str(exc) or type(exc).__name__, str(path)) from exc
