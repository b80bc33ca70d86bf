"""A stored conversation's items as ``GET /v1/responses/{id}/input_items`` lists them (app/api/
response_items.py): ids given where the client sent none, OpenAI's item shapes (checked with the openai
SDK's own types), a response's own output left out, logprobs and image URLs only where ``include`` asks
for them, and pages by ``after``, ``limit`` and ``order``."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import ResponseItem
from pydantic import TypeAdapter

from app.api.response_items import input_items, made_by, output_item_id, page, with_ids
from app.errors import InvalidRequestError

IMAGE = "data:image/png;base64,AAAA"
LOGPROBS = [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}]  # its request included them
CONVERSATION = [
    {"role": "user",
     "content": [{"type": "input_text", "text": "look"}, {"type": "input_image", "image_url": IMAGE}]},
    {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
     "content": [{"type": "output_text", "text": "a call", "annotations": [], "logprobs": LOGPROBS}]},
    {"type": "function_call", "call_id": "call_1", "name": "click", "arguments": "{}", "id": "fc_1"},
    {"type": "function_call_output", "call_id": "call_1", "output": "done"},
    {"role": "assistant", "content": "resent as a string"},
    {"role": "assistant", "content": [{"type": "input_text", "text": "resent as input_text"}]},
    {"role": "user", "content": "and now?"},
]  # fmt: skip
OUTPUT = [
    {"id": "msg_2", "type": "message", "role": "assistant", "status": "completed", "content": []},
    {"id": "fc_2", "type": "function_call", "status": "incomplete", "call_id": "c", "name": "n",
     "arguments": ""},
]  # fmt: skip


RESPONSE_ID = "resp_" + "0123456789abcdef" * 2


def stored() -> list[dict[str, Any]]:
    """The conversation as the service stores it: ids given, then the response's kept output."""
    return [*with_ids(CONVERSATION, RESPONSE_ID), OUTPUT[0]]


def test_items_without_an_id_get_one_that_names_their_response_and_ids_are_kept() -> None:
    ids = [item["id"] for item in with_ids(CONVERSATION, RESPONSE_ID)]
    assert ids[1] == "msg_1" and ids[2] == "fc_1"
    assert [i.split("_")[0] for i in ids] == ["msg", "msg", "fc", "fco", "msg", "msg", "msg"]
    assert len(set(ids)) == len(ids)
    outputs = [
        output_item_id("message", RESPONSE_ID),
        *(output_item_id("function_call", RESPONSE_ID, n) for n in (0, 1)),
    ]
    assert len(set(ids + outputs)) == len(ids) + 3
    assert [made_by(i) for i in ids] == [RESPONSE_ID, None, None, *[RESPONSE_ID] * 4]
    assert {made_by(i) for i in outputs} == {RESPONSE_ID}
    for other in (
        "msg_1",
        f"msg_{RESPONSE_ID[5:]}",
        f"msg_{RESPONSE_ID[5:]}_in",
        f"fc_{RESPONSE_ID[5:].upper()}_out",
    ):
        assert made_by(other) is None


def test_the_list_is_the_input_in_openais_shapes_without_the_output() -> None:
    items = stored()
    listed = page(input_items(items, {"output": OUTPUT}), None, 100, "asc", image_urls=False)
    data = listed["data"]
    assert [item["id"] for item in data] == [item["id"] for item in items[:-1]]  # not msg_2
    for item in data:
        TypeAdapter(ResponseItem).validate_python(item)
    assert data[0]["content"][1] == {
        "type": "input_image",
        "image_url": None,
        "detail": "auto",
        "file_id": None,
    }
    assert data[4]["content"] == [
        {"type": "output_text", "text": "resent as a string", "annotations": [], "logprobs": []}
    ]
    assert data[1]["content"][0]["logprobs"] == []  # only with include message.output_text.logprobs
    assert data[5]["content"] == [
        {"type": "output_text", "text": "resent as input_text", "annotations": [], "logprobs": []}
    ]
    assert data[6]["content"] == [{"type": "input_text", "text": "and now?"}]
    assert data[3]["status"] == "completed" and data[3]["output"] == "done"
    assert (listed["first_id"], listed["last_id"], listed["has_more"]) == (
        data[0]["id"],
        data[-1]["id"],
        False,
    )
    with_urls = page(input_items(items, {"output": OUTPUT}), None, 100, "asc", image_urls=True)
    assert with_urls["data"][0]["content"][1]["image_url"] == IMAGE
    assert with_urls["data"][1]["content"][0]["logprobs"] == []
    with_logprobs = page(input_items(items, {"output": OUTPUT}), None, 100, "asc", False, logprobs=True)
    assert with_logprobs["data"][1]["content"][0]["logprobs"] == LOGPROBS


def test_pages_follow_after_in_either_order() -> None:
    items = input_items(stored(), {"output": OUTPUT})
    ids = [item["id"] for item in items]
    for order, expected in (("asc", ids), ("desc", ids[::-1])):
        seen: list[str] = []
        after = None
        while True:
            listed = page(items, after, 4, order, image_urls=False)  # type: ignore[arg-type]
            seen += [item["id"] for item in listed["data"]]
            if not listed["has_more"]:
                break
            after = listed["last_id"]
        assert seen == expected
    with pytest.raises(InvalidRequestError) as caught:
        page(items, "msg_nowhere", 4, "asc", image_urls=False)
    assert caught.value.param == "after"


def test_an_item_stored_without_an_id_is_named_by_its_place() -> None:
    listed = page([{"role": "user", "content": "old"}], None, 20, "desc", image_urls=False)
    assert listed["data"][0]["id"] == "item_0"
