"""The model's own HF processor, split into the steps the API runs apart (the middle one is skipped
on a processor-cache hit):

    render_prompt(messages)        chat template -> text with one image token per image
    process_image(image, kwargs)   one image -> tensors + number of placeholder tokens  (cached by mm_hash)
    tokenize(prompt, num_tokens)   expand each image token, tokenize -> ids + placeholder offsets

Together they give exactly the HF processor's ``input_ids`` and ``pixel_values``. ``MMProcessor`` is the
LLaVA family; another (e.g. Qwen2-VL) subclasses it, overrides the hooks and joins ``FAMILIES``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import torch
import transformers
from huggingface_hub.dataclasses import validate_typed_dict
from PIL import Image
from transformers import AutoProcessor

from app.errors import InvalidRequestError
from app.hashing import canonical_option, framed_digest

MODEL_ID_DOMAIN = b"mmserve.model_id.v1"
KWARGS_PARAM = "mm_processor_kwargs"

# Image-processor kwargs a request may not set: they change where or in which layout tensors come out,
# not what the model sees, and the worker relies on the defaults.
_RESERVED_KWARGS = frozenset(
    {"return_tensors", "data_format", "input_data_format", "device", "disable_grouping", "image_seq_length"}
)

# Pixel sizes (ints or dicts of ints) that a request may set; bounded by MMProcessor.max_size_px.
_SIZE_KWARGS = frozenset({"size", "crop_size", "pad_size"})


@dataclass(frozen=True)
class ProcessedItem:
    """One image after the HF image processor: the model inputs and how many placeholder tokens
    (embeddings) it fills in the prompt."""

    tensors: dict[str, torch.Tensor]
    num_tokens: int

    @property
    def num_bytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors.values())


class MMProcessor:
    """LLaVA-family processing (llava-1.5 and look-alikes: one fixed-size image -> one placeholder run).

    Built once per API process; every method may run in a worker thread (none mutates state).
    """

    model_types: ClassVar[tuple[str, ...]] = ("llava",)
    modality: ClassVar[str] = "image"
    # Largest side, in pixels, a request may ask the image processor to resize, crop or pad to.
    max_size_px: ClassVar[int] = 4096

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        config_bytes = (self.model_dir / "config.json").read_bytes()
        self.config: dict[str, Any] = json.loads(config_bytes)
        model_type = self.config.get("model_type")
        if model_type not in self.model_types:
            raise ValueError(f"{type(self).__name__} handles {self.model_types}, not {model_type!r}")
        self.hf_processor = AutoProcessor.from_pretrained(self.model_dir, local_files_only=True)
        self.tokenizer = self.hf_processor.tokenizer
        self.image_processor = self.hf_processor.image_processor
        self.image_token: str = self.hf_processor.image_token
        self.image_token_id: int = self.hf_processor.image_token_id
        self.eos_token_ids: list[int] = _eos_token_ids(self.model_dir, self.tokenizer)
        # Everything that decides a processed item: model config, processor config (image processor,
        # patch size, feature strategy) and the transformers version that implements them. Weights
        # are left out: processed items do not depend on them.
        self.model_id = f"{model_type}:" + framed_digest(
            MODEL_ID_DOMAIN,
            config_bytes,
            self.hf_processor.to_json_string(),
            type(self.hf_processor).__name__,
            type(self.image_processor).__name__,
            transformers.__version__,
        )
        accepted = set(getattr(self.image_processor.valid_kwargs, "__annotations__", {}))
        self.accepted_kwargs: frozenset[str] = frozenset(accepted - _RESERVED_KWARGS)

    @staticmethod
    def from_pretrained(model_dir: str | Path) -> MMProcessor:
        """The processor class registered (in ``FAMILIES``) for the checkpoint's ``model_type``."""
        model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
        for cls in FAMILIES:
            if model_type in cls.model_types:
                return cls(model_dir)
        raise ValueError(f"Unsupported model_type {model_type!r}")

    # -- per request ------------------------------------------------------------------------------

    def hash_options(self, mm_processor_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """The validated, canonical image-processor options of a request; part of every mm_hash.

        Options equal to the processor's default are dropped (spelling out a default shares cache
        entries). Unknown or reserved names, wrong types, sizes out of bounds: InvalidRequestError.
        """
        if mm_processor_kwargs is None:
            return {}
        if not isinstance(mm_processor_kwargs, Mapping):
            raise InvalidRequestError("mm_processor_kwargs must be an object.", param=KWARGS_PARAM)
        unknown = sorted(str(key) for key in mm_processor_kwargs if key not in self.accepted_kwargs)
        if unknown:
            raise InvalidRequestError(
                f"Unsupported mm_processor_kwargs {unknown}; accepted: {sorted(self.accepted_kwargs)}.",
                param=KWARGS_PARAM,
            )
        try:
            validate_typed_dict(self.image_processor.valid_kwargs, dict(mm_processor_kwargs))
            options = {key: canonical_option(value) for key, value in mm_processor_kwargs.items()}
        except Exception as exc:  # huggingface_hub raises its own validation error types
            raise InvalidRequestError(f"Invalid mm_processor_kwargs: {exc}", param=KWARGS_PARAM) from exc
        for key in _SIZE_KWARGS.intersection(options):
            self._check_size_option(key, options[key])
        return {key: options[key] for key in sorted(options) if not self._is_default(key, options[key])}

    def render_prompt(self, messages: list[dict[str, Any]]) -> str:
        """Apply the model's chat template (generation prompt added) to OpenAI-style messages.

        Content is a string or a list of parts ``{"type": "text", "text": ...}`` / ``{"type": "image"}``
        (``image_url`` parts count as images too). Each image part becomes one ``image_token``.
        """
        conversation = [
            {"role": message.get("role"), "content": _normalise_content(message.get("content"), index)}
            for index, message in enumerate(messages)
        ]
        try:
            return self.hf_processor.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=False
            )
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
            raise InvalidRequestError(
                f"The chat template rejected the messages: {exc}", param="messages"
            ) from exc

    def process_image(
        self, image: Image.Image, mm_processor_kwargs: Mapping[str, Any] | None
    ) -> ProcessedItem:
        """Run the HF image processor on one decoded image (the step the processor cache skips)."""
        options = self.hash_options(mm_processor_kwargs)
        try:
            batch = self.image_processor([image], return_tensors="pt", **options)
        except Exception as exc:
            if not options:
                raise
            raise InvalidRequestError(
                f"mm_processor_kwargs could not be applied: {exc}", param=KWARGS_PARAM
            ) from exc
        tensors = {
            name: value.contiguous() for name, value in batch.items() if isinstance(value, torch.Tensor)
        }
        self._check_processed(tensors)
        return ProcessedItem(tensors=tensors, num_tokens=self._num_image_tokens(tensors))

    def tokenize(self, prompt: str, num_tokens_per_image: list[int]) -> tuple[list[int], list[int]]:
        """Token ids of ``prompt`` with the i-th image token expanded to ``num_tokens_per_image[i]``
        placeholders, and the offset of each image's placeholder run.

        Equals ``hf_processor(text=prompt, images=...).input_ids``, except that no second BOS is added
        when the chat template already wrote one (as ``apply_chat_template(tokenize=True)`` does).
        """
        pieces = prompt.split(self.image_token)
        if len(pieces) - 1 != len(num_tokens_per_image):
            raise InvalidRequestError(
                f"The prompt has {len(pieces) - 1} image placeholders ({self.image_token!r}) but the "
                f"request carries {len(num_tokens_per_image)} images.",
                param="messages",
            )
        expanded = pieces[0] + "".join(
            self._image_replacement(num_tokens) + piece
            for num_tokens, piece in zip(num_tokens_per_image, pieces[1:], strict=True)
        )
        bos = self.tokenizer.bos_token
        add_special_tokens = not (bos is not None and expanded.startswith(bos))
        token_ids: list[int] = self.tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"]
        return token_ids, self._placeholder_offsets(token_ids, num_tokens_per_image)

    def _check_size_option(self, key: str, option: Any) -> None:
        """Sizes a request asks for are bounded: the processor resizes before it crops, so an absurd
        ``size`` would allocate gigabytes before the result could be refused."""
        values = list(option.values()) if isinstance(option, dict) else option
        for value in values if isinstance(values, list) else [values]:
            if value is not None and (type(value) is not int or not 1 <= value <= self.max_size_px):
                raise InvalidRequestError(
                    f"mm_processor_kwargs.{key} sizes must be integers from 1 to {self.max_size_px}.",
                    param=KWARGS_PARAM,
                )

    def _is_default(self, key: str, option: Any) -> bool:
        try:
            default = canonical_option(getattr(self.image_processor, key, None))
        except TypeError:
            return False
        # Compared as hashed, so 1, 1.0 and True stay different.
        return framed_digest(b"", option) == framed_digest(b"", default)

    # -- family hooks -----------------------------------------------------------------------------

    def _num_image_tokens(self, tensors: dict[str, torch.Tensor]) -> int:
        """As ``LlavaProcessor.replace_image_token``: one token per patch of the processed image,
        plus the extra (CLS) tokens, minus the CLS one the "default" feature strategy drops."""
        height, width = tensors["pixel_values"].shape[-2:]
        patch_size = self.hf_processor.patch_size
        num_tokens = (height // patch_size) * (width // patch_size)
        num_tokens += self.hf_processor.num_additional_image_tokens
        if self.hf_processor.vision_feature_select_strategy == "default":
            num_tokens -= 1
        return int(num_tokens)

    def _check_processed(self, tensors: dict[str, torch.Tensor]) -> None:
        """LLaVA's vision tower takes exactly ``image_size`` squares; kwargs that resize or skip the crop
        would give it something it cannot encode, so such requests are refused here."""
        image_size = self.config.get("vision_config", {}).get("image_size")
        shape = tuple(tensors["pixel_values"].shape)
        if image_size is not None and shape[-2:] != (image_size, image_size):
            raise InvalidRequestError(
                f"mm_processor_kwargs give {shape[-2]}x{shape[-1]} pixel inputs; this model's vision "
                f"encoder takes {image_size}x{image_size}.",
                param=KWARGS_PARAM,
            )

    def _image_replacement(self, num_tokens: int) -> str:
        return self.image_token * num_tokens

    def _placeholder_offsets(self, token_ids: list[int], num_tokens_per_image: list[int]) -> list[int]:
        positions = [index for index, token_id in enumerate(token_ids) if token_id == self.image_token_id]
        if len(positions) != sum(num_tokens_per_image):
            raise InvalidRequestError(
                f"The prompt has {len(positions)} image tokens, expected {sum(num_tokens_per_image)}.",
                param="messages",
            )
        offsets, start = [], 0
        for num_tokens in num_tokens_per_image:
            run = positions[start : start + num_tokens]
            assert run[-1] - run[0] == num_tokens - 1, "an image's placeholder run is not contiguous"
            offsets.append(run[0])
            start += num_tokens
        return offsets


# A new family: subclass MMProcessor, override the hooks, append the class here.
FAMILIES: list[type[MMProcessor]] = [MMProcessor]


def _normalise_content(content: Any, message_index: int) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    parts: list[dict[str, Any]] = []
    for part_index, part in enumerate(content):
        part_type = part.get("type") if isinstance(part, Mapping) else None
        if part_type == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif part_type in ("image", "image_url"):
            parts.append({"type": "image"})
        else:
            raise InvalidRequestError(
                f"Unsupported content part {part_type!r}.",
                param=f"messages[{message_index}].content[{part_index}]",
            )
    return parts


def _eos_token_ids(model_dir: Path, tokenizer: Any) -> list[int]:
    """The tokenizer's EOS plus every EOS the generation config lists, in that order, without repeats."""
    candidates: list[Any] = [tokenizer.eos_token_id]
    generation_config = model_dir / "generation_config.json"
    if generation_config.exists():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        candidates.extend(eos if isinstance(eos, list) else [eos])
    return list(dict.fromkeys(int(token_id) for token_id in candidates if token_id is not None))
