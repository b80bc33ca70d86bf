"""A family's API half reduced to what ``InputProcessor.prepare`` reads, for tests of fetching and hashing
that need no checkpoint: a prompt of no text, image options passed through, images only."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def prepare_only_family(hash_options: Any = dict) -> Any:
    return SimpleNamespace(
        hash_options=hash_options,
        supports_video=False,
        render_prompt=lambda messages, template=None: "",
        model_id="m",
        image_token="<image>",
        image_token_id=0,
        video_token_id=None,
        placeholder_token=lambda modality: "<image>",
        tokenizer=SimpleNamespace(bos_token=None, get_added_vocab=lambda: {"<image>": 0}),
        hf_processor=SimpleNamespace(chat_template=""),
        chat_template_override=None,
        tool_chat_template=None,
    )
