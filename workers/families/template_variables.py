"""A request's ``chat_template_kwargs`` (vLLM's field): variables for the chat template, such as
``enable_thinking``. They reach the template by the names it reads and does not set itself (as vLLM
passes them); a name the template does not read changes nothing. Names that apply_chat_template or the
render set (the messages, the tools, the generation prompt, the tokenizer's special tokens, …) are
refused at the HTTP edge (``refused_name``) and never passed on."""

from __future__ import annotations

import json
from typing import Any

import jinja2
import jinja2.meta

from workers.families.errors import FamilyInputError

# what apply_chat_template and the render itself set; every name starting with "_" as well
RESERVED = frozenset(
    {
        "messages",
        "conversation",
        "conversations",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "sanitize_control_tokens",
        "processor_kwargs",
        "tokenizer_kwargs",
        "load_audio_from_video",
        "raise_exception",
        "strftime_now",
    }
)


class TemplateVariables:
    """Built once per family processor; ``special_tokens``: the tokenizer's special-token names (the
    template is given them)."""

    def __init__(self, special_tokens: frozenset[str]) -> None:
        self.special_tokens = special_tokens
        self._read: dict[str, frozenset[str]] = {}  # a template's text -> the variables it reads

    def refused_name(self, name: str) -> bool:
        return (
            name in RESERVED or name in self.special_tokens or name.startswith("_") or not name.isidentifier()
        )

    def given(self, template: Any, variables: str | None, documents: str | None = None) -> dict[str, Any]:
        """Of ``variables`` (JSON text of an object), those ``template`` reads, to pass to its render; and
        ``documents`` (JSON text of a list, vLLM's), which a template that does not read them refuses: a
        400, not documents the model never sees."""
        read = self.read(template)
        given = {}
        if variables is not None:
            given = {k: v for k, v in json.loads(variables).items() if k in read and not self.refused_name(k)}
        if documents is not None:
            if "documents" not in read:
                raise FamilyInputError(
                    "This model's chat template does not read documents: they would not reach the model. "
                    "Put them in the messages, or serve a template that renders them (--chat-template).",
                    param="documents",
                )
            given["documents"] = json.loads(documents)
        return given

    def read(self, template: Any) -> frozenset[str]:
        """The variables a template's text reads that it does not set itself."""
        if not isinstance(template, str):
            return frozenset()
        found = self._read.get(template)
        if found is None:
            found = frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template)))
            self._read[template] = found
        return found
