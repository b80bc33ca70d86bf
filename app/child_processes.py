"""Where ``serve``'s child processes come from (docs/architecture.md, "Processes"): the worker, the
preprocessing processes and API processes 1..N-1 are forks of one multiprocessing fork server per
server, which imported torch, transformers and their modules once. Such a child starts on about 0.1 s of
CPU, where a spawned one imported them again (5-7 s of CPU each on a 2-core machine), and a restarted
worker or preprocessing process is back as soon as it has loaded its model.

The fork server dies with the thread that started it (PR_SET_PDEATHSIG): ``serve``'s main thread, or
an API's event loop; not with a SIGTERM to the process group, which drains the server. It only
imports: it never runs a model, so no CUDA context exists in it and its forks may use the GPU
(importing torch initialises no CUDA). A child inherits the environment the fork server was started
with, so ``start_fork_server`` runs once the launcher has set the variables its children read.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import signal
from multiprocessing.context import ForkServerContext
from typing import Any

# The fork server's own set-up first (app/fork_server_init.py), then what the children import anyway: the
# worker's model code and the preprocessing processes' processors. (The engine, which imports no torch,
# is spawned: app/launch/supervisor.py.)
PRELOAD = ["app.fork_server_init", "workers.worker_main", "app.inputs.preprocess.child"]
# API processes 1..N-1 (``--api-server-count``) run the API's modules too (about 0.7 s more to import)
API_PRELOAD = "app.api.server"


def child_context(*, api_processes: bool = False) -> ForkServerContext:
    """The context to make child processes with. ``api_processes``: some children will run an API.
    The modules are those of the fork server's first start (a running fork server keeps its own)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD + ([API_PRELOAD] if api_processes else []))
    return context


def leave_fork_server() -> None:
    """First thing in a forked child: closes the child's copy of the fork server's liveness pipe, which
    multiprocessing hands every fork. The fork server exits when that pipe's last writer is gone: once
    only the process that started it holds one, the fork server exits with it, and PR_SET_PDEATHSIG then
    ends each child, busy or not, rather than each waiting to notice its own connections close. Also
    gives SIGTERM back its default action, which the fork server ignores (app/fork_server_init.py).
    Nothing in a spawned child."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    server: Any = multiprocessing.forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def start_fork_server(*, api_processes: bool = False) -> None:
    """Starts the fork server now rather than at the first child, so that its imports overlap the
    caller's own."""
    child_context(api_processes=api_processes)
    multiprocessing.forkserver.ensure_running()


def remove_multiprocessing_folder() -> None:
    """Removes the folder multiprocessing made in this process (``pymp-*`` in the temp folder: the fork
    server's listening socket), as its exit hook would: a role ends with ``os._exit``, which skips that
    hook, so every start and stop left one behind. Only once nothing will start another child, and only
    in a program's first process: a child's process object carries its parent's folder, which the
    parent's fork server still listens in."""
    if multiprocessing.parent_process() is not None:
        return
    config = getattr(multiprocessing.current_process(), "_config", {})  # multiprocessing.util sets it
    folder = config.get("tempdir")
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
