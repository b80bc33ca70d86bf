"""The ingress deployment: the OpenAI endpoints on Ray Serve's HTTP proxy (docs/architecture.md,
"Replicas on Ray Serve"). It checks a request as ``mmserve serve`` does before any route runs (API key,
body size: ``app.api.request_guards``), computes its media keys from the JSON body, and hands it to
the replica deployment's handle, whose request router picks the replica. The answer comes back as the
replica's instance gave it, streamed when it is SSE, with the replica's name in ``x-mmserve-replica``.

A replica that died before answering is tried again elsewhere (the router has forgotten it by then);
one that fails mid-stream ends the stream with an error event, as ``mmserve proxy`` does. The ingress's
own routes: ``/health``, ``/metrics`` (the router's placements) and ``/replicas`` (what each replica
reports: its instance's URL and pid, how many media keys it holds).

SIGTERM to ``mmserve ray serve`` drains here, as ``mmserve serve`` drains its API (``app.api.drain``):
``start_drain`` makes ``DrainGuard`` refuse new requests with 503 ``server_shutting_down`` and
``/health`` answer 503, and the driver polls ``in_flight`` until the answers under way are done or
``--shutdown-timeout`` passed, before it stops the application.

No ``from __future__ import annotations`` here: Ray ships the ingress class by value, without the
module's globals its annotations would name, and FastAPI reads the annotations to bind ``Request``."""

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

from app.api.drain import Drain, DrainGuard
from app.api.error_handlers import error_response, install_error_handlers, sse_error_event
from app.api.request_guards import GUARDED_PREFIXES, RequestGuards, request_tenant
from app.api.response_ids import ResponseIdWatch, followed_responses, json_or_none
from app.proxy.forward import UpstreamUnavailableError, describe, forwarded_headers
from app.ray_serve import router_state
from app.ray_serve.grpc_binding import bind_to_node_address
from app.ray_serve.media_keys import media_keys, response_key, stored_response_keys
from app.ray_serve.messages import ReplicaHead, ReplicaRequest

REPLICA_HEADER = "x-mmserve-replica"
TRIES = 3  # a replica that died before answering: the request goes to another (the router forgot it)
FORWARDED_METHODS = ["GET", "POST", "DELETE"]


@dataclass(frozen=True)
class IngressOptions:
    api_keys: list[str]
    max_body_bytes: int
    isolate_tenants: bool
    replica_deployment: str  # the replica deployment's name, under which its router is listed
    chat_messages: bool = False  # send the parsed messages too (Ray's prefix router reads them)
    shared_responses: bool = False  # every replica reads one response store (--responses-store FILE)
    shutdown_timeout_s: float = 30.0  # --shutdown-timeout: how long SIGTERM's drain waits


def build_ingress(options: IngressOptions) -> type:
    """The ingress deployment's class, its FastAPI app guarded by ``options``."""
    # no OpenAPI of its own: /openapi.json, as /docs, is a replica's (the whole API)
    app = FastAPI(title="mmserve on Ray Serve", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    drain = Drain(options.shutdown_timeout_s)
    app.add_middleware(DrainGuard, drain=drain)  # added first: runs after the guards below
    app.add_middleware(
        RequestGuards,
        api_key=options.api_keys,
        max_body_bytes=options.max_body_bytes,
        guarded=(*GUARDED_PREFIXES, "/replicas"),  # (its instances' addresses and pids)
    )

    @serve.ingress(app)
    class MmserveIngress:
        def __init__(self, replicas: DeploymentHandle) -> None:
            bind_to_node_address()
            self._replicas = replicas.options(stream=True)

        @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes
        async def health(self) -> JSONResponse:
            if drain.started:
                return JSONResponse({"status": "draining"}, status_code=503)
            return JSONResponse({"status": "ok"})

        def start_drain(self) -> None:
            """Called by the driver on SIGTERM (a handle call: one ingress replica)."""
            drain.start()

        def in_flight(self) -> int:
            """The requests still being answered."""
            return drain.in_flight

        @app.get("/metrics")
        async def metrics(self) -> Response:
            return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

        @app.get("/replicas")
        async def replicas(self) -> JSONResponse:
            router = router_state.LISTED.get(
                options.replica_deployment
            )  # by name: this class is shipped by value
            return JSONResponse({"replicas": router.listed_replicas() if router is not None else []})

        @app.api_route("/{path:path}", methods=FORWARDED_METHODS, include_in_schema=False)
        async def forward(self, request: Request) -> Response:
            return await self._forward(request)

        async def _forward(self, request: Request) -> Response:
            body = await request.body()
            parsed = json_or_none(body)
            tenant = request_tenant(request.scope)
            keys = media_keys(parsed, tenant=tenant, isolate_tenants=options.isolate_tenants)
            stored = stored_response_keys(request.method, request.url.path, tenant)
            keys += stored
            holder_only = not options.shared_responses and bool(stored or followed_responses(parsed))
            makes_response = request.method == "POST" and request.url.path == "/v1/responses"
            path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            messages = parsed.get("messages") if options.chat_messages and isinstance(parsed, dict) else None
            message = ReplicaRequest(
                method=request.method,
                path=path,
                headers=forwarded_headers(request.headers),
                body=body,
                media_keys=keys,
                chat_messages=messages if isinstance(messages, list) else None,
                response_tenant=tenant if makes_response else None,
                holder_only=holder_only,
            )
            failure: BaseException | None = None
            for _ in range(TRIES):
                stream: Any = self._replicas.forward.remote(message)  # a DeploymentResponseGenerator
                try:
                    head = await stream.__anext__()
                except (RayActorError, ActorUnavailableError) as exc:
                    failure = exc
                    continue
                except Exception as exc:  # the replica raised before its head (it never does on purpose)
                    return error_response(UpstreamUnavailableError(f"The replica failed ({describe(exc)})."))
                assert isinstance(head, ReplicaHead)
                learn = None
                if makes_response and head.status == 200:
                    learn = self._learner(tenant, head.replica)
                return await _respond(head, stream, learn)
            assert failure is not None
            return error_response(UpstreamUnavailableError(f"No replica answered ({describe(failure)})."))

        def _learner(self, tenant: str, replica: str) -> Callable[[str], None]:
            """Where a stored response was made: its follow-ups' media are there (``response_key``)."""

            def learn(response_id: str) -> None:
                router = router_state.LISTED.get(options.replica_deployment)
                if router is not None:
                    router.place((response_key(tenant, response_id),), replica)

            return learn

    return MmserveIngress


async def _respond(
    head: ReplicaHead, stream: DeploymentResponseGenerator, learn: Callable[[str], None] | None
) -> Response:
    """``learn``: told the response id of a Responses API answer, streamed or not."""
    headers = {**head.headers, REPLICA_HEADER: head.replica}
    streamed = head.headers.get("content-type", "").startswith("text/event-stream")
    watch = ResponseIdWatch(learn, streamed) if learn is not None else None
    if streamed:
        return StreamingResponse(
            _rest(stream, watch),
            status_code=head.status,
            headers=headers,
            background=BackgroundTask(stream.cancel),  # the client left: the replica's stream ends too
        )
    try:
        body = b"".join([chunk async for chunk in stream])
    except Exception as exc:
        return error_response(UpstreamUnavailableError(f"The replica failed mid-answer ({describe(exc)})."))
    if watch is not None:
        watch.feed(body)
        watch.finish()
    return Response(body, status_code=head.status, headers=headers)


async def _rest(stream: DeploymentResponseGenerator, watch: ResponseIdWatch | None) -> AsyncIterator[bytes]:
    try:
        async for chunk in stream:
            if watch is not None:
                watch.feed(chunk)
            yield chunk
    except Exception as exc:
        error = UpstreamUnavailableError(f"The replica failed mid-stream ({describe(exc)}).")
        yield sse_error_event(error).encode()
    finally:
        stream.cancel()
