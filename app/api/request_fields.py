"""Every chat-completions field OpenAI's API or vLLM defines that ``ChatCompletionRequest`` does not
implement, and what mmserve does with it (docs/api.md, "Request fields"): accepted without effect,
as OpenAI or vLLM treat it for a self-hosted model, or refused with a 400 naming it unless it carries
its default. A field no spec knows, at the top or in a message or part, is accepted and logged once
per name (``UnknownFields``), as vLLM does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterable
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from app.errors import InvalidRequestError

log = logging.getLogger("mmserve.api")

MAX_WARNED_FIELDS = 256  # unknown field names remembered (and logged once each)
MAX_NAMES_LOGGED = 16  # per log line

# Accepted, with no effect on what mmserve does (each is a hint, a label or a hosted-service option).
WITHOUT_EFFECT = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "reasoning_effort",
        "verbosity",
        "length_penalty",  # beam search only
        "spaces_between_special_tokens",  # not read by fast tokenizers, as in vLLM
        "include_reasoning",  # the tiny families have no reasoning parser
        "session_id",
    }
)

_TOOLS = "it is OpenAI's deprecated form: use tools and tool_choice"
_NOT_SUPPORTED = ""  # no more to say
# Refused unless the value is one of the defaults given; the reason ends the 400's message.
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "audio": ((None,), "mmserve answers with text only"),
    "modalities": ((None, ["text"]), "mmserve answers with text only"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "mmserve has no web search"),
    "moderation": ((None,), "mmserve runs no moderation"),
    "functions": ((None, []), _TOOLS),
    "function_call": ((None, "none"), _TOOLS),
    "use_beam_search": ((None, False), "beam search is not supported"),
    "best_of": ((None, 1), "use n"),
    "chat_template": ((None,), "the model's own chat template is used"),
    "add_special_tokens": ((None, False), "the chat template adds the special tokens"),
    "media_io_kwargs": ((None,), "use mm_processor_kwargs"),
    "logits_processors": ((None, []), _NOT_SUPPORTED),
    "return_token_offsets": ((None, False), _NOT_SUPPORTED),
    "return_mm_kwargs": ((None, False), _NOT_SUPPORTED),
    "routed_experts_prompt_start": ((None, 0), _NOT_SUPPORTED),
    "mm_payload": ((None,), _NOT_SUPPORTED),
    "kv_transfer_params": ((None,), _NOT_SUPPORTED),
    "ec_transfer_params": ((None,), _NOT_SUPPORTED),
    "vllm_xargs": ((None,), _NOT_SUPPORTED),
    "repetition_detection": ((None,), _NOT_SUPPORTED),
    "watermarking": ((None, False), _NOT_SUPPORTED),
    "thinking_token_budget": ((None,), _NOT_SUPPORTED),
    # vLLM's earlier spellings of structured outputs
    "guided_json": ((None,), "it is vLLM's earlier spelling: use structured_outputs.json"),
    "guided_regex": ((None,), "it is vLLM's earlier spelling: use structured_outputs.regex"),
    "guided_choice": ((None,), "it is vLLM's earlier spelling: use structured_outputs.choice"),
    "guided_grammar": ((None,), "it is vLLM's earlier spelling: use structured_outputs.grammar"),
    "guided_decoding_backend": ((None,), "it is vLLM's earlier spelling, and mmserve has no equivalent"),
    "guided_whitespace_pattern": ((None,), "it is vLLM's earlier spelling, and mmserve has no equivalent"),
}


def is_default(value: Any, defaults: tuple[Any, ...]) -> bool:
    # == would take 0 for False and 1.0 for 1: a default must match in type too
    return any(value == default and type(value) is type(default) for default in defaults)


def drop_known_fields(body: Any, declared: Collection[str]) -> Any:
    """Called on the raw request body before validation: removes the fields accepted without effect and
    those refused that carry their default; raises (a validation error located at the field, so the
    400's ``param`` names it) for a refused one that does not. The model's ``declared`` fields and
    unknown ones pass on."""
    if not isinstance(body, dict):
        return body
    errors: list[InitErrorDetails] = []
    kept = {}
    for name, value in body.items():
        if name in declared:
            kept[name] = value
        elif name in WITHOUT_EFFECT:
            continue
        elif name in REFUSED:
            defaults, reason = REFUSED[name]
            if not is_default(value, defaults):
                msg = f"{name} is not supported" + (f": {reason}" if reason else "")
                error = PydanticCustomError("unsupported_field", msg)
                errors.append({"type": error, "loc": (name,), "input": value})
        else:
            kept[name] = value
    if errors:
        raise ValidationError.from_exception_data("ChatCompletionRequest", errors)
    return kept


def unknown_field_names(model: BaseModel, path: str = "") -> list[str]:
    """The names of a validated request's fields no model declares, at any depth, as paths without
    indices (``nmae``, ``messages[].nmae``, ``messages[].content[].cache_control``): what models that
    keep extras (``extra="allow"``) took and nothing reads."""
    names = [path + name for name in model.model_extra or {}]
    for field in type(model).model_fields:
        value = getattr(model, field)
        if isinstance(value, BaseModel):
            names += unknown_field_names(value, f"{path}{field}.")
        elif isinstance(value, list) and value and isinstance(value[0], BaseModel):
            for item in value:
                names += unknown_field_names(item, f"{path}{field}[].")
    return names


class UnknownFields:
    """Logs each unknown field name the first time a request sends it: the first ``MAX_WARNED_FIELDS``
    names, at most ``MAX_NAMES_LOGGED`` in a line, so that clients sending made-up names grow neither
    the memory nor the log without bound."""

    def __init__(self) -> None:
        self.warned: set[str] = set()

    def log(self, names: Iterable[str]) -> None:
        room = MAX_WARNED_FIELDS - len(self.warned)
        if room <= 0:
            return
        new = sorted(set(names) - self.warned)[:room]
        if not new:
            return
        self.warned.update(new)
        more = f" (and {len(new) - MAX_NAMES_LOGGED} more)" if len(new) > MAX_NAMES_LOGGED else ""
        log.warning("request fields mmserve does not know were ignored: %s%s", new[:MAX_NAMES_LOGGED], more)
        if len(self.warned) >= MAX_WARNED_FIELDS:
            log.warning("%d unknown field names logged: further ones are not", MAX_WARNED_FIELDS)


def template_variables(family: Any, variables: dict[str, Any] | None) -> str | None:
    """A request's ``chat_template_kwargs`` as ``TemplateOptions.variables`` (JSON text; None for none):
    a name the template is given by the render itself (workers/families/template_variables.py) is a 400
    naming it."""
    if not variables:
        return None
    for name in variables:
        if family.template_variables.refused_name(name):
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {name!r}: the chat template is given it by the server",
                param=f"chat_template_kwargs.{name}",
            )
    return json.dumps(variables, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
