"""The id of a Responses API answer, read from the answer as it passes (docs/architecture.md, "Replicas
on Ray Serve"): the ingress places it on the replica that made it at once, and that replica reports it
among its keys, so a follow-up by ``previous_response_id`` finds the replica that holds the stored
response and its conversation's media, even through an ingress that has not seen the answer (one
restarted, or past its bounded memory of placements)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.api.json_body import decode_json


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
