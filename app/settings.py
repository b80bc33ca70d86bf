"""The one settings object of every mmserve process.

Built once at a process's entry point (CLI flags over ``MMSERVE_*`` environment variables over
defaults) and passed down; never mutated after start. Each role reads the fields it needs.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

GIB = 1 << 30


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MMSERVE_", frozen=True, extra="forbid")

    model: str = Field("models/tiny-llava", description="Local folder of a HF checkpoint with its processor.")
    served_model_name: str | None = Field(
        None, description="Name clients use in 'model' (default: the model folder's name)."
    )
    host: str = Field("127.0.0.1", description="HTTP host of the API process.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port of the API process.")
    engine_addr: str = Field(
        "ipc:///tmp/mmserve-engine.sock",
        description="ZeroMQ address API<->engine (engine binds, APIs connect); ipc:// or tcp://host:port.",
    )
    worker_addr: str = Field(
        "ipc:///tmp/mmserve-worker.sock",
        description="ZeroMQ address engine<->worker (engine binds, the worker connects).",
    )
    max_num_seqs: int = Field(64, ge=1, description="Most requests running in one engine step.")
    max_num_batched_tokens: int = Field(
        2048, ge=16, description="Token budget of one engine step (prefill chunks + decode tokens)."
    )
    max_model_len: int | None = Field(
        None, ge=16, description="Longest prompt + output in tokens (default: the model's own limit)."
    )
    mm_processor_cache_gb: float = Field(
        4.0, ge=0, description="API processor cache size in GiB (processed items); 0 disables it."
    )
    mm_ipc_cache_gb: float = Field(
        4.0,
        ge=0,
        description="IPC cache size in GiB (API key mirror = engine receiver cache); 0 disables it.",
    )
    encoder_cache_tokens: int = Field(
        8192, ge=0, description="Encoder cache space in embeddings (tokens), shared across requests."
    )
    encoder_compute_budget_tokens: int | None = Field(
        None,
        ge=0,
        description="Embeddings the encoder may produce in one step (default: max-num-batched-tokens).",
    )
    device: str = Field(
        "auto", description="Worker device: auto (cuda if available, else cpu), cpu, cuda, cuda:N."
    )
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV-cache block.")
    kv_cache_tokens: int | None = Field(
        None,
        ge=1,
        description="KV pool size in tokens, allocated at worker start (default: a share of GPU memory "
        "on CUDA, 65536 on CPU).",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="On CUDA without --kv-cache-tokens: share of GPU memory for weights + KV.",
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV of prompt blocks seen before (images count by mm_hash and position)."
    )
    disable_chunked_mm_input: bool = Field(
        False,
        description="Never split an image across prefill chunks: a chunk stops before an image it cannot "
        "cover whole.",
    )
    fetch_timeout_s: float = Field(10.0, gt=0, description="Timeout for fetching an http(s) image URL.")
    max_image_bytes: int = Field(
        20 * 1024 * 1024, gt=0, description="Largest image (encoded bytes) accepted."
    )
    log_level: str = Field("info", description="Log level of every process.")

    @field_validator("engine_addr", "worker_addr")
    @classmethod
    def _check_zmq_addr(cls, addr: str) -> str:
        if not addr.startswith(("ipc://", "tcp://", "inproc://")):
            raise ValueError(f"ZeroMQ address must start with ipc://, tcp:// or inproc://: {addr!r}")
        return addr

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    @property
    def processor_cache_bytes(self) -> int:
        return int(self.mm_processor_cache_gb * GIB)

    @property
    def ipc_cache_bytes(self) -> int:
        return int(self.mm_ipc_cache_gb * GIB)

    @property
    def encoder_budget_tokens(self) -> int:
        if self.encoder_compute_budget_tokens is None:
            return self.max_num_batched_tokens
        return self.encoder_compute_budget_tokens

    def max_mm_tokens_per_item(self) -> int | None:
        """Placeholder tokens of the largest image the checkpoint's vision tower produces (LLaVA: one
        token per patch), or None when the folder has no vision config."""
        path = Path(self.model) / "config.json"
        if not path.is_file():
            return None
        vision = json.loads(path.read_text()).get("vision_config")
        if not vision:
            return None
        return int((vision.get("image_size", 336) // vision.get("patch_size", 14)) ** 2)

    def startup_error(self) -> str | None:
        """Settings that cannot work together, found before any process starts. (An image larger than
        an encoder budget is not one of them: such requests get a 400 at admission, text still works.)"""
        item_tokens = self.max_mm_tokens_per_item()
        if item_tokens is None:
            return None
        if self.disable_chunked_mm_input and item_tokens > self.max_num_batched_tokens:
            return (
                f"--disable-chunked-mm-input needs --max-num-batched-tokens of at least {item_tokens} "
                f"(the tokens of one image of this model); it is {self.max_num_batched_tokens}"
            )
        return None

    def resolved_max_model_len(self) -> int:
        """The configured limit, else the LM's ``max_position_embeddings`` from the checkpoint."""
        if self.max_model_len is not None:
            return self.max_model_len
        config = json.loads((Path(self.model) / "config.json").read_text())
        text_config = config.get("text_config", config)
        return int(text_config.get("max_position_embeddings", 4096))
