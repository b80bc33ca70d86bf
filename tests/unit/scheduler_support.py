"""Helpers of the step-driven scheduler tests: a config, requests made of one repeated token, and a
stand-in worker answer for each step."""

from __future__ import annotations

from collections.abc import Sequence

from engine.protocol import MMFeature, RunnerOutput, SamplingParams
from engine.request import MMItem, Request
from engine.scheduler import Scheduler, SchedulerConfig, StepPlan, StepResult

Image = tuple[str, int, int]  # (mm_hash, offset, num_tokens)

DEFAULT_TOKEN = 7


def config(**overrides: int | bool | None) -> SchedulerConfig:
    values = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 2048,
        "max_model_len": 4096,
        "encoder_cache_tokens": 4096,
        "encoder_compute_budget_tokens": 2048,
        # a pool far larger than any test needs; prefix caching off, so that prompts made of one
        # repeated token do not share blocks (the KV tests turn both on explicitly)
        "num_kv_blocks": 4096,
        "enable_prefix_caching": False,
    }
    values.update(overrides)
    return SchedulerConfig(**values)


def make_request(
    req_id: str, prompt_len: int, images: Sequence[Image] = (), max_tokens: int = 8, **sampling: object
) -> Request:
    return Request(
        req_id=req_id,
        client=b"api",
        prompt_token_ids=[5] * prompt_len,
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
        mm_features=[MMFeature(h, offset, n) for h, offset, n in images],
        mm_items={h: MMItem("image", n, dtypes_shapes={}, buffers={}) for h, _, n in images},
        arrival_time=0.0,
    )


def runner_output(s: Scheduler, plan: StepPlan, tokens: dict[str, int] | None = None) -> RunnerOutput:
    """What the worker answers: a token for every request whose prompt is fully computed after the step."""
    req_ids = []
    for req_id, num_tokens in plan.num_scheduled_tokens.items():
        request = s.requests.get(req_id)
        if request is not None and request.num_computed_tokens + num_tokens >= request.num_prompt_tokens:
            req_ids.append(req_id)
    token_ids = [(tokens or {}).get(req_id, DEFAULT_TOKEN) for req_id in req_ids]
    return RunnerOutput(
        step_id=plan.step_id,
        req_ids=req_ids,
        sampled_token_ids=token_ids,
        logprobs=[None] * len(req_ids),
        num_encoded_items=len(plan.encoder_items),
        encoder_seconds=0.0,
        forward_seconds=0.0,
    )


def run_step(s: Scheduler, tokens: dict[str, int] | None = None) -> tuple[StepPlan, StepResult]:
    plan = s.schedule()
    return plan, s.postprocess(plan, runner_output(s, plan, tokens))


def encoded(plan: StepPlan) -> list[str]:
    return [mm_hash for mm_hash, _ in plan.encoder_items]


def new_ids(plan: StepPlan) -> list[str]:
    return [r.req_id for r in plan.new_requests]


def freeable(s: Scheduler) -> list[str]:
    """Zero-user entries, oldest first (the eviction order)."""
    return list(s.encoder_cache._freeable)


def users(s: Scheduler, mm_hash: str) -> set[str]:
    return set(s.encoder_cache._users[mm_hash])
