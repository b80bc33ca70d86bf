"""The CUDA tier: every family's tiny checkpoint served by ``mmserve serve --device cuda`` (the worker in
bf16, encoder outputs and the paged KV pool in GPU memory), against transformers' bf16 ``generate`` on
the same GPU, by the near-tie rule of every tier (tests/near_tie.py; the bf16 bound is in conftest.py):

- images, cold and again from every cache (processor, IPC, encoder and prefix caches hit);
- a prompt's logprobs (vLLM's ``prompt_logprobs``) with an image: transformers' bf16 forward over it,
  each within twice the near-tie bound (a token's logprob from a neighbouring position is off by nats);
- the sampler's device paths for named ids' logprobs (``logprob_token_ids``) and ``bad_words``;
- every cache off, in 128-token prefill steps that cut through the images;
- the shm store, with a KV pool so small that concurrent requests are preempted and resumed;
- videos (the Qwen families), cold, warm, chunked and uncached;
- the worker SIGKILLed mid-stream: the stream ends with an error, the worker restarts on the GPU and
  answers as before.

tests/gpu/conftest.py says how the GPU kit's dry run runs these on the CPU.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import PIL.Image
import pytest
import torch

from tests.e2e.conftest import Oracle, greedy_body, make_image, user_message
from tests.e2e.metrics import delta
from tests.e2e.parity import NUM_TOKENS, assert_matches_greedy, taken_together
from tests.e2e.server import Server, role_pid, seconds_until_health, stream_chunks
from tests.e2e.test_bad_words import banned_greedy, sequences
from tests.e2e.video_oracle import Case, Expected, body, expected_answers
from tests.gpu.conftest import Tier, cuda_missing, tier
from tests.near_tie import accept_near_tie, first_divergence
from tests.video_clips import make_clip

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(cuda_missing(), reason="needs a CUDA device"),
]

Servers = dict[tuple[str, str], Server]
QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
IMAGE_CASES = {
    "one": ("Describe the picture.", (make_image(901),)),
    "two": ("Compare the two pictures.", (make_image(902, (448, 336)), make_image(903))),
}
# ~600 prompt tokens each in every family (LLaVA's 576 per image; 768x640 px is ~480-620 for Qwen)
PREEMPT_CASES = [(f"Preempt me {i}.", (make_image(910 + i, (768, 640)),)) for i in range(4)]
CLIP = make_clip(width=160, height=120, fps=10, num_frames=40, seed=1)
VIDEO_CASES = {
    "clip": Case("What happens in the clip?", (CLIP,), {"fps": 2}),
    "clip_and_image": Case("Is the picture in the clip?", (make_image(904, (224, 224)), CLIP), {"fps": 1}),
}


def ask(server: Server, payload: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=payload, timeout=300)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def image_body(family: str, text: str, images: tuple[PIL.Image.Image, ...]) -> dict[str, Any]:
    return greedy_body(
        [user_message(text, *images)], NUM_TOKENS, model=f"tiny-{family}", logprobs=True, top_logprobs=2
    )


def check(response: dict[str, Any], oracle: Oracle, want: tuple[list[int], Any], tier: Tier) -> None:
    assert_matches_greedy(
        response, oracle.processor.tokenizer, want[0], want[1], tier.near_tie, tier.quantized
    )


FAMILIES = tier().families
QWEN_FAMILIES = [f for f in FAMILIES if f in QWEN]


@pytest.mark.parametrize("family", FAMILIES)
def test_images_cold_warm_and_uncached_in_128_token_steps(
    family: str, gpu_tier: Tier, tier_servers: Servers, tier_oracle: Callable[[str], Oracle]
) -> None:
    oracle = tier_oracle(family)
    cached, uncached = tier_servers[family, "cached"], tier_servers[family, "uncached_chunked"]
    for text, images in IMAGE_CASES.values():
        want = oracle.greedy(text, list(images), NUM_TOKENS)
        cold = ask(cached, image_body(family, text, images))
        check(cold, oracle, want, gpu_tier)
        before = cached.metrics()
        warm = ask(cached, image_body(family, text, images))
        after = cached.metrics()
        check(warm, oracle, want, gpu_tier)
        assert delta(before, after, "mmserve_encoder_runs_total") == 0, family
        assert delta(before, after, "mmserve_mm_processor_cache_hits_total") == len(images)
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        check(ask(uncached, image_body(family, text, images)), oracle, want, gpu_tier)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logprobs_with_an_image(
    family: str, gpu_tier: Tier, tier_servers: Servers, tier_oracle: Callable[[str], Oracle]
) -> None:
    oracle, server = tier_oracle(family), tier_servers[family, "cached"]
    text, images = IMAGE_CASES["two"]
    served = ask(server, {**image_body(family, text, images), "max_tokens": 1, "prompt_logprobs": 1})
    inputs = oracle.inputs(text, list(images))
    ids = inputs["input_ids"][0].tolist()
    device_inputs = {k: v.to(oracle.model.device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    with torch.inference_mode():
        expected = torch.log_softmax(oracle.model(**device_inputs).logits[0].float(), dim=-1).cpu()
    positions = served["prompt_logprobs"]
    assert len(positions) == len(ids) and positions[0] is None, family
    gaps = [
        abs(positions[t][str(ids[t])]["logprob"] - float(expected[t - 1, ids[t]])) for t in range(1, len(ids))
    ]
    assert max(gaps) <= 2 * gpu_tier.near_tie, (family, max(gaps), gaps.index(max(gaps)) + 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_named_logprobs_and_bad_words_on_the_device(
    family: str, gpu_tier: Tier, tier_servers: Servers, tier_oracle: Callable[[str], Oracle]
) -> None:
    """The sampler's gather of named ids' logprobs and its masked fill of banned words, on the device:
    the named ids' logprobs at the first step are transformers', and a word of the greedy answer, banned,
    gives transformers' answer under its ``bad_words_ids``."""
    oracle, server = tier_oracle(family), tier_servers[family, "cached"]
    tokenizer = oracle.processor.tokenizer
    text, images = IMAGE_CASES["one"]
    hf_ids, hf_logprobs = oracle.greedy(text, list(images), NUM_TOKENS)
    named = list(dict.fromkeys([hf_ids[0], 3, len(tokenizer) - 1]))
    body = image_body(family, text, images) | {"logprob_token_ids": named, "return_token_ids": True}
    first = ask(server, body)["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    gaps = [abs(alt["logprob"] - float(hf_logprobs[0, t])) for alt, t in zip(first, named, strict=True)]
    assert max(gaps) <= 2 * gpu_tier.near_tie, (family, gaps)
    word = next(
        w
        for w in (tokenizer.decode([t]).strip() for t in hf_ids)
        if w.isalpha() and len(sequences(tokenizer, [w])[0]) == 1
    )
    banned = sequences(tokenizer, [word])
    served = ask(server, image_body(family, text, images) | {"bad_words": [word], "return_token_ids": True})
    ids = served["choices"][0]["token_ids"]
    assert not {seq[0] for seq in banned} & set(ids), (family, word)
    want = banned_greedy(oracle, oracle.inputs(text, list(images)), banned, NUM_TOKENS)
    pos = first_divergence(ids, want[0])
    if pos is not None:
        accept_near_tie(pos, ids[pos], want[0][pos], want[1][pos], gpu_tier.near_tie, int, gpu_tier.quantized)


@pytest.mark.parametrize("family", FAMILIES)
def test_shm_store_and_preemption(
    family: str, gpu_tier: Tier, tier_servers: Servers, tier_oracle: Callable[[str], Oracle]
) -> None:
    oracle, server = tier_oracle(family), tier_servers[family, "shm_small_pool"]
    before = server.metrics()
    responses = taken_together(server, [image_body(family, t, i) for t, i in PREEMPT_CASES])
    after = server.metrics()
    assert delta(before, after, "mmserve_num_preemptions_total") > 0, family
    assert delta(before, after, "mmserve_mm_shm_bytes_total") > 0, family
    for response, (text, images) in zip(responses, PREEMPT_CASES, strict=True):
        check(response, oracle, oracle.greedy(text, list(images), NUM_TOKENS), gpu_tier)


@pytest.fixture(scope="module")
def video_expected(
    gpu_tier: Tier, tiny_model: Callable[[str], Path], tier_oracle: Callable[[str], Oracle]
) -> dict[tuple[str, str], Expected]:
    cases = {(f, name): (f, case) for f in QWEN_FAMILIES for name, case in VIDEO_CASES.items()}
    return expected_answers(cases, tiny_model, tier_oracle) if cases else {}


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_videos_cold_warm_and_uncached_in_128_token_steps(
    family: str,
    gpu_tier: Tier,
    tier_servers: Servers,
    tier_oracle: Callable[[str], Oracle],
    video_expected: dict[tuple[str, str], Expected],
) -> None:
    for name in VIDEO_CASES:
        want = video_expected[family, name]
        tokenizer, case = tier_oracle(family).processor.tokenizer, VIDEO_CASES[name]
        cached = tier_servers[family, "cached"]
        for server in (cached, cached, tier_servers[family, "uncached_chunked"]):
            answer = ask(server, body(case, family))
            assert_matches_greedy(
                answer, tokenizer, want.ids, want.logprobs, gpu_tier.near_tie, gpu_tier.quantized
            )
            assert answer["usage"]["prompt_tokens"] == want.num_prompt_tokens


def test_worker_sigkill_then_recovery_on_the_gpu(
    gpu_tier: Tier, tier_servers: Servers, tier_oracle: Callable[[str], Oracle]
) -> None:
    """Last in the module: it restarts one server's worker (its caches start empty again)."""
    family = FAMILIES[0]
    server, oracle = tier_servers[family, "cached"], tier_oracle(family)
    assert server.process.proc is not None
    text, images = IMAGE_CASES["one"]
    want = oracle.greedy(text, list(images), NUM_TOKENS)
    long_body = {**image_body(family, "Go on and on.", images), "max_tokens": 1500, "stream": True}
    worker = role_pid(server.process.proc.pid, "worker")
    chunks: list[dict[str, Any]] = []

    def kill_on_first_token(chunk: dict[str, Any]) -> None:
        chunks.append(chunk)
        if len(chunks) == 2:
            os.kill(worker, signal.SIGKILL)

    events = stream_chunks(server, long_body, timeout_s=120, on_chunk=kill_on_first_token)
    codes = ("worker_unavailable", "engine_unavailable")
    assert "error" in events[-1] and events[-1]["error"]["code"] in codes, events[-1]
    seconds_until_health(server.base_url, 200, timeout_s=180)
    assert role_pid(server.process.proc.pid, "worker") != worker
    check(ask(server, image_body(family, text, images)), oracle, want, gpu_tier)
