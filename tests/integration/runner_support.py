"""Shared by the worker tests: the generate oracle's constants, greedy sampling params, block tables
for hand-made steps, and the parity assertion."""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

import pytest
import torch

from tests.integration.fake_engine import FakeEngine, Prompt
from tests.near_tie import accept_near_tie, first_divergence
from wire.protocol import (
    MMFeature,
    SamplingParams,
)
from workers.attention import ATTENTION_BACKENDS
from workers.decode_graphs import DecodeGraphs
from workers.model_runner import ModelRunner

NUM_NEW_TOKENS = 32
NEAR_TIE_LOGPROB_GAP = 1e-4
LOGPROB_ATOL = 5e-5  # observed: <= 2.2e-5 on CPU fp32, either attention backend (logprobs near -8: ~20 ulp)
BACKEND_LOGITS_ATOL = 1e-4  # two attention backends, fp32 on CPU
KV_CACHE_TOKENS = 8192  # room for the largest batch below (3 x "two": ~3,700 tokens) and then some


def placements(
    input_ids: list[int],
    image_token_id: int,
    mm_hashes: list[str],
    grids: list[tuple[int, ...]] | None = None,
) -> list[MMFeature]:
    """One MMFeature per run of image placeholder tokens (with the family's grid, where it has one)."""
    runs, offset = [], 0
    for is_image, group in itertools.groupby(input_ids, key=lambda t: t == image_token_id):
        num_tokens = len(list(group))
        if is_image:
            runs.append((offset, num_tokens))
        offset += num_tokens
    grids = grids or [()] * len(runs)
    return [
        MMFeature(h, offset, n, grid_thw=grid)
        for h, (offset, n), grid in zip(mm_hashes, runs, grids, strict=True)
    ]


def greedy(hf_model: Any, **kwargs) -> SamplingParams:
    """Like generate(do_sample=False, min_new_tokens=32): argmax with eos masked for 32 tokens; asks for
    logprobs so that parity checks cover the logits, not only their argmax."""
    eos = hf_model.generation_config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
    params = {
        "max_tokens": NUM_NEW_TOKENS,
        "temperature": 0.0,
        "min_tokens": NUM_NEW_TOKENS,
        "num_top_logprobs": 5,
    }
    return SamplingParams(**(params | {"eos_token_ids": eos_ids} | kwargs))


def reference_prompt(
    hf_model: Any,
    batch: Any,
    items: list[dict[str, torch.Tensor]],
    grids: list[tuple[int, ...]] | None = None,
) -> Prompt:
    """A ``Prompt`` whose reference is transformers' greedy ``generate`` on the processor's full ``batch``
    (``items``: each image's tensors as the API would send them; mm_hash = sha256 of its pixels)."""
    with torch.no_grad():
        generated = hf_model.generate(
            **batch,
            do_sample=False,
            max_new_tokens=NUM_NEW_TOKENS,
            min_new_tokens=NUM_NEW_TOKENS,
            output_logits=True,
            return_dict_in_generate=True,
        )
    logprobs = torch.log_softmax(torch.cat(generated.logits).float(), dim=-1)
    input_ids = batch["input_ids"][0].tolist()
    hashes = [hashlib.sha256(i["pixel_values"].numpy().tobytes()).hexdigest() for i in items]
    features = placements(input_ids, hf_model.config.image_token_id, hashes, grids)
    reference = generated.sequences[0, len(input_ids) :].tolist()
    return Prompt(input_ids, items, features, reference, logprobs)


def run_staggered(runner: ModelRunner, hf_model: Any, prompts: dict[str, Prompt]) -> FakeEngine:
    """ "text" starts alone; "one" and "two" join while it decodes, in 200-token prefill chunks, so
    steps mix prefill chunks with decode tokens. Every request is checked against ``generate``."""
    engine = FakeEngine(runner, chunk_tokens=200)
    engine.add("text", prompts["text"], greedy(hf_model))
    engine.step()
    engine.step()
    engine.add("one", prompts["one"], greedy(hf_model))
    engine.step()
    engine.add("two", prompts["two"], greedy(hf_model))
    engine.run()
    for name in ("text", "one", "two"):
        assert_matches_generate(engine, name, prompts[name])
    return engine


def blocks(prompt: Prompt, runner: ModelRunner, num_extra_tokens: int = 8) -> list[int]:
    """A contiguous block table with room for the prompt and a few outputs (hand-made steps)."""
    return list(range(-(-(len(prompt.input_ids) + num_extra_tokens) // runner.block_size)))


def assert_matches_generate(engine: FakeEngine, req_id: str, prompt: Prompt) -> None:
    """Token-for-token equality with transformers, but for a divergence at a true near-tie (the served
    token is generate's runner-up within ``NEAR_TIE_LOGPROB_GAP``: tests/near_tie.py, the rule of every
    tier), after which nothing is compared by design; up to there, returned logprobs (sampled and top)
    equal log_softmax of generate's logits."""
    tokens, ref = engine.outputs[req_id], prompt.reference
    pos = first_divergence(tokens, ref)
    num_equal = len(ref) if pos is None else pos
    for i, lp in enumerate(engine.logprobs[req_id][:num_equal]):
        if lp is None:
            continue
        expected = prompt.reference_logprobs[i]
        assert lp.sampled.logprob == pytest.approx(float(expected[tokens[i]]), abs=LOGPROB_ATOL), f"token {i}"
        for top in lp.top:
            assert top.logprob == pytest.approx(float(expected[top.token_id]), abs=LOGPROB_ATOL), f"token {i}"
    if pos is not None:  # generate's logits at step pos saw the same prefix as ours
        logprobs, sampling = prompt.reference_logprobs[pos].clone(), engine.sampling[req_id]
        if pos < sampling.min_tokens:  # neither side could pick EOS there
            logprobs[list(sampling.eos_token_ids)] = float("-inf")
        accept_near_tie(pos, tokens[pos], ref[pos], logprobs, NEAR_TIE_LOGPROB_GAP)


def record_logits(runner: ModelRunner) -> list[torch.Tensor]:
    """From now on, every step's logits of every scheduled token (not only the rows that are sampled)
    are appended to the returned list."""
    recorded: list[torch.Tensor] = []
    forward = runner.lm_forward
    assert forward is not None

    def recording(embeds, positions, spans, logits_rows, deepstack=None, prompt_logprobs=None):
        logits = forward(embeds, positions, spans, list(range(embeds.shape[0])), deepstack, prompt_logprobs)
        recorded.append(logits)
        return logits[logits_rows]

    runner.lm_forward = recording  # type: ignore[assignment]
    return recorded


def run_mixed_steps(runner: ModelRunner, hf_model: Any, prompts: dict[str, Prompt]) -> FakeEngine:
    """Steps that mix everything a backend must handle: "text" decodes while "one" and "two" prefill in
    64-token chunks that cut through their images; "text" is preempted, its blocks reused, and resumed
    (its prompt and outputs recomputed in one chunk) while the others still prefill; once "one" has its
    prompt's K/V, "again" and "thrice" arrive with the same prompt and share its full blocks (prefix-cache
    hits), so their decodes share leading blocks; then all decode."""
    engine = FakeEngine(runner, chunk_tokens=64)
    engine.add("text", prompts["text"], greedy(hf_model, max_tokens=10))
    engine.step()
    engine.step()
    engine.add("one", prompts["one"], greedy(hf_model, max_tokens=6))
    engine.add("two", prompts["two"], greedy(hf_model, max_tokens=6))
    engine.step()
    engine.step()
    engine.preempt("text")
    engine.step()
    engine.resume("text")
    prompt = prompts["one"]
    for _ in range(len(prompt.input_ids)):
        if engine.num_computed["one"] >= len(prompt.input_ids):
            break
        engine.step()
    for name in ("again", "thrice"):
        engine.add(
            name,
            prompt,
            greedy(hf_model, max_tokens=6),
            prefix=("one", len(prompt.input_ids) // engine.block_size),
        )
    engine.run()
    kinds = [sorted(scheduled.values()) for scheduled, _ in engine.history]
    assert any(k[0] == 1 and k[-1] > 1 for k in kinds), "a step with decodes and prefill chunks"
    both = [s for s, _ in engine.history if s.get("again") == 1 and s.get("thrice") == 1]
    assert both, "a step where two decodes share a prompt's blocks"
    assert engine.outputs["again"] == engine.outputs["thrice"] == engine.outputs["one"][:6]
    return engine


def assert_backends_agree(
    model_dir: str, kv_cache_tokens: int, hf_model: Any, prompts: dict[str, Prompt]
) -> None:
    """``run_mixed_steps`` on every attention backend, and on the default one with decode-only steps in
    the fixed shapes that CUDA graphs capture (workers/decode_graphs.py: padded rows and key blocks,
    run without capture on the CPU): the same tokens, and every step's logits of every token equal to
    the reference backend's (per-request) within fp32 rounding."""
    runs = {}
    for name, graphs in [*((b, False) for b in ATTENTION_BACKENDS), ("batched", True)]:
        runner = ModelRunner(
            model_dir, device="cpu", kv_cache_tokens=kv_cache_tokens, attention=name, decode_graphs=graphs
        )
        forward = runner.lm_forward
        logits = record_logits(runner)
        label = f"{name} + decode graphs" if graphs else name
        runs[label] = (run_mixed_steps(runner, hf_model, prompts), logits)
        if graphs:
            assert isinstance(forward, DecodeGraphs)
            assert forward.num_replays > 0, "decode-only steps ran in fixed shapes"
    reference, reference_logits = runs["per-request"]
    for name, (engine, logits) in runs.items():
        assert engine.outputs == reference.outputs, name
        assert len(logits) == len(reference_logits), name
        for step, (got, expected) in enumerate(zip(logits, reference_logits, strict=True)):
            torch.testing.assert_close(
                got, expected, atol=BACKEND_LOGITS_ATOL, rtol=0, msg=f"{name}, step {step}"
            )
