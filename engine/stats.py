"""Engine and worker figures forwarded to the API's ``/metrics`` (names without the ``mmserve_``
prefix; the API adds it). Counters are cumulative, gauges current; observations are drained into each
stats message and become histogram samples in the API."""

from __future__ import annotations

from collections import defaultdict

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
        self.count("encoder_runs_total", output.num_encoded_items)
        if plan.num_scheduled_tokens:
            self._observations["num_requests_per_step"].append(len(plan.num_scheduled_tokens))
            self._observations["num_batched_tokens_per_step"].append(plan.num_batched_tokens)
        if output.num_encoded_items:
            self._observations["encoder_seconds"].append(output.encoder_seconds)

    def snapshot(self, scheduler: Scheduler) -> EngineStats:
        """Current figures; drains the observations made since the previous snapshot."""
        encoder_cache = scheduler.encoder_cache
        counters = dict(self._counters)
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
