"""Generation in its own process (`engine_proc`): a job's tokens come back in order, a cancel reaches the
engine, a full queue is refused here, and an engine that dies fails what waits on it instead of hanging."""

import asyncio

import pytest

from nanoeuler.serve.backend import Sampling
from nanoeuler.serve.engine_proc import EngineGone, EngineProcess
from nanoeuler.serve.scheduler import QueueFull
from serve_fixtures import counting_backend


async def _tokens(job) -> list[int]:
    return [t async for batch in job.batches() for t in batch]


def test_jobs_cancel_queue_limit_and_a_dead_engine():
    async def main():
        engine = await EngineProcess(counting_backend, (0.002,), max_batch=2, max_queue=0).start()
        try:
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
        engine = await EngineProcess(counting_backend, (0.001, True), max_batch=2, max_queue=2).start()
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
