"""LLaVA-1.5 processing: one fixed-size square per image, one placeholder run of patches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoProcessor

from workers.families.errors import FamilyInputError
from workers.families.processing import KWARGS_PARAM, FamilyProcessor


class LlavaProcessing(FamilyProcessor):
    @classmethod
    def load_hf_processor(cls, model_dir: Path) -> Any:
        # PIL, as every family here: where torchvision is installed (the CUDA images) transformers would
        # pick its torchvision backend, whose resize differs, so one image would process differently
        return AutoProcessor.from_pretrained(model_dir, local_files_only=True, backend="pil")

    def item_layout(self, tensors: dict[str, torch.Tensor]) -> tuple[int, tuple[int, ...]]:
        """As ``LlavaProcessor.replace_image_token``: one token per patch of the processed image,
        plus the extra (CLS) tokens, minus the CLS one the "default" feature strategy drops."""
        height, width = tensors["pixel_values"].shape[-2:]
        patch_size = self.hf_processor.patch_size
        num_tokens = (height // patch_size) * (width // patch_size)
        num_tokens += self.hf_processor.num_additional_image_tokens
        if self.hf_processor.vision_feature_select_strategy == "default":
            num_tokens -= 1
        return int(num_tokens), ()

    def check_processed(self, tensors: dict[str, torch.Tensor]) -> None:
        """LLaVA's vision tower takes exactly ``image_size`` squares; kwargs that resize or skip the crop
        would give it something it cannot encode, so such requests are refused here."""
        image_size = self.config.get("vision_config", {}).get("image_size")
        shape = tuple(tensors["pixel_values"].shape)
        if image_size is not None and shape[-2:] != (image_size, image_size):
            raise FamilyInputError(
                f"mm_processor_kwargs give {shape[-2]}x{shape[-1]} pixel inputs; this model's vision "
                f"encoder takes {image_size}x{image_size}.",
                param=KWARGS_PARAM,
            )
