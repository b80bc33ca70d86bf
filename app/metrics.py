"""Prometheus metrics of the API process, including the engine's and workers' figures, which arrive
in ``EngineStats`` messages (docs/architecture.md, "Metrics").
One registry per app, no import-time singletons.

Several API processes on one port (``serve --api-server-count N``): the launcher sets
``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's own switch) for every API process, so the API-side
counters and histograms live in per-process files there, and whichever process answers ``/metrics`` sums
them (``MultiProcessCollector``; a dead process's files stay, so totals survive its restart). The engine's
figures are not summed: every API process receives the same ``EngineStats``, so each renders its own copy
(engine counters and gauges are the engine's global values; the engine histograms count the steps since
the answering API process connected).
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client import values as prometheus_values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from wire.metric_names import EngineCounter, EngineGauge, EngineObservation
from wire.protocol import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STEP_BUCKETS = (0.001, 0.0025, *LATENCY_BUCKETS)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 2048, 4096, 8192, 16384)
EC_BUCKETS = (0.0005, 0.001, 0.0025, *LATENCY_BUCKETS)
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Label values exported at 0 from the start. A series that appears with its first increment shows no
# rate() for that increment, so without these the first error of a kind would not show on a dashboard.
CHAT_ROUTE = "/v1/chat/completions"
CHAT_STATUSES = ("200", "400", "401", "404", "413", "415", "429", "499", "500", "503")  # every one it answers
FINISH_REASONS = ("stop", "length")

# Engine counters exported as one family with a label: family -> (help, label, {label value: counter}).
# Every other counter and every gauge of wire/metric_names.py is a family of its own.
ENGINE_LABELLED_COUNTERS: dict[str, tuple[str, str, dict[str, EngineCounter]]] = {
    "ec_bytes": (
        "Encoder-output bytes moved through the connector's store.",
        "direction",
        {"load": EngineCounter.EC_LOAD_BYTES, "save": EngineCounter.EC_SAVE_BYTES},
    ),
}
BAD_MESSAGES = "bad_messages"
BAD_MESSAGES_HELP = (
    "Messages a process received that did not decode or that it could not take in its state, by the "
    "receiving process and the sender's role; each was dropped and the process served on."
)
# the engine's and its worker's counts, as (process, source) samples of mmserve_bad_messages_total
ENGINE_BAD_MESSAGES = {
    ("engine", "api"): EngineCounter.BAD_MESSAGES_FROM_API,
    ("engine", "worker"): EngineCounter.BAD_MESSAGES_FROM_WORKER,
    ("worker", "engine"): EngineCounter.WORKER_BAD_MESSAGES,
}
HISTOGRAM_BUCKETS = {
    EngineObservation.ENCODER_SECONDS: LATENCY_BUCKETS,
    EngineObservation.FORWARD_SECONDS: STEP_BUCKETS,
    EngineObservation.REQUESTS_PER_STEP: BATCH_BUCKETS,
    EngineObservation.BATCHED_TOKENS_PER_STEP: TOKEN_BUCKETS,
    EngineObservation.EC_LOAD_SECONDS: EC_BUCKETS,
    EngineObservation.GRAMMAR_COMPILE_SECONDS: LATENCY_BUCKETS,
    EngineObservation.REQUEST_QUEUE_SECONDS: LATENCY_BUCKETS,
    EngineObservation.REQUEST_PREFILL_SECONDS: LATENCY_BUCKETS,
}
_SEPARATE = {*ENGINE_BAD_MESSAGES.values()} | {
    counter for _, _, members in ENGINE_LABELLED_COUNTERS.values() for counter in members.values()
}


class EngineHistogram:
    """Cumulative bucket counts of one engine histogram, fed with ``EngineStats`` observations. Kept in
    this process only (not a prometheus ``Histogram``, which multiprocess mode would sum over the API
    processes, each of which receives the same observations); rendered like one."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.doc = doc
        self.bounds = (*(float(b) for b in buckets), float("inf"))
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # buckets are "<= bound", as prometheus
        self.sum += value

    def family(self) -> HistogramMetricFamily:
        cumulative = itertools.accumulate(self.counts)
        buckets = [(floatToGoString(b), float(c)) for b, c in zip(self.bounds, cumulative, strict=True)]
        return HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=self.sum)


class _EngineCollector(Collector):
    """The engine's figures as this API process last received them (never summed over processes)."""

    def __init__(self, metrics: ApiMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        counters, gauges = self._metrics.engine_counters, self._metrics.engine_gauges
        for counter in EngineCounter:
            if counter not in _SEPARATE:
                name = f"mmserve_{counter.removesuffix('_total')}"
                yield CounterMetricFamily(name, counter.help, value=counters.get(counter, 0.0))
        for family, (help_text, label, members) in ENGINE_LABELLED_COUNTERS.items():
            labelled = CounterMetricFamily(f"mmserve_{family}", help_text, labels=[label])
            for value, counter in members.items():
                labelled.add_metric([value], counters.get(counter, 0.0))
            yield labelled
        bad = CounterMetricFamily(f"mmserve_{BAD_MESSAGES}", BAD_MESSAGES_HELP, labels=["process", "source"])
        for labels, counter in ENGINE_BAD_MESSAGES.items():
            bad.add_metric(list(labels), counters.get(counter, 0.0))
        yield bad
        for gauge in EngineGauge:
            yield GaugeMetricFamily(f"mmserve_{gauge}", gauge.help, value=gauges.get(gauge, 0.0))
        for histogram in self._metrics.engine_histograms.values():
            yield histogram.family()


class _Merged(Collector):
    """The families of several collectors, those of one name merged into one (the API's own
    ``bad_messages`` samples and the engine's): an exposition may name a family only once."""

    def __init__(self, *collectors: Collector) -> None:
        self._collectors = collectors

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for collector in self._collectors:
            for family in collector.collect():
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = family
        yield from merged.values()


class ApiMetrics:
    """``registry`` holds this process's own metrics; ``render`` shows the totals of every API process
    when ``PROMETHEUS_MULTIPROC_DIR`` is set (created, empty, before the first API process starts)."""

    def __init__(self) -> None:
        disable_created_metrics()  # the *_created series only add noise to every counter
        self.multiprocess_dir = os.environ.get(MULTIPROC_DIR_ENV)
        if self.multiprocess_dir is not None and not prometheus_values.ValueClass._multiprocess:
            # prometheus_client picks its value class when first imported, maybe before the variable
            # was set: switch it now, before the first metric (every metric reads it when created)
            prometheus_values.ValueClass = prometheus_values.MultiProcessValue()
        self.registry = CollectorRegistry()
        r = self.registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"mmserve_{name}", doc, labels, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            """With several API processes: the largest of theirs (each holds the same shared figure, or its
            own share of one)."""
            return Gauge(f"mmserve_{name}", doc, registry=r, multiprocess_mode="max")

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"mmserve_{name}", doc, buckets=buckets, registry=r)

        self.mm_items = counter("mm_items", "Multimodal items (images and videos) received.")
        self.processor_cache_queries = counter(
            "mm_processor_cache_queries", "Processor-cache lookups (items)."
        )
        self.processor_cache_hits = counter("mm_processor_cache_hits", "Processor-cache hits (items).")
        self.ipc_cache_queries = counter("mm_ipc_cache_queries", "IPC-mirror lookups (items).")
        self.ipc_cache_hits = counter("mm_ipc_cache_hits", "IPC-mirror hits: item sent as a key only.")
        self.ipc_payload_bytes = counter(
            "mm_ipc_payload_bytes", "Multimodal bytes sent API->engine, keys included."
        )
        self.ipc_saved_bytes = counter(
            "mm_ipc_saved_bytes",
            "Processed-item bytes not sent API->engine because the engine held the item (IPC-mirror "
            "hits; with shm, ring hits).",
        )
        self.shm_bytes = counter("mm_shm_bytes", "Processed-item bytes written into the shared-memory ring.")
        self.shm_fallbacks = counter(
            "mm_shm_fallbacks",
            "Items that took the normal path with shm (larger than the object limit, or no free room).",
        )
        self.uuid_lookups = counter(
            "mm_uuid_lookups",
            "Media ids (uuid) sent without their media: hit (served from a cache) or unknown (400 "
            "media_uuid_unknown).",
            ("result",),
        )
        for result in ("hit", "unknown"):
            self.uuid_lookups.labels(result=result)
        self.uuid_bindings = gauge("mm_uuid_bindings", "Media-id bindings (uuid -> media) held.")
        # the response store's totals (one file shared by the API processes: each sees the same)
        self.responses_stored = gauge("responses_stored", "Responses held in the response store.")
        self.responses_stored_bytes = gauge(
            "responses_stored_bytes",
            "Bytes the response store holds: conversations, response objects and images (each once).",
        )
        self.responses_evicted = counter(
            "responses_evicted", "Stored responses evicted, least recently used first, past a store bound."
        )
        self.requests_sent = counter(
            "engine_requests_sent",
            "Requests handed to the engine (each choice of n one; a resend with payloads again).",
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = counter("request_success", "Finished requests.", ("finish_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Time between a request's consecutive tokens reaching the API (an output of k tokens after t "
            "seconds: k observations of t/k).",
            STEP_BUCKETS,
        )
        self.e2e_latency = histogram("e2e_request_latency_seconds", "End-to-end request latency.")
        self.fetch_seconds = histogram(
            "mm_fetch_seconds", "Time to fetch one item's bytes (URL or data URL)."
        )
        self.processor_seconds = histogram(
            "mm_processor_seconds",
            "Decode + processor time of one item (a miss; shared by concurrent misses).",
        )
        self.engine_counters: dict[str, float] = {}
        self.engine_gauges: dict[str, float] = {}
        self.engine_histograms: dict[str, EngineHistogram] = {
            name: EngineHistogram(f"mmserve_{name}", name.help, buckets)
            for name, buckets in HISTOGRAM_BUCKETS.items()
        }
        self.http_requests = counter(
            "http_requests", "HTTP requests answered, by route and status code.", ("route", "status")
        )
        for status in CHAT_STATUSES:
            self.http_requests.labels(route=CHAT_ROUTE, status=status)
        for reason in FINISH_REASONS:
            self.request_success.labels(finish_reason=reason)
        self.bad_messages = counter(BAD_MESSAGES, BAD_MESSAGES_HELP, ("process", "source")).labels(
            process="api", source="engine"
        )
        # this process's own metrics, or every API process's files; plus this process's copy of the
        # engine's figures
        own: Collector = self.registry
        if self.multiprocess_dir is not None:
            own = MultiProcessCollector(None, path=self.multiprocess_dir)
        self._exposed = CollectorRegistry()
        self._exposed.register(_Merged(own, _EngineCollector(self)))

    def apply_engine_stats(self, stats: EngineStats) -> None:
        self.engine_counters = stats.counters
        self.engine_gauges = stats.gauges
        for name, values in stats.observations.items():
            histogram = self.engine_histograms.get(name)
            if histogram is not None:
                for value in values:
                    histogram.observe(value)

    def render(self) -> bytes:
        return generate_latest(self._exposed)
