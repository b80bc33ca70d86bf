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

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client import values as prometheus_values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from engine.protocol import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STEP_BUCKETS = (0.001, 0.0025, *LATENCY_BUCKETS)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 2048, 4096, 8192, 16384)
EC_BUCKETS = (0.0005, 0.001, 0.0025, *LATENCY_BUCKETS)
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# engine-side counter/gauge names (without prefix) and their help texts
ENGINE_COUNTERS = {
    "encoder_cache_queries_total": "Encoder-cache lookups (items).",
    "encoder_cache_hits_total": "Encoder-cache lookups that found the item already encoded.",
    "encoder_runs_total": "Items run through the vision encoder.",
    "engine_steps_total": "Engine steps run on the worker.",
    "prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache (at admission).",
    "prefix_cache_hits_total": "Prompt tokens whose KV came from the prefix cache.",
    "num_preemptions_total": "Requests preempted (KV freed, recomputed later) because KV blocks ran out.",
    "mm_ipc_cache_resends_total": "Items the receiver cache lacked though the mirror said cached (stays 0).",
    "engine_failed_steps_total": "Engine steps the worker failed or did not answer in time.",
    "worker_busy_seconds_total": "Seconds the worker spent on engine steps, as it reports them (its rate "
    "is the worker's busy fraction).",
    "worker_losses_total": "Times the engine lost its worker (the process died or disconnected).",
    "worker_stale_replies_total": "Late worker replies to an earlier step, discarded.",
    "mm_shm_stale_refs_total": "Shared-memory references the engine found stale; re-sent with payload.",
    "ec_lookups_total": "Items looked up in the encoder-cache connector's store (has_caches).",
    "ec_lookup_hits_total": "Store lookups that found the item (it is loaded instead of encoded).",
    "ec_lookup_errors_total": "Store lookups that failed: the store could not be reached.",
    "ec_loads_total": "Encoder outputs loaded from the store.",
    "ec_load_failures_total": "Loads that failed (missing after the lookup, store down, corrupt value).",
    "ec_fallback_encodes_total": "Items encoded locally because their load failed.",
    "ec_saves_total": "Encoder outputs saved to the store.",
    "ec_save_failures_total": "Saves the store refused (full) or could not take (down); not retried.",
}
# engine counters rendered as one labelled family: family name -> (label, {label value: counter name})
ENGINE_LABELLED_COUNTERS = {
    "ec_bytes": (
        "Encoder-output bytes moved through the connector's store.",
        "direction",
        {"load": "ec_load_bytes_total", "save": "ec_save_bytes_total"},
    ),
}
ENGINE_GAUGES = {
    "encoder_cache_usage_tokens": "Encoder-cache space in use (embeddings), freeable entries included.",
    "encoder_cache_capacity_tokens": "Encoder-cache capacity (embeddings).",
    "num_requests_running": "Requests running in the engine.",
    "num_requests_waiting": "Requests waiting in the engine (preempted ones included).",
    "kv_cache_usage_ratio": "Share of KV-cache blocks in use by running requests.",
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
        for name, help_text in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(
                f"mmserve_{name.removesuffix('_total')}", help_text, value=counters.get(name, 0.0)
            )
        for family, (help_text, label, members) in ENGINE_LABELLED_COUNTERS.items():
            labelled = CounterMetricFamily(f"mmserve_{family}", help_text, labels=[label])
            for value, name in members.items():
                labelled.add_metric([value], counters.get(name, 0.0))
            yield labelled
        for name, help_text in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(f"mmserve_{name}", help_text, value=gauges.get(name, 0.0))
        for histogram in self._metrics.engine_histograms.values():
            yield histogram.family()


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

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"mmserve_{name}", doc, buckets=buckets, registry=r)

        self.mm_items = counter("mm_items", "Multimodal items (images) received.")
        self.processor_cache_queries = counter(
            "mm_processor_cache_queries", "Processor-cache lookups (items)."
        )
        self.processor_cache_hits = counter("mm_processor_cache_hits", "Processor-cache hits (items).")
        self.ipc_cache_queries = counter("mm_ipc_cache_queries", "IPC-mirror lookups (items).")
        self.ipc_cache_hits = counter("mm_ipc_cache_hits", "IPC-mirror hits: item sent as a key only.")
        self.ipc_payload_bytes = counter(
            "mm_ipc_payload_bytes", "Multimodal bytes sent API->engine, keys included."
        )
        self.shm_bytes = counter("mm_shm_bytes", "Processed-item bytes written into the shared-memory ring.")
        self.shm_fallbacks = counter(
            "mm_shm_fallbacks",
            "Items that took the normal path with shm (larger than the object limit, or no free room).",
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = counter("request_success", "Finished requests.", ("finish_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.e2e_latency = histogram("e2e_request_latency_seconds", "End-to-end request latency.")
        self.fetch_seconds = histogram(
            "mm_fetch_seconds", "Time to fetch one image's bytes (URL or data URL)."
        )
        self.processor_seconds = histogram(
            "mm_processor_seconds",
            "Image decode + HF processor time of one run (a miss; shared by concurrent misses).",
        )
        self.engine_counters: dict[str, float] = {}
        self.engine_gauges: dict[str, float] = {}
        self.engine_histograms = {
            name: EngineHistogram(f"mmserve_{name}", doc, buckets)
            for name, doc, buckets in (
                ("encoder_seconds", "Vision-encoder time of one engine step.", LATENCY_BUCKETS),
                (
                    "forward_seconds",
                    "Language-model time of one engine step (forward and sampling).",
                    STEP_BUCKETS,
                ),
                ("num_requests_per_step", "Requests batched together in one engine step.", BATCH_BUCKETS),
                ("num_batched_tokens_per_step", "Tokens computed in one engine step.", TOKEN_BUCKETS),
                ("ec_load_seconds", "Time to load one encoder output from the store.", EC_BUCKETS),
            )
        }
        if self.multiprocess_dir is None:
            self.registry.register(_EngineCollector(self))
            self._exposed = self.registry
        else:  # every API process's files, plus this process's copy of the engine's figures
            self._exposed = CollectorRegistry()
            MultiProcessCollector(self._exposed, path=self.multiprocess_dir)
            self._exposed.register(_EngineCollector(self))

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
