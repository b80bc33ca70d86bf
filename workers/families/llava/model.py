"""LLaVA-1.5 on the worker: CLIP tower + projector per image, 1-D positions (Llama LM)."""

from __future__ import annotations

import torch
from transformers import LlavaForConditionalGeneration

from workers.families.model import FamilyModel


class LlavaModel(FamilyModel):
    hf_class = LlavaForConditionalGeneration

    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        pixel_values, num_images = [], []
        for tensors in items:
            pixels = tensors["pixel_values"]
            pixels = pixels.unsqueeze(0) if pixels.ndim == 3 else pixels
            pixel_values.append(pixels)
            num_images.append(pixels.shape[0])
        batch = torch.cat(pixel_values).to(self.device, self.dtype)
        out = self.hf_model.model.get_image_features(
            pixel_values=batch,
            vision_feature_layer=self.config.vision_feature_layer,
            vision_feature_select_strategy=self.config.vision_feature_select_strategy,
        )
        features = out.pooler_output  # one [num_tokens, text_hidden] tensor per image
        outputs, first = [], 0
        for count in num_images:
            outputs.append(torch.cat(features[first : first + count]))
            first += count
        return outputs
