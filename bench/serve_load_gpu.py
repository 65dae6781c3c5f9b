"""Load test of `nanoeuler serve` on a GPU: 1, 8, 32 and 64 concurrent streaming clients, and the in-process
engine's batched tokens/s beside each level.

    python bench/serve_load_gpu.py --ckpt results/chat.bin                 # the 116M chat model, bf16 on the GPU
    python bench/serve_load_gpu.py --ckpt results/chat.bin --levels 1,8 --requests 2 --max-tokens 64
    python bench/serve_load_gpu.py --url http://127.0.0.1:8081 --ckpt results/chat.bin   # another server (llama-server)
    python bench/serve_load_gpu.py --device cpu --levels 1,2 --requests 1 --max-tokens 8  # a smoke run, no GPU

Needs the `serve` extra and `httpx2` (the clients) where it runs; CuPy for `--device gpu`. One command on a
GPU machine, from the repository's root: `python bench/serve_load_gpu.py --ckpt results/chat.bin`.

For each level L: L clients each send --requests streamed /v1/completions requests back to back (the chat
template already applied to one of eight questions, so every server sees the same prompt; greedy,
`ignore_eos`, --max-tokens tokens each, `stream_options.include_usage`). A request counts as a failure unless
its stream is whole (one id, a finish_reason, `data: [DONE]`) and its usage says --max-tokens tokens.
Per level it prints: generated tokens/s (all clients), time to first token p50/p99, inter-token latency
p50/p99 (between a stream's consecutive text chunks), failures, and the peer: the same model in this
process (`DecodeEngine.generate`, L prompts decoded as one batch, no server; measured in a child process
before the server starts, so the server's memory sizing sees an empty GPU).

Comparing with llama.cpp's llama-server (not built here): export the model to Hugging Face format and
convert it with llama.cpp's own script, then serve it with as many parallel slots as the top level:

    nanoeuler export-hf --ckpt results/chat.bin --out hf/chat          # LlamaForCausalLM, no MTP heads
    python llama.cpp/convert_hf_to_gguf.py hf/chat --outtype bf16 --outfile chat-bf16.gguf
    llama-server -m chat-bf16.gguf -ngl 99 --parallel 64 --ctx-size $((64 * 512)) --cont-batching \\
        --port 8081 --metrics
    python bench/serve_load_gpu.py --url http://127.0.0.1:8081 --ckpt results/chat.bin

(`--ctx-size` is shared by the slots: 64 x the 116M model's 512 positions. llama-server takes `max_tokens`,
`ignore_eos` and `stream_options` on /v1/completions; its prompt is our rendered template, tokenized by
its copy of our tokenizer.) Both servers then answer the same prompts with the same number of tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402

from serve_load import QUESTIONS, small_model  # noqa: E402


def prompt_texts(n: int) -> list[str]:
    from nanoeuler.data.template import render_prompt

    return [render_prompt(QUESTIONS[i % len(QUESTIONS)]) for i in range(n)]


def peer(ckpt: Path, device: str, rows: int, max_tokens: int) -> float:
    """Batched greedy decoding of `rows` prompts in this process: generated tokens/s (best of two runs)."""
    from nanoeuler.infer.engine import load
    from nanoeuler.infer.sampling import Sampling

    engine, tok, _ = load(ckpt, device)
    ids = [tok.encode(t) for t in prompt_texts(rows)]
    best = 0.0
    for _ in range(3):  # the first run compiles kernels and records graphs
        t0 = time.perf_counter()
        out = engine.generate(ids, max_tokens, Sampling(temperature=0), speculative=False)
        best = max(best, sum(len(o) for o in out) / (time.perf_counter() - t0))
    return best


def start_server(ckpt: Path, args) -> tuple[subprocess.Popen, str]:
    import re

    cmd = [sys.executable, "-m", "nanoeuler", "serve", "--ckpt", str(ckpt), "--device", args.device, "--port", "0",
           "--max-batch", str(max(args.levels)), "--max-queue", str(4 * max(args.levels)),
           "--max-tokens", str(args.max_tokens), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    while True:
        line = proc.stderr.readline()
        found = re.search(r"at (http://[^/]+)/", line)
        if found:
            return proc, found.group(1)
        if not line:  # the server ended before saying where it listens
            raise SystemExit(f"the server did not start: {proc.stderr.read()}")
        print(line, end="", file=sys.stderr)  # e.g. the note that max_batch was lowered to fit


async def one_request(client, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "stream": True, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    arrivals, ids, finish, usage, done = [], set(), None, None, False
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return {"ok": False, "status": r.status_code}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                ids.add(chunk.get("id"))
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        arrivals.append(time.perf_counter())
                    finish = choice.get("finish_reason") or finish
    except Exception as exc:  # a dropped connection is a failure of this request, not of the run
        return {"ok": False, "status": type(exc).__name__}
    tokens = (usage or {}).get("completion_tokens", 0)
    return {"ok": done and finish is not None and len(ids) == 1 and tokens == max_tokens, "status": 200,
            "tokens": tokens, "ttft": (arrivals[0] if arrivals else time.perf_counter()) - t0,
            "gaps": list(np.diff(arrivals))}


async def level(url: str, clients: int, args) -> dict:
    import httpx2

    prompts = prompt_texts(clients)
    async with httpx2.AsyncClient(timeout=600, limits=httpx2.Limits(max_connections=clients + 4)) as client:
        async def one_client(i):
            return [await one_request(client, url, prompts[i], args.max_tokens) for _ in range(args.requests)]

        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(one_client(i) for i in range(clients))) for r in rs]
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] * 1e3 for r in ok]
    gaps = [g * 1e3 for r in ok for g in r["gaps"]]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    return {"clients": clients, "requests": len(results), "failures": len(results) - len(ok),
            "tokens_per_s": sum(r["tokens"] for r in ok) / wall, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "itl_p50": pct(gaps, 50), "itl_p99": pct(gaps, 99)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", type=Path, help="chat model file (default: a random-weight small model)")
    ap.add_argument("--url", help="load a server already running there instead of starting `nanoeuler serve`")
    ap.add_argument("--device", default="gpu", choices=["gpu", "cpu"])
    ap.add_argument("--levels", default="1,8,32,64", help="concurrent clients, comma-separated")
    ap.add_argument("--requests", type=int, default=4, help="requests per client at each level")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per answer")
    ap.add_argument("--peer-rows", type=int, help=argparse.SUPPRESS)  # the child that measures the peer
    args = ap.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    if args.peer_rows:
        print(json.dumps(peer(args.ckpt, args.device, args.peer_rows, args.max_tokens)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.ckpt is None:
            args.ckpt = Path(tmp) / "small.bin"
            small_model(args.ckpt)
        peers = {}
        for rows in args.levels:
            out = subprocess.run([sys.executable, __file__, "--ckpt", str(args.ckpt), "--device", args.device,
                                  "--max-tokens", str(args.max_tokens), "--peer-rows", str(rows)],
                                 capture_output=True, text=True, cwd=ROOT)
            peers[rows] = float(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else float("nan")
        proc, url = (None, args.url) if args.url else start_server(args.ckpt, args)
        try:
            asyncio.run(level(url, 1, argparse.Namespace(**{**vars(args), "requests": 1})))  # warm-up
            rows = [asyncio.run(level(url, clients, args)) for clients in args.levels]
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)
    print(f"\n{args.ckpt.name} on {args.device} ({url}), {args.requests} requests per client, "
          f"{args.max_tokens} tokens each, greedy")
    print(f"{'clients':>7} {'requests':>8} {'failures':>8} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8} {'peer tok/s':>10} {'/peer':>6}")
    for r in rows:
        p = peers[r["clients"]]
        print(f"{r['clients']:>7} {r['requests']:>8} {r['failures']:>8} {r['tokens_per_s']:>9.1f} "
              f"{r['ttft_p50']:>7.1f}ms {r['ttft_p99']:>7.1f}ms {r['itl_p50']:>6.2f}ms {r['itl_p99']:>6.2f}ms "
              f"{p:>10.1f} {r['tokens_per_s'] / p:>5.2f}x")
    return 0 if not any(r["failures"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
