"""The engine process's generation loop: requests queued and decoded together by one worker thread.

A request becomes a `Job` in a bounded waiting queue (full: `QueueFull`); the worker takes up to `max_batch`
jobs at a time and advances all of them by one token per `Backend.step` (a speculating stream by up to K),
so a long answer does not hold up a short one. A step's items (every job's new tokens, and the end or the
error of those that ended) go to `send` together, in one call per step, not per token: `engine_proc`
sends them to the HTTP process as one message. A job that is cancelled (its client has gone, or its
stop string has appeared) is dropped before its next token.

A job's failure is its own: a stream that fails alone (`Backend.step` gives its exception) ends only its
job; a step that raises ends the jobs in it, never the worker. Every way out of the batch goes through
`_finish`, which closes the job's stream (its cache slot goes back) and uncounts it.

    >>> sent = []                                                                                   # doctest: +SKIP
    >>> scheduler = Scheduler(backend, max_batch=8, max_queue=64, send=sent.append).start()          # doctest: +SKIP
    >>> job = scheduler.submit(prompt_ids, max_new_tokens=16, sampling=Sampling(temperature=0))     # doctest: +SKIP
    >>> sent[0]   # after the first step: [(job, [token id])]; a job's last is END or an error  # doctest: +SKIP
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

from nanoeuler.errors import UserError
from nanoeuler.serve.backend import Backend, Sampling, TokenStream

END = object()  # the last item of a job that finished or was cancelled (one that failed ends with its exception)


class QueueFull(Exception):
    """The waiting queue is at its limit."""


class Job:
    """One request as the worker sees it: its prompt, settings and stream; `key` names it to whoever submitted it."""

    def __init__(
        self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling, stop_at_end: bool = True, key=None, **opts
    ):
        self.prompt_ids, self.max_new_tokens, self.sampling = prompt_ids, max_new_tokens, sampling
        self.stop_at_end, self.key = stop_at_end, key
        self.stream_options = opts  # `Backend.open`'s logprobs and guide, when asked for
        self.stream: TokenStream | None = None  # opened by the worker, closed by `Scheduler._finish`
        self.generated = 0
        self.outcome: str | None = None  # finished, cancelled or failed, once the worker is done with it
        self.cancelled = threading.Event()
        self.queued_at = time.monotonic()  # to its first token: the engine's share of the time to first token

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def grammar_stopped(self) -> bool:
        """Whether the job's grammar (if any) says its answer is complete."""
        guide = self.stream_options.get("guide")
        return guide is not None and guide.stopped


class Scheduler:
    """The bounded queue and the worker thread that decodes up to `max_batch` jobs together; `send(items)` gets
    each step's [(job, [token ids..., END or an exception])] on the worker thread."""

    def __init__(self, backend: Backend, max_batch: int, max_queue: int, send):
        if max_batch < 1 or max_queue < 0:
            raise ValueError("max_batch must be >= 1 and max_queue >= 0")
        if getattr(backend, "capacity", None) is not None and max_batch > backend.capacity:
            raise ValueError(f"max_batch {max_batch} is more than the backend's {backend.capacity} slots")
        self.backend, self.max_batch, self.max_queue, self.send = backend, max_batch, max_queue, send
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._in_flight = 0  # waiting + being decoded
        self.counts = {"finished": 0, "cancelled": 0, "failed": 0, "rejected": 0, "tokens": 0}
        self.first_tokens = [0, 0.0]  # jobs that had their first token, and the seconds from queued to it
        self._outbox: dict = {}  # the worker's items not yet sent: {job: [items]}, sent by `_flush`
        self.on_crash = None  # on_crash(exc): the worker died of an exception no job owns
        profile = os.environ.get("NANOEULER_PROFILE_WORKER")
        if profile and not os.path.isdir(os.path.dirname(os.path.abspath(profile))):
            raise UserError(f"NANOEULER_PROFILE_WORKER: {profile}: its folder does not exist")

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
        self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling, stop_at_end: bool = True, **opts
    ) -> Job:
        """Queue a job (takes a lock for microseconds, never waits on the model). `opts`: `Backend.open`'s
        `logprobs` and `guide`."""
        return self.submit_many([(prompt_ids, max_new_tokens, sampling, stop_at_end, opts)])[0]

    def submit_many(self, specs: list[tuple], keys=None) -> list[Job]:
        """Queue several jobs at once, all or none (the choices of one request): each spec is `submit`'s
        (prompt_ids, max_new_tokens, sampling, stop_at_end, opts); `keys`: the jobs' names."""
        keys = keys or [None] * len(specs)
        jobs = [Job(ids, n, sampling, stop, key, **opts) for (ids, n, sampling, stop, opts), key in zip(specs, keys)]
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
                    job.outcome = "cancelled"
                    self._send(job, RuntimeError("the server is shutting down"))
                self._in_flight -= len(self._waiting)
                self._waiting.clear()
                self._flush()
                return False
            while self._waiting and len(active) < self.max_batch:
                active.append(self._waiting.popleft())  # streams are opened by the next step
        return True

    def _finish(self, job: Job, outcome: str, item=END) -> None:
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
        """Send the queued items: one call, however many jobs and tokens."""
        if self._outbox:
            batch, self._outbox = list(self._outbox.items()), {}
            self.send(batch)

    def _run(self) -> None:
        profile = os.environ.get("NANOEULER_PROFILE_WORKER")  # a file: the worker's cProfile, written at stop
        if profile:
            import cProfile

            cProfile.runctx("self._run_steps()", globals(), {"self": self}, profile)
        else:
            self._run_steps()

    def _run_steps(self) -> None:
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
        running, generated = [], 0
        for job, tokens in zip(live, news):
            if isinstance(tokens, Exception):  # this job's own failure; the others go on
                self._finish(job, "failed", tokens)
                continue
            if tokens:  # several where a speculative pass kept drafts: they arrive together
                if not job.generated:
                    self.first_tokens[0] += 1
                    self.first_tokens[1] += time.monotonic() - job.queued_at
                job.generated += len(tokens)
                self._outbox.setdefault(job, []).extend(tokens)
            generated += len(tokens)
            if job.stream.done:
                self._finish(job, "finished")
            else:
                running.append(job)
        with self._cond:
            self.counts["tokens"] += generated
        return running
