"""Each process's config, built from the one ``Settings`` (app/settings.py) at its entry point.

``Settings`` holds every default, once: the engine's and the worker's configs have only required
fields, filled here. The API processes take ``Settings`` itself (``create_app``), as their parts read
many of its fields; the proxy's shared flags default to the same fields (app/proxy/cli.py).

    Settings ──engine_config──▶ EngineConfig (+ SchedulerOptions; the worker's WorkerReady completes
       │                                      them into the SchedulerConfig, engine/scheduler.py)
       ├──────worker_config──▶ WorkerConfig
       └──────(itself)───────▶ the API (app/api/server.py)
"""

from __future__ import annotations

from app.inputs.encoder_budgets import derive_encoder_budgets
from app.settings import GIB, MIB, Settings
from engine.config import EngineConfig, SchedulerOptions, StructuredOutputOptions
from wire.ec_store import ECConfig, ECRole
from workers.config import ModelParts, WorkerConfig


def engine_config(settings: Settings) -> EngineConfig:
    """Reads the model folder's JSON for what the settings leave to the model (length limit, encoder
    budgets)."""
    cache_tokens, compute_tokens = settings.encoder_cache_tokens, settings.encoder_compute_budget_tokens
    if cache_tokens is None or compute_tokens is None:  # derived from the model's largest item
        budgets = derive_encoder_budgets(settings)
        cache_tokens, compute_tokens = budgets.encoder_cache_tokens, budgets.encoder_compute_budget_tokens
    scheduler = SchedulerOptions(
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.resolved_max_model_len(),
        encoder_cache_tokens=cache_tokens,
        encoder_compute_budget_tokens=compute_tokens,
        enable_prefix_caching=settings.enable_prefix_caching,
        prefix_match=settings.prefix_match,
        disable_chunked_mm_input=settings.disable_chunked_mm_input,
        max_waiting_requests=settings.max_waiting_requests,
        async_scheduling=settings.async_scheduling,
        scheduling_policy=settings.scheduling_policy,
    )
    return EngineConfig(
        engine_addr=settings.engine_addr,
        worker_addr=settings.worker_addr,
        scheduler=scheduler,
        shutdown_timeout=settings.shutdown_timeout,
        log_level=settings.log_level,
        ec=ec_config(settings),
        step_timeout_s=settings.step_timeout_s,
        curve=settings.curve_keys(),
        structured_outputs=StructuredOutputOptions(
            model_dir=settings.model,
            cache_bytes=int(settings.structured_output_cache_mb * MIB),
            compile_timeout_s=settings.structured_output_compile_timeout_s,
        ),
    )


def worker_config(settings: Settings) -> WorkerConfig:
    if settings.encoder_only:
        parts = ModelParts.ENCODER
    elif settings.language_model_only:
        parts = ModelParts.LANGUAGE_MODEL
    else:
        parts = ModelParts.ALL
    return WorkerConfig(
        model=settings.model,
        worker_addr=settings.worker_addr,
        device=settings.device,
        log_level=settings.log_level,
        block_size=settings.block_size,
        kv_cache_tokens=settings.kv_cache_tokens,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        attention_backend=settings.attention_backend,
        enforce_eager=settings.enforce_eager,
        step_overlap=settings.worker_step_overlap,
        threads=settings.worker_threads,
        shutdown_timeout=settings.shutdown_timeout,
        parts=parts,
        ec=ec_config(settings),
        curve=settings.curve_keys(),
    )


def ec_config(settings: Settings) -> ECConfig | None:
    """The connector's settings, the same for the engine and the worker (None: no connector)."""
    if settings.ec_connector is None:
        return None
    return ECConfig(
        connector=settings.ec_connector,
        role=ECRole(settings.ec_role),
        storage_path=settings.ec_storage_path or "",
        storage_max_bytes=int(settings.ec_storage_max_gb * GIB),
        mooncake_master=settings.ec_mooncake_master,
        mooncake_metadata_server=settings.ec_mooncake_metadata_server,
        mooncake_local_hostname=settings.ec_mooncake_local_hostname,
    )
