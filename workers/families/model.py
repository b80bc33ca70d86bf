"""The worker half of a model family: load the checkpoint, encode items, give token positions.

``ModelRunner`` (family-agnostic) asks its ``FamilyModel`` for exactly three things::

    encode(items)                    the step's items, one batch -> one encoder output per item
                                     ([num_tokens, hidden], or [num_tokens, levels, hidden] when the
                                     family has deepstack levels: level 0 is spliced into the input,
                                     levels 1.. are added after the first decoder layers)
    prompt_positions(ids, features)  rotary positions of a request's tokens (1-D or M-RoPE)
    placeholder_token_ids            the prompt token ids that stand for encoder output rows
    language_model, lm_head, embed_tokens   the transformers modules the paged forward runs

See docs/architecture.md, "Model families".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import AutoConfig

from wire.protocol import MMFeature
from workers.config import ModelParts


@dataclass(frozen=True)
class RequestPositions:
    """Rotary positions of one request's tokens (prompt, then everything it generates).

    ``table`` None: token i sits at position i (one row). Otherwise ``table`` ([rows, num_prompt_tokens],
    CPU int64) holds the prompt's positions and generated token i sits at ``i + delta`` on every row
    (transformers' ``rope_deltas``)."""

    table: torch.Tensor | None = None
    delta: int = 0

    def between(self, start: int, end: int) -> torch.Tensor:
        """Positions of tokens [start, end): a [rows, end - start] int64 CPU tensor."""
        if self.table is None:
            return torch.arange(start, end).unsqueeze(0)
        num_prompt = self.table.shape[1]
        parts = []
        if start < num_prompt:
            parts.append(self.table[:, start : min(end, num_prompt)])
        if end > num_prompt:
            generated = torch.arange(max(start, num_prompt), end) + self.delta
            parts.append(generated.unsqueeze(0).expand(self.table.shape[0], -1))
        return torch.cat(parts, dim=1)

    def at(self, index: int) -> list[int]:
        """The position of token ``index`` on each row, as ``between(index, index + 1)`` gives it but
        without a tensor: a decode step asks this of every request."""
        if self.table is None:
            return [index]
        if index < self.table.shape[1]:
            return self.table[:, index].tolist()
        return [index + self.delta] * self.table.shape[0]


class FamilyModel:
    """Subclasses name their transformers class and implement ``encode``; 1-D positions by default."""

    hf_class: ClassVar[Any]
    # The tensors an item of each modality the family encodes must carry (as the HF processor names them).
    item_tensors: ClassVar[dict[str, frozenset[str]]] = {"image": frozenset({"pixel_values"})}

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        parts: ModelParts = ModelParts.ALL,
    ) -> None:
        """Loads the checkpoint's ``parts``: the half left out is built with no layers, so its layers'
        weights are never read (only its small embedding / projection tensors are)."""
        config = AutoConfig.from_pretrained(model_dir)
        if not parts.has_language_model:
            config.text_config.num_hidden_layers = 0
            if getattr(config.text_config, "layer_types", None) is not None:
                config.text_config.layer_types = []
        if not parts.has_vision_tower:
            for name in ("depth", "num_hidden_layers"):  # Qwen's vision config / CLIP's
                if hasattr(config.vision_config, name):
                    setattr(config.vision_config, name, 0)
        model = self.hf_class.from_pretrained(model_dir, config=config, dtype=dtype)
        self.hf_model = model.to(device).eval()
        self.config = model.config
        self.device = device
        self.dtype = dtype
        self.language_model = model.model.language_model
        self.lm_head = model.lm_head
        self.embed_tokens = model.get_input_embeddings()

    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Vision encoder (+ projector / merger) on the step's items as one batch. ``items`` hold each
        item's processed tensors (CPU, as the API's processor made them)."""
        raise NotImplementedError

    def prompt_positions(
        self, prompt_token_ids: Sequence[int], mm_features: list[MMFeature]
    ) -> RequestPositions:
        """Positions of the prompt's tokens from its items' placements (``ValueError`` for placements
        that contradict the prompt); 1-D unless the family says otherwise."""
        return RequestPositions()

    @property
    def placeholder_token_ids(self) -> frozenset[int]:
        """The token ids that stand for an item's encoder output rows in a prompt (docs/architecture.md,
        "Model families": an item's span may hold text between them)."""
        ids = (
            getattr(self.config, name, None)
            for name in ("image_token_id", "image_token_index", "video_token_id")
        )
        return frozenset(int(i) for i in ids if i is not None)

    @property
    def encoder_output_tail(self) -> tuple[int, ...]:
        """The shape of one item's output after its token dimension (what ``encode`` returns)."""
        return (int(self.config.text_config.hidden_size),)
