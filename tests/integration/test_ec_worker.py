"""The worker's encoder-cache connector on the tiny LLaVA and Qwen3-VL (deepstack levels) checkpoints,
for an image and (Qwen3-VL) a video, over a real shared-storage folder: a producer's saved value is
exactly its encoder output; a consumer that loads it samples what the producer sampled; a failed load
is encoded locally where the vision tower is loaded, and fails the step where it is not; an
encoder-only worker encodes like the full model.

Steps are built by hand, as the engine would send them for one request prefilled in one step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from wire.ec_store import ECConfig, ECRole
from wire.ec_store.shared_storage import SharedStorageStore
from wire.protocol import (
    ECConnectorMeta,
    EncoderInput,
    MMFeature,
    NewRequestData,
    RunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from workers.config import ModelParts
from workers.ec_codec import decode_output, encode_output
from workers.families import load_processing
from workers.families.processing import VideoMetadata
from workers.frames import tensor_to_frame
from workers.model_runner import EncoderOutputUnavailable, ModelRunner
from workers.runner_requests import StepError

pytestmark = pytest.mark.slow

KV_CACHE_TOKENS = 1024
MM_HASH = "9c" * 32
GREEDY = SamplingParams(max_tokens=1, temperature=0.0, num_top_logprobs=5)


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    feature: MMFeature
    tensors: dict[str, torch.Tensor]  # the processed image, as the API sends it


@pytest.fixture(
    scope="module",
    params=[("llava", "image"), ("qwen3_vl", "image"), ("qwen3_vl", "video")],
    ids=["llava", "qwen3_vl", "qwen3_vl-video"],
)
def case(request: pytest.FixtureRequest) -> tuple[str, str]:
    """(family, modality of the prompt's item)."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def model_dir(case: tuple[str, str], tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model(case[0])


@pytest.fixture(scope="module")
def prompt(model_dir: Path, case: tuple[str, str]) -> Prompt:
    """One image or video (8 frames: its frame groups between Qwen3-VL's timestamps) and a question,
    processed by the family's API half."""
    processing = load_processing(model_dir)
    modality = case[1]
    rng = np.random.default_rng(0)
    if modality == "video":
        frames = rng.integers(0, 256, (8, 96, 128, 3), dtype=np.uint8)
        item = processing.process_video(frames, VideoMetadata(fps=4.0, num_frames=8), list(range(8)), {})
    else:
        pixels = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
        item = processing.process_image(Image.fromarray(pixels), {}, param="image")
    text = processing.render_prompt(
        [{"role": "user", "content": [{"type": modality}, {"type": "text", "text": "What is this?"}]}]
    )
    token_ids, [(first, end)] = processing.tokenize(text, [item.layout])
    span = end - first if end - first != item.num_tokens else 0
    feature = MMFeature(
        MM_HASH, first, item.num_tokens, modality, grid_thw=item.grid_thw, num_span_tokens=span
    )
    return Prompt(token_ids, feature, item.tensors)


def runner(model_dir: Path, folder: Path, role: ECRole, parts: ModelParts = ModelParts.ALL) -> ModelRunner:
    ec = ECConfig("shared-storage", role, storage_path=str(folder))
    return ModelRunner(str(model_dir), device="cpu", kv_cache_tokens=KV_CACHE_TOKENS, parts=parts, ec=ec)


def encoder_input(prompt: Prompt) -> tuple[EncoderInput, list[object]]:
    frames: list[object] = [b""]
    refs = {}
    for name, tensor in prompt.tensors.items():
        refs[name], buf = tensor_to_frame(tensor, len(frames))
        frames.append(buf)
    return EncoderInput(MM_HASH, prompt.feature.modality, refs), frames


def prefill(r: ModelRunner, prompt: Prompt, *, encode: bool, load: bool, req_id: str = "r") -> RunnerOutput:
    """The request's first step: its whole prompt, its image sent to encode and/or to load."""
    enc, frames = encoder_input(prompt)
    num_blocks = -(-len(prompt.token_ids) // r.block_size)
    new = NewRequestData(req_id, prompt.token_ids, [prompt.feature], GREEDY, list(range(num_blocks)))
    sched = SchedulerOutput(
        step_id=0,
        new_requests=[new],
        num_scheduled_tokens={req_id: len(prompt.token_ids)},
        encoder_inputs=[enc] if encode else [],
        free_mm_hashes=[],
        finished_req_ids=[],
        ec_meta=ECConnectorMeta(load_mm_hashes=[MM_HASH]) if load else None,
    )
    return r.execute(sched, frames)


def encode_only(r: ModelRunner, prompt: Prompt) -> RunnerOutput:
    enc, frames = encoder_input(prompt)
    return r.execute(SchedulerOutput(0, [], {}, [enc], [], []), frames)


@pytest.fixture(scope="module")
def produced(model_dir: Path, prompt: Prompt, tmp_path_factory: pytest.TempPathFactory):
    """A full producer's prefill: its output, its encoder output, and the folder it saved to."""
    folder = tmp_path_factory.mktemp("store")
    producer = runner(model_dir, folder, ECRole.PRODUCER)
    output = prefill(producer, prompt, encode=True, load=False)
    return output, producer.encoder_store.get(MM_HASH), folder


@pytest.fixture
def store(produced, tmp_path: Path) -> SharedStorageStore:
    """A fresh folder holding the producer's value (tests may damage it)."""
    store = SharedStorageStore(tmp_path / "ec", max_bytes=0)
    store.put(MM_HASH, SharedStorageStore(produced[2], max_bytes=0).get(MM_HASH))
    return store


def test_the_producer_saves_exactly_its_encoder_output(produced, prompt: Prompt, model_dir: Path) -> None:
    output, encoded, folder = produced
    value = SharedStorageStore(folder, max_bytes=0).get(MM_HASH)
    assert value is not None
    tail = runner(model_dir, folder, ECRole.PRODUCER, ModelParts.ENCODER).model.encoder_output_tail
    assert tuple(encoded.shape) == (prompt.feature.num_tokens, *tail)
    assert torch.equal(decode_output(MM_HASH, value, prompt.feature.num_tokens, tail), encoded)
    assert output.num_encoded_items == 1 and output.ec_stats is not None
    stats = output.ec_stats
    assert (stats.num_saves, stats.save_bytes, stats.num_loads, stats.num_load_failures) == (
        1,
        len(value),
        0,
        0,
    )


def test_a_language_model_only_consumer_samples_what_the_producer_sampled(
    produced, prompt: Prompt, model_dir: Path, store: SharedStorageStore
) -> None:
    consumer = runner(model_dir, store.folder, ECRole.CONSUMER, ModelParts.LANGUAGE_MODEL)
    output = prefill(consumer, prompt, encode=False, load=True)
    reference = produced[0]
    assert output.req_ids == ["r"] and output.sampled_token_ids == reference.sampled_token_ids
    assert output.logprobs == reference.logprobs  # the same logits, bit for bit
    assert output.num_encoded_items == 0
    assert torch.equal(consumer.encoder_store.get(MM_HASH), produced[1])
    stats = output.ec_stats
    assert stats is not None and (stats.num_loads, stats.num_load_failures, stats.num_saves) == (1, 0, 0)
    assert stats.load_bytes == len(store.get(MM_HASH) or b"") and len(stats.load_seconds) == 1


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
@pytest.mark.parametrize("role", [ECRole.CONSUMER, ECRole.BOTH])
def test_a_failed_load_is_encoded_locally_where_the_vision_tower_is(
    produced, prompt: Prompt, model_dir: Path, store: SharedStorageStore, damage: str, role: ECRole
) -> None:
    if damage == "missing":
        store.path(MM_HASH).unlink()
    else:
        value = bytearray(store.get(MM_HASH) or b"")
        value[-3] ^= 0xFF  # in the tensor bytes: the digest no longer matches
        store.put(MM_HASH, bytes(value))
    damaged = store.get(MM_HASH)
    consumer = runner(model_dir, store.folder, role)
    output = prefill(consumer, prompt, encode=True, load=True)
    assert output.sampled_token_ids == produced[0].sampled_token_ids
    assert output.logprobs == produced[0].logprobs
    assert output.num_encoded_items == 1 and torch.equal(consumer.encoder_store.get(MM_HASH), produced[1])
    stats = output.ec_stats
    assert stats is not None and (stats.num_loads, stats.num_load_failures, stats.num_fallback_encodes) == (
        0,
        1,
        1,
    )
    # only a role that saves repairs the store
    assert stats.num_saves == (1 if role.saves else 0)
    if role.saves:
        repaired = store.get(MM_HASH)
        assert repaired is not None
        tail = consumer.model.encoder_output_tail
        assert torch.equal(decode_output(MM_HASH, repaired, prompt.feature.num_tokens, tail), produced[1])
    else:
        assert store.get(MM_HASH) == damaged


def test_a_loaded_item_is_not_encoded_again(
    prompt: Prompt, model_dir: Path, store: SharedStorageStore
) -> None:
    consumer = runner(model_dir, store.folder, ECRole.BOTH)
    output = prefill(consumer, prompt, encode=True, load=True)  # the tensors came along as a fallback
    assert output.num_encoded_items == 0
    stats = output.ec_stats
    assert stats is not None and (stats.num_loads, stats.num_fallback_encodes, stats.num_saves) == (1, 0, 0)


def test_a_failed_load_without_the_vision_tower_fails_the_step(
    prompt: Prompt, model_dir: Path, store: SharedStorageStore
) -> None:
    store.path(MM_HASH).unlink()
    consumer = runner(model_dir, store.folder, ECRole.CONSUMER, ModelParts.LANGUAGE_MODEL)
    with pytest.raises(EncoderOutputUnavailable) as info:
        prefill(consumer, prompt, encode=False, load=True)
    assert info.value.mm_hashes == [MM_HASH]
    assert consumer.requests["r"].num_computed_tokens == 0 and MM_HASH not in consumer.encoder_store
    with pytest.raises(StepError, match="without a vision tower"):  # nor can it be sent to encode
        prefill(consumer, prompt, encode=True, load=False, req_id="r2")


def test_a_value_of_another_model_shape_is_refused_and_encoded_locally(
    produced, prompt: Prompt, model_dir: Path, store: SharedStorageStore
) -> None:
    truncated = produced[1][:-1].clone()  # one embedding short of the placement
    store.put(MM_HASH, encode_output(MM_HASH, truncated))
    consumer = runner(model_dir, store.folder, ECRole.CONSUMER)
    output = prefill(consumer, prompt, encode=True, load=True)
    assert output.sampled_token_ids == produced[0].sampled_token_ids
    assert output.ec_stats is not None and output.ec_stats.num_load_failures == 1


def test_an_encoder_only_worker_encodes_exactly_like_the_full_model(
    produced, prompt: Prompt, model_dir: Path, tmp_path: Path
) -> None:
    encoder = runner(model_dir, tmp_path / "ec", ECRole.PRODUCER, ModelParts.ENCODER)
    assert encoder.num_kv_blocks == 0 and encoder.lm_forward is None
    output = encode_only(encoder, prompt)
    assert output.num_encoded_items == 1 and output.req_ids == []
    assert torch.equal(encoder.encoder_store.get(MM_HASH), produced[1])
    value = SharedStorageStore(tmp_path / "ec", max_bytes=0).get(MM_HASH)
    assert value is not None
    tail = encoder.model.encoder_output_tail
    assert torch.equal(decode_output(MM_HASH, value, prompt.feature.num_tokens, tail), produced[1])


def test_an_encoder_only_worker_refuses_a_request_to_prefill(
    prompt: Prompt, model_dir: Path, tmp_path: Path
) -> None:
    encoder = runner(model_dir, tmp_path / "ec", ECRole.PRODUCER, ModelParts.ENCODER)
    with pytest.raises(StepError):
        prefill(encoder, prompt, encode=True, load=False)
