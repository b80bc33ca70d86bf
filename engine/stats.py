"""Engine and worker figures forwarded to the API's ``/metrics`` (names without the ``mmserve_``
prefix; the API adds it). Counters are cumulative, gauges current; observations are drained into each
stats message and become histogram samples in the API."""

from __future__ import annotations

from collections import defaultdict

from engine.ec_connector import ECConnectorScheduler
from engine.encode_scheduler import EncodeOnlyScheduler
from engine.protocol import EngineStats, RunnerOutput
from engine.scheduler import Scheduler, StepPlan


class EngineMetrics:
    def __init__(self) -> None:
        self._counters: dict[str, float] = defaultdict(float)
        self._observations: dict[str, list[float]] = defaultdict(list)

    def count(self, name: str, value: float = 1.0) -> None:
        self._counters[name] += value

    def set_total(self, name: str, value: float) -> None:
        """A counter kept outside the core (already cumulative, across worker restarts)."""
        self._counters[name] = value

    def record_step(self, plan: StepPlan, output: RunnerOutput) -> None:
        """Called after every step that ran on the worker."""
        self.count("engine_steps_total")
        self.count("worker_busy_seconds_total", output.step_seconds)
        self.count("encoder_runs_total", output.num_encoded_items)
        if plan.num_scheduled_tokens:
            self._observations["num_requests_per_step"].append(len(plan.num_scheduled_tokens))
            self._observations["num_batched_tokens_per_step"].append(plan.num_batched_tokens)
        if output.num_encoded_items:
            self._observations["encoder_seconds"].append(output.encoder_seconds)
        if plan.num_scheduled_tokens:
            self._observations["forward_seconds"].append(output.forward_seconds)
        ec = output.ec_stats
        if ec is not None:
            self.count("ec_loads_total", ec.num_loads)
            self.count("ec_load_failures_total", ec.num_load_failures)
            self.count("ec_fallback_encodes_total", ec.num_fallback_encodes)
            self.count("ec_saves_total", ec.num_saves)
            self.count("ec_save_failures_total", ec.num_save_failures)
            self.count("ec_load_bytes_total", ec.load_bytes)
            self.count("ec_save_bytes_total", ec.save_bytes)
            self._observations["ec_load_seconds"] += ec.load_seconds

    def snapshot(
        self, scheduler: Scheduler | EncodeOnlyScheduler, connector: ECConnectorScheduler | None = None
    ) -> EngineStats:
        """Current figures; drains the observations made since the previous snapshot."""
        encoder_cache = scheduler.encoder_cache
        counters = dict(self._counters)
        if connector is not None:
            counters["ec_lookups_total"] = connector.num_lookups
            counters["ec_lookup_hits_total"] = connector.num_lookup_hits
            counters["ec_lookup_errors_total"] = connector.num_lookup_errors
        counters["encoder_cache_queries_total"] = encoder_cache.num_queries
        counters["encoder_cache_hits_total"] = encoder_cache.num_hits
        kv_cache = scheduler.kv_cache
        counters["prefix_cache_queries_total"] = kv_cache.num_prefix_queries_tokens
        counters["prefix_cache_hits_total"] = kv_cache.num_prefix_hits_tokens
        counters["num_preemptions_total"] = scheduler.num_preemptions
        gauges = {
            "encoder_cache_usage_tokens": float(encoder_cache.num_used_tokens),
            "encoder_cache_capacity_tokens": float(encoder_cache.capacity_tokens),
            "num_requests_running": float(scheduler.num_running),
            "num_requests_waiting": float(scheduler.num_waiting),
            "kv_cache_usage_ratio": kv_cache.usage,
        }
        observations, self._observations = dict(self._observations), defaultdict(list)
        return EngineStats(counters=counters, gauges=gauges, observations=observations)
