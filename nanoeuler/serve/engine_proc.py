"""Generation in a process of its own: the model and the `Scheduler` run there, the HTTP server here.

A decode step on a GPU is mostly Python (the kernel launches), and so is answering 32 streams on the event
loop; in one process they take turns on one GIL and the GPU waits on both (bench/serve_overhead.py: at 64
streams the thread gave 0.40 of the ideal tokens/s, this process 0.59). The engine process builds its
`Backend` from a picklable factory (`functools.partial(Backend.load, path, ...)`) after `spawn`, so CUDA never
starts in the HTTP process (and a forked CUDA context would be no good), and says it is ready with the facts
the handlers need: the model's name, context length, parameter count and tokenizer. What crosses after that
is plain data, one message per decode step: every job's new token ids (with their log-probabilities when
asked), the ends, the engine's waiting count, and now and then its counters (prefix cache, speculation,
memory) for /health and /metrics. Requests go the other way: prompt ids, sampling, options (a JSON schema,
whose grammar the engine compiles), and cancels. Messages are read on the event loop from the pipe's file
descriptor (`loop.add_reader`), so a step costs this side one wake-up, and written by a thread of their own,
so a slow engine never blocks the loop.

    >>> engine = EngineProcess(partial(Backend.load, "chat.bin", "cpu"), max_batch=8).start()   # doctest: +SKIP
    >>> engine.attach()                                   # on the event loop                 # doctest: +SKIP
    >>> job = engine.submit(prompt_ids, 16, Sampling(temperature=0))                           # doctest: +SKIP
    >>> async for batch in job.batches(): ...             # token ids, as they arrive        # doctest: +SKIP

An engine that dies (killed, or its generation loop crashed) fails every job waiting on it with `EngineGone`
and refuses new ones; `alive` turns False (and /health with it).
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback

from nanoeuler.errors import UserError
from nanoeuler.serve.backend import Sampling, _TokenBytes
from nanoeuler.serve.scheduler import END, QueueFull, Scheduler

STATS_EVERY_S = 0.1  # the engine's counters ride on a step message at most this often (and with every end)


class EngineGone(RuntimeError):
    """The engine process has ended: every job waiting on it fails with this."""


class RemoteError(Exception):
    """The traceback of an exception raised in the engine process (the `__cause__` of its copy here)."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


# ---- this side (the HTTP process) -----------------------------------------------------------------------


class Model:
    """What the handlers know of the model, from the engine's ready message: no weights here."""

    def __init__(self, name: str, ctx_len: int, params: int, tokenizer_json: str):
        from nanoeuler.tokenizer.bpe import Tokenizer

        self.name, self.ctx_len, self.params = name, ctx_len, params
        self.tok = Tokenizer.from_json(tokenizer_json)
        self.stop_ids = frozenset({self.tok.end_id, self.tok.eot_id})
        self.token_bytes = _TokenBytes(self.tok)  # a token's bytes, looked up once
        self.token_text = _TokenText(self.token_bytes)


class _TokenText(dict):
    """token id -> its text when its bytes are whole UTF-8 on their own, else None (a character split over
    tokens): a stream decodes such a token without the incremental decoder, once per token id.

    >>> tok = type("Tok", (), {"decode_bytes": lambda self, ids: bytes(ids)})()
    >>> text = _TokenText(_TokenBytes(tok)); text[65], text[0xE4]
    ('A', None)
    """

    def __init__(self, token_bytes):
        super().__init__()
        self.token_bytes = token_bytes

    def __missing__(self, token: int) -> str | None:
        try:
            text = self.token_bytes[token].decode("utf-8")
        except UnicodeDecodeError:
            text = None
        self[token] = text
        return text


class RemoteJob:
    """One request's handle here: its items arrive from the engine process, `cancel` goes there."""

    def __init__(self, engine: "EngineProcess | None", key: int, stop_at_end: bool = True, guided: bool = False):
        self.engine, self.key, self.stop_at_end = engine, key, stop_at_end
        self.generated = 0
        self.records: list = []  # with `logprobs`: (log-probability, [(id, log-probability)...]) per token
        self.grammar_stopped = False  # a grammar says the answer is complete (told with the end)
        self.outcome: str | None = None
        self.last_at = time.monotonic()  # submitted, then each arrival: the latency metrics
        # a job with a schema: the engine's word on its grammar (None: built; else the ApiError's (message, param))
        self.guided = asyncio.get_running_loop().create_future() if guided else None
        self._cancelled = False
        self._items: list = []  # token ids, then the end (END) or an error
        self._wake: asyncio.Future | None = None

    def cancel(self) -> None:
        if not self._cancelled and self.outcome is None:
            self._cancelled = True
            self.engine._send(("cancel", self.key))

    @property
    def ready(self) -> bool:
        """Whether more has arrived than `batches` has given yet (its end, say): a reader may write once for both."""
        return bool(self._items)

    def _arrive(self, items: list) -> None:
        if not items:
            return
        self._items += items
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def batches(self):
        """The job's token ids as they arrive, in lists of all that had arrived when read; raises what
        generation raised (after the tokens before it)."""
        while True:
            if not self._items:
                self._wake = asyncio.get_running_loop().create_future()
                try:
                    await self._wake
                finally:
                    self._wake = None
            batch, self._items = self._items, []
            last = batch[-1]  # the end or an error comes last: the job has left `EngineProcess._jobs`
            if last is END or isinstance(last, BaseException):
                if len(batch) > 1:
                    yield batch[:-1]
                if last is END:
                    return
                raise last
            yield batch


class EngineProcess:
    """The engine process, and this side's count of its jobs (a full queue is a 429 without asking it).
    `factory()` builds the `Backend` there; `max_batch` is lowered to the slots the backend has room for."""

    def __init__(self, factory, max_batch: int = 8, max_queue: int = 64):
        self.factory, self.max_batch, self.max_queue = factory, max_batch, max_queue
        self.metrics = None  # `metrics.Metrics`: told of each step's token latencies
        self.counts = {"finished": 0, "cancelled": 0, "failed": 0, "rejected": 0, "tokens": 0}
        self.model: Model | None = None
        self.engine_stats: dict = {}  # the engine's counters as last told (`_Wire.stats`)
        self.waiting = 0  # as the engine last told
        self.error: str | None = None  # why the engine process ended, once it has
        self._jobs: dict[int, RemoteJob] = {}
        self._keys = itertools.count()
        self._proc = self._conn = self._loop = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # what `_writer` sends

    def start(self) -> "EngineProcess":
        """Start the engine and wait (blocking) until it has loaded the model; UserError, one line, if it cannot."""
        ctx = multiprocessing.get_context("spawn")  # never fork: a CUDA context does not survive it
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_engine_main,
            args=(child, self.factory, self.max_batch, self.max_queue),
            name="nanoeuler-engine",
            daemon=True,  # and `stop`: no engine outlives its server
        )
        self._proc.start()
        child.close()
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(timeout=10)
            raise UserError(f"the engine process ended while loading the model (exit code {self._proc.exitcode})")
        if kind != "ready":
            self._proc.join(timeout=10)
            raise UserError(payload)
        self.model = Model(payload["name"], payload["ctx_len"], payload["params"], payload["tokenizer"])
        self.max_batch, self.engine_stats = payload["max_batch"], payload["stats"]
        threading.Thread(target=self._writer, name="nanoeuler-engine-writer", daemon=True).start()
        return self

    def attach(self) -> None:
        """On the event loop that serves: read the engine's messages as they arrive."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._conn.fileno(), self._read)  # an engine already gone: its end is read too

    async def stop(self) -> None:
        """Ask the engine to stop (the jobs still there end), wait for it, kill it if it does not."""
        if self._proc is None:
            return
        self._send(("stop", None))
        await asyncio.to_thread(self._proc.join, 30)
        if self._proc.is_alive():
            self._proc.kill()
            await asyncio.to_thread(self._proc.join)
        self._gone("the server is shutting down")
        self._outbox.put(None)

    @property
    def alive(self) -> bool:
        return self.error is None and self._proc is not None and self._proc.is_alive()

    def submit(self, prompt_ids, max_new_tokens: int, sampling: Sampling, stop_at_end: bool = True, **options):
        return self.submit_many([(prompt_ids, max_new_tokens, sampling, stop_at_end, options)])[0]

    def submit_many(self, specs: list[tuple]) -> list[RemoteJob]:
        """Queue several jobs at once, all or none (the choices of one request); each spec is (prompt_ids,
        max_new_tokens, sampling, stop_at_end, options), options plain data (`logprobs`, `schema`)."""
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
            opts = {k: v for k, v in opts.items() if v is not None}
            job = RemoteJob(self, next(self._keys), stop, guided="schema" in opts)
            self._jobs[job.key] = job
            jobs.append(job)
            wire.append((job.key, list(ids), n, sampling, stop, opts))
        self._send(("submit", wire))
        return jobs

    def stats(self) -> dict:
        waiting = min(self.waiting, len(self._jobs))
        return {
            "active": len(self._jobs) - waiting,
            "waiting": waiting,
            **self.counts,
            "max_batch": self.max_batch,
            "max_queue": self.max_queue,
        }

    def _send(self, message) -> None:
        self._outbox.put(message)

    def _writer(self) -> None:
        """Sends what `_send` queued (a pipe that is full would block the event loop); ends with the engine."""
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the engine is gone: `_read` hears of it too
                return

    def _read(self) -> None:
        """On the event loop, when the pipe has data: every message that has arrived."""
        try:
            while self._conn.poll():
                kind, payload = self._conn.recv()
                if kind == "step":
                    self._step(*payload)
                elif kind == "guided":
                    self._guided(*payload)
                elif kind == "died":
                    self._gone(payload)
                    return
        except (EOFError, OSError):
            self._proc.join(timeout=1)
            self._gone(f"the engine process ended, exit code {self._proc.exitcode}")

    def _step(self, news: list, waiting: int, stats: dict | None) -> None:
        """A step's items: per job (key, tokens, records, end), end None or (outcome, error, grammar done)."""
        self.waiting = waiting
        if stats is not None:
            self.engine_stats = stats
        now, firsts, gaps, count = time.monotonic(), [], [], 0
        for key, tokens, records, end in news:  # `tokens`: a list of this message's own, extended in place
            job = self._jobs.get(key)
            if job is None:
                continue
            if tokens:
                n = len(tokens)
                if job.generated:
                    gaps.append(now - job.last_at)
                else:
                    firsts.append(now - job.last_at)
                if n > 1:  # tokens of one step (speculation) arrive together
                    gaps += [0.0] * (n - 1)
                job.last_at = now
                job.generated += n
                count += n
            if records:
                job.records += records
            if end is not None:
                if job.guided is not None and not job.guided.done():  # failed before its grammar was told
                    job.guided.set_result(None)
                outcome, error, job.grammar_stopped = end
                job.outcome = outcome
                self.counts[outcome] += 1
                del self._jobs[key]
                tokens.append(END if error is None else _local_error(error))
            job._arrive(tokens)
        self.counts["tokens"] += count
        if self.metrics is not None:
            self.metrics.token_latencies(firsts, gaps)

    def _guided(self, keys: list, problem) -> None:
        """The engine built the grammars of these jobs (problem None), or refused their schema: they end unrun."""
        for key in keys:
            job = self._jobs.get(key) if problem is None else self._jobs.pop(key, None)
            if job is not None and not job.guided.done():
                job.guided.set_result(problem)
            if job is not None and problem is not None:
                job.outcome = "refused"
                job._arrive([END])

    def _gone(self, why: str) -> None:
        """The engine is no more: every job still waiting ends with an error, later submits fail at once."""
        if self.error is None:
            self.error = why
        if self._loop is not None:
            self._loop.remove_reader(self._conn.fileno())
        for job in self._jobs.values():
            job.outcome = "failed"
            self.counts["failed"] += 1
            if job.guided is not None and not job.guided.done():
                job.guided.set_result(None)
            job._arrive([EngineGone(f"the generation process has stopped ({why})")])
        self._jobs.clear()


def _local_error(error: tuple) -> BaseException:
    """This side's copy of an exception raised in the engine (`_wire_error`), its traceback as its cause."""
    blob, text, trace = error
    try:
        exc = pickle.loads(blob) if blob is not None else RuntimeError(text)
    except Exception:  # a class this side cannot rebuild: its name and message
        exc = RuntimeError(text)
    exc.__cause__ = RemoteError(trace)
    return exc


# ---- the engine process ---------------------------------------------------------------------------------


def _wire_error(exc: BaseException) -> tuple:
    """(the pickled exception or None, "Type: message", its traceback) for the pipe."""
    text = f"{type(exc).__name__}: {exc}"
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)  # one that pickles but cannot be rebuilt goes as its text
    except Exception:
        blob = None
    return blob, text, "".join(traceback.format_exception(exc))


class _Wire:
    """The scheduler's `send`: a step's items go down the pipe as one message of plain data, with the
    engine's counters when they are due."""

    def __init__(self, conn, backend):
        self.conn, self.backend, self.lock = conn, backend, threading.Lock()
        self.scheduler: Scheduler | None = None
        self.grammars = None  # `structured.Grammars`, built on the first schema
        self._records_sent: dict = {}  # job -> its log-probability records already sent
        self._stats_at = 0.0

    def __call__(self, batch: list) -> None:
        news, ended = [], False
        for job, items in batch:
            tokens, end = items, None
            if items and (items[-1] is END or isinstance(items[-1], BaseException)):
                tokens, last = items[:-1], items[-1]
                end = (job.outcome, None if last is END else _wire_error(last), job.grammar_stopped)
                ended = True
            records = []
            if job.stream is not None and job.stream.logprobs is not None:
                sent = self._records_sent.get(job, 0)
                records = job.stream.records[sent:]
                self._records_sent[job] = sent + len(records)
            if end is not None:
                self._records_sent.pop(job, None)
            news.append((job.key, tokens, records, end))
        now = time.monotonic()
        stats = None
        if ended or now - self._stats_at >= STATS_EVERY_S:
            stats, self._stats_at = self.stats(), now
        try:
            self.send(("step", (news, len(self.scheduler._waiting), stats)))
        except OSError as exc:  # the HTTP process is gone; the scheduler fails the step's jobs
            raise RuntimeError(f"the server is gone: {exc}") from None

    def send(self, message) -> None:
        with self.lock:  # the scheduler's thread and the command reader both send
            self.conn.send(message)

    def stats(self) -> dict:
        """The engine's counters: slots, prefix cache, speculation per head, memory, grammars, CPU."""
        be = self.backend
        prefixes = be.prefixes
        spec = be.engine.stats if be.speculative else None
        out = {
            "free_slots": be.free_slots,
            "prefix_hits": prefixes.hits if prefixes else 0,
            "prefix_tokens": prefixes.tokens if prefixes else 0,
            "spec_offered": list(spec.offered) if spec else [],
            "spec_accepted": list(spec.accepted) if spec else [],
            "grammar_compiles": self.grammars.compiles if self.grammars else 0,
            "resident_bytes": _resident_bytes(),
            "cpu_s": time.process_time(),
            "first_tokens": list(self.scheduler.first_tokens) if self.scheduler else [0, 0.0],
        }
        cupy = sys.modules.get("cupy")  # loaded by the GPU engine only; never imported here
        if cupy is not None:
            pool = cupy.get_default_memory_pool()
            out["gpu_pool"] = (pool.used_bytes(), pool.total_bytes())
        extra = getattr(be, "extra_stats", None)  # a bench's fake engine adds its own
        return {**out, **extra()} if extra else out


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux
        return None


def _engine_main(conn, factory, max_batch: int, max_queue: int) -> None:
    """The engine process: build the backend, run the scheduler, obey the pipe until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server stops us in turn
    try:
        backend = factory()
        if getattr(backend, "capacity", None) is not None:
            max_batch = min(max_batch, backend.capacity)
        wire = _Wire(conn, backend)
        # the HTTP side admits what fits in its count; the queue here must never refuse what it sends
        scheduler = wire.scheduler = Scheduler(backend, max_batch, max_queue + max_batch, wire)
        scheduler.on_crash = lambda exc: _die(wire, exc)
        info = {
            "name": backend.name,
            "ctx_len": backend.ctx_len,
            "params": backend.cfg.n_params(),
            "tokenizer": backend.tok.to_json(),
            "max_batch": max_batch,
            "stats": wire.stats(),
        }
    except BaseException as exc:
        conn.send(("failed", _startup_error(exc)))
        return
    scheduler.start()
    wire.send(("ready", info))
    jobs: dict = {}  # key -> Job, while the scheduler has it
    try:
        while True:
            kind, payload = conn.recv()
            if kind == "submit":
                for job in _submit(scheduler, wire, payload):
                    jobs[job.key] = job
                for key in [k for k, j in jobs.items() if j.outcome is not None]:
                    del jobs[key]
            elif kind == "cancel" and payload in jobs:
                jobs.pop(payload).cancel()
            elif kind == "stop":
                break
    except (EOFError, OSError):  # the HTTP process is gone: stop generating for nobody
        pass
    finally:
        scheduler.stop()


def _submit(scheduler: Scheduler, wire: _Wire, specs: list) -> list:
    """Queue one request's jobs; a schema is compiled here first (a refused one ends them unrun)."""
    keys = [key for key, *_ in specs]
    guided = [key for key, *_, opts in specs if "schema" in opts]
    from nanoeuler.serve.protocol import ApiError

    try:
        queued = [(ids, n, sampling, stop, _options(wire, opts)) for _, ids, n, sampling, stop, opts in specs]
    except ApiError as exc:  # a schema the grammar engine refuses: a 400
        wire.send(("guided", (guided, (exc.message, exc.param))))
        return []
    except Exception as exc:  # a bug of ours: this request's jobs fail, the engine goes on
        ends = [(key, [], [], ("failed", _wire_error(exc), False)) for key in keys]
        wire.send(("step", (ends, len(scheduler._waiting), None)))
        return []
    jobs = scheduler.submit_many(queued, keys)
    if guided:
        wire.send(("guided", (guided, None)))
    return jobs


def _options(wire: _Wire, opts: dict) -> dict:
    """`Backend.open`'s options from the request's: a schema becomes its grammar's `Guide`."""
    from nanoeuler.serve.protocol import ApiError

    opts = dict(opts)
    schema = opts.pop("schema", None)
    if schema is not None:
        if wire.grammars is None:
            try:
                from nanoeuler.serve.structured import Grammars
            except ImportError:
                raise ApiError(
                    "response_format: this server has no grammar engine (install the 'serve' extra: llguidance)",
                    "response_format",
                ) from None
            wire.grammars = Grammars(wire.backend.tok)
        try:
            opts["guide"] = wire.grammars.guide(schema)
        except ValueError as exc:
            raise ApiError(f"response_format: the schema cannot be used: {exc}", "response_format") from None
    return opts


def _startup_error(exc: BaseException) -> str:
    """The one line that says why the engine could not start (and the traceback, on stderr, of a bug)."""
    from nanoeuler.backend import is_out_of_memory

    if isinstance(exc, UserError):
        return str(exc)
    if isinstance(exc, OSError):  # the machine's, not a bug: a device missing, a file unreadable
        return str(exc)
    if isinstance(exc, MemoryError) or is_out_of_memory(exc):
        return f"out of memory loading the model: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    traceback.print_exc()
    return f"the engine failed to start: {type(exc).__name__}: {exc} (its traceback is above)"


def _die(wire: _Wire, exc: BaseException) -> None:
    """The scheduler's thread died: say why, and end the process (nothing here can answer any more)."""
    try:
        wire.send(("died", f"the generation loop failed: {type(exc).__name__}: {exc}"))
    finally:
        os._exit(1)
