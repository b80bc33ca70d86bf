"""A replica whose mmserve instance cannot be reached (app/ray_serve/replica.py, ``forward``): if the
instance died, the actor ends before answering, so the ingress tries another replica instead of relaying
a refusal; if it is alive, the request gets the refusal, as from ``mmserve proxy``. The replica's actor
is built without Ray here (its constructor needs a Serve replica context) and asks a real closed port."""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict

import httpx
import pytest

pytest.importorskip("ray.serve")

from app.ray_serve import replica as replica_module  # noqa: E402 (after the skip)
from app.ray_serve.messages import ReplicaHead, ReplicaRequest  # noqa: E402
from tests.e2e.server import free_port  # noqa: E402


class ActorExit(Exception):
    """Stands for ``os._exit`` in these tests."""


def unreachable_replica(instance_exited: bool) -> replica_module.MmserveReplica:
    replica = object.__new__(replica_module.MmserveReplica)
    replica.name, replica.url = "r1", f"http://127.0.0.1:{free_port()}"  # nothing listens there
    replica.report_keys, replica.stream_interval_s = 16, 0.05
    replica._keys, replica._stopping = OrderedDict(), False
    replica._instance, replica.log_path = None, "/nonexistent/mmserve-replica.log"  # (for __del__)
    replica.tmp = "/nonexistent/mmserve-replica"
    replica._instance_exited = threading.Event()
    if instance_exited:
        replica._instance_exited.set()
    return replica


async def first_items(replica: replica_module.MmserveReplica) -> list[object]:
    request = ReplicaRequest("POST", "/v1/chat/completions", {}, b"{}")
    async with httpx.AsyncClient(timeout=5.0) as client:
        replica._client = client
        return [item async for item in replica.forward(request)]


def test_a_request_that_finds_the_instance_dead_ends_the_actor_before_any_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def exit_(code: int) -> None:
        raise ActorExit(code)

    monkeypatch.setattr(replica_module.os, "_exit", exit_)
    with pytest.raises(ActorExit):
        asyncio.run(first_items(unreachable_replica(instance_exited=True)))


def test_a_request_that_finds_the_instance_alive_but_unreachable_gets_the_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(replica_module, "EXIT_GRACE_S", 0.05)
    head, body = asyncio.run(first_items(unreachable_replica(instance_exited=False)))
    assert isinstance(head, ReplicaHead) and head.status == 503 and head.replica == "r1"
    assert isinstance(body, bytes) and b"upstream_unavailable" in body
