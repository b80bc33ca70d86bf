"""The product's Qwen video processing (workers/families/qwen_vl/video_processing.py, torch only) equals
transformers' own (torchvision-based) processors exactly, on the tiny checkpoints of the three families:
sampled indices, pixel_values_videos / video_grid_thw, Qwen3-VL's timestamps and Qwen2.5-VL's
second_per_grid_ts. HF runs in the reference environment's subprocess (tests/reference), once for the
whole module: every request is built first, answered in one batch, and compared per test."""

from __future__ import annotations

import functools
import io
import json
import shutil
import sys
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import jinja2
import numpy as np
import pytest
import torch
from transformers import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)

from tests.reference.client import (
    answer,
    model_inputs_request,
    run_reference,
    sample_request,
    video_request,
)
from workers.families.qwen_vl.hf_processor import ImageOnlyQwenVLProcessor
from workers.families.qwen_vl.video_processing import (
    VideoKind,
    check_video_kwargs,
    frame_timestamps,
    load_video_config,
    process_frames,
    sample_indices,
    second_per_grid_t,
)

pytestmark = pytest.mark.slow

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
MODELS = {
    "qwen2_vl": Qwen2VLForConditionalGeneration,
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    "qwen3_vl": Qwen3VLForConditionalGeneration,
}
# (total_num_frames, video fps) x (fps, num_frames): fewer frames than asked, odd counts that round,
# min_frames (4) and max_frames (768) clamps, an unknown frame rate, neither option.
VIDEOS = [(1, 30.0), (3, 30.0), (7, 25.0), (10, 29.97), (50, 10.0), (100, 24.0), (301, 30.0), (20000, 10.0)]
SAMPLINGS = [(fps, None) for fps in (0.5, 1, 2, 3)] + [(None, n) for n in (1, 3, 4, 5, 7, 8, 9, 16)]
SAMPLE_CASES = [(total, vfps, fps, n) for total, vfps in VIDEOS for fps, n in SAMPLINGS]
SAMPLE_CASES += [(50, None, 2, None), (50, None, None, 8), (50, 10.0, None, None), (50, 10.0, 2, 8)]


def clip(num_frames: int, height: int, width: int, seed: int) -> np.ndarray:
    """Noise over a gradient with a moving square: sharp edges and smooth ramps for the resampler."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, width, dtype=np.float32)[None, :] * np.linspace(0.3, 1, height)[:, None]
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    for t in range(num_frames):
        frame = ramp[..., None] + rng.normal(0, 40, (height, width, 3))
        side = max(2, min(height, width) // 4)
        y, x = t % max(height - side, 1), (3 * t) % max(width - side, 1)
        frame[y : y + side, x : x + side] = (250, 10, 120)
        frames[t] = np.clip(frame, 0, 255).astype(np.uint8)
    return frames


def decoded_clip(num_frames: int, height: int, width: int) -> np.ndarray:
    """Frames of a real MPEG-4 encode of ``clip``, decoded back to RGB with PyAV."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=30)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for t, pixels in enumerate(clip(num_frames, height, width, seed=7)):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts, frame.time_base = t, Fraction(1, 30)
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    with av.open(io.BytesIO(buf.getvalue())) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def metadata(num_frames: int, stride: int, fps: float) -> dict[str, Any]:
    return {
        "total_num_frames": num_frames * stride,
        "fps": fps,
        "frames_indices": list(range(0, num_frames * stride, stride)),
    }


@functools.cache
def video_cases() -> dict[str, tuple[np.ndarray, dict[str, Any], dict[VideoKind, dict[str, Any]]]]:
    """name -> (sampled frames, their video's metadata, processor kwargs per kind)."""
    both = {VideoKind.QWEN2_VL: {}, VideoKind.QWEN3_VL: {}}
    return {
        "odd 97x131, 5 frames (temporal padding)": (clip(5, 97, 131, 0), metadata(5, 10, 30.0), both),
        "portrait 360x202, 4 frames": (clip(4, 360, 202, 1), metadata(4, 7, 29.97), both),
        "tiny 20x30, 3 frames (scaled up)": (clip(3, 20, 30, 2), metadata(3, 3, 24.0), both),
        "480x640, 8 frames (max_pixels downscale)": (clip(8, 480, 640, 3), metadata(8, 15, 30.0), both),
        "224x448, 2 frames (no resize)": (clip(2, 224, 448, 4), metadata(2, 5, 10.0), both),
        "one frame": (clip(1, 64, 80, 5), metadata(1, 1, 7.5), both),
        "decoded mpeg4 120x160, 7 frames": (decoded_clip(7, 120, 160), metadata(7, 4, 30.0), both),
        "16 frames, cap_pixels_per_frame": (
            clip(16, 240, 320, 6),
            metadata(16, 2, 25.0),
            {
                VideoKind.QWEN2_VL: {"cap_pixels_per_frame": True},
                VideoKind.QWEN3_VL: {"cap_pixels_per_frame": True},
            },
        ),
        "request pixel bounds": (
            clip(6, 300, 400, 8),
            metadata(6, 5, 30.0),
            {
                VideoKind.QWEN2_VL: {"min_pixels": 3136, "max_pixels": 50000},
                VideoKind.QWEN3_VL: {"size": {"shortest_edge": 4096, "longest_edge": 300000}},
            },
        ),
    }


@pytest.fixture(scope="module")
def model_dirs(
    tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The tiny checkpoints, plus copies laid out as other checkpoints are: Qwen2.5-VL without
    video_preprocessor_config.json (HF falls back to the image processor's config and pixel bounds),
    Qwen2-VL whose config turns cap_pixels_per_frame on with a budget small enough to bite, and Qwen3-VL
    with its video processor nested in processor_config.json (also with a biting per-frame cap)."""
    dirs = {family: tiny_model(family) for family in FAMILIES}
    layouts = tmp_path_factory.mktemp("layouts")

    def copy(family: str, name: str) -> tuple[Path, dict[str, Any]]:
        folder = layouts / name
        shutil.copytree(dirs[family], folder)
        dirs[name] = folder
        return folder, json.loads((folder / "video_preprocessor_config.json").read_text())

    legacy, _ = copy("qwen2_5_vl", "qwen2_5_vl-no-video-config")
    (legacy / "video_preprocessor_config.json").unlink()
    capped, video = copy("qwen2_vl", "qwen2_vl-capped")
    video.update(cap_pixels_per_frame=True, max_video_tokens=64)
    (capped / "video_preprocessor_config.json").write_text(json.dumps(video))
    nested, video = copy("qwen3_vl", "qwen3_vl-nested")
    video.update(size={"shortest_edge": 4096, "longest_edge": 500000}, max_video_tokens=16)
    processor_config = {"processor_class": "Qwen3VLProcessor", "video_processor": video}
    (nested / "processor_config.json").write_text(json.dumps(processor_config))
    return dirs


def chat_video() -> tuple[list[dict[str, Any]], np.ndarray, np.ndarray, dict[str, Any]]:
    frames = clip(6, 90, 120, seed=11)
    image = clip(1, 64, 96, seed=12)[0]
    parts = [{"type": "video"}, {"type": "image"}, {"type": "text", "text": "What happens in the video?"}]
    return [{"role": "user", "content": parts}], frames, image, metadata(6, 5, 30.0)


@pytest.fixture(scope="module")
def reference(model_dirs: dict[str, Path]) -> dict[str, Any]:
    """Every HF answer the module compares with, from one subprocess."""
    keys, requests = [], []
    for family in FAMILIES:
        for case in SAMPLE_CASES:
            keys.append(("sample", family, case))
            requests.append(
                sample_request(model_dirs[family], case[0], case[1], fps=case[2], num_frames=case[3])
            )
    for name, dir_ in model_dirs.items():
        kind = load_video_config(dir_).kind
        for case, (frames, meta, kwargs) in video_cases().items():
            keys.append(("video", name, case))
            requests.append(video_request(dir_, frames, meta, **kwargs[kind]))
    for family in FAMILIES:
        messages, frames, image, meta = chat_video()
        keys.append(("model_inputs", family, None))
        requests.append(model_inputs_request(model_dirs[family], messages, [image], [(frames, meta)]))
    start = time.perf_counter()
    results = run_reference(requests)
    print(f"\nHF reference: {len(requests)} requests in {time.perf_counter() - start:.1f} s (one subprocess)")
    return {key: answer(result) for key, result in zip(keys, results, strict=True)}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


def ours_or_error(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except ValueError as exc:
        return f"ValueError: {exc}"


def test_sample_indices(family: str, model_dirs: dict[str, Path], reference: dict[str, Any]) -> None:
    config = load_video_config(model_dirs[family])
    mismatches, errors = [], 0
    for case in SAMPLE_CASES:
        total, video_fps, fps, num_frames = case
        hf = reference[("sample", family, case)]
        ours = ours_or_error(
            lambda: sample_indices(family, total, video_fps, fps=fps, num_frames=num_frames, config=config)  # noqa: B023
        )
        if isinstance(hf, str) or isinstance(ours, str):
            errors += 1
            if not (isinstance(hf, str) and isinstance(ours, str) and ours.startswith("ValueError")):
                mismatches.append((case, hf, ours))
        elif hf["indices"] != ours:
            mismatches.append((case, hf["indices"], ours))
    print(f"{family}: {len(SAMPLE_CASES)} sampling cases, {errors} refused by both")
    assert not mismatches, mismatches
    assert errors < len(SAMPLE_CASES) // 2


def test_process_frames(family: str, model_dirs: dict[str, Path], reference: dict[str, Any]) -> None:
    compare_videos(family, model_dirs, reference)


@pytest.mark.parametrize("layout", ["qwen2_5_vl-no-video-config", "qwen2_vl-capped", "qwen3_vl-nested"])
def test_process_frames_other_checkpoint_layouts(
    layout: str, model_dirs: dict[str, Path], reference: dict[str, Any]
) -> None:
    compare_videos(layout, model_dirs, reference)


def compare_videos(name: str, model_dirs: dict[str, Path], reference: dict[str, Any]) -> None:
    """Every video case of checkpoint ``name``: ours equals HF's bit for bit (or both refuse it)."""
    config = load_video_config(model_dirs[name])
    report = []
    for case, (frames, meta, kwargs) in video_cases().items():
        hf = reference[("video", name, case)]
        start = time.perf_counter()
        ours = ours_or_error(lambda: process_frames(frames, config, **kwargs[config.kind]))  # noqa: B023
        elapsed_ms = (time.perf_counter() - start) * 1000
        if isinstance(hf, str) or isinstance(ours, str):
            assert isinstance(hf, str) and isinstance(ours, str), (case, hf, ours)
            report.append(f"{case}: refused by both ({hf})")
            continue
        pixel_values, grid = ours
        assert torch.equal(grid, hf["video_grid_thw"]), (case, grid, hf["video_grid_thw"])
        assert pixel_values.dtype == hf["pixel_values_videos"].dtype == torch.float32
        assert pixel_values.shape == hf["pixel_values_videos"].shape, case
        max_diff = (pixel_values - hf["pixel_values_videos"]).abs().max().item()
        report.append(f"{case}: grid {grid.tolist()[0]}, max |diff| {max_diff} ({elapsed_ms:.1f} ms)")
        assert torch.equal(pixel_values, hf["pixel_values_videos"]), (case, max_diff)
        indices = meta["frames_indices"]
        if "timestamps" in hf:
            assert frame_timestamps(indices, meta["fps"], config.temporal_patch_size) == hf["timestamps"]
        if "second_per_grid_ts" in hf:
            num_sampled, total = len(indices), meta["total_num_frames"]
            ours_t = second_per_grid_t(num_sampled, total, meta["fps"], config.temporal_patch_size)
            assert [ours_t] == hf["second_per_grid_ts"]
    print(f"\n{name}:\n  " + "\n  ".join(report))
    assert sum("refused" in line for line in report) <= 1


def test_timestamps_and_second_per_grid_t_cover_the_families(reference: dict[str, Any]) -> None:
    """The comparisons above ran: HF answers with timestamps for Qwen3-VL only, second_per_grid_ts for
    Qwen2.5-VL only."""
    first = next(iter(video_cases()))
    assert set(reference[("video", "qwen3_vl", first)]) >= {"timestamps"}
    assert set(reference[("video", "qwen2_5_vl", first)]) >= {"second_per_grid_ts"}
    assert not {"timestamps", "second_per_grid_ts"} & set(reference[("video", "qwen2_vl", first)])


def test_hf_model_inputs_feed_generate(
    family: str, model_dirs: dict[str, Path], reference: dict[str, Any]
) -> None:
    """What the e2e oracle will use: HF's processor on a chat with an image and a video gives everything
    ``generate`` needs, and its video tensors and token counts are the product's."""
    hf = reference[("model_inputs", family, None)]
    assert not isinstance(hf, str), hf
    inputs = hf["inputs"]
    expected = {
        "input_ids",
        "attention_mask",
        "mm_token_type_ids",
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
    }
    assert set(inputs) == expected | ({"second_per_grid_ts"} if family == "qwen2_5_vl" else set())
    assert "<|vision_start|><|video_pad|><|vision_end|>" in hf["prompt"]

    config = load_video_config(model_dirs[family])
    _, frames, _, meta = chat_video()
    pixel_values, grid = process_frames(frames, config)
    assert torch.equal(pixel_values, inputs["pixel_values_videos"])
    assert torch.equal(grid, inputs["video_grid_thw"])
    model = MODELS[family].from_pretrained(model_dirs[family]).eval()
    video_token_id = model.config.video_token_id
    ids = inputs["input_ids"][0]
    assert int((ids == video_token_id).sum()) == int(grid.prod()) // config.merge_size**2
    assert torch.equal(inputs["mm_token_type_ids"][0] == 2, ids == video_token_id)
    if family == "qwen2_5_vl":
        ours_t = second_per_grid_t(len(meta["frames_indices"]), meta["total_num_frames"], meta["fps"], 2)
        assert torch.equal(inputs["second_per_grid_ts"], torch.tensor([ours_t]))
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, ids.shape[0] + 4)


def test_qwen3_prompt_carries_timestamps(model_dirs: dict[str, Path], reference: dict[str, Any]) -> None:
    """Qwen3VLProcessor writes ``<{t:.1f} seconds>`` before each temporal patch's run of tokens, with the
    product's timestamps. (transformers 5.23 replaces only <|video_pad|>, so the template's own
    <|vision_start|> / <|vision_end|> stay around the runs; the e2e oracle tokenizes the same.)"""
    from transformers import AutoTokenizer

    ids = reference[("model_inputs", "qwen3_vl", None)]["inputs"]["input_ids"][0]
    text = AutoTokenizer.from_pretrained(model_dirs["qwen3_vl"]).decode(ids)
    _, _, _, meta = chat_video()
    seconds = frame_timestamps(meta["frames_indices"], meta["fps"], 2)
    assert text.count(" seconds>") == len(seconds) == 3
    assert f"<|vision_start|><{seconds[0]:.1f} seconds><|vision_start|><|video_pad|>" in text
    for t in seconds:
        assert f"<{t:.1f} seconds><|vision_start|><|video_pad|>" in text


def test_chat_template_video_parts(family: str, model_dirs: dict[str, Path]) -> None:
    """The tiny checkpoints' templates render video parts as the real ones do (one marked <|video_pad|>
    each, "Video N: " with add_vision_id), and Qwen3-VL's refuses videos in a system message."""
    processor = ImageOnlyQwenVLProcessor.from_pretrained(model_dirs[family])
    parts = [{"type": "video_url", "video_url": {"url": "x"}}, {"type": "image"}, {"type": "video"}]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "Same?"}]}]
    prompt = processor.apply_chat_template(messages, tokenize=False, add_vision_id=True)
    video, image = (
        "<|vision_start|><|video_pad|><|vision_end|>",
        "<|vision_start|><|image_pad|><|vision_end|>",
    )
    assert f"<|im_start|>user\nVideo 1: {video}Picture 1: {image}Video 2: {video}Same?<|im_end|>" in prompt
    system = [{"role": "system", "content": [{"type": "video"}]}, *messages]
    if family == "qwen3_vl":
        with pytest.raises(jinja2.TemplateError, match="System message cannot contain videos"):
            processor.apply_chat_template(system, tokenize=False)


def test_no_torchvision_in_the_test_process() -> None:
    """HF ran in its subprocess only: torchvision here would switch transformers' image processors (and
    every other test's tensors) to its backend."""
    assert "torchvision" not in sys.modules


def test_check_video_kwargs(model_dirs: dict[str, Path]) -> None:
    qwen2, qwen3 = load_video_config(model_dirs["qwen2_vl"]), load_video_config(model_dirs["qwen3_vl"])
    assert check_video_kwargs(qwen2, {"fps": 1, "min_pixels": 3136}) == {
        "fps": 1.0,
        "size": {"shortest_edge": 3136, "longest_edge": qwen2.size["longest_edge"]},
    }
    assert check_video_kwargs(qwen3, {"num_frames": 8, "cap_pixels_per_frame": True}) == {
        "num_frames": 8,
        "cap_pixels_per_frame": True,
    }
    bad = [
        (qwen2, {"do_normalize": False}, "Unsupported"),
        (qwen2, {"fps": 2, "num_frames": 4}, "mutually exclusive"),
        (qwen2, {"fps": 0}, "positive"),
        (qwen2, {"fps": True}, "positive"),
        (qwen2, {"num_frames": 0}, "num_frames"),
        (qwen2, {"num_frames": 10_000}, "num_frames"),
        (qwen2, {"max_pixels": 10, "min_pixels": 20}, "1 <= min <= max"),
        # a max below the video's default min: the message says where the min came from
        (qwen2, {"max_pixels": 3136}, f"min {qwen2.size['shortest_edge']}, max 3136 .a bound not given"),
        (qwen2, {"size": {"longest_edge": 5000}}, "shortest_edge"),
        (qwen3, {"max_pixels": 50000}, "not min/max_pixels"),
        (qwen3, {"cap_pixels_per_frame": "yes"}, "true or false"),
    ]
    for config, kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            check_video_kwargs(config, kwargs)
    with pytest.raises(ValueError, match="uint8"):
        process_frames(np.zeros((2, 32, 32, 3), dtype=np.float32), qwen2)
