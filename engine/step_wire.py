"""A step's plan to and from the wire: the ``SchedulerOutput`` and its tensor frames (encoder inputs and the
grammar bitmask), the check of the worker's reply, and the engine's item for a received feature
(docs/architecture.md, "Messages")."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from engine.kv_cache_manager import KVCacheManager
from engine.request import MMItem, Request
from engine.step_plan import StepPlan
from engine.structured.grammar import RequestGrammar, stack_rows
from wire.bad_messages import BadMessage
from wire.protocol import (
    EncoderInput,
    GrammarBitmask,
    MMFeature,
    NewRequestData,
    ResumedRequestData,
    RunnerOutput,
    SchedulerOutput,
    TensorRef,
)


def item_from_wire(feature: MMFeature, frames: Sequence[memoryview]) -> MMItem | None:
    """The engine-side item for a feature that carries tensors (frames of the same message) or a
    shared-memory reference; None for a key-only feature (the receiver cache holds it)."""
    if feature.shm is not None:
        shapes = {name: (t.dtype, t.shape) for name, t in feature.shm.tensors.items()}
        return MMItem(feature.modality, feature.num_tokens, shapes, buffers={}, shm=feature.shm)
    if feature.tensors is None:
        return None
    return MMItem(
        modality=feature.modality,
        num_tokens=feature.num_tokens,
        dtypes_shapes={name: (ref.dtype, ref.shape) for name, ref in feature.tensors.items()},
        buffers={name: frames[ref.frame] for name, ref in feature.tensors.items()},
    )


def check_runner_output(plan: StepPlan, output: RunnerOutput, requests: Mapping[str, Request]) -> None:
    """A reply the engine can take for ``plan``: one sampled token, with its logprobs entry, per request
    of the step at most, and prompt logprobs only for prompt tokens the step computed, which follow on
    from those its request (one of ``requests``, while it runs) has. ``BadMessage`` otherwise (the step
    fails, as one the worker failed)."""
    if not len(output.req_ids) == len(output.sampled_token_ids) == len(output.logprobs):
        raise BadMessage("reply lengths differ", f"step {plan.step_id}")
    scheduled = plan.num_scheduled_tokens
    if len(set(output.req_ids)) != len(output.req_ids) or any(r not in scheduled for r in output.req_ids):
        raise BadMessage("reply names a request not in the step", f"step {plan.step_id}")
    if any(token_id < 0 for token_id in output.sampled_token_ids):
        raise BadMessage("negative token id", f"step {plan.step_id}")
    for req_id, run in output.prompt_logprobs.items():
        request = requests.get(req_id)
        if req_id not in scheduled or run.count > scheduled[req_id] or not run.is_whole:
            raise BadMessage("prompt logprobs the step did not compute", f"step {plan.step_id}")
        if request is not None and not request.follows_on(run):
            raise BadMessage(f"prompt logprobs of {req_id!r} do not follow on", f"step {plan.step_id}")


def to_scheduler_output(
    plan: StepPlan, kv_cache: KVCacheManager, grammars: Sequence[tuple[str, RequestGrammar]] = ()
) -> tuple[SchedulerOutput, list[memoryview]]:
    """The wire form of a plan and its tensor frames (numbered from 1: frame 0 is the message);
    ``grammars``: the constrained requests that sample in the step, whose bitmask rows go with it."""
    frames: list[memoryview] = []
    encoder_inputs = []
    for mm_hash, item in plan.encoder_items:
        if item.shm is not None:  # the worker reads it from the API's ring
            encoder_inputs.append(EncoderInput(mm_hash, item.modality, shm=item.shm))
            continue
        refs = {}
        for name, (dtype, shape) in item.dtypes_shapes.items():
            refs[name] = TensorRef(dtype, shape, len(frames) + 1)
            frames.append(item.buffers[name])
        encoder_inputs.append(EncoderInput(mm_hash, item.modality, refs))
    new_requests = [
        NewRequestData(
            r.req_id,
            r.prompt_token_ids,
            r.mm_features,
            r.sampling,
            block_ids=kv_cache.block_ids(r.req_id),
            num_computed_tokens=r.num_computed_tokens,
        )
        for r in plan.new_requests
    ]
    resumed_requests = [
        ResumedRequestData(r.req_id, kv_cache.block_ids(r.req_id), r.num_computed_tokens)
        for r in plan.resumed_requests
    ]
    # a new or resumed request gets its whole table above; only running ones need the appended blocks
    fresh = {r.req_id for r in plan.new_requests} | {r.req_id for r in plan.resumed_requests}
    new_block_ids = {req_id: ids for req_id, ids in plan.new_block_ids.items() if req_id not in fresh}
    sched = SchedulerOutput(
        step_id=plan.step_id,
        new_requests=new_requests,
        num_scheduled_tokens=plan.num_scheduled_tokens,
        encoder_inputs=encoder_inputs,
        free_mm_hashes=plan.free_mm_hashes,
        finished_req_ids=plan.finished_req_ids,
        resumed_requests=resumed_requests,
        new_block_ids=new_block_ids,
        preempted_req_ids=plan.preempted_req_ids,
        ec_meta=plan.ec_meta,
        grammar_bitmask=_bitmask(grammars, frames),
        forced_tokens=plan.forced_tokens,
        kv_copies=plan.kv_copies,
    )
    return sched, frames


def _bitmask(
    grammars: Sequence[tuple[str, RequestGrammar]], frames: list[memoryview]
) -> GrammarBitmask | None:
    """The step's grammar bitmask (one row per constrained request that samples), appended to ``frames``."""
    if not grammars:
        return None
    rows = stack_rows([grammar for _, grammar in grammars])
    frames.append(memoryview(rows.tobytes()))  # a few words per request
    ref = TensorRef(str(rows.dtype), tuple(rows.shape), len(frames))
    return GrammarBitmask([req_id for req_id, _ in grammars], ref)
