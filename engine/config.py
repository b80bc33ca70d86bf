"""Settings of the engine process, built by the CLI from the user's flags and never mutated."""

from __future__ import annotations

from dataclasses import dataclass

from engine.ec_store import ECConfig


@dataclass(frozen=True)
class EngineConfig:
    engine_addr: str  # the engine binds it; API processes connect (DEALER -> ROUTER)
    worker_addr: str  # the engine binds it; the worker connects
    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    encoder_cache_tokens: int = 8192
    encoder_compute_budget_tokens: int = 2048
    enable_prefix_caching: bool = True
    disable_chunked_mm_input: bool = False
    max_waiting_requests: int | None = None
    step_timeout_s: float = 600.0  # a step unanswered this long fails its requests (500)
    shutdown_timeout: float = 30.0  # SIGTERM: held requests get this long to finish
    log_level: str = "info"
    ec: ECConfig | None = None  # the encoder-cache connector (None: none)
