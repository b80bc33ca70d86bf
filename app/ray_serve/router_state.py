"""What a router shares with the ingress in the process that holds the replicas' handle. Apart from
``routers`` because Ray ships a router's own module by value (a copy, with copies of its globals):
this module is imported by name on both sides, so both see one registry and one counter."""

from __future__ import annotations

from typing import Any, Protocol

from prometheus_client import Counter, disable_created_metrics

from app.ray_serve.affinity import Placement

disable_created_metrics()  # as the instances' /metrics: no *_created series beside the counter

PLACEMENTS = Counter(
    "mmserve_ray_placements",
    "Requests with media placed by the media-affinity router, by how: affinity (to a replica holding "
    "some of their media), fallback (held, but that replica's queue was too long), new (held nowhere).",
    ["placement"],
)
for _placement in Placement:  # each at 0 from the start, as an instance's counters are
    PLACEMENTS.labels(_placement)


class Listing(Protocol):
    def listed_replicas(self) -> list[dict[str, Any]]: ...

    def place(self, keys: tuple[str, ...], replica: str) -> None:
        """Keys learnt from an answer (a stored response's id) are held by the replica named."""


LISTED: dict[str, Listing] = {}  # deployment name -> its router in this process
