"""The completions request (app/api/completion_schemas.py): each prompt form, OpenAI's default max tokens,
chat's fields refused by name, null as the default; and the legacy logprobs' offsets as they stream
(app/api/completion_responses.py)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from app.api.completion_responses import LegacyLogprobs
from app.api.completion_schemas import CompletionRequest
from app.api.error_handlers import validation_error_detail


def request(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def refused(**fields: Any) -> str | None:
    with pytest.raises(ValidationError) as caught:
        request(**fields)
    return validation_error_detail(caught.value.errors()).param


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("hi", ["hi"]),
        ([1, 2, 3], [[1, 2, 3]]),
        (["a", "b"], ["a", "b"]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_every_prompt_form_is_a_list_of_prompts(prompt: Any, prompts: list[Any]) -> None:
    assert request(prompt=prompt).prompts() == prompts


def test_the_max_tokens_are_16_unless_given_and_logprobs_count_alternatives() -> None:
    assert request().effective_max_tokens() == 16 and request(max_tokens=None).effective_max_tokens() == 16
    assert request(max_tokens=300).effective_max_tokens() == 300
    assert request().num_top_logprobs() is None and request(logprobs=0).num_top_logprobs() == 0
    assert request(echo=None, add_special_tokens=None) == request()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": ["a", 1]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"suffix": "x"}, "suffix"),
        ({"prompt_embeds": "AAAA"}, "prompt_embeds"),
        ({"messages": []}, "messages"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"mm_processor_kwargs": {}}, "mm_processor_kwargs"),
        ({"best_of": 3}, "best_of"),
        ({"echo": [True]}, "echo"),
        ({"logprobs": False}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 1.0}, "logprobs"),
        ({"prompt": [True, False]}, "prompt"),
        ({"prompt": [[1.0, 2]]}, "prompt"),
    ],
)
def test_a_bad_field_is_named(fields: dict[str, Any], param: str) -> None:
    assert refused(**fields) == param


def test_chat_fields_sent_as_null_are_no_fields() -> None:
    assert request(messages=None, tools=None, suffix=None) == request()


def entry(token: str, logprob: float = -1.0, raw: bytes | None = None) -> dict[str, Any]:
    raw = token.encode() if raw is None else raw
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(raw),
        "top_logprobs": [{"token": "z", "logprob": -9.0}],
    }


def test_legacy_offsets_run_on_across_pieces() -> None:
    legacy = LegacyLogprobs(start=5)
    first = legacy.piece([entry("ab", -0.5), entry("c", -1.0)])
    second = legacy.piece([entry("def", -0.25)])
    assert first["text_offset"] == [5, 7] and second["text_offset"] == [8]
    assert first["tokens"] == ["ab", "c"] and first["token_logprobs"] == [-0.5, -1.0]
    assert second["top_logprobs"] == [{"def": -0.25, "z": -9.0}]


def test_a_token_that_is_part_of_a_character_points_at_that_character() -> None:
    """``a你😀b`` in tokens of single bytes: the offsets index the text's characters."""
    text = "a你😀b"
    tokens = [entry(f"bytes:\\x{byte:02x}", raw=bytes([byte])) for byte in text.encode()]
    tokens[0], tokens[-1] = entry("a"), entry("b")
    offsets = LegacyLogprobs(start=0).piece(tokens)["text_offset"]
    assert offsets == [0, 1, 1, 1, 2, 2, 2, 2, 3]
    assert [text[offset] for offset in offsets] == ["a", *"你" * 3, *"😀" * 4, "b"]
