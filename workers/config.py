"""Settings of a worker process, built by the CLI from the user's flags and never mutated."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerConfig:
    model: str  # local folder of the HF checkpoint
    worker_addr: str  # the engine's address; the worker connects to it
    device: str = "auto"  # auto: cuda (bf16) when available, else cpu (fp32)
    log_level: str = "info"
    block_size: int = 16  # tokens per KV block
    kv_cache_tokens: int | None = None  # KV pool size; None: a memory fraction on CUDA, a default on CPU
    gpu_memory_utilization: float = 0.9  # on CUDA without kv_cache_tokens: share of GPU memory to use
    shutdown_timeout: float = 30.0  # SIGTERM: keep serving steps this long, or until WorkerShutdown
