"""From an OpenAI chat request to an ``AddRequest`` on the wire, as one straight sequence of stages; the
model's family (``workers.families``) supplies every model-specific step. An item is an image or a
video; both go every step alike::

    prepare()    1 parse            messages -> chat-template messages + media URLs; per-prompt limits
                                    by kind, mm_processor_kwargs validated per kind (before anything is
                                    fetched); a video for a family without video is refused
                 2 fetch and hash   every item's bytes, concurrently, under the media policy (images:
                                    one request-wide byte budget; a video: its own cap); mm_hash over
                                    kind + bytes + that kind's options (a data URL seen before: its
                                    remembered mm_hash, decoded only if processed)
                 3 render           the family's chat template (cached by messages, app/inputs/prompts.py)
    resolve()    4 cache lookups    per item: processor cache, then the IPC mirror (pins a hit)
                 5 process misses   decode + the family's processor, concurrently, in the
                                    preprocessing pool's processes (a video: header, sampling, only the
                                    sampled frames decoded; app/inputs/preprocess/video_item.py)
                 6 tokenize         the prompt's ids (cached by text), each media token written out as
                                    the item's layout says -> ids + each item's span (app/inputs/prompts.py)
    submit()     7 submit           EngineClient.send_request, ONE synchronous step: mirror decisions
                                    -> AddRequest + frames -> socket -> unpin (docs/architecture.md,
                                    "IPC mirror")

With ``--mm-processor-cache-type shm`` stage 4 looks in this API's shared-memory ring instead of the
processor cache and the mirror (a hit holds a reference), stage 5 writes a processed miss into the ring,
and stage 7 sends a ring item as its reference (docs/architecture.md, "Shared-memory object store").

A processor-cache hit and an IPC hit both know the item's layout (placeholders, grid, a video's frame
times) without running the processor. ``resolve`` and ``submit`` may run again for the same request (the
mirror changed in between, the engine's safety net asked for payloads, or the request has several
choices).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from app.errors import InvalidRequestError, MMServeError
from app.inputs.engine_client import EngineClient, EngineGone, OutgoingItem
from app.inputs.known_data_urls import KnownDataUrls
from app.inputs.media_ids import (
    UNSCOPED,
    CacheScope,
    LocalMediaIds,
    MediaBinding,
    MediaIds,
    binding_key,
    media_uuid_unknown,
)
from app.inputs.messages import MediaPart, normalise_messages
from app.inputs.preprocess.pool import PreprocessPool
from app.inputs.processor_cache import ProcessorCache
from app.inputs.prompts import OFF_LOOP_PROMPT_CHARS, PromptBuilder
from app.inputs.shm_store import ShmEntry
from app.media.fetch import MediaFetcher, RequestImageBudget
from app.media.kinds import MediaKind
from app.media.urls import decode_data_url, is_data_url, load_media_bytes
from app.metrics import ApiMetrics
from app.settings import Settings
from wire.hashing import mm_hash
from wire.protocol import Constraint, MMFeature, RequestOutput, SamplingParams
from workers.families.processing import FamilyProcessor, ItemLayout, ProcessedItem, TemplateOptions

T = TypeVar("T")


@dataclass
class MediaInput:
    """One image or video of a request, from its URL to its placement."""

    kind: MediaKind
    mm_hash: str
    # The original encoded bytes; decoded only if the processor must run. None for a data URL this
    # process hashed before (KnownDataUrls): its base64 is decoded only if the item must be processed.
    data: bytes | None
    url: str
    param: str  # where the item sits in the request, for error messages
    options: dict[str, Any]  # its kind's validated mm_processor_kwargs (part of its mm_hash)
    item: ProcessedItem | None = None  # processed tensors, when this API process has them
    layout: ItemLayout | None = None  # known once looked up or processed
    uuid_only: bool = False  # sent as a media id alone: served from a cache or refused, never processed
    named_by: str | None = None  # that media id, for the 400 when no cache holds its item any more
    bind_uuid: str | None = None  # sent with media and this id: bound once its layout is known
    # a media id's binding layout: what the item needs to be placed when the engine alone still has it
    bound_layout: ItemLayout | None = None
    borrowed: bool = False  # sent as a key only outside the mirror (MMFeature.borrowed)
    pinned: bool = False  # found in the mirror and pinned until the request is sent
    shm: ShmEntry | None = None  # in this API's shm ring, one reference held until the request is sent
    payload_only: bool = False  # the engine found its shm reference stale: send the tensors instead


@dataclass
class PreparedRequest:
    prompt: str
    items: list[MediaInput]
    prompt_token_ids: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # each item's (first, end) token
    scope: CacheScope = UNSCOPED  # its tenant and salt: media ids are bound under them
    ids_given: bool = False  # a prompt without media, tokenized once (app/inputs/raw_prompts.py)
    truncated: bool = False  # its tokens were cut (app/inputs/truncation.py)


async def gather_or_cancel(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """``asyncio.gather``, but the first failure cancels the others (a refused request stops fetching
    its remaining media at once)."""
    tasks = [asyncio.ensure_future(coro) for coro in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class InputProcessor:
    def __init__(
        self,
        settings: Settings,
        family: FamilyProcessor,
        processor_cache: ProcessorCache,
        engine: EngineClient,
        metrics: ApiMetrics,
        media: MediaFetcher,
        pool: PreprocessPool,
        media_ids: MediaIds | None = None,
    ) -> None:
        self.settings = settings
        self.media_ids = media_ids if media_ids is not None else LocalMediaIds(settings.mm_uuid_cache_entries)
        self.pool = pool
        self.family = family
        self.processor_cache = processor_cache
        self.engine = engine
        self.metrics = metrics
        self.media = media
        # mm_hash -> the pool run processing it now: concurrent misses of one item share that run
        self._in_flight: dict[str, asyncio.Future[ProcessedItem]] = {}
        self._known_data_urls = KnownDataUrls()
        self._prompts = PromptBuilder(family)  # chat template and tokenizer, results cached

    def cache_scope(self, tenant: str, cache_salt: str | None) -> CacheScope:
        """A request's cache scope: its tenant and salt, under ``--tenant-cache-isolation``."""
        isolate = self.settings.tenant_cache_isolation
        return CacheScope.of(tenant=tenant, cache_salt=cache_salt, isolate_tenants=isolate)

    # -- stages 1-3 -------------------------------------------------------------------------------

    async def prepare(
        self,
        messages: list[Any],
        mm_processor_kwargs: dict[str, Any],
        scope: CacheScope = UNSCOPED,
        template: TemplateOptions = TemplateOptions(),  # noqa: B008 (an immutable tuple)
    ) -> PreparedRequest:
        rendered, parts = normalise_messages(messages)
        self._check_parts(parts)
        options = self._options(parts, mm_processor_kwargs)
        budget = RequestImageBudget(self.settings.max_request_image_bytes)
        # media ids first: an unknown one is refused before anything is fetched
        items: list[MediaInput | None] = [
            self._named_item(part, options[part.kind], scope) if part.url is None else None for part in parts
        ]
        pending: list[tuple[int, MediaPart, str | None]] = []
        for i, part in enumerate(parts):
            if part.url is None:
                continue
            url_key = self._data_url_key(part, options[part.kind], scope)
            known = self._known_data_urls.get(url_key) if url_key is not None else None
            if known is not None:  # a data URL hashed before: nothing to await
                items[i] = self._known_item(part, options[part.kind], budget, known)
            else:
                pending.append((i, part, url_key))
        if pending:
            fetched = await gather_or_cancel(
                [
                    self._fetch_and_hash(part, options[part.kind], budget, key, scope)
                    for _, part, key in pending
                ]
            )
            for (i, _, _), fetched_item in zip(pending, fetched, strict=True):
                items[i] = fetched_item
        ready = [media for media in items if media is not None]
        assert len(ready) == len(parts)
        for part, media in zip(parts, ready, strict=True):
            if part.uuid is not None and part.url is not None:  # media with its id: (re)bound in resolve
                media.bind_uuid = part.uuid
        prompt = self._prompts.render(rendered, template)
        return PreparedRequest(prompt, ready, scope=scope)

    def _named_item(self, part: MediaPart, options: dict[str, Any], scope: CacheScope) -> MediaInput:
        """A media part left out and named by its uuid: the item its binding names, or a 400 when the
        uuid names nothing here (never bound, another tenant's or salt's, or bound with other options)."""
        assert part.uuid is not None
        binding = self.media_ids.get(binding_key(scope, part.uuid))
        if binding is None or binding.kind != part.kind or dict(binding.options) != options:
            self.metrics.uuid_lookups.labels(result="unknown").inc()
            article = "an" if part.kind == "image" else "a"
            detail = "" if binding is None else f" as {article} {part.kind} with these mm_processor_kwargs"
            raise media_uuid_unknown(part.uuid, part.param, detail)
        self.metrics.mm_items.inc()
        media = MediaInput(
            part.kind, binding.mm_hash, None, "", part.param, options, uuid_only=True, named_by=part.uuid
        )
        media.bound_layout = binding.layout
        return media

    def _check_parts(self, parts: list[MediaPart]) -> None:
        """Per-prompt limits by kind, and videos only for a family that takes them."""
        for kind in MediaKind:
            count = sum(1 for part in parts if part.kind is kind)
            if kind is MediaKind.VIDEO and count and not self.family.supports_video:
                first = next(part for part in parts if part.kind is kind)
                raise InvalidRequestError(
                    f"This model ({self.settings.model_name}) takes text and images; it cannot take "
                    "video_url parts.",
                    param=first.param.removesuffix(".video_url.url"),
                    code="unsupported_modality",
                )
            limit = self.settings.limit_mm_per_prompt.get(kind, 0)
            if count > limit:
                raise InvalidRequestError(
                    f"At most {limit} {kind}s are allowed per prompt (--limit-mm-per-prompt {kind}={limit}); "
                    f"this request has {count}.",
                    param="messages",
                    code="mm_limit_exceeded",
                )

    def _options(
        self, parts: list[MediaPart], mm_processor_kwargs: dict[str, Any]
    ) -> dict[MediaKind, dict[str, Any]]:
        """Each kind's validated options (refused before anything is fetched)."""
        # hash_options({}) is {} for every family; its validation costs more than the rest of a hit
        options: dict[MediaKind, dict[str, Any]] = {MediaKind.IMAGE: {}, MediaKind.VIDEO: {}}
        if mm_processor_kwargs:
            options[MediaKind.IMAGE] = self.family.hash_options(mm_processor_kwargs)
        if self.family.supports_video and any(part.kind is MediaKind.VIDEO for part in parts):
            options[MediaKind.VIDEO] = self.family.hash_video_options(mm_processor_kwargs)
        return options

    def _data_url_key(self, part: MediaPart, options: dict[str, Any], scope: CacheScope) -> str | None:
        """The ``KnownDataUrls`` key of a data URL; None for any other URL."""
        if part.url is None or not is_data_url(part.url):
            return None
        return KnownDataUrls.key(
            model_id=self.family.model_id, modality=part.kind, url=part.url, options=options, salt=scope.salt
        )

    def _known_item(
        self,
        part: MediaPart,
        options: dict[str, Any],
        budget: RequestImageBudget,
        known: tuple[str, int] | None,
    ) -> MediaInput:
        """A data URL this process decoded and hashed before: its mm_hash, its bytes decoded only if
        its item must be processed."""
        assert known is not None
        digest, num_bytes = known
        if part.kind is MediaKind.IMAGE:
            budget.add(num_bytes)
        self.metrics.fetch_seconds.observe(0.0)
        self.metrics.mm_items.inc()
        assert part.url is not None
        return MediaInput(part.kind, digest, None, part.url, part.param, options)

    async def _fetch_and_hash(
        self,
        part: MediaPart,
        options: dict[str, Any],
        budget: RequestImageBudget,
        url_key: str | None,
        scope: CacheScope,
    ) -> MediaInput:
        assert part.url is not None
        start = time.perf_counter()
        data = await load_media_bytes(
            part.url,
            kind=part.kind,
            fetcher=self.media,
            param=part.param,
            budget=budget if part.kind is MediaKind.IMAGE else None,  # a video has its own cap
        )
        self.metrics.fetch_seconds.observe(time.perf_counter() - start)
        self.metrics.mm_items.inc()
        digest = mm_hash(
            model_id=self.family.model_id, modality=part.kind, data=data, options=options, salt=scope.salt
        )
        if url_key is not None:
            self._known_data_urls.put(url_key, digest, len(data))
        return MediaInput(part.kind, digest, data, part.url, part.param, options)

    # -- stages 4-6 -------------------------------------------------------------------------------

    async def resolve(self, prepared: PreparedRequest) -> None:
        """Makes every item's layout known and its tensors available unless the engine holds it."""
        if prepared.ids_given:
            return
        for media in prepared.items:
            media.borrowed = False  # decided again: resolve may run again for the request
        misses = [item for item in prepared.items if not self._lookup(item)]
        for media in misses:
            if media.uuid_only:  # no bytes to process: another API process's partition, or a 400
                self._borrow_or_refuse(media)
        await asyncio.gather(*(self._process(item) for item in misses if not item.uuid_only))
        layouts = [item.layout for item in prepared.items]
        assert all(layout is not None for layout in layouts)
        if len(prepared.prompt) > OFF_LOOP_PROMPT_CHARS:  # seconds for megabytes: not on the event loop
            tokenized = await asyncio.to_thread(self._prompts.tokenize, prepared.prompt, layouts)  # type: ignore[arg-type]
        else:
            tokenized = self._prompts.tokenize(prepared.prompt, layouts)  # type: ignore[arg-type]
        prepared.prompt_token_ids, prepared.spans = tokenized
        for media in prepared.items:
            if media.bind_uuid is not None:
                binding = MediaBinding(media.mm_hash, media.kind, media.options, media.layout)
                self.media_ids.bind(binding_key(prepared.scope, media.bind_uuid), binding)
                self.metrics.uuid_bindings.set(len(self.media_ids))

    def _borrow_or_refuse(self, media: MediaInput) -> None:
        """A media id's item that no cache of this API process holds: the engine may still have it (in
        another API process's receiver-cache partition, or its encoder output in the encoder cache), so
        it is sent as a borrowed key, which the engine serves or reports missing (``send_payloads``: a
        400). Without its layout (how many placeholders, which grid) it cannot be placed: a 400 now."""
        if media.bound_layout is None:
            raise self._uuid_evicted(media)
        media.borrowed, media.layout = True, media.bound_layout

    def _uuid_evicted(self, media: MediaInput) -> InvalidRequestError:
        """The 400 for a media id whose item no cache holds any more, counted."""
        self.metrics.uuid_lookups.labels(result="unknown").inc()
        return media_uuid_unknown(media.named_by, media.param, " any more: no cache holds its item")

    def count_uuid_hits(self, prepared: PreparedRequest) -> None:
        """Called once the engine accepted the request: each media id sent alone was served."""
        for media in prepared.items:
            if media.uuid_only:
                self.metrics.uuid_lookups.labels(result="hit").inc()

    def _lookup(self, media: MediaInput) -> bool:
        """Processor cache, then the mirror (a hit is pinned); with shm, the ring (a hit holds a
        reference). False when the processor must run."""
        shm = self.engine.shm
        if shm is not None:
            if media.shm is None and media.item is None and not media.payload_only:
                self.metrics.processor_cache_queries.inc()
                self.metrics.ipc_cache_queries.inc()
                media.shm = shm.lookup(media.mm_hash)
                if media.shm is not None:
                    self.metrics.processor_cache_hits.inc()
                    self.metrics.ipc_cache_hits.inc()
                    self.metrics.ipc_saved_bytes.inc(media.shm.ref.size)
            if media.shm is not None:
                media.layout = media.shm.layout
            return media.shm is not None or media.item is not None
        if media.item is None:
            self.metrics.processor_cache_queries.inc()
            media.item = self.processor_cache.get(media.mm_hash)
            if media.item is not None:
                self.metrics.processor_cache_hits.inc()
        if not media.pinned:
            self.metrics.ipc_cache_queries.inc()
            entry = self.engine.lookup_and_pin(media.mm_hash)
            if entry is not None:
                self.metrics.ipc_cache_hits.inc()
                self.metrics.ipc_saved_bytes.inc(entry.num_bytes)
                media.pinned, media.layout = True, entry.layout
        if media.item is not None:
            media.layout = media.item.layout
        return media.item is not None or media.pinned

    async def _process(self, media: MediaInput) -> None:
        """Decodes and processes one item in the preprocessing pool. Only cache misses get here: a hit
        needs no pixels at all (the hash is over the encoded bytes, and bytes that hit once decoded
        fine). The result goes into the processor cache, or with shm into the ring."""
        item = await self._run_once(media)
        media.layout = item.layout
        shm = self.engine.shm
        if shm is None:
            self.processor_cache.put(media.mm_hash, item)
            media.item = item
            return
        written = media.mm_hash not in shm
        media.shm = None if media.payload_only else shm.put(media.mm_hash, item)
        if media.shm is None:  # the normal path: tensors through the engine, not stored
            self.metrics.shm_fallbacks.inc()
            media.item = item
        elif written:
            self.metrics.shm_bytes.inc(media.shm.ref.size)

    async def _run_once(self, media: MediaInput) -> ProcessedItem:
        """The pool's result for the item; a request whose item is being processed for another one
        waits for that run instead of starting a second (the hash covers bytes and options)."""
        run = self._in_flight.get(media.mm_hash)
        shared = run is not None
        if run is None:
            if media.data is None:  # a known data URL (KnownDataUrls): it decoded before, so it does again
                max_bytes = self.media.policy.max_bytes(media.kind)
                media.data = decode_data_url(
                    media.url, kind=media.kind, max_bytes=max_bytes, param=media.param
                )
            process = self.pool.process(media.data, media.options, media.param, media.kind)
            run = asyncio.ensure_future(self._timed(process))
            self._in_flight[media.mm_hash] = run
            run.add_done_callback(lambda done: self._forget_run(media.mm_hash, done))
        try:
            return await asyncio.shield(run)  # one waiter going away does not cancel the others' run
        except MMServeError as exc:
            if not shared:
                raise
            raise type(exc)(exc.message, param=media.param, code=exc.code) from exc  # this request's param

    async def _timed(self, run: Coroutine[Any, Any, ProcessedItem]) -> ProcessedItem:
        start = time.perf_counter()
        item = await run
        self.metrics.processor_seconds.observe(time.perf_counter() - start)  # once per processor run
        return item

    def _forget_run(self, mm_hash: str, run: asyncio.Future[ProcessedItem]) -> None:
        if self._in_flight.get(mm_hash) is run:
            del self._in_flight[mm_hash]
        if not run.cancelled():
            run.exception()  # retrieved, even when every waiter went away

    def release_pins(self, prepared: PreparedRequest) -> None:
        """Gives back what the request's preparation held and did not send (mirror pins, shm refs)."""
        for media in prepared.items:
            if media.pinned:
                self.engine.unpin(media.mm_hash)
                media.pinned = False
            if media.shm is not None and self.engine.shm is not None:
                self.engine.shm.release(media.shm)
                media.shm = None

    def send_payloads(self, prepared: PreparedRequest, mm_hashes: list[str]) -> None:
        """The engine found these items' shm references stale (``EngineClient.forget`` dropped them):
        send those items' tensors with the request from now on. A media id sent alone has none: 400."""
        for media in prepared.items:
            if media.mm_hash in mm_hashes:
                if media.borrowed:
                    raise self._uuid_evicted(media)
                media.payload_only = True

    # -- stage 7 ----------------------------------------------------------------------------------

    def submit(
        self,
        prepared: PreparedRequest,
        req_id: str,
        sampling: SamplingParams,
        constraint: Constraint | None = None,
        later_choice: bool = False,
        priority: int = 0,
    ) -> asyncio.Queue[RequestOutput | EngineGone] | None:
        """Hands the request to ``EngineClient.send_request``, which decides what crosses the pipe and
        sends it in one synchronous step (no ``await``), and releases the mirror pins. ``later_choice``:
        a choice after the first of an ``n > 1`` request (``AddRequest.later_choice``); ``priority``:
        its place under ``--scheduling-policy priority``.

        Returns None, sending nothing, when an item found in the mirror during ``resolve`` has since
        been dropped from it (engine restart, reset): the caller resolves again and retries."""
        outgoing = []
        for media, (first, end) in zip(prepared.items, prepared.spans, strict=True):
            layout = media.layout
            assert layout is not None
            # An item in the shm ring crosses as its reference, outside the mirror (no room with shm).
            placement = MMFeature(
                media.mm_hash,
                first,
                layout.num_tokens,
                modality=media.kind.value,
                shm=media.shm.ref if media.shm is not None else None,
                grid_thw=layout.grid_thw,
                num_span_tokens=end - first if end - first != layout.num_tokens else 0,
                second_per_grid_t=layout.second_per_grid_t,
                borrowed=media.borrowed,
            )
            outgoing.append(OutgoingItem(placement, layout, media.item, media.pinned))
        try:
            ids, salt = prepared.prompt_token_ids, prepared.scope.salt
            queue = self.engine.send_request(
                req_id,
                ids,
                sampling,
                outgoing,
                cache_salt=salt,
                constraint=constraint,
                later_choice=later_choice,
                priority=priority,
            )
        finally:
            for media in prepared.items:  # send_request released the pins, sent or not
                media.pinned = False
        if queue is None:
            self.release_pins(prepared)  # the shm references
            return None
        for media in prepared.items:  # the engine client holds the shm references from now on
            media.shm = None
        return queue
