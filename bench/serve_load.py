"""Load test of `nanoeuler serve` on loopback: concurrent streaming clients, every answer checked.

    python bench/serve_load.py                                    # small model, 32 clients x 20 requests
    python bench/serve_load.py --ckpt results/chat.bin --clients 8 --requests 5 --max-queue 4

Starts `nanoeuler serve` as a subprocess (a random-weight `small` model with a BPE tokenizer learned
on data/sample/ unless --ckpt is given), then:
1. the peer: the same model in this process, the engine that `infer.engine.load` gives, greedy on one
   prompt at a time: the tokens/s a single user gets without any server;
2. references: each client's prompt answered once by the server, one request at a time;
3. the load: `--clients` concurrent clients, each sending `--requests` streamed chat requests back to
   back (greedy, `ignore_eos`, `--max-tokens` tokens each). Every request must end in a complete stream
   (one id for all its chunks, a finish_reason, `data: [DONE]`, the reference text: no lost or mixed-up
   streams) or in a 429 (then the client waits `Retry-After` and sends its next request).
It prints one table: request counts, latency and time to first token percentiles, tokens/s per client,
the server's aggregate tokens/s and its ratio to the peer. Exits non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# One BLAS thread, here and in the server (set before NumPy loads): on a few shared cores a thread pool
# on the small model's 128-wide products costs far more than the arithmetic (13.8 vs 333 tokens/s
# measured for the peer on 2 busy cores). --blas-threads changes it for both.
if "--blas-threads" in sys.argv[:-1]:
    os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = sys.argv[sys.argv.index("--blas-threads") + 1]
else:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

QUESTIONS = [
    "Give three tips for staying healthy.",
    "What is the capital of France?",
    "Name a color.",
    "Describe the sea.",
    "Write a short poem about a fox.",
    "Summarize the history of science.",
    "Translate 'good morning' to French.",
    "List four fruits.",
]


def small_model(path: Path) -> None:
    """A random-weight `small` model (the CPU showcase's size) carrying a 512-token BPE tokenizer."""
    from nanoeuler import checkpoint
    from nanoeuler.model.config import ModelConfig
    from nanoeuler.model.transformer import init_params
    from nanoeuler.tokenizer.bpe import train_bpe

    records = json.loads((ROOT / "data/sample/alpaca_data.json").read_text())
    text = "\n\n".join(r["instruction"] + "\n" + r["input"] + "\n" + r["output"] for r in records)
    tok = train_bpe(text, 512)
    cfg = ModelConfig.named("small")
    checkpoint.save_model(path, init_params(cfg, 0), cfg, step=0, tokenizer_json=tok.to_json())


def prompts(n: int) -> list[str]:
    return [f"{QUESTIONS[i % len(QUESTIONS)]} (client {i})" for i in range(n)]


def peer_tokens_per_s(ckpt: Path, questions: list[str], max_tokens: int) -> float:
    """Greedy decoding in this process, one prompt after another (median of the per-prompt rates)."""
    from nanoeuler.infer.engine import load
    from nanoeuler.infer.sampling import Sampling
    from nanoeuler.serve.prompts import chat_prompt

    gen, tok, _ = load(ckpt, "cpu")
    room = min(max_tokens, gen.cfg.ctx_len // 4)
    ids = [chat_prompt(tok, [("user", q)], gen.cfg.ctx_len, room)[0] for q in questions]
    list(gen.stream(ids[0], max_tokens, Sampling(temperature=0)))  # warm-up
    rates = []
    for p in ids:
        t0 = time.perf_counter()
        n = len(list(gen.stream(p, max_tokens, Sampling(temperature=0))))
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def start_server(ckpt: Path, args) -> tuple[subprocess.Popen, str]:
    return launch_server(ckpt, "cpu", args.max_batch, args.max_queue, args.max_tokens)


def launch_server(ckpt: Path, device: str, max_batch: int, max_queue: int, max_tokens: int, extra=()):
    """`nanoeuler serve` on a free loopback port, started as a child: (the process, its URL), once it says
    where it listens (what it prints before, e.g. that max_batch was lowered to fit, passes through)."""
    cmd = [sys.executable, "-m", "nanoeuler", "serve", "--ckpt", str(ckpt), "--device", device, "--port", "0"]
    cmd += ["--max-batch", str(max_batch), "--max-queue", str(max_queue), "--max-tokens", str(max_tokens)]
    proc = subprocess.Popen(cmd + ["--log-level", "warning", *extra], stderr=subprocess.PIPE, text=True, cwd=ROOT)
    while True:
        line = proc.stderr.readline()
        found = re.search(r"at (http://[^/]+)/", line)
        if found:
            return proc, found.group(1)
        if not line:  # the server ended before saying where it listens
            raise SystemExit(f"the server did not start: {proc.stderr.read()}")
        print(line, end="", file=sys.stderr)


async def stream_once(client, url: str, question: str, max_tokens: int) -> dict:
    """One streamed chat request: its outcome, text, chunk ids, timings."""
    body = {
        "messages": [{"role": "user", "content": question}],
        "stream": True,
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "retry_after": float(r.headers.get("retry-after", "0"))}
        events, ids, text, finish = [], set(), [], None
        async for line in r.aiter_lines():
            if not line:
                continue
            events.append(line)
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[len("data: ") :])
            ids.add(chunk["id"])
            choice = chunk["choices"][0]
            if choice["delta"].get("content"):
                first = first or time.perf_counter()
                text.append(choice["delta"]["content"])
            finish = choice["finish_reason"] or finish
    t1 = time.perf_counter()
    return {
        "status": 200,
        "text": "".join(text),
        "ids": ids,
        "finish": finish,
        "done": events[-1] == "data: [DONE]",
        "latency": t1 - t0,
        "ttft": (first or t1) - t0,
        "tokens": max_tokens,
    }


async def load_phase(url: str, questions: list[str], refs: list[str], args) -> tuple[list[dict], float]:
    import httpx2

    limits = httpx2.Limits(max_connections=len(questions) + 4)
    async with httpx2.AsyncClient(timeout=600, limits=limits) as client:

        async def one_client(i):
            out = []
            for _ in range(args.requests):
                r = await stream_once(client, url, questions[i], args.max_tokens)
                r["client"] = i
                if r["status"] == 200:
                    r["ok"] = len(r["ids"]) == 1 and r["done"] and r["finish"] == "length" and r["text"] == refs[i]
                else:
                    await asyncio.sleep(r.get("retry_after", 1))
                out.append(r)
            return out

        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(one_client(i) for i in range(len(questions))))
        wall = time.perf_counter() - t0
    return [r for rs in per_client for r in rs], wall


async def references(url: str, questions: list[str], max_tokens: int) -> list[str]:
    import httpx2

    async with httpx2.AsyncClient(timeout=600) as client:
        return [(await stream_once(client, url, q, max_tokens))["text"] for q in questions]


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def report(results: list[dict], wall: float, peer: float, args) -> bool:
    done = [r for r in results if r["status"] == 200]
    busy = [r for r in results if r["status"] == 429]
    other = [r for r in results if r["status"] not in (200, 429)]
    bad = [r for r in done if not r["ok"]]
    ids = [i for r in done for i in r["ids"]]
    per_client = []
    for c in range(args.clients):
        mine = [r for r in done if r["client"] == c]
        if mine:
            per_client.append(sum(r["tokens"] for r in mine) / sum(r["latency"] for r in mine))
    tokens = sum(r["tokens"] for r in done)
    lat, ttft = [r["latency"] * 1e3 for r in done], [r["ttft"] * 1e3 for r in done]
    rows = [
        ("requests", f"{len(results)} = {len(done)} answered + {len(busy)} refused (429) + {len(other)} other"),
        ("checks", f"{len(bad)} wrong or incomplete streams, {len(ids) - len(set(ids))} repeated stream ids"),
        ("latency ms p50 / p90 / max", f"{pct(lat, 50):.0f} / {pct(lat, 90):.0f} / {max(lat, default=0):.0f}"),
        ("first token ms p50 / p90", f"{pct(ttft, 50):.0f} / {pct(ttft, 90):.0f}"),
        (
            "tokens/s per client min / median / max",
            f"{min(per_client, default=0):.1f} / {statistics.median(per_client) if per_client else 0:.1f} / "
            f"{max(per_client, default=0):.1f}",
        ),
        ("server tokens/s (all clients)", f"{tokens / wall:.1f}  ({tokens} tokens in {wall:.1f} s)"),
        ("peer: in-process, one prompt at a time", f"{peer:.1f} tokens/s"),
        ("server / peer", f"{tokens / wall / peer:.2f}x"),
    ]
    width = max(len(k) for k, _ in rows)
    print(
        f"\nclients {args.clients} x requests {args.requests}, max_tokens {args.max_tokens}, "
        f"max_batch {args.max_batch}, max_queue {args.max_queue}, BLAS threads {os.environ['OPENBLAS_NUM_THREADS']}"
    )
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return not bad and not other and len(set(ids)) == len(ids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", type=Path, help="chat model file (default: a random-weight small model)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=20, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--blas-threads", default="1", help="OPENBLAS_NUM_THREADS of this process and the server")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.ckpt
        if ckpt is None:
            ckpt = Path(tmp) / "small.bin"
            small_model(ckpt)
        questions = prompts(args.clients)
        peer = peer_tokens_per_s(ckpt, questions[: min(8, len(questions))], args.max_tokens)
        proc, url = start_server(ckpt, args)
        try:
            refs = asyncio.run(references(url, questions, args.max_tokens))
            results, wall = asyncio.run(load_phase(url, questions, refs, args))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return 0 if report(results, wall, peer, args) else 1


if __name__ == "__main__":
    sys.exit(main())
