"""Ray Serve request routers for the replica deployment (docs/architecture.md, "Replicas on Ray
Serve"). Each runs in the process that holds the deployment's handle (the ingress) and is named in
the deployment's ``RequestRouterConfig`` by its import path.

- ``MediaAffinityRouter``, the default: ranks replicas by how many of a request's media keys they hold
  (``AffinityTable``: their reports and its own placements), within a bounded imbalance.
- ``ListedPowerOfTwoRouter`` and ``ListedPrefixCacheAffinityRouter``: Ray's own default router and Ray
  Serve LLM's prefix router, unchanged but for being listed like the first; the benchmark compares all
  three (``mmserve ray serve --router``).

Every router here is listed in ``router_state.LISTED`` under its deployment's name, so the ingress can
show the replicas and what they report (``GET /replicas``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from app.ray_serve import router_state
from app.ray_serve.affinity import IMBALANCE_THRESHOLD, AffinityTable, Choice
from app.ray_serve.messages import ReplicaRequest

MAX_OPEN_CHOICES = 10_000  # choices of requests not routed yet (a cancelled one never is)


class ListedReplicas:
    """A router mixin: lists the router in ``router_state.LISTED`` so the ingress can read its replicas."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        deployment_id = getattr(self, "_deployment_id", None)
        router_state.LISTED[deployment_id.name if deployment_id is not None else ""] = self

    def listed_replicas(self) -> list[dict[str, Any]]:
        replicas: dict[ReplicaID, RunningReplica] = self.curr_replicas  # type: ignore[attr-defined]
        listed = []
        for replica in replicas.values():
            stats = dict(replica.routing_stats or {})
            keys = stats.pop("media_keys", [])
            listed.append({"replica": replica.replica_id.unique_id, "media_keys_held": len(keys), **stats})
        return sorted(listed, key=lambda entry: str(entry["replica"]))

    def place(self, keys: tuple[str, ...], replica: str) -> None:
        """Only the media-affinity router keeps placements."""


def request_of(pending_request: PendingRequest | None) -> ReplicaRequest | None:
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request if isinstance(request, ReplicaRequest) else None


class MediaAffinityRouter(ListedReplicas, RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        """``imbalance_threshold`` (``IMBALANCE_THRESHOLD``): how many more requests the preferred
        replica may have queued than the least loaded one before a request goes to the least loaded
        instead; ``max_placements`` (65536): the placements remembered."""
        self._table = AffinityTable(int(kwargs.get("max_placements", 65536)))
        self._imbalance_threshold = int(kwargs.get("imbalance_threshold", IMBALANCE_THRESHOLD))
        self._reports: dict[ReplicaID, object] = {}  # the report each replica's keys were taken from
        self._open: OrderedDict[str, tuple[tuple[str, ...], Choice]] = OrderedDict()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every rank tried: wait, then again
        request = request_of(pending_request)
        if request is None or not request.media_keys or not candidate_replicas:
            return [candidate_replicas]  # the least loaded
        assert pending_request is not None
        self._read_reports(candidate_replicas)
        queue_lens = await self._queue_lens(candidate_replicas)
        choice = self._table.choose(
            request.media_keys, queue_lens, self._imbalance_threshold, holder_only=request.holder_only
        )
        # a response's key is placed only where it is: a guess would send its follow-ups astray
        placed = () if request.holder_only and not choice.holders else request.media_keys
        self._open[pending_request.metadata.internal_request_id] = (placed, choice)
        while len(self._open) > MAX_OPEN_CHOICES:
            self._open.popitem(last=False)
        preferred = [r for r in candidate_replicas if r.replica_id in choice.preferred]
        others = [r for r in candidate_replicas if r.replica_id not in choice.preferred]
        return [preferred, others]  # a preferred replica with a full queue: the others

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        keys, choice = self._open.pop(pending_request.metadata.internal_request_id, ((), None))
        if choice is not None:
            router_state.PLACEMENTS.labels(choice.placement(replica_id)).inc()
            self._table.place(keys, replica_id)

    def place(self, keys: tuple[str, ...], replica: str) -> None:
        replicas: dict[ReplicaID, RunningReplica] = self.curr_replicas
        for replica_id in replicas:
            if replica_id.unique_id == replica:
                self._table.place(keys, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {replica.replica_id for replica in replicas}
        for gone in [replica_id for replica_id in self._reports if replica_id not in current]:
            self._forget(gone)

    def _forget(self, replica_id: ReplicaID) -> None:
        self._reports.pop(replica_id, None)
        self._table.forget(replica_id)

    def _read_reports(self, replicas: list[RunningReplica]) -> None:
        """Each replica's latest report, taken in when it is new (a report is a new dict each time)."""
        for replica in replicas:
            stats = replica.routing_stats  # None or {} until the replica's first report
            if stats and self._reports.get(replica.replica_id) is not stats:
                self._reports[replica.replica_id] = stats
                self._table.report(replica.replica_id, stats.get("media_keys", ()))

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[Hashable, int]:
        """Each replica's queue length: the router's cache, or a probe where it has none (as Ray's own
        routers do); a replica that does not answer the probe counts as idle."""
        queue_lens: dict[Hashable, int] = {}
        unknown = []
        for replica in replicas:
            queue_len = self._replica_queue_len_cache.get(replica.replica_id)
            if queue_len is None:
                unknown.append(replica)
            else:
                queue_lens[replica.replica_id] = queue_len
        if unknown:
            for replica, queue_len in await self._probe_queue_lens(unknown, 0):
                queue_lens[replica.replica_id] = queue_len or 0
        return queue_lens


class ListedPowerOfTwoRouter(ListedReplicas, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default router."""


class ListedPrefixCacheAffinityRouter(ListedReplicas, PrefixCacheAffinityRouter):
    """Ray Serve LLM's prefix router: it routes on the chat text (``ReplicaRequest.messages``)."""


ROUTERS = {
    "media": f"{__name__}.MediaAffinityRouter",
    "default": f"{__name__}.ListedPowerOfTwoRouter",
    "prefix": f"{__name__}.ListedPrefixCacheAffinityRouter",
}
