"""A response's output items (app/api/responses_service.py makes the response): the answer's text as a
``message`` item and each call as a ``function_call`` item, in the order the answer began them, whole
(``output_items``) or as the typed events of a stream builds them (``OutputStream``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.api.outputs import Generation
from app.api.response_items import output_item_id
from app.api.tool_calls import ContentDelta, ToolCall, ToolCallDelta, ToolCallStreamer


def _message(message_id: str, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    """The output item of a response's text: the assistant's message."""
    return {"id": message_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _function_call(
    call: ToolCall, item_id: str, status: str = "completed", arguments: str | None = None
) -> dict[str, Any]:
    """The output item of one call: its ``call_id`` is what a ``function_call_output`` answers."""
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if arguments is None else arguments,
    }


def output_items(gen: Generation) -> list[dict[str, Any]]:
    """A finished answer's output items: its text as a message (unless a call-parsing answer has none)
    and its calls (one cut off by the max tokens ``incomplete``), in the order the answer began them;
    none for an answer cut off as it opened its first call. The items a stream of it ends with: those of
    ``OutputStream`` given the whole text at once."""
    if not gen.parse_tool_calls:
        message_id = output_item_id("message", gen.response_id)
        return [_message(message_id, answer_status(gen), [_text_part(gen.text, gen.logprobs)])]
    stream = OutputStream(gen.response_id, lambda kind, **fields: kind, gen.call_streamer())
    stream.push(gen.text, gen, [])
    return stream.finish(gen)[1]


def answer_status(gen: Generation) -> str:
    return "incomplete" if gen.finish_reason == "length" else "completed"


Event = Callable[..., str]


class OutputStream:
    """A streamed answer's output-item events, built as its text arrives: the message opened with its
    first text (at once for an answer that parses no calls) and each call once it closed (app/api/
    tool_calls.py), in output order; ``finish`` closes what is open and returns the items, with the
    ids the events used, for the final ``response`` object. As OpenAI's, an item is done before the
    next is added: a call that closes while the message is open (text came first, and more may follow)
    is added once the message is done, at the answer's end."""

    def __init__(self, response_id: str, event: Event, calls: ToolCallStreamer | None) -> None:
        self.response_id, self.event, self.calls = response_id, event, calls
        self.message_id = output_item_id("message", response_id)
        self.items: list[dict[str, Any]] = []
        self.text: str | None = None  # the message's text, once opened
        self.where: dict[str, Any] = {}
        self.later: list[ToolCallDelta] = []  # calls that closed while the message was open
        self.opened: list[str] = [] if calls is not None else self._open()

    def _open(self) -> list[str]:
        self.text = ""
        self.where = {"item_id": self.message_id, "output_index": len(self.items), "content_index": 0}
        self.items.append(_message(self.message_id, "in_progress", []))
        return [
            self.event("response.output_item.added", output_index=len(self.items) - 1, item=self.items[-1]),
            self.event("response.content_part.added", part=_text_part(""), **self.where),
        ]

    def push(self, text: str, gen: Generation, logprobs: list[dict[str, Any]]) -> list[str]:
        """Events for the answer's new ``text`` (its tokens' ``logprobs``, asked for only without calls to
        parse; a token whose text is held back, as a stop string's start, has them with no text); once
        ``gen`` finished, held text is released."""
        events, self.opened = self.opened, []
        pieces: list[ContentDelta | ToolCallDelta]
        if self.calls is None:
            pieces = [ContentDelta(text)] if text or logprobs else []
        else:
            last = gen.finish_reason is not None
            pieces = self.calls.push(text) + (self.calls.finish(gen.cut) if last else [])
        for piece in pieces:
            if isinstance(piece, ContentDelta):
                if self.text is None:
                    events += self._open()
                self.text = (self.text or "") + piece.content
                events.append(
                    self.event(
                        "response.output_text.delta", delta=piece.content, logprobs=logprobs, **self.where
                    )
                )
            elif self.text is not None:
                self.later.append(piece)
            else:
                events += self._call(piece)
        return events

    def _call(self, piece: ToolCallDelta) -> list[str]:
        """The events of a call's delta: its first (id and name) adds its item, the next (its arguments)
        completes it."""
        if piece.id is not None:
            call = ToolCall(piece.id, piece.name or "", "")
            item_id = output_item_id("function_call", self.response_id, piece.index)
            self.items.append(_function_call(call, item_id, "in_progress", ""))
            index = len(self.items) - 1
            return [self.event("response.output_item.added", output_index=index, item=self.items[index])]
        index, item = len(self.items) - 1, self.items[-1]
        item.update(arguments=piece.arguments, status="completed" if piece.complete else "incomplete")
        where = {"item_id": item["id"], "output_index": index}
        return [
            self.event("response.function_call_arguments.delta", delta=piece.arguments, **where),
            self.event("response.function_call_arguments.done", arguments=piece.arguments, **where),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def finish(self, gen: Generation) -> tuple[list[str], list[dict[str, Any]]]:
        events = self.opened
        cut_opening = self.calls is not None and self.calls.cut_off  # (as ``output_items``: nothing)
        if self.text is None and not self.items and not cut_opening:  # nothing: an empty message
            events += self._open()
        if self.text is not None:
            index = self.where["output_index"]
            part = _text_part(self.text, gen.logprobs)
            self.items[index] = _message(self.message_id, answer_status(gen), [part])
            events += [
                self.event(
                    "response.output_text.done", text=self.text, logprobs=part["logprobs"], **self.where
                ),
                self.event("response.content_part.done", part=part, **self.where),
                self.event("response.output_item.done", output_index=index, item=self.items[index]),
            ]
        for piece in self.later:
            events += self._call(piece)
        return events, self.items


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An ``output_text`` part: its tokens' logprobs where the request included them (chat's entries,
    the shape of OpenAI's ``Logprob``), else none."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs or [])}
