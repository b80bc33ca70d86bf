"""An image-only HF processor for Qwen2-VL, Qwen2.5-VL and Qwen3-VL checkpoints.

The stock processors (``AutoProcessor``, ``Qwen2VLProcessor``, ...) also build a video processor, which
needs torchvision; this one holds only the image processor (the PIL backend) and the tokenizer. For
images it returns what the stock processor returns: ``input_ids`` and ``attention_mask`` with each
``<|image_pad|>`` expanded to ``image_grid_thw.prod() // merge_size**2`` placeholders, ``pixel_values``,
``image_grid_thw``, and ``mm_token_type_ids`` (1 on image placeholders, 2 on video ones), which
transformers' Qwen models need for their M-RoPE positions (Qwen2.5-VL silently falls back to 1-D
positions without it; Qwen3-VL warns).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, Qwen2VLImageProcessorPil
from transformers.processing_utils import ProcessorMixin

_CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


class ImageOnlyQwenVLProcessor(ProcessorMixin):
    """``ProcessorMixin`` takes its sub-processors from the names of ``__init__``'s parameters, so
    ``image_processor`` and ``tokenizer`` are all it has (no ``video_processor``).

    Attributes: ``tokenizer``, ``image_processor``, ``image_token`` / ``image_token_id``
    (``<|image_pad|>``), ``video_token`` / ``video_token_id`` (only so that ``mm_token_type_ids`` and
    input validation match the stock processor), ``vision_start_token(_id)`` / ``vision_end_token(_id)``,
    ``chat_template``.
    """

    return_mm_token_type_ids = True
    # Qwen3VLProcessor says so explicitly; Qwen2's tokenizers return no token_type_ids anyway.
    text_kwargs = {"return_token_type_ids": False}

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None):
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.vision_start_token = getattr(tokenizer, "vision_start_token", None) or "<|vision_start|>"
        self.vision_end_token = getattr(tokenizer, "vision_end_token", None) or "<|vision_end|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
        self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)
        super().__init__(image_processor, tokenizer, chat_template=chat_template)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **kwargs: Any) -> ImageOnlyQwenVLProcessor:  # type: ignore[override]
        """Load from a checkpoint folder as a real Qwen-VL checkpoint has it: ``preprocessor_config.json``
        (any Qwen2-VL image processor type; ``min_pixels`` / ``max_pixels`` or ``size`` both work), the
        tokenizer files, and the chat template in ``chat_template.jinja`` or ``chat_template.json``
        (else the one in tokenizer_config.json). Local files only; ``kwargs`` go to both loaders."""
        folder = Path(model_dir)
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(folder, local_files_only=True, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
        return cls(image_processor, tokenizer, chat_template=_read_chat_template(folder, tokenizer))

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs: Any) -> str:
        """As ``Qwen2VLProcessor``: one placeholder per merged patch of the image's grid."""
        merge_length = self.image_processor.merge_size**2
        num_image_tokens = int(image_inputs["image_grid_thw"][image_idx].prod()) // merge_length
        return self.image_token * num_image_tokens

    def post_process_image_text_to_text(
        self,
        generated_outputs: Any,
        skip_special_tokens: bool = True,
        clean_up_tokenization_spaces: bool = False,
        **kwargs: Any,
    ) -> list[str]:
        return self.tokenizer.batch_decode(
            generated_outputs,
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=clean_up_tokenization_spaces,
            **kwargs,
        )

    @property
    def model_input_names(self) -> list[str]:
        return [*super().model_input_names, "mm_token_type_ids"]


def _read_chat_template(folder: Path, tokenizer: Any) -> str | None:
    for name in _CHAT_TEMPLATE_FILES:
        path = folder / name
        if path.exists():
            text = path.read_text(encoding="utf-8")
            return json.loads(text)["chat_template"] if name.endswith(".json") else text
    return getattr(tokenizer, "chat_template", None)
