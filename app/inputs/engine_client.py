"""The API's side of the API⇄engine pipe, and the owner of the IPC mirror.

    API (DEALER, identity=client_id, connect) ──[AddRequest | Abort | ResetCaches | Hello, frames]──▶ engine
                                              ◀──[EngineReady | EngineOutputs | EngineDead]────────

Sending is synchronous and never blocks (unbounded send queue), so a request's mirror decisions and
the hand-off of its message happen in one step with no ``await`` between: socket order is decision
order (docs/architecture.md, "IPC mirror", rule 2). The mirror is reached only through this client:
``lookup_and_pin`` while a request is prepared, then ``send_request`` records, sends and unpins in one
call; ``unpin`` gives back the pins of a request abandoned before it was sent; ``forget`` is the safety
net's. A reader task routes outputs to per-request queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from app.inputs.ipc_mirror import IpcMirror, MirrorDecision, MirrorEntry, MirrorItem
from app.metrics import ApiMetrics
from wire.bad_messages import BadMessage, BadMessageLog, decode_frame0
from wire.curve import CurveKeys, secure_client, uses_curve
from wire.protocol import (
    Abort,
    AddRequest,
    Constraint,
    EngineDead,
    EngineOutbound,
    EngineOutputs,
    EngineReady,
    Hello,
    MMFeature,
    RequestOutput,
    ResetCaches,
    SamplingParams,
    Shutdown,
    TensorRef,
    decode_engine_outbound,
    encode,
)

if TYPE_CHECKING:
    from app.inputs.shm_store import ShmObjectStore
    from workers.families.processing import ItemLayout, ProcessedItem

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
# Until the engine answers ready (starting, or restarted), Hello goes out this often: the API is ready
# within a tenth of a second of its engine and worker, not up to a heartbeat later.
HELLO_UNTIL_READY_S = 0.1
HEARTBEAT_TIMEOUT_S = 10.0
# Outputs of a request released this many releases ago still count as late, not unknown: far more than
# are ever in flight at once.
RELEASED_IDS_KEPT = 4096


@dataclass(frozen=True)
class EngineGone:
    """Put on a request's queue when the engine died or restarted with the request in flight, or when
    the API's drain ran out of time (``end_in_flight``): the request's 503 with this code."""

    reason: str
    code: str = "engine_unavailable"


@dataclass(frozen=True)
class OutgoingItem:
    """One image of a request as ``EngineClient.send_request`` sends it."""

    placement: MMFeature  # mm_hash, offset, num_tokens, grid; ``shm`` set when it lies in the ring
    layout: ItemLayout  # what the mirror keeps for a later key-only send
    item: ProcessedItem | None  # its tensors, when this API process has them
    pinned: bool  # ``lookup_and_pin`` found it; the pin is released by ``send_request``


def tensor_frames(item: ProcessedItem, first_frame: int) -> tuple[dict[str, TensorRef], list[memoryview]]:
    """Zero-copy views of an item's tensors, numbered from ``first_frame``."""
    refs: dict[str, TensorRef] = {}
    frames: list[memoryview] = []
    for name, tensor in item.tensors.items():
        array = tensor.contiguous().numpy()
        refs[name] = TensorRef(str(array.dtype), tuple(array.shape), first_frame + len(frames))
        frames.append(array.data.cast("B"))
    return refs, frames


class EngineClient:
    def __init__(
        self,
        engine_addr: str,
        ipc_cache_bytes: int,
        metrics: ApiMetrics,
        shm: ShmObjectStore | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        """``shm``: this API process's shared-memory object store (``--mm-processor-cache-type shm``);
        the client keeps each sent request's references in it until the request's final output.
        ``curve``: the deployment's CURVE keys (used on a tcp:// engine address; wire/curve.py)."""
        self.engine_addr = engine_addr
        self.client_id = f"api-{uuid.uuid4().hex[:12]}".encode()
        self._mirror: IpcMirror[ItemLayout] = IpcMirror(ipc_cache_bytes)
        self.shm = shm
        self.metrics = metrics
        self.ready: EngineReady | None = None
        self.ready_event = asyncio.Event()
        self._queues: dict[str, asyncio.Queue[RequestOutput | EngineGone]] = {}
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, self.client_id)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # unbounded: a send never blocks nor drops
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None and uses_curve(engine_addr, curve):
            secure_client(self._sock, curve)
        self._released: OrderedDict[str, None] = OrderedDict()  # ids of requests lately released
        self.bad_messages = BadMessageLog(log)
        self._tasks: list[asyncio.Task[None]] = []
        self._last_ready_time = 0.0

    async def start(self) -> None:
        self._sock.connect(self.engine_addr)
        monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._tasks = [
            asyncio.create_task(self._read_loop()),
            asyncio.create_task(self._heartbeat_loop()),
            asyncio.create_task(self._watch_connection(monitor)),
        ]

    async def close(self, *, shutdown_engine: bool = False) -> None:
        """Stops the engine if this API owns it; otherwise frees this API's receiver-cache partition."""
        self._send(Shutdown() if shutdown_engine else ResetCaches(encoder=False))
        await asyncio.sleep(0.05)  # let the socket flush before it closes
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._sock.close(linger=0)
        self._ctx.term()

    @property
    def is_ready(self) -> bool:
        loop_time = asyncio.get_running_loop().time()
        return self.ready is not None and loop_time - self._last_ready_time < HEARTBEAT_TIMEOUT_S

    async def wait_ready(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self.ready_event.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    # ------------------------------------------------------------------ sending (synchronous)

    def _send(
        self,
        msg: AddRequest | Abort | ResetCaches | Hello | Shutdown,
        frames: Sequence[memoryview] = (),
        encoded: bytes | None = None,
    ) -> None:
        data = encode(msg) if encoded is None else encoded
        self._sock.send_multipart([data, *frames], flags=zmq.NOBLOCK, copy=False)

    def lookup_and_pin(self, mm_hash: str) -> MirrorEntry[ItemLayout] | None:
        """While a request is prepared: the mirror's entry when the engine holds the item, pinned until
        ``send_request`` (or ``unpin``) releases it."""
        return self._mirror.lookup_and_pin(mm_hash)

    def unpin(self, mm_hash: str) -> None:
        """Gives back one ``lookup_and_pin`` pin of a request that will not be sent as prepared."""
        self._mirror.unpin(mm_hash)

    def forget(self, mm_hashes: list[str]) -> None:
        """The safety net: the engine lacked these items (or found their shm references stale). The mirror
        and the ring forget them, so the request's next send carries their tensors."""
        self._mirror.invalidate(mm_hashes)
        if self.shm is not None:
            self.shm.invalidate(mm_hashes)

    def send_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        items: Sequence[OutgoingItem],
        cache_salt: str | None = None,
        constraint: Constraint | None = None,
        later_choice: bool = False,
        priority: int = 0,
    ) -> asyncio.Queue[RequestOutput | EngineGone] | None:
        """Stage 7 of the request path, in one synchronous step (docs/architecture.md, "IPC mirror",
        rules 1-3): the mirror decides each item not in the shm ring (HIT: key only; STORE or UNCACHED:
        tensors), the ``AddRequest`` with those decisions, the evicted keys and the tensor frames goes to
        the socket, then the items' pins are released. The pins are released whatever happens.

        Returns None, sending nothing, when an item pinned as a hit has left the mirror since (engine
        restart, reset) and its tensors are not at hand: the caller resolves the request again."""
        try:
            # the ring's items and borrowed media ids bypass the mirror
            by_mirror = [i for i in items if i.placement.shm is None and not i.placement.borrowed]
            if any(i.item is None and i.placement.mm_hash not in self._mirror for i in by_mirror):
                return None
            mirror_decisions, evicted = self._mirror.record_request(
                [
                    MirrorItem(i.placement.mm_hash, i.item.num_bytes if i.item else 0, i.layout)
                    for i in by_mirror
                ]
            )
            decisions = iter(mirror_decisions)
            features: list[MMFeature] = []
            frames: list[memoryview] = []
            payload_bytes = 0
            for outgoing in items:
                placement = outgoing.placement
                payload_bytes += len(placement.mm_hash)
                decision = None if placement.shm is not None or placement.borrowed else next(decisions)
                if decision is None or decision is MirrorDecision.HIT:  # a ring reference, or a key only
                    features.append(placement)
                    continue
                assert outgoing.item is not None, "a mirror miss always has its tensors"
                refs, item_frames = tensor_frames(outgoing.item, first_frame=1 + len(frames))
                frames.extend(item_frames)
                payload_bytes += sum(f.nbytes for f in item_frames)
                store = decision is MirrorDecision.STORE
                features.append(msgspec.structs.replace(placement, tensors=refs, store=store))
            msg = AddRequest(
                req_id=req_id,
                prompt_token_ids=prompt_token_ids,
                sampling=sampling,
                mm_features=features,
                evicted_mm_hashes=evicted,
                cache_salt=cache_salt,
                constraint=constraint,
                later_choice=later_choice,
                priority=priority,
            )
            queue = self._add_request(msg, frames)
            self.metrics.ipc_payload_bytes.inc(payload_bytes)
            return queue
        finally:
            for outgoing in items:
                if outgoing.pinned:
                    self._mirror.unpin(outgoing.placement.mm_hash)

    def _add_request(
        self, msg: AddRequest, frames: Sequence[memoryview]
    ) -> asyncio.Queue[RequestOutput | EngineGone]:
        """Registers the request's output queue and hands the message to the socket. The message is
        encoded first: one that cannot be raises with nothing registered or held for it."""
        encoded = encode(msg)
        queue: asyncio.Queue[RequestOutput | EngineGone] = asyncio.Queue()
        if self.shm is not None:  # released by the request's final output (or right away, unsent)
            self.shm.hold(msg.req_id, [f.shm.item_id for f in msg.mm_features if f.shm is not None])
        if self.ready is None:  # nothing would answer it: a new engine starts without this request
            queue.put_nowait(EngineGone("the engine is not ready"))
            if self.shm is not None:
                self.shm.finish(msg.req_id)
            return queue
        self._queues[msg.req_id] = queue
        self._send(msg, frames, encoded)
        self.metrics.requests_sent.inc()
        return queue

    def release(self, req_id: str, *, abort: bool) -> None:
        """Called when the API is done with a request; aborts it in the engine if still running."""
        if self._queues.pop(req_id, None) is None:
            return
        self._released[req_id] = None  # its outputs may still come (the abort's, late ones)
        if len(self._released) > RELEASED_IDS_KEPT:
            self._released.popitem(last=False)
        if abort:
            self._send(Abort([req_id]))

    def reset_caches(self) -> None:
        """Empties the mirror and, in the same socket order, the engine's partition for this client."""
        self._mirror.reset()
        if self.shm is not None:
            self.shm.clear()
        self._send(ResetCaches())

    # ------------------------------------------------------------------ receiving

    async def _heartbeat_loop(self) -> None:
        while True:
            self._send(Hello())
            await asyncio.sleep(HEARTBEAT_S if self.is_ready else HELLO_UNTIL_READY_S)

    async def _watch_connection(self, monitor: zmq.asyncio.Socket) -> None:
        """The engine process died (or closed its socket): its requests and its receiver cache are gone.
        ZeroMQ reconnects by itself; the next EngineReady (a new epoch) makes the API ready again."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self._on_engine_lost("the engine process went away")
        finally:
            monitor.close(linger=0)

    def _on_engine_lost(self, reason: str) -> None:
        log.warning("engine gone: %s", reason)
        self.ready = None
        self.ready_event.clear()
        self._fail_in_flight(reason)
        if self.shm is not None:  # its worker goes with it: nothing reads those items any more
            self.shm.engine_lost()

    async def _read_loop(self) -> None:
        """Routes the engine's messages. One this process cannot take (wire/bad_messages.py) is counted
        and dropped, and the loop reads on (docs/architecture.md, "Bad messages")."""
        while True:
            parts = await self._sock.recv_multipart()
            try:
                if len(parts) != 1:
                    raise BadMessage("extra frame", f"a message of {len(parts)} frames")
                self._take(decode_frame0(decode_engine_outbound, parts))
            except BadMessage as bad:
                self._on_bad_message(bad)
            except Exception as exc:  # a bug this message met: the reader must live on
                self._on_bad_message(BadMessage.from_bug(exc, f"{parts[0][:200]!r}"))

    def _on_bad_message(self, bad: BadMessage) -> None:
        self.bad_messages.record("engine", bad)
        self.metrics.bad_messages.inc()

    def _take(self, msg: EngineOutbound) -> None:
        match msg:
            case EngineOutputs():
                if msg.stats is not None:
                    self.metrics.apply_engine_stats(msg.stats)
                unknown = []
                for output in msg.outputs:
                    if self.shm is not None and output.finish_reason is not None:
                        self.shm.finish(output.req_id)
                    queue = self._queues.get(output.req_id)
                    if queue is not None:
                        queue.put_nowait(output)
                    elif output.req_id not in self._released:
                        unknown.append(output.req_id)
                if unknown:  # the others were routed
                    raise BadMessage("unknown request id", ", ".join(unknown[:3]))
            case EngineReady():
                self._on_ready(msg)
            case EngineDead():
                self._on_engine_lost(f"the engine stopped: {msg.reason}")

    def _on_ready(self, msg: EngineReady) -> None:
        self._last_ready_time = asyncio.get_running_loop().time()
        if self.ready is not None and self.ready.epoch == msg.epoch:
            return
        if self.ready is not None:
            log.warning(
                "engine restarted (epoch %s -> %s): emptying the IPC mirror", self.ready.epoch, msg.epoch
            )
            self._fail_in_flight("the engine restarted")
            if self.shm is not None:
                self.shm.engine_lost()
        # A new engine has an empty receiver cache: the mirror must not claim anything.
        self._mirror.reset()
        self.ready = msg
        self.ready_event.set()

    def _fail_in_flight(self, reason: str) -> None:
        self.end_in_flight(reason, "engine_unavailable")

    def end_in_flight(self, reason: str, code: str) -> None:
        """Ends every request in flight with a 503 (``code``): a stream ends with its error event."""
        for queue in self._queues.values():
            queue.put_nowait(EngineGone(reason, code))
