"""The engine's side of prompt logprobs (docs/architecture.md, "Prompt logprobs"): a request that asks for
them computes its whole prompt, never from the prefix cache (which keeps serving the others); it keeps
each prompt token's entry once, however often a resume computes it again; a worker's reply whose runs
leave a gap, pass the prompt or name a request the step did not compute is a bad message."""

from __future__ import annotations

import pytest

from engine.scheduler import Scheduler
from engine.step_plan import StepPlan
from engine.step_wire import check_runner_output
from tests.unit.scheduler_support import config, make_request, run_step
from wire.bad_messages import BadMessage
from wire.prompt_logprobs import empty_run
from wire.protocol import PromptLogprobs, RunnerOutput


def run(first: int, count: int) -> PromptLogprobs:
    """A run for prompt tokens first, first + 1, ...: each one's logprob is minus its index, its rank
    its index."""
    tokens = range(first, first + count)
    return PromptLogprobs(first, 0, [-float(t) for t in tokens], list(tokens), [], [])


def test_a_request_that_asks_computes_its_whole_prompt_and_the_cache_stays() -> None:
    s = Scheduler(config(num_kv_blocks=64, enable_prefix_caching=True))
    s.add_request(make_request("a", 50, max_tokens=1))
    while s.has_work:
        run_step(s)
    s.add_request(make_request("scored", 50, max_tokens=1, num_prompt_logprobs=2))
    looked_up = s.kv_cache.num_prefix_queries_tokens
    plan, _ = run_step(s)
    (new,) = plan.new_requests
    assert new.num_cached_tokens == 0
    assert s.kv_cache.num_prefix_queries_tokens == looked_up, "not looked up: not in the hit rate"
    assert plan.num_scheduled_tokens == {"scored": 50}
    while s.has_work:
        run_step(s)
    s.add_request(make_request("c", 50, max_tokens=1))
    plan, _ = run_step(s)
    assert plan.new_requests[0].num_cached_tokens == 48  # the cache serves the others as before


def test_each_prompt_token_is_kept_once_and_a_gap_is_refused() -> None:
    request = make_request("r", 10, num_prompt_logprobs=0)
    first, rest = run(1, 4), run(5, 5)
    assert request.follows_on(first)
    request.add_prompt_logprobs(first)
    assert not request.follows_on(run(6, 4)), "token 5 would be missing"
    assert not request.follows_on(run(5, 6)), "the prompt has 10 tokens"
    request.add_prompt_logprobs(rest)
    again = run(1, 9)  # a resume computes them all again
    assert request.follows_on(again)
    request.add_prompt_logprobs(again)
    whole = request.take_prompt_logprobs()
    assert whole is not None and whole.first == 1 and whole.ranks == list(range(1, 10))
    assert whole.logprobs == [-float(t) for t in range(1, 10)]
    assert request.follows_on(again) and not request.follows_on(run(1, 10)), "sent: only the count stays"
    request.add_prompt_logprobs(again)
    assert request.prompt_logprobs == empty_run(10, 0) and request.num_prompt_logprobs_sent == 9
    assert not make_request("plain", 10).follows_on(first), "it did not ask"


@pytest.mark.parametrize(
    ("runs", "why"),
    [
        ({"other": run(1, 2)}, "did not compute"),
        ({"r": run(1, 9)}, "did not compute"),  # 9 entries from 8 tokens
        ({"r": run(3, 2)}, "do not follow on"),
        ({"r": PromptLogprobs(1, 0, [-1.0, -2.0], [1], [], [])}, "did not compute"),  # a rank short
        ({"r": PromptLogprobs(1, 1, [-1.0], [1], [7, 8], [-1.0])}, "did not compute"),  # a top id too many
        ({"r": PromptLogprobs(1, 2, [-1.0], [1], [7, 8], [-1.0, -2.0])}, "do not follow on"),  # its top count
    ],
)
def test_a_reply_with_runs_the_step_did_not_compute_is_a_bad_message(
    runs: dict[str, PromptLogprobs], why: str
) -> None:
    request = make_request("r", 10, num_prompt_logprobs=0)
    plan = StepPlan(1, [request], {"r": 8}, [], [], [])
    output = RunnerOutput(1, [], [], [], 0, 0.0, 0.0, prompt_logprobs=runs)
    with pytest.raises(BadMessage, match=why):
        check_runner_output(plan, output, {"r": request})
    check_runner_output(plan, RunnerOutput(1, [], [], [], 0, 0.0, 0.0, prompt_logprobs={}), {"r": request})
