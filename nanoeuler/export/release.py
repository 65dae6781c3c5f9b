"""`nanoeuler release`: a finished run as a folder people can download and try.

    nanoeuler release --config config/tiny.yaml --model results/chat.bin --out results/release

(under Snakemake: `snakemake results/release/SHA256SUMS`, rule `release`) writes

    README.md           the model card: the Hub's YAML metadata, then what the run's files say (`export.card`)
    config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json
                        the model as a `transformers` LlamaForCausalLM, chat template included (`export.hf`)
    chat.bin            nanoeuler's own checkpoint, MTP heads and all (base.bin, chat.bin or dpo.bin by its stage)
    run_config.yaml     the run's whole config, every default filled in
    SHA256SUMS          the sha256 of every other file, as `sha256sum` writes them

`transformers` loads the folder as it is (AutoModelForCausalLM, AutoTokenizer), and `nanoeuler chat`, `serve`
and `sample --ckpt FOLDER` load the checkpoint inside it after checking it against SHA256SUMS
(`checkpoint.model_file`). The HF files are made from the copied checkpoint, so both hold the same weights.

The card reads the run's other files, by default beside --model as `evaluate` finds its run directories: the
base model, metrics.json (validation metrics, and the HellaSwag scores `evaluate` gathers from hellaswag/),
samples.md, the pretraining run directory (tokens seen, device memory, tokens/s) and Snakemake's benchmark
files (wall time). A missing one leaves its part of the card "not measured"; only the model itself must be
there. The config (--config or --params) is required: the card names the data sources and their licenses
from it.

The folder is built beside --out and renamed into place. An existing --out must be empty or a previous
release (only the file names above); a previous release is replaced whole, and nothing else is removed.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
from pathlib import Path

import yaml

from nanoeuler import __version__, checkpoint
from nanoeuler.config import add_config_arguments, load_schema, sections
from nanoeuler.errors import UserError
from nanoeuler.export import hf
from nanoeuler.export.card import STAGES, RunFacts, model_card
from nanoeuler.files import CHECKPOINT, SMALL_JSON, file_sha256, naming, parse_json, read_json, read_text

NAMES = {stage: name for name, stage in STAGES.items()}  # the stage that wrote a model -> its file name
MODEL_FILES = tuple(f"{name}.bin" for name in STAGES)
RELEASE_FILES = (*hf.EXPORT_FILES, hf.GENERATION_CONFIG, *MODEL_FILES, "README.md", "run_config.yaml", checkpoint.SUMS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument(
        "--model",
        required=True,
        metavar="BIN",
        help="the model to release: results/chat.bin, or results/dpo.bin after DPO",
    )
    parser.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="the release folder to write: a new one, an empty one or a previous release",
    )
    beside = " (default: beside --model)"
    parser.add_argument("--base", metavar="BIN", help="the base model, results/base.bin" + beside)
    parser.add_argument("--metrics", metavar="JSON", help="metrics.json of `nanoeuler evaluate`" + beside)
    parser.add_argument("--samples", metavar="MD", help="samples.md of `nanoeuler evaluate`" + beside)
    parser.add_argument("--pretrain-dir", metavar="DIR", help="the pretraining run directory" + beside)
    parser.add_argument(
        "--benchmarks",
        nargs="*",
        metavar="DIR",
        help="folders of Snakemake's benchmark files (default: benchmarks/ beside results/)",
    )


def run(args: argparse.Namespace) -> int:
    if not (args.config or args.params):
        raise UserError("give the run's config (--config FILE or --params JSON): the card names its data sources")
    conf = sections(args, *load_schema()["properties"])
    files = release(conf, _inputs(args), args.out)
    print(f"nanoeuler release: wrote {args.out}: {', '.join(files)}")
    return 0


def _inputs(args: argparse.Namespace) -> dict:
    """The run's files by name: given on the command line, else where a run puts them beside --model."""
    model = Path(args.model)
    run_dir = model.parent

    def pick(given, default):
        return Path(given) if given else run_dir / default

    benchmarks = args.benchmarks if args.benchmarks is not None else _benchmark_dirs(run_dir)
    return {
        "model": model,
        "base": pick(args.base, "base.bin"),
        "metrics": pick(args.metrics, "metrics.json"),
        "samples": pick(args.samples, "samples.md"),
        "pretrain_dir": pick(args.pretrain_dir, "pretrain"),
        "benchmarks": [Path(p) for p in benchmarks],
    }


def _benchmark_dirs(run_dir: Path) -> list[Path]:
    """Where the Snakefile writes a run's benchmark files: results/ -> benchmarks/; results/NAME/ ->
    benchmarks/NAME/ and benchmarks/ (the data stages, shared by every experiment)."""
    parts = run_dir.parts
    if "results" not in parts:
        return []
    at = parts.index("results")
    root = Path(*parts[:at], "benchmarks")
    return [root.joinpath(*parts[at + 1 :]), root] if at + 1 < len(parts) else [root]


# ---- writing the folder --------------------------------------------------------------------------


def release(conf: dict, inputs: dict, out) -> list[str]:
    """Write the release folder `out` from a run's files (`_inputs`); returns its file names."""
    if not conf["release"]["license"].strip():
        raise UserError("config key 'release.license' is empty; name the license of the release")
    out = Path(os.path.abspath(out))
    hf.check_out_dir(out, RELEASE_FILES, "release")
    checkpoint.read_header(inputs["model"])  # a missing or broken model stops here, before any writing
    tmp = hf.new_folder_beside(out, "release")
    try:
        params, cfg, meta = _copy_model(inputs["model"], tmp)
        hf.write_hf(tmp, params, cfg, meta, conf["eval"])
        facts = read_run(inputs, conf, cfg, meta, _exported_params(params, cfg))
        with naming(tmp):
            (tmp / "run_config.yaml").write_text(yaml.safe_dump(conf, sort_keys=False), encoding="utf-8")
            (tmp / "README.md").write_text(model_card(facts), encoding="utf-8")
            digests = {p.name: file_sha256(p, "release file", CHECKPOINT) for p in sorted(tmp.iterdir())}
            (tmp / checkpoint.SUMS).write_text(checkpoint.format_sums(digests), encoding="utf-8")
            _fsync_files(tmp)
        _swap_in(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the folder this release made (gone after a swap)
    checkpoint.fsync_dir(out.parent)
    return sorted(p.name for p in out.iterdir())


def _copy_model(model: Path, folder: Path):
    """Copy the model file into `folder` under its stage's name and load the copy (its checksum checked), so
    the HF files are made from exactly the bytes released. -> load_model's (params, cfg, metadata)."""
    meta = _metadata(model)
    name = NAMES.get(meta.get("stage"))
    if name is None:
        raise UserError(
            f"{model} was not written by pretrain, sft or dpo (metadata 'stage' is "
            f"{meta.get('stage')!r}); release a model file of the pipeline"
        )
    if not meta.get("tokenizer"):
        raise UserError(f"{model} carries no tokenizer (metadata 'tokenizer'); release a model file of the pipeline")
    copy = folder / f"{name}.bin"
    with naming(copy):
        shutil.copyfile(model, copy)
    return checkpoint.load_model(copy)


def _exported_params(params: dict, cfg) -> int:
    return sum(a.size for a in hf.hf_tensors(params, cfg).values())


def _fsync_files(folder: Path) -> None:
    """Every file of `folder` on disk before the folder is renamed into place (a crash then leaves the old
    release or the whole new one, never empty files under the release's names)."""
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    checkpoint.fsync_dir(folder)


def _swap_in(tmp: Path, out: Path) -> None:
    """`tmp` becomes `out`: a rename, after moving a previous release (checked by `check_out_dir`) aside."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = hf.new_folder_beside(out, "previous")
    os.replace(out, old)  # onto the empty folder just made
    os.replace(tmp, out)
    shutil.rmtree(old)


# ---- reading the run -----------------------------------------------------------------------------


def read_run(inputs: dict, conf: dict, cfg, meta: dict, exported_params: int) -> RunFacts:
    """The facts of the card, from each of the run's files that exists."""
    base, samples = inputs["base"], inputs["samples"]
    metrics = read_json(inputs["metrics"], "metrics file") if inputs["metrics"].exists() else None
    if metrics is not None and not isinstance(metrics, dict):
        raise UserError(f"metrics file {inputs['metrics']} is not a JSON object (is it evaluate's metrics.json?)")
    return RunFacts(
        name=NAMES[meta["stage"]],
        cfg=cfg,
        meta=meta,
        exported_params=exported_params,
        conf=conf,
        version=__version__,
        base_meta=_metadata(base) if base.exists() else None,
        metrics=metrics,
        hellaswag=(metrics or {}).get("hellaswag", {}),
        samples=markdown_sections(read_text(samples, "samples file", SMALL_JSON)) if samples.exists() else None,
        pretraining=pretraining_facts(inputs["pretrain_dir"]),
        stage_times=stage_times(inputs["benchmarks"]),
    )


def _metadata(path: Path) -> dict:
    """A checkpoint's metadata from its header alone (the tensors are not read), JSON values decoded."""
    _, raw, _ = checkpoint.read_header(path)
    out = {}
    for key, value in raw.items():
        if key not in checkpoint.RESERVED:
            out[key] = parse_json(value, f"checkpoint {path}: metadata {key!r}") if isinstance(value, str) else value
    return out


def pretraining_facts(run_dir: Path) -> dict | None:
    """Tokens seen and how, from the newest checkpoint of a pretraining run directory (its step and the run's
    settings: rows a step, ranks, context), and device memory and throughput from its metrics log."""
    from nanoeuler.train import rundir

    found = rundir.list_checkpoints(run_dir)
    if not found:
        return None
    meta = _metadata(found[0][1])
    try:
        settings, world = meta["identity"]["settings"], meta["identity"].get("world_size", 1)
        rows, steps = settings["batch_size"] * settings.get("grad_accum", 1), meta["step"]
        ctx_len = meta["model_config"]["ctx_len"]
    except (KeyError, TypeError, AttributeError):
        raise UserError(
            f"{found[0][1]} is not a pretraining checkpoint (no step, model config or run settings in its metadata)"
        ) from None
    log = rundir.read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    peaks = [r["memory_peak_bytes"] for r in log if "memory_peak_bytes" in r]
    rates = [r["tokens_per_s"] for r in log if "tokens_per_s" in r]
    return {
        "tokens": steps * world * rows * ctx_len,
        "steps": steps,
        "world": world,
        "rows": rows,
        "ctx_len": ctx_len,
        "precision": settings.get("precision", "fp32"),
        "peak_bytes": max(peaks) if peaks else None,
        "tokens_per_s": statistics.median(rates) if rates else None,
    }


def stage_times(folders: list[Path]) -> list[tuple[str, float]]:
    """(rule, wall seconds) of each Snakemake benchmark file (`benchmark:`, named after its rule or job) in
    `folders`, from its first row; a rule found in two folders counts once."""
    out: dict[str, float] = {}
    for folder in folders:
        for path in sorted(folder.glob("*.tsv")) if folder.is_dir() else []:
            rows = list(csv.DictReader(read_text(path, "benchmark file", SMALL_JSON).splitlines(), delimiter="\t"))
            try:
                out.setdefault(path.stem, float(rows[0]["s"]))
            except (IndexError, KeyError, TypeError, ValueError):
                raise UserError(f"benchmark file {path} is not Snakemake's (no wall time in its column 's')") from None
    return list(out.items())


def markdown_sections(text: str) -> dict[str, str]:
    """{heading: body} of each `## heading` of a Markdown text, ignoring lines inside code fences.

    >>> markdown_sections("# t\\n## A\\n```\\n## not a heading\\n```\\n## B\\nb\\n")
    {'A': '```\\n## not a heading\\n```', 'B': 'b'}
    """
    out: dict[str, list[str]] = {}
    heading, fence = None, ""
    for line in text.splitlines():
        ticks = len(line) - len(line.lstrip("`"))
        if fence:
            if ticks >= len(fence) and not line.strip("` \t"):
                fence = ""
        elif ticks >= 3:
            fence = "`" * ticks
        elif line.startswith("## "):
            heading = line[3:].strip()
            out[heading] = []
            continue
        if heading is not None:
            out[heading].append(line)
    return {h: "\n".join(body).strip("\n") for h, body in out.items()}
