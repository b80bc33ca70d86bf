"""A request's media keys, the identities the media-affinity router places requests by
(docs/architecture.md, "Replicas on Ray Serve"). Computed at the ingress from the JSON body alone:
nothing is fetched or decoded, and a body mmserve would refuse simply has fewer keys (the replica then
gives the proper 400).

    an image or video by URL    the URL's exact text (a data URL's too, as the API process's table of
                                known data URLs keys it) with the part's kind, ``mm_processor_kwargs``
                                and the request's cache scope (``cache_salt``, tenant isolation)
    a media id (``uuid``)       the tenant (its API key) and the uuid: a part that binds one has both
                                keys, so a later part with the uuid alone goes where the binding is
    ``previous_response_id``    the tenant and the id: the conversation's media are where the response
                                was made (``response_key``, which the ingress places once it answered)
    an ``item_reference``       the same key, of the response whose turn made the item, which the id
                                mmserve gave it names (app/api/response_items.py); none for another id
    ``/v1/responses/{id}``      the same key, from the path (``GET``, ``DELETE``, ``GET .../input_items``,
                                ``POST .../cancel``): a replica's store holds only the responses it made
                                (``stored_response_keys``)

Each key is a short digest, so a replica's report of what it holds stays small.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from app.api.response_ids import followed_responses
from app.inputs.media_ids import CacheScope
from wire.hashing import framed_digest

MEDIA_KEY_DOMAIN = b"mmserve.route.media.v1"
MEDIA_ID_KEY_DOMAIN = b"mmserve.route.media_id.v1"
RESPONSE_KEY_DOMAIN = b"mmserve.route.response.v1"
STORED_RESPONSES_PATH = "/v1/responses/"
KEY_CHARS = 24  # 96 bits of a blake3 digest: no two media of a deployment share one

# chat's media parts and the Responses API's input_image, each with where its URL is
_CHAT_PARTS = {"image_url": "image", "video_url": "video"}
_RESPONSES_PARTS = {"input_image": "image"}


def media_keys(body: Any, *, tenant: str, isolate_tenants: bool) -> tuple[str, ...]:
    """The distinct media keys of a chat-completions or responses body, first appearance first."""
    if not isinstance(body, Mapping):
        return ()
    salt = body.get("cache_salt")
    scope = CacheScope.of(
        tenant=tenant, cache_salt=salt if isinstance(salt, str) else None, isolate_tenants=isolate_tenants
    )
    options = body.get("mm_processor_kwargs")
    options = dict(options) if isinstance(options, Mapping) else {}
    keys = dict.fromkeys(response_key(tenant, followed) for followed in followed_responses(body))
    for kind, url, uuid in _media_parts(body):
        if url is not None:
            keys[framed_digest(MEDIA_KEY_DOMAIN, kind, url, options, scope.salt)[:KEY_CHARS]] = None
        if uuid is not None:
            keys[framed_digest(MEDIA_ID_KEY_DOMAIN, tenant, uuid)[:KEY_CHARS]] = None
    return tuple(keys)


def _media_parts(body: Mapping[str, Any]) -> Iterator[tuple[str, str | None, str | None]]:
    """(kind, url, uuid) of every media part in ``messages`` or ``input``."""
    items = body.get("messages", body.get("input"))
    if not isinstance(items, list):
        return
    for item in items:
        content = item.get("content") if isinstance(item, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, Mapping):
                yield from _media_of(part)


def _media_of(part: Mapping[str, Any]) -> Iterator[tuple[str, str | None, str | None]]:
    kind_name = part.get("type")
    uuid = part.get("uuid") if isinstance(part.get("uuid"), str) else None
    if kind_name in _CHAT_PARTS:
        media = part.get(kind_name)
        url = media.get("url") if isinstance(media, Mapping) else None
        yield _CHAT_PARTS[kind_name], url if isinstance(url, str) else None, uuid
    elif kind_name in _RESPONSES_PARTS:
        url = part.get("image_url")
        yield _RESPONSES_PARTS[kind_name], url if isinstance(url, str) else None, uuid


def stored_response_keys(method: str, path: str, tenant: str) -> tuple[str, ...]:
    """The key of the stored response that ``GET`` or ``DELETE /v1/responses/{id}``, ``GET
    /v1/responses/{id}/input_items`` or ``POST /v1/responses/{id}/cancel`` names; none for any other
    request."""
    if not path.startswith(STORED_RESPONSES_PATH):
        return ()
    response_id, *below = path.removeprefix(STORED_RESPONSES_PATH).split("/")
    names = {("GET", ()), ("DELETE", ()), ("GET", ("input_items",)), ("POST", ("cancel",))}
    if not response_id or (method, tuple(below)) not in names:
        return ()
    return (response_key(tenant, response_id),)


def response_key(tenant: str, response_id: str) -> str:
    """The key of a stored response: a follow-up naming it goes where it was made."""
    return framed_digest(RESPONSE_KEY_DOMAIN, tenant, response_id)[:KEY_CHARS]
