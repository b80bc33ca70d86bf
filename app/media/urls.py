"""The encoded bytes behind a media URL, whatever its kind.

The mm_hash is taken over a medium's original encoded bytes, so the same file sent by ``https://`` or as
a ``data:`` URL must give the same bytes here. What may be fetched, and how, is ``app.media.url_policy``
and ``app.media.fetch``; the kind (image, video) gives the size limit, the data-URL media type and the
error codes. Every failure is a ``MediaError`` (HTTP 400) naming the message part in ``param``.
"""

from __future__ import annotations

import base64
import binascii

from app.errors import MediaError
from app.media.fetch import MediaFetcher, RequestImageBudget
from app.media.kinds import MediaKind

# What a base64 payload may carry between its characters: the bytes ``re``'s ``\s`` matches in a bytes
# pattern, removed with ``bytes.translate`` (one C pass; the regex took 1.5 ms on a 136 KB payload).
_BASE64_WHITESPACE = b" \t\n\r\x0b\x0c"


async def load_media_bytes(
    url: str,
    *,
    kind: MediaKind,
    fetcher: MediaFetcher,
    param: str,
    budget: RequestImageBudget | None = None,
) -> bytes:
    """The encoded bytes behind a media URL: ``data:<kind>/...;base64,``, ``http(s)://`` (under the media
    policy: public addresses, allowed domains, redirects checked hop by hop) or ``file://`` (only under
    ``--allowed-local-media-path``).

    Called once per media part while a request is prepared. At most the kind's byte limit is read, and
    every byte counts against ``budget``, the request's total when one is given.
    """
    head = url[:16]  # the schemes taken are short; splitting a data URL would copy its whole payload
    scheme = head.split(":", 1)[0].lower() if ":" in head else ""
    if scheme == "data":
        data = decode_data_url(url, kind=kind, max_bytes=fetcher.policy.max_bytes(kind), param=param)
        if budget is not None:
            budget.add(len(data))
        return data
    if scheme in ("http", "https"):
        return await fetcher.fetch_http(url, param=param, budget=budget, kind=kind)
    if scheme == "file":
        return await fetcher.read_file(url, param=param, budget=budget, kind=kind)
    raise MediaError(
        f"{kind.noun} URLs must be http://, https:// or data:{kind}/...;base64, URLs.",
        param=param,
        code=kind.invalid_url_code,
    )


def is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"


def decode_data_url(url: str, *, kind: MediaKind, max_bytes: int, param: str) -> bytes:
    """The bytes a ``data:<kind>/<format>;base64,`` URL carries (whitespace in the payload ignored), at
    most ``max_bytes``; anything else is a ``MediaError``."""
    header, sep, payload = url.partition(",")
    # header: "data:<mediatype>[;params];base64"
    fields = header[len("data:") :].split(";")
    media_type = fields[0].strip().lower()
    if not sep or fields[-1].strip().lower() != "base64" or len(fields) < 2:
        raise MediaError(
            f"Data URLs must have the form data:{kind}/<format>;base64,<data>.",
            param=param,
            code=kind.invalid_url_code,
        )
    if not media_type.startswith(f"{kind}/") or len(media_type) == len(kind) + 1:
        raise MediaError(
            f"Data URL media type must be {kind}/<format>, got {media_type or 'none'!r}.",
            param=param,
            code=kind.invalid_url_code,
        )
    encoded = payload.encode("ascii", "replace").translate(None, _BASE64_WHITESPACE)
    if len(encoded) // 4 * 3 > max_bytes + 2:
        raise MediaError(
            f"{kind.noun} exceeds the limit of {max_bytes} bytes.", param=param, code=kind.too_large_code
        )
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(
            "Data URL payload is not valid base64.", param=param, code=kind.invalid_url_code
        ) from exc
    if not data:
        raise MediaError(f"Data URL carries no {kind} data.", param=param, code=kind.invalid_url_code)
    if len(data) > max_bytes:
        raise MediaError(
            f"{kind.noun} exceeds the limit of {max_bytes} bytes.", param=param, code=kind.too_large_code
        )
    return data
