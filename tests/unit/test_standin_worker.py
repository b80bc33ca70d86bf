"""The stand-in worker (tests/standin_worker.py) keeps the worker's books and refuses what the worker
refuses: the engine tests that run on it can only fail on an engine bug if it does."""

from __future__ import annotations

from typing import Any

import pytest

from engine.executor import WorkerFailed, WorkerLost
from tests.standin_worker import StandinWorker, StepError
from wire.protocol import (
    EncoderInput,
    MMFeature,
    NewRequestData,
    ResumedRequestData,
    SamplingParams,
    SchedulerOutput,
    TensorRef,
)

PIXELS = {"pixel_values": TensorRef("uint8", (4,), 1)}
PIXEL_FRAMES = [memoryview(bytes(4))]


def new(
    req_id: str, prompt_len: int = 8, *, blocks: int = 1, computed: int = 0, **kw: object
) -> NewRequestData:
    sampling = SamplingParams(max_tokens=4, **kw)  # type: ignore[arg-type]
    return NewRequestData(req_id, list(range(prompt_len)), [], sampling, list(range(blocks)), computed)


def sched(step_id: int, tokens: dict[str, int], **fields: Any) -> SchedulerOutput:
    names = ("new_requests", "encoder_inputs", "free_mm_hashes", "finished_req_ids")
    required: dict[str, Any] = {name: [] for name in names}
    return SchedulerOutput(step_id, num_scheduled_tokens=tokens, **(required | fields))


def test_counts_up_through_prefill_chunks_decodes_preemption_and_resume() -> None:
    w = StandinWorker(block_size=4)
    assert w.execute(sched(1, {"r": 6}, new_requests=[new("r", blocks=2)]), []).req_ids == []  # a chunk
    out = w.execute(sched(2, {"r": 2}), [])
    assert (out.req_ids, out.sampled_token_ids, out.logprobs) == (["r"], [8], [None])
    assert w.execute(sched(3, {"r": 1}, new_block_ids={"r": [2]}), []).sampled_token_ids == [9]
    w.execute(sched(4, {}, preempted_req_ids=["r"]), [])
    assert w.requests["r"].block_ids is None and w.requests["r"].token_ids[-2:] == [8, 9]
    resumed = ResumedRequestData("r", [0, 1, 2], 0)
    out = w.execute(sched(5, {"r": 10}, resumed_requests=[resumed]), [])  # recomputes prompt + outputs
    assert out.sampled_token_ids == [10]
    w.execute(sched(6, {}, finished_req_ids=["r", "never-seen"]), [])
    assert w.requests == {}


def test_logprobs_only_when_asked() -> None:
    w = StandinWorker()
    out = w.execute(sched(1, {"r": 8}, new_requests=[new("r", num_top_logprobs=2)]), [])
    [entry] = out.logprobs
    assert entry is not None and entry.sampled.token_id == 8
    assert [lp.token_id for lp in entry.top] == [8, 9]


@pytest.mark.parametrize(
    ("step", "match"),
    [
        (sched(1, {"x": 1}), "'x' is scheduled but unknown"),
        (sched(1, {"r": 9}, new_requests=[new("r")]), "scheduled 9 tokens, 8 are computable"),
        (sched(1, {"r": 8}, new_requests=[new("r", blocks=0)]), "needs 8 KV slots"),
        (sched(1, {"r": 8}, new_requests=[new("r", computed=8)]), "8 computed tokens of 8"),
        (sched(1, {}, new_requests=[new("r", blocks=2000)]), "outside the pool of 1024"),
        (sched(1, {}, resumed_requests=[ResumedRequestData("r", [0], 0)]), "resumed but unknown"),
        (sched(1, {}, new_block_ids={"r": [3]}), "gets new blocks but is unknown"),
    ],
)
def test_a_step_that_contradicts_the_books_is_refused(step: SchedulerOutput, match: str) -> None:
    with pytest.raises(StepError, match=match):
        StandinWorker().execute(step, [])


def test_items_are_encoded_once_from_valid_frames_and_needed_by_their_placeholders() -> None:
    w = StandinWorker()
    req = NewRequestData("r", list(range(8)), [MMFeature("h", 2, 4)], SamplingParams(max_tokens=1), [0])
    with pytest.raises(StepError, match=r"needs the encoder output of \['h'\]"):
        w.execute(sched(1, {"r": 8}, new_requests=[req]), [])
    w = StandinWorker()
    enc = EncoderInput("h", "image", PIXELS)
    with pytest.raises(StepError, match="frame 1 holds 3 bytes"):
        w.execute(sched(1, {}, encoder_inputs=[enc]), [memoryview(bytes(3))])
    w.execute(sched(2, {"r": 8}, new_requests=[req], encoder_inputs=[enc]), PIXEL_FRAMES)
    assert w.outputs == {"h": b"output of h"}
    with pytest.raises(StepError, match="already holds"):
        w.execute(sched(3, {}, encoder_inputs=[enc]), PIXEL_FRAMES)
    w.execute(sched(4, {}, free_mm_hashes=["h"], encoder_inputs=[enc]), PIXEL_FRAMES)  # freed first


def test_injected_faults_raise_what_the_worker_client_would() -> None:
    w = StandinWorker(fail_steps={1: "CUDA error"}, drop_replies={2}, lose_steps={3})
    with pytest.raises(WorkerFailed, match="failed step 1: CUDA error"):
        w.execute(sched(1, {"r": 4}, new_requests=[new("r")]), [])
    assert w.requests["r"].num_computed_tokens == 0  # failed before its tokens
    with pytest.raises(WorkerFailed, match="did not answer step 2"):
        w.execute(sched(2, {}), [])
    with pytest.raises(WorkerLost):
        w.execute(sched(3, {}), [])
    assert w.received_step_ids == [1, 2, 3]
