"""Per-kernel resources of the decode kernels, before and after a change of their source: registers, stack,
spill stores and loads, static shared memory and barriers, as ptxas reports them (no GPU needed).

    python scripts/decode_resources.py 4f81d48            # the one-file decode.cu of that rev against this tree
    python scripts/decode_resources.py main --arch sm_89  # another target

The old side is `nanoeuler/kernels/decode.cu` of REV (or, where REV already has them, the files of
`nanoeuler/kernels/decode/`), extracted with its headers by `git archive`; the new side is this tree's
`nanoeuler/kernels/decode/*.cu` compiled with the -D shape constants the runtime passes
(`kernels/decode/plan.defines()`). Every kernel is compared field by field; the table is printed last and
the exit status is 1 if any kernel differs or exists on one side only.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FIELDS = ("regs", "stack", "spill_st", "spill_ld", "smem", "barriers")
SMEM_UNIT = 128  # bytes: the granularity a block's shared memory is allocated in (compute capability 8.x, 9.0)
_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(text: str) -> dict:
    """{kernel: {field: int}} from the output of `nvcc --resource-usage`."""
    out: dict = {}
    name = None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            name = m.group(1)
            out[name] = dict.fromkeys(FIELDS, 0)
            continue
        if name is None:
            continue
        if m := _FRAME.search(line):
            out[name].update(stack=int(m.group(1)), spill_st=int(m.group(2)), spill_ld=int(m.group(3)))
        if m := _USED.search(line):
            out[name].update(regs=int(m.group(1)), barriers=int(m.group(2) or 0))
            if s := _SMEM.search(line):
                out[name]["smem"] = int(s.group(1))
    return out


def compile_resources(path: Path, arch: str, options: tuple = ()) -> dict:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("decode_resources: nvcc not found")
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run(
            [
                nvcc,
                f"-gencode=arch=compute_{arch[3:]},code={arch}",
                "-std=c++17",
                *options,
                "-cubin",
                "--resource-usage",
                "-o",
                str(Path(tmp) / "k.cubin"),
                str(path),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
    if res.returncode != 0:
        raise SystemExit(f"decode_resources: nvcc failed on {path}:\n{res.stderr}")
    return parse_ptxas(res.stdout + res.stderr)


def old_files(rev: str, into: Path) -> list[Path]:
    """The decode kernel sources of `rev`, extracted (with the package they belong to) under `into`."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "nanoeuler"], capture_output=True, check=False)
    if tar.returncode != 0:
        raise SystemExit(f"decode_resources: git archive {rev}: {tar.stderr.decode().strip()}")
    with tarfile.open(fileobj=BytesIO(tar.stdout)) as t:
        t.extractall(into, filter="data")
    kernels = into / "nanoeuler" / "kernels"
    files = sorted((kernels / "decode").glob("*.cu")) or [kernels / "decode.cu"]
    if not files[0].exists():
        raise SystemExit(f"decode_resources: {rev} has no decode kernels")
    return files


def old_options(tree: Path) -> tuple:
    """A rev with decode/plan.py compiles with its own plan's -D options; the one-file decode.cu holds
    its #defines."""
    if not (tree / "nanoeuler" / "kernels" / "decode" / "plan.py").exists():
        return ()
    code = "from nanoeuler.kernels.decode import plan; print(' '.join(plan.defines()))"
    res = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"decode_resources: the old plan.py: {res.stderr.strip()}")
    return tuple(res.stdout.split())


def gather(files: list[Path], arch: str, options: tuple) -> dict:
    with ThreadPoolExecutor(max_workers=2) as pool:
        parts = list(pool.map(lambda p: compile_resources(p, arch, options), files))
    out: dict = {}
    for part in parts:
        out.update(part)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", help="the git rev whose decode kernels are the baseline (e.g. main, 4f81d48)")
    ap.add_argument("--arch", default="sm_90a", help="the target ptxas reports for (default sm_90a, as on H100)")
    args = ap.parse_args(argv)

    from nanoeuler.kernels.decode import plan

    with tempfile.TemporaryDirectory() as tmp:
        files = old_files(args.rev, Path(tmp))
        old = gather(files, args.arch, old_options(Path(tmp)))
    new = gather(sorted((ROOT / "nanoeuler" / "kernels" / "decode").glob("*.cu")), args.arch, plan.defines())
    names = sorted(set(old) | set(new))
    bad = 0
    print(
        f"decode kernels, {args.rev} against this tree, {args.arch}: "
        "regs, stack, spill stores, spill loads, static smem, barriers"
    )
    print("| kernel | old | new | same |")
    print("|---|---|---|---|")
    for n in names:
        o, w = old.get(n), new.get(n)
        verdict = same(o, w)
        bad += verdict == "**NO**"
        print(f"| {n} | {fmt(o)} | {fmt(w)} | {verdict} |")
    print(f"{len(names) - bad} of {len(names)} kernels the same in effect" + (f", {bad} DIFFER" if bad else ""))
    return 1 if bad else 0


def fmt(r) -> str:
    return "-" if r is None else " ".join(str(r[f]) for f in FIELDS)


def same(o, w) -> str:
    """ "yes"; "in effect" where only the static shared memory differs within one allocation unit (a
    module without dynamic shared memory pads less before it); else "**NO**"."""
    if o == w:
        return "yes"
    if o is None or w is None or any(o[f] != w[f] for f in FIELDS if f != "smem"):
        return "**NO**"
    return "in effect" if -(-o["smem"] // SMEM_UNIT) == -(-w["smem"] // SMEM_UNIT) else "**NO**"


if __name__ == "__main__":
    raise SystemExit(main())
