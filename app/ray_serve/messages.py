"""The typed messages of the ingress → replica hop (docs/architecture.md, "Replicas on Ray Serve"),
pickled by Ray: one ``ReplicaRequest`` per HTTP request, answered by a stream whose first item is a
``ReplicaHead`` and whose other items are the body's bytes as the instance sent them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ReplicaRequest:
    method: str
    path: str  # with the query string, if any
    headers: dict[str, str]  # only those the instance needs (auth, content type)
    body: bytes
    media_keys: tuple[str, ...] = ()  # what the media-affinity router places it by
    chat_messages: list[Any] | None = field(default=None, repr=False)
    response_tenant: str | None = None  # a Responses API request's tenant: its answer's id is a key
    # its keys name a stored response that only the replica holding it has (no shared response store):
    # it goes to a holder whatever the queues, and is not placed where none is known
    holder_only: bool = False

    @property
    def messages(self) -> list[Any]:
        """The chat messages, read by Ray's ``PrefixCacheAffinityRouter`` (the benchmark's peer): it
        looks for a ``messages`` attribute. A request without any routes on its path."""
        return self.chat_messages if self.chat_messages is not None else [{"content": self.path}]


@dataclass(frozen=True)
class ReplicaHead:
    """The instance's status and the response headers the ingress relays, with the replica's name."""

    status: int
    headers: dict[str, str]
    replica: str
