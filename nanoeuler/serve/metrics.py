"""`GET /metrics`: the server's counters in the Prometheus text format (`prometheus-client`).

    nanoeuler_requests_total{status}                    HTTP answers by status code
    nanoeuler_generations_total{outcome}                jobs finished, cancelled, failed; requests rejected (429)
    nanoeuler_prompt_tokens_total                       prompt tokens of accepted requests (each choice counts)
    nanoeuler_generation_tokens_total                   tokens generated
    nanoeuler_stream_events_total, nanoeuler_stream_writes_total   server-sent events of streamed answers, and the
                                                        body writes that carried them (fewer when streams fell
                                                        behind and several events went in one write)
    nanoeuler_queue_depth, nanoeuler_active_jobs        jobs waiting for a slot, jobs being decoded
    nanoeuler_time_to_first_token_seconds               histogram: submitted -> first token (queue included)
    nanoeuler_engine_time_to_first_token_seconds        summary: the engine process's share of it (queued there ->
                                                        first token handed out), no pipe or HTTP
    nanoeuler_inter_token_latency_seconds               histogram: between a job's consecutive tokens
    nanoeuler_prefix_cache_hits_total, nanoeuler_prefix_cache_tokens_total   prompts that reused cached rows,
                                                        and the positions they did not compute
    nanoeuler_spec_drafts_offered_total{head}, nanoeuler_spec_drafts_accepted_total{head}
                                                        speculative decoding's drafts per MTP head
    nanoeuler_spec_acceptance_ratio{head}               accepted / offered
    nanoeuler_gpu_pool_bytes{kind}                      CuPy's memory pool: bytes in use, bytes held (GPU only)
    nanoeuler_grammar_compiles_total                    JSON schemas compiled (the others came from the cache)
    nanoeuler_engine_resident_memory_bytes, nanoeuler_engine_cpu_seconds_total   the engine process's
    nanoeuler_engine_up                                 1 while the engine process runs, 0 once it has stopped
    process_resident_memory_bytes, ...                  the HTTP process's own (`prometheus_client`'s, on Linux)

Each app has its own registry, so two servers in one process (the tests) count apart. The engine's counters
are those it last sent (`EngineProcess.engine_stats`, at most `engine_proc.STATS_EVERY_S` old, and fresh
after every job's end). The two latency histograms are counted here (`_Histogram`), a step's values at once:
a step's message tells them of all its tokens in one call, where `prometheus_client`'s `observe` takes a lock
per value.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    SummaryMetricFamily,
)
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# seconds: a CPU prefill of a long prompt takes seconds, a GPU decode step milliseconds
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    """The registry of one app; `token_latencies` is called per step's message, `answered` per request."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.requests = Counter("nanoeuler_requests", "HTTP answers by status code", ["status"], registry=self.registry)
        self.prompt_tokens = Counter(
            "nanoeuler_prompt_tokens", "prompt tokens of accepted requests", registry=self.registry
        )
        self.ttft = _Histogram("nanoeuler_time_to_first_token_seconds", "submitted to first token", TTFT_BUCKETS)
        self.itl = _Histogram(
            "nanoeuler_inter_token_latency_seconds", "between consecutive tokens of a job", ITL_BUCKETS
        )
        self.registry.register(self.ttft)
        self.registry.register(self.itl)
        self.registry.register(_Live(engine))
        self.stream_events = self.stream_writes = 0  # counted by the event loop alone: plain integers
        self.registry.register(self)  # `collect`: the streams' counts
        ProcessCollector(registry=self.registry)  # resident memory, CPU time: a soak test's flat-memory check

    def token_latencies(self, firsts, gaps) -> None:
        """A step's latencies in seconds: of first tokens (since submitted), and between later tokens."""
        self.ttft.observe_many(firsts)
        self.itl.observe_many(gaps)

    def answered(self, status: int) -> None:
        self.requests.labels(status=str(status)).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self):
        yield CounterMetricFamily(
            "nanoeuler_stream_events", "server-sent events of streamed answers", value=self.stream_events
        )
        yield CounterMetricFamily(
            "nanoeuler_stream_writes",
            "body writes of streamed answers (several events each when behind)",
            value=self.stream_writes,
        )


class _Histogram:
    """A Prometheus histogram (cumulative `le` buckets, `_sum`, `_count`) that takes many values per call.

    >>> h = _Histogram("x_seconds", "x", (0.1, 1))
    >>> h.observe_many([0.05, 0.1, 3.0]); h.counts, h.sum
    ([2, 0, 1], 3.15)
    """

    def __init__(self, name: str, doc: str, bounds):
        self.name, self.doc, self.bounds = name, doc, tuple(float(b) for b in bounds)
        self.counts = [0] * (len(bounds) + 1)  # per bucket, the last above every bound
        self.sum = 0.0
        self._lock = threading.Lock()  # the worker adds, a scrape on the event loop reads

    def observe_many(self, values) -> None:
        if not values:
            return
        # a value equal to a bound belongs to that bound's bucket (Prometheus' `le`); a step's few dozen
        # values are counted faster in plain Python than through NumPy's calls
        at = [bisect_left(self.bounds, v) for v in values]
        total = sum(values)
        with self._lock:
            for i in at:
                self.counts[i] += 1
            self.sum += total

    def collect(self):
        with self._lock:
            counts, total = list(accumulate(self.counts)), self.sum
        buckets = [(floatToGoString(b), int(c)) for b, c in zip(self.bounds, counts)]
        yield HistogramMetricFamily(self.name, self.doc, buckets=buckets + [("+Inf", int(counts[-1]))], sum_value=total)


class _Live:
    """The counts kept elsewhere (this side's of the jobs, the engine's as it last told), read at each scrape."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats, there = self.engine.stats(), self.engine.engine_stats
        outcomes = CounterMetricFamily("nanoeuler_generations", "jobs by outcome (rejected: 429)", labels=["outcome"])
        for outcome in ("finished", "cancelled", "failed", "rejected"):
            outcomes.add_metric([outcome], stats[outcome])
        yield outcomes
        yield CounterMetricFamily("nanoeuler_generation_tokens", "tokens generated", value=stats["tokens"])
        yield GaugeMetricFamily("nanoeuler_queue_depth", "jobs waiting for a slot", value=stats["waiting"])
        yield GaugeMetricFamily("nanoeuler_active_jobs", "jobs being decoded", value=stats["active"])
        yield CounterMetricFamily(
            "nanoeuler_prefix_cache_hits", "prompts that reused a cached prefix", value=there.get("prefix_hits", 0)
        )
        yield CounterMetricFamily(
            "nanoeuler_prefix_cache_tokens",
            "prompt positions copied, not computed",
            value=there.get("prefix_tokens", 0),
        )
        offered = CounterMetricFamily("nanoeuler_spec_drafts_offered", "drafts checked, per MTP head", labels=["head"])
        accepted = CounterMetricFamily("nanoeuler_spec_drafts_accepted", "drafts kept, per MTP head", labels=["head"])
        ratio = GaugeMetricFamily(
            "nanoeuler_spec_acceptance_ratio", "drafts kept / checked, per MTP head", labels=["head"]
        )
        for k, (o, a) in enumerate(zip(there.get("spec_offered", []), there.get("spec_accepted", []))):
            offered.add_metric([str(k + 1)], o)
            accepted.add_metric([str(k + 1)], a)
            ratio.add_metric([str(k + 1)], a / o if o else 0.0)
        yield from (offered, accepted, ratio)
        if there.get("gpu_pool") is not None:
            gpu = GaugeMetricFamily("nanoeuler_gpu_pool_bytes", "CuPy's memory pool", labels=["kind"])
            gpu.add_metric(["used"], there["gpu_pool"][0])
            gpu.add_metric(["held"], there["gpu_pool"][1])
            yield gpu
        yield CounterMetricFamily(
            "nanoeuler_grammar_compiles", "JSON schemas compiled", value=there.get("grammar_compiles", 0)
        )
        if there.get("first_tokens"):
            count, seconds = there["first_tokens"]
            yield SummaryMetricFamily(
                "nanoeuler_engine_time_to_first_token_seconds",
                "queued in the engine process to first token",
                count_value=count,
                sum_value=seconds,
            )
        if there.get("resident_bytes") is not None:
            yield GaugeMetricFamily(
                "nanoeuler_engine_resident_memory_bytes", "the engine process's", value=there["resident_bytes"]
            )
        if there.get("cpu_s") is not None:
            yield CounterMetricFamily("nanoeuler_engine_cpu_seconds", "the engine process's", value=there["cpu_s"])
        yield GaugeMetricFamily("nanoeuler_engine_up", "1 while the engine process runs", value=int(self.engine.alive))
