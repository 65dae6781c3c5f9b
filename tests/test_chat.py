"""The chat REPL, driven through a pipe: template, streaming, stop at </s>, empty lines, long prompts, Ctrl-D."""

import subprocess
import sys

import pytest

from nanoeuler import checkpoint
from nanoeuler.data.template import render_prompt
from nanoeuler.infer.chat import answer
from nanoeuler.infer.generate import Generator, decode_stream
from nanoeuler.infer.sampling import Sampling
from train_fixtures import make_tokenizer, save_random_model


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def model_file(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("chat") / "chat.bin"
    save_random_model(path, tok)
    return path


def chat(path, stdin, *extra):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "nanoeuler",
            "chat",
            "--ckpt",
            str(path),
            "--device",
            "cpu",
            "--max-new-tokens",
            "8",
            *extra,
        ],
        input=stdin,
        capture_output=True,
        timeout=120,
    )


def test_decode_stream_prints_multibyte_characters_whole(tok):
    text = "héllo wörld ✓ ünïcödé — ok"
    ids = tok.encode(text)
    assert len(ids) > len(text.encode("utf-8")) // 3  # multi-byte characters are split over byte tokens
    pieces = list(decode_stream(tok, ids))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert list(decode_stream(tok, tok.encode("✓")[:1])) == ["\ufffd"]  # a torn character is replaced at the end


def test_answer_streams_one_piece_per_token(tok, tmp_path):
    params, cfg = save_random_model(tmp_path / "m.bin", tok)
    gen = Generator(params, cfg)
    greedy = Sampling(temperature=0.0)
    pieces = []
    ids = answer(gen, tok, "Name a color.", 10, greedy, pieces.append)
    assert len(ids) == 10 and "".join(pieces) == tok.decode(ids)
    prompt = tok.encode(render_prompt("Name a color."))
    assert ids == gen.generate(prompt, 10, greedy)


class ScriptedGenerator:
    """Stands in for a model: yields a fixed token sequence (and stops after a stop id, as Generator does)."""

    def __init__(self, cfg, script):
        self.cfg, self.script, self.prompts = cfg, script, []

    def stream(self, prompt_ids, max_new_tokens, sampling, stop_ids=frozenset()):
        self.prompts.append(prompt_ids)
        for t in self.script[:max_new_tokens]:
            yield t
            if t in stop_ids:
                return


def test_answer_stops_at_end_marker_and_truncates_long_prompts(tok, tmp_path, capsys):
    _, cfg = save_random_model(tmp_path / "m.bin", tok)
    words = tok.encode(" sea calm")
    gen = ScriptedGenerator(cfg, words + [tok.end_id] + words)
    pieces = []
    assert answer(gen, tok, "Say it.", 50, Sampling(), pieces.append) == words
    assert "".join(pieces) == " sea calm"
    assert gen.prompts[0] == tok.encode(render_prompt("Say it."))
    answer(gen, tok, "word " * 500, 50, Sampling(), pieces.append)
    assert len(gen.prompts[1]) == cfg.ctx_len - cfg.ctx_len // 4
    assert gen.prompts[1][-len(tok.encode("### Response:\n")) :] == tok.encode("### Response:\n")
    assert "left-truncated" in capsys.readouterr().err


def test_repl_over_a_pipe(model_file):
    lines = ["Name a color.", "", "   ", "word " * 200, "Dîtes ✓ bonjour"]
    r = chat(model_file, ("\n".join(lines) + "\n").encode("utf-8"))
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.decode("utf-8")
    assert out.count("> ") == len(lines) + 1  # a prompt per line, and one before end of input
    assert "left-truncated" in r.stderr.decode()
    assert "Ctrl-D" in r.stderr.decode()


def test_repl_is_seeded_and_quits(model_file):
    text = "What is the capital of France?\nWhat is the capital of France?\n/quit\nnever read\n".encode()
    a = chat(model_file, text, "--temperature", "1.0", "--seed", "3")
    b = chat(model_file, text, "--temperature", "1.0", "--seed", "3")
    assert a.returncode == 0 and a.stdout == b.stdout
    turns = a.stdout.decode().split("> ")
    assert len(turns) == 4  # '', answer 1, answer 2, '' before /quit
    r = chat(model_file, b"")
    assert r.returncode == 0 and r.stdout.decode() == "> \n"


def test_model_without_tokenizer_is_refused(tmp_path, tok):
    from nanoeuler.model.config import ModelConfig
    from nanoeuler.model.transformer import init_params
    from train_fixtures import TINY_MODEL

    cfg = ModelConfig.from_section(TINY_MODEL, tok.vocab_size)
    checkpoint.save_model(tmp_path / "bare.bin", init_params(cfg, 0), cfg, step=0, tokenizer_json=None)
    r = chat(tmp_path / "bare.bin", b"hi\n")
    assert r.returncode == 1 and b"carries no tokenizer" in r.stderr
