"""Engine and worker figures forwarded to the API's ``/metrics``, by the names in ``wire/metric_names.py``.
Counters are cumulative, gauges current; observations are drained into each stats message and become
histogram samples in the API."""

from __future__ import annotations

import time
from collections import defaultdict

from engine.ec_connector import ECConnectorScheduler
from engine.encode_scheduler import EncodeOnlyScheduler
from engine.request import Request
from engine.scheduler import Scheduler
from engine.step_plan import StepPlan
from engine.structured.compiler import GrammarCompiler
from wire.metric_names import EngineCounter, EngineGauge, EngineObservation
from wire.protocol import EngineStats, RunnerOutput


class EngineMetrics:
    def __init__(self) -> None:
        self._counters: dict[EngineCounter, float] = defaultdict(float)
        self._observations: dict[EngineObservation, list[float]] = defaultdict(list)

    def count(self, name: EngineCounter, value: float = 1.0) -> None:
        self._counters[name] += value

    def set_total(self, name: EngineCounter, value: float) -> None:
        """A counter kept outside the core (already cumulative, across worker restarts)."""
        self._counters[name] = value

    def record_admitted(self, requests: list[Request]) -> None:
        """Called when a step is scheduled, with the requests it computes for the first time."""
        now = time.monotonic()
        for request in requests:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                self._observations[EngineObservation.REQUEST_QUEUE_SECONDS].append(now - request.arrival_time)

    def record_tokens(self, request: Request) -> None:
        """Called for each output that carries tokens: the first one ends the request's prefill."""
        if request.first_token_time is None and request.first_scheduled_time is not None:
            request.first_token_time = time.monotonic()
            elapsed = request.first_token_time - request.first_scheduled_time
            self._observations[EngineObservation.REQUEST_PREFILL_SECONDS].append(elapsed)

    def record_step(self, plan: StepPlan, output: RunnerOutput) -> None:
        """Called after every step that ran on the worker."""
        self.count(EngineCounter.ENGINE_STEPS)
        self.count(EngineCounter.WORKER_BUSY_SECONDS, output.step_seconds)
        self.count(EngineCounter.ENCODER_RUNS, output.num_encoded_items)
        if plan.num_scheduled_tokens:
            self._observations[EngineObservation.REQUESTS_PER_STEP].append(len(plan.num_scheduled_tokens))
            self._observations[EngineObservation.BATCHED_TOKENS_PER_STEP].append(plan.num_batched_tokens)
        if output.num_encoded_items:
            self._observations[EngineObservation.ENCODER_SECONDS].append(output.encoder_seconds)
        if plan.num_scheduled_tokens:
            self._observations[EngineObservation.FORWARD_SECONDS].append(output.forward_seconds)
        ec = output.ec_stats
        if ec is not None:
            self.count(EngineCounter.EC_LOADS, ec.num_loads)
            self.count(EngineCounter.EC_LOAD_FAILURES, ec.num_load_failures)
            self.count(EngineCounter.EC_FALLBACK_ENCODES, ec.num_fallback_encodes)
            self.count(EngineCounter.EC_SAVES, ec.num_saves)
            self.count(EngineCounter.EC_SAVE_FAILURES, ec.num_save_failures)
            self.count(EngineCounter.EC_LOAD_BYTES, ec.load_bytes)
            self.count(EngineCounter.EC_SAVE_BYTES, ec.save_bytes)
            self._observations[EngineObservation.EC_LOAD_SECONDS] += ec.load_seconds

    def snapshot(
        self,
        scheduler: Scheduler | EncodeOnlyScheduler,
        connector: ECConnectorScheduler | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> EngineStats:
        """Current figures; drains the observations made since the previous snapshot."""
        encoder_cache = scheduler.encoder_cache
        counters: dict[str, float] = {str(name): value for name, value in self._counters.items()}
        gauges: dict[str, float] = {}
        if grammars is not None:  # the engine process's compiler: its counts span worker restarts
            # first: this absorbs the compiles that ended since, so their counts and seconds go out
            # with the gauge that no longer counts them
            gauges[EngineGauge.GRAMMAR_COMPILES_RUNNING] = float(grammars.num_compiling())
            stats = grammars.stats
            counters[EngineCounter.GRAMMAR_CACHE_HITS] = stats.num_hits
            counters[EngineCounter.GRAMMAR_CACHE_MISSES] = stats.num_misses
            counters[EngineCounter.GRAMMAR_COMPILE_FAILURES] = stats.num_failures
            counters[EngineCounter.GRAMMAR_COMPILE_TIMEOUTS] = stats.num_timeouts
            self._observations[EngineObservation.GRAMMAR_COMPILE_SECONDS] += stats.compile_seconds
            stats.compile_seconds = []
            gauges[EngineGauge.GRAMMAR_CACHE_BYTES] = float(grammars.cache_bytes)
        if isinstance(scheduler, Scheduler):
            gauges[EngineGauge.REQUESTS_AWAITING_GRAMMAR] = float(scheduler.num_awaiting_grammar)
        if connector is not None:
            counters[EngineCounter.EC_LOOKUPS] = connector.num_lookups
            counters[EngineCounter.EC_LOOKUP_HITS] = connector.num_lookup_hits
            counters[EngineCounter.EC_LOOKUP_ERRORS] = connector.num_lookup_errors
        counters[EngineCounter.ENCODER_CACHE_QUERIES] = encoder_cache.num_queries
        counters[EngineCounter.ENCODER_CACHE_HITS] = encoder_cache.num_hits
        counters[EngineCounter.ENCODER_CACHE_HIT_TOKENS] = encoder_cache.num_hit_tokens
        kv_cache = scheduler.kv_cache
        counters[EngineCounter.PREFIX_CACHE_QUERIES] = kv_cache.num_prefix_queries_tokens
        counters[EngineCounter.PREFIX_CACHE_HITS] = kv_cache.num_prefix_hits_tokens
        counters[EngineCounter.PREEMPTIONS] = scheduler.num_preemptions
        counters[EngineCounter.FORCED_TOKENS] = scheduler.num_forced_tokens
        gauges |= {
            EngineGauge.ENCODER_CACHE_USAGE: float(encoder_cache.num_used_tokens),
            EngineGauge.ENCODER_CACHE_CAPACITY: float(encoder_cache.capacity_tokens),
            EngineGauge.REQUESTS_RUNNING: float(scheduler.num_running),
            EngineGauge.REQUESTS_WAITING: float(scheduler.num_waiting),
            EngineGauge.KV_CACHE_USAGE: kv_cache.usage,
        }
        observations = {str(name): values for name, values in self._observations.items()}
        self._observations = defaultdict(list)
        return EngineStats(counters=counters, gauges=gauges, observations=observations)
