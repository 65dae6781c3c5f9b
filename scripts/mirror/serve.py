"""Serve a folder over HTTP on the loopback interface, with byte ranges, for the data stages' downloader.

    python scripts/mirror/serve.py --root data/mirror --port 8765

Python's `http.server` ignores the Range header; this one answers `Range: bytes=START-[END]` with
206 and Content-Range (416 past the end), so resuming a cut download runs as it would against the
real servers. Files are read in 64 KiB blocks, so a 2 GB parquet file costs no memory.
"""

from __future__ import annotations

import argparse
import http.server
import os
import re
import shutil
import sys
from functools import partial

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """SimpleHTTPRequestHandler plus single byte ranges."""

    def send_head(self):
        rng = _RANGE.match(self.headers.get("Range", "").strip())
        path = self.translate_path(self.path)
        if rng is None or not os.path.isfile(path):
            return super().send_head()
        size = os.path.getsize(path)
        start = int(rng.group(1))
        end = min(int(rng.group(2)) if rng.group(2) else size - 1, size - 1)
        if start >= size or end < start:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        f = open(path, "rb")
        f.seek(start)
        self.send_response(206)
        self.send_header("Content-Type", self.guess_type(path))
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self._left = end - start + 1
        return f

    def copyfile(self, source, outputfile):
        left = getattr(self, "_left", None)
        if left is None:
            return shutil.copyfileobj(source, outputfile, 1 << 16)
        while left > 0:
            block = source.read(min(1 << 16, left))
            if not block:
                break
            outputfile.write(block)
            left -= len(block)
        self._left = None

    def log_message(self, format, *args):  # one line per request on stderr, without the client address
        sys.stderr.write(f"{self.log_date_time_string()} {format % args}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="data/mirror", help="folder to serve (default data/mirror)")
    parser.add_argument("--port", type=int, default=8765, help="port on 127.0.0.1 (default 8765)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.root):
        print(f"serve: error: {args.root} is not a folder (build it with scripts/mirror/build.py)", file=sys.stderr)
        return 1
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), partial(RangeHandler, directory=args.root))
    print(f"serving {args.root} on http://127.0.0.1:{args.port}/", file=sys.stderr, flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
