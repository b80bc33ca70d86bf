"""``mmserve ray serve``: mmserve replicas on Ray Serve (docs/operations.md, "Scale-out on Ray"). With no
``--ray-address`` it starts a Ray cluster on this machine, bound to 127.0.0.1 with its object store
capped, and the replicas share one media-id table and one response store (files in a temporary folder), so
any replica resolves a media id or a stored response made through another. With an address it joins that
cluster; there each replica keeps its own unless ``--mm-uuid-store`` and ``--responses-store`` name files,
which only replicas on one node may share (SQLite's WAL: one host). SIGTERM drains first, as ``mmserve
serve`` does: new requests get 503 ``server_shutting_down`` while the answers under way finish, for up to
``--shutdown-timeout`` (``drain``); then, or at once on Ctrl-C or a second SIGTERM, it stops the
application, its replicas and a cluster it started."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from app.ray_serve.affinity import IMBALANCE_THRESHOLD  # no Ray: the CLI stays importable without it
from app.ray_serve.stream_batching import DEFAULT_INTERVAL_S
from app.settings import Settings

APP_NAME = "mmserve"
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Arguments up to this size travel inside Ray's task messages instead of through the object store: a
# request's body (often hundreds of KB of data URLs) then costs no object creation, raylet round trips
# or store memory on its way to a replica (Ray's default: 100 KiB; docs/operations.md, "Scale-out on Ray").
INLINE_ARG_BYTES = 8 << 20
SHARED_FILES = {"mm_uuid_store": "media-ids.sqlite", "responses_store": "responses.sqlite"}


def add_ray_parser(sub: Any, add_settings_flags: Any) -> None:
    ray = sub.add_parser("ray", help="Run mmserve replicas on Ray Serve.")
    ray_sub = ray.add_subparsers(dest="ray_command", required=True)
    help_text = "Serve the OpenAI endpoints from N mmserve replicas behind a media-affinity router."
    serve = ray_sub.add_parser("serve", help=help_text, description=help_text)
    add_settings_flags(serve)
    serve.add_argument(
        "--replicas", type=int, default=2, help="Replicas, each a whole mmserve instance (default: 2)."
    )
    serve.add_argument(
        "--router",
        choices=["media", "default", "prefix"],
        default="media",
        help="media: media affinity (default); default: Ray's power of two; prefix: Ray's prefix router.",
    )
    serve.add_argument(
        "--imbalance-threshold",
        type=int,
        default=IMBALANCE_THRESHOLD,
        help="Queue length by which the replica holding the media may exceed the least loaded "
        f"(default: {IMBALANCE_THRESHOLD}).",
    )
    serve.add_argument(
        "--replica-cpus", type=float, default=1.0, help="CPUs each replica reserves (default: 1)."
    )
    serve.add_argument(
        "--replica-gpus", type=float, default=0.0, help="GPUs each replica reserves (default: 0)."
    )
    serve.add_argument(
        "--stream-interval-ms",
        type=float,
        default=DEFAULT_INTERVAL_S * 1e3,
        help="A streamed answer's items on Ray's hops, after its first token: at most one per interval, "
        f"as Ray Serve LLM batches streams (default: {DEFAULT_INTERVAL_S * 1e3:g}; 0: one per chunk).",
    )
    serve.add_argument(
        "--ray-address",
        default=None,
        help="A running Ray cluster to join (default: start one on this machine).",
    )
    serve.add_argument(
        "--object-store-mb",
        type=int,
        default=256,
        help="The object store of a cluster started here, in MiB (default: 256; bodies up to 8 MiB pass "
        "inside Ray's messages, not through it).",
    )


def run_ray_serve(args: argparse.Namespace, given: dict[str, Any]) -> int:
    try:
        settings = Settings(**given)
    except ValidationError as exc:
        print(f"mmserve: error: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    if not Path(settings.model).is_dir():
        print(f"mmserve: error: no model folder at {settings.model}", file=sys.stderr)
        return 2
    if args.ray_address is None:
        # a one-machine cluster: Ray's node address is then 127.0.0.1 and its servers listen there only
        # (the switch is named for the platforms where that is Ray's default)
        os.environ[LOCAL_ONLY_ENV] = "0"
    import ray
    from ray import serve

    from app.ray_serve.app import INGRESS_DEPLOYMENT, build_app

    given = {**given, "model": str(Path(settings.model).resolve())}  # replicas run in other folders
    with tempfile.TemporaryDirectory(prefix="mmserve-ray-") as folder:
        if args.ray_address is None:
            for name, file_name in SHARED_FILES.items():
                given.setdefault(name, f"{folder}/{file_name}")
            ray.init(
                include_dashboard=False,
                num_cpus=len(os.sched_getaffinity(0)),  # the cores this process may use
                object_store_memory=args.object_store_mb << 20,
                _system_config={"max_direct_call_object_size": INLINE_ARG_BYTES},
                _temp_dir=f"{folder}/ray",
            )
        else:
            ray.init(address=args.ray_address)
        stop, now = threading.Event(), threading.Event()  # stop: drain first; now: stop at once

        def on_signal(sig: int, _: object) -> None:
            if sig == signal.SIGINT or stop.is_set():
                now.set()
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        try:
            serve.start(http_options={"host": settings.host, "port": settings.port})
            app_args = {
                "settings": given,
                "replicas": args.replicas,
                "router": args.router,
                "imbalance_threshold": args.imbalance_threshold,
                "replica_cpus": args.replica_cpus,
                "replica_gpus": args.replica_gpus,
                "stream_interval_ms": args.stream_interval_ms,
            }
            serve.run(build_app(app_args), name=APP_NAME, route_prefix="/")
            # the handle SIGTERM's drain calls, ready before it is needed (a first call takes seconds)
            ingress = serve.get_deployment_handle(INGRESS_DEPLOYMENT, app_name=APP_NAME)
            ingress.in_flight.remote().result(timeout_s=60)
            url = f"http://{settings.host}:{settings.port}"
            print(
                f"mmserve: serving model {settings.model_name!r} from {args.replicas} Ray Serve replicas at "
                f"{url}/v1 - press Ctrl-C to stop",
                flush=True,
            )
            stop.wait()
            if not now.is_set():
                drain(ingress, settings.shutdown_timeout, now)
        finally:
            serve.shutdown()
            ray.shutdown()
    return 0


def drain(ingress: Any, timeout_s: float, now: threading.Event) -> None:
    """SIGTERM: the ingress (its deployment's handle) refuses new requests (503 ``server_shutting_down``)
    and the driver waits until it answers none, ``timeout_s`` passed or ``now`` is set; what is still
    running then is cut off when the application stops (app/ray_serve/ingress.py)."""
    print(f"mmserve: SIGTERM: draining for up to {timeout_s:g} s; new requests get 503", flush=True)
    deadline = time.monotonic() + timeout_s
    try:
        ingress.start_drain.remote().result(timeout_s=30)
        while not now.is_set() and time.monotonic() < deadline:
            if ingress.in_flight.remote().result(timeout_s=30) == 0:
                return
            now.wait(0.1)
    except Exception as exc:  # an ingress that cannot be reached has nothing to drain
        print(f"mmserve: the drain stopped early: {exc!r}", file=sys.stderr, flush=True)
        return
    if not now.is_set():
        print("mmserve: shutdown timeout: the requests still running are cut off", flush=True)
