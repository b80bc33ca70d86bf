"""Every chat-completions field of OpenAI's API and of vLLM is implemented, accepted without effect, or
refused by name (app/api/request_fields.py); a field no spec knows is kept aside for the log."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.chat.completion_create_params import CompletionCreateParamsBase
from pydantic import ValidationError

from app.api.request_fields import REFUSED, WITHOUT_EFFECT
from app.api.schemas import ChatCompletionRequest

# vLLM 0.32's ChatCompletionRequest (vllm/entrypoints/openai/chat_completion/protocol.py), beyond OpenAI's
VLLM_FIELDS = [
    "thinking_token_budget",
    "include_reasoning",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "watermarking",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "truncation_side",
    "prompt_logprobs",
    "logprob_token_ids",
    "allowed_token_ids",
    "bad_words",
    "echo",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "media_io_kwargs",
    "mm_processor_kwargs",
    "structured_outputs",
    "priority",
    "request_id",
    "session_id",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "routed_experts_prompt_start",
    "return_token_offsets",
    "return_prompt_text",
    "mm_payload",
    "return_mm_kwargs",
    "cache_salt",
    "kv_transfer_params",
    "ec_transfer_params",
    "vllm_xargs",
    "repetition_detection",
]
OPENAI_FIELDS = sorted(CompletionCreateParamsBase.__annotations__)
BASE = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("name", sorted({*OPENAI_FIELDS, *VLLM_FIELDS}))
def test_every_known_field_is_sorted(name: str) -> None:
    """Implemented (a declared field), accepted without effect, or refused unless default: never both,
    never neither. A field the SDK adds in a new release fails here until it is sorted."""
    places = [name in ChatCompletionRequest.model_fields, name in WITHOUT_EFFECT, name in REFUSED]
    assert sum(places) == 1, (name, places)


@pytest.mark.parametrize("name", sorted(WITHOUT_EFFECT))
def test_a_field_without_effect_is_accepted_and_dropped(name: str) -> None:
    req = ChatCompletionRequest.model_validate({**BASE, name: "anything"})
    assert not req.model_extra


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_field_is_a_400_naming_it_unless_default(name: str) -> None:
    defaults, _ = REFUSED[name]
    for default in defaults:
        assert not ChatCompletionRequest.model_validate({**BASE, name: default}).model_extra
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({**BASE, name: {"something": 1}})
    error = info.value.errors()[0]
    assert error["loc"] == (name,) and name in error["msg"], error


@pytest.mark.parametrize(("value", "accepted"), [(False, True), (0, False), (True, False), (None, True)])
def test_a_default_matches_in_type_too(value: Any, accepted: bool) -> None:
    """``echo: 0`` is not ``echo: false``: a refused field's default must be the very value."""
    body = {**BASE, "echo": value}
    if accepted:
        ChatCompletionRequest.model_validate(body)
    else:
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate(body)


def test_an_unknown_field_is_kept_aside() -> None:
    req = ChatCompletionRequest.model_validate({**BASE, "frobnicate": 3, "user": "u"})
    assert req.model_extra == {"frobnicate": 3}
