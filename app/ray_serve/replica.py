"""One Ray Serve replica: a whole mmserve instance (``mmserve serve``: its API, engine and worker
processes) on a free loopback port of the replica's node, owned by the replica's actor
(docs/architecture.md, "Replicas on Ray Serve").

- Start: the instance is spawned with the deployment's mmserve settings; the replica is ready when its
  ``/health`` answers 200 (Ray waits on the constructor).
- Requests: ``forward`` relays one ``ReplicaRequest`` over HTTP and streams back a ``ReplicaHead`` and the
  body's bytes, an SSE body in fewer, larger items (``stream_batching``); a client that leaves cancels
  the stream, which closes the connection, which aborts the request in the instance.
- What it holds: the keys of the media it served most recently and of the Responses API answers it
  made (``report_keys`` of them, LRU), reported with its URL through ``record_routing_stats``. Its
  caches are LRU too; a key it reports may have been evicted there, which costs a miss and nothing
  else.
- Health and death: ``check_health`` asks the instance; an instance that exits ends the replica's actor
  at once, so the router forgets its keys and Ray starts a new replica. A request that finds the
  instance gone ends the actor too, before answering, so the ingress tries another replica. An actor
  that dies takes its instance with it (PR_SET_PDEATHSIG on the thread that waits for it); one stopped
  by Serve stops the instance gracefully (SIGTERM: it drains).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable

import httpx
from ray import serve

from app.api.error_handlers import error_response, sse_error_event
from app.api.response_ids import ResponseIdWatch
from app.errors import MMServeError
from app.proxy.forward import RELAYED_RESPONSE_HEADERS, UpstreamUnavailableError, describe, open_upstream
from app.ray_serve.grpc_binding import bind_to_node_address
from app.ray_serve.media_keys import response_key
from app.ray_serve.messages import ReplicaHead, ReplicaRequest
from app.ray_serve.stream_batching import DEFAULT_INTERVAL_S, batched

log = logging.getLogger("mmserve.ray")

STOP_GRACE_S = 30.0  # SIGTERM drains the instance's requests; then SIGKILL
EXIT_GRACE_S = 1.0  # an unreachable instance: how long to wait to learn whether it died
READ_TIMEOUT_S = 600.0  # a read of the instance's answer: generation steps bound it long before this


def _free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the thread that spawned it (the waiting thread) ends."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class MmserveReplica:
    def __init__(
        self,
        report_keys: int = 4096,
        start_timeout_s: float = 600,
        stream_interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        """The instance's settings are this actor's ``MMSERVE_*`` variables (``app.ray_serve.app``).
        ``stream_interval_s``: an SSE answer's items, after the first few, at most one per interval."""
        bind_to_node_address()
        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id
        self.port = _free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.report_keys = report_keys
        self.stream_interval_s = stream_interval_s
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._stopping = False
        fd, self.log_path = tempfile.mkstemp(prefix=f"mmserve-replica-{self.name}-", suffix=".log")
        os.close(fd)
        # the instance's temporary files (its sockets' folder) go here, removed whenever it ends: a
        # SIGKILLed instance cannot remove its own
        self.tmp = tempfile.mkdtemp(prefix=f"mmserve-replica-{self.name}-")
        argv = [
            sys.executable,
            "-P",  # not the working folder first on sys.path: a folder of its own named app stays out
            "-m",
            "app.launch.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        spawned = threading.Event()
        self._instance_exited = threading.Event()
        self._instance: subprocess.Popen[bytes] | None = None
        threading.Thread(target=self._own_instance, args=(argv, spawned), daemon=True).start()
        spawned.wait()
        self._wait_until_healthy(start_timeout_s)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=READ_TIMEOUT_S))
        log.info("replica %s serves mmserve at %s (log %s)", self.name, self.url, self.log_path)

    def _own_instance(self, argv: list[str], spawned: threading.Event) -> None:
        """Spawns the instance and waits for it for as long as it runs: this thread's end is the
        instance's PR_SET_PDEATHSIG. An instance that exits unasked ends the actor."""
        with open(self.log_path, "ab") as out:
            self._instance = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
                start_new_session=True,
                env={**os.environ, "TMPDIR": self.tmp},
            )
        spawned.set()
        code = self._instance.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._instance_exited.set()
        if not self._stopping:
            log.error("replica %s: its mmserve instance exited (%s); see %s", self.name, code, self.log_path)
            os._exit(1)  # the router forgets this replica's keys; Ray starts another

    def _wait_until_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        assert self._instance is not None
        with httpx.Client(timeout=2.0, trust_env=False) as client:  # one TLS context, not one per poll
            while time.monotonic() < deadline:
                if self._instance.poll() is not None:
                    raise RuntimeError(
                        f"mmserve exited ({self._instance.returncode}) at start: {self._log_tail()}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        raise RuntimeError(f"mmserve did not become healthy in {timeout_s:g}s: {self._log_tail()}")

    def _log_tail(self, num_bytes: int = 2000) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(self.log_path) - num_bytes))
            return f.read().decode(errors="replace")

    def _hold(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.report_keys:
            self._keys.popitem(last=False)

    async def forward(self, request: ReplicaRequest) -> AsyncIterator[ReplicaHead | bytes]:
        self._hold(request.media_keys)
        try:
            upstream = await open_upstream(
                self._client,
                request.method,
                self.url + request.path,
                content=request.body,
                headers=request.headers,
            )
        except MMServeError as exc:
            unreachable = isinstance(exc, UpstreamUnavailableError) and not self._stopping
            if unreachable and await asyncio.to_thread(self._instance_exited.wait, EXIT_GRACE_S):
                # The instance died and this actor is ending with it (``_own_instance``): end it before
                # any answer, so that the ingress tries another replica instead of relaying a refusal.
                os._exit(1)
            refusal = error_response(exc)
            yield ReplicaHead(refusal.status_code, {"content-type": "application/json"}, self.name)
            yield bytes(refusal.body)
            return
        try:
            headers = {
                name: upstream.headers[name] for name in RELAYED_RESPONSE_HEADERS if name in upstream.headers
            }
            yield ReplicaHead(upstream.status_code, headers, self.name)
            is_sse = headers.get("content-type", "").startswith("text/event-stream")
            body = upstream.aiter_bytes()  # decoded: Content-Encoding is not relayed
            interval_s = self.stream_interval_s if is_sse else 0.0  # the ingress reads others whole
            watch = None
            if request.response_tenant is not None and upstream.status_code == 200:
                tenant = request.response_tenant
                watch = ResponseIdWatch(lambda made: self._hold([response_key(tenant, made)]), is_sse)
            try:
                async with contextlib.aclosing(batched(body, interval_s)) as items:
                    async for item in items:
                        if watch is not None:
                            watch.feed(item)
                        yield item
                if watch is not None:
                    watch.finish()
            except httpx.HTTPError as exc:
                error = UpstreamUnavailableError(
                    f"The replica's instance failed mid-answer ({describe(exc)})."
                )
                if not is_sse:
                    raise error from exc  # the ingress has sent nothing yet: it answers 503
                yield sse_error_event(error).encode()  # the stream's status went out: an error event ends it
        finally:
            await upstream.aclose()

    def record_routing_stats(self) -> dict[str, object]:
        """Read by the request router (``RunningReplica.routing_stats``), every few seconds."""
        pid = self._instance.pid if self._instance is not None else None
        return {"media_keys": list(self._keys), "url": self.url, "pid": pid, "node": os.uname().nodename}

    async def check_health(self) -> None:
        if self._instance is None or self._instance.poll() is not None:
            raise RuntimeError(f"replica {self.name}: its mmserve instance is not running")
        resp = await self._client.get(f"{self.url}/health", timeout=5.0)
        if resp.status_code != 200:
            raise RuntimeError(f"replica {self.name}: /health answered {resp.status_code}")

    def __del__(self) -> None:
        """Serve stops the replica: the instance drains (SIGTERM), then is killed if it must be; its log
        goes."""
        self._stopping = True
        instance = self._instance
        if instance is not None and instance.poll() is None:
            instance.send_signal(signal.SIGTERM)
            try:
                instance.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(instance.pid, signal.SIGKILL)
                instance.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.remove(self.log_path)  # kept only where the instance died unasked (the actor exits first)
