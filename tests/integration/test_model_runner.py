"""The worker against transformers' own ``generate`` on the tiny checkpoint.

The tests play the engine with ``FakeEngine`` (tests/integration/fake_engine.py): it schedules prefill
chunks and decode tokens, hands out KV blocks, sends items to encode in the step their placeholder
range is first needed, preempts and resumes on request, and finishes requests after max_tokens.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from engine.protocol import (
    EncoderInput,
    MMFeature,
    NewRequestData,
    ResumedRequestData,
    RunnerOutput,
    SamplingParams,
    SchedulerOutput,
    WorkerError,
    WorkerReady,
    WorkerShutdown,
    decode_worker_outbound,
    encode,
)
from tests.integration.fake_engine import FakeEngine, Prompt
from workers.config import WorkerConfig
from workers.encoder_store import MissingEncoderOutput
from workers.frames import tensor_from_frame, tensor_to_frame
from workers.kv_pool import CPU_DEFAULT_KV_CACHE_TOKENS, KVPool, plan_num_kv_blocks
from workers.model_runner import ModelRunner, StepError
from workers.worker_main import run_worker

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 32
NEAR_TIE_LOGPROB_GAP = 1e-4
LOGPROB_ATOL = 2e-5  # observed: <= 2e-6 on CPU fp32
KV_CACHE_TOKENS = 8192  # room for the largest batch below (3 x "two": ~3,700 tokens) and then some


def _placements(input_ids: list[int], image_token_id: int, mm_hashes: list[str]) -> list[MMFeature]:
    """One MMFeature per run of image placeholder tokens."""
    runs, offset = [], 0
    for is_image, group in itertools.groupby(input_ids, key=lambda t: t == image_token_id):
        num_tokens = len(list(group))
        if is_image:
            runs.append((offset, num_tokens))
        offset += num_tokens
    return [MMFeature(h, offset, n) for h, (offset, n) in zip(mm_hashes, runs, strict=True)]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir) -> LlavaForConditionalGeneration:
    return LlavaForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tiny_model_dir, hf_model) -> dict[str, Prompt]:
    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    rng = np.random.default_rng(0)
    cat, dog = (
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((240, 320), (300, 200))
    )
    contents = {
        "one": ([cat], "What is in this picture?"),
        "two": ([cat, dog], "Compare the two pictures."),
        "text": ([], "Tell me a story about a red car in the city, please."),
    }
    out = {}
    for name, (images, text) in contents.items():
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        chat = processor.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
        )
        inputs = processor(text=chat, images=images or None, return_tensors="pt")
        with torch.no_grad():
            generated = hf_model.generate(
                **inputs,
                do_sample=False,
                max_new_tokens=NUM_NEW_TOKENS,
                min_new_tokens=NUM_NEW_TOKENS,
                output_logits=True,
                return_dict_in_generate=True,
            )
        logprobs = torch.log_softmax(torch.cat(generated.logits).float(), dim=-1)
        input_ids = inputs["input_ids"][0].tolist()
        pixels = [p.unsqueeze(0) for p in inputs["pixel_values"]] if images else []
        hashes = [hashlib.sha256(p.numpy().tobytes()).hexdigest() for p in pixels]
        features = _placements(input_ids, hf_model.config.image_token_id, hashes)
        reference = generated.sequences[0, len(input_ids) :].tolist()
        out[name] = Prompt(input_ids, pixels, features, reference, logprobs)
    return out


@pytest.fixture
def runner(tiny_model_dir) -> ModelRunner:
    # the oracle runs fp32 on CPU
    return ModelRunner(str(tiny_model_dir), device="cpu", kv_cache_tokens=KV_CACHE_TOKENS)


def greedy(hf_model: LlavaForConditionalGeneration, **kwargs) -> SamplingParams:
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


def _blocks(prompt: Prompt, runner: ModelRunner, num_extra_tokens: int = 8) -> list[int]:
    """A contiguous block table with room for the prompt and a few outputs (hand-made steps)."""
    return list(range(-(-(len(prompt.input_ids) + num_extra_tokens) // runner.block_size)))


def assert_matches_generate(engine: FakeEngine, req_id: str, prompt: Prompt) -> None:
    """Token-for-token equality with transformers, except a divergence at a true near-tie; up to there,
    returned logprobs (sampled and top) equal log_softmax of generate's logits."""
    tokens, ref = engine.outputs[req_id], prompt.reference
    assert len(tokens) == len(ref)
    num_equal = next((i for i, (a, b) in enumerate(zip(tokens, ref, strict=True)) if a != b), len(ref))
    for i, lp in enumerate(engine.logprobs[req_id][:num_equal]):
        if lp is None:
            continue
        expected = prompt.reference_logprobs[i]
        assert lp.sampled.logprob == pytest.approx(float(expected[tokens[i]]), abs=LOGPROB_ATOL), f"token {i}"
        for top in lp.top:
            assert top.logprob == pytest.approx(float(expected[top.token_id]), abs=LOGPROB_ATOL), f"token {i}"
    if num_equal < len(ref):
        i = num_equal  # generate's logits at step i saw the same prefix as ours
        gap = float(prompt.reference_logprobs[i, ref[i]] - prompt.reference_logprobs[i, tokens[i]])
        assert gap < NEAR_TIE_LOGPROB_GAP, (
            f"diverged at token {i}: {tokens[i]} vs {ref[i]}, logprob gap {gap:.3g}"
        )
        print(f"near-tie at token {i}: logprob gap {gap:.3g}")


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
    new = NewRequestData("r", prompt.input_ids, prompt.features, greedy(hf_model), _blocks(prompt, runner))
    sched = SchedulerOutput(0, [new], {"r": len(prompt.input_ids)}, [], [], [])
    with pytest.raises(MissingEncoderOutput):
        runner.execute(sched, [b""])
    assert runner.requests["r"].num_computed_tokens == 0


# ---------------------------------------------------------------- paged KV


def test_kv_pool_slots_and_sizing():
    cpu = torch.device("cpu")
    pool = KVPool(2, num_blocks=10, block_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=cpu)
    slots = pool.slot_ids([7, 2, 9], 10)
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


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefix_hit_reuses_another_requests_blocks(tiny_model_dir, runner, hf_model, prompts, block_size):
    """ "two" starts like "one" (chat header, the same cat image, one more token): its first blocks may
    be "one"'s. With 4-token blocks the cat lies entirely in the shared prefix (never encoded again);
    with 16-token blocks the prefix ends 4 tokens before the cat does (encoded whole, sliced)."""
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
    cat_skipped = num_shared_blocks * block_size >= cat.offset + cat.num_tokens
    assert cat_skipped == (block_size == 4)

    engine = FakeEngine(runner, chunk_tokens=256)
    engine.add("first", one, greedy(hf_model))
    while not engine.outputs["first"]:
        engine.step()
    engine.free([cat.mm_hash])  # "first" is past its image: only a re-encode could bring it back
    num_steps_before = len(engine.history)
    engine.add("second", two, greedy(hf_model), prefix=("first", num_shared_blocks))
    assert engine.tables["second"] == engine.tables["first"][:num_shared_blocks]
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
    ]
    for sched in bad_steps:
        with pytest.raises(StepError):
            runner.execute(sched, [b""])
    assert runner.requests["r"].num_computed_tokens == 0  # the first step registered it, computed nothing
    # A preempted request is not scheduled until it is resumed.
    ok = NewRequestData("ok", prompt.input_ids, [], greedy(hf_model), _blocks(prompt, runner))
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


# ---------------------------------------------------------------- frames and socket


def test_frames_roundtrip_without_copy():
    for tensor in (
        torch.randn(2, 3, 4),
        torch.arange(6, dtype=torch.int64),
        torch.ones(3, dtype=torch.bfloat16),
    ):
        ref, buf = tensor_to_frame(tensor, frame=1)
        back = tensor_from_frame(ref, [b"", bytes(buf)])
        assert back.dtype == tensor.dtype and torch.equal(back, tensor)
    source = bytearray(np.arange(4, dtype=np.float32).tobytes())
    ref, _ = tensor_to_frame(torch.zeros(2, 2), frame=1)
    view = tensor_from_frame(ref, [b"", source])
    source[0:4] = np.float32(7.0).tobytes()  # same memory: no copy was made
    assert view[0, 0].item() == 7.0


@pytest.fixture
def router(tmp_path):
    """The engine's side: a ROUTER bound on an ipc path; yields (socket, address)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)  # a dead worker fails the test instead of hanging it
    addr = f"ipc://{tmp_path}/worker.sock"
    sock.bind(addr)
    yield sock, addr
    sock.close(linger=0)
    ctx.term()


def test_worker_over_zmq(router, tiny_model_dir, hf_model, prompts):
    router, addr = router
    config = WorkerConfig(str(tiny_model_dir), addr, device="cpu", block_size=32, kv_cache_tokens=1000)
    thread = threading.Thread(target=run_worker, args=(config,), daemon=True)
    thread.start()
    assert router.poll(60_000), "no WorkerReady"
    identity, payload = router.recv_multipart()
    try:
        ready = WorkerReady(device="cpu", dtype="float32", num_kv_blocks=1000 // 32, block_size=32)
        assert decode_worker_outbound(payload) == ready

        prompt = prompts["one"]
        ref, buf = tensor_to_frame(prompt.pixel_values[0], frame=1)
        block_ids = list(range(ready.num_kv_blocks))[::-1][: -(-(len(prompt.input_ids) + 2) // 32)]
        new = NewRequestData("r", prompt.input_ids, prompt.features, greedy(hf_model), block_ids)
        sched = SchedulerOutput(
            0,
            [new],
            {"r": len(prompt.input_ids)},
            [EncoderInput(prompt.features[0].mm_hash, "image", {"pixel_values": ref})],
            [],
            [],
        )
        router.send_multipart([identity, encode(sched), buf])
        out = decode_worker_outbound(router.recv_multipart()[1])
        assert isinstance(out, RunnerOutput) and out.num_encoded_items == 1
        assert out.sampled_token_ids == prompt.reference[:1]

        router.send_multipart([identity, encode(SchedulerOutput(1, [], {"nope": 1}, [], [], []))])
        err = decode_worker_outbound(router.recv_multipart()[1])
        assert isinstance(err, WorkerError) and err.step_id == 1 and "nope" in err.message

        router.send_multipart([identity, encode(SchedulerOutput(2, [], {"r": 1}, [], [], []))])
        out = decode_worker_outbound(router.recv_multipart()[1])  # still serving after the error
        assert isinstance(out, RunnerOutput) and out.sampled_token_ids == prompt.reference[1:2]
    finally:
        router.send_multipart([identity, encode(WorkerShutdown())])
        thread.join(timeout=30)
    assert not thread.is_alive()


def test_worker_process_stops_on_sigterm(router, tiny_model_dir):
    router, addr = router
    code = (
        "from workers.config import WorkerConfig; from workers.worker_main import run_worker; "
        f"run_worker(WorkerConfig({str(tiny_model_dir)!r}, {addr!r}, device='cpu'))"
    )
    repo_root = Path(__file__).resolve().parents[2]
    env = os.environ | {"PYTHONPATH": str(repo_root)}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=repo_root, env=env)
    try:
        assert router.poll(120_000), "no WorkerReady"
        assert isinstance(decode_worker_outbound(router.recv_multipart()[1]), WorkerReady)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
