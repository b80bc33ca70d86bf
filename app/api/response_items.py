"""A stored conversation's items as the Responses API names and lists them (docs/api.md, "Stored
responses"): every item has an id (an input item the client sent without one is given one when its
response is made), by which a later request may send it again as an ``item_reference``; and
``GET /v1/responses/{id}/input_items`` lists the items a response was made from, in OpenAI's item
shapes, a page at a time.

An id mmserve gives names the response whose turn made the item (``msg_<response>_in0`` for its first
input item, ``msg_<response>_out`` for its answer, ``fc_<response>_call0`` for its first call), so a
reference finds the replica that stores it without a table of items (``made_by``; app/ray_serve/
media_keys.py)."""

from __future__ import annotations

import re
from typing import Any, Literal

from app.errors import InvalidRequestError

_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
_GIVEN_ID = re.compile(rf"(?:{'|'.join(_ID_PREFIX.values())})_([0-9a-f]{{32}})_(?:in\d+|out|call\d+)")
IMAGE_URLS = "message.input_image.image_url"  # ``include`` values the list takes (with chat's logprobs)


def with_ids(items: list[dict[str, Any]], response_id: str) -> list[dict[str, Any]]:
    """``items`` (the input items of the turn that makes ``response_id``), each with an id: its own, or
    one that names the response."""
    return [
        item if "id" in item else {**item, "id": _item_id(_kind(item), response_id, f"in{index}")}
        for index, item in enumerate(items)
    ]


def check_unique_ids(history: list[dict[str, Any]], items: list[Any]) -> None:
    """The ids of a conversation's items are unique (an ``after`` cursor, a reference, name one item):
    an input item repeating the id of another, or of one in the stored conversation it follows, is a
    400 naming it, as OpenAI's "duplicate item"."""
    seen = {item["id"] for item in history if "id" in item}
    for index, item in enumerate(items):
        item_id = getattr(item, "id", None)
        if item_id is None:
            continue
        if item_id in seen:
            raise InvalidRequestError(
                f"Duplicate item found with id '{item_id}': an item of the conversation has it already "
                "(the stored one previous_response_id continues, or this input). Remove the duplicate.",
                param=f"input[{index}].id",
            )
        seen.add(item_id)


def output_item_id(kind: Literal["message", "function_call"], response_id: str, index: int = 0) -> str:
    """The id of a response's answer (its one message) or of its ``index``-th call."""
    return _item_id(kind, response_id, "out" if kind == "message" else f"call{index}")


def made_by(item_id: str) -> str | None:
    """The id of the response whose turn made the item, for an id mmserve gave; None for another."""
    given = _GIVEN_ID.fullmatch(item_id)
    return None if given is None else f"resp_{given.group(1)}"


def _item_id(kind: str, response_id: str, tag: str) -> str:
    return f"{_ID_PREFIX[kind]}_{response_id.removeprefix('resp_')}_{tag}"


def conversation_outputs(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a stored conversation keeps of its response's output items: all but a call cut off by the max
    tokens, whose arguments are no object to render or to answer."""
    return [i for i in output if not (i["type"] == "function_call" and i["status"] == "incomplete")]


def input_items(conversation: list[dict[str, Any]], response: dict[str, Any]) -> list[dict[str, Any]]:
    """The items ``response`` was made from: its stored conversation without its own output (earlier
    turns of a ``previous_response_id`` chain included, as the model read them)."""
    return conversation[: len(conversation) - len(conversation_outputs(response["output"]))]


def page(
    items: list[dict[str, Any]],
    after: str | None,
    limit: int,
    order: Literal["asc", "desc"],
    image_urls: bool,
    logprobs: bool = False,
) -> dict[str, Any]:
    """OpenAI's list object of ``items``: ``limit`` of them after the item ``after``, oldest first
    (``asc``) or newest first (``desc``); input images carry their URL only with ``image_urls``, an
    answer's text its tokens' logprobs (where its request included them) only with ``logprobs``."""
    listed = [_listed(item, index, image_urls, logprobs) for index, item in enumerate(items)]
    if order == "desc":
        listed.reverse()
    if after is not None:
        ids = [item["id"] for item in listed]
        if after not in ids:
            raise InvalidRequestError(f"No input item with id '{after}' in this response.", param="after")
        listed = listed[ids.index(after) + 1 :]
    data = listed[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(listed) > limit,
    }


def _kind(item: dict[str, Any]) -> str:
    return str(item.get("type") or "message")


def _listed(item: dict[str, Any], index: int, image_urls: bool, logprobs: bool) -> dict[str, Any]:
    """A stored item in the shape OpenAI lists it: a message's content always parts (an assistant's
    text ``output_text``), every item with its ``status``. An item stored before items had ids is named by
    its place."""
    kind = _kind(item)
    listed = {"id": item.get("id", f"item_{index}"), "type": kind, "status": item.get("status", "completed")}
    if kind != "message":
        return {**listed, **{k: v for k, v in item.items() if k not in ("id", "type", "status")}}
    role = item["role"]
    content = item["content"]
    if isinstance(content, str):
        text_type = "output_text" if role == "assistant" else "input_text"
        content = [{"type": text_type, "text": content}]
    return {**listed, "role": role, "content": [_part(part, role, image_urls, logprobs) for part in content]}


def _part(part: dict[str, Any], role: str, image_urls: bool, logprobs: bool) -> dict[str, Any]:
    if role == "assistant" and part["type"] == "input_text":  # (OpenAI's input shape takes it)
        part = {**part, "type": "output_text"}
    if part["type"] == "output_text":
        return {"annotations": [], **part} if logprobs else {"annotations": [], **part, "logprobs": []}
    if part["type"] == "input_image":
        url = part.get("image_url") if image_urls else None
        return {**part, "detail": part.get("detail", "auto"), "file_id": None, "image_url": url}
    return part
