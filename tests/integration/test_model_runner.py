"""The worker against transformers' own ``generate`` on the tiny checkpoint.

The tests play the engine with ``FakeEngine`` (tests/integration/fake_engine.py): it schedules prefill
chunks and decode tokens, hands out KV blocks, sends items to encode in the step their placeholder
range is first needed, preempts and resumes on request, and finishes requests after max_tokens.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.fake_engine import FakeEngine
from tests.integration.runner_support import (
    KV_CACHE_TOKENS,
    assert_matches_generate,
    blocks,
    greedy,
    run_staggered,
)
from wire.protocol import (
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from workers.encoder_store import MissingEncoderOutput
from workers.kv_pool import plan_num_kv_blocks
from workers.model_runner import ModelRunner

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------- parity with generate


@pytest.mark.parametrize("name", ["one", "two", "text"])
def test_greedy_matches_generate(runner, hf_model, prompts, name):
    engine = FakeEngine(runner)
    engine.add("r", prompts[name], greedy(hf_model))
    engine.run()
    assert_matches_generate(engine, "r", prompts[name])
    assert engine.history[0][1].num_encoded_items == len(prompts[name].features)


@pytest.mark.parametrize("chunk_tokens", [100, 37])
def test_chunked_prefill_matches_generate(runner, hf_model, prompts, chunk_tokens):
    for name in ("one", "two"):
        prompt = prompts[name]
        engine = FakeEngine(runner, chunk_tokens=chunk_tokens)
        engine.add(name, prompt, greedy(hf_model))
        engine.run()
        assert_matches_generate(engine, name, prompt)
        # Each image is encoded in the step whose chunk first reaches its placeholder range.
        encode_steps = [s for s, (_, out) in enumerate(engine.history) for _ in range(out.num_encoded_items)]
        assert encode_steps == [f.offset // chunk_tokens for f in prompt.features]
        assert any(
            f.offset // chunk_tokens != (f.offset + f.num_tokens - 1) // chunk_tokens for f in prompt.features
        )


def test_batched_mixed_prefill_and_decode(runner, hf_model, prompts):
    engine = run_staggered(runner, hf_model, prompts)
    mixed = [
        s for s, _ in engine.history if len(s) > 1 and 1 in s.values() and any(n > 1 for n in s.values())
    ]
    assert mixed, "no step mixed a prefill chunk with a decode token"
    assert not runner.requests and not engine.allocator.refs


# ---------------------------------------------------------------- encoder store


def test_encoder_store_reuse_and_free(runner, hf_model, prompts):
    engine = FakeEngine(runner, chunk_tokens=256)
    engine.add("first", prompts["one"], greedy(hf_model))
    engine.run()
    cat_hash = prompts["one"].features[0].mm_hash
    assert cat_hash in runner.encoder_store  # kept: only the scheduler frees

    engine.add("again", prompts["one"], greedy(hf_model))  # same image: nothing to encode
    engine.add("pair", prompts["two"], greedy(hf_model))  # cat is cached, dog is new
    outputs = engine.run()
    assert outputs["again"] == outputs["first"]
    assert_matches_generate(engine, "again", prompts["one"])
    assert_matches_generate(engine, "pair", prompts["two"])
    assert sum(out.num_encoded_items for _, out in engine.history) == 2  # cat once, dog once
    assert len(runner.encoder_store) == 2 and runner.encoder_store.num_tokens == 2 * 576

    engine.free([cat_hash])
    engine.step()  # finishes nothing new; applies the free
    assert cat_hash not in runner.encoder_store and len(runner.encoder_store) == 1


def test_missing_encoder_output_fails_the_step_without_state_change(runner, hf_model, prompts):
    prompt = prompts["one"]
    new = NewRequestData("r", prompt.input_ids, prompt.features, greedy(hf_model), blocks(prompt, runner))
    sched = SchedulerOutput(0, [new], {"r": len(prompt.input_ids)}, [], [], [])
    with pytest.raises(MissingEncoderOutput):
        runner.execute(sched, [b""])
    assert runner.requests["r"].num_computed_tokens == 0


# ---------------------------------------------------------------- sampling


def test_seeded_sampling_is_reproducible_and_batch_independent(runner, hf_model, prompts):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    alone = FakeEngine(runner)
    alone.add("a", prompts["one"], seeded)
    tokens_alone = alone.run()["a"]

    batched = FakeEngine(runner, chunk_tokens=300)
    batched.add("other", prompts["text"], SamplingParams(max_tokens=16, temperature=1.0))
    batched.step()
    batched.add("b", prompts["one"], seeded)
    batched.add("c", prompts["one"], SamplingParams(max_tokens=16, temperature=1.0, seed=99))
    outputs = batched.run()
    assert outputs["b"] == tokens_alone
    assert outputs["c"] != tokens_alone


def test_top_k_1_equals_greedy_and_logprobs(runner, hf_model, prompts):
    prompt = prompts["two"]
    engine = FakeEngine(runner)
    engine.add("topk", prompt, greedy(hf_model, temperature=1.0, top_k=1, seed=7, num_top_logprobs=None))
    engine.add("lp", prompt, greedy(hf_model, num_top_logprobs=5))
    engine.add("lp0", prompt, greedy(hf_model, num_top_logprobs=0))
    outputs = engine.run()
    assert_matches_generate(engine, "topk", prompt)
    assert_matches_generate(engine, "lp", prompt)  # logprobs equal generate's log_softmax(logits)
    assert outputs["lp"] == outputs["topk"] and all(lp is None for lp in engine.logprobs["topk"])
    for token_id, lp in zip(outputs["lp"], engine.logprobs["lp"], strict=True):
        assert lp.sampled.token_id == token_id == lp.top[0].token_id
        assert lp.sampled.logprob == lp.top[0].logprob <= 0
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
        assert len(lp.top) == 5
    for token_id, lp in zip(outputs["lp0"], engine.logprobs["lp0"], strict=True):
        assert lp.top == [] and lp.sampled.token_id == token_id


def test_min_tokens_masks_eos(runner, hf_model, prompts):
    prompt = prompts["text"]
    first, second = prompt.reference_logprobs[0].topk(2).indices.tolist()
    # Declare the greedy first token an eos: while min_tokens is unmet it must not be chosen.
    engine = FakeEngine(runner)
    engine.add("masked", prompt, greedy(hf_model, max_tokens=1, min_tokens=1, eos_token_ids=(first,)))
    engine.add("stop", prompt, greedy(hf_model, max_tokens=1, min_tokens=1, stop_token_ids=(first,)))
    engine.add("met", prompt, greedy(hf_model, max_tokens=1, min_tokens=0, eos_token_ids=(first,)))
    outputs = engine.run()
    assert outputs["masked"] == outputs["stop"] == [second] and outputs["met"] == [first]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_runs_bf16(tiny_model_dir, hf_model, prompts):
    runner = ModelRunner(str(tiny_model_dir), kv_cache_tokens=KV_CACHE_TOKENS)  # device "auto"
    assert runner.device.type == "cuda" and runner.dtype == torch.bfloat16
    # Without kv_cache_tokens the pool takes gpu_memory_utilization x total, less what is in use.
    free_bytes, total_bytes = torch.cuda.mem_get_info(runner.device)
    headroom_bytes = 64 * 2**20
    plan = {"block_size": 16, "bytes_per_token": 1024, "device": runner.device, "kv_cache_tokens": None}
    utilization = (total_bytes - free_bytes + headroom_bytes) / total_bytes
    num_blocks = plan_num_kv_blocks(gpu_memory_utilization=utilization, **plan)
    assert num_blocks == pytest.approx(headroom_bytes // (16 * 1024), rel=0.05)
    with pytest.raises(RuntimeError, match="no GPU memory left"):
        plan_num_kv_blocks(gpu_memory_utilization=(total_bytes - free_bytes) / total_bytes / 2, **plan)
    engine = FakeEngine(runner, chunk_tokens=100)
    engine.add("greedy", prompts["two"], greedy(hf_model))
    for req_id in ("s1", "s2"):
        engine.add(req_id, prompts["two"], SamplingParams(max_tokens=8, temperature=1.0, seed=5))
    engine.run()
    assert engine.outputs["s1"] == engine.outputs["s2"]
    assert all(runner.encoder_store.get(f.mm_hash).dtype == torch.bfloat16 for f in prompts["two"].features)
    first = engine.logprobs["greedy"][0]
    for top in first.top:  # bf16 drifts from the fp32 oracle, but not far
        assert top.logprob == pytest.approx(
            float(prompts["two"].reference_logprobs[0, top.token_id]), abs=0.25
        )
