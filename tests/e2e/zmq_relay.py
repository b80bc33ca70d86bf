"""A ZeroMQ relay between a role that connects (an API process, the worker) and the engine that binds,
for tests that put messages on a socket as if its real peer had sent them.

    API / worker (DEALER) ──▶ relay ROUTER (front) ─┐ one DEALER per front peer, with the peer's
                          ◀──                       └▶ identity ──▶ engine ROUTER (back)

Every message is passed on unchanged, both ways; ``to_front`` sends frames to a front peer as if from
the engine, ``to_back`` sends frames to the engine as if from that peer. With CURVE keys, both sides
use them as the roles do (wire/curve.py).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import zmq

from wire.curve import CurveKeys, CurveServer, secure_client


class Relay:
    def __init__(self, front_addr: str, back_addr: str, keys: CurveKeys | None = None) -> None:
        self._ctx = zmq.Context()
        self._keys = keys
        self._curve = CurveServer(self._ctx, keys) if keys is not None else None
        self._front = self._ctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            self._curve.secure(self._front)
        self._front.bind(front_addr)
        self._back_addr = back_addr
        self._backs: dict[bytes, zmq.Socket] = {}
        self._injected: queue.Queue[tuple[str, bytes, list[bytes]]] = queue.Queue()
        self._wake_recv = self._ctx.socket(zmq.PAIR)
        self._wake_recv.bind(f"inproc://relay-{id(self)}")
        self._wake_send = self._ctx.socket(zmq.PAIR)
        self._wake_send.connect(f"inproc://relay-{id(self)}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def peers(self) -> list[bytes]:
        """Identities of the front peers seen so far."""
        return list(self._backs)

    def to_front(self, identity: bytes, frames: Sequence[bytes]) -> None:
        self._inject("front", identity, frames)

    def to_back(self, identity: bytes, frames: Sequence[bytes]) -> None:
        self._inject("back", identity, frames)

    def _inject(self, side: str, identity: bytes, frames: Sequence[bytes]) -> None:
        self._injected.put((side, identity, list(frames)))
        self._wake_send.send(b"")

    def close(self) -> None:
        self._stop.set()
        self._wake_send.send(b"")
        self._thread.join(5)
        for sock in [self._front, self._wake_recv, self._wake_send, *self._backs.values()]:
            sock.close(linger=0)
        if self._curve is not None:
            self._curve.close()
        self._ctx.term()

    def _back(self, identity: bytes, poller: zmq.Poller) -> zmq.Socket:
        sock = self._backs.get(identity)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, identity)
            sock.setsockopt(zmq.LINGER, 0)
            if self._keys is not None:
                secure_client(sock, self._keys)
            sock.connect(self._back_addr)
            poller.register(sock, zmq.POLLIN)
            self._backs[identity] = sock
        return sock

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        poller.register(self._wake_recv, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(100))
            if self._front in events:
                while True:
                    try:
                        identity, *frames = self._front.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._back(identity, poller).send_multipart(frames)
            for identity, sock in list(self._backs.items()):
                if sock in events:
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._front.send_multipart([identity, *frames])
            if self._wake_recv in events:
                while True:
                    try:
                        self._wake_recv.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                while not self._injected.empty():
                    side, identity, frames = self._injected.get()
                    if side == "front":
                        self._front.send_multipart([identity, *frames])
                    else:
                        self._back(identity, poller).send_multipart(frames)
