"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL processing: dynamic resolution. An image is resized to multiples of
``patch_size * merge_size`` within [min_pixels, max_pixels] and becomes ``t * h * w / merge_size**2``
placeholders, where (t, h, w) is its ``image_grid_thw`` in patches; the grid also decides the M-RoPE
positions of those placeholders, so it travels with every item (docs/architecture.md, "Model families").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from workers.families.errors import FamilyInputError
from workers.families.processing import KWARGS_PARAM, FamilyProcessor

# The largest pixel count a request may ask for (Qwen3-VL's own default ceiling).
MAX_PIXELS_CAP = 4096 * 4096


class QwenVLProcessing(FamilyProcessor):
    # ``size`` counts pixels here (shortest_edge = min_pixels, longest_edge = max_pixels), not sides.
    size_kwargs = frozenset()
    # The patch geometry must match the vision tower's weights.
    reserved_kwargs = frozenset({"patch_size", "temporal_patch_size", "merge_size"})

    @classmethod
    def load_hf_processor(cls, model_dir: Path) -> Any:
        from workers.families.qwen_vl.hf_processor import ImageOnlyQwenVLProcessor

        return ImageOnlyQwenVLProcessor.from_pretrained(model_dir)

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
