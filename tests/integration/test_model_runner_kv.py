"""The worker's paged KV pool: slot mapping and sizing, block tables chosen by the engine (shuffled,
shared through the prefix cache), preemption with exact resumption, and flat memory."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch

from tests.integration.fake_engine import FakeEngine
from tests.integration.runner_support import (
    KV_CACHE_TOKENS,
    assert_matches_generate,
    blocks,
    greedy,
)
from wire.protocol import (
    NewRequestData,
    ResumedRequestData,
    SamplingParams,
    SchedulerOutput,
)
from workers.attention.base import SeqSpan, slot_matrix
from workers.config import CPU_DEFAULT_KV_CACHE_TOKENS
from workers.kv_pool import KVPool, plan_num_kv_blocks
from workers.model_runner import ModelRunner
from workers.runner_requests import StepError

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------- paged KV


def test_kv_pool_slots_and_sizing():
    cpu = torch.device("cpu")
    pool = KVPool(2, num_blocks=10, block_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=cpu)
    [slots] = slot_matrix([SeqSpan("r", 0, 10, [7, 2, 9])], block_size=4, num_positions=10)
    assert slots.tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 36, 37]
    k, v = torch.randn(10, 1, 2), torch.randn(10, 1, 2)
    pool.write(1, slots, k, v)
    read_k, read_v = pool.read(1, slots[2:7])
    assert torch.equal(read_k, k[2:7]) and torch.equal(read_v, v[2:7])
    plan = {"block_size": 16, "bytes_per_token": 1024, "device": cpu, "gpu_memory_utilization": 0.9}
    assert plan_num_kv_blocks(kv_cache_tokens=1000, **plan) == 62
    assert plan_num_kv_blocks(kv_cache_tokens=3, **plan) == 1
    assert plan_num_kv_blocks(kv_cache_tokens=None, **plan) == CPU_DEFAULT_KV_CACHE_TOKENS // 16


def test_runner_reports_its_pool(tiny_model_dir, runner):
    assert (runner.num_kv_blocks, runner.block_size) == (KV_CACHE_TOKENS // 16, 16)
    other = ModelRunner(str(tiny_model_dir), device="cpu", block_size=32, kv_cache_tokens=1000)
    assert (other.num_kv_blocks, other.block_size) == (31, 32)
    assert other.kv_pool.kv.shape[2] == 31 * 32


def test_shuffled_block_tables_give_identical_outputs(runner, hf_model, prompts):
    runs = []
    for shuffle_seed in (None, 1):
        engine = FakeEngine(runner, chunk_tokens=37, shuffle_seed=shuffle_seed)
        engine.add("two", prompts["two"], greedy(hf_model))
        engine.add("text", prompts["text"], greedy(hf_model))
        engine.step()
        tables = {r: list(t) for r, t in engine.tables.items()}
        engine.run()
        runs.append((engine.outputs, engine.logprobs, tables))
    (outputs, logprobs, tables), (shuffled_outputs, shuffled_logprobs, shuffled_tables) = runs
    assert tables["two"] == list(range(len(tables["two"])))
    assert any(b - a != 1 for a, b in itertools.pairwise(shuffled_tables["two"]))
    assert shuffled_outputs == outputs and shuffled_logprobs == logprobs
    assert_matches_generate(engine, "two", prompts["two"])  # the shuffled run


@pytest.mark.parametrize(("block_size", "partial"), [(4, False), (16, False), (16, True)])
def test_prefix_hit_reuses_another_requestsblocks(
    tiny_model_dir, runner, hf_model, prompts, block_size, partial
):
    """ "two" starts like "one" (chat header, the same cat image, one more token): its first blocks may
    be "one"'s. With 4-token blocks the cat lies entirely in the shared prefix (never encoded again);
    with 16-token blocks the shared blocks end 4 tokens before the cat does (encoded whole, sliced),
    unless the first tokens of the next block are a hit too (``partial``: copied into "two"'s own)."""
    one, two = prompts["one"], prompts["two"]
    cat = two.features[0]
    num_common_tokens = cat.offset + cat.num_tokens + 1
    assert cat.mm_hash == one.features[0].mm_hash
    assert one.input_ids[:num_common_tokens] == two.input_ids[:num_common_tokens]
    if block_size != runner.block_size:
        runner = ModelRunner(
            str(tiny_model_dir), "cpu", block_size=block_size, kv_cache_tokens=KV_CACHE_TOKENS
        )
    num_shared_blocks = num_common_tokens // block_size
    num_copied = num_common_tokens % block_size if partial else 0
    cat_skipped = num_shared_blocks * block_size + num_copied >= cat.offset + cat.num_tokens
    assert cat_skipped == (block_size == 4 or partial)

    engine = FakeEngine(runner, chunk_tokens=256)
    engine.add("first", one, greedy(hf_model))
    while not engine.outputs["first"]:
        engine.step()
    engine.free([cat.mm_hash])  # "first" is past its image: only a re-encode could bring it back
    num_steps_before = len(engine.history)
    engine.add("second", two, greedy(hf_model), prefix=("first", num_shared_blocks), num_copied=num_copied)
    assert engine.tables["second"][:num_shared_blocks] == engine.tables["first"][:num_shared_blocks]
    engine.run()
    assert_matches_generate(engine, "first", one)
    assert_matches_generate(engine, "second", two)
    num_encoded = sum(out.num_encoded_items for _, out in engine.history[num_steps_before:])
    assert num_encoded == (1 if cat_skipped else 2)
    unshared = FakeEngine(runner, chunk_tokens=256)
    unshared.add("second", two, greedy(hf_model))
    assert unshared.run()["second"] == engine.outputs["second"]


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_preempted_request_resumes_exactly(runner, hf_model, prompts, kind):
    """Preempted after 15 outputs, its blocks overwritten by another request, resumed with a new table:
    the worker recomputes prompt + outputs (590 + 15 tokens) in chunks of 100 and samples only after
    the chunk that ends at 605, not the one that ends at 600, past the prompt."""
    prompt, num_outputs_before = prompts["one"], 15
    if kind == "greedy":
        sampling = greedy(hf_model, max_tokens=24)
    else:
        sampling = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234)
    alone = FakeEngine(runner, chunk_tokens=100)
    alone.add("r", prompt, sampling)
    expected = alone.run()["r"]

    engine = FakeEngine(runner, chunk_tokens=100)
    engine.add("r", prompt, sampling)
    engine.add("other", prompts["text"], SamplingParams(max_tokens=40, temperature=1.0))
    while len(engine.outputs["r"]) < num_outputs_before:
        engine.step()
    old_blocks = engine.preempt("r")
    engine.add("intruder", prompts["two"], greedy(hf_model, max_tokens=4))
    engine.step()  # the intruder's first chunk overwrites r's old blocks
    assert set(engine.tables["intruder"]) & set(old_blocks)
    engine.step()
    engine.resume("r")
    num_steps_before = len(engine.history)
    engine.run()
    assert engine.outputs["r"] == expected
    first_sample = next(
        i for i, (_, out) in enumerate(engine.history[num_steps_before:]) if "r" in out.req_ids
    )
    num_tokens = len(prompt.input_ids) + num_outputs_before
    assert len(prompt.input_ids) <= num_tokens // 100 * 100 < num_tokens  # a chunk ends in between
    assert first_sample == num_tokens // 100
    if kind == "greedy":
        assert expected == prompt.reference[:24]


def test_contradicting_block_tables_fail_the_step(runner, hf_model, prompts):
    prompt = prompts["text"]
    num_tokens = len(prompt.input_ids)
    too_few = list(range(num_tokens // runner.block_size))
    bad_steps = [
        SchedulerOutput(
            0,
            [NewRequestData("r", prompt.input_ids, [], greedy(hf_model), too_few)],
            {"r": num_tokens},
            [],
            [],
            [],
        ),
        SchedulerOutput(
            0,
            [NewRequestData("r2", prompt.input_ids, [], greedy(hf_model), [runner.num_kv_blocks])],
            {},
            [],
            [],
            [],
        ),
        SchedulerOutput(0, [], {}, [], [], [], resumed_requests=[ResumedRequestData("nope", [0], 0)]),
        SchedulerOutput(0, [], {}, [], [], [], new_block_ids={"nope": [0]}),
        # prefix copies: a block outside the pool, a block onto itself, a whole block (never a hit), a
        # block where no request starts (it would overwrite another request's K/V), and the block where a
        # request starts after 1 token, filled with 2
        SchedulerOutput(0, [], {}, [], [], [], kv_copies=[(0, runner.num_kv_blocks, 1)]),
        SchedulerOutput(0, [], {}, [], [], [], kv_copies=[(3, 3, 1)]),
        SchedulerOutput(0, [], {}, [], [], [], kv_copies=[(0, 1, runner.block_size)]),
        SchedulerOutput(0, [], {}, [], [], [], kv_copies=[(0, 1, 1)]),
        SchedulerOutput(
            0,
            [NewRequestData("r3", prompt.input_ids, [], greedy(hf_model), blocks(prompt, runner), 1)],
            {"r3": num_tokens - 1},
            [],
            [],
            [],
            kv_copies=[(0, blocks(prompt, runner)[0], 2)],
        ),
    ]
    for sched in bad_steps:
        with pytest.raises(StepError):
            runner.execute(sched, [b""])
    assert runner.requests["r"].num_computed_tokens == 0  # the first step registered it, computed nothing
    # A preempted request is not scheduled until it is resumed.
    ok = NewRequestData("ok", prompt.input_ids, [], greedy(hf_model), blocks(prompt, runner))
    runner.execute(SchedulerOutput(1, [ok], {"ok": num_tokens}, [], [], ["r"]), [b""])
    with pytest.raises(StepError, match="preempted"):
        runner.execute(SchedulerOutput(2, [], {"ok": 1}, [], [], [], preempted_req_ids=["ok"]), [b""])
    assert runner.requests["ok"].token_ids[num_tokens:] == prompt.reference[:1]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_memory_stays_flat_across_many_requests(runner, prompts):
    sampling = SamplingParams(max_tokens=3, temperature=1.0)

    def serve(num_requests: int) -> None:
        engine = FakeEngine(runner)
        for i in range(0, num_requests, 25):
            for j in range(i, i + 25):
                engine.add(f"r{j}", prompts["text"], sampling)
            engine.run()
        assert not runner.requests and not engine.allocator.refs

    serve(100)  # warm up allocators and touch the pool's pages that short requests use
    before = _rss_bytes()
    serve(200)
    assert _rss_bytes() - before < 8 * 2**20


def test_forced_tokens_are_computed_as_one_span_and_appended_once(runner, hf_model, prompts):
    """Tokens the engine forced (a grammar that allowed one token only) come with the next step: the
    worker appends them after its sampled token and computes them with it as one span, and samples what
    generate samples after them; the same entry again (a resend after a failed step) changes nothing;
    one that does not continue the request's tokens fails the step before anything changes."""
    prompt = prompts["text"]
    num_prompt, ref = len(prompt.input_ids), prompt.reference
    new = NewRequestData("f", prompt.input_ids, [], greedy(hf_model), blocks(prompt, runner))
    runner.execute(SchedulerOutput(0, [new], {"f": num_prompt}, [], [], []), [b""])
    forced = {"f": (num_prompt + 1, ref[1:4])}
    out = runner.execute(SchedulerOutput(1, [], {"f": 4}, [], [], [], forced_tokens=forced), [b""])
    assert out.sampled_token_ids == [ref[4]]
    out = runner.execute(SchedulerOutput(2, [], {"f": 1}, [], [], [], forced_tokens=forced), [b""])
    assert out.sampled_token_ids == [ref[5]]
    assert runner.requests["f"].token_ids[num_prompt:] == ref[:6]
    wrong = {"f": (num_prompt + 1, [ref[1], ref[1]])}
    with pytest.raises(StepError, match="forced tokens"):
        runner.execute(SchedulerOutput(3, [], {"f": 1}, [], [], [], forced_tokens=wrong), [b""])
    assert runner.requests["f"].token_ids[num_prompt:] == ref[:6]
