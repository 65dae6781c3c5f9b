"""bench/time_to_quality.py on the CPU: every recipe is a valid pretraining section for config.yaml's model,
and the report reads a folder of runs against a tuned baseline found there or given."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nanoeuler.config import load_config, validate
from nanoeuler.model.config import ModelConfig
from nanoeuler.train.config import PretrainConfig

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "time_to_quality.py"


def _bench():
    spec = importlib.util.spec_from_file_location("time_to_quality", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["adamw_6e-4", "muon_1e-3", "muon_1.4e-3", "muon_2e-3+mtp", "muon_2e-3_1800+mtp"])
def test_recipes_are_valid_pretraining_sections(tmp_path, name):
    bench = _bench()
    keys = bench.recipe_keys(name, 3000, 6e-4)
    bench.write_config(tmp_path / "config.yaml", keys, 250)
    conf = load_config(tmp_path / "config.yaml")
    settings = PretrainConfig.from_section(conf["pretrain"])
    heads = ModelConfig.from_section(conf["model"], 4096).mtp_heads
    schedule = settings.head_weight_schedule(heads, "pretrain")
    assert (schedule is not None) == name.endswith("+mtp")
    if schedule:
        assert schedule(0, settings.steps) == [1.0, 0.5, 0.25, 0.125]
        assert schedule(settings.steps - 1, settings.steps) == [1.0, 0.0, 0.0, 0.0]
    assert settings.steps == (1800 if "_1800" in name else 3000)
    with pytest.raises(KeyError):
        bench.recipe_keys("muon_2e-3+nope", 3000, 6e-4)
    validate({"pretrain": keys})


def _fake_run(folder: Path, name: str, keys: dict, bpbs: list, step_ms: float):
    work = folder / name
    (work / "run").mkdir(parents=True)
    (work / "config.yaml").write_text(yaml.safe_dump({"pretrain": keys}))
    with open(work / "run" / "metrics.jsonl", "w") as f:
        for i, bpb in enumerate(bpbs, start=1):
            step = 250 * i
            f.write(json.dumps({"step": step, "loss": 3.0, "tokens_per_s": 32 * 512 / (step_ms / 1e3)}) + "\n")
            f.write(json.dumps({"step": step, "val_bpb": bpb}) + "\n")


def test_report_against_a_baseline_found_or_given(tmp_path):
    bench = _bench()
    _fake_run(tmp_path, "muon_1e-3", bench.recipe_keys("muon_1e-3", 1000, 6e-4), [1.5, 1.3, 1.2, 1.1], 30.0)

    def report(*extra):
        return subprocess.run(
            [sys.executable, str(BENCH), "report", str(tmp_path), *extra], capture_output=True, text=True, cwd=ROOT
        )

    alone = report()
    assert alone.returncode == 1 and "give --baseline BPB,STEP,SECONDS" in alone.stderr
    given = report("--baseline", "1.2,1000,40")
    assert given.returncode == 0, given.stderr
    # 1.2 reached at step 750: 0.75x the tokens, 22.5 s of 40
    assert "| muon_1e-3 | 1000 | 30.0 | 1.1000 | 12.3M | 0.75 | 22 | 0.56 |" in given.stdout
    _fake_run(tmp_path, "adamw_6e-4", bench.recipe_keys("adamw_6e-4", 1000, 6e-4), [1.6, 1.4, 1.3, 1.25], 28.0)
    found = report()
    assert (
        found.returncode == 0 and "tuned baseline: adamw_6e-4, best val bits/byte 1.2500 at step 1000" in found.stdout
    )
