"""From an OpenAI chat request to an ``AddRequest`` on the wire, as one straight sequence of stages; the
model's family (``workers.families``) supplies every model-specific step::

    prepare()    1 parse            messages -> chat-template messages + image URLs; per-prompt limit,
                                    mm_processor_kwargs validated (before anything is fetched)
                 2 fetch and hash   every image's bytes, concurrently, under the media policy and one
                                    request-wide byte budget; mm_hash over bytes + options (a data URL
                                    seen before: its remembered mm_hash, decoded only if processed)
                 3 render           the family's chat template (cached by messages, app/inputs/prompts.py)
    resolve()    4 cache lookups    per image: processor cache, then the IPC mirror (pins a hit)
                 5 process misses   decode + the family's HF processor, concurrently, in the
                                    preprocessing pool's processes
                 6 tokenize         the prompt's ids (cached by text), each image token repeated to
                                    its placeholder count -> ids + offsets (app/inputs/prompts.py)
    submit()     7 submit           EngineClient.send_request, ONE synchronous step: mirror decisions
                                    -> AddRequest + frames -> socket -> unpin (docs/architecture.md,
                                    "IPC mirror")

With ``--mm-processor-cache-type shm`` stage 4 looks in this API's shared-memory ring instead of the
processor cache and the mirror (a hit holds a reference), stage 5 writes a processed miss into the ring,
and stage 7 sends a ring item as its reference (docs/architecture.md, "Shared-memory object store").

A processor-cache hit and an IPC hit both know the item's placeholder count and grid without running the
processor. ``resolve`` and ``submit`` may run again for the same request (the mirror changed in between,
or the engine's safety net asked for payloads).
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
from app.inputs.preprocess.pool import PreprocessPool
from app.inputs.processor_cache import ProcessorCache
from app.inputs.prompts import PromptBuilder
from app.inputs.shm_store import ShmEntry
from app.media.fetch import MediaFetcher, RequestImageBudget
from app.media.images import decode_data_url, is_data_url, load_image_bytes
from app.metrics import ApiMetrics
from app.settings import Settings
from wire.hashing import mm_hash
from wire.protocol import MMFeature, RequestOutput, SamplingParams
from workers.families.processing import FamilyProcessor, ProcessedItem

T = TypeVar("T")


@dataclass
class ImageInput:
    mm_hash: str
    # The original encoded bytes; decoded only if the HF processor must run. None for a data URL this
    # process hashed before (KnownDataUrls): its base64 is decoded only if the item must be processed.
    data: bytes | None
    url: str
    param: str  # where the image sits in the request, for error messages
    item: ProcessedItem | None = None  # processed tensors, when this API process has them
    num_tokens: int | None = None
    grid_thw: tuple[int, ...] = ()
    pinned: bool = False  # found in the mirror and pinned until the request is sent
    shm: ShmEntry | None = None  # in this API's shm ring, one reference held until the request is sent
    payload_only: bool = False  # the engine found its shm reference stale: send the tensors instead


@dataclass
class PreparedRequest:
    prompt: str
    images: list[ImageInput]
    options: dict[str, Any]  # validated mm_processor_kwargs (part of every mm_hash)
    prompt_token_ids: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)


def normalise_messages(messages: list[Any]) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """OpenAI messages → chat-template messages with ``{"type": "image"}`` parts, plus the image URLs
    in prompt order with their request locations."""
    rendered: list[dict[str, Any]] = []
    urls: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        content = message.content
        if content is None or isinstance(content, str):
            rendered.append({"role": message.role, "content": content or ""})
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            if part.type == "text":
                parts.append({"type": "text", "text": part.text})
            else:
                parts.append({"type": "image"})
                urls.append((part.image_url.url, f"messages[{i}].content[{j}].image_url.url"))
        rendered.append({"role": message.role, "content": parts})
    return rendered, urls


async def gather_or_cancel(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """``asyncio.gather``, but the first failure cancels the others (a refused request stops fetching
    its remaining images at once)."""
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
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.family = family
        self.processor_cache = processor_cache
        self.engine = engine
        self.metrics = metrics
        self.media = media
        # mm_hash -> the pool run processing it now: concurrent misses of one image share that run
        self._in_flight: dict[str, asyncio.Future[ProcessedItem]] = {}
        self._known_data_urls = KnownDataUrls()
        self._prompts = PromptBuilder(family)  # chat template and tokenizer, results cached

    # -- stages 1-3 -------------------------------------------------------------------------------

    async def prepare(self, messages: list[Any], mm_processor_kwargs: dict[str, Any]) -> PreparedRequest:
        rendered, urls = normalise_messages(messages)
        self._check_limit(len(urls))
        # hash_options({}) is {} for every family; its validation costs more than the rest of a hit
        options = self.family.hash_options(mm_processor_kwargs) if mm_processor_kwargs else {}
        budget = RequestImageBudget(self.settings.max_request_image_bytes)
        url_keys = [self._data_url_key(url, options) for url, _ in urls]
        known = [self._known_data_urls.get(key) if key is not None else None for key in url_keys]
        if all(k is not None for k in known):  # only data URLs hashed before: nothing to await
            images = [
                self._known_image(url, param, budget, k) for (url, param), k in zip(urls, known, strict=True)
            ]
        else:
            images = await gather_or_cancel(
                [
                    self._fetch_and_hash(url, param, options, budget, key, k)
                    for (url, param), key, k in zip(urls, url_keys, known, strict=True)
                ]
            )
        prompt = self._prompts.render(rendered)
        return PreparedRequest(prompt, images, options)

    def _check_limit(self, num_images: int) -> None:
        limit = self.settings.limit_mm_per_prompt.get("image", 0)
        if num_images > limit:
            raise InvalidRequestError(
                f"At most {limit} images are allowed per prompt (--limit-mm-per-prompt image={limit}); "
                f"this request has {num_images}.",
                param="messages",
                code="mm_limit_exceeded",
            )

    def _data_url_key(self, url: str, options: dict[str, Any]) -> str | None:
        """The ``KnownDataUrls`` key of a data URL; None for any other URL."""
        if not is_data_url(url):
            return None
        return KnownDataUrls.key(model_id=self.family.model_id, modality="image", url=url, options=options)

    def _known_image(
        self, url: str, param: str, budget: RequestImageBudget, known: tuple[str, int] | None
    ) -> ImageInput:
        """A data URL this process decoded and hashed before: its mm_hash, its bytes decoded only if
        its item must be processed."""
        assert known is not None
        digest, num_bytes = known
        budget.add(num_bytes)
        self.metrics.fetch_seconds.observe(0.0)
        self.metrics.mm_items.inc()
        return ImageInput(mm_hash=digest, data=None, url=url, param=param)

    async def _fetch_and_hash(
        self,
        url: str,
        param: str,
        options: dict[str, Any],
        budget: RequestImageBudget,
        url_key: str | None,
        known: tuple[str, int] | None,
    ) -> ImageInput:
        if known is not None:
            return self._known_image(url, param, budget, known)
        start = time.perf_counter()
        data = await load_image_bytes(url, fetcher=self.media, param=param, budget=budget)
        self.metrics.fetch_seconds.observe(time.perf_counter() - start)
        self.metrics.mm_items.inc()
        digest = mm_hash(model_id=self.family.model_id, modality="image", data=data, options=options)
        if url_key is not None:
            self._known_data_urls.put(url_key, digest, len(data))
        return ImageInput(mm_hash=digest, data=data, url=url, param=param)

    # -- stages 4-6 -------------------------------------------------------------------------------

    async def resolve(self, prepared: PreparedRequest) -> None:
        """Makes every image's placement known and its tensors available unless the engine holds it."""
        misses = [image for image in prepared.images if not self._lookup(image)]
        await asyncio.gather(*(self._process(image, prepared.options) for image in misses))
        prepared.prompt_token_ids, prepared.offsets = self._prompts.tokenize(
            prepared.prompt, [image.num_tokens or 0 for image in prepared.images]
        )

    def _lookup(self, image: ImageInput) -> bool:
        """Processor cache, then the mirror (a hit is pinned); with shm, the ring (a hit holds a
        reference). False when the processor must run."""
        shm = self.engine.shm
        if shm is not None:
            if image.shm is None and image.item is None and not image.payload_only:
                self.metrics.processor_cache_queries.inc()
                self.metrics.ipc_cache_queries.inc()
                image.shm = shm.lookup(image.mm_hash)
                if image.shm is not None:
                    self.metrics.processor_cache_hits.inc()
                    self.metrics.ipc_cache_hits.inc()
            if image.shm is not None:
                image.num_tokens, image.grid_thw = image.shm.num_tokens, image.shm.grid_thw
            return image.shm is not None or image.item is not None
        if image.item is None:
            self.metrics.processor_cache_queries.inc()
            image.item = self.processor_cache.get(image.mm_hash)
            if image.item is not None:
                self.metrics.processor_cache_hits.inc()
        if not image.pinned:
            self.metrics.ipc_cache_queries.inc()
            entry = self.engine.lookup_and_pin(image.mm_hash)
            if entry is not None:
                self.metrics.ipc_cache_hits.inc()
                image.pinned, image.num_tokens, image.grid_thw = True, entry.num_tokens, entry.grid_thw
        if image.item is not None:
            image.num_tokens, image.grid_thw = image.item.num_tokens, image.item.grid_thw
        return image.item is not None or image.pinned

    async def _process(self, image: ImageInput, options: dict[str, Any]) -> None:
        """Decodes and processes one image in the preprocessing pool. Only cache misses get here: a hit
        needs no pixels at all (the hash is over the encoded bytes, and bytes that hit once decoded
        fine). The result goes into the processor cache, or with shm into the ring."""
        item = await self._run_once(image, options)
        image.num_tokens, image.grid_thw = item.num_tokens, item.grid_thw
        shm = self.engine.shm
        if shm is None:
            self.processor_cache.put(image.mm_hash, item)
            image.item = item
            return
        written = image.mm_hash not in shm
        image.shm = None if image.payload_only else shm.put(image.mm_hash, item)
        if image.shm is None:  # the normal path: tensors through the engine, not stored
            self.metrics.shm_fallbacks.inc()
            image.item = item
        elif written:
            self.metrics.shm_bytes.inc(image.shm.ref.size)

    async def _run_once(self, image: ImageInput, options: dict[str, Any]) -> ProcessedItem:
        """The pool's result for the image; a request whose image is being processed for another one
        waits for that run instead of starting a second (the hash covers bytes and options)."""
        run = self._in_flight.get(image.mm_hash)
        shared = run is not None
        if run is None:
            if image.data is None:  # a known data URL (KnownDataUrls): it decoded before, so it does again
                max_bytes = self.media.policy.max_image_bytes
                image.data = decode_data_url(image.url, max_bytes=max_bytes, param=image.param)
            run = asyncio.ensure_future(self._timed(self.pool.process(image.data, options, image.param)))
            self._in_flight[image.mm_hash] = run
            run.add_done_callback(lambda done: self._forget_run(image.mm_hash, done))
        try:
            return await asyncio.shield(run)  # one waiter going away does not cancel the others' run
        except MMServeError as exc:
            if not shared:
                raise
            raise type(exc)(exc.message, param=image.param, code=exc.code) from exc  # this request's param

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
        for image in prepared.images:
            if image.pinned:
                self.engine.unpin(image.mm_hash)
                image.pinned = False
            if image.shm is not None and self.engine.shm is not None:
                self.engine.shm.release(image.shm)
                image.shm = None

    def send_payloads(self, prepared: PreparedRequest, mm_hashes: list[str]) -> None:
        """The engine found these items' shm references stale (``EngineClient.forget`` dropped them):
        send those images' tensors with the request from now on."""
        for image in prepared.images:
            if image.mm_hash in mm_hashes:
                image.payload_only = True

    # -- stage 7 ----------------------------------------------------------------------------------

    def submit(
        self, prepared: PreparedRequest, req_id: str, sampling: SamplingParams
    ) -> asyncio.Queue[RequestOutput | EngineGone] | None:
        """Hands the request to ``EngineClient.send_request``, which decides what crosses the pipe and
        sends it in one synchronous step (no ``await``), and releases the mirror pins.

        Returns None, sending nothing, when an image found in the mirror during ``resolve`` has since
        been dropped from it (engine restart, reset): the caller resolves again and retries."""
        items = []
        for image, offset in zip(prepared.images, prepared.offsets, strict=True):
            assert image.num_tokens is not None
            # An item in the shm ring crosses as its reference, outside the mirror (no room with shm).
            shm = image.shm.ref if image.shm is not None else None
            placement = MMFeature(image.mm_hash, offset, image.num_tokens, shm=shm, grid_thw=image.grid_thw)
            items.append(OutgoingItem(placement, image.item, image.pinned))
        try:
            queue = self.engine.send_request(req_id, prepared.prompt_token_ids, sampling, items)
        finally:
            for image in prepared.images:  # send_request released the pins, sent or not
                image.pinned = False
        if queue is None:
            self.release_pins(prepared)  # the shm references
            return None
        for image in prepared.images:  # the engine client holds the shm references from now on
            image.shm = None
        return queue
