"""The one settings object of every mmserve process.

Built once at a process's entry point (CLI flags over ``MMSERVE_*`` environment variables over
defaults) and passed down; never mutated after start. It holds every default, once: the API reads it
directly, the engine and the worker get configs built from it (app/launch/process_configs.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app import setting_values
from wire.curve import CurveKeys, load_keys
from wire.shm_ring import HEADER_BYTES  # a ring chunk's header
from workers.config import CPU_DEFAULT_KV_CACHE_TOKENS
from workers.families import STRUCTURAL_TAG_FORMATS, check_tool_call_parser

GIB = 1 << 30
MIB = 1 << 20
DEFAULT_ENCODER_CACHE_TOKENS = 8192
DEFAULT_MM_PER_PROMPT = 999  # vLLM's default per modality
# a video is tens of frames through the vision encoder: a few per prompt unless asked for more
DEFAULT_VIDEOS_PER_PROMPT = 4
DEFAULT_MM_LIMITS = {"image": DEFAULT_MM_PER_PROMPT, "video": DEFAULT_VIDEOS_PER_PROMPT}


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
    mm_processor_cache_type: Literal["lru", "shm"] = Field(
        "lru",
        description="lru: processor cache in the API + IPC mirror/receiver cache; shm: one shared-memory "
        "ring of --mm-processor-cache-gb per API process that the API writes once and the worker reads in "
        "place.",
    )
    mm_shm_cache_max_object_size_mb: float = Field(
        128.0,
        gt=0,
        description="With shm: largest processed item put in the ring, in MiB; larger items take the "
        "normal path (payload through the engine).",
    )
    api_server_count: int = Field(
        1, ge=1, le=64, description="API processes `serve` runs on one port (SO_REUSEPORT)."
    )
    mm_preprocess_processes: int | None = Field(
        None,
        ge=0,
        le=256,
        description="Processes per API process that decode + run the HF processor for cache misses; 0 runs "
        "them in the API process's threads (default: the core count / api-server-count, at most 4).",
    )
    encoder_cache_tokens: int | None = Field(
        None,
        ge=0,
        description="Encoder cache space in embeddings (tokens), shared across requests; 0 disables "
        f"caching (default: the larger of {DEFAULT_ENCODER_CACHE_TOKENS} and the model's largest item).",
    )
    encoder_compute_budget_tokens: int | None = Field(
        None,
        ge=0,
        description="Embeddings the encoder may produce in one step (default: the larger of "
        "max-num-batched-tokens and the model's largest item).",
    )
    # NoDecode: MMSERVE_LIMIT_MM_PER_PROMPT reaches the validator as text, so "image=4" works there too
    generation_config: Literal["auto", "vllm"] = Field(
        "auto",
        description="Where a request's sampling defaults come from: auto takes the model folder's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) "
        "as vLLM does; vllm ignores it (temperature 1, no top-k/top-p/min-p, no penalty).",
    )
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template file (or, as vLLM accepts, the template itself when it holds "
        "a {, } or newline) that replaces the model's for every request; where it renders tools it is "
        "also the tool template, else the model has none. Read at start-up (default: the model's own).",
    )
    tool_call_parser: str | None = Field(
        None,
        description=f"The syntax of the model's tool calls ({', '.join(sorted(STRUCTURAL_TAG_FORMATS))}), "
        "over its family's default (hermes for Qwen2.5-VL and Qwen3-VL; none for LLaVA and Qwen2-VL, which "
        "also need a --chat-template with tools).",
    )
    limit_mm_per_prompt: Annotated[dict[str, int], NoDecode] = Field(
        DEFAULT_MM_LIMITS,
        description="Most items per prompt by modality, as image=N,video=M or a JSON object; a modality "
        f"left out keeps its default (image={DEFAULT_MM_PER_PROMPT}, as vLLM; "
        f"video={DEFAULT_VIDEOS_PER_PROMPT}).",
    )
    device: str = Field(
        "auto", description="Worker device: auto (cuda if available, else cpu), cpu, cuda, cuda:N."
    )
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV-cache block.")
    kv_cache_tokens: int | None = Field(
        None,
        ge=1,
        description="KV pool size in tokens, allocated at worker start (default: a share of GPU memory "
        f"on CUDA, {CPU_DEFAULT_KV_CACHE_TOKENS} on CPU).",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="On CUDA without --kv-cache-tokens: share of GPU memory for weights + KV.",
    )
    worker_threads: int | None = Field(
        None,
        ge=1,
        description="Threads of the worker's PyTorch CPU ops (default: the cores this process may use, "
        "less one for the API and engine processes; at least 1).",
    )
    attention_backend: Literal["batched", "per-request"] = Field(
        "batched",
        description="Worker attention over the paged KV pool: batched (the step's decodes as one padded "
        "batch, its prefill chunks as another, on a CPU in batches of like sizes) or per-request (one call "
        "per request; the reference).",
    )
    worker_step_overlap: Literal["auto", "on", "off"] = Field(
        "auto",
        description="The worker launches a step's forward while the device still runs the step before "
        "(the tokens that step samples are read on the device) and answers that step meanwhile: auto, on "
        "CUDA; on, also on the CPU, where nothing runs asynchronously and each answer only comes a step "
        "later (for tests); off, each step answered before the next starts. The answers are the same.",
    )
    enforce_eager: bool = Field(
        False,
        description="On CUDA, run decode steps eagerly instead of replaying them as CUDA graphs (vLLM's "
        "flag; the answers are the same either way).",
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV of prompt blocks seen before (images count by mm_hash and position)."
    )
    prefix_match: Literal["token", "block"] = Field(
        "token",
        description="How far a prefix-cache hit reaches: token, up to the first token that differs (the "
        "first tokens of a cached block are copied into the request's own block); block, whole blocks "
        "only (vLLM's).",
    )
    async_scheduling: bool = Field(
        True,
        description="Schedule and send the next step while the worker runs the current one, from what is "
        "known (vLLM's flag): the worker waits for neither the scheduler nor the pipe between steps. "
        "A request's answers are the same either way; one that stops on EOS costs one step more. On a "
        "CPU whose every core is busy it can cost throughput (docs/benchmarks.md, 'Scheduling ahead').",
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="The order requests are taken in (vLLM's flag): fcfs, by arrival; priority, by their "
        "priority field (lower first) then arrival, the latest of the lowest preempted first (fcfs: 0 only).",
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
    max_request_image_bytes: int = Field(
        64 * 1024 * 1024,
        gt=0,
        description="Most encoded image bytes in one request, all images together.",
    )
    max_video_bytes: int = Field(
        256 * 1024 * 1024, gt=0, description="Largest video (encoded bytes) accepted."
    )
    max_video_frames: int = Field(
        64,
        ge=1,
        le=4096,
        description="Most frames a video may give after its sampling (fps or num_frames); more is a 400.",
    )
    max_video_pixels: int = Field(
        1 << 28,
        ge=1,
        description="Most decoded pixels of one video: its sampled frames x width x height (about 3 bytes "
        "each, and a few copies while it is processed); more is a 400 before a frame is decoded.",
    )
    video_decode_timeout_s: float = Field(
        30.0, gt=0, description="Longest one video's decode may take (checks, seeking, frames)."
    )
    max_media_redirects: int = Field(5, ge=0, le=20, description="Most redirects followed per media URL.")
    allow_private_media_urls: bool = Field(
        False,
        description="Fetch image URLs that resolve to loopback, private, link-local or other non-public "
        "addresses (development only; refused by default).",
    )
    allowed_media_domains: list[str] | None = Field(
        None,
        description="Only fetch image URLs whose host is one of these domains or their subdomains, "
        "comma-separated (default: any public host).",
    )
    allowed_local_media_path: str | None = Field(
        None,
        description="Accept file:// image URLs for files under this folder, never outside it "
        "(default: file:// refused).",
    )
    shutdown_timeout: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM: seconds in-flight requests get to finish while new ones get 503.",
    )
    step_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A step the worker does not answer within this many seconds fails its requests (500).",
    )
    structured_output_cache_mb: float = Field(
        256.0,
        ge=0,
        description="Compiled grammars of structured outputs the engine keeps for requests that repeat "
        "a constraint, in MiB; 0 compiles every request's anew.",
    )
    response_format_whitespace: Literal["compact", "any"] = Field(
        "compact",
        description="Whitespace in JSON answers to OpenAI's response_format (json_schema, json_object, "
        "and the Responses API's text.format): compact writes only the separators ', ' and ': ', as "
        "OpenAI's answers read; any allows up to 16 whitespace characters between elements, as vLLM's "
        "default. A request's structured_outputs.disable_any_whitespace overrides it.",
    )
    structured_output_compile_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A request waits this long for its grammar to compile, then gets a 400 (the server "
        "serves on meanwhile).",
    )
    max_waiting_requests: int | None = Field(
        1024,
        ge=1,
        description="Most requests waiting in the engine's queue; one more gets 429 with Retry-After "
        "(requests already accepted are never dropped). An n > 1 request counts once: its later choices "
        "follow its first past the cap.",
    )
    # NoDecode: MMSERVE_API_KEY reaches the validator as text ("k1,k2"), as the repeated flag's list does
    api_key: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Require 'Authorization: Bearer <key>' on /v1/*, /tokenize, /detokenize and "
        "/reset_mm_cache; repeat the flag (or give MMSERVE_API_KEY as k1,k2) for several keys, each a "
        "tenant with its own media ids (default: no auth).",
    )
    mm_uuid_cache_entries: int = Field(
        65536,
        ge=0,
        description="Media-id bindings (uuid -> media) kept, least recently used first out; shared by "
        "the API processes of one server; 0 turns media ids off.",
    )
    mm_uuid_store: str | None = Field(
        None,
        description="A SQLite file holding the media-id bindings, shared by every API process that names "
        "it (serve --api-server-count N > 1 sets one in its temporary folder); unset: each API process "
        "keeps its own in memory.",
    )
    responses_store_entries: int = Field(
        4096,
        ge=0,
        description="Stored responses kept for previous_response_id and GET /v1/responses/{id}, least "
        "recently used first out; 0 stores none (answers say store false).",
    )
    responses_store_mb: int = Field(
        256,
        ge=0,
        description="Most megabytes the stored responses hold, their conversations and images included "
        "(each image once however many conversations hold it).",
    )
    responses_store: str | None = Field(
        None,
        description="A SQLite file holding the stored responses, shared by every API process that names "
        "it (serve --api-server-count N > 1 sets one in its temporary folder); a file named here outlives "
        "the server. Unset: each API process keeps its own in memory.",
    )
    tenant_cache_isolation: bool = Field(
        False,
        description="Make each API key's own cache salt the default, so tenants share no cache hit of "
        "any kind (a request's cache_salt then divides its tenant's caches further).",
    )
    curve_key_file: str | None = Field(
        None,
        description="The deployment's ZeroMQ CURVE secret certificate (`mmserve curve-keygen --out FILE` "
        "writes one), the same for every role: encrypts and authenticates every tcp:// socket between "
        "roles; required when --engine-addr or --worker-addr is reachable from other hosts.",
    )
    curve_secret_key: SecretStr | None = Field(
        None,
        description="The same key as its Z85 secret key (40 characters), from the environment only "
        "(a docker-compose secret); --curve-key-file wins when both are given.",
        json_schema_extra={"env_only": True},
    )
    max_request_body_mb: float = Field(
        64.0, gt=0, description="Largest request body in MiB; a larger one gets 413 before it is read."
    )
    ec_connector: Literal["shared-storage", "mooncake"] | None = Field(
        None,
        description="Encoder-cache connector: share encoder outputs by mm_hash with other instances through "
        "a folder (shared-storage) or a Mooncake store (mooncake); none when unset.",
    )
    ec_role: Literal["producer", "consumer", "both"] = Field(
        "both",
        description="With --ec-connector: producer saves every encoder output, consumer loads what the store "
        "holds instead of encoding, both does both.",
    )
    ec_storage_path: str | None = Field(None, description="shared-storage: the folder every instance shares.")
    ec_storage_max_gb: float = Field(
        16.0,
        ge=0,
        description="shared-storage: bound on the folder's outputs in GiB, oldest removed first (0: none).",
    )
    ec_mooncake_master: str = Field(
        "127.0.0.1:50051", description="mooncake: the mooncake_master's RPC address (host:port)."
    )
    ec_mooncake_metadata_server: str = Field(
        "P2PHANDSHAKE", description="mooncake: the transfer engine's metadata server (P2PHANDSHAKE or a URL)."
    )
    ec_mooncake_local_hostname: str = Field(
        "127.0.0.1", description="mooncake: the address this instance's store client is reached at."
    )
    encoder_only: bool = Field(
        False,
        description="Load only the vision tower and projector; encode each request's images, save them "
        "through --ec-connector and answer without generating (the encoder of an encoder / LM split).",
    )
    language_model_only: bool = Field(
        False,
        description="Load only the language model; every encoder output comes from --ec-connector's store "
        "(503 when it is not there).",
    )
    log_level: str = Field("info", description="Log level of every process.")

    @field_validator("engine_addr", "worker_addr")
    @classmethod
    def _check_zmq_addr(cls, addr: str) -> str:
        if not addr.startswith(("ipc://", "tcp://", "inproc://")):
            raise ValueError(f"ZeroMQ address must start with ipc://, tcp:// or inproc://: {addr!r}")
        return addr

    @field_validator("chat_template")
    @classmethod
    def _check_chat_template(cls, value: str | None) -> str | None:
        """Read and parsed here, so a template that cannot serve stops the start, not a request."""
        if value is not None:
            from workers.families.chat_template import load_chat_template  # jinja2: only where one is given

            load_chat_template(value)
        return value

    @field_validator("tool_call_parser")
    @classmethod
    def _check_tool_call_parser(cls, name: str | None) -> str | None:
        return check_tool_call_parser(name) if name is not None else None

    @field_validator("allowed_media_domains", mode="before")
    @classmethod
    def _parse_domains(cls, value: Any) -> Any:
        return setting_values.media_domains(value)

    @field_validator("api_key", mode="before")
    @classmethod
    def _parse_api_keys(cls, value: Any) -> Any:
        return setting_values.api_keys(value)

    @field_validator("limit_mm_per_prompt", mode="before")
    @classmethod
    def _parse_limits(cls, value: Any) -> Any:
        return setting_values.mm_limits(value)

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _check_limits(cls, limits: dict[str, int]) -> dict[str, int]:
        return setting_values.complete_mm_limits(limits, DEFAULT_MM_LIMITS)

    @model_validator(mode="after")
    def _check_shm(self) -> Settings:
        """The shm object store replaces the processor cache and the IPC cache: it needs the ring's
        memory and the cross-process cache on, and a ring that holds at least one largest item."""
        if self.mm_processor_cache_type != "shm":
            return self
        if self.mm_ipc_cache_gb == 0:
            raise ValueError(
                "--mm-processor-cache-type shm keeps processed items across processes, which "
                "--mm-ipc-cache-gb 0 turns off: use --mm-processor-cache-type lru, or a non-zero IPC cache"
            )
        ring_mib = self.processor_cache_bytes / MIB
        if self.processor_cache_bytes < self.shm_max_object_bytes + HEADER_BYTES:
            raise ValueError(
                f"the shm ring (--mm-processor-cache-gb {self.mm_processor_cache_gb:g} = {ring_mib:.1f} MiB) "
                "is too small for one item of --mm-shm-cache-max-object-size-mb "
                f"{self.mm_shm_cache_max_object_size_mb:g}: raise the first or lower the second"
            )
        return self

    @model_validator(mode="after")
    def _check_ec(self) -> Settings:
        """An encoder / LM split needs a connector, in the role its half plays."""
        if self.encoder_only and self.scheduling_policy == "priority":
            raise ValueError("--encoder-only takes requests as they come: leave out --scheduling-policy")
        if self.encoder_only and self.language_model_only:
            raise ValueError("--encoder-only and --language-model-only exclude each other")
        if self.ec_connector is None:
            if self.encoder_only or self.language_model_only:
                flag = "--encoder-only" if self.encoder_only else "--language-model-only"
                raise ValueError(f"{flag} needs --ec-connector (encoder outputs travel through its store)")
            return self
        if self.encoder_only and self.ec_role == "consumer":
            raise ValueError("--encoder-only saves what it encodes: use --ec-role producer (or both)")
        if self.language_model_only and self.ec_role == "producer":
            raise ValueError("--language-model-only loads encoder outputs: use --ec-role consumer (or both)")
        if self.ec_connector == "shared-storage" and not self.ec_storage_path:
            raise ValueError("--ec-connector shared-storage needs --ec-storage-path (a folder)")
        return self

    def chat_template_text(self) -> str | None:
        """``--chat-template``'s template (None: the model's own), read from its file again."""
        if self.chat_template is None:
            return None
        from workers.families.chat_template import load_chat_template

        return load_chat_template(self.chat_template)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    @property
    def processor_cache_bytes(self) -> int:
        return int(self.mm_processor_cache_gb * GIB)

    @property
    def shm_max_object_bytes(self) -> int:
        return int(self.mm_shm_cache_max_object_size_mb * MIB)

    def resolved_preprocess_processes(self) -> int:
        if self.mm_preprocess_processes is not None:
            return self.mm_preprocess_processes
        return max(1, min(4, (os.cpu_count() or 1) // self.api_server_count))

    @property
    def max_request_body_bytes(self) -> int:
        return int(self.max_request_body_mb * (1 << 20))

    @property
    def ipc_cache_bytes(self) -> int:
        return int(self.mm_ipc_cache_gb * GIB)

    def curve_keys(self) -> CurveKeys | None:
        """The CURVE key pair (None: none given); ``ValueError`` for a key given but unusable."""
        secret = self.curve_secret_key.get_secret_value() if self.curve_secret_key else None
        return load_keys(self.curve_key_file, secret)

    def resolved_max_model_len(self) -> int:
        """The configured limit, else the LM's ``max_position_embeddings`` from the checkpoint."""
        if self.max_model_len is not None:
            return self.max_model_len
        config = json.loads((Path(self.model) / "config.json").read_text())
        text_config = config.get("text_config", config)
        if "max_position_embeddings" not in text_config:
            raise ValueError(
                f"{self.model}/config.json gives no max_position_embeddings: set --max-model-len"
            )
        return int(text_config["max_position_embeddings"])


def setting_default(name: str) -> Any:
    """The default of setting ``name``, for a process that takes no ``Settings`` (the proxy)."""
    return Settings.model_fields[name].default
