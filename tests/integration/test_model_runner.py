"""The worker against transformers' own ``generate`` on the tiny checkpoint.

The tests play the engine: ``FakeEngine`` schedules prefill chunks and decode tokens, sends items to
encode in the step their placeholder range is first needed, and finishes requests after max_tokens.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
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
    RunnerOutput,
    SamplingParams,
    SchedulerOutput,
    WorkerError,
    WorkerReady,
    WorkerShutdown,
    decode_worker_outbound,
    encode,
)
from workers.config import WorkerConfig
from workers.encoder_store import MissingEncoderOutput
from workers.frames import tensor_from_frame, tensor_to_frame
from workers.model_runner import ModelRunner
from workers.worker_main import run_worker

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 32
NEAR_TIE_LOGPROB_GAP = 1e-4
LOGPROB_ATOL = 2e-5  # observed: <= 2e-6 on CPU fp32


@dataclass(frozen=True)
class Prompt:
    input_ids: list[int]
    pixel_values: list[torch.Tensor]  # one [1, 3, 336, 336] per image, in prompt order
    features: list[MMFeature]
    reference: list[int]  # transformers' greedy continuation
    reference_logprobs: torch.Tensor  # [NUM_NEW_TOKENS, vocab]: log_softmax of generate's raw logits


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
    return ModelRunner(str(tiny_model_dir), device="cpu")  # the oracle runs fp32 on CPU


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


class FakeEngine:
    """Plays the scheduler. Each step every running request computes min(chunk_tokens, rest of its
    prompt) tokens, or 1 decode token; an item is sent to encode in the step its placeholder range is
    first needed unless an earlier step encoded it (and it was not freed); a request finishes once it
    has max_tokens outputs, which the next step tells the worker."""

    def __init__(self, runner: ModelRunner, chunk_tokens: int = 1 << 30):
        self.runner, self.chunk_tokens = runner, chunk_tokens
        self.step_id = 0
        self.new: list[NewRequestData] = []
        self.prompts: dict[str, Prompt] = {}
        self.sampling: dict[str, SamplingParams] = {}
        self.num_computed: dict[str, int] = {}
        self.outputs: dict[str, list[int]] = {}
        self.logprobs: dict[str, list] = {}
        self.encoded: set[str] = set()
        self.finished: list[str] = []  # told to the worker in the next step
        self.done: set[str] = set()
        self.to_free: list[str] = []
        self.history: list[tuple[dict[str, int], RunnerOutput]] = []

    def add(self, req_id: str, prompt: Prompt, sampling: SamplingParams) -> None:
        self.new.append(NewRequestData(req_id, prompt.input_ids, prompt.features, sampling))
        self.prompts[req_id], self.sampling[req_id] = prompt, sampling
        self.num_computed[req_id], self.outputs[req_id], self.logprobs[req_id] = 0, [], []

    def free(self, mm_hashes: list[str]) -> None:
        self.to_free += mm_hashes
        self.encoded -= set(mm_hashes)

    @property
    def running(self) -> list[str]:
        return [r for r in self.prompts if r not in self.done]

    def step(self) -> RunnerOutput:
        scheduled: dict[str, int] = {}
        encoder_inputs: list[EncoderInput] = []
        frames: list = [b""]
        for req_id in self.running:
            prompt, start = self.prompts[req_id], self.num_computed[req_id]
            rest = len(prompt.input_ids) - start
            num_tokens = min(self.chunk_tokens, rest) if rest > 0 else 1
            scheduled[req_id] = num_tokens
            for feat, pixels in zip(prompt.features, prompt.pixel_values, strict=True):
                if feat.mm_hash not in self.encoded and feat.offset < start + num_tokens:
                    ref, buf = tensor_to_frame(pixels, len(frames))
                    frames.append(buf)
                    encoder_inputs.append(EncoderInput(feat.mm_hash, "image", {"pixel_values": ref}))
                    self.encoded.add(feat.mm_hash)
        sched = SchedulerOutput(
            self.step_id, self.new, scheduled, encoder_inputs, self.to_free, self.finished
        )
        out = self.runner.execute(sched, frames)
        self.history.append((scheduled, out))
        self.step_id, self.new, self.to_free, self.finished = self.step_id + 1, [], [], []
        for req_id, num_tokens in scheduled.items():
            self.num_computed[req_id] += num_tokens
        for req_id, token_id, logprobs in zip(out.req_ids, out.sampled_token_ids, out.logprobs, strict=True):
            self.outputs[req_id].append(token_id)
            self.logprobs[req_id].append(logprobs)
            if len(self.outputs[req_id]) >= self.sampling[req_id].max_tokens:
                self.finished.append(req_id)
                self.done.add(req_id)
        return out

    def run(self) -> dict[str, list[int]]:
        while self.running:
            self.step()
        if self.finished or self.to_free:
            self.step()  # tell the worker, as the next real step would
        return self.outputs


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
    assert not runner.requests and all(r not in runner.kv_cache for r in ("text", "one", "two"))


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
    new = NewRequestData("r", prompt.input_ids, prompt.features, greedy(hf_model))
    sched = SchedulerOutput(0, [new], {"r": len(prompt.input_ids)}, [], [], [])
    with pytest.raises(MissingEncoderOutput):
        runner.execute(sched, [b""])
    assert runner.requests["r"].num_computed_tokens == 0 and runner.kv_cache.num_tokens("r") == 0


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
    runner = ModelRunner(str(tiny_model_dir))  # "auto"
    assert runner.device.type == "cuda" and runner.dtype == torch.bfloat16
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
    config = WorkerConfig(str(tiny_model_dir), addr, device="cpu")
    thread = threading.Thread(target=run_worker, args=(config,), daemon=True)
    thread.start()
    assert router.poll(60_000), "no WorkerReady"
    identity, payload = router.recv_multipart()
    try:
        assert decode_worker_outbound(payload) == WorkerReady(device="cpu", dtype="float32")

        prompt = prompts["one"]
        ref, buf = tensor_to_frame(prompt.pixel_values[0], frame=1)
        new = NewRequestData("r", prompt.input_ids, prompt.features, greedy(hf_model))
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
