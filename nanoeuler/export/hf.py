"""`nanoeuler export-hf --ckpt CKPT --out DIR`: a checkpoint as a Hugging Face `LlamaForCausalLM`.

Our architecture is Llama's (pre-norm RMSNorm, half-split RoPE, GQA, SwiGLU, no biases, untied head),
and our parameter names are Llama's, so the export is a renaming: `model.` in front of every trunk
tensor, `lm_head.weight` as is. The multi-token heads `mtp_heads.k` have no Llama twin and are left out
(the exported model is head 0, the one generation uses).

DIR receives `config.json`, `model.safetensors` (float32, `{"format": "pt"}` metadata as transformers
expects) and, when the checkpoint carries a tokenizer, `tokenizer.json` (HF tokenizers format), a
`tokenizer_config.json` naming its special tokens (with the chat template of a fine-tuned model, so
`apply_chat_template` writes the prompt SFT trained on). Then, offline:

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(DIR)
    tok = AutoTokenizer.from_pretrained(DIR)

The files are built in a folder beside DIR and moved in when all are written, so a failed export leaves
no partial DIR. An existing DIR must be empty or a previous export: a folder holding anything else is
refused, never replaced. `nanoeuler release` writes the same files (`write_hf`) into a release folder,
with a `generation_config.json` (the stop tokens and the run's sampling defaults) beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from nanoeuler import checkpoint
from nanoeuler.errors import UserError
from nanoeuler.files import naming
from nanoeuler.model.config import ModelConfig
from nanoeuler.data.template import PROMPT_NO_INPUT, PROMPT_WITH_INPUT


def hf_config(cfg: ModelConfig, eos_token_id=None, bos_token_id=None) -> dict:
    """config.json for LlamaForCausalLM. Both `rope_theta` (transformers 4) and `rope_parameters`
    (transformers 5) are written."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.ctx_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "torch_dtype": "float32",
    }


def hf_tensors(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our parameters under their LlamaForCausalLM names (float32), MTP heads dropped."""
    out = {}
    for name in cfg.param_shapes():
        if name.startswith("mtp_heads."):
            continue
        hf_name = name if name == "lm_head.weight" else "model." + name
        out[hf_name] = np.ascontiguousarray(params[name], dtype=np.float32)
    return out


def _tokenizer_files(tokenizer_json: str, cfg: ModelConfig, tuned: bool):
    """(tokenizer.json text, tokenizer_config dict, eos ids, bos id), or None without the HF exporter.
    A `tuned` (SFT or DPO) model's tokenizer_config carries the chat template."""
    try:
        from nanoeuler.tokenizer.bpe import Tokenizer
        from nanoeuler.tokenizer.hf import to_hf_json
    except ImportError:
        return None
    tok = Tokenizer.from_json(tokenizer_json)
    if tok.vocab_size != cfg.vocab_size:
        raise UserError(f"the checkpoint's tokenizer has {tok.vocab_size} tokens but its model {cfg.vocab_size}")
    specials = {i: s for s, i in tok.special_tokens.items()}
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.ctx_len,
        "eos_token": specials[tok.end_id],
        "bos_token": specials[tok.eot_id],
        "clean_up_tokenization_spaces": False,
    }
    if tuned:
        tok_config["chat_template"] = chat_template(specials[tok.end_id])
    return to_hf_json(tok), tok_config, [tok.end_id, tok.eot_id], tok.eot_id


def _jinja_text(text: str) -> str:
    """`text` as a Jinja string literal (JSON's escapes are Jinja's)."""
    return json.dumps(text)


def chat_template(end: str) -> str:
    """The Jinja chat template of `serve.prompts.chat_prompt`'s layout, for `apply_chat_template`: every
    earlier exchange is a fine-tuning example (the Alpaca prompt around the user's text, the answer, `end`),
    the last user turn (consecutive user messages joined by a blank line) is a prompt awaiting its answer,
    and system messages fill that turn's `### Input:` block. Built from `data.template`'s texts, so the
    two cannot drift apart; a conversation the server refuses raises here too.
    """
    head0, tail0 = PROMPT_NO_INPUT.split("{instruction}")
    head1, rest = PROMPT_WITH_INPUT.split("{instruction}")
    mid1, tail1 = rest.split("{input}")
    q = _jinja_text
    return (
        "{%- macro turn(instruction, input) -%}"
        "{%- if input and input.strip() -%}"
        f"{{{{ {q(head1)} ~ instruction ~ {q(mid1)} ~ input ~ {q(tail1)} }}}}"
        "{%- else -%}"
        f"{{{{ {q(head0)} ~ instruction ~ {q(tail0)} }}}}"
        "{%- endif -%}"
        "{%- endmacro -%}"
        "{%- set ns = namespace(system=[], pending=[]) -%}"
        "{%- for m in messages -%}"
        "{%- if m['role'] in ['system', 'developer'] -%}{%- set ns.system = ns.system + [m['content']] -%}"
        "{%- elif m['role'] == 'user' -%}{%- set ns.pending = ns.pending + [m['content']] -%}"
        "{%- elif m['role'] == 'assistant' -%}"
        "{%- if not ns.pending -%}"
        "{{ raise_exception('an assistant message must follow a user message') }}"
        "{%- endif -%}"
        f"{{{{ turn(ns.pending | join('\\n\\n'), '') ~ m['content'] ~ {q(end)} }}}}"
        "{%- set ns.pending = [] -%}"
        "{%- else -%}"
        "{{ raise_exception('a message role must be system, developer, user or assistant') }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if not ns.pending -%}"
        "{{ raise_exception('the conversation must end with a user message') }}"
        "{%- endif -%}"
        "{{ turn(ns.pending | join('\\n\\n'), ns.system | join('\\n\\n')) }}"
    )


def generation_config(eos, bos, sampling: dict) -> dict:
    """generation_config.json: the stop tokens and the sampling defaults of an `eval` config section
    (temperature 0: greedy, where transformers wants no sampling values at all)."""
    out = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": sampling["temperature"] > 0}
    if out["do_sample"]:
        out.update(temperature=sampling["temperature"], top_k=sampling["top_k"], top_p=sampling["top_p"])
    return out


# What an export writes; an existing --out may hold these and nothing else (it is a previous export).
EXPORT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
GENERATION_CONFIG = "generation_config.json"  # written when the sampling settings are known (a release)


def write_hf(folder: Path, params: dict, cfg: ModelConfig, metadata: dict, sampling: dict | None = None) -> None:
    """The HF files of a model (`load_model`'s answer) into `folder`; with `sampling` (a run's `eval` config
    section) and a tokenizer, generation_config.json too."""
    tok = None
    if metadata.get("tokenizer"):
        tok = _tokenizer_files(metadata["tokenizer"], cfg, tuned=metadata.get("stage") in ("sft", "dpo"))
    eos, bos = (tok[2], tok[3]) if tok else (None, None)
    with naming(folder):
        (folder / "config.json").write_text(json.dumps(hf_config(cfg, eos, bos), indent=2) + "\n", encoding="utf-8")
        checkpoint.write_safetensors(folder / "model.safetensors", hf_tensors(params, cfg), {"format": "pt"})
        if tok:
            (folder / "tokenizer.json").write_text(tok[0], encoding="utf-8")
            (folder / "tokenizer_config.json").write_text(json.dumps(tok[1], indent=2) + "\n", encoding="utf-8")
        if tok and sampling is not None:
            (folder / GENERATION_CONFIG).write_text(
                json.dumps(generation_config(eos, bos, sampling), indent=2) + "\n", encoding="utf-8"
            )


def export(ckpt, out) -> list[str]:
    """Write the HF model directory `out` from checkpoint `ckpt`; returns the file names written.

    The files are written into a new folder beside `out`, then moved in: as a whole when `out` does not
    exist, else one by one into `out`, which must be empty or a previous export. Nothing else is ever
    replaced or removed.
    """
    out = Path(os.path.abspath(out))  # "." and "dir/" have a name and a parent this way
    check_out_dir(out, EXPORT_FILES, "export")
    params, cfg, metadata = checkpoint.load_model(ckpt)
    tmp = new_folder_beside(out, "export")
    try:
        write_hf(tmp, params, cfg, metadata)
        move_into(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the folder this export made, empty after a move
    checkpoint.fsync_dir(out.parent)
    return sorted(p.name for p in out.iterdir())


def new_folder_beside(out: Path, what: str) -> Path:
    """A new hidden folder next to `out` (same filesystem, so it or its files move into `out` by rename),
    with the mode `mkdir` gives (0755 under umask 022; mkdtemp's 0700 would follow it into `out`)."""
    from nanoeuler.tokenizer.bpe import default_file_mode

    out.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{out.name}.{what}-", dir=out.parent))
    mode = default_file_mode()
    folder.chmod(mode | (mode & 0o444) >> 2)  # search where read is allowed, as for a new folder
    return folder


def check_out_dir(out: Path, allowed, what: str) -> None:
    """Refuse an --out whose replacement would lose something: a file, a link, or a folder holding
    anything but files named in `allowed` (what a previous `what` wrote). For example `--out results`
    is refused with "--out results holds other files (base.bin, chat.bin, metrics.json, pretrain, sft, ...)".
    """
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserError(f"--out {out} exists and is not a directory")
    if not out.exists():
        return
    others = sorted(p.name for p in out.iterdir() if p.name not in allowed or p.is_symlink() or not p.is_file())
    if others:
        shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        raise UserError(
            f"--out {out} holds other files ({shown}); {what} into a new or empty directory, or a previous {what}"
        )


def move_into(tmp: Path, out: Path) -> None:
    """The finished files of `tmp` into `out`: a rename of the folder when `out` is new, else file by
    file, and a previous export's file that this one does not write (its tokenizer) is removed."""
    if not out.exists():
        os.replace(tmp, out)
        return
    written = {p.name for p in tmp.iterdir()}
    for name in sorted(written):
        os.replace(tmp / name, out / name)
    for name in EXPORT_FILES:
        if name not in written:
            (out / name).unlink(missing_ok=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", required=True, help="checkpoint to export (results/base.bin, results/chat.bin, ...)")
    parser.add_argument("--out", required=True, help="directory to write: a new one, an empty one or a previous export")


def run(args: argparse.Namespace) -> int:
    files = export(args.ckpt, args.out)
    print(f"wrote {args.out}: {', '.join(files)} (LlamaForCausalLM; load with from_pretrained)")
    return 0
