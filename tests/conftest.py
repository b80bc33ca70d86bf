"""Fixtures shared by every test tier, and how `make test` splits the tiers between two pytest-xdist
workers (``--dist loadgroup``)."""

from __future__ import annotations

import functools
import ssl
from collections.abc import Callable
from pathlib import Path

import httpx._transports.default as httpx_transports
import pytest
from hypothesis import HealthCheck, settings

from workers.families.tiny import build_tiny_model

# Another worker's tests share the CPU, so one example can take far longer than its work: no per-example
# deadline and no "too slow" health check in any property test (a test's own @settings still wins).
settings.register_profile("shared-cpu", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("shared-cpu")

# Every httpx client (each httpx.get and httpx.post, each openai SDK client) builds httpx's default TLS
# context anew, about 40 ms of CPU for a request that takes a few on loopback, in a suite that keeps both
# cores busy. The tests speak plain HTTP on loopback: clients that ask for the default share one context
# (a client given its own ``verify`` or ``cert`` still gets its own).
_new_tls_context = httpx_transports.create_ssl_context


@functools.cache
def _default_tls_context(trust_env: bool) -> ssl.SSLContext:
    return _new_tls_context(verify=True, cert=None, trust_env=trust_env)


def _shared_tls_context(
    verify: ssl.SSLContext | str | bool = True, cert: object = None, trust_env: bool = True
) -> ssl.SSLContext:
    if verify is True and cert is None:
        return _default_tls_context(trust_env)
    return _new_tls_context(verify=verify, cert=cert, trust_env=trust_env)  # type: ignore[arg-type]


httpx_transports.create_ssl_context = _shared_tls_context

# The session's shared servers (tests/e2e/conftest.py). Every test that uses a fixture of one of these
# names (a module's own ``server`` too) runs in one xdist worker, in collection order, so each shared
# server starts once per run and one worker holds them all, as a run without xdist does (about 18 GiB at
# the end). Every other module is a group of its own, run whole by whichever worker is free. Moving more
# work out of the shared-server group would let the other worker's last groups (xdist runs those with
# the most tests first, so the heavy e2e modules of a few tests come last) overlap that peak. It would
# shorten the run little: both cores are busy until that worker's last three minutes, so work moved out of
# it mostly slows the rest of it (taking out the two modules whose own fixture is named ``server``,
# two minutes of tests, left the run's length as it was and overlapped compose-epd's start with theirs).
SESSION_SERVERS = frozenset({"server", "uncached_server", "narrow_server", "guarded_server", "family_server"})
SESSION_GROUP = "session-servers"


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the group
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        uses_session_server = SESSION_SERVERS & set(getattr(item, "fixturenames", ()))
        group = SESSION_GROUP if uses_session_server else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_finish(session: pytest.Session) -> None:
    """In an xdist worker under ``--dist loadgroup``, refuse to run if the groups were lost (xdist writes
    them into the node ids): both workers would then start every shared server, more than this machine's
    memory holds."""
    if getattr(session.config.option, "loadgroup", False):
        lost = [item.nodeid for item in session.items if "@" not in item.nodeid.rpartition("::")[2]]
        if lost:
            raise pytest.UsageError(f"pytest-xdist did not group {lost[0]} (and {len(lost) - 1} more)")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_model(family)``: that family's tiny checkpoint (seed 0), built once per test session (a few
    seconds each on a CPU) and read, never written, by every test. The folder name is the served model
    name: ``tiny-<family>``, as in `make serve`."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny_model(
                family, tmp_path_factory.mktemp("models") / f"tiny-{family}", seed=0
            )
        return built[family]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model: Callable[[str], Path]) -> Path:
    """The tiny LLaVA checkpoint."""
    return tiny_model("llava")
