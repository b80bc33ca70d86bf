"""The scheduler of an encoder-only instance (``--encoder-only``, the "E" of an encoder / LM split): it
encodes every image of a request, has the worker save the outputs to the encoder-cache connector's
store, and ends the request without generating (finish reason ``length``, no token). Same interface as
``Scheduler`` as far as ``EngineCore`` uses it; no KV blocks, no prefill.

Per item of a request, in this order (FCFS over requests; an item waits for the compute budget and the
encoder-cache room without letting later requests overtake)::

    encoder cache has it                the worker holds it: done if the store has it too, else the
                                        worker saves it again (``ECConnectorMeta.save_mm_hashes``)
    the store has it                    done (another producer encoded it)
    budget and room                     encoded this step; the producer worker saves it

A request is done once every item is: its requests end in ``postprocess`` of the step that finished
them (each step lists its requests in ``num_scheduled_tokens`` with 0 tokens, so a failed step fails
exactly them).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from engine.admission import AdmissionError, queue_full_error
from engine.ec_connector import ECConnectorScheduler
from engine.encoder_cache_manager import EncoderCacheManager
from engine.kv_cache_manager import KVCacheManager
from engine.request import MMItem, Request, RequestStatus
from engine.step_plan import SchedulerConfig, StepPlan, StepResult
from wire.protocol import FinishReason, RunnerOutput


class EncodeOnlyScheduler:
    def __init__(self, config: SchedulerConfig, connector: ECConnectorScheduler) -> None:
        assert connector.role.saves, "an encoder-only instance produces"
        self.config = config
        self.connector = connector
        self.encoder_cache = EncoderCacheManager(config.encoder_cache_tokens)
        self.kv_cache = KVCacheManager(0, config.block_size, enable_prefix_caching=False)  # (metrics)
        self.num_preemptions = 0
        self.num_forced_tokens = 0  # (metrics: an encoder-only instance samples nothing)
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self._pending: dict[str, list[str]] = {}  # req_id -> its items not done yet, in prompt order
        self._step_id = 0

    def admission_error(
        self,
        prompt_len: int,
        max_tokens: int,
        mm_sizes: list[int],
        mm_modalities: Sequence[str] = (),
        *,
        queue_capped: bool = True,
    ) -> AdmissionError | None:
        busy = queue_full_error(self.config, self.num_waiting) if queue_capped else None
        if busy is not None:
            return busy
        for num_tokens in mm_sizes:
            for flag, budget in (
                ("--encoder-compute-budget-tokens", self.config.encoder_compute_budget_tokens),
                (
                    "--encoder-cache-tokens",
                    self.config.encoder_cache_tokens if self.encoder_cache.enabled else None,
                ),
            ):
                if budget is not None and num_tokens > budget:
                    return AdmissionError(
                        f"An item of this request needs {num_tokens} encoder tokens, more than {flag} "
                        f"({budget}) allows; raise {flag} to at least {num_tokens}.",
                        "mm_item_too_large",
                    )
        return None

    def add_request(self, request: Request) -> None:
        self.requests[request.req_id] = request
        self._pending[request.req_id] = list(dict.fromkeys(f.mm_hash for f in request.mm_features))
        self.waiting.append(request)

    def abort(self, req_id: str) -> Request | None:
        request = self.requests.get(req_id)
        if request is None:
            return None
        self.waiting.remove(request)
        self._finish(request, FinishReason.ABORT)
        return request

    @property
    def has_work(self) -> bool:
        return bool(self.waiting)

    @property
    def num_running(self) -> int:
        return sum(1 for r in self.waiting if r.status is RequestStatus.RUNNING)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) - self.num_running

    def schedule(self) -> StepPlan:
        encoder_budget = self.config.encoder_compute_budget_tokens
        encoder_items: dict[str, MMItem] = {}
        num_scheduled: dict[str, int] = {}
        blocked = False
        for request in self.waiting:
            if len(num_scheduled) >= self.config.max_num_seqs:
                break
            pending = self._pending[request.req_id]
            in_store = self._in_store(request, pending)
            for mm_hash in list(pending):
                num_tokens = request.mm_items[mm_hash].num_tokens
                first_query = mm_hash not in request.encoder_hashes_queried
                request.encoder_hashes_queried.add(mm_hash)
                if self.encoder_cache.lookup(mm_hash, request.req_id, count_query=first_query):
                    if not in_store.get(mm_hash, False):
                        self.connector.request_save(mm_hash)
                elif in_store.get(mm_hash, False):
                    pass
                elif num_tokens <= encoder_budget and self.encoder_cache.can_allocate(num_tokens):
                    self.encoder_cache.allocate(mm_hash, num_tokens, request.req_id)
                    encoder_items[mm_hash] = request.mm_items[mm_hash]
                    encoder_budget -= num_tokens
                else:
                    blocked = True
                    break
                pending.remove(mm_hash)  # done once this step ran
            num_scheduled[request.req_id] = 0
            request.status = RequestStatus.RUNNING
            if blocked:
                break
        self._step_id += 1
        return StepPlan(
            step_id=self._step_id,
            new_requests=[],
            num_scheduled_tokens=num_scheduled,
            encoder_items=list(encoder_items.items()),
            free_mm_hashes=self.encoder_cache.take_evicted(),
            finished_req_ids=[],
            ec_meta=self.connector.build_connector_meta(),
        )

    def _in_store(self, request: Request, mm_hashes: list[str]) -> dict[str, bool]:
        """The store's answer for the request's pending items (asked again each step they wait)."""
        return dict(zip(mm_hashes, self.connector.has_caches(mm_hashes), strict=True))

    def postprocess(self, plan: StepPlan, output: RunnerOutput) -> StepResult:
        """Requests whose every item is now encoded and saved (or was in the store) end here."""
        result = StepResult()
        for req_id in plan.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is not None and not self._pending[req_id]:
                self.waiting.remove(request)
                self._finish(request, FinishReason.LENGTH)
                result.finished.append(request)
        return result

    def fail_steps(self, plans: Sequence[StepPlan]) -> list[Request]:
        """``fail_step`` of each (an encoder-only instance never schedules ahead: one at most)."""
        return [request for plan in plans for request in self.fail_step(plan)]

    def fail_step(self, plan: StepPlan) -> list[Request]:
        """The step's requests end (ABORT); what it was to encode is forgotten, so it is encoded again."""
        failed = [self.requests[r] for r in plan.num_scheduled_tokens if r in self.requests]
        for request in failed:
            self.waiting.remove(request)
            self._finish(request, FinishReason.ABORT)
        for mm_hash, _ in plan.encoder_items:
            self.encoder_cache.discard(mm_hash)
        return failed

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.encoder_cache.release_all(request.req_id)
        del self.requests[request.req_id]
        del self._pending[request.req_id]

    def reset_caches(self) -> None:
        self.encoder_cache.reset()
