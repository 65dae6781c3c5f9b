"""The model card of a release (its README.md): the Hugging Face Hub's YAML metadata, then what the run's own
files say about the model.

`release.read_run` gathers the facts into a `RunFacts`; `model_card` only formats them, so every number in the
card is one a run file holds (or computes from): the architecture and parameter count from the model file,
tokens seen from the pretraining run directory, losses and bits per byte from metrics.json, HellaSwag from
its results, wall time from Snakemake's benchmark files, data sources from the config. A fact no file
holds is written as "not measured", never guessed.

    >>> short_count(116_417_280), short_count(1_049_216), short_count(188_480)
    ('116M', '1.0M', '188k')
"""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml

from nanoeuler.config import validate
from nanoeuler.model.config import ModelConfig

NOT_MEASURED = "not measured"
HELLASWAG_ITEMS = 10_042  # the whole validation set
GPT2_HELLASWAG = (0.286, 0.296)  # GPT-2 124M, acc / acc_norm (llm.c's scoring, as ours)
SMOKE_TEST_PARAMS = 20_000_000  # below this a model is a check that the pipeline runs, not a model to use

# The data sets the card can name a license for. A source counts as the data set itself only when the
# config points where the schema's default does; any other location is a copy (a mirror, local sample
# files) whose terms the card cannot know.
#   config section -> (what it is, Hugging Face Hub id or None, license)
SOURCES = {
    "gutenberg": ("Project Gutenberg books", None, "public domain in the USA"),
    "fineweb": ("FineWeb-Edu, sample/10BT", "HuggingFaceFW/fineweb-edu", "ODC-By 1.0"),
    "alpaca": ("Stanford Alpaca instructions", "tatsu-lab/alpaca", "CC BY-NC 4.0"),
    "prefs": ("Anthropic HH-RLHF preference pairs, helpful-base", "Anthropic/hh-rlhf", "MIT"),
    "hellaswag": ("HellaSwag validation set", "Rowan/hellaswag", "MIT"),
}
# The config key that says where each source is read from.
WHERE = {"gutenberg": "url_template", "fineweb": "base_url", "alpaca": "url", "prefs": "url", "hellaswag": "url"}
STAGES = {"base": "pretrain", "chat": "sft", "dpo": "dpo"}  # model name -> the stage that wrote it


@dataclass
class RunFacts:
    """What a finished run's files say; None (or empty) where a file was missing."""

    name: str  # the released model: base, chat or dpo
    cfg: ModelConfig
    meta: dict  # the released model file's metadata (step, final_metrics, sft_data, ...)
    exported_params: int  # parameters in model.safetensors (head 0 only)
    conf: dict  # the run's whole config
    version: str  # nanoeuler's
    base_meta: dict | None = None  # the base model's metadata (its step)
    metrics: dict | None = None  # metrics.json
    hellaswag: dict = field(default_factory=dict)  # model -> scores
    samples: dict | None = None  # samples.md's sections: heading -> Markdown
    pretraining: dict | None = None  # tokens, steps, rows a step, world size, precision, peak memory, tokens/s
    stage_times: list = field(default_factory=list)  # (rule, wall seconds) of Snakemake's benchmark files

    @property
    def title(self) -> str:
        return f"nanoeuler-{self.name}-{short_count(self.cfg.n_params())}"


def plural(n: int, word: str) -> str:
    """A count and its noun.

    >>> plural(1, "head"), plural(3, "head")
    ('1 head', '3 heads')
    """
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def short_count(n: int) -> str:
    """A parameter count as model names write it."""
    for unit, size in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}" if n < 10 * size else f"{n / size:.0f}{unit}"
    return str(n)


def model_card(run: RunFacts) -> str:
    """README.md of the release: the YAML header, then the sections in reading order."""
    parts = [
        _intro(run),
        _files(run),
        _usage(run),
        _architecture(run),
        _data(run),
        _training(run),
        _evaluation(run),
        _samples(run),
        _limits(run),
        _license(run),
    ]
    header = yaml.safe_dump(hub_metadata(run), sort_keys=False, allow_unicode=True)
    return f"---\n{header}---\n\n" + "\n\n".join(p.strip("\n") for p in parts) + "\n"


# ---- the metadata header -------------------------------------------------------------------------


def hub_metadata(run: RunFacts) -> dict:
    """The Hub's model card metadata: license, language, tags, data sets, task, library, HellaSwag results."""
    license_id = run.conf["release"]["license"]
    meta = {
        "license": license_id,
        "language": ["en"],
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["nanoeuler", "llama", "from-scratch", "numpy", "cupy"] + _tuning_tags(run.name),
    }
    datasets = [SOURCES[s][1] for s in _training_sources(run) if SOURCES[s][1] and known_source(run.conf, s)]
    if datasets:
        meta["datasets"] = datasets
    scores = run.hellaswag.get(run.name)
    if scores:
        meta["model-index"] = [{"name": run.title, "results": [_hellaswag_result(run, scores)]}]
    return meta


def _tuning_tags(name: str) -> list[str]:
    return {"base": [], "chat": ["sft", "alpaca"], "dpo": ["sft", "alpaca", "dpo"]}[name]


def _hellaswag_result(run: RunFacts, scores: dict) -> dict:
    known = known_source(run.conf, "hellaswag")
    return {
        "task": {"type": "text-generation", "name": "Text Generation"},
        "dataset": {
            "name": "HellaSwag",
            "type": SOURCES["hellaswag"][1] if known else "hellaswag",
            "split": "validation",
            "args": {"items": scores["items"]},
        },
        "metrics": [
            {"type": "acc", "value": scores["acc"], "name": "acc (completion-style, summed log-prob)"},
            {
                "type": "acc_norm",
                "value": scores["acc_norm"],
                "name": "acc_norm (completion-style, mean log-prob per token)",
            },
        ],
    }


def known_source(conf: dict, section: str) -> bool:
    """Whether the config reads `section`'s data from the public data set the card names (the schema's
    default location, and for preference pairs its default format)."""
    default = validate({})[section]
    keys = (WHERE[section], "format") if section == "prefs" else (WHERE[section],)
    return all(conf[section][k] == default[k] for k in keys)


def _training_sources(run: RunFacts) -> list[str]:
    """The config sections of the data the released model was trained on, in training order."""
    weights = run.conf["corpus"]["weights"]
    pre = [s for s in ("gutenberg", "fineweb") if weights[s] > 0]
    return pre + {"base": [], "chat": ["alpaca"], "dpo": ["alpaca", "prefs"]}[run.name]


# ---- the sections --------------------------------------------------------------------------------


def _intro(run: RunFacts) -> str:
    stages = {
        "base": "pretrained on books and web text",
        "chat": "pretrained on books and web text, then fine-tuned on Alpaca instructions (SFT)",
        "dpo": "pretrained on books and web text, fine-tuned on Alpaca instructions (SFT), then tuned on "
        "preference pairs (DPO)",
    }[run.name]
    exp = f" (experiment `{run.conf['experiment']}`)" if run.conf["experiment"] else ""
    return (
        f"# {run.title}\n\n"
        f"A {run.cfg.n_params():,}-parameter decoder-only transformer in the Llama layout, trained from scratch "
        f"by nanoeuler {run.version}{exp}: a language model whose every forward and backward pass is written by "
        f"hand on NumPy and CuPy, with no ML framework at run time. This is the **{run.name}** model, {stages}."
    )


def _files(run: RunFacts) -> str:
    extra = run.cfg.mtp_heads - 1
    heads = f" and {plural(extra, 'extra multi-token head')} (self-speculative decoding)" if extra else ""
    return "\n".join(
        [
            "## Files",
            "",
            "| file | what |",
            "|---|---|",
            "| `model.safetensors`, `config.json`, `generation_config.json` | the model as a `transformers` "
            "`LlamaForCausalLM` (float32; sampling defaults of the run) |",
            f"| `tokenizer.json`, `tokenizer_config.json` | byte-level BPE, {run.cfg.vocab_size:,} tokens"
            f"{'; the chat template' if run.name != 'base' else ''} |",
            f"| `{run.name}.bin` | nanoeuler's own checkpoint: the same weights{heads}, the tokenizer and the model "
            "config |",
            "| `run_config.yaml` | the run's whole config, every default filled in |",
            "| `SHA256SUMS` | the sha256 of every other file; check them with `sha256sum -c SHA256SUMS` |",
        ]
    )


def _usage(run: RunFacts) -> str:
    if run.name == "base":
        hf = ['inputs = tok("It was", return_tensors="pt")']
        ours = ['nanoeuler sample --ckpt . --prompt "It was"']
    else:
        hf = [
            'messages = [{"role": "user", "content": "Name a color."}]',
            'inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", '
            "return_dict=True)",
        ]
        ours = [
            "nanoeuler chat --ckpt .              # in the terminal",
            "nanoeuler serve --ckpt .             # an OpenAI-compatible API and a chat page",
        ]
    return "\n".join(
        [
            "## How to use",
            "",
            "With `transformers`, from this folder:",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            'tok = AutoTokenizer.from_pretrained(".")',
            'model = AutoModelForCausalLM.from_pretrained(".")',
            *hf,
            "out = model.generate(**inputs, max_new_tokens=64)",
            'print(tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))',
            "```",
            "",
            "With nanoeuler (the folder is its checkpoint; the model file is checked against `SHA256SUMS` first):",
            "",
            "```",
            *ours,
            "```",
        ]
        + (
            []
            if run.name == "base"
            else [
                "",
                "The chat template lays a conversation out as the fine-tuning examples were: the Alpaca prompt around "
                "each user turn, the answer, `</s>`; system messages fill the last turn's `### Input:` block.",
            ]
        )
    )


def _architecture(run: RunFacts) -> str:
    c = run.cfg
    rows = [
        (
            "parameters",
            f"{c.n_params():,} ({run.exported_params:,} in `model.safetensors`, without "
            f"{plural(c.mtp_heads - 1, 'extra multi-token head')})"
            if c.mtp_heads > 1
            else f"{c.n_params():,}",
        ),
        ("layers", f"{c.n_layers}"),
        ("model width", f"{c.dim}"),
        ("attention heads / key-value heads", f"{c.n_heads} / {c.n_kv_heads} (head size {c.head_dim})"),
        ("SwiGLU hidden width", f"{c.hidden}"),
        ("context", f"{c.ctx_len} tokens"),
        ("vocabulary", f"{c.vocab_size:,} (byte-level BPE learned on the training corpus)"),
        ("position encoding", f"RoPE, theta {c.rope_theta:g}"),
        ("normalisation", f"RMSNorm, eps {c.norm_eps:g}"),
        ("output heads", f"{c.mtp_heads} (head k predicts token t+1+k; generation uses head 0)"),
    ]
    return "\n".join(
        [
            "## Architecture",
            "",
            "Pre-norm blocks `x = x + attn(rmsnorm(x))`, `x = x + swiglu(rmsnorm(x))`, grouped-query "
            "attention, no biases, an untied output head.",
            "",
            "| | |",
            "|---|---|",
            *(f"| {k} | {v} |" for k, v in rows),
        ]
    )


def _data(run: RunFacts) -> str:
    conf, weights = run.conf, run.conf["corpus"]["weights"]
    what = {
        "gutenberg": f"{len(conf['gutenberg']['ids'])} books, weight {weights['gutenberg']:g}",
        "fineweb": f"at most {conf['fineweb']['byte_budget']:,} bytes, {_score_filter(conf['fineweb'])}, "
        f"weight {weights['fineweb']:g}",
        "alpaca": _sft_examples(run),
        "prefs": _pairs(run),
        "hellaswag": _hellaswag_items(run),
    }
    stage = {
        "gutenberg": "pretraining",
        "fineweb": "pretraining",
        "alpaca": "SFT",
        "prefs": "DPO",
        "hellaswag": "evaluation only",
    }
    rows = []
    for s in _training_sources(run) + (["hellaswag"] if run.hellaswag else []):
        name, _, license_text = SOURCES[s]
        where = conf[s][WHERE[s]]
        if not known_source(conf, s):
            name, license_text = f"a copy in the format of {name}", "that of the copy (not known to this card)"
        rows.append(f"| {stage[s]} | {name} ({what[s]}) | `{where}` | {license_text} |")
    return "\n".join(
        [
            "## Training data",
            "",
            "| stage | data | read from | license |",
            "|---|---|---|---|",
            *rows,
            "",
            f"Tokens seen in pretraining: {_tokens_seen(run)}.",
        ]
    )


def _score_filter(fineweb: dict) -> str:
    score = fineweb["min_int_score"]
    return "no score filter" if score is None else f"educational score >= {score}"


def _sft_examples(run: RunFacts) -> str:
    data = (run.meta if run.name == "chat" else _model_metrics(run, "chat")).get("sft_data")
    if not data:
        return f"examples used: {NOT_MEASURED}"
    return f"{data['train_examples']:,} examples, {run.conf['sft']['epochs']} epochs"


def _pairs(run: RunFacts) -> str:
    data = run.meta.get("dpo_data")
    return f"{data['train_pairs']:,} pairs" if data else f"pairs used: {NOT_MEASURED}"


def _hellaswag_items(run: RunFacts) -> str:
    items = {s["items"] for s in run.hellaswag.values()}
    return f"{', '.join(f'{n:,}' for n in sorted(items))} of {HELLASWAG_ITEMS:,} items"


def _model_metrics(run: RunFacts, name: str) -> dict:
    return (run.metrics or {}).get(name) or {}


def _tokens_seen(run: RunFacts) -> str:
    p = run.pretraining
    if not p:
        return NOT_MEASURED
    ranks = f"{plural(p['world'], 'GPU')} x " if p["world"] > 1 else ""
    return f"{p['tokens']:,} ({p['steps']:,} steps of {ranks}{p['rows']} sequences x {p['ctx_len']} tokens)"


def _size(run: RunFacts) -> str:
    """'188,480 parameters and 1,228,800 tokens of pretraining', as far as the run records it."""
    n = f"{run.cfg.n_params():,} parameters"
    return f"{n} and {run.pretraining['tokens']:,} tokens of pretraining" if run.pretraining else n


def _training(run: RunFacts) -> str:
    rows = []
    for name in ("base", "chat", "dpo")[: ("base", "chat", "dpo").index(run.name) + 1]:
        steps, loss = _steps_and_loss(run, name)
        wall = _stage_wall(run, STAGES[name])
        rows.append(f"| {STAGES[name]} | {steps} | {loss} | {wall} |")
    total = sum(t[1] for t in run.stage_times)
    return "\n".join(
        [
            "## Training",
            "",
            "| stage | steps | last train loss | wall time |",
            "|---|---:|---:|---:|",
            *rows,
            "",
            f"Hardware: {_hardware(run)}",
            "",
            "Wall time of every stage of the run (Snakemake's benchmark files): "
            + (
                f"{_duration(total)} in all, downloads and evaluation included."
                if run.stage_times
                else f"{NOT_MEASURED}."
            ),
        ]
    )


def _steps_and_loss(run: RunFacts, name: str) -> tuple[str, str]:
    if name == run.name:
        meta = run.meta
    elif name == "base" and run.base_meta:
        meta = run.base_meta
    else:
        m = _model_metrics(run, name)
        meta = {"step": m.get("steps"), "final_metrics": m.get("training") or {}}
    loss = (meta.get("final_metrics") or {}).get("loss")
    steps = meta.get("step")
    return (
        f"{steps:,}" if isinstance(steps, int) else NOT_MEASURED,
        f"{loss:.4f}" if isinstance(loss, (int, float)) else NOT_MEASURED,
    )


def _stage_wall(run: RunFacts, rule: str) -> str:
    for name, wall in run.stage_times:
        if name == rule:
            return _duration(wall)
    return NOT_MEASURED


def _duration(seconds: float) -> str:
    """Hours, minutes and seconds, then seconds.

    >>> _duration(3725.4)
    '1:02:05 (3,725 s)'
    """
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d} ({seconds:,.0f} s)"


def _hardware(run: RunFacts) -> str:
    """Where pretraining ran, as far as the run records it: the device from the config (or, for `auto`, the
    device memory record a GPU run writes), GPUs, precision, peak device memory and throughput."""
    p = run.pretraining
    if not p:
        return f"{NOT_MEASURED} (no pretraining run directory)."
    device = run.conf["device"]
    if device == "auto":
        device = "gpu" if p.get("peak_bytes") else "not recorded (device: auto)"
    where = {
        "cpu": "pretraining ran on the CPU (NumPy, float32)",
        "gpu": f"pretraining ran on {p['world']} GPU{'s' if p['world'] > 1 else ''} (CuPy, {p['precision']})",
    }.get(device, f"pretraining device {device}")
    facts = [where]
    if p.get("peak_bytes"):
        facts.append(f"peak device memory {p['peak_bytes'] / 1e9:.1f} GB per process")
    if p.get("tokens_per_s"):
        facts.append(f"a median of {p['tokens_per_s']:,.0f} tokens/s over the logged steps")
    return "; ".join(facts) + ". The run does not record the processor's model."


def _evaluation(run: RunFacts) -> str:
    rows = []
    for name in ("base", "chat", "dpo"):
        m, hs = _model_metrics(run, name), run.hellaswag.get(name)
        if not m and not hs:
            continue
        mark = " (this model)" if name == run.name else ""
        rows.append(
            f"| {name}{mark} | {_num(m.get('val_loss'))} | {_num(m.get('val_bpb'))} | "
            f"{_num(hs and hs['acc'])} | {_num(hs and hs['acc_norm'])} |"
        )
    if not rows:
        rows = [f"| {run.name} (this model) | {NOT_MEASURED} | {NOT_MEASURED} | {NOT_MEASURED} | {NOT_MEASURED} |"]
    table = [
        "## Evaluation",
        "",
        "| model | val loss | val bits/byte | HellaSwag acc | HellaSwag acc_norm |",
        "|---|---:|---:|---:|---:|",
        *rows,
    ]
    notes = []
    if run.metrics and "val_split" in run.metrics:
        notes.append(
            f"Validation: the first {_model_metrics(run, 'base').get('val_tokens', 0):,} tokens of the "
            "held-out split; bits per byte = head-0 cross-entropy / ln 2 x (tokens / UTF-8 bytes of the "
            "split), which does not depend on the tokenizer."
        )
    if run.hellaswag:
        notes.append(
            f"HellaSwag: {_hellaswag_items(run)}, scored completion-style as llm.c does (chance 0.25; "
            f"GPT-2 124M: {GPT2_HELLASWAG[0]} / {GPT2_HELLASWAG[1]})."
        )
    dpo = _model_metrics(run, "dpo").get("training") or {}
    if "reward_accuracy" in dpo:
        notes.append(
            f"DPO on held-out preference pairs: reward accuracy {dpo['reward_accuracy']:.3f}, mean margin "
            f"{dpo['margin']:+.2f}."
        )
    return "\n\n".join(["\n".join(table), *notes])


def _num(x) -> str:
    return f"{x:.4f}" if isinstance(x, (int, float)) and not isinstance(x, bool) else NOT_MEASURED


def _samples(run: RunFacts) -> str:
    if not run.samples:
        return f"## Samples\n\n{NOT_MEASURED} (no samples.md)."
    s = (run.metrics or {}).get("sampling")
    how = (
        f"Sampled at temperature {s['temperature']}, top-k {s['top_k']}, top-p {s['top_p']}, at most "
        f"{s['max_new_tokens']} new tokens, seed {s['seed']} + the prompt's index."
        if s
        else ""
    )
    lines = ["## Samples", "", "From the run's samples.md, unedited. " + how]
    for heading in ("Base model continuations", "Chat answers"):
        if heading in run.samples:
            lines += ["", f"### {heading}", "", run.samples[heading]]
    return "\n".join(lines)


def _limits(run: RunFacts) -> str:
    if run.cfg.n_params() < SMOKE_TEST_PARAMS:
        body = (
            f"Very little. With {_size(run)} this model is a check that "
            "the pipeline runs from raw text to a chat model; its text is barely English. Use it to try the "
            "tools, not for anything it says."
        )
    else:
        body = (
            f"With {_size(run)}, a model of this size writes fluent-ish "
            "English in the style of its training text, but it knows little and reasons not at all: what it "
            "states as fact is often wrong, it does not do arithmetic or follow several steps of an argument, "
            "and longer answers drift off the question."
        )
    hs = run.hellaswag.get(run.name)
    score = (
        f" Its HellaSwag acc_norm is {hs['acc_norm']:.3f} on {hs['items']:,} items, against 0.25 by chance."
        if hs
        else ""
    )
    tuning = {
        "base": " It continues text; it does not follow instructions.",
        "chat": " It has learned the shape of an answer, not the content of one, for one instruction at a "
        "time in the Alpaca format; it has had no safety training, so it can write false, biased or "
        "offensive text.",
        "dpo": " It has learned the shape of an answer, not the content of one, for one instruction at a "
        "time in the Alpaca format; it has had no safety training (DPO on a few preference pairs is "
        "not that), so it can write false, biased or offensive text.",
    }[run.name]
    return "\n".join(
        [
            "## What a model of this size can and cannot do",
            "",
            body + score + tuning + f" English only; at most {run.cfg.ctx_len} tokens of context. Do not "
            "use it where facts, safety or fairness matter.",
        ]
    )


def _license(run: RunFacts) -> str:
    text = (
        f"`{run.conf['release']['license']}` (the config's `release.license`). Each data set's own terms are in "
        "the table under Training data."
    )
    if run.name != "base" and known_source(run.conf, "alpaca"):
        text += (
            " Alpaca is CC BY-NC 4.0 (its answers were written by OpenAI's text-davinci-003), so a model "
            "tuned on it is for non-commercial use."
        )
    return "## License\n\n" + text
