"""``serve``'s child processes (engine, worker, API processes 1..N-1), started, watched and restarted
(docs/architecture.md, "Processes"). The launcher hands it the function each child runs."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable

from app.child_processes import child_context
from app.settings import Settings

log = logging.getLogger("mmserve")

# what an API process needs after its drain's deadline: the grace after the drain, closing its
# lifespan, exiting
API_EXIT_MARGIN_S = 5.0
ENGINE_EXIT_GRACE_S = 5.0  # for the engine and the worker to exit by message, once the API processes did

ChildMain = Callable[..., None]  # (role, settings[, api_index]) in the child process


class Supervisor:
    """The engine and worker processes of ``serve``, and API processes 1..N-1 (roles ``api-<i>``),
    restarted when they die (a non-zero exit: a crash, SIGKILL, the OOM killer); an engine or worker that
    exits 0 was asked to stop, and the server stops with it; an API process that exits 0 was asked to
    drain (a SIGTERM of its own), and the server drains as a whole.

    A dead worker is started again; the engine notices the lost worker, fails its requests with 503 and
    takes the new worker with a fresh epoch. A dead engine takes its worker with it (that worker's KV
    and encoder outputs belong to the dead engine's state): both are started again, and each API, which
    saw the engine go, clears its IPC mirror on the new epoch. A dead API process is started again alone,
    once its orphaned shared-memory files are removed: the new process has a new ZeroMQ identity and an
    empty mirror, and the engine drops the old identity's receiver-cache partition once it has been silent
    for 60 s. A role that dies again within ``RESTART_WINDOW_S`` waits before its restart, 1 s, then 2,
    4 and 8 s (``restart_delay``), so that what killed it (memory, a port, a file being replaced) may
    pass; one that dies ``MAX_RESTARTS`` times within the window, or cannot be started, is not restarted
    again: the server is stopped instead.

    SIGTERM to ``serve`` (the main API process's drain): ``drain_apis`` forwards it to the other API
    processes, which then drain at the same time and are no longer restarted; the main process's drain
    waits for them (``apis_running``) before its lifespan stops the engine.
    """

    MAX_RESTARTS = 5
    RESTART_WINDOW_S = 60.0

    def __init__(
        self, settings: Settings, child_main: ChildMain, before_api_restart: Callable[[], None]
    ) -> None:
        """``child_main`` runs in each child (picklable: a module-level function); ``before_api_restart``
        runs before a dead API process is started again (removes what it left in /dev/shm)."""
        self.settings = settings
        self.child_main = child_main
        self.before_api_restart = before_api_restart
        self.api_roles = tuple(f"api-{index}" for index in range(1, settings.api_server_count))
        # The engine, which imports no torch, is spawned (a second of CPU, a fifth of the memory); the
        # others are forks of the fork server, which imported their modules
        self.spawned = multiprocessing.get_context("spawn")
        self.forked = child_context(api_processes=bool(self.api_roles))
        self.children: dict[str, multiprocessing.process.BaseProcess] = {}
        self.restarts: dict[str, list[float]] = {role: [] for role in ("engine", "worker", *self.api_roles)}
        self.lock = threading.Lock()
        self.draining = False

    def start(self, roles: tuple[str, ...] | None = None) -> None:
        """Starts ``roles`` (default: every child of ``serve``)."""
        for role in roles if roles is not None else ("engine", "worker", *self.api_roles):
            args: tuple[object, ...] = (role, self.settings)
            if role in self.api_roles:
                args = ("api", self.settings, int(role.removeprefix("api-")))
            ctx = self.spawned if role == "engine" else self.forked
            child = ctx.Process(target=self.child_main, args=args, name=f"mmserve-{role}", daemon=False)
            child.start()
            self.children[role] = child
            if self.draining and role in self.api_roles:  # started while the drain began: nothing to serve
                _signal(child, signal.SIGTERM)

    def run(self, stop: threading.Event) -> None:
        """Starts every child, then watches them until ``stop`` is set: a thread of ``serve``, whose
        API imports its modules and builds its app meanwhile, while the first start waits for the fork
        server's imports (app/child_processes.py)."""
        with self.lock:
            if stop.is_set():
                return
            try:
                self.start()
            except Exception:
                log.exception("the engine and the worker could not be started: stopping the server")
                signal.raise_signal(signal.SIGINT)
                return
        self.watch(stop)

    def watch(self, stop: threading.Event) -> None:
        while not stop.wait(0.1):
            dead = [role for role, child in self.children.items() if not child.is_alive()]
            if self.draining:  # API processes exit once drained: neither a fault nor a request to stop
                dead = [role for role in dead if role not in self.api_roles]
            if not dead:
                continue
            faults = [role for role in dead if self.children[role].exitcode != 0]
            if faults and stop.wait(max(self._restart_delay(role) for role in faults)):
                return
            with self.lock:
                if stop.is_set():
                    return
                stopped = [role for role in dead if self.children[role].exitcode == 0]
                if any(role not in self.api_roles for role in stopped):
                    # asked to stop (Ctrl-C reaches the whole process group; a signal to one role):
                    # the server stops as a whole
                    log.info("%s stopped: stopping the server", " and ".join(dead))
                    signal.raise_signal(signal.SIGINT)
                    return
                if stopped:
                    log.info("%s stopped: draining the server", " and ".join(stopped))
                    self.draining = True
                    signal.raise_signal(signal.SIGTERM)  # the main API's drain, then drain_apis
                    continue
                try:
                    restarted = self._restart(dead)
                except Exception:  # e.g. the fork server is gone: the server cannot heal, so it stops
                    log.exception("%s could not be started again: stopping the server", " and ".join(dead))
                    restarted = False
                if not restarted:
                    signal.raise_signal(signal.SIGINT)  # the API stops, then stop() ends the rest
                    return

    def _restart_delay(self, role: str) -> float:
        now = time.monotonic()
        return restart_delay(sum(1 for t in self.restarts[role] if now - t < self.RESTART_WINDOW_S))

    def _restart(self, dead: list[str]) -> bool:
        now = time.monotonic()
        for role in dead:
            log.error("%s process exited (code %s)", role, self.children[role].exitcode)
            recent = [t for t in self.restarts[role] if now - t < self.RESTART_WINDOW_S] + [now]
            self.restarts[role] = recent
            if len(recent) > self.MAX_RESTARTS:
                log.error("%s died %d times in %gs: giving up", role, len(recent), self.RESTART_WINDOW_S)
                return False
        roles = [role for role in dead if role in self.api_roles]
        if roles:
            self.before_api_restart()
        if "engine" in dead:
            if self.children["worker"].is_alive():
                self.children["worker"].kill()  # (it ignores SIGTERM) its engine is gone: its state too
                self.children["worker"].join()
            roles += ["engine", "worker"]
        elif "worker" in dead:
            roles.append("worker")
        log.warning("restarting %s", " and ".join(roles))
        self.start(tuple(roles))
        return True

    def drain_apis(self) -> None:
        """Called once, from the main API process's SIGTERM handler (its ``Drain.on_start``)."""
        self.draining = True
        for role in self.api_roles:
            child = self.children.get(role)
            if child is not None and child.is_alive():
                _signal(child, signal.SIGTERM)

    def apis_running(self) -> bool:
        """Whether an API process other than the main one is still alive (the main drain waits)."""
        children = [self.children.get(role) for role in self.api_roles]
        return any(child is not None and child.is_alive() for child in children)

    def stop(self) -> None:
        """Called once the main API process stopped: the other API processes first (still draining
        after SIGTERM, or stopped at once like the main one: Ctrl-C, a role that gave up), then the
        engine and the worker."""
        with self.lock:
            apis = [self.children[role] for role in self.api_roles if role in self.children]
            grace_s = API_EXIT_MARGIN_S
            if self.draining:
                grace_s += self.settings.shutdown_timeout
            else:
                for child in apis:
                    if child.is_alive():
                        _signal(child, signal.SIGINT)
            _end(apis, grace_s=grace_s)
            # (a worker mid-step, say an encoder over a huge image, ends it first: then it is killed)
            others = [child for role, child in self.children.items() if role not in self.api_roles]
            _end(others, grace_s=ENGINE_EXIT_GRACE_S, terminate=False)


def _signal(child: multiprocessing.process.BaseProcess, sig: signal.Signals) -> None:
    if child.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, sig)


def _end(
    children: list[multiprocessing.process.BaseProcess], *, grace_s: float, terminate: bool = True
) -> None:
    """Waits ``grace_s`` for children to exit by themselves, then terminates (where they heed SIGTERM:
    the engine and the worker ignore it), then kills them."""
    deadline = time.monotonic() + grace_s
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.is_alive() and terminate:
            child.terminate()
            child.join(2.0)
        if child.is_alive():
            child.kill()
            child.join()


def restart_delay(recent_restarts: int) -> float:
    """Seconds before a role's next restart, after ``recent_restarts`` within the window: none for the
    first, then 1, 2, 4 and 8 s."""
    return 0.0 if recent_restarts == 0 else min(2.0 ** (recent_restarts - 1), 8.0)
