"""A loopback HTTP server that misbehaves on request, for driving the real downloader through faults.

    with FaultServer() as srv:
        srv.files["/a.txt"] = b"hello"
        srv.plan("/a.txt", "500", "cut")      # the next two answers to /a.txt misbehave, then "ok"
        srv.always("/b.txt", "html200")       # every answer to /b.txt misbehaves
        fetch(srv.url + "/a.txt", dest)

Faults (one per answer; Range requests get 206 unless the fault says otherwise):

    ok            the file (206 for a Range request, 416 past its end)
    <code>        that status with a short plain-text body ("500", "503", "429", "404", "403", ...)
    cut           half of the body, then the connection closes
    cut1          one byte of the body, then the connection closes (progress, forever if always)
    norange-cut   ignores Range: 200 with the whole file announced, half sent, then closes
    416           416 to any request, announcing the true size
    long-length   announces one byte more than it sends, then closes
    short-length  announces (and sends) one byte less than the file has
    slow          waits `slow_s` before answering (longer than a short read timeout)
    hang          sends the headers, then nothing until the server stops
    trickle       sends one byte every `trickle_s` seconds, never timing a read out
    html200       200 with an HTML error page (Content-Type text/html)
    text200       200 with an HTML error page labelled text/plain (only a content check sees it)
    redirect      302 to the same path under /moved/ (which serves the file)
    loop          302 to itself
"""

from __future__ import annotations

import http.server
import threading

ERROR_PAGE = b"<!DOCTYPE html><html><head><title>Service Unavailable</title></head><body>try later</body></html>"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: "_Server"

    def do_GET(self):  # noqa: N802 (http.server's naming)
        srv = self.server
        path = self.path
        srv.requests.append((path, self.headers.get("Range")))
        if path.startswith("/moved/"):
            path, fault = path[len("/moved") :], "ok"
        else:
            fault = srv.next_fault(path)
        if fault.isdigit():
            return self._answer(int(fault), f"HTTP {fault}".encode(), "text/plain")
        if fault == "html200":
            return self._answer(200, ERROR_PAGE, "text/html; charset=utf-8")
        if fault == "text200":
            return self._answer(200, ERROR_PAGE, "text/plain")
        if fault in ("redirect", "loop"):
            self.send_response(302)
            self.send_header("Location", path if fault == "loop" else "/moved" + path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        if fault == "slow":
            srv.stopping.wait(srv.slow_s)
        data = srv.files.get(path)
        if data is None:
            return self._answer(404, b"no such file", "text/plain")
        start = self._range_start()
        if fault == "416" or (start is not None and start >= len(data) and fault != "norange-cut"):
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(data)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        if start is None or fault == "norange-cut":
            start = 0
            self.send_response(200)
        else:
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        body = data[start:]
        announced = {"long-length": len(body) + 1, "short-length": len(body) - 1}.get(fault, len(body))
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(announced))
        self.end_headers()
        self._body(fault, body[:announced])
        return None

    def _body(self, fault: str, body: bytes) -> None:
        srv = self.server
        if fault in ("cut", "norange-cut"):
            body = body[: len(body) // 2]
        elif fault == "cut1":
            body = body[:1]
        elif fault == "hang":
            self.wfile.flush()
            srv.stopping.wait(60)
            return
        elif fault == "trickle":
            for i in range(len(body)):
                if srv.stopping.wait(srv.trickle_s):
                    return
                self.wfile.write(body[i : i + 1])
                self.wfile.flush()
            return
        self.wfile.write(body)
        self.wfile.flush()
        self.close_connection = True

    def _range_start(self) -> int | None:
        rng = self.headers.get("Range")
        if not rng or not rng.startswith("bytes="):
            return None
        return int(rng[len("bytes=") :].split("-")[0])

    def _answer(self, code: int, body: bytes, kind: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # keep the test output quiet
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files: dict[str, bytes] = {}
        self.plans: dict[str, list[str]] = {}
        self.forever: dict[str, str] = {}
        self.requests: list[tuple[str, str | None]] = []
        self.stopping = threading.Event()
        self.slow_s, self.trickle_s = 1.0, 0.05
        self._lock = threading.Lock()

    def next_fault(self, path: str) -> str:
        with self._lock:
            plan = self.plans.get(path)
            if plan:
                return plan.pop(0)
            return self.forever.get(path, "ok")


class FaultServer:
    """Context manager around a threaded loopback server; see the module docstring."""

    def __enter__(self) -> "FaultServer":
        self._srv = _Server()
        self.url = f"http://127.0.0.1:{self._srv.server_address[1]}"
        self._thread = threading.Thread(target=self._srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._srv.stopping.set()  # wakes hung and trickling answers
        self._srv.shutdown()
        self._srv.server_close()

    @property
    def files(self) -> dict[str, bytes]:
        return self._srv.files

    @property
    def requests(self) -> list[tuple[str, str | None]]:
        return self._srv.requests

    def plan(self, path: str, *faults: str) -> None:
        """The next answers to `path` misbehave in this order; then it behaves (or follows `always`)."""
        self._srv.plans[path] = list(faults)

    def always(self, path: str, fault: str) -> None:
        self._srv.forever[path] = fault

    def timing(self, *, slow_s: float | None = None, trickle_s: float | None = None) -> None:
        if slow_s is not None:
            self._srv.slow_s = slow_s
        if trickle_s is not None:
            self._srv.trickle_s = trickle_s
