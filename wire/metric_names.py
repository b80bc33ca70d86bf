"""The figures the engine reports to the API processes in ``EngineStats`` (its own and its worker's), by
name: the one list the engine counts with and the API's ``/metrics`` exports, so a name cannot be
misspelt on one side only. Names are without the ``mmserve_`` prefix, which the API adds; each member
carries its help text (docs/architecture.md, "Metrics").

    engine ── EngineStats(counters={EngineCounter: float}, gauges={EngineGauge: float},
                          observations={EngineObservation: [float]}) ──▶ API /metrics
"""

from __future__ import annotations

import enum


class _Named(enum.StrEnum):
    """A metric name (its value) with its help text."""

    help: str

    def __new__(cls, name: str, help_text: str) -> _Named:
        member = str.__new__(cls, name)
        member._value_ = name
        member.help = help_text
        return member


class EngineCounter(_Named):
    """Cumulative counts (``*_total``)."""

    ENCODER_CACHE_QUERIES = "encoder_cache_queries_total", "Encoder-cache lookups (items)."
    ENCODER_CACHE_HITS = (
        "encoder_cache_hits_total",
        "Encoder-cache lookups that found the item already encoded.",
    )
    ENCODER_CACHE_HIT_TOKENS = (
        "encoder_cache_hit_tokens_total",
        "Embeddings (tokens) of encoder-cache hits: vision-encoder output reused, not computed again.",
    )
    ENCODER_RUNS = "encoder_runs_total", "Items run through the vision encoder."
    ENGINE_STEPS = "engine_steps_total", "Engine steps run on the worker."
    ENGINE_STEPS_AHEAD = (
        "engine_steps_ahead_total",
        "Engine steps scheduled and sent while the step before them still ran (--async-scheduling).",
    )
    PREFIX_CACHE_QUERIES = (
        "prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache (at admission).",
    )
    PREFIX_CACHE_HITS = "prefix_cache_hits_total", "Prompt tokens whose KV came from the prefix cache."
    PREEMPTIONS = (
        "num_preemptions_total",
        "Requests preempted (KV freed, recomputed later) because KV blocks ran out.",
    )
    IPC_CACHE_RESENDS = (
        "mm_ipc_cache_resends_total",
        "Items the receiver cache lacked though the mirror said cached (stays 0).",
    )
    FAILED_STEPS = "engine_failed_steps_total", "Engine steps the worker failed or did not answer in time."
    WORKER_BUSY_SECONDS = (
        "worker_busy_seconds_total",
        "Seconds the worker spent on engine steps, as it reports them (its rate is the worker's busy "
        "fraction).",
    )
    WORKER_LOSSES = (
        "worker_losses_total",
        "Times the engine lost its worker (the process died or disconnected).",
    )
    WORKER_STALE_REPLIES = "worker_stale_replies_total", "Late worker replies to an earlier step, discarded."
    SHM_STALE_REFS = (
        "mm_shm_stale_refs_total",
        "Shared-memory references the engine found stale; re-sent with payload.",
    )
    EC_LOOKUPS = "ec_lookups_total", "Items looked up in the encoder-cache connector's store (has_caches)."
    EC_LOOKUP_HITS = (
        "ec_lookup_hits_total",
        "Store lookups that found the item (it is loaded instead of encoded).",
    )
    EC_LOOKUP_ERRORS = "ec_lookup_errors_total", "Store lookups that failed: the store could not be reached."
    EC_LOADS = "ec_loads_total", "Encoder outputs loaded from the store."
    EC_LOAD_FAILURES = (
        "ec_load_failures_total",
        "Loads that failed (missing after the lookup, store down, corrupt value).",
    )
    EC_FALLBACK_ENCODES = "ec_fallback_encodes_total", "Items encoded locally because their load failed."
    EC_SAVES = "ec_saves_total", "Encoder outputs saved to the store."
    EC_SAVE_FAILURES = (
        "ec_save_failures_total",
        "Saves the store refused (full) or could not take (down); not retried.",
    )
    # exported as one family each, with a label (the API's exporter says which)
    EC_LOAD_BYTES = "ec_load_bytes_total", "Encoder-output bytes loaded from the connector's store."
    EC_SAVE_BYTES = "ec_save_bytes_total", "Encoder-output bytes saved to the connector's store."
    BAD_MESSAGES_FROM_API = (
        "bad_messages_from_api_total",
        "Messages on the engine's API socket that did not decode or that it could not take; dropped.",
    )
    BAD_MESSAGES_FROM_WORKER = (
        "bad_messages_from_worker_total",
        "Messages on the engine's worker socket that did not decode or that it could not take; dropped.",
    )
    WORKER_BAD_MESSAGES = (
        "worker_bad_messages_total",
        "Messages the worker received from the engine that did not decode or that it could not take.",
    )
    GRAMMAR_CACHE_HITS = (
        "structured_output_cache_hits_total",
        "Constrained requests whose grammar was already compiled (compiled-grammar cache hits).",
    )
    GRAMMAR_CACHE_MISSES = (
        "structured_output_cache_misses_total",
        "Constrained requests that waited for a compile (their own, or one already running).",
    )
    GRAMMAR_COMPILE_FAILURES = (
        "structured_output_compile_failures_total",
        "Constraints that could not be compiled (invalid, or past the compile timeout); each a 400.",
    )
    GRAMMAR_COMPILE_TIMEOUTS = (
        "structured_output_compile_timeouts_total",
        "Requests that stopped waiting for their grammar at --structured-output-compile-timeout-s.",
    )
    FORCED_TOKENS = (
        "structured_output_forced_tokens_total",
        "Output tokens appended without sampling: the only token a request's grammar allowed next.",
    )


class EngineGauge(_Named):
    """Current values."""

    ENCODER_CACHE_USAGE = (
        "encoder_cache_usage_tokens",
        "Encoder-cache space in use (embeddings), freeable entries included.",
    )
    ENCODER_CACHE_CAPACITY = "encoder_cache_capacity_tokens", "Encoder-cache capacity (embeddings)."
    REQUESTS_RUNNING = "num_requests_running", "Requests running in the engine."
    REQUESTS_WAITING = "num_requests_waiting", "Requests waiting in the engine (preempted ones included)."
    KV_CACHE_USAGE = "kv_cache_usage_ratio", "Share of KV-cache blocks in use by running requests."
    GRAMMAR_CACHE_BYTES = "structured_output_cache_bytes", "Bytes of compiled grammars the engine keeps."
    GRAMMAR_COMPILES_RUNNING = (
        "structured_output_compiles_running",
        "Grammar compiles running, those whose requests stopped waiting (timed out, aborted) included.",
    )
    REQUESTS_AWAITING_GRAMMAR = (
        "num_requests_awaiting_grammar",
        "Requests waiting for their grammar to compile (counted among the waiting requests too).",
    )


class EngineObservation(_Named):
    """Values observed since the previous ``EngineStats``: histogram samples in the API."""

    ENCODER_SECONDS = "encoder_seconds", "Vision-encoder time of one engine step."
    FORWARD_SECONDS = "forward_seconds", "Language-model time of one engine step (forward and sampling)."
    REQUESTS_PER_STEP = "num_requests_per_step", "Requests batched together in one engine step."
    BATCHED_TOKENS_PER_STEP = "num_batched_tokens_per_step", "Tokens computed in one engine step."
    EC_LOAD_SECONDS = "ec_load_seconds", "Time to load one encoder output from the store."
    GRAMMAR_COMPILE_SECONDS = (
        "structured_output_compile_seconds",
        "Time to compile one constraint into a grammar (off the step loop).",
    )
    REQUEST_QUEUE_SECONDS = (
        "request_queue_time_seconds",
        "Time a request waited in the engine, from its arrival to the first step that computes it.",
    )
    REQUEST_PREFILL_SECONDS = (
        "request_prefill_time_seconds",
        "Time from a request's first step to its first output token (its prompt's steps, encoder included).",
    )
