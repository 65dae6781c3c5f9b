"""The one downloader every data stage uses.

`fetch(source, dest)` puts the file named by `source` at `dest`:

- http(s) URLs are downloaded with `requests`: connect/read timeouts, retries with exponential
  backoff on 5xx/429 answers and on connection errors (a transfer cut mid-file is one), resume of
  the partial file `dest.part` with an HTTP Range request, a size check against Content-Length or
  Content-Range, an optional sha256 and expected size, a polite delay between requests to the same
  host, a tqdm progress bar, and an atomic rename when the file is complete.
- local paths and file:// URLs are copied (also atomically), so an offline config can point the
  same stages at files shipped in the repository.

A file that is already complete is not fetched again. Next to it, `dest.source` records where it
came from, so pointing a config at another source fetches the new file instead of reusing a stale one.

    >>> fetch("https://www.gutenberg.org/cache/epub/11/pg11.txt", "data/gutenberg/raw/11.txt")  # doctest: +SKIP
    True
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import requests
import urllib3
from tqdm import tqdm

from nanoeuler.data.common import info, is_remote, local_path
from nanoeuler.errors import UserError

USER_AGENT = "nanoeuler/0.1 (data pipeline; python-requests)"
CHUNK = 1 << 16
MAX_BACKOFF_S = 60.0
# Answers worth asking again: the server is busy or broken right now, not the request.
RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}

_last_request: dict[str, float] = {}  # host -> monotonic time of the last request to it
_lock = threading.Lock()


class _Transient(Exception):
    """A failure that a later attempt may not see (5xx, reset connection, transfer cut short)."""


def fetch(
    source: str,
    dest: str | os.PathLike,
    *,
    root: str | os.PathLike | None = None,
    sha256: str | None = None,
    size: int | None = None,
    timeout_s: float = 60.0,
    connect_timeout_s: float = 10.0,
    retries: int = 5,
    backoff_s: float = 1.0,
    delay_s: float = 0.0,
    session: requests.Session | None = None,
) -> bool:
    """Make `dest` a complete copy of `source`. Returns False when it already was (nothing fetched).

    `root` is the directory relative local paths are taken from. `retries` counts the attempts
    after the first; an attempt that made progress before failing does not use one up.
    Raises UserError naming the source when the file cannot be had or fails its checks.
    """
    dest = Path(dest)
    record = dest.with_name(dest.name + ".source")
    if dest.exists() and (not record.exists() or record.read_text(encoding="utf-8").strip() == source):
        return False  # complete (it was renamed into place), and from this source
    dest.parent.mkdir(parents=True, exist_ok=True)
    if record.exists():
        record.unlink()  # dest holds another source's file: fetch again
    part = dest.with_name(dest.name + ".part")
    if is_remote(source):
        _download(source, part, sha256=sha256, size=size, timeout=(connect_timeout_s, timeout_s),
                  retries=retries, backoff_s=backoff_s, delay_s=delay_s, session=session)
    else:
        path = local_path(source, root)
        if not path.is_file():
            raise UserError(f"source file {path} does not exist (from '{source}')")
        shutil.copyfile(path, part)
        _verify(part, source, sha256=sha256, size=size)
    os.replace(part, dest)
    record.write_text(source + "\n", encoding="utf-8")
    return True


def _download(url, part: Path, *, sha256, size, timeout, retries, backoff_s, delay_s, session) -> None:
    own = session is None
    session = session or requests.Session()
    failures = 0
    try:
        while True:
            before = part.stat().st_size if part.exists() else 0
            try:
                total = _attempt(session, url, part, timeout, delay_s)
                break
            except (_Transient, requests.ConnectionError, requests.Timeout,
                    requests.exceptions.ChunkedEncodingError, urllib3.exceptions.HTTPError) as exc:
                now = part.stat().st_size if part.exists() else 0
                failures = 0 if now > before else failures + 1  # progress resets the count
                if failures > retries:
                    raise UserError(f"download of {url} failed after {retries + 1} attempts: "
                                    f"{_reason(exc)}") from None
                # a transfer that was cut after making progress resumes at once
                wait = 0.0 if failures == 0 else min(MAX_BACKOFF_S, backoff_s * 2 ** (failures - 1))
                info(f"retrying {url} in {wait:.1f}s ({_reason(exc)}; {now} bytes kept)")
                if wait:
                    time.sleep(wait)
    finally:
        if own:
            session.close()
    got = part.stat().st_size
    if total is not None and got != total:
        part.unlink()
        raise UserError(f"download of {url}: got {got} bytes, the server announced {total}")
    _verify(part, url, sha256=sha256, size=size)


def _attempt(session: requests.Session, url: str, part: Path, timeout, delay_s: float) -> int | None:
    """One GET, resuming `part` if it holds bytes. Returns the full size, if the server said it."""
    offset = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    _polite_wait(url, delay_s)
    try:
        with session.get(url, headers=headers, stream=True, timeout=timeout) as r:
            code = r.status_code
            if code == 416 and offset:  # nothing after `offset`: complete already, or the file changed
                total = _range_total(r.headers.get("Content-Range", ""))
                if total == offset:
                    return total
                part.unlink()
                raise _Transient(f"HTTP 416 for a resume at byte {offset}; starting over")
            if code in (404, 410):
                raise UserError(f"{url} not found (HTTP {code})")
            if code in RETRY_STATUS or code >= 500:
                raise _Transient(f"HTTP {code} {r.reason}")
            if code >= 400:
                raise UserError(f"{url}: HTTP {code} {r.reason}")
            encoded = r.headers.get("Content-Encoding", "identity").lower() not in ("", "identity")
            if code == 206:
                start, total = _content_range(r.headers.get("Content-Range", ""))
                if start != offset:
                    part.unlink()
                    raise _Transient(f"server resumed at byte {start}, not {offset}; starting over")
                mode = "ab"
            else:  # 200: the whole file, whatever we asked for
                offset, mode = 0, "wb"
                length = r.headers.get("Content-Length")
                total = int(length) if length and length.isdigit() and not encoded else None
            if encoded:
                total = None  # the announced length counts compressed bytes
            name = Path(urllib.parse.urlsplit(url).path).name or url
            with open(part, mode) as f, tqdm(total=total, initial=offset, unit="B", unit_scale=True,
                                            unit_divisor=1024, desc=name, file=sys.stderr,
                                            disable=None, leave=False, mininterval=1.0) as bar:
                for chunk in _chunks(r, decode=encoded):
                    f.write(chunk)
                    bar.update(len(chunk))
    except requests.exceptions.InvalidURL as exc:
        raise UserError(f"{url} is not a valid URL: {exc}") from None
    got = part.stat().st_size if part.exists() else 0
    if total is not None and got < total:
        raise _Transient(f"connection closed after {got} of {total} bytes")
    return total


def _chunks(r: requests.Response, decode: bool):
    """The body as it arrives. `read1` hands over every byte received before a connection drops
    (a plain `read(n)` would discard the last partial block), so a resume loses nothing."""
    if not hasattr(r.raw, "read1"):  # urllib3 < 2
        yield from r.iter_content(CHUNK)
        return
    while True:
        chunk = r.raw.read1(CHUNK, decode_content=decode)
        if not chunk:
            return
        yield chunk


def _polite_wait(url: str, delay_s: float) -> None:
    host = urllib.parse.urlsplit(url).netloc
    with _lock:
        last = _last_request.get(host)
        now = time.monotonic()
        if last is not None and delay_s > 0 and now - last < delay_s:
            time.sleep(delay_s - (now - last))
        _last_request[host] = time.monotonic()


_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


def _content_range(value: str) -> tuple[int, int | None]:
    m = _RANGE.match(value.strip())
    if not m:
        raise _Transient(f"206 answer with a bad Content-Range {value!r}")
    total = None if m.group(3) == "*" else int(m.group(3))
    return int(m.group(1)), total


def _range_total(value: str) -> int | None:
    m = re.match(r"bytes\s+\*/(\d+)", value.strip())
    return int(m.group(1)) if m else None


def _verify(path: Path, source: str, *, sha256: str | None, size: int | None) -> None:
    """Expected size and checksum, when the config gives them; a bad file is removed."""
    got = path.stat().st_size
    if size is not None and got != size:
        path.unlink()
        raise UserError(f"{source}: got {got} bytes, expected {size}")
    if sha256:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() != sha256.lower():
            path.unlink()
            raise UserError(f"{source}: sha256 is {h.hexdigest()}, expected {sha256.lower()}")


def _reason(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, requests.Timeout):
        return f"timed out ({type(exc).__name__})"
    if isinstance(exc, requests.ConnectionError) and not isinstance(exc, requests.exceptions.ChunkedEncodingError):
        return f"connection error ({type(exc).__name__})"
    return text.splitlines()[0][:200]
