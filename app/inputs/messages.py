"""A chat request's messages as the chat template reads them, and its media parts in prompt order."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from app.media.kinds import MediaKind


@dataclass(frozen=True)
class MediaPart:
    kind: MediaKind
    url: str | None  # None: left out, named by ``uuid``
    param: str
    uuid: str | None = None


def normalise_messages(messages: list[Any]) -> tuple[list[dict[str, Any]], list[MediaPart]]:
    """OpenAI messages → chat-template messages with ``{"type": "image"}`` / ``{"type": "video"}``
    parts, plus the media parts in prompt order with their request locations."""
    rendered: list[dict[str, Any]] = []
    media: list[MediaPart] = []
    for i, message in enumerate(messages):
        content = message.content
        if content is None or isinstance(content, str):
            rendered.append(_with_tool_fields({"role": message.role, "content": content or ""}, message))
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            if part.type == "text":
                parts.append({"type": "text", "text": part.text})
            else:
                kind = MediaKind.VIDEO if part.type == "video_url" else MediaKind.IMAGE
                parts.append({"type": kind.value})
                where = f"messages[{i}].content[{j}]"
                param = f"{where}.{part.type}.url" if part.url is not None else f"{where}.uuid"
                media.append(MediaPart(kind, part.url, param, part.uuid))
        rendered.append(_with_tool_fields({"role": message.role, "content": parts}, message))
    return rendered, media


def _with_tool_fields(rendered: dict[str, Any], message: Any) -> dict[str, Any]:
    """An assistant message's calls as chat templates read them (arguments decoded to an object), and a
    tool message's call id."""
    calls = getattr(message, "tool_calls", None)
    if calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
            }
            for call in calls
        ]
    call_id = getattr(message, "tool_call_id", None)
    if call_id is not None:
        rendered["tool_call_id"] = call_id
    return rendered
