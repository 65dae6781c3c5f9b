"""A training run directory: rotating checkpoints `ckpt_{step:08d}.bin` and `metrics.jsonl`.

The checkpoint file format is `nanoeuler.checkpoint` (atomic writes, checksums); this module only
names, finds, rotates and sets aside files. A checkpoint that fails to load is renamed to
`*.bin.corrupt` so that it is never picked again; checkpoints of a finished or abandoned run with
other settings, another model config or another tokenizer move to `previous/`, replacing the checkpoints
and metrics there (nothing else: a run directory may be a folder that holds other things).
One process writes a run directory at a time: its writer holds `.lock` inside it (`writer_lock`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shlex
import socket
import sys
import time
from pathlib import Path

from nanoeuler.errors import UserError
from nanoeuler.files import JsonError, lines, naming, parse_json

_CKPT = re.compile(r"^ckpt_(\d{8})\.bin$")
LOCK_NAME = ".lock"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"ckpt_{step:08d}.bin"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint in the run dir, newest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for entry in run_dir.iterdir():
        m = _CKPT.match(entry.name)
        if m and entry.is_file():
            found.append((int(m.group(1)), entry))
    return sorted(found, reverse=True)


def remove_stale_temporaries(run_dir: Path) -> None:
    """Delete half-written checkpoint temporaries left by a killed writer (never under a real name)."""
    run_dir = Path(run_dir)
    if run_dir.is_dir():
        for entry in run_dir.glob(".ckpt_*.bin.tmp*"):
            entry.unlink(missing_ok=True)


def rotate(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints."""
    for _, path in list_checkpoints(run_dir)[max(1, keep) :]:
        path.unlink(missing_ok=True)


def set_aside_corrupt(path: Path) -> Path:
    target = path.with_name(path.name + ".corrupt")
    os.replace(path, target)
    return target


def set_aside_all(run_dir: Path) -> Path:
    """Move every checkpoint and the metrics file into run_dir/previous/, replacing the ones there.

    Only files of those names are replaced: anything else in previous/ (or a previous/ that is not a
    directory) is the user's, and stays as it is.
    """
    run_dir = Path(run_dir)
    prev = run_dir / "previous"
    if prev.is_symlink() or (prev.exists() and not prev.is_dir()):
        raise UserError(
            f"{prev} is not a directory: the run's old checkpoints cannot be set aside there; "
            "move it away or name another --run-dir"
        )
    prev.mkdir(parents=True, exist_ok=True)
    for _, path in list_checkpoints(prev):
        path.unlink()
    for _, path in list_checkpoints(run_dir):
        os.replace(path, prev / path.name)
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        os.replace(metrics, prev / metrics.name)
    return prev


def model_change(meta: dict, model_config: dict, tokenizer_sha256: str) -> str:
    """What makes a checkpoint's model differ from the configured one ('' when it is the same).

    Such a checkpoint belongs to another run: its files are set aside (`set_aside_all`) rather than
    resumed, so a changed model key simply starts a new run.

    >>> model_change({"model_config": {"dim": 64}, "tokenizer_sha256": "ab"}, {"dim": 128}, "ab")
    'model dim 64 -> 128'
    """
    old = meta.get("model_config") or {}
    parts = [
        f"model {k} {old.get(k)!r} -> {model_config.get(k)!r}"
        for k in sorted(set(old) | set(model_config))
        if old.get(k) != model_config.get(k)
    ]
    if meta.get("tokenizer_sha256") != tokenizer_sha256:
        parts.append(f"tokenizer sha256 {str(meta.get('tokenizer_sha256'))[:12]} -> {tokenizer_sha256[:12]}")
    return ", ".join(parts)


@contextlib.contextmanager
def writer_lock(run_dir: Path, stage: str):
    """Hold `run_dir` for this process; a second writer is refused with one line naming the holder.

    An flock on `run_dir/.lock`: the kernel drops it when the holder exits or is killed, so a killed
    run resumes at once and no stale lock is ever cleaned up by hand. The file itself stays.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(
                f"run directory {run_dir} is in use by another writer ({_holder(fd)}); wait for it to finish or stop it"
            ) from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            warn(stage, f"cannot lock {run_dir} ({exc.strerror}): a second writer there would not be stopped")
        else:
            _write_holder(fd)
        yield
    finally:
        os.close(fd)


def _write_holder(fd: int) -> None:
    """Who holds the lock, for the message a second writer gets."""
    command = shlex.join(["nanoeuler", *sys.argv[1:]]).replace("\n", "\\n")  # the refusal stays one line
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": command if len(command) <= 200 else command[:197] + "...",
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode("utf-8"), 0)


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 1 << 16, 0).decode("utf-8"))
        return f"pid {info['pid']} on {info['host']}, started {info['started']}: {info['command']}"
    except (ValueError, KeyError, TypeError):  # the holder has not written its name yet
        return "a process that is just starting"


def warn(stage: str, message: str) -> None:
    print(f"nanoeuler {stage}: warning: {message}", file=sys.stderr, flush=True)


class MetricsLog:
    """Append-only JSONL of logged steps; on resume, lines after the checkpoint's step are dropped."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def read(self) -> list[dict]:
        return read_jsonl(self.path)

    def truncate_after(self, step: int) -> None:
        """Keep only records with step <= `step` (a resumed run re-logs the rest); 0 clears the log."""
        keep = [r for r in self.read() if r.get("step", 0) <= step] if step > 0 else []
        tmp = self.path.with_name(self.path.name + ".tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with naming(self.path), open(tmp, "w", encoding="utf-8") as f:
            for r in keep:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.path)

    def append(self, record: dict) -> None:
        with naming(self.path), open(self.path, "a", encoding="utf-8") as f:  # a full disk names the log
            f.write(json.dumps(record) + "\n")
            f.flush()


def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSONL file; a torn or garbled line (a killed writer, a bad disk) is skipped.

    Read by `nanoeuler.files.lines`: a line longer than any record, or a file that is not one (a
    directory, a device), is an error naming it.
    """
    path = Path(path)
    if not os.path.lexists(path):
        return []
    out = []
    for n, line in lines(path, "metrics log"):
        try:
            rec = parse_json(line, f"{path}:{n}")
        except JsonError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out
