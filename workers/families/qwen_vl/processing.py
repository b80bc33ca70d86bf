"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL processing: dynamic resolution. An image is resized to multiples of
``patch_size * merge_size`` within [min_pixels, max_pixels] and becomes ``t * h * w / merge_size**2``
placeholders, where (t, h, w) is its ``image_grid_thw`` in patches; the grid also decides the M-RoPE
positions of those placeholders, so it travels with every item (docs/architecture.md, "Model families").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wire.hashing import canonical_option
from workers.families.errors import FamilyInputError
from workers.families.processing import (
    KWARGS_PARAM,
    FamilyProcessor,
    ItemLayout,
    ProcessedItem,
    VideoMetadata,
)
from workers.families.qwen_vl.video_processing import (
    VIDEO_KWARGS,
    VideoConfig,
    VideoKind,
    check_video_kwargs,
    frame_timestamps,
    load_video_config,
    process_frames,
    sample_indices,
    second_per_grid_t,
)

# The largest pixel count a request may ask for (Qwen3-VL's own default ceiling).
MAX_PIXELS_CAP = 4096 * 4096
# Frames per second sampled from a video when neither the request nor the checkpoint says (qwen-vl-utils')
DEFAULT_VIDEO_FPS = 2.0


class QwenVLProcessing(FamilyProcessor):
    # ``size`` counts pixels here (shortest_edge = min_pixels, longest_edge = max_pixels), not sides.
    size_kwargs = frozenset()
    # The patch geometry must match the vision tower's weights.
    reserved_kwargs = frozenset({"patch_size", "temporal_patch_size", "merge_size"})
    # Qwen2.5's and Qwen3's tool calls: <tool_call>{"name": ..., "arguments": ...}</tool_call>
    default_tool_call_parser = "hermes"

    def __init__(
        self, model_dir: str | Path, *, chat_template: str | None = None, tool_call_parser: str | None = None
    ) -> None:
        super().__init__(model_dir, chat_template=chat_template, tool_call_parser=tool_call_parser)
        self.video_config = load_video_config(self.model_dir)
        self.video_token = self.hf_processor.video_token
        self.video_token_id = self.hf_processor.video_token_id
        self.video_kwargs = VIDEO_KWARGS
        self._qwen2_5 = self.config.get("model_type") == "qwen2_5_vl"

    @classmethod
    def load_hf_processor(cls, model_dir: Path) -> Any:
        from workers.families.qwen_vl.hf_processor import ImageOnlyQwenVLProcessor

        return ImageOnlyQwenVLProcessor.from_pretrained(model_dir)

    # -- video (workers/families/qwen_vl/video_processing.py does the work, equal to HF's) -------------

    def hash_video_options(self, mm_processor_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """``fps`` or ``num_frames``, the pixel bounds (``size``, or Qwen2's ``min_pixels`` /
        ``max_pixels``) and ``cap_pixels_per_frame``, validated; the rest of the request's options
        belong to its images."""
        kwargs = self.options_for(mm_processor_kwargs or {}, self.video_kwargs)
        try:
            options = check_video_kwargs(self.video_config, kwargs)
        except ValueError as exc:
            raise FamilyInputError(
                f"Invalid video options in mm_processor_kwargs: {exc}", param=KWARGS_PARAM
            ) from exc
        options = _without_defaults(self.video_config, options)
        return {key: canonical_option(options[key]) for key in sorted(options)}

    @property
    def min_video_frames(self) -> int:
        """One temporal patch: Qwen3-VL's sampling can give one frame, which its processing refuses."""
        return self.video_config.temporal_patch_size

    def sample_video(self, metadata: VideoMetadata, options: Mapping[str, Any]) -> list[int]:
        """The video processor's sampling; without ``fps`` or ``num_frames`` from the request or the
        checkpoint, ``DEFAULT_VIDEO_FPS`` frames per second."""
        config = self.video_config
        fps, num_frames = options.get("fps"), options.get("num_frames")
        if fps is None and num_frames is None and config.fps is None and config.num_frames is None:
            fps = DEFAULT_VIDEO_FPS
        try:
            return sample_indices(
                config.kind, metadata.num_frames, metadata.fps, fps=fps, num_frames=num_frames, config=config
            )
        except ValueError as exc:
            raise FamilyInputError(f"This video cannot be sampled so: {exc}", param=KWARGS_PARAM) from exc

    def process_video(
        self, frames: np.ndarray, metadata: VideoMetadata, indices: Sequence[int], options: Mapping[str, Any]
    ) -> ProcessedItem:
        config = self.video_config
        try:
            pixel_values, grid_thw = process_frames(frames, config, **options)
        except ValueError as exc:
            raise FamilyInputError(
                f"The video processor could not process this video: {exc}", param=KWARGS_PARAM
            ) from exc
        t, h, w = (int(x) for x in grid_thw[0])
        tps = config.temporal_patch_size
        layout = ItemLayout(
            num_tokens=t * h * w // (config.merge_size * config.merge_size),
            grid_thw=(t, h, w),
            modality="video",
            timestamps=tuple(frame_timestamps(indices, metadata.fps, tps)) if self._writes_timestamps else (),
            second_per_grid_t=second_per_grid_t(len(indices), metadata.num_frames, metadata.fps, tps)
            if self._qwen2_5
            else None,
        )
        return ProcessedItem({"pixel_values_videos": pixel_values, "video_grid_thw": grid_thw}, layout)

    @property
    def _writes_timestamps(self) -> bool:
        return self.video_config.kind is VideoKind.QWEN3_VL

    def placeholder_pieces(self, layout: ItemLayout) -> list[tuple[str, int]]:
        """Qwen3-VL writes each frame group of a video as ``<t seconds><|vision_start|>`` + its placeholders
        + ``<|vision_end|>`` (Qwen3VLProcessor.replace_video_token); otherwise one run."""
        if layout.modality != "video" or not self._writes_timestamps:
            return super().placeholder_pieces(layout)
        start, end = self.hf_processor.vision_start_token, self.hf_processor.vision_end_token
        per_group = layout.num_tokens // len(layout.timestamps)
        pieces = [
            (("" if i == 0 else end) + f"<{t:.1f} seconds>{start}", per_group)
            for i, t in enumerate(layout.timestamps)
        ]
        return [*pieces, (end, 0)]

    def hash_options(self, mm_processor_kwargs: Any) -> dict[str, Any]:
        """``min_pixels`` / ``max_pixels`` are spelled as the ``size`` they stand for before hashing, so
        the same resolution asked for either way is one cache entry."""
        if isinstance(mm_processor_kwargs, dict) and {"min_pixels", "max_pixels"} & set(mm_processor_kwargs):
            kwargs = dict(mm_processor_kwargs)
            size = dict(kwargs.pop("size", None) or self.image_processor.size)
            if "min_pixels" in kwargs:
                size["shortest_edge"] = kwargs.pop("min_pixels")
            if "max_pixels" in kwargs:
                size["longest_edge"] = kwargs.pop("max_pixels")
            kwargs["size"] = size
            mm_processor_kwargs = kwargs
        return super().hash_options(mm_processor_kwargs)

    def check_options(self, options: dict[str, Any]) -> None:
        size = options.get("size")
        if size is None:
            return
        if not isinstance(size, dict) or set(size) != {"shortest_edge", "longest_edge"}:
            raise FamilyInputError(
                "mm_processor_kwargs.size must be {'shortest_edge': min_pixels, 'longest_edge': max_pixels}.",
                param=KWARGS_PARAM,
            )
        low, high = size["shortest_edge"], size["longest_edge"]
        if type(low) is not int or type(high) is not int or not 1 <= low <= high <= MAX_PIXELS_CAP:
            raise FamilyInputError(
                f"mm_processor_kwargs min_pixels / max_pixels must be integers with "
                f"1 <= min_pixels <= max_pixels <= {MAX_PIXELS_CAP}.",
                param=KWARGS_PARAM,
            )

    def item_layout(self, tensors: dict[str, torch.Tensor]) -> tuple[int, tuple[int, ...]]:
        """As ``Qwen2VLProcessor.replace_image_token``: grid.prod() // merge_size**2 placeholders."""
        t, h, w = (int(x) for x in tensors["image_grid_thw"].reshape(-1, 3)[0])
        merge_size = int(self.image_processor.merge_size)
        return t * h * w // (merge_size * merge_size), (t, h, w)


def _without_defaults(config: VideoConfig, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` less those that sample or size exactly as the checkpoint does without them, so that
    spelling out a default shares cache entries and media ids, as an image's options do: the default
    ``fps`` (the checkpoint's, else ``DEFAULT_VIDEO_FPS``) where the checkpoint samples by rate, its
    ``num_frames`` where it samples by count, its ``size``, and ``cap_pixels_per_frame`` false."""
    defaults: dict[str, Any] = {
        "size": dict(config.size),
        "cap_pixels_per_frame": config.cap_pixels_per_frame,
    }
    if config.num_frames is None:
        defaults["fps"] = float(config.fps if config.fps is not None else DEFAULT_VIDEO_FPS)
    elif config.fps is None:
        defaults["num_frames"] = config.num_frames
    return {key: value for key, value in options.items() if key not in defaults or value != defaults[key]}
