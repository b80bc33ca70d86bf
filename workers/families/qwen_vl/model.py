"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL on the worker: the family's vision transformer on several images of
different sizes as one packed batch, M-RoPE positions from each item's grid, and (Qwen3-VL) the deepstack
levels kept together with the main embeddings as one [num_tokens, levels, hidden] output.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from transformers import (
    PreTrainedModel,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)

from wire.protocol import MMFeature
from workers.families.model import FamilyModel, RequestPositions


class QwenVLModel(FamilyModel):
    hf_class: ClassVar[type[PreTrainedModel]] = Qwen2VLForConditionalGeneration

    @property
    def merge_size(self) -> int:
        return int(self.config.vision_config.spatial_merge_size)

    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        pixel_values = torch.cat([t["pixel_values"] for t in items]).to(self.device, self.dtype)
        grid_thw = torch.cat([t["image_grid_thw"].reshape(-1, 3) for t in items]).to(self.device)
        out = self.hf_model.model.get_image_features(pixel_values, grid_thw, return_dict=True)
        levels = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
        if len(levels) == 1:
            return list(out.pooler_output)
        # [num_tokens, levels, hidden]: one item's levels are cached, sliced and freed together
        return [torch.stack(per_item, dim=1) for per_item in zip(*levels, strict=True)]

    def prompt_positions(self, num_prompt_tokens: int, mm_features: list[MMFeature]) -> RequestPositions:
        """transformers' ``get_rope_index`` for an image + text prompt: text tokens advance all three rows
        together; an image's placeholders take (t, row, column) of its merged grid offset by the text
        position before it; the text after it resumes at that offset + max(rows, columns)."""
        merge = self.merge_size
        parts: list[torch.Tensor] = []
        next_position = next_token = 0
        for feature in sorted(mm_features, key=lambda f: f.offset):
            num_text = feature.offset - next_token
            parts.append(torch.arange(num_text).expand(3, -1) + next_position)
            next_position += num_text
            t, h, w = feature.grid_thw
            grid = torch.stack(
                torch.meshgrid(
                    torch.arange(t), torch.arange(h // merge), torch.arange(w // merge), indexing="ij"
                )
            ).reshape(3, -1)
            if grid.shape[1] != feature.num_tokens:
                raise ValueError(
                    f"mm item {feature.mm_hash!r}: grid {feature.grid_thw} for {feature.num_tokens}"
                )
            parts.append(grid + next_position)
            next_position += max(h, w) // merge
            next_token = feature.offset + feature.num_tokens
        parts.append(torch.arange(num_prompt_tokens - next_token).expand(3, -1) + next_position)
        table = torch.cat(parts, dim=1)
        return RequestPositions(table=table, delta=int(table.max()) + 1 - num_prompt_tokens)


class Qwen2_5_VLModel(QwenVLModel):
    hf_class = Qwen2_5_VLForConditionalGeneration


class Qwen3VLModel(QwenVLModel):
    hf_class = Qwen3VLForConditionalGeneration

    @property
    def encoder_output_tail(self) -> tuple[int, ...]:
        """The main embeddings and one level per deepstack layer."""
        num_levels = 1 + len(self.config.vision_config.deepstack_visual_indexes)
        return (num_levels, int(self.config.text_config.hidden_size))
