"""Which stored responses a request reads, and the id of a Responses API answer read from the answer as
it passes: what a front of several instances (the Ray ingress, docs/architecture.md, "Replicas on Ray
Serve"; ``mmserve proxy``) needs to send a follow-up by ``previous_response_id`` where its stored
response and its conversation's media are."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from app.api.json_body import decode_json
from app.api.response_items import made_by


def json_or_none(body: bytes) -> Any:
    """``body`` as strict JSON (as the API process reads it: app/api/json_body.py), or None where it is
    not: such a body has no keys, and the replica answers its 400."""
    if not body:
        return None
    try:
        return decode_json(body)
    except ValueError:  # json.JSONDecodeError
        return None


class ResponseIdWatch:
    """Finds the response id in an answer fed chunk by chunk: a stream's first event
    (``response.created``), or the whole JSON body of an answer that is not streamed."""

    MAX_BYTES = 1 << 20  # past this, the answer is not watched (a stream's first event is far smaller)

    def __init__(self, learn: Callable[[str], None], streamed: bool) -> None:
        self.learn, self.streamed = learn, streamed
        self.seen = b""
        self.done = False

    def feed(self, chunk: bytes) -> None:
        if self.done:
            return
        self.seen += chunk
        if len(self.seen) > self.MAX_BYTES:
            self.done, self.seen = True, b""
        elif self.streamed:
            event, separator, _ = self.seen.partition(b"\n\n")
            if separator:
                self.done = True
                for line in event.splitlines():
                    if line.startswith(b"data: "):
                        data = json_or_none(line.removeprefix(b"data: "))
                        self._learn(data.get("response") if isinstance(data, dict) else None)

    def finish(self) -> None:
        """The answer ended: a JSON body is read now."""
        if not self.done and not self.streamed:
            self._learn(json_or_none(self.seen))
        self.done, self.seen = True, b""

    def _learn(self, response: Any) -> None:
        if isinstance(response, dict) and isinstance(response.get("id"), str):
            self.learn(response["id"])


def followed_responses(body: Any) -> list[str]:
    """The stored responses a body reads: the one it follows, and those that made the items it refers
    to (where mmserve gave their ids)."""
    if not isinstance(body, Mapping):
        return []
    previous = body.get("previous_response_id")
    followed = [previous] if isinstance(previous, str) else []
    items = body.get("input")
    for item in items if isinstance(items, list) else ():
        if isinstance(item, Mapping) and item.get("type", "item_reference") == "item_reference":
            item_id = item.get("id")
            made = made_by(item_id) if isinstance(item_id, str) and "role" not in item else None
            followed += [made] if made is not None else []
    return followed
