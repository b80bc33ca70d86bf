"""``/tokenize`` bodies: a field of the ``messages`` form is refused beside a ``prompt``, by name, and a
field no spec knows is logged as on chat; long prompts and long id lists are worked on in a thread."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from app.api.error_handlers import validation_error_detail
from app.api.tokenize_schemas import MESSAGES_ONLY, DetokenizeRequest, TokenizeRequest
from app.api.tokenize_service import OFF_LOOP_TOKEN_IDS, TokenizeService
from app.errors import InvalidRequestError
from app.inputs.prompts import OFF_LOOP_PROMPT_CHARS

MESSAGES = [{"role": "user", "content": "hi"}]
# a value other than the field's default, for each field of the messages form
NOT_DEFAULT: dict[str, Any] = {
    "add_generation_prompt": False,
    "continue_final_message": True,
    "mm_processor_kwargs": {"bogus": 1},
    "cache_salt": "salt",
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "chat_template_kwargs": {"enable_thinking": True},
}
DEFAULT: dict[str, Any] = {
    "add_generation_prompt": True,
    "continue_final_message": False,
    "mm_processor_kwargs": None,
    "cache_salt": None,
    "tools": None,
    "chat_template_kwargs": None,
}


def test_every_field_of_the_messages_form_is_covered() -> None:
    assert set(NOT_DEFAULT) == set(DEFAULT) == set(MESSAGES_ONLY)


@pytest.mark.parametrize("name", sorted(NOT_DEFAULT))
def test_a_messages_field_beside_a_prompt_is_a_400_naming_it(name: str) -> None:
    with pytest.raises(ValidationError) as raised:
        TokenizeRequest.model_validate({"prompt": "x", name: NOT_DEFAULT[name]})
    detail = validation_error_detail(raised.value.errors())
    assert detail.param == name and "messages only" in detail.message, detail


@pytest.mark.parametrize("name", sorted(NOT_DEFAULT))
def test_a_messages_field_at_its_default_beside_a_prompt_or_set_beside_messages_is_taken(name: str) -> None:
    TokenizeRequest.model_validate({"prompt": "x", name: DEFAULT[name]})
    other = {"add_generation_prompt": False} if name == "continue_final_message" else {}
    TokenizeRequest.model_validate({"messages": MESSAGES, name: NOT_DEFAULT[name], **other})


def test_chat_only_fields_are_refused_by_name_as_on_chat() -> None:
    with pytest.raises(ValidationError) as raised:
        TokenizeRequest.model_validate({"prompt": "x", "chat_template": "{{ messages }}"})
    assert validation_error_detail(raised.value.errors()).param == "chat_template"


class RecordingTokenizer:
    """Answers as a tokenizer would (one id per character) and notes which thread each call ran on."""

    def __init__(self) -> None:
        self.threads: dict[str, int] = {}

    def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
        self.threads["encode"] = threading.get_ident()
        return {"input_ids": [1] * len(text)}

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        self.threads["convert"] = threading.get_ident()
        return ["a"] * len(ids)

    def decode(self, ids: list[int]) -> str:
        self.threads["decode"] = threading.get_ident()
        return "a" * len(ids)


def service() -> tuple[TokenizeService, RecordingTokenizer]:
    tokenizer = RecordingTokenizer()
    inputs = SimpleNamespace(family=SimpleNamespace(tokenizer=tokenizer, vocab_size=8))
    return TokenizeService("tiny", 4096, inputs), tokenizer  # type: ignore[arg-type]


@pytest.mark.parametrize("long", [False, True])
def test_a_long_prompt_is_tokenized_and_its_ids_turned_into_strings_in_a_thread(long: bool) -> None:
    tokenize, tokenizer = service()
    num_chars = max(OFF_LOOP_PROMPT_CHARS, OFF_LOOP_TOKEN_IDS) + 1 if long else 100  # one id per character

    async def main() -> int:
        body = TokenizeRequest.model_validate({"prompt": "x" * num_chars, "return_token_strs": True})
        counted = await tokenize.tokenize(body, None)  # type: ignore[arg-type]  # a prompt needs no request
        assert counted["count"] == len(counted["token_strs"]) == num_chars
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert set(tokenizer.threads) == {"encode", "convert"}
    assert all((thread != loop_thread) == long for thread in tokenizer.threads.values()), tokenizer.threads


@pytest.mark.parametrize("long", [False, True])
def test_a_long_id_list_is_decoded_in_a_thread(long: bool) -> None:
    tokenize, tokenizer = service()
    num_ids = OFF_LOOP_TOKEN_IDS + 1 if long else 100

    async def main() -> int:
        assert await tokenize.detokenize(DetokenizeRequest(tokens=[1] * num_ids)) == {"prompt": "a" * num_ids}
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert (tokenizer.threads["decode"] != loop_thread) == long


def test_ids_outside_the_vocabulary_are_refused_off_the_loop_too() -> None:
    tokenize, _ = service()
    with pytest.raises(InvalidRequestError, match="outside the model's vocabulary") as raised:
        asyncio.run(tokenize.detokenize(DetokenizeRequest(tokens=[1] * OFF_LOOP_TOKEN_IDS + [9])))
    assert (raised.value.param, raised.value.code) == ("tokens", "invalid_value")


def test_unknown_fields_are_logged_once_each_as_on_chat(caplog: pytest.LogCaptureFixture) -> None:
    tokenize, _ = service()

    def send(**fields: Any) -> list[str]:
        caplog.clear()
        body = TokenizeRequest.model_validate({"prompt": "x", **fields})
        asyncio.run(tokenize.tokenize(body, None))  # type: ignore[arg-type]
        return [record.getMessage() for record in caplog.records]

    with caplog.at_level("WARNING", logger="mmserve.api"):
        (line,) = send(frobnicate=1, user="u")  # user: accepted without effect, as on chat
        assert "does not know were ignored: ['frobnicate']" in line
        assert send(frobnicate=2) == []
        # /detokenize's too, in the same log
        asyncio.run(tokenize.detokenize(DetokenizeRequest.model_validate({"tokens": [1], "tokns": [2]})))
        assert "['tokns']" in caplog.records[-1].getMessage()
