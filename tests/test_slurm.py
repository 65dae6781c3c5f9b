"""The tiny DAG through a real one-node SLURM cluster (scripts/slurm_local.sh): its outputs equal a local run's.

Skips unless SLURM's daemons, munge and the Snakemake SLURM plugin are installed and the tests run as root
(the script starts munged, slurmctld and slurmd itself). About 3-4 minutes on 2 cores.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nanoeuler.config import REPO_ROOT

NEEDED = ["slurmctld", "slurmd", "sbatch", "squeue", "munged", "munge"]


def _missing() -> list[str]:
    missing = [exe for exe in NEEDED if not (shutil.which(exe) or Path("/usr/sbin", exe).exists())]
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        missing.append("snakemake-executor-plugin-slurm")
    if os.geteuid() != 0:
        missing.append("root")
    return missing


@pytest.mark.slow
@pytest.mark.skipif(bool(_missing()), reason=f"needs SLURM: missing {', '.join(_missing())}")
def test_tiny_dag_on_slurm_equals_local_run(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}/usr/sbin{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "slurm_local.sh"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK: the SLURM run's outputs equal the local run's" in proc.stderr
    log = (tmp_path / "slurm-run" / "snakemake.log").read_text()
    assert "SLURM" in log and "pretrain" in log
