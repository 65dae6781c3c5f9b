"""Generation in its own process (`engine_proc`): a job's tokens come back in order, a cancel reaches the
engine, a full queue is refused here, an engine that dies fails what waits on it instead of hanging (and
over HTTP: the stream ends with an error event, /health and new requests are 503s), and an engine that
cannot start is one line before anything listens."""

import asyncio
import json
import struct
import subprocess
import sys
import time
from functools import partial

import pytest

from nanoeuler.errors import UserError
from nanoeuler.serve.backend import Sampling
from nanoeuler.serve.engine_proc import EngineGone, EngineProcess
from nanoeuler.serve.scheduler import QueueFull
from serve_fixtures import chat_model, counting_backend, live_server


async def _tokens(job) -> list[int]:
    return [t async for batch in job.batches() for t in batch]


def test_jobs_cancel_queue_limit_and_a_dead_engine():
    async def main():
        engine = EngineProcess(partial(counting_backend, 0.002), max_batch=2, max_queue=0).start()
        engine.attach()
        try:
            assert engine.model.name == "counting" and engine.model.ctx_len == 64
            a, b = engine.submit_many([([0], 3, Sampling(), True, {}), ([0], 5, Sampling(), True, {})])
            assert await asyncio.gather(_tokens(a), _tokens(b)) == [[1, 2, 3], [1, 2, 3, 4, 5]]
            assert (a.outcome, b.outcome, a.generated, b.generated) == ("finished", "finished", 3, 5)

            long = engine.submit([0], 10**6, Sampling())
            other = engine.submit([0], 10**6, Sampling())
            with pytest.raises(QueueFull):
                engine.submit([0], 1, Sampling())
            first = await long.batches().__anext__()
            assert first[0] == 1
            long.cancel()
            rest = await asyncio.wait_for(_tokens(long), 10)
            assert long.outcome == "cancelled" and rest == list(range(len(first) + 1, len(first) + len(rest) + 1))
            stats = engine.stats()
            assert stats["finished"] == 2 and stats["cancelled"] == 1 and stats["active"] == 1

            engine._proc.kill()  # the engine dies mid-answer: the job waiting on it fails, the next is refused
            with pytest.raises(EngineGone):
                await asyncio.wait_for(_tokens(other), 10)
            with pytest.raises(EngineGone):
                engine.submit([0], 1, Sampling())
            assert engine.stats()["failed"] == 1 and not engine.alive
        finally:
            await engine.stop()
        assert engine._proc.exitcode is not None  # stopped: no engine outlives its server

    asyncio.run(main())


def test_a_crashed_generation_loop_fails_its_jobs_and_ends_the_engine():
    async def main():
        engine = EngineProcess(partial(counting_backend, 0.001, True), max_batch=2, max_queue=2).start()
        engine.attach()
        try:
            # the first job's close fails (a failed step), then the second's, in the worker's recovery from
            # that: the worker dies before the step's items go out, and so does the engine, saying why
            jobs = engine.submit_many([([0], 2, Sampling(), True, {}), ([0], 3, Sampling(), True, {})])
            for job in jobs:
                with pytest.raises(EngineGone, match="generation loop failed: AttributeError"):
                    await asyncio.wait_for(_tokens(job), 10)
            await asyncio.to_thread(engine._proc.join, 10)
            assert engine._proc.exitcode == 1 and not engine.alive
        finally:
            await engine.stop()

    asyncio.run(main())


def exits_while_loading(code: int):
    """A factory whose process ends before it has built anything (the OOM killer's way)."""
    import os

    os._exit(code)


def test_an_engine_that_cannot_start_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"^the engine process ended while loading the model \(exit code 3\)$"):
        EngineProcess(partial(exits_while_loading, 3)).start()
    bad = tmp_path / "bad.bin"
    bad.write_bytes(struct.pack("<Q", 14) + b"{not a header}")  # a corrupt checkpoint
    r = subprocess.run(
        [sys.executable, "-m", "nanoeuler", "serve", "--ckpt", str(bad), "--device", "cpu", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and r.stdout == ""
    why = "its header is not valid JSON"
    assert r.stderr.splitlines() == [f"nanoeuler serve: error: checkpoint {bad} is corrupt ({why})"]


def test_an_engine_killed_mid_stream_ends_the_stream_and_turns_the_server_to_503s(tmp_path_factory):
    httpx = pytest.importorskip("httpx2")
    body = {"prompt": "It", "max_tokens": 10**5, "ignore_eos": True, "stream": True}
    with live_server(chat_model(tmp_path_factory), max_tokens=10**5) as (url, app):
        assert httpx.get(url + "/health").json()["status"] == "ok"
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # it is generating
            app.state.engine._proc.kill()
            events = [line for line in lines if line]
        error = json.loads(next(e for e in events if '"error"' in e)[6:])["error"]
        assert events[-1] == "data: [DONE]" and error["type"] == "server_error"
        gone = "the generation process has stopped (the engine process ended, exit code -9)"
        assert error["message"].startswith(gone)
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "error" and gone in health.json()["error"]
        started = time.monotonic()
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=10)
        assert r.status_code == 503 and time.monotonic() - started < 5
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["code"] == "engine_unavailable"
        assert "nanoeuler_engine_up 0.0" in httpx.get(url + "/metrics").text
        assert httpx.post(url + "/tokenize", json={"content": "It"}).status_code == 200  # the HTTP side answers on
