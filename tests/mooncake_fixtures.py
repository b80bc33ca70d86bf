"""A real Mooncake store on 127.0.0.1 for tests: a ``mooncake_master`` and one holder (``mooncake_client``)
mounting the values' memory. Import the fixtures into a test module; skipped where mooncake is missing
or its master cannot start here."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.paused import paused
from wire.ec_store.mooncake_processes import MooncakeProcess, start_holder, start_master

LEASE_TTL_MS = 1000  # short, so tests of a full store wait little for eviction


@dataclass
class MooncakeCluster:
    master: MooncakeProcess
    holder: MooncakeProcess
    log_dir: Path

    @property
    def address(self) -> str:
        return self.master.address


@contextlib.contextmanager
def mooncake_cluster_at(
    log_dir: Path, segment_bytes: int = 64 << 20, lease_ttl_ms: int = LEASE_TTL_MS
) -> Iterator[MooncakeCluster]:
    """A master and a holder of ``segment_bytes``, both stopped (and waited for) on exit."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:  # not x86_64 Linux, or libibverbs.so.1 missing
        pytest.skip(f"mooncake cannot be imported here: {e}")
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        master = start_master(lease_ttl_ms=lease_ttl_ms, log_path=log_dir / "master.log")
    except (OSError, RuntimeError) as e:
        pytest.skip(f"mooncake_master cannot start on this machine: {e}")
    try:
        holder = start_holder(master.address, segment_bytes, log_path=log_dir / "holder.log")
    except BaseException:
        master.stop()
        raise
    try:
        yield MooncakeCluster(master, holder, log_dir)
    finally:
        holder.stop()
        master.stop()
        assert not holder.alive() and not master.alive()


def hung(process: MooncakeProcess, timeout_s: float = 5.0) -> contextlib.AbstractContextManager[None]:
    """``process`` stopped (SIGSTOP) for the block, continued after (tests/paused.py)."""
    return paused(process.proc.pid, timeout_s)


@pytest.fixture(scope="module")
def mooncake_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster]:
    """One store shared by a module's tests (64 MiB held): use distinct keys per test."""
    with mooncake_cluster_at(tmp_path_factory.mktemp("mooncake")) as cluster:
        yield cluster
