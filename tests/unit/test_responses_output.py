"""A response's output items, whole (``output_items``) and as a stream builds them (``OutputStream``): for
any answer the tiny Qwen2.5-VL could write, split anyhow, ended by the model or cut off, the stream's
items are the whole answer's, and its events add each item once, at its place."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from app.api.detokenizer import IncrementalDetokenizer
from app.api.outputs import Generation
from app.api.responses_output import OutputStream, output_items
from tests.unit.test_tool_calls import texts, unterminated


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Callable[[str], Path]) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model("qwen2_5_vl"))


def generation(
    tokenizer: PreTrainedTokenizerBase, finish_reason: str | None, answer_or_calls: bool = False
) -> Generation:
    return Generation(
        req_id="r",
        response_id="resp_0123",
        index=0,
        model_name="tiny-qwen2_5_vl",
        arrival=0.0,
        num_prompt_tokens=1,
        num_cached_tokens=0,
        want_logprobs=False,
        detok=IncrementalDetokenizer(tokenizer),
        finish_reason=finish_reason,
        parse_tool_calls=True,
        answer_or_calls=answer_or_calls,
    )


def streamed(
    tokenizer: PreTrainedTokenizerBase, pieces: list[str], reason: str, answer_or_calls: bool = False
) -> tuple[list[tuple[str, dict[str, Any]]], list[dict[str, Any]]]:
    """The stream's events (kind, fields) and items, the answer arriving in ``pieces``."""
    events: list[tuple[str, dict[str, Any]]] = []

    def event(kind: str, **fields: Any) -> str:
        events.append((kind, json.loads(json.dumps(fields))))
        return kind

    gen = generation(tokenizer, None, answer_or_calls)
    stream = OutputStream(gen.response_id, event, gen.call_streamer())
    for number, piece in enumerate(pieces, 1):
        gen.text += piece
        gen.finish_reason = reason if number == len(pieces) else None
        stream.push(piece, gen, [])
    _, items = stream.finish(gen)
    return events, items


def without_call_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k != "call_id"} for item in items]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=texts,
    tail=unterminated,
    cuts=st.lists(st.integers(min_value=0), max_size=6),
    reason=st.sampled_from(["stop", "length"]),
)
def test_a_streamed_answer_has_the_whole_answers_items(
    tokenizer: PreTrainedTokenizerBase, body: str, tail: str, cuts: list[int], reason: str
) -> None:
    text = body + tail
    points = sorted({point % (len(text) + 1) for point in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    gen = generation(tokenizer, reason)
    gen.text = text
    events, items = streamed(tokenizer, pieces, reason)
    assert without_call_ids(items) == without_call_ids(output_items(gen))
    # each item added once, in output order, and done before the next is added (as OpenAI streams)
    changes = [
        (kind, fields["output_index"]) for kind, fields in events if kind.startswith("response.output_item")
    ]
    assert changes == [
        (f"response.output_item.{change}", index)
        for index in range(len(items))
        for change in ("added", "done")
    ]


def test_a_call_after_text_is_added_once_the_message_is_done(tokenizer: PreTrainedTokenizerBase) -> None:
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    events, items = streamed(tokenizer, ["Let me look.", call, " Done."], "stop")
    assert [item["type"] for item in items] == ["message", "function_call"]
    assert items[0]["content"][0]["text"] == "Let me look. Done."
    kinds = [kind for kind, _ in events]
    assert kinds.index("response.function_call_arguments.done") > kinds.index("response.output_text.done")
    events, items = streamed(tokenizer, [call, " Done."], "stop")  # a call first: at once, then the text
    assert [item["type"] for item in items] == ["function_call", "message"]
    assert events[0][0] == "response.output_item.added" and events[0][1]["item"]["type"] == "function_call"


def test_an_answer_cut_as_it_opens_a_call_has_no_item(tokenizer: PreTrainedTokenizerBase) -> None:
    gen = generation(tokenizer, "length")
    gen.text = "<tool_"
    assert output_items(gen) == []
    events, items = streamed(tokenizer, ["<to", "ol_"], "length")
    assert items == [] and events == []
    gen.finish_reason = "stop"  # the model ended it there itself: its text
    [message] = output_items(gen)
    assert message["content"][0]["text"] == "<tool_"


def test_a_json_answer_beside_tools_is_one_message_tags_and_all(tokenizer: PreTrainedTokenizerBase) -> None:
    """An output format beside tools: the answer that opens no call is the format's JSON, whole."""
    answer = '{"note": "<tool_call> opens a call"}'
    gen = generation(tokenizer, "stop", answer_or_calls=True)
    gen.text = answer
    [message] = output_items(gen)
    assert message["content"][0]["text"] == answer
    events, items = streamed(tokenizer, ['{"note": "<tool', "_call> opens a call", '"}'], "stop", True)
    assert items == output_items(gen)
