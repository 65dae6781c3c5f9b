"""Load test of `nanoeuler serve` on a GPU: 1, 8, 32 and 64 concurrent streaming clients, and the in-process
engine's batched tokens/s beside each level.

    python bench/serve_load_gpu.py --ckpt results/chat.bin                 # the 116M chat model, bf16 on the GPU
    python bench/serve_load_gpu.py --ckpt results/chat.bin --levels 1,8 --requests 2 --max-tokens 64
    python bench/serve_load_gpu.py --ckpt results/chat.bin --levels 32 --loop  # and the loop without HTTP
    python bench/serve_load_gpu.py --url http://127.0.0.1:8081 --ckpt results/chat.bin   # another server (llama-server)
    python bench/serve_load_gpu.py --device cpu --levels 1,2 --requests 1 --max-tokens 8  # a smoke run, no GPU
    python bench/serve_load_gpu.py --preset gpu --prefix 400 --soak 240     # the 116M model, random weights
    python bench/serve_load_gpu.py --preset gpu --save-model gpu.bin        # only write that model file

Needs the `serve` extra and `httpx2` (the clients) where it runs; CuPy for `--device gpu`. One command on a
GPU machine, from the repository's root: `python bench/serve_load_gpu.py --ckpt results/chat.bin`.

For each level L: L clients each send --requests streamed /v1/completions requests back to back (the chat
template already applied to one of eight questions, so every server sees the same prompt; greedy,
`ignore_eos`, --max-tokens tokens each, `stream_options.include_usage`). A request counts as a failure unless
its stream is whole (one id, a finish_reason, `data: [DONE]`) and its usage says --max-tokens tokens.
Each level runs first with --warmup requests per client, unmeasured: a server records a CUDA graph for each
new batch width and prompt length on their first calls, as the peer's first run does (its best run counts).
Per level it prints: generated tokens/s (all clients), time to first token p50/p99, inter-token latency
p50/p99 (between a stream's consecutive text chunks), the server's own mean time to first token (its
/metrics: submitted to first token, no HTTP) and the engine process's share of it (queued there to handed
out), failures, and the peer: the same model in this
process (`DecodeEngine.generate`, L prompts decoded as one batch, no server; measured in a child process
before the server starts, so the server's memory sizing sees an empty GPU). With `--loop`, also the server's
generation loop alone (`looped`: its `Backend` and `Scheduler` in a child process, no HTTP, each client's
next request submitted the moment its last one ends, the streams' ends spread over a request's length):
what continuous batching costs by itself (prompts that arrive one by one are prefilled between decode
steps), apart from what HTTP and the second process add.

Without --ckpt the model has random weights: the `small` preset, or with `--preset gpu` the full run's 116M
model with a 4096-token BPE learned on the shipped Alpaca sample and this repository's documents (tokens/s do
not depend on training; every answer has --max-tokens tokens, `ignore_eos`). `--prefix N`: time to first
token of requests (token ids, one new token) whose N-token prefix is cached against ones whose prefix is new,
one request at a time, median of --prefix-repeats each. `--soak S`: the top level's clients go on for S
seconds while /metrics is read every 10 s (the server's resident memory, both processes, and CuPy pool): the
samples, their first-to-last change, and the soak's failures. `--speculative` starts the server with it (greedy requests
speculate; with random weights no draft is kept, so it only shows the cost).

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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402

from serve_load import QUESTIONS, launch_server, small_model  # noqa: E402


def gpu_model(path: Path) -> None:
    """A random-weight model of the `gpu` preset (116M parameters) with a 4096-token BPE tokenizer."""
    from nanoeuler import checkpoint
    from nanoeuler.model.config import ModelConfig
    from nanoeuler.model.transformer import init_params
    from nanoeuler.tokenizer.bpe import train_bpe

    records = json.loads((ROOT / "data/sample/alpaca_data.json").read_text())
    texts = [r["instruction"] + "\n" + r["input"] + "\n" + r["output"] for r in records]
    texts += [
        f.read_text() for f in [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    ]
    tok = train_bpe("\n\n".join(texts), 4096)
    cfg = ModelConfig.from_section({"preset": "gpu"}, tok.vocab_size)
    checkpoint.save_model(path, init_params(cfg, 0), cfg, step=0, tokenizer_json=tok.to_json())


def prompt_texts(n: int) -> list[str]:
    from nanoeuler.data.template import render_prompt

    return [render_prompt(QUESTIONS[i % len(QUESTIONS)]) for i in range(n)]


def peer(ckpt: Path, device: str, rows: int, max_tokens: int, temperature: float = 0.0) -> float:
    """Batched decoding of `rows` prompts in this process, greedy or sampled at `temperature` (top-p 1, no
    top-k, as the requests): generated tokens/s (best of two runs). Greedy steps feed themselves on the
    GPU (`greedy_steps`), queued ahead of the host; sampled ones run one at a time, as the server's do."""
    from nanoeuler.infer.engine import load
    from nanoeuler.infer.sampling import Sampling

    engine, tok, _ = load(ckpt, device)
    ids = [tok.encode(t) for t in prompt_texts(rows)]
    best = 0.0
    for _ in range(3):  # the first run compiles kernels and records graphs
        t0 = time.perf_counter()
        sampling = Sampling(temperature=temperature, top_k=0, top_p=1.0)
        out = engine.generate(ids, max_tokens, sampling, speculative=False)
        best = max(best, sum(len(o) for o in out) / (time.perf_counter() - t0))
    return best


def looped(ckpt: Path, device: str, clients: int, slots: int, requests: int, max_tokens: int, warmup: int) -> float:
    """The server's generation loop alone: `nanoeuler serve`'s `Backend` (`slots` of them, warmed up) and
    `Scheduler` in this process, no HTTP and no second process. `clients` streams each submit their next
    request the moment the last one ends (from the worker thread's `send`), `requests` each, greedy and
    `ignore_eos`; generated tokens/s of the measured run, after `warmup` requests each. Client c's first
    request asks for (c + 1) / clients of `max_tokens`, so the streams end one by one, as a server's clients
    do once HTTP has spread them, and never all at once (which would make every prefill a joint one).
    Between the peer (every prompt prefilled at once) and the server, it shows what continuous batching
    costs by itself (prompts arriving one by one, prefilled between decode steps), apart from HTTP."""
    from nanoeuler.serve.backend import Backend

    backend = Backend.load(ckpt, device, slots=slots)
    loop_rate(backend, clients, warmup, max_tokens)
    return loop_rate(backend, clients, requests, max_tokens)


def loop_rate(backend, clients: int, per_client: int, max_tokens: int) -> float:
    """`looped`'s run on a loaded `Backend`: generated tokens/s (every token counted as it is sent)."""
    from nanoeuler.serve.backend import Sampling
    from nanoeuler.serve.scheduler import END, Scheduler

    ids = [backend.tok.encode(t) for t in prompt_texts(clients)]
    firsts = [max(1, max_tokens * (c + 1) // clients) for c in range(clients)]
    left, got, ended, failed, done = [per_client - 1] * clients, [0], [0], [], threading.Event()

    def spec(c: int, n: int = max_tokens) -> tuple:
        return (ids[c], n, Sampling(temperature=0.0), False, {})

    def send(batch) -> None:  # on the worker thread: a client whose request ended sends its next
        for job, items in batch:
            if isinstance(items[-1], BaseException):  # a job's failure ends the run
                failed.append(items[-1])
                done.set()
                return
            got[0] += len(items) - (items[-1] is END)
            if items[-1] is not END:
                continue
            if left[job.key]:
                left[job.key] -= 1
                scheduler.submit_many([spec(job.key)], keys=[job.key])
            else:
                ended[0] += 1
                if ended[0] == clients:
                    done.set()

    scheduler = Scheduler(backend, backend.capacity, clients, send).start()
    t0 = time.perf_counter()
    scheduler.submit_many([spec(c, n) for c, n in enumerate(firsts)], keys=list(range(clients)))
    done.wait()
    seconds = time.perf_counter() - t0
    scheduler.stop()
    if failed:
        raise RuntimeError(f"a request of the loop failed: {failed[0]!r}") from failed[0]
    expected = sum(firsts) + clients * (per_client - 1) * max_tokens
    if got[0] != expected:
        raise RuntimeError(f"the loop generated {got[0]} tokens, not {expected}")
    return got[0] / seconds


def _child(args, flag: str, n: int) -> float:
    """The peer (`--peer-rows n`) or the loop alone (`--loop-clients n`), measured in a child process so that
    each sees the GPU to itself; NaN where it failed."""
    cmd = [sys.executable, __file__, "--ckpt", str(args.ckpt), "--device", args.device, flag, str(n)]
    cmd += ["--max-tokens", str(args.max_tokens), "--temperature", str(args.temperature)]
    cmd += ["--levels", ",".join(map(str, args.levels)), "--requests", str(args.requests), "--warmup", str(args.warmup)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        print(f"{flag} {n} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
        return float("nan")
    return float(out.stdout.strip().splitlines()[-1])


def start_server(ckpt: Path, args) -> tuple[subprocess.Popen, str]:
    top = max(args.levels)
    extra = (["--speculative"] if args.speculative else []) + args.serve_args.split()
    return launch_server(ckpt, args.device, top, 4 * top, args.max_tokens, extra)


async def one_request(client, url: str, prompt: str, max_tokens: int, temperature: float = 0.0) -> dict:
    body = {
        "prompt": prompt,
        "stream": True,
        "temperature": temperature,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
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
    return {
        "ok": done and finish is not None and len(ids) == 1 and tokens == max_tokens,
        "status": 200,
        "tokens": tokens,
        "ttft": (arrivals[0] if arrivals else time.perf_counter()) - t0,
        "gaps": list(np.diff(arrivals)),
    }


async def server_ttft(client, url: str, name: str = "nanoeuler_time_to_first_token_seconds"):
    """The server's own count and sum of seconds to first token (its /metrics: submitted to first token,
    no HTTP; or `name`'s, e.g. the engine process's share), or None for a server without them."""
    r = await client.get(url + "/metrics")
    if r.status_code != 200:
        return None
    values = dict(line.rsplit(" ", 1) for line in r.text.splitlines() if " " in line and not line.startswith("#"))
    if f"{name}_count" not in values:
        return None
    return float(values[f"{name}_count"]), float(values[f"{name}_sum"])


async def prefix_ttft(url: str, args, vocab: int) -> tuple[float, float, tuple | None]:
    """Median time to first token (ms) of one-token answers whose --prefix tokens are new, and cached; and
    the server's own mean of each (ms, from its /metrics; None where it has none), which tells what the
    HTTP round trip and the client add."""
    import httpx2

    rng = np.random.default_rng(0)
    ids = lambda n: [int(t) for t in rng.integers(10, vocab - 10, n)]  # noqa: E731
    async with httpx2.AsyncClient(timeout=600) as client:

        async def one(prompt):
            t0 = time.perf_counter()
            r = await client.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
            r.raise_for_status()
            return (time.perf_counter() - t0) * 1e3

        m0 = await server_ttft(client, url)
        fresh = [await one(ids(args.prefix) + ids(16)) for _ in range(args.prefix_repeats)]
        m1 = await server_ttft(client, url)
        shared = ids(args.prefix)
        await one(shared + ids(16))  # puts the prefix in the cache
        m2 = await server_ttft(client, url)
        cached = [await one(shared + ids(16)) for _ in range(args.prefix_repeats)]
        m3 = await server_ttft(client, url)
    mean = lambda a, b: (b[1] - a[1]) / max(b[0] - a[0], 1) * 1e3  # noqa: E731
    own = (mean(m0, m1), mean(m2, m3)) if None not in (m0, m1, m2, m3) else None
    return float(np.median(fresh)), float(np.median(cached)), own


async def soak(url: str, args) -> dict:
    """The top level's clients for --soak seconds, /metrics read every 10 s: (seconds, RSS, pool) samples."""
    import httpx2

    clients, stop = max(args.levels), time.perf_counter() + args.soak
    prompts, samples, results = prompt_texts(clients), [], []
    async with httpx2.AsyncClient(timeout=600, limits=httpx2.Limits(max_connections=clients + 4)) as client:

        async def one_client(i):
            while time.perf_counter() < stop:
                results.append(await one_request(client, url, prompts[i], args.max_tokens))

        async def sampler():
            t0 = time.perf_counter()
            while time.perf_counter() < stop:
                text = (await client.get(url + "/metrics")).text
                values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
                samples.append(
                    (
                        time.perf_counter() - t0,
                        # the HTTP process's and the engine process's
                        float(values.get("process_resident_memory_bytes", "nan"))
                        + float(values.get("nanoeuler_engine_resident_memory_bytes", 0)),
                        float(values.get('nanoeuler_gpu_pool_bytes{kind="held"}', "nan")),
                    )
                )
                await asyncio.sleep(10)

        await asyncio.gather(sampler(), *(one_client(i) for i in range(clients)))
    return {
        "samples": samples,
        "requests": len(results),
        "failures": sum(not r["ok"] for r in results),
        "tokens": sum(r.get("tokens", 0) for r in results if r["ok"]),
    }


async def _clients(url: str, indices: list, args, start_at: float) -> tuple[list, float]:
    """Clients `indices` of a level from `start_at` (time.monotonic, one clock for every process): their
    requests' results and when the last ended."""
    import httpx2

    prompts = prompt_texts(max(indices) + 1)
    limits = httpx2.Limits(max_connections=len(indices) + 4)
    async with httpx2.AsyncClient(timeout=600, limits=limits) as client:

        async def one_client(i):
            return [
                await one_request(client, url, prompts[i], args.max_tokens, args.temperature)
                for _ in range(args.requests)
            ]

        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        results = [r for rs in await asyncio.gather(*(one_client(i) for i in indices)) for r in rs]
    return results, time.monotonic()


def _clients_process(url: str, indices: list, args, start_at: float) -> tuple[list, float]:
    return asyncio.run(_clients(url, indices, args, start_at))


def client_processes(clients: int, wanted: int | None) -> int:
    """Processes the level's clients are spread over: one parses ~15k events/s, about what 32 streams of
    the 116M model on an H100 ask for, so a level of 32 or more gets several (a client-bound figure would be
    the client's, not the server's).

        >>> [client_processes(n, None) for n in (1, 8, 32, 64)]
        [1, 1, 4, 8]
    """
    return max(1, min(clients, wanted if wanted else clients // 8))


def level(url: str, clients: int, args) -> dict:
    """One level: `clients` streaming clients in `client_processes` processes, started together."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    procs = client_processes(clients, args.client_procs)
    parts = [list(range(clients))[p::procs] for p in range(procs)]
    own0 = asyncio.run(_own_ttft(url))
    start_at = time.monotonic() + (3.0 if procs > 1 else 0.0)  # the processes' start-up before it
    if procs == 1:
        results, end = _clients_process(url, parts[0], args, start_at)
        ends = [end]
    else:
        with ProcessPoolExecutor(procs, mp_context=get_context("spawn")) as pool:
            done = list(pool.map(_clients_process, [url] * procs, parts, [args] * procs, [start_at] * procs))
        results, ends = [r for rs, _ in done for r in rs], [e for _, e in done]
    wall = max(ends) - start_at
    own1 = asyncio.run(_own_ttft(url))
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] * 1e3 for r in ok]
    gaps = [g * 1e3 for r in ok for g in r["gaps"]]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    return {
        "clients": clients,
        "procs": procs,
        "requests": len(results),
        "failures": len(results) - len(ok),
        "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "itl_p50": pct(gaps, 50),
        "itl_p99": pct(gaps, 99),
        # the server's own mean time to first token (submitted to first token: no HTTP), and of that the engine
        # process's (queued there to handed out), where it has them
        **{k: _mean_ms(own0[k], own1[k]) for k in ("own_ttft", "engine_ttft")},
    }


async def _own_ttft(url: str) -> dict:
    import httpx2

    async with httpx2.AsyncClient(timeout=60) as client:
        return {
            "own_ttft": await server_ttft(client, url),
            "engine_ttft": await server_ttft(client, url, "nanoeuler_engine_time_to_first_token_seconds"),
        }


def _mean_ms(before, after) -> float:
    """Mean ms of the values counted between two (count, sum) readings; NaN where there are none."""
    if before is None or after is None or after[0] <= before[0]:
        return float("nan")
    return (after[1] - before[1]) / (after[0] - before[0]) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", type=Path, help="chat model file (default: a random-weight small model)")
    ap.add_argument("--url", help="load a server already running there instead of starting `nanoeuler serve`")
    ap.add_argument("--device", default="gpu", choices=["gpu", "cpu"])
    ap.add_argument("--levels", default="1,8,32,64", help="concurrent clients, comma-separated")
    ap.add_argument("--requests", type=int, default=4, help="requests per client at each level")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per answer")
    ap.add_argument("--preset", default="small", choices=["small", "gpu"], help="the random model without --ckpt")
    ap.add_argument("--save-model", type=Path, metavar="BIN", help="write that random model there and stop")
    ap.add_argument("--prefix", type=int, default=0, help="tokens of a shared prefix to time (0: none)")
    ap.add_argument("--prefix-repeats", type=int, default=5)
    ap.add_argument("--soak", type=float, default=0, help="seconds of the top level after the levels (0: none)")
    ap.add_argument("--speculative", action="store_true", help="start the server with --speculative")
    ap.add_argument("--temperature", type=float, default=0.0, help="requests' and peer's (default 0: greedy)")
    ap.add_argument("--warmup", type=int, default=2, help="requests per client of each level's unmeasured run first")
    ap.add_argument("--serve-args", default="", help="more `nanoeuler serve` options, e.g. '--prefix-cache 0'")
    ap.add_argument(
        "--client-procs", type=int, help="processes a level's clients are spread over (default: one per 8 clients)"
    )
    ap.add_argument(
        "--loop", action="store_true", help="also time the server's generation loop alone (`looped`: no HTTP), greedy"
    )
    ap.add_argument("--peer-rows", type=int, help=argparse.SUPPRESS)  # the child that measures the peer
    ap.add_argument("--loop-clients", type=int, help=argparse.SUPPRESS)  # the child that measures `looped`
    args = ap.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    make = gpu_model if args.preset == "gpu" else small_model
    if args.save_model:
        make(args.save_model)
        return 0
    if args.peer_rows:
        print(json.dumps(peer(args.ckpt, args.device, args.peer_rows, args.max_tokens, args.temperature)))
        return 0
    if args.loop_clients:
        top = max(args.levels)
        rate = looped(args.ckpt, args.device, args.loop_clients, top, args.requests, args.max_tokens, args.warmup)
        print(json.dumps(rate))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.ckpt is None:
            args.ckpt = Path(tmp) / f"{args.preset}.bin"
            make(args.ckpt)
        peers = {rows: _child(args, "--peer-rows", rows) for rows in args.levels}
        loops = {n: _child(args, "--loop-clients", n) for n in args.levels} if args.loop else {}
        proc, url = (None, args.url) if args.url else start_server(args.ckpt, args)
        try:
            rows = []
            for clients in args.levels:
                # warm-up: the server records a CUDA graph for each new batch width and prompt length on their
                # first two calls, which a level's first requests meet (the peer's best run is warm too)
                level(url, clients, argparse.Namespace(**{**vars(args), "requests": args.warmup}))
                rows.append(level(url, clients, args))
            if args.prefix:
                from nanoeuler import checkpoint

                vocab = checkpoint.load_model(args.ckpt)[1].vocab_size
                fresh, cached, own = asyncio.run(prefix_ttft(url, args, vocab))
            soaked = asyncio.run(soak(url, args)) if args.soak else None
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)
    print(
        f"\n{args.ckpt.name} on {args.device} ({url}), {args.requests} requests per client, "
        f"{args.max_tokens} tokens each, {'greedy' if args.temperature <= 0 else f'temperature {args.temperature:g}'}; "
        f"client processes {', '.join(str(r['procs']) for r in rows)}"
    )
    print(
        f"{'clients':>7} {'requests':>8} {'failures':>8} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8} {'own TTFT':>9} {'engine':>8} {'peer tok/s':>10} {'/peer':>6}"
        + (f" {'loop tok/s':>10} {'/peer':>6}" if loops else "")
    )
    for r in rows:
        p = peers[r["clients"]]
        loop = loops.get(r["clients"])
        print(
            f"{r['clients']:>7} {r['requests']:>8} {r['failures']:>8} {r['tokens_per_s']:>9.1f} "
            f"{r['ttft_p50']:>7.1f}ms {r['ttft_p99']:>7.1f}ms {r['itl_p50']:>6.2f}ms {r['itl_p99']:>6.2f}ms "
            f"{r['own_ttft']:>7.1f}ms {r['engine_ttft']:>6.1f}ms "
            f"{p:>10.1f} {r['tokens_per_s'] / p:>5.2f}x" + (f" {loop:>10.1f} {loop / p:>5.2f}x" if loops else "")
        )
    if args.prefix:
        print(
            f"prefix reuse, {args.prefix} shared tokens + 16: TTFT {fresh:.1f} ms new, {cached:.1f} ms cached "
            f"({cached / fresh:.2f}x)"
        )
        if own:
            print(
                f"  the server's own (its /metrics, submitted to first token): {own[0]:.2f} ms new, "
                f"{own[1]:.2f} ms cached ({own[1] / max(own[0], 1e-9):.2f}x); the rest is HTTP and the client"
            )
    if soaked:
        s = soaked["samples"]
        print(
            f"soak, {max(args.levels)} clients for {args.soak:g} s: {soaked['requests']} requests, "
            f"{soaked['failures']} failures, {soaked['tokens'] / args.soak:.1f} tokens/s"
        )
        for t, rss, pool in s:
            print(f"  {t:6.0f} s  RSS {rss / 2**20:8.1f} MiB  GPU pool {pool / 2**20:8.1f} MiB")
        if len(s) > 1:
            print(
                f"  change first -> last: RSS {(s[-1][1] - s[0][1]) / 2**20:+.1f} MiB, "
                f"GPU pool {(s[-1][2] - s[0][2]) / 2**20:+.1f} MiB"
            )
    failed = any(r["failures"] for r in rows) or (soaked and soaked["failures"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
