"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL video: which frames to sample, and sampled frames -> model inputs, in
torch and numpy alone. transformers' video processors need torchvision, which the product does without;
every function here equals its HF counterpart exactly (tests/integration/test_qwen_video_processing.py
runs HF beside it)::

    load_video_config(model_dir)                          the checkpoint's video processor settings
    check_video_kwargs(config, kwargs)                    a request's options, validated (VIDEO_KWARGS)
    sample_indices(kind, total, video_fps, fps=, num_frames=, config=)   = video_processor.sample_frames
    process_frames(frames, config, **options)             = video_processor(..., do_sample_frames=False)
    frame_timestamps(indices, video_fps, tps)             = Qwen3VLProcessor._calculate_timestamps
    second_per_grid_t(num_sampled, total, video_fps, tps) = Qwen2.5-VL's second_per_grid_ts

``VideoKind.QWEN2_VL`` follows ``Qwen2VLVideoProcessor`` (Qwen2-VL and Qwen2.5-VL), ``VideoKind.QWEN3_VL``
``Qwen3VLVideoProcessor``. Everything a request can get wrong raises ValueError (the caller's 400).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import torch

# The options a request may set; the rest of the video processor's settings must match the weights.
VIDEO_KWARGS = frozenset({"fps", "num_frames", "size", "min_pixels", "max_pixels", "cap_pixels_per_frame"})
# The largest ``size`` bound a request may ask for, unless the checkpoint's own is larger.
MAX_REQUEST_PIXELS = 4096 * 4096
# Where HF looks for the video processor's settings after processor_config.json's "video_processor".
_CONFIG_FILES = ("video_preprocessor_config.json", "preprocessor_config.json")
_PIXEL_KEYS = {"min_pixels": "shortest_edge", "max_pixels": "longest_edge"}  # Qwen2VLVideoProcessor's aliases


class VideoKind(StrEnum):
    QWEN2_VL = "qwen2_vl"  # Qwen2VLVideoProcessor: size bounds each frame
    QWEN3_VL = "qwen3_vl"  # Qwen3VLVideoProcessor: size bounds all the frames together


# A video processor class, or a model_type (config.json), to its kind.
_KINDS = {
    "Qwen2VLVideoProcessor": VideoKind.QWEN2_VL, "Qwen3VLVideoProcessor": VideoKind.QWEN3_VL,
    "qwen2_vl": VideoKind.QWEN2_VL, "qwen2_5_vl": VideoKind.QWEN2_VL, "qwen3_vl": VideoKind.QWEN3_VL,
}  # fmt: skip
# Each class's defaults, for what a checkpoint's JSON leaves out.
_DEFAULTS: dict[VideoKind, dict[str, Any]] = {
    VideoKind.QWEN2_VL: {
        "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
        "image_mean": [0.48145466, 0.4578275, 0.40821073],  # OpenAI CLIP's
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "patch_size": 14, "max_video_tokens": 128000,
    },
    VideoKind.QWEN3_VL: {
        "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "patch_size": 16, "fps": 2, "max_video_tokens": 768,
    },
}  # fmt: skip


@dataclass(frozen=True)
class VideoConfig:
    """The settings of a checkpoint's video processor that decide sampling and tensors."""

    kind: VideoKind
    size: dict[str, int]  # {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    patch_size: int
    max_video_tokens: int
    fps: float | None = None  # default sampling rate (None: Qwen2 samples only when asked)
    num_frames: int | None = None
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_frames: int = 4
    max_frames: int = 768
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    cap_pixels_per_frame: bool = False  # HF: unset means False (with a warning)


def load_video_config(model_dir: str | Path) -> VideoConfig:
    """Read the video processor's settings as HF's ``from_pretrained`` does: processor_config.json's
    ``video_processor``, else video_preprocessor_config.json, else preprocessor_config.json; the class from
    ``video_processor_type``, else the image processor's type, else config.json's ``model_type``."""
    folder = Path(model_dir)
    nested = folder / "processor_config.json"
    raw = json.loads(nested.read_text()).get("video_processor") if nested.exists() else None
    for name in _CONFIG_FILES:
        if raw is None and (folder / name).exists():
            raw = json.loads((folder / name).read_text())
    if raw is None:
        raise ValueError(f"{folder} has no video processor config ({', '.join(_CONFIG_FILES)})")
    inferred = str(raw.get("image_processor_type", "")).replace("ImageProcessor", "VideoProcessor")
    kind = _KINDS.get(raw.get("video_processor_type") or inferred)
    if kind is None and (folder / "config.json").exists():
        kind = _KINDS.get(json.loads((folder / "config.json").read_text()).get("model_type"))
    if kind is None:
        raise ValueError(f"{folder}: not a Qwen2-VL / Qwen2.5-VL / Qwen3-VL video processor")
    settings = {**_DEFAULTS[kind], **{key: value for key, value in raw.items() if value is not None}}
    size = dict(raw.get("size") or _DEFAULTS[kind]["size"])
    if kind is VideoKind.QWEN2_VL:  # Qwen2VLVideoProcessor.__init__: min_pixels / max_pixels win over size
        size.update({edge: raw[key] for key, edge in _PIXEL_KEYS.items() if raw.get(key) is not None})
    if set(size) != {"shortest_edge", "longest_edge"}:
        raise ValueError(f"{folder}: video size must be shortest_edge / longest_edge pixels, got {size}")
    if settings.get("resample", 3) != 3:
        raise ValueError(f"{folder}: only bicubic resampling (3) is implemented, got {settings['resample']}")
    names = VideoConfig.__dataclass_fields__.keys() - {"kind", "size", "image_mean", "image_std"}
    return VideoConfig(
        kind=kind,
        size={"shortest_edge": int(size["shortest_edge"]), "longest_edge": int(size["longest_edge"])},
        image_mean=tuple(float(x) for x in settings["image_mean"]),
        image_std=tuple(float(x) for x in settings["image_std"]),
        **{name: settings[name] for name in names if name in settings},
    )


def check_video_kwargs(config: VideoConfig, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's video options, validated: ``fps`` (> 0) or ``num_frames`` (1..max_frames), ``size``
    ({"shortest_edge", "longest_edge"} in pixels, HF's meaning: per frame for Qwen2-VL / Qwen2.5-VL, over
    all sampled frames for Qwen3-VL), ``min_pixels`` / ``max_pixels`` (Qwen2 kind only, folded into
    ``size`` as HF does), ``cap_pixels_per_frame`` (bool). Returns them with ``size`` complete."""
    options = dict(kwargs or {})
    unknown = sorted(set(options) - VIDEO_KWARGS)
    if unknown:
        raise ValueError(f"Unsupported video options {unknown}; accepted: {sorted(VIDEO_KWARGS)}.")
    if options.get("fps") is not None and options.get("num_frames") is not None:
        raise ValueError("`num_frames` and `fps` are mutually exclusive; use only one.")
    if "fps" in options:
        fps = options["fps"]
        if type(fps) not in (int, float) or not (math.isfinite(fps) and fps > 0):
            raise ValueError(f"fps must be a positive number, got {fps!r}.")
        options["fps"] = float(fps)
    if "num_frames" in options and (
        type(options["num_frames"]) is not int or not 1 <= options["num_frames"] <= config.max_frames
    ):
        raise ValueError(f"num_frames must be an integer from 1 to {config.max_frames}.")
    if type(options.get("cap_pixels_per_frame", False)) is not bool:
        raise ValueError("cap_pixels_per_frame must be true or false.")
    if {"size", *_PIXEL_KEYS} & options.keys():
        if config.kind is VideoKind.QWEN3_VL and _PIXEL_KEYS.keys() & options.keys():
            raise ValueError(
                "Qwen3-VL videos take size (pixels of all frames), not min/max_pixels; a request's "
                "pixel options apply to its images and videos alike, so with a video give them as size."
            )
        size = options.pop("size", None) or dict(config.size)
        if not isinstance(size, Mapping) or set(size) != {"shortest_edge", "longest_edge"}:
            raise ValueError("size must be {'shortest_edge': min_pixels, 'longest_edge': max_pixels}.")
        size = {**size, **{edge: options.pop(key) for key, edge in _PIXEL_KEYS.items() if key in options}}
        cap = max(MAX_REQUEST_PIXELS, config.size["longest_edge"])
        low, high = size["shortest_edge"], size["longest_edge"]
        if type(low) is not int or type(high) is not int or not 1 <= low <= high <= cap:
            default = config.size
            raise ValueError(
                f"Video pixel bounds must be integers, 1 <= min <= max <= {cap}: here min {low!r}, max "
                f"{high!r} (a bound not given is the video's default: min {default['shortest_edge']}, max "
                f"{default['longest_edge']}; a request's pixel options apply to its images and videos alike)."
            )
        options["size"] = {"shortest_edge": low, "longest_edge": high}
    return options


def sample_indices(
    kind: VideoKind | str,
    total_num_frames: int,
    video_fps: float | None,
    *,
    fps: float | None = None,
    num_frames: int | None = None,
    config: VideoConfig,
) -> list[int]:
    """The frames to decode, as ``video_processor.sample_frames(metadata, fps=fps, num_frames=num_frames)``
    of ``kind``'s processor (a VideoKind or a model_type) with ``config``'s defaults. ValueError where HF
    raises, and where HF would return no frame (or crash dividing by zero)."""
    kind = _KINDS.get(str(kind)) or VideoKind(kind)
    if fps is not None and num_frames is not None:
        raise ValueError("`num_frames` and `fps` are mutually exclusive; use only one.")
    if total_num_frames < 1 or (video_fps is not None and not video_fps > 0):
        raise ValueError(f"Cannot sample a video of {total_num_frames} frames at {video_fps} fps.")
    fps = fps if fps is not None else config.fps
    if kind is VideoKind.QWEN3_VL:
        if num_frames is None and fps is not None:
            video_fps = 24 if video_fps is None else video_fps  # HF's default, with a warning
            num_frames = int(total_num_frames / video_fps * fps)
            num_frames = min(max(num_frames, config.min_frames), config.max_frames, total_num_frames)
        if num_frames is None:
            num_frames = min(max(total_num_frames, config.min_frames), config.max_frames)
        if num_frames < 1:
            raise ValueError(f"num_frames must be at least 1, got {num_frames}.")
        return np.linspace(0, total_num_frames - 1, num_frames).round().astype(int).tolist()
    factor = config.temporal_patch_size
    num_frames = num_frames if num_frames is not None else config.num_frames
    if num_frames is not None:
        num_frames = round(num_frames / factor) * factor
    elif fps is not None:
        if video_fps is None:
            raise ValueError("Sampling at `fps` frames per second needs the video's frame rate.")
        max_frames = math.floor(min(config.max_frames, total_num_frames) / factor) * factor
        sampled = min(
            max(total_num_frames / video_fps * fps, config.min_frames), max_frames, total_num_frames
        )
        num_frames = math.floor(sampled / factor) * factor
    else:
        raise ValueError("This model's video processor needs `fps` or `num_frames` to sample frames.")
    if num_frames > total_num_frames:
        raise ValueError(
            f"Video can't be sampled. The inferred `num_frames={num_frames}` exceeds "
            f"`total_num_frames={total_num_frames}`. Decrease `num_frames` or `fps` for sampling."
        )
    if num_frames < 1:
        raise ValueError(f"Video can't be sampled: {num_frames} frames (in multiples of {factor}).")
    return torch.arange(0, total_num_frames, total_num_frames / num_frames).int().tolist()


def frame_timestamps(
    indices: Sequence[int], video_fps: float | None, temporal_patch_size: int
) -> list[float]:
    """Seconds of each temporal patch (the mean of its first and last frame's time), as
    Qwen3VLProcessor writes them into the prompt (``<{t:.1f} seconds>``); an unknown fps counts as 24."""
    video_fps = 24 if video_fps is None else video_fps
    padded = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch_size)
    seconds = [index / video_fps for index in padded]
    return [
        (seconds[i] + seconds[i + temporal_patch_size - 1]) / 2
        for i in range(0, len(seconds), temporal_patch_size)
    ]


def second_per_grid_t(
    num_sampled: int, total_num_frames: int, video_fps: float | None, temporal_patch_size: int
) -> float:
    """Qwen2.5-VL's ``second_per_grid_ts`` entry: ``temporal_patch_size / metadata.sampled_fps``."""
    sampled_fps = 24 if video_fps is None else num_sampled / total_num_frames * video_fps
    return temporal_patch_size / sampled_fps


def process_frames(
    frames: np.ndarray | torch.Tensor, config: VideoConfig, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled RGB frames (uint8 [T, H, W, 3]) -> (pixel_values_videos [grid_t*h*w, 3*tps*patch²] float32,
    video_grid_thw [[t, h, w]] int64), as ``video_processor(videos=[frames], do_sample_frames=False,
    **kwargs)``. ``kwargs`` as ``check_video_kwargs`` takes them (fps / num_frames are ignored here)."""
    options = check_video_kwargs(config, kwargs)
    video = torch.as_tensor(frames)
    if video.dtype != torch.uint8 or video.ndim != 4 or video.shape[-1] != 3 or 0 in video.shape:
        raise ValueError(f"Frames must be uint8 [T, H, W, 3] RGB, got {video.dtype} {tuple(video.shape)}.")
    video = video.permute(0, 3, 1, 2).contiguous()  # [T, C, H, W], as HF lays it out
    num_frames, _, height, width = video.shape
    factor = config.patch_size * config.merge_size
    if config.do_resize:
        size = options.get("size", config.size)
        cap = options.get("cap_pixels_per_frame", config.cap_pixels_per_frame)
        resized = _target_size(
            config, num_frames, height, width, size["shortest_edge"], size["longest_edge"], cap
        )
        if resized != (height, width):
            # = torchvision.transforms.v2.functional.resize(BICUBIC, antialias=True): on CPU it resamples
            # uint8 natively (no float round trip), rounding and clamping inside the kernel.
            video = torch.nn.functional.interpolate(
                video, size=list(resized), mode="bicubic", align_corners=False, antialias=True
            )
    height, width, patch = video.shape[-2], video.shape[-1], config.patch_size
    if height % factor or width % factor:  # only with do_resize off
        raise ValueError(f"Frames of {height}x{width} px are not whole {factor}x{factor} px patches.")
    grid_thw = torch.tensor([[-(-num_frames // config.temporal_patch_size), height // patch, width // patch]])
    return _patchify(_rescale_and_normalize(video, config), config), grid_thw


def _target_size(
    config: VideoConfig, num_frames: int, height: int, width: int, min_pixels: int, max_pixels: int, cap: bool
) -> tuple[int, int]:
    """(height, width) after each kind's ``resize``: its ``cap_pixels_per_frame`` rule, then its smart_resize
    (Qwen3-VL's counts the pixels of all frames, rounded to temporal patches, and first scales frames
    smaller than a merged patch up)."""
    factor = config.patch_size * config.merge_size
    temporal = config.temporal_patch_size
    if config.kind is VideoKind.QWEN2_VL:
        if cap:
            total_pixels = int(config.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total_pixels * temporal // num_frames), int(min_pixels * 1.05))
        return _smart_resize(height, width, factor, min_pixels, max_pixels)
    if cap:
        frame_cap = config.max_video_tokens * factor * factor
        max_pixels = max(min(frame_cap, max_pixels // num_frames), int(min_pixels * 1.05)) * num_frames
    if num_frames < temporal:
        raise ValueError(f"Qwen3-VL needs at least {temporal} frames per video, got {num_frames}.")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    t_bar = round(num_frames / temporal) * temporal
    return _smart_resize(height, width, factor, min_pixels, max_pixels, (num_frames, t_bar))


def _smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int, frames: tuple[int, int] = (1, 1)
) -> tuple[int, int]:
    """Multiples of ``factor`` near (height, width) with t_bar * h * w in [min_pixels, max_pixels], where
    ``frames`` = (num_frames, t_bar): (1, 1) for Qwen2-VL's per-frame bounds."""
    num_frames, t_bar = frames
    if (aspect := max(height, width) / min(height, width)) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {aspect}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _rescale_and_normalize(video: torch.Tensor, config: VideoConfig) -> torch.Tensor:
    """TorchvisionBackend.rescale_and_normalize: rescale folded into mean and std (x / s - m / s) / (d / s),
    computed in float32 exactly as torchvision's normalize does."""
    if config.do_normalize:
        mean, std = torch.tensor(config.image_mean), torch.tensor(config.image_std)
        if config.do_rescale:
            mean, std = mean * (1.0 / config.rescale_factor), std * (1.0 / config.rescale_factor)
        return video.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    return video * config.rescale_factor if config.do_rescale else video


def _patchify(video: torch.Tensor, config: VideoConfig) -> torch.Tensor:
    """[T, C, H, W] -> [grid_t * grid_h * grid_w, C * tps * patch²], merge_size² neighbours in a row; the
    last frame repeated up to a multiple of temporal_patch_size (HF's patchify)."""
    temporal, patch, merge = config.temporal_patch_size, config.patch_size, config.merge_size
    if pad := -video.shape[0] % temporal:
        video = torch.cat((video, video[-1:].expand(pad, -1, -1, -1)), dim=0)
    num_frames, channels, height, width = video.shape
    grid_t, grid_h, grid_w = num_frames // temporal, height // patch, width // patch
    patches = video.view(
        grid_t, temporal, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch
    )
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(grid_t * grid_h * grid_w, channels * temporal * patch * patch)
