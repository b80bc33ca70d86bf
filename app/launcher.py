"""Starts mmserve's processes: one role (``api``/``engine``/``worker``) or all three (``serve``).
The only module that knows all three entry points."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import setproctitle
import uvicorn

from app.encoder_budgets import budget_warnings, derive_encoder_budgets, startup_error
from app.settings import Settings
from workers.families import UnsupportedModelError

log = logging.getLogger("mmserve")

GRACE_AFTER_DRAIN_S = 0.5


def run_role(role: str, settings: Settings) -> int:
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # What ps and top show, so an operator can find and signal each role ("serve" runs the API itself).
    setproctitle.setproctitle(f"mmserve: {'api' if role == 'serve' else role}")
    # The engine reads only JSON from the folder: the model's length limit and its largest image.
    derived = (settings.max_model_len, settings.encoder_cache_tokens, settings.encoder_compute_budget_tokens)
    needs_model = role != "engine" or None in derived
    if needs_model and not Path(settings.model).is_dir():
        print(
            f"mmserve: error: model folder {settings.model!r} does not exist "
            "(build one with `mmserve build-tiny-model --out DIR`)",
            file=sys.stderr,
        )
        return 2
    if Path(settings.model).is_dir():
        try:
            budgets = derive_encoder_budgets(settings)
        except UnsupportedModelError as exc:
            print(f"mmserve: error: {exc}", file=sys.stderr)
            return 2
        error = startup_error(settings, budgets)
        if error is not None:
            print(f"mmserve: error: {error}", file=sys.stderr)
            return 2
        if role in ("serve", "engine"):
            for warning in budget_warnings(settings, budgets):
                log.warning("%s", warning)
    if role == "serve":
        return serve(settings)
    from app.cli import engine_config, worker_config

    if role == "engine":
        from engine.engine_main import run_engine

        run_engine(engine_config(settings))
    elif role == "worker":
        from workers.worker_main import run_worker

        return run_worker(worker_config(settings))
    else:
        run_api(settings, owns_engine=False)
    return 0


def run_api(settings: Settings, *, owns_engine: bool) -> None:
    """Serves HTTP until SIGINT, or until SIGTERM's drain finished (``app.drain``)."""
    from app.drain import Drain, DrainingServer
    from app.server import create_app

    drain = Drain(settings.shutdown_timeout)
    app = create_app(settings, shutdown_engine_on_exit=owns_engine, drain=drain)
    # The drain already waited for requests in flight: what uvicorn's own shutdown finds after it (or
    # after Ctrl-C) is cut off at once.
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=GRACE_AFTER_DRAIN_S,
    )
    DrainingServer(config, drain).run()


def _child_main(role: str, settings: Settings) -> None:
    """Entry of a child started by ``serve``: dies with its parent, then runs its role."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    sys.exit(run_role(role, settings))


def _private_addresses(settings: Settings, folder: str) -> Settings:
    """``serve`` uses fresh ipc:// paths unless addresses were set, so two servers never collide."""
    explicit = settings.model_fields_set
    update = {}
    if "engine_addr" not in explicit:
        update["engine_addr"] = f"ipc://{folder}/engine.sock"
    if "worker_addr" not in explicit:
        update["worker_addr"] = f"ipc://{folder}/worker.sock"
    return Settings(**{**settings.model_dump(exclude_unset=True), **update})


def serve(settings: Settings) -> int:
    with tempfile.TemporaryDirectory(prefix="mmserve-") as folder:
        return _serve(_private_addresses(settings, folder))


def _serve(settings: Settings) -> int:
    supervisor = Supervisor(settings)
    supervisor.start()
    stop = threading.Event()
    threading.Thread(target=_announce_when_ready, args=(settings, stop), daemon=True).start()
    threading.Thread(target=supervisor.watch, args=(stop,), daemon=True).start()
    try:
        run_api(settings, owns_engine=True)
    finally:
        stop.set()
        supervisor.stop()
    return 0


def _announce_when_ready(settings: Settings, stop: threading.Event) -> None:
    url = f"http://{settings.host}:{settings.port}"
    while not stop.wait(0.2):
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                print(
                    f"mmserve: serving model {settings.model_name!r} ({settings.model}) at {url}/v1 "
                    "- press Ctrl-C to stop",
                    flush=True,
                )
                return
        except httpx.HTTPError:
            continue


class Supervisor:
    """The engine and worker processes of ``serve``, restarted when they die (a non-zero exit: a crash,
    SIGKILL, the OOM killer); a role that exits 0 was asked to stop, and the server stops with it.

    A dead worker is started again; the engine notices the lost worker, fails its requests with 503 and
    takes the new worker with a fresh epoch. A dead engine takes its worker with it (that worker's KV
    and encoder outputs belong to the dead engine's state): both are started again, and the API, which
    saw the engine go, clears its IPC mirror on the new epoch. A role that dies ``MAX_RESTARTS`` times
    within ``RESTART_WINDOW_S`` is not restarted again: the API is stopped instead.
    """

    MAX_RESTARTS = 5
    RESTART_WINDOW_S = 60.0

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.ctx = multiprocessing.get_context("spawn")
        self.children: dict[str, multiprocessing.process.BaseProcess] = {}
        self.restarts: dict[str, list[float]] = {"engine": [], "worker": []}
        self.lock = threading.Lock()

    def start(self, roles: tuple[str, ...] = ("engine", "worker")) -> None:
        for role in roles:
            child = self.ctx.Process(
                target=_child_main, args=(role, self.settings), name=f"mmserve-{role}", daemon=False
            )
            child.start()
            self.children[role] = child

    def watch(self, stop: threading.Event) -> None:
        while not stop.wait(0.1):
            dead = [role for role, child in self.children.items() if not child.is_alive()]
            if not dead:
                continue
            with self.lock:
                if stop.is_set():
                    return
                if any(self.children[role].exitcode == 0 for role in dead):
                    # asked to stop (Ctrl-C reaches the whole process group; a signal to one role):
                    # the server stops as a whole
                    log.info("%s stopped: stopping the server", " and ".join(dead))
                    signal.raise_signal(signal.SIGINT)
                    return
                if not self._restart(dead):
                    signal.raise_signal(signal.SIGINT)  # the API stops, then stop() ends the rest
                    return

    def _restart(self, dead: list[str]) -> bool:
        roles = ("engine", "worker") if "engine" in dead else ("worker",)
        now = time.monotonic()
        for role in dead:
            log.error("%s process exited (code %s)", role, self.children[role].exitcode)
            recent = [t for t in self.restarts[role] if now - t < self.RESTART_WINDOW_S] + [now]
            self.restarts[role] = recent
            if len(recent) > self.MAX_RESTARTS:
                log.error("%s died %d times in %gs: giving up", role, len(recent), self.RESTART_WINDOW_S)
                return False
        if "engine" in dead and self.children["worker"].is_alive():
            _end([self.children["worker"]], grace_s=0.0)
        log.warning("restarting %s", " and ".join(roles))
        self.start(roles)
        return True

    def stop(self) -> None:
        with self.lock:
            _end(list(self.children.values()), grace_s=5.0)


def _end(children: list[multiprocessing.process.BaseProcess], *, grace_s: float) -> None:
    """Waits ``grace_s`` for children to exit by themselves, then terminates, then kills them."""
    deadline = time.monotonic() + grace_s
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.is_alive():
            child.terminate()
            child.join(2.0)
        if child.is_alive():
            child.kill()
            child.join()
