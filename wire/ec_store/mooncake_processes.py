"""Starting and stopping Mooncake's own processes, for tests and benchmarks (a deployment runs them as
services of their own, as the compose profile ``epd`` does).

Two processes make a Mooncake store, both shipped as executables inside the ``mooncake`` wheel
(``mooncake-transfer-engine-non-cuda``):

* ``mooncake_master``: the metadata service (which key lives where, leases, eviction). It holds no
  values. Bound to 127.0.0.1 (RPC port given, admin/metrics HTTP port ephemeral), no HTTP metadata
  server: clients use ``metadata_server="P2PHANDSHAKE"``. If it dies every client call fails (see
  ``MooncakeStore``); a master restarted on the same port starts empty, and clients and holders
  reconnect by themselves (holders re-mount their segment within ~2 s).
* ``mooncake_client`` (the "holder"): a standalone client that mounts ``segment_bytes`` of its own
  memory into the store and serves nothing else we use. Values live in the segments that clients
  mount, so producers mount nothing (``global_segment_size_bytes=0``): their puts land in the holder's
  memory and outlive the producer. Its segment must be at least 16 MiB (smaller and it aborts at
  start). Killing the holder loses the values it holds; puts are then refused (no segment) until a
  holder mounts again.

When the holders' memory is full, the master evicts objects whose lease has expired (a lease is
granted for ``lease_ttl_ms`` on each exists/get of the key, so a value stays readable between the
scheduler's ``exists`` and the worker's ``get``); eviction runs asynchronously, so a put may be
refused (``put`` returns False) until it has freed room. Callers count refusals; never fatal.

Only loopback: every port these processes open is on 127.0.0.1, except the transfer engine's data
listeners, which Mooncake binds to the wildcard address without a setting to change it (the address
advertised, hence every connection made, is 127.0.0.1). Each child gets PR_SET_PDEATHSIG so it dies
with the process that started it: call these from a thread that outlives the store (the main one).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

MIN_HOLDER_SEGMENT_BYTES = 16 << 20  # mooncake_client refuses a smaller global segment


def mooncake_executable(name: str) -> Path:
    """The path of ``mooncake_master`` or ``mooncake_client``: the wheel's own copy, else one on PATH."""
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found: pip install mooncake-transfer-engine-non-cuda")
    return Path(found)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class MooncakeProcess:
    """A started master or holder; ``stop()`` it (idempotent)."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path | None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; waits for the process so no zombie is left."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """SIGKILL now (tests: a master that dies without warning)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _start(name: str, args: list[str], port: int, log_path: Path | None, timeout_s: float) -> MooncakeProcess:
    env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
    out = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            [str(mooncake_executable(name)), *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
    finally:
        if log_path is not None:
            out.close()  # type: ignore[union-attr]
    started = MooncakeProcess(name, proc, port, log_path)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return started
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            started.stop()
            tail = log_path.read_text(errors="replace")[-2000:] if log_path is not None else ""
            raise RuntimeError(
                f"{name} did not start listening on 127.0.0.1:{port} "
                f"(exit code {proc.returncode}); log tail:\n{tail}"
            )
        time.sleep(0.05)


def start_master(
    port: int | None = None,
    *,
    lease_ttl_ms: int = 5000,
    log_path: Path | None = None,
    timeout_s: float = 15.0,
) -> MooncakeProcess:
    """Starts ``mooncake_master`` on 127.0.0.1:``port`` (a free one if None) and returns once it accepts
    connections (a client can set up right away). ``lease_ttl_ms``: how long an exists/get protects a
    value from eviction."""
    port = port or free_port()
    args = [
        f"--rpc_port={port}",
        "--rpc_address=127.0.0.1",
        "--metrics_host=127.0.0.1",
        "--metrics_port=0",  # the admin/metrics HTTP server cannot be turned off: an ephemeral port
        "--enable_metric_reporting=false",  # no periodic summary in the log
        "--enable_http_metadata_server=false",  # it would bind 0.0.0.0 whatever its host flag says
        f"--default_kv_lease_ttl={lease_ttl_ms}",
    ]
    return _start("mooncake_master", args, port, log_path, timeout_s)


def start_holder(
    master_address: str,
    segment_bytes: int,
    *,
    port: int | None = None,
    log_path: Path | None = None,
    timeout_s: float = 15.0,
) -> MooncakeProcess:
    """Starts ``mooncake_client`` mounting ``segment_bytes`` (>= 16 MiB) into the store of the master at
    ``master_address``; returns once its segment is mounted (it opens its service port after that)."""
    if segment_bytes < MIN_HOLDER_SEGMENT_BYTES:
        raise ValueError(f"a holder segment must be at least {MIN_HOLDER_SEGMENT_BYTES} bytes")
    port = port or free_port()
    args = [
        f"--master_server_address={master_address}",
        "--metadata_server=P2PHANDSHAKE",
        "--protocol=tcp",
        f"--global_segment_size={segment_bytes}",
        "--local_buffer_size=0",
        "--host=127.0.0.1",
        f"--port={port}",
    ]
    return _start("mooncake_client", args, port, log_path, timeout_s)
