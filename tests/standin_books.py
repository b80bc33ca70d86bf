"""The stand-in worker's books (tests/standin_worker.py): a request's state, the error a contradicting
step raises, and the checks of a step's additions (new and resumed requests, new blocks, prefix copies),
made before any of them is applied, as workers/runner_requests.py makes them for the worker."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from wire.protocol import (
    MMFeature,
    NewRequestData,
    ResumedRequestData,
    SamplingParams,
    SchedulerOutput,
    WorkerReady,
)


class StepError(ValueError):
    """The step contradicts the stand-in's books (as ``workers.model_runner.StepError``)."""


@dataclass
class RequestState:
    """The worker's books for one request (``workers.model_runner.RequestState`` without tensors)."""

    req_id: str
    token_ids: list[int]  # prompt, then every token sampled for it
    mm_features: list[MMFeature]
    sampling: SamplingParams
    block_ids: list[int] | None  # None while preempted
    num_computed_tokens: int


def check_additions(sched: SchedulerOutput, requests: Mapping[str, RequestState], ready: WorkerReady) -> None:
    """Raises ``StepError`` for a step's new and resumed requests, new blocks and prefix copies that
    contradict the books, before any of them is applied."""
    if not ready.has_language_model and (
        sched.new_requests or sched.resumed_requests or sched.new_block_ids or sched.kv_copies
    ):
        raise StepError("requests sent to an encoder-only worker (it has no language model)")
    for resumed in sched.resumed_requests:
        req = requests.get(resumed.req_id)
        if req is None or req.block_ids is not None:
            state = "unknown" if req is None else "not preempted"
            raise StepError(f"request {resumed.req_id!r} is resumed but {state} on this worker")
        _check_blocks(resumed.req_id, resumed.block_ids, ready)
        _check_num_computed(resumed, len(req.token_ids), ready)
    new_ids: set[str] = set()
    for new in sched.new_requests:
        if new.req_id in requests or new.req_id in new_ids:
            raise StepError(f"request {new.req_id!r} is already running on this worker")
        new_ids.add(new.req_id)
        for feat in new.mm_features:
            if feat.offset < 0 or feat.end > len(new.prompt_token_ids):
                raise StepError(
                    f"mm item {feat.mm_hash!r} at {feat.offset}+{feat.num_tokens} is outside the prompt"
                )
        _check_blocks(new.req_id, new.block_ids, ready)
        _check_num_computed(new, len(new.prompt_token_ids), ready)
    added = new_ids | {r.req_id for r in sched.resumed_requests}
    for req_id, block_ids in sched.new_block_ids.items():
        req = requests.get(req_id)
        if req_id not in added and (req is None or req.block_ids is None):
            state = "unknown" if req is None else "preempted"
            raise StepError(f"request {req_id!r} gets new blocks but is {state} on this worker")
        _check_blocks(req_id, block_ids, ready)
    # a prefix copy fills the first slots of the block a new or resumed request starts in, no more
    starts = sched.copy_destinations(ready.block_size)
    for source, destination, num_tokens in sched.kv_copies:
        _check_blocks("(a prefix copy)", [source, destination], ready)
        if source == destination or starts.get(destination) != num_tokens:
            raise StepError(
                f"a prefix copy of {num_tokens} tokens from block {source} into block {destination}, "
                "where no request of the step starts after as many"
            )


def _check_blocks(req_id: str, block_ids: Sequence[int], ready: WorkerReady) -> None:
    if bad := [b for b in block_ids if not 0 <= b < ready.num_kv_blocks]:
        raise StepError(f"request {req_id!r}: block ids {bad} outside the pool of {ready.num_kv_blocks}")


def _check_num_computed(
    data: NewRequestData | ResumedRequestData, num_tokens: int, ready: WorkerReady
) -> None:
    num_computed, num_slots = data.num_computed_tokens, len(data.block_ids) * ready.block_size
    if not 0 <= num_computed < num_tokens or num_computed > num_slots:
        raise StepError(
            f"request {data.req_id!r}: {num_computed} computed tokens of {num_tokens}, {num_slots} slots"
        )
