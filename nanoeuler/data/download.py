"""The one downloader every data stage uses.

`fetch(source, dest)` puts the file named by `source` at `dest`:

- http(s) URLs are downloaded with `requests`: connect/read timeouts, retries with exponential
  backoff on 5xx/429 answers and on connection errors (a transfer cut mid-file is one), resume of
  the partial file `dest.part` with an HTTP Range request, a size check against Content-Length or
  Content-Range, an optional sha256 and expected size, a polite delay between requests to the same
  host, a tqdm progress bar, and an atomic rename when the file is complete.
- local paths and file:// URLs are copied (also atomically), so an offline config can point the
  same stages at files shipped in the repository.

A file that is already complete is not fetched again, as long as it is still what its source is.
Next to it, `dest.source` (JSON) records the source and the file's size, and for a local source the
source file's size and modification time, for an http(s) source the server's ETag/Last-Modified: a
config pointing at another source, an edited local source, or a cached file of another size is
fetched again. `check` (the stage's own validation) runs on every file handed out: a cached file that
fails it is fetched again once, and a fresh file that fails it is kept as `dest.rejected` and named
in the error.

Every network loop is bounded: at most `retries + 1` attempts that make no progress, at most
`MAX_RESUMES` more that do (a cut transfer resumes at once), and `max_time_s` seconds in all, whatever
the server does. A host name that does not resolve (no network, a typo) is retried once, then reported
as the cause; a stage never skips past it.

    >>> fetch("https://www.gutenberg.org/cache/epub/11/pg11.txt", "data/gutenberg/raw/11.txt")  # doctest: +SKIP
    True
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Callable

import requests
import urllib3
from tqdm import tqdm

from nanoeuler.data.common import info, is_remote, local_path
from nanoeuler.files import size_text
from nanoeuler.errors import UserError

USER_AGENT = "nanoeuler/0.1 (data pipeline; python-requests)"
CHUNK = 1 << 16
MAX_BACKOFF_S = 60.0
# Answers worth asking again: the server is busy or broken right now, not the request.
RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
MAX_RESUMES = 20  # attempts that made progress before failing; they retry at once and use no retry
NAME_RETRIES = 1  # a host name that does not resolve: one more try, then it is the cause

_last_request: dict[str, float] = {}  # host -> monotonic time of the last request to it
_lock = threading.Lock()


class _Transient(Exception):
    """A failure that a later attempt may not see (5xx, reset connection, transfer cut short)."""


class NetworkError(UserError):
    """The network itself is missing (a host name does not resolve): no stage skips past it."""


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
    max_time_s: float = 3600.0,
    session: requests.Session | None = None,
    check: Callable[[Path], object] | None = None,
    limit: int | None = None,
) -> bool:
    """Make `dest` a complete copy of `source`. Returns False when it already was (nothing fetched).

    `root` is the directory relative local paths are taken from. `retries` counts the attempts after
    the first that made no progress; `max_time_s` bounds the whole download. `check(path)` is the
    stage's validation (raises UserError): see the module docstring for what happens when it fails.
    `limit` is the largest local source the stage reads, refused before it is copied.
    Raises UserError naming the source when the file cannot be had or fails its checks.
    """
    dest = Path(dest)
    record = dest.with_name(dest.name + ".source")
    identity = {"source": source, **_source_identity(source, root)}
    if limit is not None and identity.get("source_size", 0) > limit:
        raise UserError(f"source file {local_path(source, root)} (from '{source}') is "
                        f"{size_text(identity['source_size'])}, more than the {size_text(limit)} this stage reads")
    if _cached(dest, record, identity):
        problem = _problem(check, dest)
        if problem is None:
            return False
        info(f"cached {dest} fails its check ({problem}); fetching {source} again")
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    record.unlink(missing_ok=True)  # from here on dest is not a valid cache entry until it is renamed in
    part = dest.with_name(dest.name + ".part")
    if is_remote(source):
        validators = _download(source, part, sha256=sha256, size=size, timeout=(connect_timeout_s, timeout_s),
                               retries=retries, backoff_s=backoff_s, delay_s=delay_s, max_time_s=max_time_s,
                               session=session)
        identity.update(validators)
    else:
        _copy(local_path(source, root), part, source)
        _verify(part, source, sha256=sha256, size=size)
    os.replace(part, dest)
    problem = _problem(check, dest)
    if problem is not None:  # not cached (no record): kept aside for a look, fetched again next time
        rejected = dest.with_name(dest.name + ".rejected")
        os.replace(dest, rejected)
        raise UserError(f"{problem} (fetched from {source}; kept as {rejected})")
    identity["size"] = dest.stat().st_size
    record.write_text(json.dumps(identity, sort_keys=True) + "\n", encoding="utf-8")
    return True


def fetch_options(section: dict) -> dict:
    """fetch's network keyword arguments from a download stage's config section."""
    keys = ("timeout_s", "retries", "delay_s", "max_time_s")
    return {k: section[k] for k in keys if k in section}


def _source_identity(source: str, root) -> dict:
    """What says that a local source is still the same file: its size and modification time."""
    if is_remote(source):
        return {}
    path = local_path(source, root)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise UserError(f"source file {path} does not exist (from '{source}')") from None
    except OSError as exc:
        raise UserError(f"cannot read source file {path}: {exc.strerror or exc}") from None
    if not path.is_file():
        raise UserError(f"source {path} is not a file (from '{source}')")
    return {"source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns}


def _cached(dest: Path, record: Path, identity: dict) -> bool:
    """True when `dest` is a complete file of this very source (same identity, same size)."""
    if not dest.is_file() or not record.is_file():
        return False
    try:
        text = record.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return False
    try:
        saved = json.loads(text)
    except json.JSONDecodeError:  # a record of an older version: just the source string
        return is_remote(identity["source"]) and text == identity["source"]
    if not isinstance(saved, dict) or saved.get("size") != dest.stat().st_size:
        return False
    return all(saved.get(k) == v for k, v in identity.items())


def _problem(check, path: Path) -> str | None:
    """The stage's objection to `path` (its UserError's message), or None when it passes."""
    if check is None:
        return None
    try:
        check(path)
    except UserError as exc:
        return str(exc)
    return None


def _copy(path: Path, part: Path, source: str) -> None:
    try:
        shutil.copyfile(path, part)
    except OSError as exc:
        part.unlink(missing_ok=True)
        raise UserError(f"cannot copy {path} (from '{source}') to {part}: {exc.strerror or exc}") from None


def _download(url, part: Path, *, sha256, size, timeout, retries, backoff_s, delay_s, max_time_s,
              session) -> dict:
    """Download `url` into `part` within the attempt and time bounds. Returns the server's validators."""
    own = session is None
    session = session or requests.Session()
    deadline = time.monotonic() + max_time_s
    failures = resumes = attempts = 0
    validators: dict = {}
    try:
        while True:
            before = part.stat().st_size if part.exists() else 0
            attempts += 1
            try:
                total = _attempt(session, url, part, timeout, delay_s, deadline, validators)
                break
            except (_Transient, requests.ConnectionError, requests.Timeout,
                    requests.exceptions.ChunkedEncodingError, urllib3.exceptions.HTTPError) as exc:
                now = part.stat().st_size if part.exists() else 0
                host = _unresolved_host(exc)
                if host is not None and failures >= min(NAME_RETRIES, retries):
                    raise NetworkError(f"download of {url}: could not resolve host {host}: no network, "
                                       "or a mistyped host name") from None
                if now > before and resumes < MAX_RESUMES:
                    resumes += 1  # a transfer that was cut after making progress resumes at once
                    wait = 0.0
                else:
                    failures += 1
                    wait = min(MAX_BACKOFF_S, backoff_s * 2 ** (failures - 1))
                if failures > retries:
                    raise UserError(f"download of {url} failed after {attempts} attempts: "
                                    f"{_reason(exc)}") from None
                if time.monotonic() + wait > deadline:
                    raise UserError(f"download of {url} gave up after {attempts} attempts: it would take more "
                                    f"than max_time_s = {max_time_s:g} s (last: {_reason(exc)})") from None
                info(f"retrying {url} in {wait:.1f}s ({_reason(exc)}; {now} bytes kept)")
                if wait:
                    time.sleep(wait)
            except requests.exceptions.TooManyRedirects:
                raise UserError(f"download of {url}: too many redirects (a redirect loop?)") from None
            except requests.RequestException as exc:  # a bad URL, a redirect to one, ...
                raise UserError(f"download of {url}: {_reason(exc)}") from None
    finally:
        if own:
            session.close()
    got = part.stat().st_size
    if total is not None and got != total:
        part.unlink()
        raise UserError(f"download of {url}: got {got} bytes, the server announced {total}")
    _verify(part, url, sha256=sha256, size=size)
    return validators


def _causes(exc: BaseException):
    """`exc` and every exception inside it (causes, contexts, urllib3's `reason`, wrapped args)."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop(0)
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__, getattr(e, "reason", None), *e.args]


def _unresolved_host(exc: BaseException) -> str | None:
    """'host (why)' when `exc` comes from a failed name lookup, else None."""
    for e in _causes(exc):
        if isinstance(e, socket.gaierror) or type(e).__name__ == "NameResolutionError":
            m = re.search(r"host='([^']+)'", str(exc))
            why = next((c.strerror for c in _causes(e) if isinstance(c, socket.gaierror) and c.strerror), None)
            return (m.group(1) if m else "?") + (f" ({why})" if why else "")
    return None


def _attempt(session: requests.Session, url: str, part: Path, timeout, delay_s: float, deadline: float,
             validators: dict) -> int | None:
    """One GET, resuming `part` if it holds bytes. Returns the full size, if the server said it.

    Fills `validators` with the answer's ETag/Last-Modified; stops with UserError past `deadline`."""
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
            _refuse_html(url, r)
            validators.update({k.lower().replace("-", "_"): r.headers[k] for k in ("ETag", "Last-Modified")
                               if k in r.headers})
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
                    if time.monotonic() > deadline:  # a server trickling bytes never times out a read
                        raise UserError(f"download of {url} is taking longer than its max_time_s "
                                        f"({f.tell():,} bytes so far); stopped")
    except requests.exceptions.InvalidURL as exc:
        raise UserError(f"{url} is not a valid URL: {exc}") from None
    got = part.stat().st_size if part.exists() else 0
    if total is not None and got < total:
        raise _Transient(f"connection closed after {got} of {total} bytes")
    return total


def _refuse_html(url: str, r: requests.Response) -> None:
    """An HTML page where a data file was asked for is an error page sent with status 200."""
    kind = r.headers.get("Content-Type", "").split(";")[0].strip().lower()
    path = urllib.parse.urlsplit(r.url or url).path.lower()
    if kind in ("text/html", "application/xhtml+xml") and not path.endswith((".html", ".htm")):
        raise UserError(f"{url} answered with an HTML page (Content-Type {kind}), not the file: "
                        "an error or login page?")


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
        why = [e.strerror for e in _causes(exc) if isinstance(e, OSError) and e.strerror]
        return f"connection error ({why[0] if why else type(exc).__name__})"
    return text.splitlines()[0][:200]
