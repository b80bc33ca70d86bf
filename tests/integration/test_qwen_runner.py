"""The worker on the tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL checkpoints against transformers' ``generate``:
M-RoPE positions equal ``get_rope_index``; greedy parity for one image, two images of different sizes and
text only; chunk boundaries inside images (deepstack levels sliced with them); mixed batches; preemption
and exact resumption. ``FakeEngine`` plays the engine (tests/integration/fake_engine.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.integration.fake_engine import FakeEngine, Prompt
from tests.integration.runner_support import (
    assert_backends_agree,
    assert_matches_generate,
    greedy,
    reference_prompt,
    run_staggered,
)
from workers.attention import ATTENTION_BACKENDS, shared_prefix
from workers.families import family_for, load_processing
from workers.model_runner import ModelRunner

pytestmark = pytest.mark.slow

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
KV_CACHE_TOKENS = 8192


def image(seed: int, width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    low = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
    return Image.fromarray(low).resize((width, height), Image.Resampling.BILINEAR)


CONTENTS = {
    "one": ([image(0, 224, 224)], "What is in this picture?"),
    "two": ([image(1, 224, 224), image(2, 1024, 768)], "Compare the two pictures."),
    "text": ([], "Tell me a story about a red car in the city, please."),
}


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request: pytest.FixtureRequest, tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def hf_model(family_dir: Path) -> Any:
    return family_for(family_dir).model.hf_class.from_pretrained(family_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(family_dir: Path) -> Any:
    return load_processing(family_dir).hf_processor


@pytest.fixture(scope="module")
def inputs(processor: Any) -> dict[str, Any]:
    out = {}
    for name, (images, text) in CONTENTS.items():
        parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        chat = processor.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
        )
        out[name] = processor(text=[chat], images=images or None, return_tensors="pt")
    return out


@pytest.fixture(scope="module")
def prompts(hf_model: Any, inputs: dict[str, Any]) -> dict[str, Prompt]:
    out = {}
    for name, batch in inputs.items():
        items, grids = [], []
        if "image_grid_thw" in batch:
            grid_thw = batch["image_grid_thw"]
            sizes = grid_thw.prod(-1).tolist()
            for pixels, grid in zip(batch["pixel_values"].split(sizes), grid_thw, strict=True):
                items.append({"pixel_values": pixels.contiguous(), "image_grid_thw": grid.reshape(1, 3)})
                grids.append(tuple(int(x) for x in grid))
        out[name] = reference_prompt(hf_model, batch, items, grids)
    return out


@pytest.fixture(params=ATTENTION_BACKENDS)
def runner(family_dir: Path, request: pytest.FixtureRequest) -> ModelRunner:
    """One per attention backend: every parity test runs on each."""
    return ModelRunner(
        str(family_dir), device="cpu", kv_cache_tokens=KV_CACHE_TOKENS, attention=request.param
    )


@pytest.mark.parametrize("name", ["one", "two", "text"])
def test_positions_equal_get_rope_index(runner, hf_model, inputs, prompts, name):
    batch, prompt = inputs[name], prompts[name]
    positions = runner.model.prompt_positions(prompt.input_ids, prompt.features)
    expected, deltas = hf_model.model.get_rope_index(
        batch["input_ids"], batch["mm_token_type_ids"], batch.get("image_grid_thw")
    )
    assert torch.equal(positions.between(0, len(prompt.input_ids)), expected[:, 0])
    assert positions.delta == int(deltas[0])
    # generated tokens continue at index + delta on every row
    n = len(prompt.input_ids)
    assert positions.between(n, n + 2).tolist() == [[n + positions.delta, n + 1 + positions.delta]] * 3
    # a decode's one position, without a tensor: the same columns, in the prompt and after it
    for index in (0, n // 2, n - 1, n, n + 5):
        assert [positions.at(index)] == positions.between(index, index + 1).T.tolist()


@pytest.mark.parametrize("name", ["one", "two", "text"])
def test_greedy_matches_generate(runner, hf_model, prompts, name):
    engine = FakeEngine(runner)
    engine.add("r", prompts[name], greedy(hf_model))
    engine.run()
    assert_matches_generate(engine, "r", prompts[name])
    # images of different sizes are encoded together, in one step
    assert engine.history[0][1].num_encoded_items == len(prompts[name].features)


def test_two_images_have_different_sizes(prompts):
    sizes = [f.num_tokens for f in prompts["two"].features]
    assert len(set(sizes)) == 2 and min(sizes) < 100 < 500 < max(sizes)


@pytest.mark.parametrize("chunk_tokens", [37, 256])
def test_chunks_cut_through_images(runner, hf_model, prompts, chunk_tokens):
    prompt = prompts["two"]
    engine = FakeEngine(runner, chunk_tokens=chunk_tokens)
    engine.add("r", prompt, greedy(hf_model))
    engine.run()
    assert_matches_generate(engine, "r", prompt)
    assert any(
        f.offset // chunk_tokens != (f.offset + f.num_tokens - 1) // chunk_tokens for f in prompt.features
    )


def test_encoder_output_keeps_its_levels_together(runner, hf_model, prompts):
    engine = FakeEngine(runner, chunk_tokens=40)
    engine.add("r", prompts["one"], greedy(hf_model, max_tokens=2, min_tokens=2))
    while not engine.history or not engine.history[-1][1].num_encoded_items:
        engine.step()
    feature = prompts["one"].features[0]
    output = runner.encoder_store.get(feature.mm_hash)
    deepstack = getattr(hf_model.config.vision_config, "deepstack_visual_indexes", None)
    hidden = hf_model.config.text_config.hidden_size
    if deepstack:
        assert output.shape == (feature.num_tokens, 1 + len(deepstack), hidden)
    else:
        assert output.shape == (feature.num_tokens, hidden)


def test_batched_mixed_prefill_and_decode(runner, hf_model, prompts):
    run_staggered(runner, hf_model, prompts)


def test_preempted_request_resumes_exactly(runner, hf_model, prompts):
    """Preempted after 10 outputs, its blocks overwritten, resumed with a new table: the recomputed
    prompt and outputs keep their M-RoPE positions, and decoding continues as generate does."""
    engine = FakeEngine(runner, chunk_tokens=64)
    engine.add("r", prompts["two"], greedy(hf_model))
    while len(engine.outputs["r"]) < 10:
        engine.step()
    old_blocks = engine.preempt("r")
    engine.add("intruder", prompts["one"], greedy(hf_model, max_tokens=4, min_tokens=4))
    engine.step()
    assert set(engine.tables["intruder"]) & set(old_blocks)
    engine.step()
    engine.resume("r")
    engine.run()
    assert_matches_generate(engine, "r", prompts["two"])


def test_backends_give_the_same_logits_on_mixed_steps(family_dir, hf_model, prompts, monkeypatch):
    # the tiny Qwen prompts share ~7 full blocks, under the serving threshold: group them anyway, so that
    # shared-prefix attention runs under M-RoPE and deepstack too
    monkeypatch.setattr(shared_prefix, "MIN_SHARED_KEYS", 16)
    assert_backends_agree(str(family_dir), KV_CACHE_TOKENS, hf_model, prompts)
