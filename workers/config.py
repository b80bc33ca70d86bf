"""Settings of a worker process, built by app/launch/process_configs.py from the user's settings and never
mutated. Every field is required: the defaults live in ``app.settings.Settings``, once."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from wire.curve import CurveKeys
from wire.ec_store import ECConfig

CPU_DEFAULT_KV_CACHE_TOKENS = 65536  # the KV pool on CPU without --kv-cache-tokens


class ModelParts(enum.Enum):
    """Which halves of the checkpoint a worker loads: both, the vision tower + projector only
    (``--encoder-only``), or the language model only (``--language-model-only``)."""

    ALL = "all"
    ENCODER = "encoder"
    LANGUAGE_MODEL = "language_model"

    @property
    def has_vision_tower(self) -> bool:
        return self is not ModelParts.LANGUAGE_MODEL

    @property
    def has_language_model(self) -> bool:
        return self is not ModelParts.ENCODER


@dataclass(frozen=True)
class WorkerConfig:
    model: str  # local folder of the HF checkpoint
    worker_addr: str  # the engine's address; the worker connects to it
    device: str  # auto: cuda (bf16) when available, else cpu (fp32)
    log_level: str
    block_size: int  # tokens per KV block
    kv_cache_tokens: int | None  # KV pool size; None: a memory fraction on CUDA, a default on CPU
    gpu_memory_utilization: float  # on CUDA without kv_cache_tokens: share of GPU memory to use
    attention_backend: str  # workers.attention.ATTENTION_BACKENDS
    enforce_eager: bool  # no CUDA graphs for decode steps (workers/decode_graphs.py)
    step_overlap: str  # auto (on CUDA), on, off: the next step launched before this one is answered
    threads: int | None  # PyTorch's CPU threads; None: the usable cores less one (at least 1)
    shutdown_timeout: float  # SIGTERM: keep serving steps this long, or until WorkerShutdown
    parts: ModelParts  # --encoder-only / --language-model-only
    ec: ECConfig | None  # the encoder-cache connector (None: none)
    curve: CurveKeys | None  # CURVE to a tcp:// engine (wire/curve.py); None: no keys
