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

import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import jinja2
import numpy as np
import torch
import transformers
from huggingface_hub.dataclasses import validate_typed_dict
from PIL import Image

from wire.hashing import canonical_option, framed_digest
from workers.families import check_tool_call_parser
from workers.families.errors import FamilyInputError
from workers.families.template_variables import TemplateVariables

MODEL_ID_DOMAIN = b"mmserve.model_id.v1"
VIDEO_CONFIG_FILE = "video_preprocessor_config.json"  # as transformers writes a checkpoint's
KWARGS_PARAM = "mm_processor_kwargs"
# An image's longer side may be at most this many times its shorter one: Qwen-VL's own bound
# (transformers' smart_resize), for every family. Past it a family that scales the shorter side up
# makes a huge intermediate image (LLaVA: 1x10000 pixels become 336x3,360,000, 11 GB).
MAX_ASPECT_RATIO = 200

# Image-processor kwargs no request may set: they change where or in which layout tensors come out,
# not what the model sees, and the worker relies on the defaults.
_RESERVED_KWARGS = frozenset(
    {"return_tensors", "data_format", "input_data_format", "device", "disable_grouping", "image_seq_length"}
)


@dataclass(frozen=True)
class VideoMetadata:
    """What a clip's header says, as the family's sampling needs it."""

    fps: float  # the stream's average frame rate
    num_frames: int  # frames in the stream


class Tokenized(NamedTuple):
    """A prompt's token ids and, per item, the (first, end) token index of its span."""

    token_ids: list[int]
    spans: list[tuple[int, int]]


@dataclass(frozen=True)
class ItemLayout:
    """How one processed item sits in a prompt, without its tensors: what a cache that keeps no
    tensors (the IPC mirror) still needs to place the item.

    ``num_tokens``: placeholder tokens (encoder output rows); ``grid_thw``: the family's grid of them
    (Qwen: (t, h, w) in patches, which decides their M-RoPE positions; empty where positions do not
    depend on it). Videos also carry what their frames' times decide: ``timestamps`` (seconds of each
    temporal group, which Qwen3-VL writes into the prompt) and ``second_per_grid_t`` (Qwen2.5-VL's
    spacing of the groups on the time axis)."""

    num_tokens: int
    grid_thw: tuple[int, ...] = ()
    modality: str = "image"
    timestamps: tuple[float, ...] = ()
    second_per_grid_t: float | None = None


@dataclass(frozen=True)
class ProcessedItem:
    """One image or video after the family's processor: the model inputs and their ``layout``."""

    tensors: dict[str, torch.Tensor]
    layout: ItemLayout

    @property
    def num_tokens(self) -> int:
        return self.layout.num_tokens

    @property
    def grid_thw(self) -> tuple[int, ...]:
        return self.layout.grid_thw

    @property
    def num_bytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors.values())


class TemplateOptions(NamedTuple):
    """How a chat template ends the prompt (vLLM's request fields of the same names), the request's
    tools as JSON text (None renders with the processor's template; a list, ``"[]"`` where only the
    history has tool calls or results, with the family's template that has tools), its
    ``chat_template_kwargs`` (JSON of an object) and its ``documents`` (vLLM's; JSON of a list)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: str | None = None
    variables: str | None = None
    documents: str | None = None


DEFAULT_TEMPLATE = TemplateOptions()


class FamilyProcessor:
    """Built once per API process; every method may run in a thread (none mutates state)."""

    # Largest side, in pixels, a request may ask the image processor to resize, crop or pad to.
    max_size_px: ClassVar[int] = 4096
    # Options that are sizes in pixels (ints or dicts of ints), bounded by ``max_size_px``.
    size_kwargs: ClassVar[frozenset[str]] = frozenset({"size", "crop_size", "pad_size"})
    # Options this family's model cannot take from a request (they must match the weights).
    reserved_kwargs: ClassVar[frozenset[str]] = frozenset()
    # How the family's models write tool calls (app/api/tool_calls.py), where its template has tools.
    default_tool_call_parser: ClassVar[str | None] = None

    def __init__(
        self, model_dir: str | Path, *, chat_template: str | None = None, tool_call_parser: str | None = None
    ) -> None:
        """``chat_template``: a template (its text) that replaces the checkpoint's for every request, tools
        included (``--chat-template``); ``tool_call_parser``: the syntax of the model's tool calls, over the
        family's default (``--tool-call-parser``)."""
        self.model_dir = Path(model_dir)
        config_bytes = (self.model_dir / "config.json").read_bytes()
        self.config: dict[str, Any] = json.loads(config_bytes)
        self.hf_processor = self.load_hf_processor(self.model_dir)
        self.tokenizer = self.hf_processor.tokenizer
        self.image_processor = self.hf_processor.image_processor
        self.image_token: str = self.hf_processor.image_token
        self.image_token_id: int = self.hf_processor.image_token_id
        # Set by a family that takes videos, when the checkpoint has a video processor config.
        self.video_token: str | None = None
        self.video_token_id: int | None = None
        self.video_kwargs: frozenset[str] = frozenset()  # the request options its video processing takes
        self.eos_token_ids: list[int] = _eos_token_ids(self.model_dir, self.tokenizer)
        # the language model's output width (ids a request may bias, allow or stop on are below it)
        text_config = self.config.get("text_config") or self.config
        self.vocab_size: int = int(text_config.get("vocab_size") or len(self.tokenizer))
        video_config = self.model_dir / VIDEO_CONFIG_FILE
        # Everything that decides a processed item: model config, processor config and the
        # transformers version that implements them. Weights are left out: items do not depend on them.
        self.model_id = f"{self.config.get('model_type')}:" + framed_digest(
            MODEL_ID_DOMAIN,
            config_bytes,
            self.hf_processor.to_json_string(),
            type(self.hf_processor).__name__,
            type(self.image_processor).__name__,
            transformers.__version__,
            video_config.read_bytes() if video_config.is_file() else b"",
        )
        # The templates decide the prompt text only, never a processed item: they stay out of model_id.
        self.chat_template_override = chat_template
        # the template that renders tools: the given one where it has them (none where it has not), else
        # the processor's where it has them, else the tokenizer's (a real Qwen2.5-VL's processor template
        # has none; its tokenizer's, Qwen2.5's, has)
        candidates = (
            (chat_template,)
            if chat_template is not None
            else (self.hf_processor.chat_template, self.tokenizer.chat_template)
        )
        self.tool_chat_template: str | None = next((t for t in candidates if _has_tools(t)), None)
        self.template_variables = TemplateVariables(frozenset(self.tokenizer.special_tokens_map))
        self.tool_call_parser: str | None = (
            check_tool_call_parser(tool_call_parser)
            if tool_call_parser is not None
            else self.default_tool_call_parser
        )
        hints = getattr(self.image_processor.valid_kwargs, "__annotations__", {})
        self.accepted_kwargs: frozenset[str] = frozenset(set(hints) - _RESERVED_KWARGS - self.reserved_kwargs)
        # options typed as floats and not ints (image_mean, image_std, rescale_factor); a hint may be a
        # type or its text
        self.float_kwargs = frozenset(
            key for key, hint in hints.items() if "float" in str(hint) and "int" not in str(hint)
        )

    # -- per request ------------------------------------------------------------------------------

    def hash_options(self, mm_processor_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """The validated, canonical image-processor options of a request; part of every mm_hash.

        Options equal to the processor's default are dropped (spelling out a default shares cache
        entries). Unknown or reserved names, wrong types, sizes out of bounds: FamilyInputError.
        """
        if mm_processor_kwargs is None:
            return {}
        image_kwargs = self.options_for(mm_processor_kwargs, self.accepted_kwargs)
        # JSON writes 0.0 as 0 (JavaScript always does): an integer where the processor takes floats is one
        image_kwargs = {
            key: _as_floats(value) if key in self.float_kwargs else value
            for key, value in image_kwargs.items()
        }
        try:
            validate_typed_dict(self.image_processor.valid_kwargs, image_kwargs)
            options = {key: canonical_option(value) for key, value in image_kwargs.items()}
        except Exception as exc:  # huggingface_hub raises its own validation error types
            raise FamilyInputError(f"Invalid mm_processor_kwargs: {exc}", param=KWARGS_PARAM) from exc
        for key in self.size_kwargs.intersection(options):
            self._check_size_option(key, options[key])
        for key, value in options.items():
            if not _all_finite(value):
                raise FamilyInputError(
                    f"mm_processor_kwargs.{key} must be finite numbers, not {value!r}.", param=KWARGS_PARAM
                )
        self.check_options(options)
        return {key: options[key] for key in sorted(options) if not self._is_default(key, options[key])}

    def options_for(self, mm_processor_kwargs: Mapping[str, Any], accepted: frozenset[str]) -> dict[str, Any]:
        """The request's options that one modality's processing takes (``accepted``); names that neither
        the image nor the video processing takes are refused."""
        if not isinstance(mm_processor_kwargs, Mapping):
            raise FamilyInputError("mm_processor_kwargs must be an object.", param=KWARGS_PARAM)
        known = self.accepted_kwargs | self.video_kwargs
        unknown = sorted(str(key) for key in mm_processor_kwargs if key not in known)
        if unknown:
            raise FamilyInputError(
                f"Unsupported mm_processor_kwargs {unknown}; accepted: {sorted(known)}.", param=KWARGS_PARAM
            )
        return {key: value for key, value in mm_processor_kwargs.items() if key in accepted}

    def render_prompt(
        self, messages: list[dict[str, Any]], template: TemplateOptions = DEFAULT_TEMPLATE
    ) -> str:
        """Apply the model's chat template to chat-template messages whose content is a string or a list
        of ``{"type": "text", "text": ...}`` / ``{"type": "image"}`` parts. Each image part becomes one
        ``image_token`` (inside the family's image markers). ``template``: the generation prompt added
        (the default), or the last message left open for the model to continue."""
        chat_template = self.chat_template_override  # None: the processor's own
        tool_kwargs: dict[str, Any] = {}
        if template.tools is not None:
            if self.tool_chat_template is None:
                raise FamilyInputError(
                    "This model's chat template has no tool format: tools, tool calls and tool messages "
                    "cannot be rendered.",
                    param="tools",
                )
            chat_template = self.tool_chat_template
            tool_kwargs = {"tools": json.loads(template.tools) or None}
        text = chat_template if chat_template is not None else self.hf_processor.chat_template
        tool_kwargs |= self.template_variables.given(text, template.variables, template.documents)
        try:
            return self.hf_processor.apply_chat_template(
                messages,
                chat_template=chat_template,
                add_generation_prompt=template.add_generation_prompt,
                continue_final_message=template.continue_final_message,
                tokenize=False,
                **tool_kwargs,
            )
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
            raise FamilyInputError(
                f"The chat template rejected the messages: {exc}", param="messages"
            ) from exc

    def process_image(self, image: Image.Image, options: Mapping[str, Any], *, param: str) -> ProcessedItem:
        """Run the HF image processor on one decoded image (the step the caches skip). ``options`` come
        from ``hash_options``. An image the processor cannot take (too small, too elongated, options
        that contradict each other) is the request's fault: FamilyInputError naming ``param`` or
        the options."""
        width, height = image.size
        if aspect_ratio_too_large(width, height):
            raise FamilyInputError(
                f"The image is {width}x{height} pixels: its longer side may be at most {MAX_ASPECT_RATIO} "
                "times its shorter one.",
                param=param,
                code="image_aspect_ratio_too_large",
            )
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
        # options the processor takes can still make pixels of no number (an image_std of 0 or 1e-300):
        # the model would answer NaN. The processor's defaults never do, so only options cost the check.
        if options and not all(t.isfinite().all() for t in tensors.values() if t.is_floating_point()):
            raise FamilyInputError(
                "These mm_processor_kwargs make pixel values that are not finite numbers.", param=KWARGS_PARAM
            )
        self.check_processed(tensors)
        num_tokens, grid_thw = self.item_layout(tensors)
        return ProcessedItem(tensors, ItemLayout(num_tokens, grid_thw))

    def tokenize(self, prompt: str, layouts: Sequence[ItemLayout]) -> Tokenized:
        """Token ids of ``prompt`` with the i-th media token (image or video, in prompt order) written
        out as ``layouts[i]`` says (``placeholder_pieces``), and each item's span in those ids.

        Equals ``hf_processor(text=prompt, images=..., videos=...).input_ids``, except that no second BOS
        is added when the chat template already wrote one (as ``apply_chat_template(tokenize=True)``
        does).
        """
        media_tokens = self.media_tokens_in(prompt)
        if [m for m, _ in media_tokens] != [layout.modality for layout in layouts]:
            raise FamilyInputError(
                f"The prompt has {len(media_tokens)} media placeholders "
                f"({', '.join(m for m, _ in media_tokens) or 'none'}) but the request carries "
                f"{len(layouts)} items ({', '.join(layout.modality for layout in layouts) or 'none'}).",
                param="messages",
            )
        expanded, start = [], 0
        for (modality, at), layout in zip(media_tokens, layouts, strict=True):
            expanded.append(prompt[start:at])
            pad = self.placeholder_token(modality)
            expanded.extend(text + pad * num_pads for text, num_pads in self.placeholder_pieces(layout))
            start = at + len(pad)
        expanded.append(prompt[start:])
        text = "".join(expanded)
        bos = self.tokenizer.bos_token
        add_special_tokens = not (bos is not None and text.startswith(bos))
        token_ids: list[int] = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        return Tokenized(token_ids, self._spans(token_ids, layouts))

    def media_tokens_in(self, prompt: str) -> list[tuple[str, int]]:
        """(modality, character index) of each image and video token in ``prompt``, in order."""
        tokens = {"image": self.image_token}
        if self.video_token is not None:
            tokens["video"] = self.video_token
        found = [(m, i) for m, token in tokens.items() for i in _find_all(prompt, token)]
        return sorted(found, key=lambda found_at: found_at[1])

    def placeholder_token(self, modality: str) -> str:
        return self.video_token if modality == "video" and self.video_token is not None else self.image_token

    def placeholder_token_id(self, modality: str) -> int:
        if modality == "video" and self.video_token_id is not None:
            return self.video_token_id
        return self.image_token_id

    def placeholder_pieces(self, layout: ItemLayout) -> list[tuple[str, int]]:
        """What an item's media token becomes in the prompt, in order: (text, placeholder tokens after
        it) pieces. One run of ``num_tokens`` placeholders unless the family writes text between them
        (Qwen3-VL: a timestamp before each frame group of a video)."""
        return [("", layout.num_tokens)]

    def piece_token_ids(self, text: str) -> list[int]:
        """The ids of a piece's text. Pieces lie between special tokens (or placeholders), so their
        ids do not depend on the text around them."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

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

    def _spans(self, token_ids: list[int], layouts: Sequence[ItemLayout]) -> list[tuple[int, int]]:
        """(first, end) token index of each item's expansion: its placeholders, and the text of its
        first and last pieces around them."""
        spans: list[tuple[int, int]] = []
        positions = {
            modality: iter([i for i, t in enumerate(token_ids) if t == self.placeholder_token_id(modality)])
            for modality in {layout.modality for layout in layouts}
        }
        for layout in layouts:
            run = list(itertools.islice(positions[layout.modality], layout.num_tokens))
            if not run or len(run) != layout.num_tokens:
                raise FamilyInputError(
                    f"The prompt has fewer {layout.modality} tokens than its items need.", param="messages"
                )
            pieces = self.placeholder_pieces(layout)
            first = run[0] - len(self.piece_token_ids(pieces[0][0]))
            end = run[-1] + 1 + (len(self.piece_token_ids(pieces[-1][0])) if pieces[-1][1] == 0 else 0)
            if len(pieces) == 1:
                assert run[-1] - run[0] == layout.num_tokens - 1, (
                    "an item's placeholder run is not contiguous"
                )
            spans.append((first, end))
        for modality, rest in positions.items():
            if next(rest, None) is not None:
                raise FamilyInputError(
                    f"The prompt has more {modality} tokens than its items.", param="messages"
                )
        return spans

    # -- video: families that take videos override these -------------------------------------------

    @property
    def supports_video(self) -> bool:
        return self.video_token is not None

    def hash_video_options(self, mm_processor_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """The validated, canonical video options of a request (sampling, per-frame pixel bounds); part
        of every video's mm_hash."""
        raise NotImplementedError

    def sample_video(self, metadata: VideoMetadata, options: Mapping[str, Any]) -> list[int]:
        """The frame indices the family's video processor samples from a clip (FamilyInputError when
        the clip cannot give the sampling asked for)."""
        raise NotImplementedError

    @property
    def min_video_frames(self) -> int:
        """The fewest sampled frames the family's video processor takes."""
        return 1

    def process_video(
        self, frames: np.ndarray, metadata: VideoMetadata, indices: Sequence[int], options: Mapping[str, Any]
    ) -> ProcessedItem:
        """The video processor on the sampled ``frames`` (uint8 [T, H, W, 3]; ``indices`` are their
        frame numbers in the clip)."""
        raise NotImplementedError

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


def aspect_ratio_too_large(width: int, height: int) -> bool:
    """Whether an image's or a video frame's longer side is over ``MAX_ASPECT_RATIO`` times its shorter one
    (Qwen's own bound, applied to every family)."""
    return max(width, height) > MAX_ASPECT_RATIO * min(width, height)


def _as_floats(value: Any) -> Any:
    """An option's integers (not booleans), in it or in a list or tuple of it, as floats."""
    if isinstance(value, (list, tuple)):
        return type(value)(_as_floats(v) for v in value)
    if type(value) is int and abs(value) <= 2**53:  # a larger one is left for the type check to refuse
        return float(value)
    return value


def _all_finite(value: Any) -> bool:
    """Whether every number in an option's value (a number, or lists and objects of them) is finite."""
    if isinstance(value, (list, tuple)):
        return all(_all_finite(v) for v in value)
    if isinstance(value, Mapping):
        return all(_all_finite(v) for v in value.values())
    return not isinstance(value, float) or math.isfinite(value)


def _has_tools(template: Any) -> bool:
    """Whether a chat template renders the request's ``tools`` (and so tool calls and results)."""
    return (
        isinstance(template, str) and re.search(r"\bif tools\b|\btools\s*(\||is|%|\))", template) is not None
    )


def _find_all(text: str, token: str) -> list[int]:
    found, at = [], text.find(token)
    while at != -1:
        found.append(at)
        at = text.find(token, at + len(token))
    return found


def _eos_token_ids(model_dir: Path, tokenizer: Any) -> list[int]:
    """The tokenizer's EOS plus every EOS the generation config lists, in that order, without repeats."""
    candidates: list[Any] = [tokenizer.eos_token_id]
    generation_config = model_dir / "generation_config.json"
    if generation_config.exists():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        candidates.extend(eos if isinstance(eos, list) else [eos])
    return list(dict.fromkeys(int(token_id) for token_id in candidates if token_id is not None))
