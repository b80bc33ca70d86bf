"""Helpers of the EngineCore tests: a core on the stand-in worker (tests/standin_worker.py), configured
from its ``WorkerReady`` as the engine does, requests with one image, and stepping until idle."""

from __future__ import annotations

from collections.abc import Sequence

from engine.core import EngineCore
from engine.ec_connector import ECConnectorScheduler
from engine.step_plan import SchedulerConfig
from tests.standin_worker import StandinWorker
from wire.protocol import AddRequest, MMFeature, RequestOutput, SamplingParams, TensorRef, WorkerReady

PIXELS = {"pixel_values": TensorRef("float32", (1, 3, 4, 4), 1)}
NUM_PIXEL_BYTES = 1 * 3 * 4 * 4 * 4  # 192


def scheduler_config(ready: WorkerReady, **overrides: int | bool | str | None) -> SchedulerConfig:
    """Small test budgets plus what the worker announced (its KV pool, whether it can encode), as the
    engine builds it for each worker."""
    values: dict[str, int | bool | str | None] = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "max_model_len": 512,
        "encoder_cache_tokens": 1024,
        "encoder_compute_budget_tokens": 512,
        "enable_prefix_caching": False,
        "prefix_match": "token",
        "disable_chunked_mm_input": False,
        "max_waiting_requests": None,
        "async_scheduling": True,
        "scheduling_policy": "fcfs",
        "num_kv_blocks": ready.num_kv_blocks,
        "block_size": ready.block_size,
        "can_encode": ready.has_vision_tower,
    }
    values.update(overrides)
    return SchedulerConfig(**values)  # type: ignore[arg-type]


def engine_core(
    worker: StandinWorker | None = None,
    connector: ECConnectorScheduler | None = None,
    **overrides: int | bool | None,
) -> tuple[EngineCore, StandinWorker]:
    """A core running its steps on ``worker`` (a default stand-in if None); encode-only when the
    worker has no language model."""
    worker = worker if worker is not None else StandinWorker()
    config = scheduler_config(worker.ready, **overrides)
    core = EngineCore(config, worker, connector, encode_only=not worker.ready.has_language_model)
    return core, worker


def frames() -> list[memoryview]:
    """The frames of an AddRequest with one image: the message, then the pixel bytes (frame 1)."""
    return [memoryview(b"msg"), memoryview(bytes(NUM_PIXEL_BYTES))]


def key_only_frames() -> list[memoryview]:
    return [memoryview(b"msg")]


def add(
    req_id: str,
    mm_hash: str | None = None,
    *,
    with_tensors: bool = True,
    store: bool = True,
    prompt_len: int = 20,
    max_tokens: int = 2,
    num_image_tokens: int = 16,
    evicted: Sequence[str] = (),
    num_top_logprobs: int | None = None,
) -> AddRequest:
    """A prompt ``0, 1, ..., prompt_len - 1`` (the stand-in then samples prompt_len, prompt_len + 1,
    ...), with image ``mm_hash`` at offset 2 if given."""
    features = []
    if mm_hash is not None:
        features.append(
            MMFeature(
                mm_hash,
                offset=2,
                num_tokens=num_image_tokens,
                tensors=PIXELS if with_tensors else None,
                store=store and with_tensors,
            )
        )
    return AddRequest(
        req_id=req_id,
        prompt_token_ids=list(range(prompt_len)),
        sampling=SamplingParams(max_tokens=max_tokens, num_top_logprobs=num_top_logprobs),
        mm_features=features,
        evicted_mm_hashes=list(evicted),
    )


def run_until_idle(
    core: EngineCore, max_steps: int = 100, *, ahead: bool = False
) -> dict[bytes, list[RequestOutput]]:
    """Steps until no request is left; all outputs per client, in step order. ``ahead``: turns of the
    engine loop with ``--async-scheduling`` (``EngineCore.advance``: the next step is sent before the
    one in flight is answered), else one step at a time."""
    outputs: dict[bytes, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not core.has_work and not core.in_flight:
            return outputs
        for client, outs in (core.advance(ahead=True) if ahead else core.step()).items():
            outputs.setdefault(client, []).extend(outs)
    raise AssertionError("engine did not drain")
