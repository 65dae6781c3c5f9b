"""Headless Chromium driven over the DevTools protocol on a pipe, with no browser-driver package.

`chromium --remote-debugging-pipe` reads protocol commands on file descriptor 3 and writes replies and
events on descriptor 4, each a JSON message ended by a NUL byte.

    with Chromium() as browser:
        browser.open("http://127.0.0.1:8000/")
        browser.evaluate("document.title")            # -> "nanoeuler chat"
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

# Moves two descriptors to 3 and 4, then runs the browser: thread-safe, unlike a preexec_fn. They go
# above 9 first, so neither can overwrite the other.
_ON_3_AND_4 = """import fcntl, os, sys
a, b = (fcntl.fcntl(int(fd), fcntl.F_DUPFD, 10) for fd in sys.argv[1:3])
os.dup2(a, 3); os.dup2(b, 4); os.close(a); os.close(b)
os.execvp(sys.argv[3], sys.argv[3:])"""


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


class Chromium:
    def __init__(self, binary: str | None = None, width: int = 960, height: int = 640):
        binary = binary or find_chromium()
        self.profile = tempfile.mkdtemp(prefix="cdp-profile-")
        cmd_r, self.cmd_w = os.pipe()
        self.out_r, out_w = os.pipe()
        args = [
            binary,
            "--headless=new",
            "--remote-debugging-pipe",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            f"--user-data-dir={self.profile}",
            f"--window-size={width},{height}",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ON_3_AND_4, str(cmd_r), str(out_w), *args],
            pass_fds=(cmd_r, out_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(cmd_r)
        os.close(out_w)
        self.buffer, self.next_id, self.session = b"", 0, None
        page = next(t for t in self.send("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self.session = self.send("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]

    def _read_message(self) -> dict:
        while b"\0" not in self.buffer:
            data = os.read(self.out_r, 1 << 16)
            if not data:
                raise RuntimeError("chromium closed the DevTools pipe")
            self.buffer += data
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, **params) -> dict:
        """Run one command and return its result (events that arrive meanwhile are skipped)."""
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if self.session is not None:
            message["sessionId"] = self.session
        os.write(self.cmd_w, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read_message()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str, timeout: float = 30) -> None:
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", timeout)

    def wait_for(self, expression: str, timeout: float = 30):
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout}s for {expression}")
            time.sleep(0.05)
        return value

    def type_text(self, text: str) -> None:
        self.send("Input.insertText", text=text)

    def press_enter(self) -> None:
        for kind in ("keyDown", "keyUp"):
            self.send("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13)

    def screenshot(self, path) -> None:
        data = self.send("Page.captureScreenshot", format="png")["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.cmd_w)
        os.close(self.out_r)
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
