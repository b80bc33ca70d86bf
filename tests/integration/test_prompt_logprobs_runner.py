"""Prompt logprobs on the worker (workers/prompt_logprobs.py): a request that asks for them gets, run by
run of the chunks its steps compute, each prompt token's logprob after the first and its position's top
tokens, equal to ``log_softmax`` of transformers' logits over the same prompt (an image in it); a
preempted request computes them again when it resumes, the same; a request beside it that does not ask
gets none, and the sampled tokens are those of a run without them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.integration.fake_engine import FakeEngine, Prompt
from tests.integration.runner_support import KV_CACHE_TOKENS, LOGPROB_ATOL, greedy
from wire.protocol import PromptLogprobs
from workers.decode_graphs import DecodeGraphs
from workers.model_runner import ModelRunner

NUM_TOP = 3
CHUNK = 100


def transformers_logprobs(hf_model: Any, prompt: Prompt) -> torch.Tensor:
    """[prompt tokens, vocab]: row t is log_softmax of the logits after prompt tokens 0..t."""
    ids = torch.tensor([prompt.input_ids])
    images = (
        {"pixel_values": torch.cat([item["pixel_values"] for item in prompt.items])} if prompt.items else {}
    )
    with torch.no_grad():
        logits = hf_model(input_ids=ids, attention_mask=torch.ones_like(ids), **images).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_run_matches(run: PromptLogprobs, prompt: Prompt, expected: torch.Tensor) -> None:
    assert run.is_whole and run.num_top == NUM_TOP
    for i in range(run.count):
        token = run.first + i
        reference = expected[token - 1]  # the logits after the tokens before it
        logprob = float(reference[prompt.input_ids[token]])
        assert run.logprobs[i] == pytest.approx(logprob, abs=LOGPROB_ATOL)
        higher = int((reference > logprob + LOGPROB_ATOL).sum())  # (near-ties may rank either way)
        assert higher + 1 <= run.ranks[i] <= higher + int((abs(reference - logprob) <= LOGPROB_ATOL).sum())
        top_ids, values = run.top(i)
        assert values == pytest.approx(reference.topk(NUM_TOP).values.tolist(), abs=LOGPROB_ATOL)
        for top_id, value in zip(top_ids, values, strict=True):  # (a near-tie may order two either way)
            assert value == pytest.approx(float(reference[top_id]), abs=LOGPROB_ATOL)


def test_prompt_logprobs_are_transformers_over_chunks_and_after_a_resume(
    tiny_model_dir: Any, hf_model: Any, prompts: dict[str, Prompt]
) -> None:
    prompt = prompts["one"]  # an image's placeholders, then text
    expected = transformers_logprobs(hf_model, prompt)
    runner = ModelRunner(str(tiny_model_dir), device="cpu", kv_cache_tokens=KV_CACHE_TOKENS)
    engine = FakeEngine(runner, chunk_tokens=CHUNK)
    engine.add("scored", prompt, greedy(hf_model, max_tokens=4, min_tokens=4, num_prompt_logprobs=NUM_TOP))
    engine.add("plain", prompts["text"], greedy(hf_model, max_tokens=4, min_tokens=4))
    engine.step()
    engine.step()
    engine.preempt("scored")
    engine.step()
    engine.resume("scored")
    engine.run()

    runs = [(step, out.prompt_logprobs) for step, (_, out) in enumerate(engine.history)]
    assert all(set(got) <= {"scored"} for _, got in runs), "only the request that asked gets them"
    firsts = [got["scored"].first for _, got in runs if "scored" in got]
    num_prompt = len(prompt.input_ids)
    chunks = list(range(1, num_prompt, CHUNK))
    assert firsts == [1, 1 + CHUNK, *chunks], "two chunks, then all of them again after the resume"
    covered = []
    for _, got in runs:
        if "scored" in got:
            assert_run_matches(got["scored"], prompt, expected)
            covered += range(got["scored"].first, got["scored"].first + got["scored"].count)
    assert sorted(set(covered)) == list(range(1, num_prompt)), "every prompt token but the first"
    assert len(covered) == num_prompt - 1 + 2 * CHUNK

    alone = FakeEngine(ModelRunner(str(tiny_model_dir), device="cpu", kv_cache_tokens=KV_CACHE_TOKENS))
    alone.add("scored", prompt, greedy(hf_model, max_tokens=4, min_tokens=4))
    alone.run()
    assert engine.outputs["scored"] == alone.outputs["scored"] == prompt.reference[:4]


def test_one_token_steps_that_score_the_prompt_run_eagerly_beside_decode_graphs(
    tiny_model_dir: Any, hf_model: Any, prompts: dict[str, Prompt]
) -> None:
    """Steps of one token per request are decode-shaped: those that predict a prompt token leave the
    fixed shapes of workers/decode_graphs.py (run without capture on the CPU) for the eager forward."""
    prompt = prompts["text"]
    expected = transformers_logprobs(hf_model, prompt)
    runner = ModelRunner(
        str(tiny_model_dir), device="cpu", kv_cache_tokens=KV_CACHE_TOKENS, decode_graphs=True
    )
    engine = FakeEngine(runner, chunk_tokens=1)
    engine.add("scored", prompt, greedy(hf_model, max_tokens=4, min_tokens=4, num_prompt_logprobs=NUM_TOP))
    engine.run()
    runs = [out.prompt_logprobs["scored"] for _, out in engine.history if out.prompt_logprobs]
    assert [run.first for run in runs] == list(range(1, len(prompt.input_ids)))
    for run in runs:
        assert_run_matches(run, prompt, expected)
    assert isinstance(runner.lm_forward, DecodeGraphs) and runner.lm_forward.num_replays > 0  # its decodes
    assert engine.outputs["scored"] == prompt.reference[:4]
