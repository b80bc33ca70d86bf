"""Settings of the engine process, built by app/launch/process_configs.py from the user's settings and never
mutated. Every field that is a setting is required: the defaults live in ``app.settings.Settings``,
once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from wire.curve import CurveKeys
from wire.ec_store import ECConfig

SchedulingPolicy = Literal["fcfs", "priority"]  # the order requests are taken in (engine/request_queue.py)


@dataclass(frozen=True)
class SchedulerOptions:
    """The scheduler's knobs from the settings. ``SchedulerConfig.for_worker`` (engine/scheduler.py)
    completes them with the KV pool a worker announces, once per worker."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    encoder_cache_tokens: int
    encoder_compute_budget_tokens: int
    enable_prefix_caching: bool
    prefix_match: Literal["token", "block"]  # hits up to the first differing token, or whole blocks
    disable_chunked_mm_input: bool
    max_waiting_requests: int | None  # None: the queue is unbounded
    async_scheduling: bool  # the next step is scheduled and sent while the worker runs this one
    scheduling_policy: SchedulingPolicy


@dataclass(frozen=True)
class StructuredOutputOptions:
    """The grammar compiler's knobs (engine/structured/compiler.py)."""

    model_dir: str  # the tokenizer whose vocabulary grammars are compiled over (loaded on first use)
    cache_bytes: int  # compiled grammars kept, by their size
    compile_timeout_s: float  # a request waits this long for its grammar, then gets a 400


@dataclass(frozen=True)
class EngineConfig:
    engine_addr: str  # the engine binds it; API processes connect (DEALER -> ROUTER)
    worker_addr: str  # the engine binds it; the worker connects
    scheduler: SchedulerOptions
    shutdown_timeout: float  # SIGTERM: held requests get this long to finish
    log_level: str
    ec: ECConfig | None  # the encoder-cache connector (None: none)
    step_timeout_s: float  # a step unanswered this long fails its requests (500)
    curve: CurveKeys | None  # CURVE on tcp:// binds (wire/curve.py); None: no keys
    structured_outputs: StructuredOutputOptions
