"""transformers' own processor of a checkpoint, for the tests' oracles: never the product's processing.

LLaVA's loads as ``AutoProcessor`` does. A Qwen-VL checkpoint names its processor class
(``Qwen2_5_VLProcessor``, ...) in ``preprocessor_config.json``; ``AutoProcessor`` would also build that
class's video processor, which needs torchvision, absent from the test process on purpose (it would switch
every image processor to its torchvision backend: tests/reference/setup_env.py). So for images the saved
class is loaded by its own ``from_pretrained`` without the video half: the same image processor
(``AutoImageProcessor``, the PIL backend here), tokenizer, chat template and ``__call__``. Videos go
through the reference environment instead (tests/reference/client.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import transformers


def saved_processor_class(model_dir: Path) -> type[Any]:
    """The processor class a Qwen-VL checkpoint's ``preprocessor_config.json`` names."""
    config = json.loads((model_dir / "preprocessor_config.json").read_text())
    return getattr(transformers, config["processor_class"])  # type: ignore[no-any-return]


def image_only(processor_class: type[Any]) -> type[Any]:
    """``processor_class`` without its video processor: ``from_pretrained`` loads every other part as
    the class itself does, and ``video_processor`` stays None."""

    class ImageOnly(processor_class):  # type: ignore[misc, valid-type]
        @classmethod
        def get_attributes(cls) -> list[str]:
            return [name for name in super().get_attributes() if name != "video_processor"]

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImageOnly.__name__ = ImageOnly.__qualname__ = f"ImageOnly{processor_class.__name__}"
    return ImageOnly


def stock_processor(model_dir: Path) -> Any:
    """transformers' processor for ``model_dir``'s images and text (see the module's docstring)."""
    # The PIL backend, as the product: where torchvision is installed (the GPU tier's machine),
    # transformers would otherwise pick its torchvision one, whose resize differs.
    if not (model_dir / "preprocessor_config.json").exists():  # LLaVA: processor_config.json only
        return transformers.AutoProcessor.from_pretrained(model_dir, local_files_only=True, backend="pil")
    processor_class = image_only(saved_processor_class(model_dir))
    return processor_class.from_pretrained(model_dir, local_files_only=True, backend="pil")
