"""From an OpenAI chat request to an ``AddRequest`` on the wire, as one straight sequence of stages; the
model's family (``workers.families``) supplies every model-specific step::

    prepare()    1 parse            messages -> chat-template messages + image URLs; per-prompt limit,
                                    mm_processor_kwargs validated (before anything is fetched)
                 2 fetch and hash   every image's bytes, concurrently, under the media policy and one
                                    request-wide byte budget; mm_hash over bytes + options
                 3 render           the family's chat template
    resolve()    4 cache lookups    per image: processor cache, then the IPC mirror (pins a hit)
                 5 process misses   decode + the family's HF processor, concurrently, off the loop
                 6 tokenize         expand each image to its placeholders -> ids + offsets
    submit()     7 submit           ONE synchronous step: mirror.record_request -> AddRequest +
                                    frames -> socket -> unpin (docs/architecture.md, "IPC mirror")

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
from app.errors import InvalidRequestError
from app.hashing import mm_hash
from app.ipc_mirror import MirrorDecision, MirrorItem
from app.media import decode_image, load_image_bytes
from app.media_fetch import MediaFetcher, RequestImageBudget
from app.metrics import ApiMetrics
from app.processor_cache import ProcessorCache
from app.settings import Settings
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
    ) -> None:
        self.settings = settings
        self.family = family
        self.processor_cache = processor_cache
        self.engine = engine
        self.metrics = metrics
        self.media = media

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
        processed = await asyncio.gather(*(self._process(image, prepared.options) for image in misses))
        for image, item in zip(misses, processed, strict=True):
            image.item = item
            image.num_tokens, image.grid_thw = item.num_tokens, item.grid_thw
        prepared.prompt_token_ids, prepared.offsets = self.family.tokenize(
            prepared.prompt, [image.num_tokens or 0 for image in prepared.images]
        )

    def _lookup(self, image: ImageInput) -> bool:
        """Processor cache, then the mirror (a hit is pinned). False when the processor must run."""
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

    async def _process(self, image: ImageInput, options: dict[str, Any]) -> ProcessedItem:
        """Decodes and processes one image in a thread. Only cache misses get here: a hit needs no pixels
        at all (the hash is over the encoded bytes, and bytes that hit once decoded fine)."""
        start = time.perf_counter()
        item = await asyncio.to_thread(self._decode_and_process, image, options)
        self.metrics.processor_seconds.observe(time.perf_counter() - start)
        self.processor_cache.put(image.mm_hash, item)
        return item

    def _decode_and_process(self, image: ImageInput, options: dict[str, Any]) -> ProcessedItem:
        pixels = decode_image(image.data, param=image.param)
        return self.family.process_image(pixels, options, param=image.param)

    def release_pins(self, prepared: PreparedRequest) -> None:
        for image in prepared.images:
            if image.pinned:
                self.engine.mirror.unpin(image.mm_hash)
                image.pinned = False

    # -- stage 7 ----------------------------------------------------------------------------------

    def submit(
        self, prepared: PreparedRequest, req_id: str, sampling: SamplingParams, arrival_time: float
    ) -> asyncio.Queue[RequestOutput | EngineGone] | None:
        """Decides what crosses the pipe and sends it, in one synchronous step (no ``await``).

        Returns None, sending nothing, when an image found in the mirror during ``resolve`` has since
        been dropped from it (engine restart, reset): the caller resolves again and retries."""
        mirror = self.engine.mirror
        if any(i.item is None and i.mm_hash not in mirror for i in prepared.images):
            self.release_pins(prepared)
            return None
        decisions, evicted = mirror.record_request(
            [
                MirrorItem(i.mm_hash, i.item.num_bytes if i.item else 0, i.num_tokens or 0, i.grid_thw)
                for i in prepared.images
            ]
        )
        features: list[MMFeature] = []
        frames: list[memoryview] = []
        payload_bytes = 0
        for image, offset, decision in zip(prepared.images, prepared.offsets, decisions, strict=True):
            assert image.num_tokens is not None
            payload_bytes += len(image.mm_hash)
            placement = MMFeature(image.mm_hash, offset, image.num_tokens, grid_thw=image.grid_thw)
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
        self.release_pins(prepared)
        self.metrics.ipc_payload_bytes.inc(payload_bytes)
        return queue
