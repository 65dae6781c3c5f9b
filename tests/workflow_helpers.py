"""Running the repository's Snakefile in a temporary working directory, and reading its dry runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from nanoeuler.config import REPO_ROOT

BIN = Path(sys.executable).parent


def snakemake(
    workdir: Path, configfile: Path, targets: list[str], *extra: str, timeout: int = 600, configfiles: list[Path] = ()
) -> str:
    """Run snakemake on `targets` in `workdir` with the venv's `nanoeuler` on PATH; its output, asserting success.

    `configfiles` are read after `configfile`, each overriding the keys it sets."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    # targets first: --configfile takes every word that follows it
    cmd = [
        str(BIN / "snakemake"),
        *targets,
        "-s",
        str(REPO_ROOT / "Snakefile"),
        "-d",
        str(workdir),
        "--cores",
        "2",
        *extra,
        "--configfile",
        str(configfile),
        *map(str, configfiles),
    ]
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def planned_jobs(out: str) -> dict[str, int]:
    """Rule -> job count from a dry run's 'Job stats' table ({} when there is nothing to do)."""
    if "Nothing to be done" in out:
        return {}
    jobs = {}
    for line in out.split("Job stats:", 1)[1].splitlines()[3:]:
        parts = line.split()
        if len(parts) != 2 or parts[0] == "total" or not parts[1].isdigit():
            break
        jobs[parts[0]] = int(parts[1])
    return jobs
