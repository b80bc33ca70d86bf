"""Helpers of the step-driven scheduler tests: a config, requests made of one repeated token, and each
step run on the scheduler's stand-in worker (tests/standin_worker.py), which keeps the worker's books
from the step's wire form and refuses a step the worker would refuse."""

from __future__ import annotations

from collections.abc import Sequence
from weakref import WeakKeyDictionary

from engine.encode_scheduler import EncodeOnlyScheduler
from engine.request import MMItem, Request
from engine.scheduler import Scheduler
from engine.step_plan import SchedulerConfig, StepPlan, StepResult
from engine.step_wire import to_scheduler_output
from tests.standin_worker import NextToken, StandinWorker
from wire.protocol import MMFeature, SamplingParams

Image = tuple[str, int, int]  # (mm_hash, offset, num_tokens)
PROMPT_TOKEN = 5  # every prompt token; the stand-in then samples 6, 7, 8, ...
PIXEL_BYTES = memoryview(bytes(4))  # an item's "pixel_values": 4 uint8


def config(**overrides: int | bool | str | None) -> SchedulerConfig:
    values: dict[str, int | bool | str | None] = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 2048,
        "max_model_len": 4096,
        "encoder_cache_tokens": 4096,
        "encoder_compute_budget_tokens": 2048,
        # a pool far larger than any test needs; prefix caching off, so that prompts made of one
        # repeated token do not share blocks (the KV tests turn both on explicitly)
        "num_kv_blocks": 4096,
        "block_size": 16,
        "enable_prefix_caching": False,
        "prefix_match": "token",
        "disable_chunked_mm_input": False,
        "max_waiting_requests": None,
        "async_scheduling": True,
        "scheduling_policy": "fcfs",
        "can_encode": True,
    }
    values.update(overrides)
    return SchedulerConfig(**values)  # type: ignore[arg-type]


def make_request(
    req_id: str, prompt_len: int, images: Sequence[Image] = (), max_tokens: int = 8, **sampling: object
) -> Request:
    return Request(
        req_id=req_id,
        client=b"api",
        prompt_token_ids=[PROMPT_TOKEN] * prompt_len,
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
        mm_features=[MMFeature(h, offset, n) for h, offset, n in images],
        mm_items={
            h: MMItem("image", n, {"pixel_values": ("uint8", (4,))}, {"pixel_values": PIXEL_BYTES})
            for h, _, n in images
        },
    )


AnyScheduler = Scheduler | EncodeOnlyScheduler
_workers: WeakKeyDictionary[AnyScheduler, StandinWorker] = WeakKeyDictionary()


def worker_for(s: AnyScheduler, next_token: NextToken | None = None) -> StandinWorker:
    """The stand-in worker that runs ``s``'s steps, made on first use to match ``s``: its KV pool,
    whether it can encode, its language model (none for an encoder-only scheduler) and its
    connector's store and role. ``next_token`` (the token rule) can only be given on first use."""
    worker = _workers.get(s)
    if worker is not None:
        assert next_token is None, "the scheduler's stand-in worker exists already"
        return worker
    connector = s.connector
    worker = StandinWorker(
        num_kv_blocks=s.config.num_kv_blocks,
        block_size=s.config.block_size,
        has_vision_tower=s.config.can_encode,
        has_language_model=not isinstance(s, EncodeOnlyScheduler),
        next_token=next_token,
        ec_store=connector.store if connector is not None else None,
        ec_role=connector.role if connector is not None else None,
    )
    _workers[s] = worker
    return worker


def run_step(s: AnyScheduler) -> tuple[StepPlan, StepResult]:
    """schedule() → the stand-in worker runs the step's wire form → postprocess()."""
    plan = s.schedule()
    sched, frames = to_scheduler_output(plan, s.kv_cache)
    return plan, s.postprocess(plan, worker_for(s).execute(sched, frames))


def encoded(plan: StepPlan) -> list[str]:
    return [mm_hash for mm_hash, _ in plan.encoder_items]


def new_ids(plan: StepPlan) -> list[str]:
    return [r.req_id for r in plan.new_requests]


def freeable(s: Scheduler) -> list[str]:
    """Zero-user entries, oldest first (the eviction order)."""
    return list(s.encoder_cache._freeable)


def users(s: Scheduler, mm_hash: str) -> set[str]:
    return set(s.encoder_cache._users[mm_hash])
