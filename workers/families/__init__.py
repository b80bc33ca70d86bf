"""Model families: everything model-specific, one package per family, picked by ``config.model_type``.

    family      model_types    API half (processing.py)   worker half (model.py)   tiny checkpoint
    llava       llava          LlavaProcessing            LlavaModel               llava/tiny.py
    qwen2_vl    qwen2_vl       QwenVLProcessing           QwenVLModel              qwen_vl/tiny.py
    qwen2_5_vl  qwen2_5_vl     QwenVLProcessing           Qwen2_5_VLModel          qwen_vl/tiny.py
    qwen3_vl    qwen3_vl       QwenVLProcessing           Qwen3VLModel             qwen_vl/tiny.py

Nothing outside this package names a model. Halves are imported on first use, so a process loads only
the half it runs. The engine process uses neither: the launcher, building its config, asks the family's
``limits`` module for the largest item, which reads the folder's JSON files only (no torch, so the
engine and ``serve`` before it spawns its children start in a fraction of a second). A server may give
the API half another chat template and tool-call syntax than the checkpoint's and the family's
(``--chat-template``, read by chat_template.py; ``--tool-call-parser``, one of ``STRUCTURAL_TAG_FORMATS``).
See docs/architecture.md, "Model families".
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.families.model import FamilyModel
    from workers.families.processing import FamilyProcessor


class UnsupportedModelError(ValueError):
    """The checkpoint's ``model_type`` belongs to no registered family."""


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    processing_path: str  # "module:Class" of its FamilyProcessor
    model_path: str  # "module:Class" of its FamilyModel
    limits_module: str  # its torch-free limits read from the checkpoint's JSON

    @property
    def processing(self) -> type[FamilyProcessor]:
        return _load(self.processing_path)

    @property
    def model(self) -> type[FamilyModel]:
        return _load(self.model_path)


_QWEN_PROCESSING = "workers.families.qwen_vl.processing:QwenVLProcessing"
_QWEN_LIMITS = "workers.families.qwen_vl.limits"
FAMILIES: tuple[Family, ...] = (
    Family("llava", ("llava",), "workers.families.llava.processing:LlavaProcessing",
           "workers.families.llava.model:LlavaModel", "workers.families.llava.limits"),
    Family("qwen2_vl", ("qwen2_vl",), _QWEN_PROCESSING, "workers.families.qwen_vl.model:QwenVLModel",
           _QWEN_LIMITS),
    Family("qwen2_5_vl", ("qwen2_5_vl",), _QWEN_PROCESSING, "workers.families.qwen_vl.model:Qwen2_5_VLModel",
           _QWEN_LIMITS),
    Family("qwen3_vl", ("qwen3_vl",), _QWEN_PROCESSING, "workers.families.qwen_vl.model:Qwen3VLModel",
           _QWEN_LIMITS),
)  # fmt: skip


# Tool-call parsers (app/api/tool_calls.py reads their calls) -> xgrammar's structural-tag format of the
# calls. A family's default is its FamilyProcessor's ``default_tool_call_parser``; --tool-call-parser
# names another (with a --chat-template, chat_template.py, that renders tools).
STRUCTURAL_TAG_FORMATS = {"hermes": "qwen_3"}


def check_tool_call_parser(name: str) -> str:
    """``name`` where it is a known tool-call parser; ValueError listing the known ones otherwise."""
    if name not in STRUCTURAL_TAG_FORMATS:
        raise ValueError(
            f"unknown tool-call parser {name!r}; valid: {', '.join(sorted(STRUCTURAL_TAG_FORMATS))}"
        )
    return name


def model_type_of(model_dir: str | Path) -> str | None:
    return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")


def family_for(model_dir: str | Path) -> Family:
    """The family registered for the checkpoint's ``config.model_type``."""
    model_type = model_type_of(model_dir)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = sorted(t for family in FAMILIES for t in family.model_types)
    raise UnsupportedModelError(f"unsupported model_type {model_type!r}; supported: {supported}")


def load_processing(
    model_dir: str | Path, *, chat_template: str | None = None, tool_call_parser: str | None = None
) -> FamilyProcessor:
    """The API half for the checkpoint (loads its HF processor); ``chat_template`` (its text) and
    ``tool_call_parser`` replace the checkpoint's and the family's (workers/families/chat_template.py)."""
    processing = family_for(model_dir).processing
    return processing(model_dir, chat_template=chat_template, tool_call_parser=tool_call_parser)


def largest_item_tokens(model_dir: str | Path, max_video_frames: int) -> int:
    """Placeholder tokens of the largest item the checkpoint's processor settings can produce (what
    vLLM's ``compute_encoder_budget`` derives its defaults from); JSON only, no torch."""
    limits = importlib.import_module(family_for(model_dir).limits_module)
    return int(limits.largest_item_tokens(Path(model_dir), max_video_frames))


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
