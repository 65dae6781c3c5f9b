"""The offline mirror's pieces: book files the gutenberg stage reads as real ones, R data decoding, and the
loopback server's byte ranges (a cut download resumes against it)."""

import importlib.util
import struct
import threading
from functools import partial
from pathlib import Path

import pytest

from nanoeuler.data.download import fetch
from nanoeuler.data.gutenberg import strip_license

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "mirror" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_book_files_have_the_gutenberg_framing():
    build = _load("build")
    raw = build.gutenberg_file("Pride and Prejudice", "Jane Austen", 100001, "It is a truth.\n\nUniversally.")
    assert raw.startswith("\ufeffThe Project Gutenberg eBook of") and "\r\n" in raw
    assert strip_license(raw, 100001) == ("Pride and Prejudice", "It is a truth.\n\nUniversally.")


def test_r_character_vectors_decode():
    build = _load("build")
    # XDR version 3: header, native encoding, then a STRSXP of 3 CHARSXPs (UTF-8 flag, an NA)
    blob = b"X\n" + struct.pack(">iii", 3, 0x40201, 0x30500) + struct.pack(">i", 5) + b"UTF-8"
    blob += struct.pack(">ii", 16, 3)
    for s in ("EMMA", "caf\u00e9"):
        data = s.encode()
        blob += struct.pack(">ii", 0x8009, len(data)) + data
    blob += struct.pack(">ii", 9, -1)
    assert build.read_r_strings(blob) == ["EMMA", "caf\u00e9", ""]
    with pytest.raises(ValueError):
        build.read_r_strings(b"X\n" + struct.pack(">iii", 2, 0, 0) + struct.pack(">ii", 13, 1))


@pytest.fixture
def server(tmp_path):
    import http.server

    serve = _load("serve")
    data = bytes(range(256)) * 1000
    (tmp_path / "f.bin").write_bytes(data)
    ranges = []

    class Handler(serve.RangeHandler):
        def send_head(self):
            ranges.append(self.headers.get("Range"))
            return super().send_head()

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(tmp_path)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", data, ranges
    srv.shutdown()


def test_server_answers_ranges(server):
    import requests

    url, data, _ = server
    r = requests.get(f"{url}/f.bin", headers={"Range": "bytes=1000-1009"})
    assert r.status_code == 206 and r.content == data[1000:1010]
    assert r.headers["Content-Range"] == f"bytes 1000-1009/{len(data)}"
    assert requests.get(f"{url}/f.bin", headers={"Range": "bytes=5-"}).content == data[5:]
    assert requests.get(f"{url}/f.bin", headers={"Range": f"bytes={len(data)}-"}).status_code == 416
    assert requests.get(f"{url}/f.bin").content == data


def test_a_cut_download_resumes_from_the_mirror(server, tmp_path):
    url, data, ranges = server
    dest = tmp_path / "out" / "f.bin"
    dest.parent.mkdir()
    Path(str(dest) + ".part").write_bytes(data[:12345])  # what a cut transfer left
    assert fetch(f"{url}/f.bin", dest, retries=0)
    assert dest.read_bytes() == data and ranges == ["bytes=12345-"]


def test_demo_sets_are_copied_as_they_are(tmp_path):
    build = _load("build")
    data = tmp_path / "root" / "sdists" / "llamafactory-0.9.5" / "data"
    data.mkdir(parents=True)
    (data / "dpo_en_demo.json").write_text('[{"conversations": [], "chosen": {}, "rejected": {}}]')
    entry = build.copy_demo_set(tmp_path / "root", tmp_path / "out", "dpo_en_demo.json", "prefs/dpo_en_demo.json")
    assert entry["records"] == 1 and entry["file"] == "prefs/dpo_en_demo.json"
    assert (tmp_path / "out/prefs/dpo_en_demo.json").read_bytes() == (data / "dpo_en_demo.json").read_bytes()


def test_overlays_validate_against_the_schema(tmp_path):
    """The full run's overlays, merged the way `--configfile a b c` merges them, pass the config schema."""
    import yaml
    from snakemake.utils import update_config, validate

    config = {}
    for name in ("config.yaml", "mirror.yaml", "mirror-dpo.yaml"):
        update_config(config, yaml.safe_load((ROOT / "config" / name).read_text()))
    validate(config, str(ROOT / "workflow" / "schemas" / "config.schema.yaml"))
    assert config["prefs"]["format"] == "sharegpt" and config["dpo"]["epochs"] == 1
    assert config["hellaswag"]["url"].startswith("data/sample/")


def test_stage_table_names_missing_outputs(tmp_path):
    """The device run's stage table: a row per rule with a benchmark file, n/a where outputs did not come back."""
    spec = importlib.util.spec_from_file_location("table", ROOT / "scripts" / "device_stage_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    (tmp_path / "benchmarks").mkdir()
    header = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"
    for rule, wall in (("prefs", 0.6), ("dpo", 16.3)):
        row = f"{wall}\t0:00:01\t100\t0\t0\t0\t0\t0\t0\t{wall}\n"
        (tmp_path / "benchmarks" / f"{rule}.tsv").write_text(header + row)
    (tmp_path / "data/prefs").mkdir(parents=True)
    (tmp_path / "data/prefs/prefs.jsonl").write_text("x" * 1500)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "dpo.log").write_text(
        "nanoeuler dpo: batch 32 as 2 micro-batches of 16 to fit 11.0 GB (gpu_memory)\n"
        "nanoeuler dpo: device memory peak 6.4 GB measured, 6.2 GB predicted (1.03); micro-batch 16\n"
    )
    text = table.table(tmp_path)
    assert "| prefs | 0.6 | 0.10 GB | 1.0 | 0.0 GiB | - | - | - | 1.5 KB |" in text
    assert "| dpo | 16.3 |" in text and text.rstrip().endswith("| n/a |")
    assert "| 6.4 GB | 6.2 GB | batch 32 as 2 micro-batches of 16 to fit 11.0 GB | n/a |" in text
