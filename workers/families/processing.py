"""The API half of a model family: the checkpoint's own HF processor, split into the steps the API runs
apart (the middle one is skipped on a processor-cache hit or an IPC hit)::

    render_prompt(messages)            chat template -> text with one image token per image
    process_image(image, options)      one image -> tensors, placeholder count and grid (cached by mm_hash)
    tokenize(prompt, num_tokens)       expand each image token, tokenize -> ids + placeholder offsets

Together they give exactly the HF processor's ``input_ids`` and pixel tensors. ``FamilyProcessor`` holds
what every family shares; a family subclasses it and fills in the hooks at the bottom (how its HF
processor is loaded, how many placeholders and which grid an item gets, which options a request may set,
the largest item its settings can produce). See docs/architecture.md, "Model families".
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

from wire.hashing import canonical_option, framed_digest
from workers.families.errors import FamilyInputError

MODEL_ID_DOMAIN = b"mmserve.model_id.v1"
KWARGS_PARAM = "mm_processor_kwargs"

# Image-processor kwargs no request may set: they change where or in which layout tensors come out,
# not what the model sees, and the worker relies on the defaults.
_RESERVED_KWARGS = frozenset(
    {"return_tensors", "data_format", "input_data_format", "device", "disable_grouping", "image_seq_length"}
)


@dataclass(frozen=True)
class ProcessedItem:
    """One image after the HF image processor: the model inputs, how many placeholder tokens
    (embeddings) it fills in the prompt, and the family's grid of them (Qwen: (t, h, w) in patches,
    as ``image_grid_thw``; empty where positions do not depend on it)."""

    tensors: dict[str, torch.Tensor]
    num_tokens: int
    grid_thw: tuple[int, ...] = ()

    @property
    def num_bytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors.values())


class FamilyProcessor:
    """Built once per API process; every method may run in a thread (none mutates state)."""

    # Largest side, in pixels, a request may ask the image processor to resize, crop or pad to.
    max_size_px: ClassVar[int] = 4096
    # Options that are sizes in pixels (ints or dicts of ints), bounded by ``max_size_px``.
    size_kwargs: ClassVar[frozenset[str]] = frozenset({"size", "crop_size", "pad_size"})
    # Options this family's model cannot take from a request (they must match the weights).
    reserved_kwargs: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        config_bytes = (self.model_dir / "config.json").read_bytes()
        self.config: dict[str, Any] = json.loads(config_bytes)
        self.hf_processor = self.load_hf_processor(self.model_dir)
        self.tokenizer = self.hf_processor.tokenizer
        self.image_processor = self.hf_processor.image_processor
        self.image_token: str = self.hf_processor.image_token
        self.image_token_id: int = self.hf_processor.image_token_id
        self.eos_token_ids: list[int] = _eos_token_ids(self.model_dir, self.tokenizer)
        # Everything that decides a processed item: model config, processor config and the
        # transformers version that implements them. Weights are left out: items do not depend on them.
        self.model_id = f"{self.config.get('model_type')}:" + framed_digest(
            MODEL_ID_DOMAIN,
            config_bytes,
            self.hf_processor.to_json_string(),
            type(self.hf_processor).__name__,
            type(self.image_processor).__name__,
            transformers.__version__,
        )
        accepted = set(getattr(self.image_processor.valid_kwargs, "__annotations__", {}))
        self.accepted_kwargs: frozenset[str] = frozenset(accepted - _RESERVED_KWARGS - self.reserved_kwargs)

    # -- per request ------------------------------------------------------------------------------

    def hash_options(self, mm_processor_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """The validated, canonical image-processor options of a request; part of every mm_hash.

        Options equal to the processor's default are dropped (spelling out a default shares cache
        entries). Unknown or reserved names, wrong types, sizes out of bounds: FamilyInputError.
        """
        if mm_processor_kwargs is None:
            return {}
        if not isinstance(mm_processor_kwargs, Mapping):
            raise FamilyInputError("mm_processor_kwargs must be an object.", param=KWARGS_PARAM)
        unknown = sorted(str(key) for key in mm_processor_kwargs if key not in self.accepted_kwargs)
        if unknown:
            raise FamilyInputError(
                f"Unsupported mm_processor_kwargs {unknown}; accepted: {sorted(self.accepted_kwargs)}.",
                param=KWARGS_PARAM,
            )
        try:
            validate_typed_dict(self.image_processor.valid_kwargs, dict(mm_processor_kwargs))
            options = {key: canonical_option(value) for key, value in mm_processor_kwargs.items()}
        except Exception as exc:  # huggingface_hub raises its own validation error types
            raise FamilyInputError(f"Invalid mm_processor_kwargs: {exc}", param=KWARGS_PARAM) from exc
        for key in self.size_kwargs.intersection(options):
            self._check_size_option(key, options[key])
        self.check_options(options)
        return {key: options[key] for key in sorted(options) if not self._is_default(key, options[key])}

    def render_prompt(self, messages: list[dict[str, Any]]) -> str:
        """Apply the model's chat template (generation prompt added) to chat-template messages whose
        content is a string or a list of ``{"type": "text", "text": ...}`` / ``{"type": "image"}``
        parts. Each image part becomes one ``image_token`` (inside the family's image markers)."""
        try:
            return self.hf_processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
            raise FamilyInputError(
                f"The chat template rejected the messages: {exc}", param="messages"
            ) from exc

    def process_image(self, image: Image.Image, options: Mapping[str, Any], *, param: str) -> ProcessedItem:
        """Run the HF image processor on one decoded image (the step the caches skip). ``options`` come
        from ``hash_options``. An image the processor cannot take (too small, too elongated, options
        that contradict each other) is the request's fault: FamilyInputError naming ``param`` or
        the options."""
        try:
            batch = self.image_processor([image], return_tensors="pt", **options)
        except (ValueError, TypeError, ZeroDivisionError) as exc:
            raise FamilyInputError(
                f"The image processor could not process this image: {exc}",
                param=KWARGS_PARAM if options else param,
            ) from exc
        tensors = {
            name: value.contiguous() for name, value in batch.items() if isinstance(value, torch.Tensor)
        }
        self.check_processed(tensors)
        num_tokens, grid_thw = self.item_layout(tensors)
        return ProcessedItem(tensors=tensors, num_tokens=num_tokens, grid_thw=grid_thw)

    def tokenize(self, prompt: str, num_tokens_per_image: list[int]) -> tuple[list[int], list[int]]:
        """Token ids of ``prompt`` with the i-th image token expanded to ``num_tokens_per_image[i]``
        placeholders, and the offset of each image's placeholder run.

        Equals ``hf_processor(text=prompt, images=...).input_ids``, except that no second BOS is added
        when the chat template already wrote one (as ``apply_chat_template(tokenize=True)`` does).
        """
        pieces = prompt.split(self.image_token)
        if len(pieces) - 1 != len(num_tokens_per_image):
            raise FamilyInputError(
                f"The prompt has {len(pieces) - 1} image placeholders ({self.image_token!r}) but the "
                f"request carries {len(num_tokens_per_image)} images.",
                param="messages",
            )
        expanded = pieces[0] + "".join(
            self.image_token * num_tokens + piece
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
                raise FamilyInputError(
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

    def _placeholder_offsets(self, token_ids: list[int], num_tokens_per_image: list[int]) -> list[int]:
        positions = [index for index, token_id in enumerate(token_ids) if token_id == self.image_token_id]
        if len(positions) != sum(num_tokens_per_image):
            raise FamilyInputError(
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

    # -- family hooks -----------------------------------------------------------------------------

    @classmethod
    def load_hf_processor(cls, model_dir: Path) -> Any:
        """The checkpoint's processor: ``tokenizer``, ``image_processor``, ``image_token(_id)`` and
        ``apply_chat_template``."""
        raise NotImplementedError

    def item_layout(self, tensors: dict[str, torch.Tensor]) -> tuple[int, tuple[int, ...]]:
        """(number of placeholder tokens, grid) of one processed item."""
        raise NotImplementedError

    def check_options(self, options: dict[str, Any]) -> None:
        """Family-specific checks of a request's options (FamilyInputError naming the option)."""

    def check_processed(self, tensors: dict[str, torch.Tensor]) -> None:
        """Refuse a processed item the model could not encode (FamilyInputError)."""


def _eos_token_ids(model_dir: Path, tokenizer: Any) -> list[int]:
    """The tokenizer's EOS plus every EOS the generation config lists, in that order, without repeats."""
    candidates: list[Any] = [tokenizer.eos_token_id]
    generation_config = model_dir / "generation_config.json"
    if generation_config.exists():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        candidates.extend(eos if isinstance(eos, list) else [eos])
    return list(dict.fromkeys(int(token_id) for token_id in candidates if token_id is not None))
