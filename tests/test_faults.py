"""The real downloader against a misbehaving loopback server (tests/fault_server.py).

Every fault ends in one of three ways, and each case below says which: the file arrives intact
(a fault worth retrying or resuming), one clear UserError naming the URL and no output (a fault no
retry can fix), or a UserError within the attempt and time bounds (a server that never behaves).
The cache cases check that a cached file is reused only while it is still what its source is.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time

import pytest

from fault_server import FaultServer
from nanoeuler.data import alpaca, download, gutenberg
from nanoeuler.data.download import MAX_RESUMES, NetworkError, fetch
from nanoeuler.errors import UserError

PAYLOAD = bytes(range(256)) * 64  # 16 KiB
FAST = {"backoff_s": 0.01, "retries": 2, "timeout_s": 0.3, "connect_timeout_s": 0.3}
RECORDS = json.dumps([{"instruction": f"Say {i}.", "input": "", "output": f"{i}."} for i in range(20)]).encode()


@pytest.fixture
def srv():
    with FaultServer() as s:
        s.files["/f.bin"] = PAYLOAD
        s.files["/a.json"] = RECORDS
        yield s


@pytest.fixture(autouse=True)
def _fresh_hosts(monkeypatch):
    monkeypatch.setattr(download, "_last_request", {})  # no polite delay carried between tests


# ---- faults a retry or a resume fixes -------------------------------------------------------------

RECOVERABLE = {
    "5xx and 429 answers": ["500", "502", "503", "504", "429", "408"],
    "a body cut in half, resumed with Range": ["cut", "cut", "cut"],
    "a cut body from a server without Range": ["norange-cut", "norange-cut"],
    "announcing one byte more than sent": ["long-length"],
    "answering after the read timeout": ["slow"],
    "headers, then silence": ["hang"],
    "a redirect": ["redirect"],
    "a slow trickle that finishes": ["trickle"],
    "a bit of everything": ["503", "cut", "hang", "redirect", "norange-cut", "500"],
}


@pytest.mark.parametrize("faults", list(RECOVERABLE.values()), ids=list(RECOVERABLE))
def test_recoverable_faults_end_with_the_intact_file(srv, tmp_path, faults):
    srv.timing(slow_s=1.0, trickle_s=0.0005)
    srv.files["/small.bin"] = PAYLOAD[:300]
    path = "/small.bin" if faults == ["trickle"] else "/f.bin"
    srv.plan(path, *faults)
    dest = tmp_path / "f.bin"
    assert fetch(srv.url + path, dest, **{**FAST, "retries": len(faults)}) is True
    assert dest.read_bytes() == srv.files[path]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin", "f.bin.source"]  # no .part left


def test_416_for_a_stale_part_starts_over(srv, tmp_path):
    dest = tmp_path / "f.bin"
    dest.with_name("f.bin.part").write_bytes(b"x" * (len(PAYLOAD) + 10))  # longer than the file: not ours
    fetch(srv.url + "/f.bin", dest, **FAST)
    assert dest.read_bytes() == PAYLOAD


def test_416_for_a_complete_part_keeps_it(srv, tmp_path):
    dest = tmp_path / "f.bin"
    dest.with_name("f.bin.part").write_bytes(PAYLOAD)
    fetch(srv.url + "/f.bin", dest, **FAST)
    assert dest.read_bytes() == PAYLOAD and srv.requests == [("/f.bin", f"bytes={len(PAYLOAD)}-")]


# ---- faults no retry fixes: one request, one line, no output ----------------------------------------

PERMANENT = {
    "404": "not found",
    "410": "not found",
    "403": "HTTP 403",
    "401": "HTTP 401",
    "html200": "HTML page",
    "416": "HTTP 416",
}


@pytest.mark.parametrize("fault,message", list(PERMANENT.items()), ids=list(PERMANENT))
def test_permanent_faults_fail_at_once_naming_the_url(srv, tmp_path, fault, message):
    srv.always("/f.bin", fault)
    dest = tmp_path / "f.bin"
    with pytest.raises(UserError, match=message) as err:
        fetch(srv.url + "/f.bin", dest, **FAST)
    assert srv.url + "/f.bin" in str(err.value) and "\n" not in str(err.value)
    assert len(srv.requests) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_redirect_loop_is_one_line(srv, tmp_path):
    srv.always("/f.bin", "loop")
    with pytest.raises(UserError, match="redirect"):
        fetch(srv.url + "/f.bin", tmp_path / "f.bin", **FAST)


def test_a_short_content_length_is_caught_by_the_checksum(srv, tmp_path):
    srv.always("/f.bin", "short-length")  # consistent lies: only a checksum or a content check sees them
    with pytest.raises(UserError, match="sha256"):
        fetch(srv.url + "/f.bin", tmp_path / "f.bin", sha256=hashlib.sha256(PAYLOAD).hexdigest(), **FAST)
    assert not (tmp_path / "f.bin").exists()


# ---- servers that never behave: bounded in attempts and in time ------------------------------------


def test_5xx_forever_stops_after_the_retries(srv, tmp_path):
    srv.always("/f.bin", "503")
    with pytest.raises(UserError, match="failed after 3 attempts: HTTP 503"):
        fetch(srv.url + "/f.bin", tmp_path / "f.bin", **FAST)
    assert len(srv.requests) == 3


def test_progress_forever_is_bounded(srv, tmp_path):
    """One byte per answer is progress every time; it used to reset the retry count for ever."""
    srv.always("/f.bin", "cut1")
    with pytest.raises(UserError, match="failed after"):
        fetch(srv.url + "/f.bin", tmp_path / "f.bin", **FAST)
    assert len(srv.requests) == MAX_RESUMES + FAST["retries"] + 1
    assert (tmp_path / "f.bin.part").stat().st_size == len(srv.requests)  # kept for a later resume


def test_cut_without_range_forever_is_bounded(srv, tmp_path):
    srv.always("/f.bin", "norange-cut")
    with pytest.raises(UserError, match="failed after"):
        fetch(srv.url + "/f.bin", tmp_path / "f.bin", **FAST)
    assert len(srv.requests) <= FAST["retries"] + 2


def test_hung_answers_forever_are_bounded(srv, tmp_path):
    srv.always("/f.bin", "hang")
    t0 = time.monotonic()
    with pytest.raises(UserError, match="timed out"):
        fetch(srv.url + "/f.bin", tmp_path / "f.bin", **FAST)
    assert len(srv.requests) == 3 and time.monotonic() - t0 < 5


def test_a_trickle_that_never_ends_stops_at_max_time(srv, tmp_path):
    srv.timing(trickle_s=0.01)  # 16 KiB at 100 bytes/s: never a read timeout, never done
    srv.always("/f.bin", "trickle")
    t0 = time.monotonic()
    with pytest.raises(UserError, match="max_time_s"):
        fetch(srv.url + "/f.bin", tmp_path / "f.bin", max_time_s=0.5, **FAST)
    assert time.monotonic() - t0 < 3


def test_backoff_that_would_pass_max_time_gives_up_early(srv, tmp_path, monkeypatch):
    class Clock:  # the downloader's clock; sleeping moves it on at once
        now = 0.0
        monotonic = staticmethod(lambda: Clock.now)

        @staticmethod
        def sleep(s):
            Clock.now += s

    monkeypatch.setattr(download, "time", Clock)
    srv.always("/f.bin", "500")
    with pytest.raises(UserError, match="max_time_s = 5 s"):
        fetch(srv.url + "/f.bin", tmp_path / "f.bin", backoff_s=2.0, retries=10, max_time_s=5)
    assert Clock.now == 2.0 and len(srv.requests) == 2  # waited 2 s; 4 more would pass the 5 s


# ---- no network: the cause, quickly ------------------------------------------------------------------


@pytest.fixture
def offline(monkeypatch):
    """Name lookups of *.invalid hosts fail as they do without DNS; counts the lookups."""
    calls = []
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kw):
        if str(host).endswith(".invalid"):
            calls.append(host)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return calls


def test_an_unresolvable_host_is_tried_twice_and_named(offline, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(
        NetworkError,
        match=r"could not resolve host offline\.invalid "
        r"\(Temporary failure in name resolution\)",
    ):
        fetch("http://offline.invalid/a.json", tmp_path / "a.json", backoff_s=0.01, retries=8)
    assert len(offline) == 2 and time.monotonic() - t0 < 2


def test_skip_bad_does_not_skip_past_a_missing_network(offline, tmp_path):
    section = {
        "ids": [1, 2, 3],
        "url_template": "http://offline.invalid/{id}.txt",
        "skip_bad": True,
        "delay_s": 0.0,
        "timeout_s": 1.0,
        "retries": 5,
    }
    with pytest.raises(NetworkError):
        gutenberg.build(section, tmp_path / "raw", tmp_path / "books.parquet")
    assert set(offline) == {"offline.invalid"} and len(offline) == 2  # the first book only


def test_the_cli_ends_with_the_cause(offline, tmp_path, capsys):
    from nanoeuler.cli import main

    params = json.dumps({"alpaca": {"url": "http://offline.invalid/alpaca_data.json", "retries": 8}})
    assert (
        main(["alpaca", "--params", params, "--raw-dir", str(tmp_path / "raw"), "--out", str(tmp_path / "a.jsonl")])
        == 1
    )
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("nanoeuler alpaca: error: ") and "could not resolve host offline.invalid" in last
    assert not (tmp_path / "a.jsonl").exists()


# ---- the cache: reused only while it is what its source is --------------------------------------------


def test_an_error_page_is_not_cached_and_is_named(srv, tmp_path):
    srv.plan("/a.json", "text200")  # status 200, text/plain, an HTML body: only the content check sees it
    dest = tmp_path / "raw" / "alpaca_data.json"
    with pytest.raises(UserError, match=r"not valid JSON.*kept as .*alpaca_data\.json\.rejected"):
        fetch(srv.url + "/a.json", dest, check=alpaca.load_records, **FAST)
    assert not dest.exists() and dest.with_name("alpaca_data.json.rejected").exists()
    assert fetch(srv.url + "/a.json", dest, check=alpaca.load_records, **FAST) is True  # the next run
    assert dest.read_bytes() == RECORDS


def test_a_cached_file_that_fails_its_check_is_fetched_again_once(srv, tmp_path):
    dest = tmp_path / "alpaca_data.json"
    fetch(srv.url + "/a.json", dest, check=alpaca.load_records, **FAST)
    dest.write_bytes(b"{" + RECORDS[1:])  # same size, no longer valid JSON
    assert fetch(srv.url + "/a.json", dest, check=alpaca.load_records, **FAST) is True
    assert dest.read_bytes() == RECORDS and len(srv.requests) == 2

    dest.write_bytes(b"{" + RECORDS[1:])
    srv.always("/a.json", "text200")  # the server now only has a bad body: one fetch, then the error
    with pytest.raises(UserError, match="rejected"):
        fetch(srv.url + "/a.json", dest, check=alpaca.load_records, **FAST)
    assert len(srv.requests) == 3


def test_a_cached_file_of_another_size_is_fetched_again(srv, tmp_path):
    dest = tmp_path / "f.bin"
    fetch(srv.url + "/f.bin", dest, **FAST)
    dest.write_bytes(PAYLOAD[:100])  # cut short by hand, say
    assert fetch(srv.url + "/f.bin", dest, **FAST) is True and dest.read_bytes() == PAYLOAD
    assert fetch(srv.url + "/f.bin", dest, **FAST) is False and len(srv.requests) == 2


def test_an_edited_local_source_is_copied_again(tmp_path):
    src = tmp_path / "alpaca_data.json"
    src.write_bytes(RECORDS)
    dest = tmp_path / "raw" / "alpaca_data.json"
    assert fetch(str(src), dest) is True
    assert fetch(str(src), dest) is False
    edited = RECORDS.replace(b"Say 1.", b"Say 9.")  # same size
    src.write_bytes(edited)
    st = src.stat()
    import os

    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert fetch(str(src), dest) is True and dest.read_bytes() == edited


def test_server_validators_are_recorded(srv, tmp_path):
    dest = tmp_path / "f.bin"
    fetch(srv.url + "/f.bin", dest, **FAST)
    record = json.loads(dest.with_name("f.bin.source").read_text())
    assert record["source"] == srv.url + "/f.bin" and record["size"] == len(PAYLOAD)


def test_a_record_of_an_older_version_is_still_honoured(srv, tmp_path):
    dest = tmp_path / "f.bin"
    dest.write_bytes(PAYLOAD)
    dest.with_name("f.bin.source").write_text(srv.url + "/f.bin\n")
    assert fetch(srv.url + "/f.bin", dest, **FAST) is False and srv.requests == []
