"""The Responses API through ``mmserve proxy`` (docs/architecture.md, "The encoder / LM split"): a
``POST /v1/responses`` has its ``input_image`` parts encoded as a chat request's images are, and a stored
response stays on the LM instance that made it (its store, and its conversation's media in its caches).
So what reads one goes there: a follow-up by ``previous_response_id`` (or an ``item_reference`` to an item
it made), ``GET`` and ``DELETE /v1/responses/{id}``, its input items and its cancel. The proxy learns each
answer's id as it passes (``ResponseHolders``); an id it does not know (a proxy restarted, or past its
bounded memory) it asks each LM instance for once, with the client's key."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

MAX_HELD_IDS = 1 << 16  # response id -> LM URL, least recently used out first (about 10 MB)


class ResponseHolders:
    """Which LM instance made each response the proxy saw answered. Used from the event loop only."""

    def __init__(self, max_ids: int = MAX_HELD_IDS) -> None:
        self.max_ids = max_ids
        self._by_id: OrderedDict[str, str] = OrderedDict()

    def learn(self, response_id: str, lm_url: str) -> None:
        self._by_id[response_id] = lm_url
        self._by_id.move_to_end(response_id)
        if len(self._by_id) > self.max_ids:
            self._by_id.popitem(last=False)

    def get(self, response_id: str) -> str | None:
        lm_url = self._by_id.get(response_id)
        if lm_url is not None:
            self._by_id.move_to_end(response_id)
        return lm_url

    async def find(
        self,
        client: httpx.AsyncClient,
        lm_urls: Sequence[str],
        response_id: str,
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> str | None:
        """The LM instance that holds ``response_id`` for this client's key: the one that made it, or
        the first that answers ``GET /v1/responses/{id}`` with 200; None where none does (the
        request then goes to any LM instance, which answers its 404)."""
        known = self.get(response_id)
        if known is not None or len(lm_urls) == 1:
            return known
        for lm_url in lm_urls:
            url = f"{lm_url}/v1/responses/{response_id}"
            try:
                resp = await client.get(url, headers=headers, timeout=timeout_s)
            except httpx.HTTPError:  # an instance down holds nothing reachable: ask the next
                continue
            if resp.status_code == 200:
                self.learn(response_id, lm_url)
                return lm_url
        return None


def responses_media_parts(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The distinct ``input_image`` parts of a Responses body's input messages (one per URL, first
    appearance first), as the chat image parts an encoder instance takes: the LM instance translates
    them the same way, so each one's content hash is the one the encoder saved its output under."""
    items = body.get("input")
    if not isinstance(items, list):
        return []
    by_url: dict[str, dict[str, Any]] = {}
    for item in items:
        content = item.get("content") if isinstance(item, Mapping) else None
        for part in content if isinstance(content, list) else ():
            url = part.get("image_url") if isinstance(part, Mapping) else None
            if part.get("type") == "input_image" and isinstance(url, str):
                chat_part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
                if isinstance(part.get("uuid"), str):
                    chat_part["uuid"] = part["uuid"]
                by_url.setdefault(url, chat_part)
    return list(by_url.values())
