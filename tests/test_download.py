"""The downloader against a loopback HTTP server: success, resume, 404, retries, size and checksum checks.

The server serves files in two layouts, like the real sources: Gutenberg's plain-text cache
(/cache/epub/{id}/pg{id}.txt) and the Hugging Face hub's resolve URLs
(/datasets/{org}/{name}/resolve/main/...). Each path can be given a plan: a list of misbehaviours
for its next requests ("cut" = send half the body and hang up, "500", "slow", "norange").
"""

from __future__ import annotations

import hashlib
import json
import http.server
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanoeuler.data import download, fineweb, gutenberg
from nanoeuler.data.download import fetch
from nanoeuler.errors import UserError

BOOK = (
    "\ufeffThe Project Gutenberg eBook of Test Book\r\n\r\nTitle: Test Book\r\n\r\n"
    "*** START OF THE PROJECT GUTENBERG EBOOK TEST BOOK ***\r\n\r\n"
    + "A line of the book that is long enough to matter.\r\n" * 400
    + "\r\n*** END OF THE PROJECT GUTENBERG EBOOK TEST BOOK ***\r\nlicense text\r\n"
).encode("utf-8")
HUB = "/datasets/HuggingFaceFW/fineweb-edu/resolve/main/sample/10BT"


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's naming)
        srv = self.server
        srv.requests.append((self.path, self.headers.get("Range")))
        plan = srv.plans.get(self.path) or []
        action = plan.pop(0) if plan else "ok"
        if action == "slow":
            time.sleep(1.0)
            action = "ok"
        if action == "500":
            self._plain(500, b"try later")
            return
        data = srv.files.get(self.path)
        if data is None:
            self._plain(404, b"no such file")
            return
        start = 0
        rng = self.headers.get("Range")
        if rng and action != "norange":
            start = int(rng.split("=")[1].split("-")[0])
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if action == "cut":
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)

    def _plain(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # keep the test output quiet
        pass


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.files, srv.plans, srv.requests = {}, {}, []
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(autouse=True)
def _fresh_hosts(monkeypatch):
    # Every test starts with no remembered request times, so no polite delay leaks between tests.
    monkeypatch.setattr(download, "_last_request", {})


FAST = {"backoff_s": 0.01, "retries": 3}


def test_download_success_and_no_refetch(server, tmp_path):
    server.files["/cache/epub/11/pg11.txt"] = BOOK
    dest = tmp_path / "raw" / "11.txt"
    assert fetch(server.url + "/cache/epub/11/pg11.txt", dest, **FAST) is True
    assert dest.read_bytes() == BOOK
    assert not dest.with_name("11.txt.part").exists()
    assert json.loads(dest.with_name("11.txt.source").read_text())["source"] == server.url + "/cache/epub/11/pg11.txt"
    assert fetch(server.url + "/cache/epub/11/pg11.txt", dest, **FAST) is False
    assert len(server.requests) == 1  # the second call asked nobody


def test_resume_after_transfer_cut_mid_file(server, tmp_path):
    path = HUB + "/000_00000.parquet"
    payload = bytes(range(256)) * 200
    server.files[path] = payload
    server.plans[path] = ["cut"]
    dest = tmp_path / "000_00000.parquet"
    fetch(server.url + path, dest, **FAST)
    assert dest.read_bytes() == payload
    assert [r for _, r in server.requests] == [None, f"bytes={len(payload) // 2}-"]


def test_resume_of_an_existing_part_file(server, tmp_path):
    server.files["/cache/epub/5/pg5.txt"] = BOOK
    dest = tmp_path / "5.txt"
    dest.with_name("5.txt.part").write_bytes(BOOK[:1000])
    fetch(server.url + "/cache/epub/5/pg5.txt", dest, **FAST)
    assert dest.read_bytes() == BOOK
    assert server.requests == [("/cache/epub/5/pg5.txt", "bytes=1000-")]


def test_complete_part_file_gets_416_and_is_kept(server, tmp_path):
    server.files["/cache/epub/5/pg5.txt"] = BOOK
    dest = tmp_path / "5.txt"
    dest.with_name("5.txt.part").write_bytes(BOOK)
    fetch(server.url + "/cache/epub/5/pg5.txt", dest, **FAST)
    assert dest.read_bytes() == BOOK


def test_server_that_ignores_range_restarts_from_zero(server, tmp_path):
    server.files["/cache/epub/7/pg7.txt"] = BOOK
    server.plans["/cache/epub/7/pg7.txt"] = ["cut", "norange"]
    dest = tmp_path / "7.txt"
    fetch(server.url + "/cache/epub/7/pg7.txt", dest, **FAST)
    assert dest.read_bytes() == BOOK


def test_404_names_the_url_and_leaves_nothing(server, tmp_path):
    dest = tmp_path / "404.txt"
    url = server.url + "/cache/epub/404/pg404.txt"
    with pytest.raises(UserError, match="not found") as err:
        fetch(url, dest, **FAST)
    assert url in str(err.value)
    assert len(server.requests) == 1  # a 404 is not retried
    assert not dest.exists() and not dest.with_name("404.txt.part").exists()


def test_500_then_success_is_retried(server, tmp_path):
    server.files["/cache/epub/9/pg9.txt"] = BOOK
    server.plans["/cache/epub/9/pg9.txt"] = ["500", "500"]
    dest = tmp_path / "9.txt"
    fetch(server.url + "/cache/epub/9/pg9.txt", dest, **FAST)
    assert dest.read_bytes() == BOOK
    assert len(server.requests) == 3


def test_500_forever_gives_up_naming_the_url(server, tmp_path):
    server.files["/x.txt"] = BOOK
    server.plans["/x.txt"] = ["500"] * 10
    with pytest.raises(UserError, match=r"failed after 3 attempts: HTTP 500") as err:
        fetch(server.url + "/x.txt", tmp_path / "x.txt", backoff_s=0.01, retries=2)
    assert server.url + "/x.txt" in str(err.value)
    assert len(server.requests) == 3


def test_backoff_doubles(server, tmp_path, monkeypatch):
    waits = []
    monkeypatch.setattr(download.time, "sleep", lambda s: waits.append(s))
    server.files["/x.txt"] = BOOK
    server.plans["/x.txt"] = ["500", "500", "500"]
    fetch(server.url + "/x.txt", tmp_path / "x.txt", backoff_s=0.5, retries=3)
    assert waits == [0.5, 1.0, 2.0]


def test_read_timeout_is_retried(server, tmp_path):
    server.files["/slow.txt"] = BOOK
    server.plans["/slow.txt"] = ["slow"]
    fetch(server.url + "/slow.txt", tmp_path / "slow.txt", timeout_s=0.3, **FAST)
    assert (tmp_path / "slow.txt").read_bytes() == BOOK


def test_connection_refused_is_retried_then_reported(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UserError, match="connection error"):
        fetch(f"http://127.0.0.1:{port}/a.txt", tmp_path / "a.txt", backoff_s=0.01, retries=1)


def test_wrong_size_is_an_error_and_leaves_nothing(server, tmp_path):
    server.files["/cache/epub/3/pg3.txt"] = BOOK
    dest = tmp_path / "3.txt"
    with pytest.raises(UserError, match=rf"got {len(BOOK)} bytes, expected {len(BOOK) + 1}"):
        fetch(server.url + "/cache/epub/3/pg3.txt", dest, size=len(BOOK) + 1, **FAST)
    assert not dest.exists() and not dest.with_name("3.txt.part").exists()


def test_sha256_checked(server, tmp_path):
    server.files["/a.json"] = b"[]"
    good = hashlib.sha256(b"[]").hexdigest()
    fetch(server.url + "/a.json", tmp_path / "a.json", sha256=good, **FAST)
    with pytest.raises(UserError, match="sha256"):
        fetch(server.url + "/a.json", tmp_path / "b.json", sha256="0" * 64, **FAST)
    assert not (tmp_path / "b.json").exists()


def test_polite_delay_between_requests_to_one_host(server, tmp_path):
    server.files["/a"] = server.files["/b"] = b"x"
    t0 = time.monotonic()
    fetch(server.url + "/a", tmp_path / "a", delay_s=0.3, **FAST)
    fetch(server.url + "/b", tmp_path / "b", delay_s=0.3, **FAST)
    assert time.monotonic() - t0 >= 0.3


def test_local_paths_and_file_urls_are_copied(tmp_path):
    src = tmp_path / "src" / "book.txt"
    src.parent.mkdir()
    src.write_bytes(BOOK)
    assert fetch(str(src), tmp_path / "a.txt") is True
    assert fetch(src.as_uri(), tmp_path / "b.txt") is True
    assert fetch("src/book.txt", tmp_path / "c.txt", root=tmp_path) is True
    for name in "abc":
        assert (tmp_path / f"{name}.txt").read_bytes() == BOOK
    with pytest.raises(UserError, match="does not exist"):
        fetch(str(tmp_path / "missing.txt"), tmp_path / "d.txt")


def test_a_new_source_replaces_the_cached_file(tmp_path):
    (tmp_path / "one.json").write_text("[1]")
    (tmp_path / "two.json").write_text("[2]")
    dest = tmp_path / "raw" / "data.json"
    fetch(str(tmp_path / "one.json"), dest)
    assert fetch(str(tmp_path / "one.json"), dest) is False
    assert fetch(str(tmp_path / "two.json"), dest) is True
    assert dest.read_text() == "[2]"


# ---- the stages over HTTP, in the real sources' layouts ----------------------------------------


def _book(title: str) -> bytes:
    return (
        f"Title: {title}\n\n*** START OF THE PROJECT GUTENBERG EBOOK {title.upper()} ***\n"
        f"The text of {title}.\n*** END OF THE PROJECT GUTENBERG EBOOK {title.upper()} ***\n"
    ).encode()


def test_gutenberg_stage_over_http(server, tmp_path):
    server.files["/cache/epub/1/pg1.txt"] = _book("One")
    server.files["/cache/epub/2/pg2.txt"] = _book("Two")
    server.plans["/cache/epub/2/pg2.txt"] = ["cut"]
    section = {
        "ids": [1, 2, 3],
        "url_template": server.url + "/cache/epub/{id}/pg{id}.txt",
        "skip_bad": False,
        "delay_s": 0.0,
        "timeout_s": 5.0,
        "retries": 2,
    }
    out = tmp_path / "books.parquet"
    with pytest.raises(UserError, match=r"/cache/epub/3/pg3.txt not found"):
        gutenberg.build(section, tmp_path / "raw", out)
    assert not out.exists()
    gutenberg.build({**section, "skip_bad": True}, tmp_path / "raw", out)
    rows = pq.read_table(out).to_pylist()
    assert [(r["doc_id"], r["title"], r["text"]) for r in rows] == [
        ("1", "One", "The text of One."),
        ("2", "Two", "The text of Two."),
    ]


def test_fineweb_stage_over_http(server, tmp_path):
    table = pa.table(
        {"text": ["alpha " * 50, "beta " * 50], "id": ["a", "b"], "int_score": [3, 4], "language_score": [0.95, 0.97]}
    )
    local = tmp_path / "f.parquet"
    pq.write_table(table, local)
    server.files[HUB + "/000_00000.parquet"] = local.read_bytes()
    section = {
        "base_url": server.url + HUB,
        "files": ["000_00000.parquet"],
        "min_int_score": 3,
        "min_language_score": 0.9,
        "byte_budget": 10**9,
        "seed": 0,
        "delay_s": 0.0,
        "timeout_s": 5.0,
        "retries": 2,
    }
    fineweb.build(section, tmp_path / "raw", tmp_path / "web.parquet")
    assert (tmp_path / "raw" / "000_00000.parquet").read_bytes() == local.read_bytes()
    assert sorted(pq.read_table(tmp_path / "web.parquet").column("doc_id").to_pylist()) == ["a", "b"]
