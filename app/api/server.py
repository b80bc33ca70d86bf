"""The API process's app factory. The lifespan owns the engine client, the HTTP client used to fetch
images, the HF processor and the caches; nothing runs at import time."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI
from starlette.routing import Route

from app.api.chat_service import ChatService
from app.api.completion_service import CompletionService
from app.api.drain import Drain, DrainGuard
from app.api.error_handlers import install_error_handlers
from app.api.http_metrics import HttpMetrics
from app.api.openapi_errors import document_error_envelope
from app.api.request_guards import RequestGuards
from app.api.response_store import ResponseStore
from app.api.responses_background import BACKGROUND_POLL_S, BackgroundResponses, maker_alive
from app.api.responses_object import closing_event
from app.api.responses_service import ResponsesService
from app.api.routes import chat, completions, models, ops
from app.api.routes import responses as responses_routes
from app.api.routes import tokenize as tokenize_routes
from app.api.sampling import SamplingDefaults
from app.api.state import ApiState
from app.api.tokenize_service import TokenizeService
from app.inputs.engine_client import EngineClient
from app.inputs.input_processor import InputProcessor
from app.inputs.preprocess.pool import PreprocessPool
from app.inputs.preprocess.video_item import VideoRules
from app.inputs.processor_cache import ProcessorCache
from app.inputs.shared_media_ids import media_ids_for
from app.inputs.shm_store import ShmObjectStore
from app.media.fetch import MediaFetcher
from app.media.url_policy import MediaPolicy
from app.metrics import ApiMetrics
from app.settings import Settings
from workers.families import load_processing

log = logging.getLogger("mmserve.api")
# every route reads its body as strict JSON (their StrictJSONRoute: tests/unit/test_json_body.py checks)
ROUTERS = (
    chat.router,
    completions.router,
    models.router,
    ops.router,
    tokenize_routes.router,
    responses_routes.router,
)


def _log_pool_failure(start: asyncio.Future[None]) -> None:
    if not start.cancelled() and start.exception() is not None:
        log.error("%s", start.exception())


def create_app(
    settings: Settings, *, shutdown_engine_on_exit: bool = False, drain: Drain | None = None
) -> FastAPI:
    """``shutdown_engine_on_exit``: the API owns the engine (``mmserve serve``) and tells it to stop.
    ``drain``: the SIGTERM drain of the server running this app (a fresh one when none is given)."""
    drain = drain if drain is not None else Drain(settings.shutdown_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = ApiMetrics()
        max_model_len = settings.resolved_max_model_len()
        family = load_processing(
            settings.model,
            chat_template=settings.chat_template_text(),
            tool_call_parser=settings.tool_call_parser,
        )
        # With shm the ring takes the processor cache's memory and replaces both caches' roles.
        shm = (
            ShmObjectStore(settings.processor_cache_bytes, settings.shm_max_object_bytes)
            if settings.mm_processor_cache_type == "shm"
            else None
        )
        ipc_cache_bytes = 0 if shm else settings.ipc_cache_bytes
        engine = EngineClient(settings.engine_addr, ipc_cache_bytes, metrics, shm, settings.curve_keys())
        drain.on_cut_off.append(lambda message: engine.end_in_flight(message, "server_shutting_down"))
        processor_cache = ProcessorCache(0 if shm else settings.processor_cache_bytes)
        video = VideoRules.from_settings(settings) if family.supports_video else None
        pool = PreprocessPool(
            settings.model, settings.resolved_preprocess_processes(), family=family, video=video
        )
        # Redirects are followed by the fetcher, each hop checked; proxies from the environment would
        # connect elsewhere than the checked address, so they are not used for image fetches.
        http = httpx.AsyncClient(follow_redirects=False, trust_env=False)
        media = MediaFetcher(MediaPolicy.from_settings(settings), http)
        media_ids = media_ids_for(settings)
        inputs = InputProcessor(settings, family, processor_cache, engine, metrics, media, pool, media_ids)
        defaults = SamplingDefaults.load(settings.model, settings.generation_config)
        chat_service = ChatService(
            settings.model_name,
            max_model_len,
            inputs,
            engine,
            metrics,
            defaults,
            response_format_whitespace=settings.response_format_whitespace == "any",
        )
        tokenize = TokenizeService(settings.model_name, max_model_len, inputs)
        response_store = ResponseStore(
            settings.responses_store, settings.responses_store_entries, settings.responses_store_mb << 20
        )
        # another API process may change a shared store's responses: their tasks and readers poll it
        background = BackgroundResponses(
            response_store, BACKGROUND_POLL_S if settings.responses_store else None
        )
        drain.waits_for.append(lambda: background.busy)
        responses = ResponsesService(chat_service, response_store, background)
        if settings.responses_store:  # a file: responses an API process killed was making end failed
            await asyncio.to_thread(response_store.fail_orphans, maker_alive, closing_event)
        await asyncio.to_thread(responses.stored.count, 0)  # (a file may hold responses already)
        app.state.mmserve = ApiState(
            settings,
            max_model_len,
            metrics,
            engine,
            chat_service,
            drain,
            tokenize,
            responses,
            CompletionService(chat_service),
        )
        pool_start: asyncio.Future[None] | None = None
        try:
            await engine.start()
            # The preprocessing processes load the family in the background (seconds, on cores the
            # worker's start needs too): /health waits for the engine and its worker only, and a cache
            # miss that comes before a process is loaded waits for one.
            pool_start = asyncio.ensure_future(pool.start())
            pool_start.add_done_callback(_log_pool_failure)
            yield
        finally:
            if pool_start is not None:
                pool_start.cancel()
            await engine.close(shutdown_engine=shutdown_engine_on_exit)
            await http.aclose()
            await pool.close()
            if shm is not None:
                shm.close()
            await background.close()  # (a drain waited for them: those left end failed)
            response_store.close()

    app = FastAPI(title="mmserve", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    document_error_envelope(app)
    app.add_middleware(DrainGuard, drain=drain)  # added first: runs after the guards below
    app.add_middleware(
        RequestGuards, api_key=settings.api_key, max_body_bytes=settings.max_request_body_bytes
    )
    for router in ROUTERS:
        app.include_router(router)
    # added last: the outermost middleware, so it sees the guards' refusals too
    routes = [*app.routes, *(route for router in ROUTERS for route in router.routes)]
    app.add_middleware(HttpMetrics, routes=[route for route in routes if isinstance(route, Route)])
    return app
