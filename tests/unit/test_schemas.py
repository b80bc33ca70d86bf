"""Request validation and response shapes, checked against the openai SDK's own types."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types import Model
from openai.types.chat import ChatCompletion
from openai.types.chat import ChatCompletionChunk as SdkChunk
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from app.api.sampling_schemas import StreamUsage
from app.api.schemas import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatMessage,
    ChoiceLogprobs,
    DeltaMessage,
    ImageURLContentPart,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TextContentPart,
    TokenLogprob,
    TopLogprob,
    Usage,
)

IMAGE = "data:image/png;base64,iVBORw0KGgo="


def request(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate(body)


def error_of(**fields: Any) -> ErrorDetails:
    with pytest.raises(ValidationError) as info:
        request(**fields)
    return info.value.errors()[0]


def test_minimal_request_defaults() -> None:
    req = request()
    # None: the model's default (app/api/sampling.py)
    assert (req.stream, req.temperature, req.top_p, req.n, req.logprobs) == (False, None, None, 1, False)
    assert req.effective_max_tokens() is None
    assert req.num_top_logprobs() is None
    assert req.stop is None and req.top_k is None and req.stream_usage is StreamUsage.NONE
    assert not req.return_token_ids and not req.return_tokens_as_token_ids


@pytest.mark.parametrize(
    ("options", "where"),
    [
        (None, StreamUsage.NONE),
        ({"include_usage": False}, StreamUsage.NONE),
        ({"continuous_usage_stats": True}, StreamUsage.NONE),  # (without include_usage, as vLLM)
        ({"include_usage": True}, StreamUsage.LAST),
        ({"include_usage": True, "continuous_usage_stats": False}, StreamUsage.LAST),
        ({"include_usage": True, "continuous_usage_stats": True}, StreamUsage.CONTINUOUS),
    ],
)
def test_where_a_stream_carries_usage(options: dict[str, bool] | None, where: StreamUsage) -> None:
    assert request(stream=True, stream_options=options).stream_usage is where


def test_sdk_style_multimodal_streaming_request() -> None:
    # What openai.chat.completions.create(..., stream=True, extra_body={...}) sends.
    body = {
        "model": "tiny",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in"},
                    {"type": "image_url", "image_url": {"url": IMAGE, "detail": "low"}},
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
                ],
            },
            {"role": "assistant", "content": None},
            {"role": "user", "content": "this?", "name": "alice"},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 16,
        "max_tokens": 99,
        "temperature": 0,
        "top_p": 0.9,
        "seed": 7,
        "stop": "\n\n",
        "logprobs": True,
        "top_logprobs": 3,
        "frequency_penalty": 0,
        "user": "u-1",
        "tools": [],  # unknown fields are ignored
        "top_k": 20,
        "ignore_eos": True,
        "min_tokens": 2,
        "mm_processor_kwargs": {"do_resize": True},
    }
    req = ChatCompletionRequest.model_validate(body)
    assert req.messages[0].role == "system"
    parts = req.messages[1].content
    assert isinstance(parts, list)
    assert isinstance(parts[0], TextContentPart) and parts[0].text == "What is in"
    assert isinstance(parts[1], ImageURLContentPart) and isinstance(parts[2], ImageURLContentPart)
    assert parts[1].image_url.url == IMAGE and parts[2].image_url.url == "https://example.com/cat.jpg"
    assert parts[1].image_url.detail == "low" and parts[2].image_url.detail is None
    assert req.messages[2].content is None
    assert req.effective_max_tokens() == 16  # max_completion_tokens wins
    assert req.stop == ["\n\n"]
    assert req.stream_usage is StreamUsage.LAST and req.num_top_logprobs() == 3
    assert (req.top_k, req.ignore_eos, req.min_tokens) == (20, True, 2)


@pytest.mark.parametrize("top_k", [-1, 0])
def test_top_k_off_is_kept(top_k: int) -> None:
    # an explicit "off", which overrides a model default (None is "the default")
    assert request(top_k=top_k).top_k == top_k


def test_vllms_short_media_parts_are_the_full_ones() -> None:
    """A bare URL under ``image_url`` or ``video_url`` and no ``type``, as vLLM takes it."""
    short = [{"image_url": IMAGE}, {"video_url": "https://example.com/a.mp4"}]
    full = [
        {"type": "image_url", "image_url": {"url": IMAGE}},
        {"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}},
    ]
    as_short, as_full = (request(messages=[{"role": "user", "content": parts}]) for parts in (short, full))
    assert as_short == as_full
    with pytest.raises(ValidationError):  # (an object is the full form's: it needs its type)
        request(messages=[{"role": "user", "content": [{"image_url": {"url": IMAGE}}]}])


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0},
        {"temperature": 2},
        {"top_p": 1},
        {"top_p": 1e-9},
        {"top_k": 1},
        {"top_k": 2**63 - 1},
        {"seed": 2**63 - 1},
        {"seed": -(2**63)},
        {"max_tokens": 1, "max_completion_tokens": 1},
        {"logprobs": True, "top_logprobs": 0},
        {"logprobs": True, "top_logprobs": 20},
        {"top_logprobs": 0},  # asks for no alternatives, so it needs no logprobs
        {"stop": ["a", "b", "c", "d"]},
        {"n": 1},
        {"n": 16},
        {"frequency_penalty": -2, "presence_penalty": 2},
        {"repetition_penalty": 1e-6},
        {"min_p": 1},
        {"logit_bias": {"0": -100, "5": 100}},
        {"allowed_token_ids": [0]},
        {"stop_token_ids": []},
    ],
)
def test_limits_are_inclusive(fields: dict[str, Any]) -> None:
    request(**fields)


def test_explicit_nulls_mean_defaults() -> None:
    req = request(temperature=None, top_p=None, n=None, stream=None, logprobs=None, presence_penalty=None)
    assert (req.temperature, req.top_p, req.n, req.stream, req.logprobs) == (None, None, 1, False, False)


def test_logprobs_without_alternatives() -> None:
    assert request(logprobs=True).num_top_logprobs() == 0
    assert request(max_tokens=5).effective_max_tokens() == 5


@pytest.mark.parametrize(
    ("fields", "loc", "needle"),
    [
        ({"messages": []}, ("messages",), "at least 1"),
        ({"n": 17}, ("n",), "less than or equal to 16"),
        ({"temperature": 2.5}, ("temperature",), "less than or equal to 2"),
        ({"temperature": -0.1}, ("temperature",), "greater than or equal to 0"),
        ({"temperature": float("nan")}, ("temperature",), "less than or equal to 2"),
        ({"top_p": 0}, ("top_p",), "greater than 0"),
        ({"top_p": -0.5}, ("top_p",), "greater than 0"),
        ({"top_p": 1.01}, ("top_p",), "less than or equal to 1"),
        ({"max_tokens": 0}, ("max_tokens",), "greater than or equal to 1"),
        ({"max_tokens": -1}, ("max_tokens",), "greater than or equal to 1"),
        ({"max_completion_tokens": 0}, ("max_completion_tokens",), "greater than or equal to 1"),
        ({"max_tokens": 1.5}, ("max_tokens",), "fractional part"),
        ({"top_logprobs": 21, "logprobs": True}, ("top_logprobs",), "less than or equal to 20"),
        ({"top_logprobs": -1, "logprobs": True}, ("top_logprobs",), "greater than or equal to 0"),
        ({"top_logprobs": 2}, ("top_logprobs",), "requires logprobs"),
        ({"top_logprobs": 2, "logprobs": False}, ("top_logprobs",), "requires logprobs"),
        ({"stop": ["a", "b", "c", "d", "e"]}, ("stop",), "at most 4"),
        ({"stop": [""]}, ("stop",), "must not be empty"),
        ({"stop": ""}, ("stop",), "must not be empty"),
        ({"stop": ["a", 1]}, ("stop", 1), "valid string"),
        ({"n": 0}, ("n",), "greater than or equal to 1"),
        # integers the engine's wire format and torch cannot carry (these were 500s)
        ({"seed": 2**63}, ("seed",), "less than or equal to 9223372036854775807"),
        ({"seed": -(2**63) - 1}, ("seed",), "greater than or equal to -9223372036854775808"),
        ({"top_k": 2**70}, ("top_k",), "less than or equal to 9223372036854775807"),
        ({"min_tokens": 2**70}, ("min_tokens",), "less than or equal to 9223372036854775807"),
        ({"frequency_penalty": 2.5}, ("frequency_penalty",), "less than or equal to 2"),
        ({"presence_penalty": -2.1}, ("presence_penalty",), "greater than or equal to -2"),
        ({"repetition_penalty": 0}, ("repetition_penalty",), "greater than 0"),
        ({"min_p": 1.5}, ("min_p",), "less than or equal to 1"),
        ({"logit_bias": {"x": 1}}, ("logit_bias",), "must be token ids"),
        ({"logit_bias": {"-3": 1}}, ("logit_bias",), "must be token ids"),
        ({"logit_bias": {"²": 1}}, ("logit_bias",), "must be token ids"),  # a digit to str.isdigit
        ({"logit_bias": {"١٢": 1}}, ("logit_bias",), "must be token ids"),  # Arabic-Indic 12 to int()
        ({"logit_bias": {"3": 101}}, ("logit_bias",), "from -100 to 100"),
        ({"allowed_token_ids": []}, ("allowed_token_ids",), "at least 1"),
        ({"stop_token_ids": [-1]}, ("stop_token_ids",), "token ids"),
        ({"continue_final_message": True}, ("continue_final_message",), "add_generation_prompt false"),
        ({"request_id": "a\nb"}, ("request_id",), "printable"),
        ({"top_k": -2}, ("top_k",), "greater than or equal to -1"),
        ({"functions": [{"name": "f"}]}, ("functions",), "use tools and tool_choice"),
        ({"modalities": ["text", "audio"]}, ("modalities",), "text only"),
        ({"use_beam_search": True}, ("use_beam_search",), "beam search is not supported"),
        ({"guided_json": {}}, ("guided_json",), "use structured_outputs.json"),
        ({"min_tokens": 9, "max_tokens": 8}, ("min_tokens",), "must not exceed"),
        ({"stream_options": {"include_usage": True}}, ("stream_options",), "only allowed when stream"),
        # a misspelt include_usage would drop the usage chunk
        (
            {"stream": True, "stream_options": {"include_usge": True}},
            ("stream_options", "include_usge"),
            "Extra",
        ),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": "often"}},
            ("stream_options", "continuous_usage_stats"),
            "valid boolean",
        ),
        ({"return_token_ids": "often"}, ("return_token_ids",), "valid boolean"),
        ({"model": None}, ("model",), "valid string"),
    ],
)
def test_invalid_parameters(fields: dict[str, Any], loc: tuple[Any, ...], needle: str) -> None:
    error = error_of(**fields)
    assert error["loc"] == loc
    assert needle in error["msg"]


@pytest.mark.parametrize(
    ("message", "loc", "needle"),
    [
        ({"role": "user", "content": [{"type": "image_url"}]}, (0, "content", 0, "image_url"), "required"),
        (
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}],
            },
            (0, "content", 1, "image_url", "url"),
            "required",
        ),
        (
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": IMAGE, "detail": "max"}}],
            },
            (0, "content", 0, "image_url", "detail"),
            "'auto', 'low' or 'high'",
        ),
        ({"role": "user", "content": [{"type": "input_audio"}]}, (0, "content", 0, "type"), "'input_audio'"),
        ({"role": "user", "content": [{"type": "image"}]}, (0, "content", 0, "type"), "'image'"),
        ({"role": "user", "content": [{"text": "no type"}]}, (0, "content", 0, "type"), "None"),
        (
            {"role": "user", "content": ["just a string"]},
            (0, "content", 0),
            "'text', 'image_url' or 'video_url'",
        ),
        ({"role": "user", "content": [{"type": "text"}]}, (0, "content", 0, "text"), "required"),
        ({"role": "user", "content": 5}, (0, "content"), "string or a list"),
        ({"role": "user"}, (0, "content"), "content is required"),
        ({"role": "function", "content": "x"}, (0, "role"), "send 'tool' messages"),
        ({"role": "tool", "content": "x"}, (0, "tool_call_id"), "needs the tool_call_id"),
        (
            {
                "role": "tool",
                "tool_call_id": "c",
                "content": [{"type": "image_url", "image_url": {"url": "x"}}],
            },
            (0, "content"),
            "content is text (content[0] is image_url)",
        ),
        (
            {
                "role": "tool",
                "tool_call_id": "c",
                "content": [{"type": "text", "text": "t"}, {"type": "video_url", "video_url": {"url": "x"}}],
            },
            (0, "content"),
            "content is text (content[1] is video_url)",
        ),
        (
            {
                "role": "user",
                "content": "x",
                "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
            },
            (0, "tool_calls"),
            "only assistant messages",
        ),
        (
            {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]},
            (0, "tool_calls", 0, "function", "arguments"),
            "JSON text of an object",
        ),
        ({"role": "robot", "content": "x"}, (0, "role"), "'system', 'user', 'assistant' or 'tool'"),
        ({"role": "", "content": "x"}, (0, "role"), "'system', 'user', 'assistant' or 'tool'"),
        ({"content": "x"}, (0, "role"), "required"),
    ],
)
def test_invalid_messages(message: dict[str, Any], loc: tuple[Any, ...], needle: str) -> None:
    error = error_of(messages=[message])
    assert error["loc"] == ("messages", *loc)
    assert needle in error["msg"]


def _usage() -> Usage:
    return Usage(
        prompt_tokens=10,
        completion_tokens=3,
        total_tokens=13,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=4),
    )


def _logprobs() -> ChoiceLogprobs:
    top = [TopLogprob(token="a", logprob=-0.1, bytes=[97]), TopLogprob(token="b", logprob=-2.5, bytes=[98])]
    return ChoiceLogprobs(content=[TokenLogprob(token="a", logprob=-0.1, bytes=[97], top_logprobs=top)])


def test_completion_parses_as_sdk_type() -> None:
    resp = ChatCompletionResponse(
        model="tiny",
        choices=[
            ChatCompletionChoice(
                message=ChatMessage(content="héllo 🙂"), logprobs=_logprobs(), finish_reason="length"
            )
        ],
        usage=_usage(),
    )
    wire = json.loads(resp.model_dump_json())
    sdk = ChatCompletion.model_validate(wire)
    assert sdk.id.startswith("chatcmpl-") and sdk.object == "chat.completion" and sdk.created > 0
    assert sdk.choices[0].message.content == "héllo 🙂" and sdk.choices[0].message.role == "assistant"
    assert sdk.choices[0].finish_reason == "length"
    assert sdk.choices[0].logprobs and sdk.choices[0].logprobs.content
    assert sdk.choices[0].logprobs.content[0].top_logprobs[1].bytes == [98]
    assert (
        sdk.usage and sdk.usage.prompt_tokens_details and sdk.usage.prompt_tokens_details.cached_tokens == 4
    )
    assert ChatCompletion.model_validate(json.loads(resp.model_dump_json(exclude_none=True))) == sdk


def test_stream_chunks_parse_as_sdk_type() -> None:
    def chunk(delta: DeltaMessage, **choice: Any) -> ChatCompletionChunk:
        choices = [ChatCompletionStreamChoice(delta=delta, **choice)]
        return ChatCompletionChunk(id="chatcmpl-1", created=1, model="tiny", choices=choices)

    first = json.loads(chunk(DeltaMessage(role="assistant", content="")).model_dump_json())
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["finish_reason"] is None and first["usage"] is None

    middle = json.loads(chunk(DeltaMessage(content="日本"), logprobs=_logprobs()).model_dump_json())
    assert middle["choices"][0]["delta"] == {"content": "日本"}  # unset role is left out

    last = json.loads(chunk(DeltaMessage(), finish_reason="stop").model_dump_json())
    assert last["choices"][0]["delta"] == {}

    usage = ChatCompletionChunk(id="chatcmpl-1", created=1, model="tiny", choices=[], usage=_usage())
    for wire in (first, middle, last, json.loads(usage.model_dump_json())):
        sdk = SdkChunk.model_validate(wire)
        assert sdk.object == "chat.completion.chunk" and sdk.id == "chatcmpl-1"
    assert SdkChunk.model_validate(middle).choices[0].delta.content == "日本"
    assert SdkChunk.model_validate(last).choices[0].finish_reason == "stop"
    sdk_usage = SdkChunk.model_validate(json.loads(usage.model_dump_json())).usage
    assert sdk_usage is not None and sdk_usage.total_tokens == 13


def test_model_list_parses_as_sdk_type() -> None:
    models = ModelList(data=[ModelCard(id="tiny", root="models/tiny", max_model_len=2048)])
    wire = json.loads(models.model_dump_json())
    assert wire["object"] == "list"
    card = wire["data"][0]
    assert (card["owned_by"], card["root"], card["max_model_len"]) == ("mmserve", "models/tiny", 2048)
    sdk = Model.model_validate(card)
    assert (sdk.id, sdk.object, sdk.owned_by) == ("tiny", "model", "mmserve")
