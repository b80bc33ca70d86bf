"""Scheduling ahead (``--async-scheduling``; docs/architecture.md, "Engine step"): the next step is
scheduled and sent while the worker runs the one before it, from what is known. No processes: the
scheduler's and the core's steps run on the stand-in worker (tests/standin_worker.py), which keeps the
worker's books from each step's wire form (its own sampled tokens included) and refuses a step the real
worker would refuse, in the order the worker runs them.

What must hold: the same answers as one step at a time, a pending token never scheduled twice nor a
request past its length, no request in flight preempted, no block registered before its tokens are
known, and a step scheduled on a failed one failing with it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from engine.core import ENCODER_OUTPUT_UNAVAILABLE, EngineCore
from engine.executor import WorkerFailed
from engine.kv_cache_manager import hash_block
from engine.scheduler import Scheduler
from engine.step_plan import StepPlan, StepResult
from engine.step_wire import to_scheduler_output
from tests.standin_worker import StandinWorker, StepError
from tests.unit.engine_core_support import add, engine_core, frames, key_only_frames, run_until_idle
from tests.unit.scheduler_support import PROMPT_TOKEN, config, make_request, run_step, worker_for
from tests.unit.test_ec_scheduler import CountingStore, lm_only_core
from wire.metric_names import EngineCounter
from wire.protocol import FinishReason, RequestOutput, RunnerOutput, SchedulerOutput
from workers.frames import Buffer


def launch(s: Scheduler) -> tuple[StepPlan, RunnerOutput]:
    """schedule() and the stand-in worker's run of it (the worker runs steps in the order sent); the
    engine reads the reply later (``answer``). A plan that sends nothing is not run."""
    plan = s.schedule()
    if plan.sends_nothing:
        return plan, RunnerOutput(plan.step_id, [], [], [], 0, 0.0, 0.0)
    sched, frames = to_scheduler_output(plan, s.kv_cache)
    return plan, worker_for(s).execute(sched, frames)


def answer(s: Scheduler, launched: tuple[StepPlan, RunnerOutput]) -> StepResult:
    return s.postprocess(*launched)


def test_a_request_continues_from_the_token_its_step_in_flight_samples() -> None:
    s = Scheduler(config())
    s.add_request(make_request("r", 10, max_tokens=4))
    first = launch(s)
    assert first[0].num_scheduled_tokens == {"r": 10} and first[0].sampling_req_ids == ["r"]
    request = s.requests["r"]
    assert (request.num_inflight_tokens, request.num_pending_outputs) == (10, 1)

    second = launch(s)  # ahead: the token the first step samples is computed by this one
    assert second[0].num_scheduled_tokens == {"r": 1} and second[0].sampling_req_ids == ["r"]
    assert (request.num_inflight_tokens, request.num_pending_outputs) == (11, 2)
    assert answer(s, first).new_token_ids == {"r": [6]}
    third = launch(s)
    assert answer(s, second).new_token_ids == {"r": [7]}
    fourth = launch(s)
    assert third[0].num_scheduled_tokens == fourth[0].num_scheduled_tokens == {"r": 1}

    # 3 outputs known or pending... the fourth's token is the last (max_tokens=4): nothing more to run
    assert answer(s, third).new_token_ids == {"r": [8]}
    idle = s.schedule()
    assert idle.sends_nothing and idle.step_id == fourth[0].step_id + 1  # a step not sent takes no id
    result = answer(s, fourth)
    assert result.new_token_ids == {"r": [9]} and result.finished[0].finish_reason is FinishReason.LENGTH
    assert result.finished[0].output_token_ids == [6, 7, 8, 9]
    assert s.schedule().step_id == fourth[0].step_id + 1  # its finish goes out with that id


def test_an_eos_seen_late_costs_one_row_and_nothing_else() -> None:
    """The step after the EOS computed one more token for the request: its reply for it is ignored and
    the worker forgets the request with the next step."""
    s = Scheduler(config())
    s.add_request(make_request("r", 4, max_tokens=10, eos_token_ids=(8,)))
    s.add_request(make_request("other", 4, max_tokens=5))
    launched = [launch(s)]
    plans, results = [launched[0][0]], []
    while s.requests:
        launched.append(launch(s))
        plans.append(launched[-1][0])
        results.append(answer(s, launched.pop(0)))
    tokens: dict[str, list[int]] = {}
    for result in results:
        for req_id, new in result.new_token_ids.items():
            tokens.setdefault(req_id, []).extend(new)
    assert tokens == {"r": [6, 7, 8], "other": [6, 7, 8, 9, 10]}
    # r's prompt, then the steps sampling 7 and 8, then one more (9), computed and never answered
    assert sum("r" in plan.num_scheduled_tokens for plan in plans) == 4
    # the same with one step at a time
    sync = Scheduler(config())
    sync.add_request(make_request("r", 4, max_tokens=10, eos_token_ids=(8,)))
    sync.add_request(make_request("other", 4, max_tokens=5))
    sync_tokens: dict[str, list[int]] = {}
    while sync.requests:
        for req_id, new in run_step(sync)[1].new_token_ids.items():
            sync_tokens.setdefault(req_id, []).extend(new)
    assert sync_tokens == tokens
    for step in launched:
        answer(s, step)
    launch(s)  # the last drops
    assert worker_for(s).requests == {}


def test_no_request_in_flight_is_preempted() -> None:
    """Both requests fill their blocks and sample; the step ahead would need a block each, and none is
    free: it stops instead of preempting a request whose step runs, and admits no one. The step after
    the answer preempts, as one step at a time does."""
    s = Scheduler(config(num_kv_blocks=4, block_size=4))
    s.add_request(make_request("a", 8, max_tokens=3))
    s.add_request(make_request("b", 8, max_tokens=3))
    first = launch(s)
    assert first[0].num_scheduled_tokens == {"a": 8, "b": 8}
    s.add_request(make_request("c", 2, max_tokens=1))
    ahead = s.schedule()
    assert ahead.sends_nothing and s.num_preemptions == 0 and s.num_waiting == 1
    answer(s, first)
    after = launch(s)
    assert s.num_preemptions == 1 and after[0].preempted_req_ids == ["b"]
    assert after[0].num_scheduled_tokens == {"a": 1}


def test_a_block_the_pending_token_completes_is_registered_after_the_answer() -> None:
    s = Scheduler(config(enable_prefix_caching=True, block_size=4))
    s.add_request(make_request("r", 7, max_tokens=4))
    first = launch(s)  # tokens 0-6: block 0 full, block 1 holds 3 of 4
    table = s.kv_cache.block_ids("r")
    block0 = hash_block(None, [PROMPT_TOKEN] * 4, ())
    assert first[0].cached_blocks == [(table[0], block0)]
    second = launch(s)  # position 7: the first step's token, unknown here yet
    assert second[0].cached_blocks == []
    answer(s, first)  # token 6 is known now
    third = launch(s)
    block1 = hash_block(block0, [PROMPT_TOKEN] * 3 + [6], ())
    assert third[0].cached_blocks == [(s.kv_cache.block_ids("r")[1], block1)]
    answer(s, second)
    answer(s, third)


def answers(outputs: dict[bytes, list[RequestOutput]]) -> dict[str, tuple[list[int], str | None]]:
    found: dict[str, tuple[list[int], str | None]] = {}
    for out in outputs.get(b"api", []):
        tokens, _ = found.get(out.req_id, ([], None))
        error = out.error.code if out.error is not None else None
        found[out.req_id] = ([*tokens, *out.new_token_ids], error)
    return found


def load(core: EngineCore) -> None:
    """Requests of every kind at once: long prompts in chunks, images, short and long answers."""
    core.add_request(b"api", add("long", "img-a", prompt_len=300, max_tokens=12), frames())
    core.add_request(b"api", add("short", prompt_len=10, max_tokens=1), [])
    core.add_request(b"api", add("img", "img-b", prompt_len=40, max_tokens=20), frames())
    core.add_request(b"api", add("text", prompt_len=25, max_tokens=30), [])


def test_the_core_ahead_gives_the_answers_of_one_step_at_a_time() -> None:
    sync_core, _ = engine_core(max_num_batched_tokens=64, enable_prefix_caching=True)
    load(sync_core)
    expected = answers(run_until_idle(sync_core))
    core, worker = engine_core(max_num_batched_tokens=64, enable_prefix_caching=True)
    load(core)
    assert answers(run_until_idle(core, ahead=True)) == expected
    counters = core.stats().counters
    steps, ahead = counters[EngineCounter.ENGINE_STEPS], counters[EngineCounter.ENGINE_STEPS_AHEAD]
    assert steps >= 30 and ahead >= steps - 5  # nearly every step went out before its predecessor's answer
    assert worker.errors == [] and core.scheduler.requests == {}


def test_a_step_scheduled_on_a_failed_step_fails_with_it() -> None:
    """Step 2 fails; step 3 was sent ahead of its answer (it continues "a" from step 2's token, and
    admits "b", whose second block it registers): both end with 500, step 3's registration is taken
    back, and the engine serves on."""
    core, worker = engine_core(StandinWorker(fail_steps={2: "CUDA error"}), enable_prefix_caching=True)
    core.add_request(b"api", add("a", prompt_len=20, max_tokens=10), [])
    outputs = core.advance(ahead=True)  # step 1 out
    outputs = core.advance(ahead=True)  # step 2 out, step 1 answered
    core.add_request(b"api", add("b", prompt_len=40, max_tokens=10), [])
    outputs = core.advance(ahead=True)  # step 3 out, step 2 failed: both roll back
    found = answers(outputs)
    assert found == {"a": ([], "internal_error"), "b": ([], "internal_error")}
    assert not core.in_flight and core.scheduler.requests == {}
    assert core.stats().counters[EngineCounter.FAILED_STEPS] == 2
    core.add_request(b"api", add("c", prompt_len=40, max_tokens=3), [])
    assert answers(run_until_idle(core, ahead=True)) == {"c": ([40, 41, 42], None)}
    # b and c hit block 0, which step 1 registered; c does not hit block 1, which step 3 did
    assert core.scheduler.kv_cache.num_prefix_hits_tokens == 16 + 16


class OverZmq(StandinWorker):
    """The stand-in as the engine meets it over ZeroMQ: a step it cannot take is a failed step."""

    def execute(self, sched: SchedulerOutput, frames: Sequence[Buffer]) -> RunnerOutput:
        try:
            return super().execute(sched, frames)
        except StepError as exc:
            raise WorkerFailed(f"worker failed step {sched.step_id}: {exc}") from exc


def test_a_failed_step_and_the_step_ahead_sharing_its_image_fail_together() -> None:
    """Step 1 encodes img-x for "a"; "b" (the same image, by key) joins in step 2, sent ahead, and
    shares the entry. Step 1 fails: both steps roll back together (the entry is discarded once neither
    uses it), both requests end with 500, and the image is encoded again for the next request."""
    core, worker = engine_core(OverZmq(fail_steps={1: "CUDA error"}))
    core.add_request(b"api", add("a", "img-x", prompt_len=40, max_tokens=5), frames())
    core.advance(ahead=True)  # step 1 out
    core.add_request(
        b"api", add("b", "img-x", with_tensors=False, prompt_len=40, max_tokens=5), key_only_frames()
    )
    outputs = core.advance(ahead=True)  # step 2 out, step 1 failed: both roll back
    errors = {o.req_id: o.error.code for o in outputs[b"api"] if o.error is not None}
    assert errors == {"a": "internal_error", "b": "internal_error"}
    assert not core.in_flight and core.scheduler.requests == {}
    assert "img-x" not in core.scheduler.encoder_cache
    core.add_request(b"api", add("c", "img-x", prompt_len=40, max_tokens=2), frames())
    assert answers(run_until_idle(core, ahead=True))["c"][1] is None
    assert worker.encoder_inputs.count("img-x") == 2


def test_a_lost_load_shared_by_the_step_ahead_fails_both_with_503(tmp_path: Path) -> None:
    """A --language-model-only consumer: the store loses "Y" before the worker loads it (step 1 fails
    with the item unavailable, an expected event); "r2" with the same image joined in step 2, sent
    ahead: both get the step's 503, retryable, and the engine lives on."""
    store = CountingStore(tmp_path / "ec")
    store.put("Y", b"v")
    core, worker = lm_only_core(store)
    worker.__class__ = OverZmq  # a StepError is a failed step, as over ZeroMQ
    store.lose_before_load = {"Y"}
    core.add_request(b"a", add("r1", "Y"), frames())
    core.advance(ahead=True)
    core.add_request(b"a", add("r2", "Y", with_tensors=False), key_only_frames())
    outputs = core.advance(ahead=True)
    assert {o.req_id: o.error for o in outputs[b"a"]} == {
        "r1": ENCODER_OUTPUT_UNAVAILABLE,
        "r2": ENCODER_OUTPUT_UNAVAILABLE,
    }
    assert not core.in_flight and core.scheduler.requests == {}


def test_short_of_blocks_the_engine_waits_for_the_answer_and_preempts() -> None:
    """Three requests whose outputs outgrow the pool: where the free blocks do not hold every running
    request's next token, no step goes ahead (``has_room_ahead``), and the step after the answer
    preempts as one step at a time does; the answers are the same."""

    def run(ahead: bool) -> tuple[dict[str, tuple[list[int], str | None]], int]:
        core, _ = engine_core(StandinWorker(num_kv_blocks=14, block_size=4))
        for name in ("a", "b", "c"):
            core.add_request(b"api", add(name, prompt_len=8, max_tokens=12), [])
        return answers(run_until_idle(core, 200, ahead=ahead)), core.scheduler.num_preemptions

    (expected, _), (found, num_preemptions) = run(False), run(True)
    assert found == expected and num_preemptions > 0
    assert all(len(tokens) == 12 and error is None for tokens, error in found.values())
