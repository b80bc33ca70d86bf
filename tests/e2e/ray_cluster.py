"""Helpers of tests/e2e/test_ray_serve.py: the ``mmserve ray serve`` process and its replicas as the
tests see them, its Ctrl-C, and the TCP addresses a cluster's processes listen on."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.metrics import Metrics, parse_metrics
from tests.e2e.server import ServerProcess

STOP_S = 90.0


@dataclass
class RayServer:
    process: ServerProcess
    port: int
    headers: dict[str, str]  # the API key's, for /replicas as for the API

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def replicas(self) -> dict[str, dict[str, Any]]:
        """The replicas that have reported (a new one lists its URL within a report period)."""
        listed = httpx.get(f"{self.base_url}/replicas", headers=self.headers, timeout=10).json()["replicas"]
        return {entry["replica"]: entry for entry in listed if "url" in entry}

    def replica_metrics(self) -> dict[str, Metrics]:
        return {
            name: parse_metrics(httpx.get(f"{entry['url']}/metrics", timeout=10).text)
            for name, entry in self.replicas().items()
        }


def total(metrics: dict[str, Metrics], name: str) -> float:
    """``name``'s value summed over the replicas' metrics."""
    return sum(m.get(name, 0.0) for m in metrics.values())


def stop(process: ServerProcess) -> int:
    """Ctrl-C to ``mmserve ray serve`` alone (Ray's own processes stop with its ``ray.shutdown``)."""
    assert process.proc is not None
    if process.proc.poll() is None:
        process.proc.send_signal(signal.SIGINT)
    try:
        return process.proc.wait(STOP_S)
    except subprocess.TimeoutExpired:
        process.kill()
        raise


def listening_addresses(pids: list[int]) -> dict[str, int]:
    """Each TCP address one of ``pids`` listens on ("ip:port", IPv4 or IPv6 as the kernel shows it), with
    the pid: the kernel's socket tables, joined with the processes' socket file descriptors."""
    inodes: dict[str, int] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes[target[8:-1]] = pid
    found = {}
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address, port = fields[1].split(":")
                packed = bytes.fromhex(address)
                # the kernel prints each 32-bit word in host (little-endian) order
                raw = b"".join(packed[i : i + 4][::-1] for i in range(0, len(packed), 4))
                ip = ipaddress.ip_address(raw)
                found[f"{ip}:{int(port, 16)}"] = inodes[fields[9]]
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.rpartition(":")[0])
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def streamed_lines(
    server: RayServer, body: dict[str, Any], headers: dict[str, str], lines: list[str]
) -> None:
    """A streamed chat answer's ``data:`` payloads ("cut off" when the connection closed early)."""
    url = f"{server.base_url}/v1/chat/completions"
    try:
        with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line.removeprefix("data: "))
    except httpx.HTTPError:
        lines.append("cut off")
