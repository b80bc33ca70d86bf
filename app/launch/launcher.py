"""Starts mmserve's processes: one role (``api``/``engine``/``worker``) or all three (``serve``).
The only module that knows all three entry points.

``serve --api-server-count N`` runs N API processes on one port: the main process (API 0, which owns
the engine) and N-1 children, each binding its own socket with SO_REUSEPORT. Each has its own ZeroMQ
identity, IPC mirror and receiver-cache partition, and (with shm) its own ring; ``/metrics`` sums the
API-side figures of all of them (app/metrics.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import httpx
import setproctitle
import uvicorn

from app.child_processes import leave_fork_server, remove_multiprocessing_folder, start_fork_server
from app.inputs.encoder_budgets import budget_warnings, derive_encoder_budgets, startup_error
from app.launch.process_configs import engine_config, worker_config
from app.launch.supervisor import Supervisor
from app.settings import Settings
from wire.curve import check_addresses
from wire.shm_ring import SHM_DIR, remove_orphans
from workers.families import UnsupportedModelError

if TYPE_CHECKING:  # the API's modules are imported by the processes that run an API only
    from app.api.drain import Drain

log = logging.getLogger("mmserve")

GRACE_AFTER_DRAIN_S = 0.5


def _configure_logging(settings: Settings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def run_role(role: str, settings: Settings) -> int:
    _configure_logging(settings)
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
            settings.resolved_max_model_len()
            budgets = derive_encoder_budgets(settings)
        except (UnsupportedModelError, ValueError) as exc:
            print(f"mmserve: error: {exc}", file=sys.stderr)
            return 2
        error = startup_error(settings, budgets)
        if error is not None:
            print(f"mmserve: error: {error}", file=sys.stderr)
            return 2
        if role in ("serve", "engine"):
            for warning in budget_warnings(settings, budgets):
                log.warning("%s", warning)
    error = _socket_security_error(role, settings)
    if error is not None:
        print(f"mmserve: error: {error}", file=sys.stderr)
        return 2
    exit_now(_run(role, settings))


def _run(role: str, settings: Settings) -> int:
    if role == "serve":
        return serve(settings)
    if role == "engine":
        from engine.engine_main import run_engine

        run_engine(engine_config(settings))
    elif role == "worker":
        from workers.worker_main import run_worker

        return run_worker(worker_config(settings))
    else:
        if settings.api_server_count > 1:
            log.warning("--api-server-count applies to `mmserve serve`; this is one API process")
        _remove_orphan_rings()  # e.g. what this container's previous API process left (docker-compose)
        run_api(settings, owns_engine=False)
    return 0


def exit_now(status: int) -> NoReturn:
    """Ends a role's process once it stopped serving and closed what it owns (sockets, children, shared
    memory, temp folders): the interpreter's own finalization has nothing left to do, and with torch and
    transformers imported it takes over a second, which every Ctrl-C and restart would wait for."""
    remove_multiprocessing_folder()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _socket_security_error(role: str, settings: Settings) -> str | None:
    """A CURVE key that is given but unusable, or an address of this role's sockets that other hosts
    can reach without one (wire/curve.py)."""
    try:
        keys = settings.curve_keys()
    except ValueError as exc:
        return str(exc)
    addrs = {"--engine-addr": settings.engine_addr, "--worker-addr": settings.worker_addr}
    if role == "api":
        del addrs["--worker-addr"]
    elif role == "worker":
        del addrs["--engine-addr"]
    return check_addresses(addrs, keys)


def run_api(
    settings: Settings,
    *,
    owns_engine: bool,
    api_index: int = 0,
    shared_port: bool = False,
    drain: Drain | None = None,
) -> None:
    """Serves HTTP until SIGINT, or until SIGTERM's drain finished (``app.api.drain``). ``api_index`` names
    this process in every response's ``x-mmserve-api-process`` header; ``shared_port``: one of
    ``serve``'s API processes sharing ``settings.port`` (SO_REUSEPORT)."""
    import torch

    from app.api.drain import Drain, DrainingServer
    from app.api.process_header import ProcessHeader
    from app.api.server import create_app

    # The API's few tensor ops are small; a second OpenMP thread would only spin, waiting for work,
    # on a core the worker needs (app/settings.py, worker_threads)
    torch.set_num_threads(1)

    drain = drain if drain is not None else Drain(settings.shutdown_timeout)
    app = create_app(settings, shutdown_engine_on_exit=owns_engine, drain=drain)
    app.add_middleware(ProcessHeader, index=api_index)  # outermost: refusals name the process too
    # The drain already waited for requests in flight: what uvicorn's own shutdown finds after it (or
    # after Ctrl-C) is cut off at once.
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # h11 whatever else is installed (Ray's extra brings httptools, which uvicorn would pick)
        http="h11",
        # uvicorn hands it to asyncio.wait_for, which takes a float; its annotation says int
        timeout_graceful_shutdown=GRACE_AFTER_DRAIN_S,  # type: ignore[arg-type]
    )
    sockets = [_reuse_port_socket(settings.host, settings.port)] if shared_port else None
    # uvicorn puts this disposition back when it stops listening for signals: a Ctrl-C arriving after
    # that (the terminal's reaches every process of the group, and ``serve`` passes one on to its other
    # API processes once its own stopped) must not interrupt the process's exit. SIG_IGN, unlike a
    # Python handler, also holds while the interpreter finalizes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    DrainingServer(config, drain).run(sockets=sockets)


def _reuse_port_socket(host: str, port: int) -> socket.socket:
    """This API process's own listening socket on the shared port. SO_REUSEPORT rather than one socket
    bound by ``serve`` and handed to every process (uvicorn's ``--workers``): the kernel spreads new
    connections evenly over the processes' sockets by a hash, where on one shared socket every process
    wakes for each connection and whichever runs first takes all that are queued; and a restarted process
    simply binds again. The socket is bound here but listens only once the app started (asyncio's
    ``create_server`` calls ``listen``), so the kernel sends no connection to a process still starting."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def _claim_port(settings: Settings) -> Settings:
    """Checks, before anything starts, that nothing listens on the port (SO_REUSEPORT would otherwise
    let a second ``serve`` share it silently) and resolves port 0, so every API process binds the same."""
    family, kind, proto, _, address = socket.getaddrinfo(
        settings.host, settings.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)  # fails while any socket listens there, SO_REUSEPORT or not
        port = int(probe.getsockname()[1])
    return Settings(**{**settings.model_dump(exclude_unset=True), "port": port})


def _child_main(role: str, settings: Settings, api_index: int | None = None) -> None:
    """Entry of a child started by ``serve``: dies with its parent (``serve``, or the fork server, which
    exits with ``serve``: app/child_processes.py), then runs its role. An API process (``api_index``
    1..N-1) shares the port and leaves the engine running when it exits; ``serve`` already checked the
    model folder and the budgets.

    The engine and the worker ignore SIGTERM: ``serve`` stops them by message once its API processes
    drained (docs/operations.md, "Drain on SIGTERM"). A SIGTERM to the whole process group (systemd's
    stop) would otherwise drain the engine at once, and it would stop, refusing what the API processes
    still prepare; so they die with their parent by SIGKILL instead."""
    leave_fork_server()
    serve_stops_it = api_index is None and role in ("engine", "worker")
    if sys.platform.startswith("linux"):
        death_signal = signal.SIGKILL if serve_stops_it else signal.SIGTERM
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, death_signal)  # PR_SET_PDEATHSIG
    if serve_stops_it:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # kept by the role (run_engine, run_worker)
    if api_index is None:
        sys.exit(run_role(role, settings))  # a refusal: run_role exits by itself once it served
    _configure_logging(settings)
    setproctitle.setproctitle("mmserve: api")
    run_api(settings, owns_engine=False, api_index=api_index, shared_port=True)
    exit_now(0)


def _private_addresses(settings: Settings, folder: str) -> Settings:
    """``serve`` uses fresh ipc:// paths unless addresses were set, so two servers never collide."""
    explicit = settings.model_fields_set
    update = {}
    if "engine_addr" not in explicit:
        update["engine_addr"] = f"ipc://{folder}/engine.sock"
    if "worker_addr" not in explicit:
        update["worker_addr"] = f"ipc://{folder}/worker.sock"
    if "mm_uuid_store" not in explicit and settings.api_server_count > 1:
        update["mm_uuid_store"] = f"{folder}/media-ids.sqlite"  # one binding table for every API process
    if "responses_store" not in explicit and settings.api_server_count > 1:
        update["responses_store"] = f"{folder}/responses.sqlite"  # one response store for every API process
    return Settings(**{**settings.model_dump(exclude_unset=True), **update})


def serve(settings: Settings) -> int:
    with tempfile.TemporaryDirectory(prefix="mmserve-") as folder:
        settings = _private_addresses(settings, folder)
        if settings.api_server_count == 1:
            return _serve(settings)
        try:
            settings = _claim_port(settings)
        except OSError as exc:
            print(f"mmserve: error: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
            return 1
        with _multiprocess_metrics(Path(folder) / "metrics"):
            return _serve(settings)


@contextlib.contextmanager
def _multiprocess_metrics(folder: Path) -> Iterator[None]:
    """prometheus-client's multiprocess mode for every API process (app/metrics.py): a fresh folder,
    named before any of them starts (the children inherit the variable), removed when ``serve`` ends."""
    from app.metrics import MULTIPROC_DIR_ENV

    folder.mkdir()
    previous = os.environ.get(MULTIPROC_DIR_ENV)
    os.environ[MULTIPROC_DIR_ENV] = str(folder)
    try:
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if previous is None:
            os.environ.pop(MULTIPROC_DIR_ENV, None)
        else:
            os.environ[MULTIPROC_DIR_ENV] = previous


def _serve(settings: Settings) -> int:
    from app.api.drain import Drain

    _remove_orphan_rings()
    # The fork server imports the children's modules while this process imports the API's; the children
    # start once it has (app/child_processes.py), on the supervisor's thread.
    start_fork_server(api_processes=settings.api_server_count > 1)
    supervisor = Supervisor(settings, _child_main, _remove_orphan_rings)
    stop = threading.Event()
    threading.Thread(target=_announce_when_ready, args=(settings, stop), daemon=True).start()
    threading.Thread(target=supervisor.run, args=(stop,), daemon=True).start()
    # SIGTERM: the other API processes drain at the same time, and the engine runs until they are done
    drain = Drain(
        settings.shutdown_timeout, on_start=[supervisor.drain_apis], waits_for=[supervisor.apis_running]
    )
    try:
        run_api(settings, owns_engine=True, shared_port=settings.api_server_count > 1, drain=drain)
    finally:
        stop.set()
        supervisor.stop()
    return 0


def _remove_orphan_rings() -> None:
    """Shared-memory files of API processes that died without removing them (SIGKILL, OOM killer)."""
    if os.path.isdir(SHM_DIR):
        removed = remove_orphans(SHM_DIR)
        if removed:
            log.info("removed %d shared-memory file(s) of dead processes", len(removed))


def _announce_when_ready(settings: Settings, stop: threading.Event) -> None:
    url = f"http://{settings.host}:{settings.port}"
    # one client for every poll: each httpx.get builds a client and its TLS context (about 40 ms of CPU,
    # a few seconds over a start, taken from the imports the start waits for)
    with httpx.Client(timeout=1.0, trust_env=False) as client:
        while not stop.wait(0.2):
            try:
                if client.get(f"{url}/health").status_code == 200:
                    print(
                        f"mmserve: serving model {settings.model_name!r} ({settings.model}) at {url}/v1 "
                        "- press Ctrl-C to stop",
                        flush=True,
                    )
                    return
            except httpx.HTTPError:
                continue
