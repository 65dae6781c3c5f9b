"""Requests queued and decoded together by one worker thread, off the event loop.

The HTTP handlers run on an asyncio event loop; generation runs on one worker thread that owns the
model (one thread, because the model and its device are not shared between threads). A request
becomes a `Job` in a bounded waiting queue (full: `QueueFull`, answered 429); the worker takes up to
`max_batch` jobs at a time and advances all of them by one token per `Backend.step` (a speculating
stream by up to K), so a long answer does not hold up a short one. A step's tokens go back to the handlers'
event loop together, in one `call_soon_threadsafe` per step (not per token: each call writes to the loop's
wake-up pipe, and the worker and the loop share one GIL), so the loop never waits on the model. A handler
reads all that has arrived for its job at once (`Job.batches`), so a stream that fell behind catches up in
one write. A job whose client has gone (or whose stop string has appeared) is cancelled: the worker drops
it before its next token.

A job's failure is its own: a stream that fails alone (`Backend.step` gives its exception) ends only its
job; a step that raises ends the jobs in it, never the worker. Every way out of the batch goes through
`_finish`, which closes the job's stream (its cache slot goes back) and uncounts it.

    >>> scheduler = Scheduler(backend, max_batch=8, max_queue=64).start()                        # doctest: +SKIP
    >>> job = scheduler.submit(prompt_ids, max_new_tokens=16, sampling=Sampling(temperature=0))  # doctest: +SKIP
    >>> async for token in job.tokens(): ...  # in the event loop (or `job.batches()`: lists)     # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

from nanoeuler.serve.backend import Backend, Sampling, TokenStream

_END = object()  # the last item of a job's queue


class QueueFull(Exception):
    """The waiting queue is at its limit."""


class Job:
    """One request as the worker sees it; `tokens()` is read on the event loop that submitted it."""

    def __init__(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: Sampling,
        stop_at_end: bool = True,
        loop=None,
        key=None,
        **stream_options,
    ):
        self.prompt_ids, self.max_new_tokens, self.sampling = prompt_ids, max_new_tokens, sampling
        self.stop_at_end = stop_at_end
        self.stream_options = stream_options  # `Backend.open`'s logprobs and guide, when asked for
        self.last_token_at = time.monotonic()  # submitted, then each token: for the latency metrics
        self.stream: TokenStream | None = None  # opened by the worker, closed by `Scheduler._finish`
        self.generated = 0
        self.outcome: str | None = None  # finished, cancelled or failed, once the worker is done with it
        self.cancelled = threading.Event()
        self.key = key  # the HTTP side's name for the job, where the worker runs in the engine process
        self._loop = loop or asyncio.get_running_loop()  # where `_flush` sends its items
        self._items: deque = deque()  # arrived on the loop, not yet read: token ids, then the end or an exception
        self._wake: asyncio.Future | None = None  # set while `batches` waits for more

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def records(self) -> list:
        """With `logprobs`: (log-probability, [(id, log-probability)...]) per token generated."""
        return self.stream.records

    @property
    def grammar_stopped(self) -> bool:
        """Whether the job's grammar (if any) says its answer is complete."""
        guide = self.stream_options.get("guide")
        return guide is not None and guide.stopped

    def _arrive(self, items: list) -> None:
        """On the event loop: items the worker sent (`Scheduler._flush`)."""
        self._items.extend(items)
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def batches(self):
        """The job's token ids as they are generated, in lists of all that had arrived when read; raises what
        generation raised (after the tokens before it)."""
        while True:
            if not self._items:
                self._wake = self._loop.create_future()
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

    async def tokens(self):
        """The job's token ids one at a time (`batches`, flattened)."""
        async for batch in self.batches():
            for token in batch:
                yield token


class Scheduler:
    """The bounded queue and the worker thread that decodes up to `max_batch` jobs together."""

    def __init__(self, backend: Backend, max_batch: int = 8, max_queue: int = 64, metrics=None, loop=None):
        if max_batch < 1 or max_queue < 0:
            raise ValueError("max_batch must be >= 1 and max_queue >= 0")
        if getattr(backend, "capacity", None) is not None and max_batch > backend.capacity:
            raise ValueError(f"max_batch {max_batch} is more than the backend's {backend.capacity} slots")
        self.backend, self.max_batch, self.max_queue = backend, max_batch, max_queue
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._in_flight = 0  # waiting + being decoded
        self.counts = {"finished": 0, "cancelled": 0, "failed": 0, "rejected": 0, "tokens": 0}
        self.metrics = metrics  # `metrics.Metrics`: told of each step's token latencies
        self._outbox: dict = {}  # the worker's items not yet sent: {job: [items]}, sent by `_flush`
        self.on_crash = None  # on_crash(exc): the worker died of an exception no job owns
        self.loop = loop  # what jobs' items go to (`call_soon_threadsafe`): default, the submitting event loop

    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self._run, name="nanoeuler-generate", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def submit(
        self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling, stop_at_end: bool = True, **stream_options
    ) -> Job:
        """Queue a job (called on the event loop; takes a lock for microseconds, never waits on the model).
        `stream_options`: `Backend.open`'s `logprobs` and `guide`."""
        return self.submit_many([(prompt_ids, max_new_tokens, sampling, stop_at_end, stream_options)])[0]

    def submit_many(self, specs: list[tuple], keys=None) -> list[Job]:
        """Queue several jobs at once, all or none (the choices of one request): each spec is `submit`'s
        (prompt_ids, max_new_tokens, sampling, stop_at_end, stream_options); `keys`: the jobs' names."""
        keys = keys or [None] * len(specs)
        jobs = [
            Job(ids, n, sampling, stop, loop=self.loop, key=key, **opts)
            for (ids, n, sampling, stop, opts), key in zip(specs, keys)
        ]
        with self._cond:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            if self._in_flight + len(jobs) > self.max_batch + self.max_queue:
                self.counts["rejected"] += 1
                raise QueueFull(
                    f"{self._in_flight} requests are being answered or waiting (the limit is "
                    f"{self.max_batch} at once + {self.max_queue} waiting)"
                )
            self._waiting.extend(jobs)
            self._in_flight += len(jobs)
            self._cond.notify()
        return jobs

    def stats(self) -> dict:
        with self._cond:
            return {
                "active": self._in_flight - len(self._waiting),
                "waiting": len(self._waiting),
                **self.counts,
                "max_batch": self.max_batch,
                "max_queue": self.max_queue,
            }

    def _admit(self, active: list[Job]) -> bool:
        """Move waiting jobs into the batch; wait while there is nothing to do. False once stopping."""
        with self._cond:
            while not self._stopping and not self._waiting and not active:
                self._cond.wait()
            if self._stopping:
                for job in self._waiting:
                    self._send(job, RuntimeError("the server is shutting down"))
                self._in_flight -= len(self._waiting)
                self._waiting.clear()
                self._flush()
                return False
            while self._waiting and len(active) < self.max_batch:
                active.append(self._waiting.popleft())  # streams are opened by the next step
        return True

    def _finish(self, job: Job, outcome: str, item=_END) -> None:
        job.outcome = outcome
        try:
            if job.stream is not None:
                job.stream.close()
        finally:
            with self._cond:  # counted before the handler hears of it, so /health agrees with the answer
                self.counts[outcome] += 1
                self._in_flight -= 1
            self._send(job, item)

    def _send(self, job: Job, item) -> None:
        """Queue an item for the job's handler (a token id, an exception, or the end); `_flush` sends them."""
        self._outbox.setdefault(job, []).append(item)

    def _flush(self) -> None:
        """Send the queued items: one call per event loop, however many jobs and tokens."""
        by_loop: dict = {}
        for job, items in self._outbox.items():
            by_loop.setdefault(job._loop, []).append((job, items))
        self._outbox = {}
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                for job, _ in batch:
                    job.cancel()

    def _run(self) -> None:
        try:
            self._loop_steps()
        except BaseException as exc:  # a bug of ours: whoever waits on the worker must hear of it
            if self.on_crash is not None:
                self.on_crash(exc)
            raise

    def _loop_steps(self) -> None:
        active: list[Job] = []
        while self._admit(active):
            try:
                active = self._step(active)
            except Exception as exc:  # a failed step ends its jobs, never the server
                for job in active:
                    if job.outcome is None:
                        self._finish(job, "failed", exc)
                active = []
            self._flush()
        for job in active:
            self._finish(job, "cancelled", RuntimeError("the server is shutting down"))
        self._flush()

    def _step(self, active: list[Job]) -> list[Job]:
        """Drop cancelled jobs, advance the others by a step's tokens each; returns the jobs still running."""
        live = []
        for job in active:
            if job.stream is None and not job.cancelled.is_set():
                try:
                    job.stream = self.backend.open(
                        job.prompt_ids,
                        job.max_new_tokens,
                        job.sampling,
                        job.stop_at_end,
                        **{k: v for k, v in job.stream_options.items() if v is not None},
                    )
                except Exception as exc:
                    self._finish(job, "failed", exc)
                    continue
            if job.cancelled.is_set():
                self._finish(job, "cancelled")
            elif job.stream.done:  # asked for 0 tokens
                self._finish(job, "finished")
            else:
                live.append(job)
        if not live:
            return live
        news = self.backend.step([job.stream for job in live])
        now = time.monotonic()
        running, generated, firsts, gaps = [], 0, [], []
        for job, tokens in zip(live, news):
            if isinstance(tokens, Exception):  # this job's own failure; the others go on
                self._finish(job, "failed", tokens)
                continue
            if tokens:  # several where a speculative pass kept drafts: they arrive together
                (gaps if job.generated else firsts).append(now - job.last_token_at)
                gaps += [0.0] * (len(tokens) - 1)
                job.last_token_at = now
                job.generated += len(tokens)
                self._outbox.setdefault(job, []).extend(tokens)
            generated += len(tokens)
            if job.stream.done:
                self._finish(job, "finished")
            else:
                running.append(job)
        if self.metrics is not None:
            self.metrics.token_latencies(firsts, gaps)
        with self._cond:
            self.counts["tokens"] += generated
        return running


def _deliver(batch: list) -> None:
    """On an event loop: hand each job the items the worker sent it."""
    for job, items in batch:
        job._arrive(items)
