"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL on the worker: the family's vision transformer on several images of
different sizes as one packed batch, M-RoPE positions from each item's grid, and (Qwen3-VL) the deepstack
levels kept together with the main embeddings as one [num_tokens, levels, hidden] output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from transformers import (
    PreTrainedModel,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)

from wire.protocol import MMFeature
from workers.families.model import FamilyModel, RequestPositions
from workers.packed_attention import use_packed_attention
from workers.patch_embed import use_linear_patch_embed


class QwenVLModel(FamilyModel):
    hf_class: ClassVar[type[PreTrainedModel]] = Qwen2VLForConditionalGeneration
    item_tensors: ClassVar[dict[str, frozenset[str]]] = {
        "image": frozenset({"pixel_values", "image_grid_thw"}),
        "video": frozenset({"pixel_values_videos", "video_grid_thw"}),
    }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the vision tower's spans (windows, images) in one attention call per layer
        use_packed_attention(self.hf_model.model.visual.config)
        if self.device.type == "cuda":  # its patch embedding as one matrix product (workers/patch_embed.py)
            linear = use_linear_patch_embed(self.hf_model.model.visual.patch_embed)
            assert linear, "every Qwen family's patch embedding is a non-overlapping Conv3d"

    @property
    def merge_size(self) -> int:
        return int(self.config.vision_config.spatial_merge_size)

    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Images and videos alike: the vision tower takes a video's frame groups as it takes images
        (one (t, h, w) grid per item; attention stays within each frame group)."""
        pixels, grids = zip(*(_pixels_and_grid(t) for t in items), strict=True)
        pixel_values = torch.cat(pixels).to(self.device, self.dtype)
        grid_thw = torch.cat(grids).to(self.device)
        out = self.hf_model.model.get_image_features(pixel_values, grid_thw, return_dict=True)
        levels = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
        if len(levels) == 1:
            return list(out.pooler_output)
        # [num_tokens, levels, hidden]: one item's levels are cached, sliced and freed together
        return [torch.stack(per_item, dim=1) for per_item in zip(*levels, strict=True)]

    def prompt_positions(
        self, prompt_token_ids: Sequence[int], mm_features: list[MMFeature]
    ) -> RequestPositions:
        """transformers' ``get_rope_index``: text tokens advance all three rows together; an item's
        placeholders take (t, row, column) of its merged grid offset by the text position before it (t
        spaced by ``time_interval``); the text after it resumes at that offset + max(rows, columns). An
        item whose span holds text between frame groups (Qwen3-VL videos) is one block per frame group,
        its text advancing as text."""
        merge = self.merge_size
        placeholders = self.placeholder_token_ids
        positions = _Positions()
        next_token = 0
        for feature in sorted(mm_features, key=lambda f: f.offset):
            positions.text(feature.offset - next_token)
            t, h, w = feature.grid_thw
            if not feature.num_span_tokens:
                if t * (h // merge) * (w // merge) != feature.num_tokens:
                    raise ValueError(
                        f"mm item {feature.mm_hash!r}: grid {feature.grid_thw} for {feature.num_tokens}"
                    )
                positions.vision(t, h // merge, w // merge, self.time_interval(feature))
            else:
                span = prompt_token_ids[feature.offset : feature.end]
                runs = _runs(span, placeholders)
                if len(runs) != t or any(n != (h // merge) * (w // merge) for _, n in runs):
                    raise ValueError(
                        f"mm item {feature.mm_hash!r}: {len(runs)} placeholder runs, grid {feature.grid_thw}"
                    )
                at = 0
                for run_start, run_length in runs:
                    positions.text(run_start - at)
                    positions.vision(1, h // merge, w // merge, 1.0)
                    at = run_start + run_length
                positions.text(len(span) - at)
            next_token = feature.end
        positions.text(len(prompt_token_ids) - next_token)
        table = positions.table()
        return RequestPositions(table=table, delta=int(table.max()) + 1 - len(prompt_token_ids))

    def time_interval(self, feature: MMFeature) -> float:
        """How far apart a video's temporal groups are on the t row (1: one position per group)."""
        return 1.0


class _Positions:
    """M-RoPE positions built left to right, as ``get_rope_index`` walks a prompt."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.next_position = 0

    def text(self, num_tokens: int) -> None:
        self.parts.append(torch.arange(num_tokens).expand(3, -1) + self.next_position)
        self.next_position += num_tokens

    def vision(self, t: int, h: int, w: int, time_interval: float) -> None:
        start = self.next_position
        temporal = (torch.arange(t) * time_interval).long()
        grid = torch.stack(torch.meshgrid(temporal, torch.arange(h), torch.arange(w), indexing="ij"))
        self.parts.append(grid.reshape(3, -1) + start)
        self.next_position += max(h, w)

    def table(self) -> torch.Tensor:
        return torch.cat(self.parts, dim=1)


def _runs(span: Sequence[int], placeholders: frozenset[int]) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of placeholder tokens in ``span``."""
    runs: list[tuple[int, int]] = []
    for index, token_id in enumerate(span):
        if token_id not in placeholders:
            continue
        if runs and runs[-1][0] + runs[-1][1] == index:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((index, 1))
    return runs


def _pixels_and_grid(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """An item's patches and (t, h, w) grid: an image's or a video's, as the HF processor names them."""
    if "pixel_values_videos" in tensors:
        return tensors["pixel_values_videos"], tensors["video_grid_thw"].reshape(-1, 3)
    return tensors["pixel_values"], tensors["image_grid_thw"].reshape(-1, 3)


class Qwen2_5_VLModel(QwenVLModel):
    hf_class = Qwen2_5_VLForConditionalGeneration

    def time_interval(self, feature: MMFeature) -> float:
        """A video's groups are ``tokens_per_second * second_per_grid_t`` apart (absolute time)."""
        if feature.modality != "video" or feature.second_per_grid_t is None:
            return 1.0
        return float(self.config.vision_config.tokens_per_second) * feature.second_per_grid_t


class Qwen3VLModel(QwenVLModel):
    hf_class = Qwen3VLForConditionalGeneration

    @property
    def encoder_output_tail(self) -> tuple[int, ...]:
        """The main embeddings and one level per deepstack layer."""
        num_levels = 1 + len(self.config.vision_config.deepstack_visual_indexes)
        return (num_levels, int(self.config.text_config.hidden_size))
