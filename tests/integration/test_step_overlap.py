"""The worker launching step N+1 before it finished step N (docs/architecture.md, "Engine step"): the
engine sent N+1 ahead, N's tokens are still on the device when N+1's forward is launched, and N is
answered while N+1 runs. On the CPU nothing runs asynchronously, but the bookkeeping is the GPU's: the
pending tokens read where they were sampled, penalties and ``min_tokens`` counting every earlier token,
a request dropped while its token was pending. The same steps must give the same replies, bit for bit,
as one step finished before the next is launched."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.integration.fake_engine import FakeEngine, Prompt
from wire.bad_messages import BadMessageLog
from wire.protocol import NewRequestData, RunnerOutput, SamplingParams, SchedulerOutput, WorkerError
from workers import model_runner
from workers.model_runner import ModelRunner
from workers.worker_main import _Steps

NUM_STEPS = 12
BLOCK_SIZE = 16
PARAMS = {
    "greedy": SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, num_top_logprobs=3),
    "seeded": SamplingParams(max_tokens=NUM_STEPS, temperature=0.8, top_p=0.9, seed=7, num_top_logprobs=2),
    "penalised": SamplingParams(
        max_tokens=NUM_STEPS,
        temperature=0.0,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        min_tokens=6,
        eos_token_ids=(5, 6, 7),
    ),
    "dropped": SamplingParams(max_tokens=NUM_STEPS, temperature=0.0),  # finished while a token is pending
}
DROP_AT = 5  # the step whose finished_req_ids drop "dropped"
FRAMES = [b""]  # a step's frames: the message's own (not read), no tensors


def steps() -> list[SchedulerOutput]:
    """A prefill of every prompt (different lengths), then one decode per request per step."""
    rng = random.Random(0)
    prompts = {
        req_id: [rng.randrange(10, 1000) for _ in range(20 + 7 * i)] for i, req_id in enumerate(PARAMS)
    }
    new, first_block = [], 0
    for req_id, prompt in prompts.items():
        num_blocks = -(-(len(prompt) + NUM_STEPS) // BLOCK_SIZE)
        blocks = list(range(first_block, first_block + num_blocks))
        first_block += num_blocks
        new.append(NewRequestData(req_id, prompt, [], PARAMS[req_id], block_ids=blocks))
    out = [SchedulerOutput(1, new, {r: len(p) for r, p in prompts.items()}, [], [], [])]
    running = list(prompts)
    for step_id in range(2, NUM_STEPS + 1):
        finished = []
        if step_id == DROP_AT:
            running.remove("dropped")
            finished.append("dropped")
        out.append(SchedulerOutput(step_id, [], dict.fromkeys(running, 1), [], [], finished))
    return out


def run_overlapped(
    runner: ModelRunner,
    steps: list[SchedulerOutput],
    hook: Callable[[SchedulerOutput, str], None] | None = None,
) -> list[RunnerOutput]:
    """The steps in the worker's order with ``--worker-step-overlap``: each launched before the one
    before is finished, which is then answered, and the new one sampled. ``hook(step, phase)`` runs
    before each launch after the first ("before"), right after it ("launched") and once it is sampled
    ("sampled")."""
    call = hook or (lambda step, phase: None)
    replies: list[RunnerOutput] = []
    first, *rest = steps
    in_flight = runner.sample(runner.launch(first, FRAMES))
    for step in rest:
        call(step, "before")
        launched = runner.launch(step, FRAMES)  # its decodes read in_flight's tokens on the device
        call(step, "launched")
        replies.append(runner.finish(in_flight))
        in_flight = runner.sample(launched)
        call(step, "sampled")
    return [*replies, runner.finish(in_flight)]


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
@pytest.mark.parametrize("decode_graphs", [False, True], ids=["eager", "fixed-shape"])
def test_overlapped_steps_reply_as_steps_one_at_a_time(
    tiny_model: Callable[[str], Path], family: str, decode_graphs: bool
) -> None:
    model_dir = tiny_model(family)

    def runner() -> ModelRunner:
        return ModelRunner(str(model_dir), "cpu", kv_cache_tokens=4096, decode_graphs=decode_graphs)

    sequential = runner()
    expected = [sequential.execute(step, FRAMES) for step in steps()]

    def check(step: SchedulerOutput, phase: str) -> None:
        if phase != "launched":
            return
        if step.step_id == DROP_AT:
            assert "dropped" not in overlapped.requests  # dropped before its pending token was finished
        else:
            assert all(r.pending is not None for r in overlapped.requests.values())

    overlapped = runner()
    replies = run_overlapped(overlapped, steps(), check)

    def answers(outputs: list[RunnerOutput]) -> list[tuple]:
        return [(o.step_id, o.req_ids, o.sampled_token_ids, o.logprobs) for o in outputs]

    assert answers(replies) == answers(expected)
    tokens = {r: s.token_ids for r, s in overlapped.requests.items()}
    assert tokens == {r: s.token_ids for r, s in sequential.requests.items()}
    assert all(r.pending is None for r in overlapped.requests.values())
    # the penalised request's tokens differ from the greedy one's choices: its penalties were applied
    assert len(set(tokens["penalised"][-NUM_STEPS:])) > 1


def test_a_failed_step_leaves_no_token_pending(tiny_model_dir: Path) -> None:
    """The step after a failed one is failed too by the worker loop (its inputs were the failed
    step's tokens); ``forget_pending`` drops what was pending."""
    runner = ModelRunner(str(tiny_model_dir), "cpu", kv_cache_tokens=4096, decode_graphs=False)
    first, second, *_ = steps()
    runner.sample(runner.launch(first, [b""]))
    assert all(r.pending is not None for r in runner.requests.values())
    runner.forget_pending()
    assert all(r.pending is None for r in runner.requests.values())
    with pytest.raises(Exception, match="computable"):  # its tokens are unknown: the step is refused
        runner.launch(second, [b""])


def test_the_fake_engines_overlapped_decodes_equal_its_steps(tiny_model_dir: Path) -> None:
    """``FakeEngine.decode_overlapped`` (what bench/gpu/profile_decode.py times as the worker's overlap)
    gives the tokens of as many plain steps."""
    outputs = []
    for overlapped in (False, True):
        runner = ModelRunner(str(tiny_model_dir), "cpu", kv_cache_tokens=4096, decode_graphs=True)
        engine = FakeEngine(runner)
        rng = random.Random(1)
        for i in range(3):
            ids = [rng.randrange(10, 1000) for _ in range(17 + 9 * i)]
            engine.add(
                f"r{i}",
                Prompt(ids, [], [], [], torch.empty(0)),
                SamplingParams(max_tokens=40, temperature=0.0),
            )
        engine.step()  # the prompts
        if overlapped:
            engine.decode_overlapped(20)
        else:
            for _ in range(20):
                engine.step()
        outputs.append(dict(engine.outputs))
    assert outputs[0] == outputs[1] and all(len(tokens) == 21 for tokens in outputs[1].values())


def test_min_tokens_counts_the_pending_token(tiny_model_dir: Path) -> None:
    """A step launched while its request's last token is pending samples with that token counted: the
    eos ``min_tokens`` held back is allowed exactly where it is one step at a time."""
    min_tokens = 4

    def run(params: SamplingParams, overlap: bool) -> list[int]:
        runner = ModelRunner(str(tiny_model_dir), "cpu", kv_cache_tokens=1024, decode_graphs=False)
        prompt = [random.Random(0).randrange(10, 1000) for _ in range(20)]
        first = SchedulerOutput(
            1, [NewRequestData("r", prompt, [], params, block_ids=[0, 1])], {"r": 20}, [], [], []
        )
        rest = [SchedulerOutput(i, [], {"r": 1}, [], [], []) for i in range(2, 11)]
        replies = (
            run_overlapped(runner, [first, *rest])
            if overlap
            else [runner.execute(s, FRAMES) for s in (first, *rest)]
        )
        return [t for reply in replies for t in reply.sampled_token_ids]

    plain = run(SamplingParams(max_tokens=10, temperature=0.0), overlap=False)
    eos = plain[min_tokens]  # what greedy picks once min_tokens outputs exist
    assert eos not in plain[:min_tokens]
    params = SamplingParams(max_tokens=10, temperature=0.0, min_tokens=min_tokens, eos_token_ids=(eos,))
    sequential = run(params, overlap=False)
    assert sequential[min_tokens] == eos and run(params, overlap=True) == sequential


class Frame:
    """What ``_Steps`` reads of a ZeroMQ frame."""

    buffer = memoryview(b"")


def test_the_worker_loop_fails_the_step_after_a_failed_one_without_counting_it_bad(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 1 fails in its sampling; step 2, which the engine sent ahead of that answer, cannot run
    (the token it continues from was never made): both are answered WorkerError, in order, and step 2
    is not a bad message from the engine. Step 3, sent after the engine failed both, runs."""
    runner = ModelRunner(str(tiny_model_dir), "cpu", kv_cache_tokens=1024, decode_graphs=False)
    bad = BadMessageLog(logging.getLogger("test"))
    replies: list[RunnerOutput | WorkerError] = []
    steps_ = _Steps(runner, bad, replies.append, overlap=True)
    prompt = list(range(10, 30))
    new = [NewRequestData("r", prompt, [], SamplingParams(max_tokens=5, temperature=0.0), block_ids=[0, 1])]

    def broken(*args: object) -> None:
        raise RuntimeError("sampler failed")

    monkeypatch.setattr(model_runner, "sample_on_device", broken)
    steps_.run(SchedulerOutput(1, new, {"r": 20}, [], [], []), [Frame()])
    monkeypatch.undo()
    steps_.run(SchedulerOutput(2, [], {"r": 1}, [], [], []), [Frame()])
    assert [(type(r).__name__, r.step_id) for r in replies] == [("WorkerError", 1), ("WorkerError", 2)]
    assert sum(bad.counts.values()) == 0
    new = [NewRequestData("s", prompt, [], SamplingParams(max_tokens=5, temperature=0.0), block_ids=[2, 3])]
    steps_.run(SchedulerOutput(3, new, {"s": 20}, [], [], ["r"]), [Frame()])
    steps_.finish_in_flight()
    assert isinstance(replies[-1], RunnerOutput) and replies[-1].req_ids == ["s"]
