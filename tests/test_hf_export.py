"""HF transformers as an oracle: an exported checkpoint loads offline as LlamaForCausalLM and its logits
match head 0 of ours to 1e-4 in float32."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from nanoeuler import checkpoint  # noqa: E402
from nanoeuler.cli import main  # noqa: E402
from nanoeuler.export import hf  # noqa: E402
from nanoeuler.model import transformer  # noqa: E402
from nanoeuler.model.config import ModelConfig  # noqa: E402

CONFIGS = {
    "gqa2": ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ctx_len=32, mtp_heads=2),
    "gqa3": ModelConfig(
        vocab_size=61,
        dim=48,
        n_layers=3,
        n_heads=6,
        n_kv_heads=2,
        ctx_len=24,
        ffn_hidden=72,
        mtp_heads=3,
        rope_theta=500.0,
        norm_eps=1e-6,
    ),
    "mha": ModelConfig(vocab_size=40, dim=16, n_layers=1, n_heads=2, n_kv_heads=2, ctx_len=16, mtp_heads=1),
}


def _params(cfg, seed):
    """Weights big enough that logits vary by several units (the default init gives near-uniform ones)."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in cfg.param_shapes().items():
        if name.endswith("norm.weight"):
            params[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            params[name] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    return params


def _load_hf(path):
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    return model.eval()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(tmp_path, name):
    cfg = CONFIGS[name]
    params = _params(cfg, seed=len(name))
    checkpoint.save_model(tmp_path / "m.bin", params, cfg, step=7, tokenizer_json=None)
    assert main(["export-hf", "--ckpt", str(tmp_path / "m.bin"), "--out", str(tmp_path / "hf")]) == 0
    model = _load_hf(tmp_path / "hf")
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(3, cfg.ctx_len))
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    ours = transformer.logits(params, ids, cfg)
    assert ours.dtype == np.float32 and theirs.shape == ours.shape
    assert np.abs(theirs).max() > 1.0  # the logits are not trivially flat
    assert np.abs(ours - theirs).max() <= 1e-4


def test_config_fields_and_tensor_names(tmp_path):
    cfg = CONFIGS["gqa3"]
    params = _params(cfg, seed=0)
    checkpoint.save_model(tmp_path / "m.bin", params, cfg, step=0, tokenizer_json=None)
    files = hf.export(tmp_path / "m.bin", tmp_path / "hf")
    assert files == ["config.json", "model.safetensors"]
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLM"]
    assert (
        conf["hidden_size"],
        conf["intermediate_size"],
        conf["num_attention_heads"],
        conf["num_key_value_heads"],
        conf["num_hidden_layers"],
    ) == (48, 72, 6, 2, 3)
    assert conf["tie_word_embeddings"] is False and conf["attention_bias"] is False and conf["mlp_bias"] is False
    loaded = transformers.AutoConfig.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert loaded.rms_norm_eps == 1e-6 and loaded.max_position_embeddings == 24
    theta = getattr(loaded, "rope_parameters", None) or {"rope_theta": loaded.rope_theta}
    assert theta["rope_theta"] == 500.0
    from safetensors.numpy import load_file

    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    assert "lm_head.weight" in tensors and "model.embed_tokens.weight" in tensors
    assert not any("mtp" in n for n in tensors)
    np.testing.assert_array_equal(
        tensors["model.layers.2.mlp.down_proj.weight"], params["layers.2.mlp.down_proj.weight"]
    )
    # re-export replaces the directory
    assert hf.export(tmp_path / "m.bin", tmp_path / "hf") == files


def test_tokenizer_is_exported_when_the_checkpoint_has_one(tmp_path):
    bpe = pytest.importorskip("nanoeuler.tokenizer.bpe")
    pytest.importorskip("nanoeuler.tokenizer.hf")
    tok = bpe.train_bpe("the cat sat on the mat; the cat ate the rat. " * 20, 300)
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ctx_len=16, mtp_heads=1)
    params = _params(cfg, seed=2)
    checkpoint.save_model(tmp_path / "m.bin", params, cfg, step=1, tokenizer_json=tok.to_json())
    files = hf.export(tmp_path / "m.bin", tmp_path / "hf")
    assert "tokenizer.json" in files and "tokenizer_config.json" in files
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path / "hf", local_files_only=True)
    text = "the cat sat on the rat"
    assert fast(text)["input_ids"] == tok.encode(text)
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["eos_token_id"] == [tok.end_id, tok.eot_id]


def test_bad_checkpoint_is_a_user_error(tmp_path, capsys):
    (tmp_path / "bad.bin").write_bytes(b"\x00" * 5)
    assert main(["export-hf", "--ckpt", str(tmp_path / "bad.bin"), "--out", str(tmp_path / "hf")]) == 1
    assert "truncated" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
