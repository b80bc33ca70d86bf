"""Hermes-style tool calls: the whole-output parser, and the streamer that must reassemble to it."""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from app.api.tool_calls import (
    ContentDelta,
    ParsedOutput,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStreamer,
    finish_reason,
    new_call_id,
    parse_tool_calls,
)


def ids() -> Any:
    """A deterministic id factory: call_0, call_1, ..."""
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def call(name: str, arguments: Any, *, sep: str = "\n") -> str:
    return f"<tool_call>{sep}{json.dumps({'name': name, 'arguments': arguments})}{sep}</tool_call>"


def parse(text: str, cut: bool = False, answer_or_calls: bool = False) -> ParsedOutput:
    return parse_tool_calls(text, ids(), cut=cut, answer_or_calls=answer_or_calls)


def stream(deltas: list[str]) -> list[StreamDelta]:
    return streamed(deltas)[0]


def streamed(
    deltas: list[str], cut: bool = False, answer_or_calls: bool = False
) -> tuple[list[StreamDelta], bool]:
    """The stream's deltas, and whether it ended inside a call (``cut``: the output was cut off)."""
    streamer = ToolCallStreamer(ids(), answer_or_calls=answer_or_calls)
    out: list[StreamDelta] = []
    for delta in deltas:
        out += streamer.push(delta)
    return out + streamer.finish(cut), streamer.cut_off


def reassemble(deltas: list[StreamDelta], cut_off: bool = False) -> ParsedOutput:
    """What a client builds from the chunks: content joined, calls grouped by index."""
    content = "".join(d.content for d in deltas if isinstance(d, ContentDelta))
    calls: dict[int, list[ToolCallDelta]] = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            calls.setdefault(d.index, []).append(d)
    tool_calls = []
    for index in sorted(calls):
        first, *rest = calls[index]
        assert first.id is not None and first.name is not None
        assert all(d.id is None and d.name is None for d in rest)
        arguments = "".join(d.arguments for d in calls[index])
        tool_calls.append(ToolCall(first.id, first.name, arguments, all(d.complete for d in calls[index])))
    assert sorted(calls) == list(range(len(calls)))
    return ParsedOutput(content or None, tool_calls, cut_off)


def test_plain_text_is_content_only() -> None:
    assert parse("The answer is 4.") == ParsedOutput("The answer is 4.", [])
    assert parse("") == ParsedOutput(None, [])
    assert parse("  \n") == ParsedOutput("  \n", [])  # (as written: as without tools)
    assert parse(" 4.\n\n") == ParsedOutput(" 4.\n\n", [])
    assert parse(f" 4.\n{call('a', {})} then  ").content == " 4.\n then  "  # (no end touches a call)
    assert parse(f" \n{call('a', {})}\n 4.\n{call('b', {})}\n").content == "4."


def test_one_call() -> None:
    text = call("get_weather", {"city": "Paris", "unit": "celsius"})
    expected = ToolCall("call_0", "get_weather", '{"city":"Paris","unit":"celsius"}')
    assert parse(text) == ParsedOutput(None, [expected])


def test_whitespace_between_tags_and_json_is_lenient() -> None:
    for sep in ["", " ", "\n\n", "\t \n"]:
        assert parse(call("f", {"a": 1}, sep=sep)).tool_calls == [ToolCall("call_0", "f", '{"a":1}')]


def test_parallel_calls_with_text_around() -> None:
    text = f"Let me check both.\n{call('a', {'x': 1})}\nand\n{call('b', {})}\nDone."
    assert parse(text) == ParsedOutput(
        "Let me check both.\n\nand\n\nDone.",
        [ToolCall("call_0", "a", '{"x":1}'), ToolCall("call_1", "b", "{}")],
    )


def test_calls_only_leave_no_content() -> None:
    text = f"\n{call('a', {})}\n{call('b', {})}\n"
    assert parse(text).content is None
    assert [c.name for c in parse(text).tool_calls] == ["a", "b"]


def test_nested_unicode_and_escaped_quotes_round_trip() -> None:
    arguments = {
        "q": 'say "hi" \\ now',
        "city": "Zürich 日本",
        "opts": {"deep": [1, {"x": None}], "ok": True},
    }
    (parsed,) = parse(call("search", arguments)).tool_calls
    assert json.loads(parsed.arguments) == arguments
    assert "Zürich 日本" in parsed.arguments  # not \u-escaped
    assert parsed.arguments == json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


def test_a_string_argument_may_hold_the_tags() -> None:
    """Code or markup in an argument: the call ends at the close tag after its JSON, not in a string."""
    arguments = {"html": 'see </tool_call> and <tool_call> \\" </tool_call>', "n": 1}
    text = "Here. " + call("write", arguments) + " Done."
    expected = ParsedOutput(
        "Here.  Done.", [ToolCall("call_0", "write", json.dumps(arguments, separators=(",", ":")))]
    )
    assert parse(text) == expected
    assert reassemble(stream(list(text))) == expected
    # not JSON: it ends at its first close tag, and stays content
    text = '<tool_call>he said "hi </tool_call> then ' + call("f", {})
    assert parse(text) == ParsedOutput(
        '<tool_call>he said "hi </tool_call> then', [ToolCall("call_0", "f", "{}")]
    )
    assert reassemble(stream(list(text))) == parse(text)


def test_arguments_given_as_json_string_are_decoded_once() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>'
    assert parse(text).tool_calls == [ToolCall("call_0", "f", '{"a":[1,2]}')]


def test_missing_arguments_mean_no_arguments() -> None:
    assert parse('<tool_call>{"name": "now"}</tool_call>').tool_calls == [ToolCall("call_0", "now", "{}")]


def test_bad_calls_stay_content_and_do_not_use_ids() -> None:
    bad = [
        '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',  # malformed JSON
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',  # empty name
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # name not a string
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',  # string, not an object
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',  # not strict JSON out
        "<tool_call>[1, 2]</tool_call>",  # not an object at all
    ]
    for text in bad:
        assert parse(text) == ParsedOutput(text, []), text
        assert reassemble(stream(list(text))) == ParsedOutput(text, []), text
    text = f"{bad[0]} then {call('g', {})}"
    assert parse(text) == ParsedOutput(f"{bad[0]} then", [ToolCall("call_0", "g", "{}")])


def test_a_call_cut_off_is_incomplete_once_named_and_dropped_before_never_content() -> None:
    text = f'{call("a", {})}\nNow <tool_call>\n{{"name": "b'  # cut in its name: left out
    assert parse(text) == ParsedOutput("Now", [ToolCall("call_0", "a", "{}")], cut_off=True)
    assert reassemble(*streamed([text[:30], text[30:]])) == parse(text)
    for between in ("", ", ", ', "argum'):  # its name written, none of its arguments
        text = f'{call("a", {})}\nNow <tool_call>\n{{"name": "b"{between}'
        named = ToolCall("call_1", "b", "", complete=False)
        assert parse(text) == ParsedOutput("Now", [ToolCall("call_0", "a", "{}"), named], cut_off=True)
        assert reassemble(*streamed([text[:30], text[30:]])) == parse(text)
    text = f'{call("a", {})}\n<tool_call>\n{{"name": "b", "arguments": {{"city": "Pa'
    cut = ToolCall("call_1", "b", '{"city": "Pa', complete=False)
    assert parse(text) == ParsedOutput(None, [ToolCall("call_0", "a", "{}"), cut], cut_off=True)
    assert reassemble(*streamed([text[:30], text[30:]])) == parse(text)
    assert parse('<tool_call>\n{"name": "b", "arguments": ') == ParsedOutput(
        None, [ToolCall("call_0", "b", "", complete=False)], cut_off=True
    )
    # cut after its arguments closed (in the call's closing brace or tag): the arguments alone, whole
    for tail in ("}", "}\n</", "}\n</tool_c"):
        text = '<tool_call>\n{"name": "b", "arguments": {"city": "Paris"}' + tail
        cut = ToolCall("call_0", "b", '{"city":"Paris"}', complete=False)
        assert parse(text) == ParsedOutput(None, [cut], cut_off=True), tail
        assert reassemble(*streamed([text[:20], text[20:]])) == parse(text), tail


def test_an_output_cut_off_as_it_opened_a_call_leaves_the_tag_out() -> None:
    """``required`` cut by the max tokens after a few characters: the start of ``<tool_call>`` is no
    content (as a call cut before its name); one the model ended on itself is its text."""
    for partial in ("<", "<to", "<tool_", "<tool_call"):
        assert parse(partial, cut=True) == ParsedOutput(None, [], cut_off=True), partial
        assert reassemble(*streamed([partial[:2], partial[2:]], cut=True)) == parse(partial, cut=True)
        assert parse(partial) == ParsedOutput(partial, [])
    assert parse("Let me look. <tool", cut=True) == ParsedOutput("Let me look.", [], cut_off=True)
    two = call("f", {}) + "\n<tool_"
    assert parse(two, cut=True) == ParsedOutput(None, [ToolCall("call_0", "f", "{}")], cut_off=True)
    assert finish_reason(parse(two, cut=True), "length") == "length"
    assert parse("a <tool_box>", cut=True) == ParsedOutput("a <tool_box>", [])  # no tag's start at its end


def test_stream_emits_id_and_name_first_then_arguments() -> None:
    assert stream(["Hi ", "<tool", "_call>", '{"name": "f", ', '"arguments": {"a": 1}}', "</tool_call>"]) == [
        ContentDelta("Hi"),
        ToolCallDelta(0, "call_0", "f", ""),
        ToolCallDelta(0, None, None, '{"a":1}'),
    ]


def test_stream_holds_back_a_partial_tag_only_until_decided() -> None:
    streamer = ToolCallStreamer(ids())
    assert streamer.push("Hello <tool") == [ContentDelta("Hello")]
    assert streamer.push("_call>") == []
    assert streamer.push('{"name": "f", "arguments": {}}') == []
    assert streamer.push("</tool_call>\nAfter") == [
        ToolCallDelta(0, "call_0", "f", ""),
        ToolCallDelta(0, None, None, "{}"),
        ContentDelta(" \nAfter"),  # the space held after "Hello" goes out with the next content
    ]
    assert streamer.finish() == []
    assert streamer.num_tool_calls == 1


def test_text_that_looks_like_a_partial_tag_streams_as_content() -> None:
    streamer = ToolCallStreamer(ids())
    assert streamer.push("a <") == [ContentDelta("a")]
    assert streamer.push(" b") == [ContentDelta(" < b")]
    assert streamer.push(" <tool_") == []  # a space (held until content follows) and a partial tag
    assert streamer.push("box>") == [ContentDelta(" <tool_box>")]
    assert streamer.push(" <t") == []
    assert streamer.finish() == [ContentDelta(" <t")]


def test_finish_reason() -> None:
    with_call = parse(call("f", {}))
    assert finish_reason(with_call, "stop") == "tool_calls"
    assert finish_reason(with_call, "length") == "length"
    assert finish_reason(parse("no call"), "stop") == "stop"
    # a stop string inside a call: no "tool_calls", whether the cut call is kept or dropped
    assert finish_reason(parse(call("f", {}) + '<tool_call>{"name": "g", "arguments": {"a'), "stop") == "stop"
    assert finish_reason(parse(call("f", {}) + '<tool_call>{"na'), "stop") == "stop"


def test_default_call_ids_look_like_openai() -> None:
    first, second = new_call_id(), new_call_id()
    assert first != second
    assert first.startswith("call_") and len(first) == 5 + 24
    int(first[5:], 16)


# strings with the tags, quotes and backslashes (escaped in the JSON) that a call's end must see past
markup = st.lists(
    st.text(max_size=4) | st.sampled_from(["</tool_call>", "<tool_call>", '"', "\\", "</tool_"]), max_size=3
).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8) | markup,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(max_size=6) | markup, json_values, max_size=3)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
spacing = st.sampled_from(["", "\n", " ", "\n\n"])


@st.composite
def good_calls(draw: st.DrawFn) -> str:
    body = json.dumps({"name": draw(names), "arguments": draw(arguments)}, ensure_ascii=draw(st.booleans()))
    return f"<tool_call>{draw(spacing)}{body}{draw(spacing)}</tool_call>"


bad_calls = st.sampled_from(
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": 1}</tool_call>',
        "<tool_call></tool_call>",
    ]
)
# Content with the characters and tag pieces that make streaming hard.
content = st.lists(
    st.text(alphabet="ab <>/_\n é日", max_size=6)
    | st.sampled_from(["<tool", "_call>", "<tool_call", "</tool_call>"]),
    max_size=3,
).map("".join)
texts = st.lists(content | good_calls() | bad_calls, max_size=6).map("".join)
unterminated = st.sampled_from(
    [
        "",
        "<tool_call>",
        '<tool_call>\n{"name": "f", "arg',
        '<tool_call>\n{"name": "f", "arguments": {"a": [1, "x',
        "<tool_",
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    body=texts,
    tail=unterminated,
    cuts=st.lists(st.integers(min_value=0), max_size=8),
    cut=st.booleans(),
)
def test_any_split_of_any_text_reassembles_to_the_parse(
    body: str, tail: str, cuts: list[int], cut: bool
) -> None:
    text = body + tail
    points = sorted({point % (len(text) + 1) for point in cuts})
    deltas = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert reassemble(*streamed(deltas, cut)) == parse(text, cut)


@settings(max_examples=100, deadline=None)
@given(text=texts, cut=st.booleans())
def test_char_by_char_stream_reassembles_to_the_parse(text: str, cut: bool) -> None:
    assert reassemble(*streamed(list(text), cut)) == parse(text, cut)


def test_an_answer_or_calls_is_calls_only_where_it_opens_with_one() -> None:
    """Beside a JSON output format the answer is that JSON alone or calls alone: the JSON is content
    whole, the call tag in its strings included (read as calls, it would be cut at the tag)."""
    answer = ' {"note": "x<tool_call>y"}\n'
    assert parse(answer, answer_or_calls=True) == ParsedOutput(answer)
    assert parse(answer).content == ' {"note": "x'
    closed = '{"note": "<tool_call>", "end": "</tool_call>"}'
    assert parse(closed, answer_or_calls=True) == ParsedOutput(closed)
    calls = call("f", {"a": 1}) + "\n" + call("g", {})
    assert parse(calls, answer_or_calls=True) == parse(calls)
    assert parse("<tool_", cut=True, answer_or_calls=True) == ParsedOutput(None, cut_off=True)


# what a JSON answer beside tools is: an object whose strings may hold the tags; or calls
answers_or_calls = st.tuples(
    spacing, st.dictionaries(st.text(max_size=5) | markup, json_values, max_size=3)
).map(lambda answer: answer[0] + json.dumps(answer[1])) | st.lists(good_calls(), max_size=3).map("\n".join)


@settings(max_examples=200, deadline=None)
@given(text=answers_or_calls, tail=unterminated, cuts=st.lists(st.integers(min_value=0), max_size=8))
def test_any_split_of_an_answer_or_calls_reassembles_to_the_parse(
    text: str, tail: str, cuts: list[int]
) -> None:
    text = text + tail if text.startswith("<") else text  # (a cut call ends calls only)
    points = sorted({point % (len(text) + 1) for point in cuts})
    deltas = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    parsed = parse(text, bool(tail), answer_or_calls=True)
    assert reassemble(*streamed(deltas, bool(tail), answer_or_calls=True)) == parsed
    if not text.lstrip().startswith("<"):
        assert parsed == ParsedOutput(text or None)
