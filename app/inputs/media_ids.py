"""Cache scopes (``cache_salt``, tenants) and media ids (a client's ``uuid`` for media it sent before):
docs/architecture.md, "Cache salts and media ids".

A media id is only a name for content this server has hashed. A binding ``uuid -> mm_hash`` is recorded
when a request brings the media with its uuid (once the item is hashed and its layout known); a later
request with the same uuid and no media is served as that mm_hash, if a cache still holds the item. A
uuid sent with other media rebinds. The binding's key holds the tenant and the cache salt, so another
tenant's uuid, or the same uuid under another salt, is unknown; the binding holds the kind and options
the item was processed with, so a use with other options is unknown too. Unknown never means another
item: it is a 400 asking for the media.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from app.errors import InvalidRequestError
from wire.hashing import framed_digest
from workers.families.processing import ItemLayout

SALT_DOMAIN = b"mmserve.cache_salt.v1"


@dataclass(frozen=True)
class CacheScope:
    """Whose caches a request may hit. ``salt`` is folded into every item's mm_hash and into the first
    KV block's hash (so into every cache keyed by either); None shares with every unsalted request."""

    tenant: str  # "" when the server has no API keys
    salt: str | None

    @classmethod
    def of(cls, *, tenant: str, cache_salt: str | None, isolate_tenants: bool) -> CacheScope:
        """``cache_salt`` as given (the same salt from two tenants shares, as in vLLM), or with
        ``--tenant-cache-isolation`` always within the tenant (its key's own salt by default)."""
        if isolate_tenants and tenant:
            return cls(tenant, framed_digest(SALT_DOMAIN, tenant, cache_salt))
        if cache_salt is None:
            return cls(tenant, None)
        return cls(tenant, framed_digest(SALT_DOMAIN, "", cache_salt))


UNSCOPED = CacheScope("", None)


@dataclass(frozen=True)
class MediaBinding:
    """What a uuid names: the item's mm_hash under the kind and options it was sent with, and its layout
    (what another API process needs to place the item without processing it)."""

    mm_hash: str
    kind: str
    options: Mapping[str, Any]
    layout: ItemLayout | None = None


BindingKey = tuple[str, str, str]  # (tenant, salt or "", uuid)


def binding_key(scope: CacheScope, uuid: str) -> BindingKey:
    return (scope.tenant, scope.salt or "", uuid)


def media_uuid_unknown(uuid: str | None, param: str, detail: str) -> InvalidRequestError:
    """The 400 for a media id that names nothing this server holds (``detail`` says why, if known)."""
    named = f"The media id {uuid!r}" if uuid is not None else "This media id"
    return InvalidRequestError(
        f"{named} names no media this server holds{detail}. Send the media again with the uuid.",
        param=param,
        code="media_uuid_unknown",
    )


class MediaIds(Protocol):
    """The uuid bindings of one server: ``LocalMediaIds`` in one API process, or
    ``app.inputs.shared_media_ids.SharedMediaIds`` across the API processes of ``serve
    --api-server-count N``."""

    def bind(self, key: BindingKey, binding: MediaBinding) -> None: ...

    def get(self, key: BindingKey) -> MediaBinding | None: ...

    def __len__(self) -> int: ...


class LocalMediaIds:
    """Bindings in this process, least recently used out past ``max_entries`` (0: none kept). Called
    from the event loop only."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._bindings: OrderedDict[BindingKey, MediaBinding] = OrderedDict()

    def bind(self, key: BindingKey, binding: MediaBinding) -> None:
        if self.max_entries == 0:
            return
        self._bindings[key] = binding
        self._bindings.move_to_end(key)
        while len(self._bindings) > self.max_entries:
            self._bindings.popitem(last=False)

    def get(self, key: BindingKey) -> MediaBinding | None:
        binding = self._bindings.get(key)
        if binding is not None:
            self._bindings.move_to_end(key)
        return binding

    def __len__(self) -> int:
        return len(self._bindings)
