"""Generation in a process of its own: the `Scheduler` and the model run there, the HTTP server here.

A decode step on a GPU is mostly Python (the kernel launches), and so is answering 32 streams on the event
loop; in one process they take turns on one GIL and the GPU waits on both. Here the engine process runs
the `Scheduler` over the `Backend` the factory builds (a module-level function and its arguments, so it can
be built after `spawn`: CUDA must never start in the HTTP process, and a forked CUDA context is no good),
and this side keeps the jobs' API (`submit_many`, `cancel`, `batches`). One message crosses per step
(every job's new items), read on the event loop from the pipe's file descriptor, so a step costs this
side one wake-up.

    >>> engine = EngineProcess(make_backend, (path,), max_batch=8, max_queue=64)    # doctest: +SKIP
    >>> await engine.start()                      # on the event loop                # doctest: +SKIP
    >>> job = engine.submit(prompt_ids, 16, Sampling(temperature=0))                # doctest: +SKIP
    >>> async for batch in job.batches(): ...                                        # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import threading
import time
from collections import deque

from nanoeuler.serve.backend import Sampling  # noqa: F401 (crosses the pipe)
from nanoeuler.serve.scheduler import _END, QueueFull, Scheduler


class EngineGone(RuntimeError):
    """The engine process has ended: every job waiting on it fails with this."""


# ---- this side (the HTTP process) -----------------------------------------------------------------------


class RemoteJob:
    """One request's handle here: its items arrive from the engine process, `cancel` goes there."""

    def __init__(self, engine: "EngineProcess", key: int, stop_at_end: bool, logprobs):
        self.engine, self.key, self.stop_at_end, self.logprobs = engine, key, stop_at_end, logprobs
        self.generated = 0
        self.records: list = []  # with `logprobs`: (log-probability, [(id, log-probability)...]) per token
        self.grammar_stopped = False  # a grammar's answer is complete (told with the end)
        self.outcome: str | None = None
        self.last_at = time.monotonic()  # submitted, then each arrival: the latency metrics
        self._cancelled = False
        self._items: deque = deque()
        self._wake: asyncio.Future | None = None

    def cancel(self) -> None:
        if not self._cancelled and self.outcome is None:
            self._cancelled = True
            self.engine._send(("cancel", self.key))

    def _arrive(self, items: list) -> None:
        self._items.extend(items)
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def batches(self):
        """The job's token ids as they arrive, in lists; raises what generation raised (after the tokens)."""
        while True:
            if not self._items:
                self._wake = asyncio.get_running_loop().create_future()
                try:
                    await self._wake
                finally:
                    self._wake = None
            batch = []
            while self._items:
                item = self._items.popleft()
                if item is _END or isinstance(item, BaseException):
                    if batch:
                        yield batch
                    if item is _END:
                        return
                    raise item
                batch.append(item)
            yield batch


class EngineProcess:
    """The engine process and this side's count of its jobs (so a full queue is a 429 without asking it)."""

    def __init__(self, factory, args: tuple, max_batch: int = 8, max_queue: int = 64, metrics=None):
        self.factory, self.args, self.max_batch, self.max_queue = factory, args, max_batch, max_queue
        self.metrics = metrics
        self.counts = {"finished": 0, "cancelled": 0, "failed": 0, "rejected": 0, "tokens": 0}
        self.info: dict = {}  # the engine's plain facts, sent once it is ready
        self.waiting = 0  # as the engine last told
        self.error: str | None = None  # why the engine process ended, once it has
        self._jobs: dict[int, RemoteJob] = {}
        self._keys = itertools.count()
        self._asked: dict[int, asyncio.Future] = {}  # stats requests in flight
        self._proc = self._conn = self._loop = None

    async def start(self) -> "EngineProcess":
        ctx = multiprocessing.get_context("spawn")  # never fork: a CUDA context does not survive it
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_engine_main,
            args=(child, self.factory, self.args, self.max_batch, self.max_queue),
            name="nanoeuler-engine",
            daemon=True,
        )
        self._proc.start()
        child.close()
        self._loop = asyncio.get_running_loop()
        # the engine loads the model first: wait for its word without holding up the loop
        kind, payload = await asyncio.to_thread(self._conn.recv)
        if kind != "ready":
            self._proc.join(timeout=5)
            raise RuntimeError(f"the engine process did not start: {payload}")
        self.info = payload
        self._loop.add_reader(self._conn.fileno(), self._read)
        return self

    async def stop(self) -> None:
        if self._proc is None:
            return
        if self.error is None:
            self._send(("stop", None))
        await asyncio.to_thread(self._proc.join, 30)
        if self._proc.is_alive():  # it did not stop in time: it must not outlive the server
            self._proc.kill()
            self._proc.join()
        self._gone("the server is shutting down")

    @property
    def alive(self) -> bool:
        return self.error is None and self._proc is not None and self._proc.is_alive()

    def submit(self, prompt_ids, max_new_tokens: int, sampling: Sampling, stop_at_end: bool = True, **options):
        return self.submit_many([(prompt_ids, max_new_tokens, sampling, stop_at_end, options)])[0]

    def submit_many(self, specs: list[tuple]) -> list[RemoteJob]:
        """Queue several jobs at once, all or none; each spec is (prompt_ids, max_new_tokens, sampling,
        stop_at_end, options), options plain data (`logprobs`, `schema`)."""
        if self.error is not None:
            raise EngineGone(f"the generation process has stopped ({self.error})")
        if len(self._jobs) + len(specs) > self.max_batch + self.max_queue:
            self.counts["rejected"] += 1
            raise QueueFull(
                f"{len(self._jobs)} requests are being answered or waiting (the limit is "
                f"{self.max_batch} at once + {self.max_queue} waiting)"
            )
        jobs, wire = [], []
        for ids, n, sampling, stop, opts in specs:
            job = RemoteJob(self, next(self._keys), stop, opts.get("logprobs"))
            self._jobs[job.key] = job
            jobs.append(job)
            wire.append((job.key, list(ids), n, sampling, stop, {k: v for k, v in opts.items() if v is not None}))
        self._send(("submit", wire))
        return jobs

    def stats(self) -> dict:
        return {
            "active": len(self._jobs) - min(self.waiting, len(self._jobs)),
            "waiting": min(self.waiting, len(self._jobs)),
            **self.counts,
            "max_batch": self.max_batch,
            "max_queue": self.max_queue,
        }

    async def engine_stats(self, timeout: float = 5.0) -> dict:
        """The engine process's own counts (prefix cache, speculation, memory), asked for and answered."""
        if self.error is not None:
            return {}
        key = next(self._keys)
        self._asked[key] = fut = self._loop.create_future()
        self._send(("stats", key))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._asked.pop(key, None)

    def _send(self, message) -> None:
        try:
            self._conn.send(message)
        except (OSError, ValueError) as exc:  # the pipe is closed: the engine is gone
            self._gone(f"cannot reach it: {exc}")

    def _read(self) -> None:
        """On the event loop, when the pipe has data: every message that has arrived."""
        try:
            while self._conn.poll():
                kind, payload = self._conn.recv()
                if kind == "step":
                    self._step(*payload)
                elif kind == "stats":
                    fut = self._asked.get(payload[0])
                    if fut is not None and not fut.done():
                        fut.set_result(payload[1])
                elif kind == "died":
                    self._gone(payload)
                    return
        except (EOFError, OSError):
            code = self._proc.exitcode if self._proc is not None else None
            self._gone(f"the engine process ended (exit code {code})")

    def _step(self, news: list, waiting: int) -> None:
        """A step's items: per job (key, tokens, records, end), end None or (outcome, error text, grammar done)."""
        self.waiting = waiting
        now, firsts, gaps = time.monotonic(), [], []
        for key, tokens, records, end in news:
            job = self._jobs.get(key)
            if job is None:
                continue
            items = list(tokens)
            if tokens:
                (gaps if job.generated else firsts).append(now - job.last_at)
                gaps += [0.0] * (len(tokens) - 1)
                job.last_at = now
                job.generated += len(tokens)
                self.counts["tokens"] += len(tokens)
            if records:
                job.records.extend(records)
            if end is not None:
                outcome, error, job.grammar_stopped = end
                job.outcome = outcome
                self.counts[outcome] += 1
                del self._jobs[key]
                items.append(_END if error is None else RuntimeError(error))
            job._arrive(items)
        if self.metrics is not None:
            self.metrics.token_latencies(firsts, gaps)

    def _gone(self, why: str) -> None:
        """The engine is no more: every job still waiting ends with an error, later submits fail at once."""
        if self.error is None:
            self.error = why
            if self._loop is not None and self._conn is not None:
                try:
                    self._loop.remove_reader(self._conn.fileno())
                except (ValueError, OSError):
                    pass
        for job in list(self._jobs.values()):
            job.outcome = "failed"
            self.counts["failed"] += 1
            job._arrive([EngineGone(f"the generation process has stopped ({why})")])
        self._jobs.clear()
        for fut in self._asked.values():
            if not fut.done():
                fut.set_result({})


# ---- the engine process ---------------------------------------------------------------------------------


class _Wire:
    """The engine side's stand-in for an event loop: `Scheduler._flush` hands it a step's items, which go
    down the pipe as one message of plain data."""

    def __init__(self, conn, scheduler_ref: list):
        self.conn, self.scheduler_ref, self._lock = conn, scheduler_ref, threading.Lock()

    def call_soon_threadsafe(self, fn, batch) -> None:
        news = []
        for job, items in batch:
            tokens = [t for t in items if isinstance(t, int)]
            end = None
            last = items[-1] if items else None
            if last is _END or isinstance(last, BaseException):
                guide = job.stream_options.get("guide")
                error = None if last is _END else f"{type(last).__name__}: {last}"
                end = (job.outcome or "failed", error, bool(guide is not None and guide.stopped))
            records = []
            if job.stream_options.get("logprobs") is not None and job.stream is not None:
                sent = getattr(job, "records_sent", 0)
                records = job.stream.records[sent:]
                job.records_sent = sent + len(records)
            news.append((job.key, tokens, records, end))
        scheduler = self.scheduler_ref[0]
        try:
            self.send(("step", (news, len(scheduler._waiting))))
        except OSError as exc:  # the HTTP process is gone; the scheduler cancels the jobs
            raise RuntimeError(f"the server is gone: {exc}") from None

    def send(self, message) -> None:
        with self._lock:  # the scheduler's thread and the command reader both send
            self.conn.send(message)


def _engine_main(conn, factory, args, max_batch: int, max_queue: int) -> None:
    """The engine process: build the backend, run the scheduler, obey the pipe until told to stop."""
    try:
        backend = factory(*args)
        grammars = None
        ref: list = [None]
        wire = _Wire(conn, ref)
        # this side admits what the HTTP side counted in; its own queue must never refuse
        scheduler = ref[0] = Scheduler(backend, max_batch, max_queue + max_batch, loop=wire)
        scheduler.on_crash = lambda exc: _die(wire, exc)
        scheduler.start()
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    wire.send(("ready", {"pid": os.getpid()}))
    jobs: dict = {}
    try:
        while True:
            kind, payload = conn.recv()
            if kind == "submit":
                specs = []
                for key, ids, n, sampling, stop, opts in payload:
                    schema = opts.pop("schema", None)
                    if schema is not None:
                        if grammars is None:
                            from nanoeuler.serve.structured import Grammars

                            grammars = Grammars(backend.tok)
                        opts["guide"] = grammars.guide(schema)
                    specs.append((ids, n, sampling, stop, opts))
                for job in scheduler.submit_many(specs, keys=[spec[0] for spec in payload]):
                    jobs[job.key] = job
                for key in [k for k, j in jobs.items() if j.outcome is not None]:
                    del jobs[key]
            elif kind == "cancel":
                job = jobs.pop(payload, None)
                if job is not None:
                    job.cancel()
            elif kind == "stats":
                wire.send(("stats", (payload, _engine_stats(backend))))
            elif kind == "stop":
                break
    except (EOFError, OSError):  # the HTTP process is gone: stop generating for nobody
        pass
    finally:
        scheduler.stop()


def _die(wire: _Wire, exc: BaseException) -> None:
    """The scheduler's thread died: say why, and end the process (nothing here can answer any more)."""
    try:
        wire.send(("died", f"the generation loop failed: {type(exc).__name__}: {exc}"))
    finally:
        os._exit(1)


def _engine_stats(backend) -> dict:
    prefixes = backend.prefixes
    spec = getattr(backend.engine, "stats", None) if backend.speculative else None
    out = {
        "free_slots": backend.free_slots,
        "prefix_hits": prefixes.hits if prefixes else 0,
        "prefix_tokens": prefixes.tokens if prefixes else 0,
        "spec": (list(spec.offered), list(spec.accepted)) if spec is not None else None,
        "process_cpu": time.process_time(),
    }
    extra = getattr(backend, "extra_stats", None)
    if extra is not None:
        out.update(extra())
    return out
