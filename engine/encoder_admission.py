"""Which of a request's multimodal items the next chunk of its prompt may cover in a step, and whether
its items can be had at all: the scheduler's encoder admission (docs/architecture.md, "Engine step").
An item is encoded whole, in the step that first needs it, if it fits the step's encoder
compute budget and the encoder cache's space; one already cached is shared; one the encoder-cache
connector's store holds is loaded instead (no compute budget). Without a vision tower an item neither
cached nor in the store makes the request unservable (``unavailable``: it ends with 503)."""

from __future__ import annotations

from engine.ec_connector import ECConnectorScheduler
from engine.encoder_cache_manager import EncoderCacheManager
from engine.request import MMItem, Request


class EncoderAdmission:
    def __init__(
        self,
        encoder_cache: EncoderCacheManager,
        connector: ECConnectorScheduler | None,
        *,
        can_encode: bool,
        disable_chunked_mm_input: bool,
    ) -> None:
        """``connector``: the encoder-cache connector when its role loads (else None)."""
        self.encoder_cache = encoder_cache
        self.connector = connector
        self.can_encode = can_encode
        self.disable_chunked_mm_input = disable_chunked_mm_input
        self.unavailable: list[Request] = []  # found unservable while the current step is scheduled

    def fit(
        self, request: Request, num_tokens: int, encoder_budget: int, encoder_items: dict[str, MMItem]
    ) -> tuple[int, int]:
        """How many of ``request``'s next tokens can run this step, acquiring encoder-cache entries for
        the items they cover. An item is encoded whole, in the step that first needs it; if it cannot
        be (compute budget or cache space), the chunk stops right before it. With
        ``disable_chunked_mm_input`` a chunk also stops before an image it would cover only in part."""
        start = request.num_computed_tokens + request.num_inflight_tokens
        if not self.can_encode and not self._all_obtainable(request, start, num_tokens):
            self.unavailable.append(request)  # before anything is allocated or loaded for it
            return 0, encoder_budget
        for feature in request.mm_features:
            begin, end = feature.offset, feature.end
            if end <= start or begin >= start + num_tokens:
                continue  # not covered by this chunk
            if self.disable_chunked_mm_input and start <= begin and end > start + num_tokens:
                num_tokens = begin - start
                break
            mm_hash = feature.mm_hash
            if mm_hash in request.encoder_hashes_in_use:
                continue
            first_query = mm_hash not in request.encoder_hashes_queried
            request.encoder_hashes_queried.add(mm_hash)
            if self.encoder_cache.lookup(mm_hash, request.req_id, count_query=first_query):
                request.encoder_hashes_in_use.add(mm_hash)
                continue
            if self._in_store(request, mm_hash):  # loaded, not encoded: no compute budget spent
                if self.encoder_cache.can_allocate(feature.num_tokens):
                    self.encoder_cache.allocate(mm_hash, feature.num_tokens, request.req_id)
                    request.encoder_hashes_in_use.add(mm_hash)
                    assert self.connector is not None
                    self.connector.update_state_after_alloc(mm_hash)
                    if self.can_encode:  # its tensors come along: encoded if the load fails
                        encoder_items[mm_hash] = request.mm_items[mm_hash]
                    continue
            elif feature.num_tokens <= encoder_budget and self.encoder_cache.can_allocate(feature.num_tokens):
                self.encoder_cache.allocate(mm_hash, feature.num_tokens, request.req_id)
                request.encoder_hashes_in_use.add(mm_hash)
                encoder_items[mm_hash] = request.mm_items[mm_hash]
                encoder_budget -= feature.num_tokens
                continue
            num_tokens = max(0, begin - start)
            break
        return num_tokens, encoder_budget

    def _all_obtainable(self, request: Request, start: int, num_tokens: int) -> bool:
        """Without a vision tower: whether every item the chunk covers is cached or in the store."""
        for feature in request.mm_features:
            begin, end = feature.offset, feature.end
            if (
                end <= start
                or begin >= start + num_tokens
                or feature.mm_hash in request.encoder_hashes_in_use
            ):
                continue
            if feature.mm_hash not in self.encoder_cache and not self._in_store(request, feature.mm_hash):
                return False
        return True

    def _in_store(self, request: Request, mm_hash: str) -> bool:
        """Whether the connector's store holds the item; asked once per request, for all of its items
        the encoder cache lacks at that moment (one round trip)."""
        if self.connector is None:
            return False
        if mm_hash not in request.ec_in_store:
            missing = [
                h for h in request.mm_last_end if h not in request.ec_in_store and h not in self.encoder_cache
            ]
            missing = missing if mm_hash in missing else [mm_hash, *missing]
            request.ec_in_store.update(zip(missing, self.connector.has_caches(missing), strict=True))
        return request.ec_in_store[mm_hash]
