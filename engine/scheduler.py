"""Continuous-batching scheduler: decides, each step, how many tokens every request computes, which
KV blocks they write and which multimodal items the encoder runs on. Policy only: no sockets, no
tensors (block bookkeeping is the ``KVCacheManager``'s, encoder bookkeeping the
``EncoderCacheManager``'s).

A step is ``schedule()`` → the worker runs it → ``postprocess(runner_output)``, or ``fail_step()`` when
the worker did not complete it (the step's requests end; what it would have written is forgotten by
the prefix and encoder caches; its drops are sent again). Requests join (from
``waiting``) when a step is scheduled and may leave (aborted) while one runs: ``postprocess`` skips
what the step computed for them; all running requests advance together. Admission checks are
``engine.admission``'s. When
KV blocks run out, the running request last in the policy's order (engine/request_queue.py: the most
recently admitted, or the latest of the lowest priority) is preempted: its blocks are freed, it goes
back to the queue (its front, or its place by priority) and is recomputed later (outputs already
produced are kept).
``schedule()`` may run again before the previous step's ``postprocess`` (scheduling ahead; see
``schedule``): a request's tokens in flight and the tokens they sample count as computed and known.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.admission import AdmissionError, admission_error
from engine.ec_connector import ECConnectorScheduler
from engine.encoder_admission import EncoderAdmission
from engine.encoder_cache_manager import EncoderCacheManager
from engine.kv_cache_manager import KVCacheManager
from engine.request import MMItem, OutputGrammar, Request, RequestStatus
from engine.request_queue import WaitingQueue, place
from engine.step_plan import SchedulerConfig, StepPlan, StepResult
from engine.structured.errors import CONSTRAINT_UNSATISFIABLE, GRAMMAR_BROKEN
from wire.protocol import FinishReason, RunnerOutput


class Scheduler:
    def __init__(self, config: SchedulerConfig, connector: ECConnectorScheduler | None = None) -> None:
        """``connector``: the encoder-cache connector, whose store may hold items this instance did not
        encode (consulted when its role loads)."""
        self.config = config
        self.connector = connector if connector is not None and connector.role.loads else None
        self.encoder_cache = EncoderCacheManager(config.encoder_cache_tokens)
        self.kv_cache = KVCacheManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching, config.prefix_match
        )
        self.admission = EncoderAdmission(
            self.encoder_cache,
            self.connector,
            can_encode=config.can_encode,
            disable_chunked_mm_input=config.disable_chunked_mm_input,
        )
        self.num_preemptions = 0
        self.num_forced_tokens = 0  # appended without sampling (_append_forced)
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []  # in the policy's order: the last is preempted first
        self._num_arrived = 0
        self.requests: dict[str, Request] = {}
        self._step_id = 0
        # finished since the last plan; the worker drops their state at the start of the next step
        self._finished_req_ids: list[str] = []
        self._forced_tokens: dict[str, tuple[int, list[int]]] = {}  # for the next step (StepPlan's)
        self._preempted_req_ids: list[str] = []  # likewise, their block tables
        self._resend_free_mm_hashes: list[str] = []  # a failed step's frees, sent again
        self.num_awaiting_grammar = 0  # waiting requests whose grammar is still compiling

    # ------------------------------------------------------------------ admission

    def admission_error(
        self,
        prompt_len: int,
        max_tokens: int,
        mm_sizes: list[int],
        mm_modalities: Sequence[str] = (),
        *,
        queue_capped: bool = True,
    ) -> AdmissionError | None:
        """Why a request is refused before it is queued, or None (``engine.admission``); without
        ``queue_capped`` (a later choice of an admitted request) the waiting queue's cap does not apply."""
        return admission_error(
            self.config,
            self.num_waiting if queue_capped else 0,
            self.encoder_cache.enabled,
            prompt_len,
            max_tokens,
            mm_sizes,
            mm_modalities,
        )

    def add_request(self, request: Request) -> None:
        """Queues a request. Its encoder-only items (``Request.encoder_only_hashes``, checked held by
        ``holds_encoder_output`` in the same synchronous step) become its entries at once and stay so
        until it finishes: an eviction would leave nothing to encode them from."""
        self.requests[request.req_id] = request
        self._num_arrived += 1
        request.arrival_order = self._num_arrived
        self.waiting.add(request)
        if request.awaits_grammar:
            self.num_awaiting_grammar += 1
        for mm_hash in request.encoder_only_hashes:
            held = self.encoder_cache.lookup(mm_hash, request.req_id)
            assert held, f"encoder-only item {mm_hash} is not in the encoder cache"
            request.encoder_hashes_in_use.add(mm_hash)

    def grammar_ready(self, request: Request, grammar: OutputGrammar) -> None:
        """Called when a waiting request's grammar is compiled: it may be scheduled from now on (it kept
        its place in the queue). A grammar complete before any token ends the request at once, unless it
        wants its prompt's logprobs."""
        assert request.awaits_grammar, f"{request.req_id} was not waiting for a grammar"
        request.awaits_grammar = False
        request.grammar = grammar
        self.num_awaiting_grammar -= 1
        # (one that wants its prompt's logprobs computes its prompt first, then stops without a token)
        if grammar.is_dead_end or (grammar.is_complete and not request.wants_prompt_logprobs):
            self.waiting.remove(request)
            request.error = CONSTRAINT_UNSATISFIABLE if grammar.is_dead_end else None
            self._finish(request, FinishReason.ABORT if grammar.is_dead_end else FinishReason.STOP)

    def holds_encoder_output(self, mm_hash: str) -> bool:
        """Whether the encoder cache holds ``mm_hash``'s output (in use or freeable)."""
        return mm_hash in self.encoder_cache

    def abort(self, req_id: str) -> Request | None:
        request = self.requests.get(req_id)
        if request is None or request.is_finished:
            return None
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        self._finish(request, FinishReason.ABORT)
        return request

    @property
    def has_work(self) -> bool:
        """Whether a step could run: a request waiting for its grammar makes none."""
        return bool(self.running) or len(self.waiting) > self.num_awaiting_grammar

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> StepPlan:
        """Called once per step: running requests first, then waiting ones, each in the policy's order
        (by arrival, or by priority), while the token budget, ``max_num_seqs`` and free KV blocks allow.

        It may be called while earlier steps are in flight (the worker has not answered them): a
        running request then continues after their tokens, and a step that samples for it is followed
        by its sampled token, which the worker appends itself (docs/architecture.md, "Engine step").
        Left out until the answer: a constrained request with a token pending (its grammar must
        accept it before the next bitmask) and one that the pending token ends by length. Nothing is
        preempted while a step is in flight: where a request would be, the step stops there and admits
        no one (the step after the answer preempts)."""
        token_budget = self.config.max_num_batched_tokens
        encoder_budget = self.config.encoder_compute_budget_tokens
        num_scheduled: dict[str, int] = {}
        sampling: list[str] = []
        encoder_items: dict[str, MMItem] = {}
        new_block_ids: dict[str, list[int]] = {}
        preempted_now = False  # (or a request would have been, with a step in flight)
        ahead = any(r.num_inflight_tokens for r in self.running)  # a step is in flight: no preemption

        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            if request.num_pending_outputs and self._waits_for_pending(request):
                index += 1
                continue
            inflight = request.num_inflight_tokens
            known = request.num_tokens + request.num_pending_outputs
            wanted = min(known - request.num_computed_tokens - inflight, token_budget)
            fits = True
            while not self.kv_cache.can_allocate(request, inflight + wanted):
                # the last in the policy's order: the most recently admitted (it has the least work to
                # lose), or the latest of the lowest priority
                victim = self.running[-1]
                preempted_now = True
                if ahead:  # its requests' blocks are being written, and what it frees is not known yet
                    fits = False
                    break
                self._preempt(victim)
                if victim is request:
                    break
            if not fits or request.status is RequestStatus.PREEMPTED:
                break  # nothing after it is scheduled: it was the last running request, or in flight
            num_tokens, encoder_budget = self.admission.fit(request, wanted, encoder_budget, encoder_items)
            index += 1
            if num_tokens == 0:  # (or unavailable: it ends after this loop)
                continue
            blocks = self.kv_cache.allocate_slots(request, inflight + num_tokens)
            assert blocks is not None, "can_allocate promised room"
            if blocks:
                new_block_ids[request.req_id] = blocks
            self._schedule_tokens(request, num_tokens, num_scheduled, sampling)
            token_budget -= num_tokens

        new_requests: list[Request] = []
        resumed_requests: list[Request] = []
        # No admissions in a step that had to preempt: the freed blocks go to the running requests first.
        while (
            len(self.waiting) > self.num_awaiting_grammar
            and token_budget > 0
            and len(self.running) < self.config.max_num_seqs
            and not preempted_now
        ):
            # the first in line that is not waiting for its grammar (those keep their places)
            request = next(r for r in self.waiting if not r.awaits_grammar)
            # (one that wants prompt logprobs computes it whole: docs/architecture.md, "Prompt logprobs")
            computed_blocks, num_computed = (
                self.kv_cache.get_computed_blocks(request) if not request.wants_prompt_logprobs else ([], 0)
            )
            request.num_computed_tokens = num_computed  # the prefix-cache hits, if it starts now
            wanted = min(request.num_tokens - num_computed, token_budget)
            num_tokens = 0
            if self.kv_cache.can_allocate(request, wanted, computed_blocks):
                num_tokens, encoder_budget = self.admission.fit(
                    request, wanted, encoder_budget, encoder_items
                )
            if self.admission.unavailable and self.admission.unavailable[-1] is request:
                request.num_computed_tokens = 0
                self.waiting.remove(request)  # it ends below; the next in line may run
                continue
            if num_tokens == 0:
                # Head of line waits (for blocks, or for room to encode its first image); keep the order.
                request.num_computed_tokens = 0
                break
            blocks = self.kv_cache.allocate_slots(request, num_tokens, computed_blocks)
            assert blocks is not None, "can_allocate promised room"
            self.waiting.remove(request)
            if request.status is RequestStatus.PREEMPTED:
                resumed_requests.append(request)
            elif not request.sent_to_worker:
                request.sent_to_worker = True
                request.num_cached_tokens = num_computed
                if not request.wants_prompt_logprobs:  # (not looked up)
                    self.kv_cache.record_prefix_lookup(request.num_prompt_tokens, num_computed)
                new_requests.append(request)
            request.status = RequestStatus.RUNNING
            place(self.running, request, self.config.scheduling_policy)
            self._schedule_tokens(request, num_tokens, num_scheduled, sampling)
            token_budget -= num_tokens

        unavailable, self.admission.unavailable = self.admission.unavailable, []
        for request in unavailable:
            self._finish(request, FinishReason.ABORT)
        finished, self._finished_req_ids = self._finished_req_ids, []
        preempted, self._preempted_req_ids = self._preempted_req_ids, []
        resent, self._resend_free_mm_hashes = self._resend_free_mm_hashes, []
        forced, self._forced_tokens = self._forced_tokens, {}
        plan = StepPlan(
            step_id=self._step_id + 1,
            new_requests=new_requests,
            num_scheduled_tokens=num_scheduled,
            encoder_items=list(encoder_items.items()),
            free_mm_hashes=resent + self.encoder_cache.take_evicted(),
            finished_req_ids=finished,
            resumed_requests=resumed_requests,
            new_block_ids=new_block_ids,
            preempted_req_ids=preempted,
            cached_blocks=self.kv_cache.take_newly_cached(),
            kv_copies=self.kv_cache.take_kv_copies(),
            ec_meta=self.connector.build_connector_meta() if self.connector is not None else None,
            unavailable=unavailable,
            forced_tokens=forced,  # a request's entry goes when it finishes (_finish)
            sampling_req_ids=sampling,
        )
        if not plan.sends_nothing:  # (one that is not sent takes no step id: the worker's are in order)
            self._step_id += 1
        return plan

    def _schedule_tokens(
        self, request: Request, num_tokens: int, num_scheduled: dict[str, int], sampling: list[str]
    ) -> None:
        """``request`` computes its next ``num_tokens`` in the step being planned."""
        num_scheduled[request.req_id] = num_tokens
        request.num_inflight_tokens += num_tokens
        known = request.num_tokens + request.num_pending_outputs
        if request.num_computed_tokens + request.num_inflight_tokens == known:
            request.num_pending_outputs += 1
            sampling.append(request.req_id)

    def has_room_ahead(self) -> bool:
        """Whether the free KV blocks hold every running request's next tokens, so that a step scheduled
        ahead (which preempts no one) leaves no running request out for lack of room; where they do
        not, the engine waits for the answer and schedules then, preempting as it must."""
        budget = self.config.max_num_batched_tokens
        free = self.kv_cache.num_free_blocks
        # the common case, without a look at each: a step computes at most ``budget`` tokens, which
        # start at most one new block more per request than their count fills
        if free >= budget // self.config.block_size + len(self.running):
            return True
        needed = 0
        for request in self.running:
            start = request.num_computed_tokens + request.num_inflight_tokens
            wanted = min(request.num_tokens + request.num_pending_outputs - start, budget)
            needed += self.kv_cache.num_new_blocks(request, request.num_inflight_tokens + wanted)
        return needed <= free

    def _waits_for_pending(self, request: Request) -> bool:
        """Whether a request with a token pending (sampled in a step in flight) sits this step out: its
        grammar must accept that token before the next bitmask, or the token ends it by length (one
        pending step is enough to tell; an EOS it cannot tell, and the step after it is dropped)."""
        if request.grammar is not None:
            return True
        num_after = request.num_tokens + request.num_pending_outputs
        num_outputs = num_after - request.num_prompt_tokens
        return num_outputs >= request.sampling.max_tokens or num_after >= self.config.max_model_len

    def _preempt(self, request: Request) -> None:
        """Frees the request's KV blocks and encoder-cache uses and puts it back in the queue (its front,
        or its place by priority); it will recompute its tokens (prompt + outputs so far) and continue
        where it stopped."""
        assert not request.num_inflight_tokens, "a request in a step in flight is never preempted"
        self.running.remove(request)
        self.kv_cache.free(request.req_id)
        for mm_hash in request.encoder_hashes_in_use - request.encoder_only_hashes:
            self.encoder_cache.release(request.req_id, mm_hash)
        request.encoder_hashes_in_use &= request.encoder_only_hashes
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.put_back(request)
        self._preempted_req_ids.append(request.req_id)

    # ------------------------------------------------------------------ after the worker ran

    def postprocess(self, plan: StepPlan, output: RunnerOutput) -> StepResult:
        """Called once per step with the worker's result: advances computed tokens, appends sampled
        tokens, releases encoder entries once their last placeholder range is computed, finishes requests."""
        result = StepResult()
        for req_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            request.num_computed_tokens += num_tokens
            request.num_inflight_tokens -= num_tokens
            for mm_hash in list(request.encoder_hashes_in_use - request.encoder_only_hashes):
                if request.num_computed_tokens >= request.mm_last_end[mm_hash]:
                    request.encoder_hashes_in_use.discard(mm_hash)
                    self.encoder_cache.release(req_id, mm_hash)
        for req_id in plan.sampling_req_ids:
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished:
                request.num_pending_outputs -= 1
        for req_id, run in output.prompt_logprobs.items():
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished:
                request.add_prompt_logprobs(run)  # (check_runner_output checked that it follows on)
        for req_id, token_id in zip(output.req_ids, output.sampled_token_ids, strict=True):
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.grammar is not None and request.grammar.is_complete:  # it only wanted its prompt's
                self._finish(request, FinishReason.STOP)  # logprobs (grammar_ready): no token is its answer
                result.finished.append(request)
                continue
            if request.grammar is not None and not request.grammar.accept(token_id):
                request.error = GRAMMAR_BROKEN
                self._finish(request, FinishReason.ABORT)
                result.finished.append(request)
                continue
            request.output_token_ids.append(token_id)
            result.new_token_ids[req_id] = [token_id]
            reason = self._stop_reason(request, token_id)
            if reason is None and request.grammar is not None:
                reason = self._append_forced(request, result.new_token_ids[req_id])
                if reason is None and request.grammar.is_dead_end:
                    request.error = CONSTRAINT_UNSATISFIABLE
                    reason = FinishReason.ABORT
            if reason is not None:
                self._finish(request, reason)
                result.finished.append(request)
        return result

    def _append_forced(self, request: Request, new_token_ids: list[int]) -> FinishReason | None:
        """Appends the tokens the request's grammar forces (one allowed token, no stop token) without
        sampling them, as far as they go or until the request stops (docs/architecture.md, "Structured
        outputs"); the worker gets them with the next step, which computes them as one span. Not for a
        request that wants logprobs (a forced token has no logits) or limits its ids. Returns the
        request's stop reason, if it stopped."""
        grammar, params = request.grammar, request.sampling
        assert grammar is not None
        if params.num_top_logprobs is not None or params.allowed_token_ids is not None:
            return None
        num_before = request.num_tokens
        forced: list[int] = []
        reason = None
        while reason is None and (token_id := grammar.forced_token()) is not None:
            if not grammar.accept(token_id):  # its own only token: never, unless the matcher is broken
                request.error = GRAMMAR_BROKEN
                reason = FinishReason.ABORT
                break
            request.output_token_ids.append(token_id)
            forced.append(token_id)
            reason = self._stop_reason(request, token_id)
        if forced:  # (dropped again if the request stops now: _finish)
            new_token_ids += forced
            self.num_forced_tokens += len(forced)
            self._forced_tokens[request.req_id] = (num_before, forced)
        return reason

    def fail_step(self, plan: StepPlan) -> list[Request]:
        """``fail_steps`` of one step."""
        return self.fail_steps([plan])

    def fail_steps(self, plans: Sequence[StepPlan]) -> list[Request]:
        """Called instead of ``postprocess`` when the worker did not complete ``plans[0]`` (an error or a
        timeout; it is still there), with the step sent after it, if any: scheduled on its answer, it
        fails too (docs/architecture.md, "Engine step"). Returns the steps' requests, now finished with
        ABORT: the worker's state for them is unknown. The steps are undone from the caches' view, all
        requests first: the blocks they registered in the prefix cache and the encoder entries they
        allocated are forgotten (their K/V and outputs may never have been written), so a later request
        computes and encodes them again; blocks and entries of earlier steps stay. A request outside
        the steps that looked up such an entry (a head of line that then waited) gives it up and
        encodes it again later. The steps' drops (freed outputs, finished and preempted requests) go
        out again with the next step: the worker may not have applied them, and applying one twice is
        harmless. Requests the steps did not run are untouched."""
        failed = []
        for plan in plans:
            for req_id in plan.num_scheduled_tokens:
                request = self.requests.get(req_id)
                if request is not None:
                    self._finish(request, FinishReason.ABORT)
                    failed.append(request)
        for plan in plans:
            # Only the steps' requests held what they registered: all released above.
            self.kv_cache.uncache(plan.cached_blocks)
            for mm_hash in dict.fromkeys([*(h for h, _ in plan.encoder_items), *plan.load_mm_hashes]):
                for req_id in self.encoder_cache.users(mm_hash):
                    request = self.requests[req_id]
                    if mm_hash in request.encoder_only_hashes:  # nothing to encode it from
                        if request in self.waiting:
                            self.waiting.remove(request)
                        self._finish(request, FinishReason.ABORT)
                        failed.append(request)
                        continue
                    request.encoder_hashes_in_use.discard(mm_hash)
                    self.encoder_cache.release(req_id, mm_hash)
                self.encoder_cache.discard(mm_hash)  # reported in the next step's free_mm_hashes
            self._resend_free_mm_hashes += plan.free_mm_hashes
        for plan in reversed(plans):  # (each prepended: the first step's drops go first)
            self._finished_req_ids[:0] = plan.finished_req_ids
            self._preempted_req_ids[:0] = plan.preempted_req_ids
            for req_id, entry in plan.forced_tokens.items():  # the worker may not have appended them
                if req_id in self.requests:  # not finished
                    self._forced_tokens.setdefault(req_id, entry)
        return failed

    def _stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        params = request.sampling
        num_output = len(request.output_token_ids)
        if request.grammar is not None and request.grammar.is_complete:
            return FinishReason.STOP  # before min_tokens or ignore_eos: the grammar allows nothing more
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in params.eos_token_ids:
                return FinishReason.STOP
            if token_id in params.stop_token_ids:
                return FinishReason.STOP
        if num_output >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """Releases everything the request held; its worker state is dropped in the next step."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._forced_tokens.pop(request.req_id, None)
        if request.awaits_grammar:
            request.awaits_grammar = False
            self.num_awaiting_grammar -= 1
        if request in self.running:
            self.running.remove(request)
        self.encoder_cache.release_all(request.req_id)
        request.encoder_hashes_in_use.clear()
        self.kv_cache.free(request.req_id)
        if request.sent_to_worker:
            self._finished_req_ids.append(request.req_id)
        del self.requests[request.req_id]

    def reset_caches(self) -> None:
        """Evicts every freeable encoder-cache entry and the prefix cache's free blocks."""
        self.encoder_cache.reset()
        self.kv_cache.reset_prefix_cache()
