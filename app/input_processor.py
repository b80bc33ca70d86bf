"""From an OpenAI chat request to an ``AddRequest`` on the wire, as one straight sequence of stages; the
model's family (``workers.families``) supplies every model-specific step::

    prepare()    1 parse            messages -> chat-template messages + image URLs; per-prompt limit,
                                    mm_processor_kwargs validated (before anything is fetched)
                 2 fetch and hash   every image's bytes, concurrently, under the media policy and one
                                    request-wide byte budget; mm_hash over bytes + options
                 3 render           the family's chat template
    resolve()    4 cache lookups    per image: processor cache, then the IPC mirror (pins a hit)
                 5 process misses   decode + the family's HF processor, concurrently, in the
                                    preprocessing pool's processes
                 6 tokenize         expand each image to its placeholders -> ids + offsets
    submit()     7 submit           ONE synchronous step: mirror.record_request -> AddRequest +
                                    frames -> socket -> unpin (docs/architecture.md, "IPC mirror")

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

import msgspec

from app.engine_client import EngineClient, EngineGone
from app.errors import InvalidRequestError, MMServeError
from app.hashing import mm_hash
from app.ipc_mirror import MirrorDecision, MirrorItem
from app.media import load_image_bytes
from app.media_fetch import MediaFetcher, RequestImageBudget
from app.metrics import ApiMetrics
from app.preprocess_pool import PreprocessPool
from app.processor_cache import ProcessorCache
from app.settings import Settings
from app.shm_store import ShmEntry
from engine.protocol import AddRequest, MMFeature, RequestOutput, SamplingParams, TensorRef
from workers.families.processing import FamilyProcessor, ProcessedItem

T = TypeVar("T")


@dataclass
class ImageInput:
    mm_hash: str
    data: bytes  # the original encoded bytes; decoded only if the HF processor must run
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


def tensor_frames(item: ProcessedItem, first_frame: int) -> tuple[dict[str, TensorRef], list[memoryview]]:
    """Zero-copy views of an item's tensors, numbered from ``first_frame``."""
    refs: dict[str, TensorRef] = {}
    frames: list[memoryview] = []
    for name, tensor in item.tensors.items():
        array = tensor.contiguous().numpy()
        refs[name] = TensorRef(str(array.dtype), tuple(array.shape), first_frame + len(frames))
        frames.append(memoryview(array).cast("B"))
    return refs, frames


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

    # -- stages 1-3 -------------------------------------------------------------------------------

    async def prepare(self, messages: list[Any], mm_processor_kwargs: dict[str, Any]) -> PreparedRequest:
        rendered, urls = normalise_messages(messages)
        self._check_limit(len(urls))
        options = self.family.hash_options(mm_processor_kwargs)
        budget = RequestImageBudget(self.settings.max_request_image_bytes)
        images = await gather_or_cancel(
            [self._fetch_and_hash(url, param, options, budget) for url, param in urls]
        )
        prompt = self.family.render_prompt(rendered)
        return PreparedRequest(prompt, list(images), options)

    def _check_limit(self, num_images: int) -> None:
        limit = self.settings.limit_mm_per_prompt.get("image", 0)
        if num_images > limit:
            raise InvalidRequestError(
                f"At most {limit} images are allowed per prompt (--limit-mm-per-prompt image={limit}); "
                f"this request has {num_images}.",
                param="messages",
                code="mm_limit_exceeded",
            )

    async def _fetch_and_hash(
        self, url: str, param: str, options: dict[str, Any], budget: RequestImageBudget
    ) -> ImageInput:
        start = time.perf_counter()
        data = await load_image_bytes(url, fetcher=self.media, param=param, budget=budget)
        self.metrics.fetch_seconds.observe(time.perf_counter() - start)
        self.metrics.mm_items.inc()
        digest = mm_hash(model_id=self.family.model_id, modality="image", data=data, options=options)
        return ImageInput(mm_hash=digest, data=data, param=param)

    # -- stages 4-6 -------------------------------------------------------------------------------

    async def resolve(self, prepared: PreparedRequest) -> None:
        """Makes every image's placement known and its tensors available unless the engine holds it."""
        misses = [image for image in prepared.images if not self._lookup(image)]
        await asyncio.gather(*(self._process(image, prepared.options) for image in misses))
        prepared.prompt_token_ids, prepared.offsets = self.family.tokenize(
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
            entry = self.engine.mirror.lookup_and_pin(image.mm_hash)
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
                self.engine.mirror.unpin(image.mm_hash)
                image.pinned = False
            if image.shm is not None and self.engine.shm is not None:
                self.engine.shm.release(image.shm)
                image.shm = None

    def send_payloads(self, prepared: PreparedRequest, mm_hashes: list[str]) -> None:
        """The engine found these items' shm references stale: forget them, and send those images'
        tensors with the request from now on."""
        if self.engine.shm is not None:
            self.engine.shm.invalidate(mm_hashes)
        for image in prepared.images:
            if image.mm_hash in mm_hashes:
                image.payload_only = True

    # -- stage 7 ----------------------------------------------------------------------------------

    def submit(
        self, prepared: PreparedRequest, req_id: str, sampling: SamplingParams, arrival_time: float
    ) -> asyncio.Queue[RequestOutput | EngineGone] | None:
        """Decides what crosses the pipe and sends it, in one synchronous step (no ``await``).

        Returns None, sending nothing, when an image found in the mirror during ``resolve`` has since
        been dropped from it (engine restart, reset): the caller resolves again and retries."""
        mirror = self.engine.mirror
        if any(i.item is None and i.shm is None and i.mm_hash not in mirror for i in prepared.images):
            self.release_pins(prepared)
            return None
        # Items in the shm ring cross as a reference, outside the mirror (which, with shm, has no room).
        by_mirror = [i for i in prepared.images if i.shm is None]
        mirror_decisions, evicted = mirror.record_request(
            [
                MirrorItem(i.mm_hash, i.item.num_bytes if i.item else 0, i.num_tokens or 0, i.grid_thw)
                for i in by_mirror
            ]
        )
        decisions = iter(mirror_decisions)
        features: list[MMFeature] = []
        frames: list[memoryview] = []
        payload_bytes = 0
        for image, offset in zip(prepared.images, prepared.offsets, strict=True):
            assert image.num_tokens is not None
            payload_bytes += len(image.mm_hash)
            placement = MMFeature(image.mm_hash, offset, image.num_tokens, grid_thw=image.grid_thw)
            if image.shm is not None:
                features.append(msgspec.structs.replace(placement, shm=image.shm.ref))
                continue
            decision = next(decisions)
            if decision is MirrorDecision.HIT:
                features.append(placement)
                continue
            assert image.item is not None, "a mirror miss always has its tensors"
            refs, item_frames = tensor_frames(image.item, first_frame=1 + len(frames))
            frames.extend(item_frames)
            payload_bytes += sum(f.nbytes for f in item_frames)
            store = decision is MirrorDecision.STORE
            features.append(msgspec.structs.replace(placement, tensors=refs, store=store))
        msg = AddRequest(
            req_id=req_id,
            prompt_token_ids=prepared.prompt_token_ids,
            sampling=sampling,
            mm_features=features,
            evicted_mm_hashes=evicted,
            arrival_time=arrival_time,
        )
        queue = self.engine.add_request(msg, frames)
        for image in prepared.images:  # the engine client holds the shm references from now on
            image.shm = None
        self.release_pins(prepared)
        self.metrics.ipc_payload_bytes.inc(payload_bytes)
        return queue
