"""The engine: admits requests (resolving their multimodal items through the receiver cache), runs
scheduler steps on the worker (the next one scheduled while the worker runs this one, with
``--async-scheduling``: ``advance``), and turns results into per-client outputs. No socket IO here: the
inbox methods take decoded messages, ``advance`` and ``step`` call the executor, the caller publishes
what they return.

One ``EngineCore`` lives as long as one worker: its caches describe that worker's KV pool and encoder
store. A step the worker fails (``WorkerFailed``) ends the step's requests with 500 and is rolled back
(``Scheduler.fail_step``); a lost worker (``WorkerLost``) propagates: the caller fails every request
(``fail_all``) and builds a fresh core, with a new epoch, for the next worker.
"""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from engine.api_messages import check_vocab
from engine.ec_connector import ECConnectorScheduler
from engine.encode_scheduler import EncodeOnlyScheduler
from engine.executor import Executor, WorkerFailed, WorkerLost
from engine.receiver_cache import ReceiverCachePartitions
from engine.request import MMItem, Request
from engine.scheduler import Scheduler
from engine.stats import EngineMetrics
from engine.step_plan import SchedulerConfig, StepPlan
from engine.step_wire import check_runner_output, item_from_wire, to_scheduler_output
from engine.structured.backend import CompileError
from engine.structured.compiler import GrammarCompiler, Ticket
from engine.structured.grammar import RequestGrammar
from wire.bad_messages import BadMessage, BadMessageLog
from wire.metric_names import EngineCounter
from wire.protocol import (
    Abort,
    AddRequest,
    EngineStats,
    ErrorInfo,
    FinishReason,
    MMFeature,
    RequestOutput,
    ResetCaches,
)
from wire.shm_ring import ShmRingReader

log = logging.getLogger(__name__)

Outputs = dict[bytes, list[RequestOutput]]  # client identity -> its outputs of this step


@dataclass
class Launched:
    """A step sent to the worker (``sent``), or one with nothing to run; ``outputs``: for requests
    that ended while it was scheduled."""

    plan: StepPlan
    outputs: dict[bytes, list[RequestOutput]]
    sent: bool = False


class EngineCore:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        executor: Executor,
        connector: ECConnectorScheduler | None = None,
        *,
        encode_only: bool = False,
        vocab_size: int = 0,
        bad_messages: BadMessageLog | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        """``connector``: the encoder-cache connector (None: none configured); ``encode_only``: the
        worker has no language model (``--encoder-only``); ``vocab_size``: the worker's (0: unknown),
        a bound on prompt token ids; ``bad_messages``: the engine process's log of them; ``grammars``:
        the engine process's grammar compiler (None: constrained requests are refused)."""
        self.epoch = uuid.uuid4().hex
        self.scheduler: Scheduler | EncodeOnlyScheduler
        if encode_only:
            assert connector is not None, "an encoder-only instance saves to the connector's store"
            self.scheduler = EncodeOnlyScheduler(scheduler_config, connector)
        else:
            self.scheduler = Scheduler(scheduler_config, connector)
        self.connector = connector
        self.executor = executor
        self.receiver_caches: ReceiverCachePartitions[MMItem] = ReceiverCachePartitions()
        self.metrics = EngineMetrics()
        self.shm_reader = ShmRingReader()
        self.draining = False  # set by drain(): new requests are refused, held ones run on
        self.vocab_size = vocab_size
        self.bad_messages = bad_messages if bad_messages is not None else BadMessageLog(log)
        self.grammars = grammars
        self.grammar_tickets: dict[str, Ticket] = {}  # requests waiting for their grammar
        self.in_flight: deque[Launched] = deque()  # steps sent by ``advance``, oldest first (two at most)

    # ------------------------------------------------------------------ inbox

    def add_request(self, client: bytes, msg: AddRequest, frames: Sequence[memoryview]) -> Outputs:
        """Applies the API's mirror decisions first (evictions, then inserts and touches in feature
        order), before anything that could reject the request, so the receiver cache stays identical
        to the sender's mirror whatever happens to the request. ``BadMessage`` (nothing applied) for a
        message no API process sends: a request id already held, a token id past the vocabulary."""
        if msg.req_id in self.scheduler.requests:  # not tied to the request: that one is another's
            raise BadMessage("request id in use", msg.req_id)
        check_vocab(msg, self.vocab_size)
        cache = self.receiver_caches.for_sender(client)
        mirrored = [f for f in msg.mm_features if not f.borrowed]
        features = [
            (
                f.mm_hash,
                item_from_wire(f, frames),
                sum(frames[r.frame].nbytes for r in f.tensors.values()) if f.tensors else 0,
                f.store and f.shm is None,
            )
            for f in mirrored
        ]
        applied, missing = cache.apply(msg.evicted_mm_hashes, features)
        by_feature = iter(applied)
        items = [
            self.receiver_caches.find(client, f.mm_hash) if f.borrowed else next(by_feature)
            for f in msg.mm_features
        ]
        # a borrowed item no partition holds: served from its encoder output if the encoder cache holds it
        # (held by the request from admission on), else missing (the API answers 400 media_uuid_unknown)
        scheduler = self.scheduler
        encoder_only = {
            f.mm_hash
            for f, item in zip(msg.mm_features, items, strict=True)
            if item is None
            and f.borrowed
            and isinstance(scheduler, Scheduler)  # an encoder-only instance has only items to encode
            and scheduler.holds_encoder_output(f.mm_hash)
        }
        borrowed_missing = [
            f.mm_hash
            for f, item in zip(msg.mm_features, items, strict=True)
            if item is None and f.borrowed and f.mm_hash not in encoder_only
        ]
        if self.draining:
            return self._reject(
                client, msg.req_id, "The server is shutting down.", "server_shutting_down", http_status=503
            )
        self.metrics.count(EngineCounter.IPC_CACHE_RESENDS, len(missing))
        stale = self._stale_shm_refs(msg.mm_features)
        missing += stale + borrowed_missing
        if missing:
            return self._reject(
                client,
                msg.req_id,
                "multimodal items missing from the receiver cache",
                "mm_cache_miss",
                missing=missing,
            )
        error = self.scheduler.admission_error(
            len(msg.prompt_token_ids),
            msg.sampling.max_tokens,
            [f.num_tokens for f in msg.mm_features],
            [f.modality for f in msg.mm_features],
            queue_capped=not msg.later_choice,
        )
        if error is not None:
            return self._reject(client, msg.req_id, error.message, error.code, http_status=error.http_status)
        if msg.priority and self.scheduler.config.scheduling_policy != "priority":
            why = "priority is read under --scheduling-policy priority only: leave it out, or use that flag"
            return self._reject(client, msg.req_id, why, "invalid_value", param="priority")
        if msg.constraint is not None and (
            self.grammars is None or not isinstance(self.scheduler, Scheduler)
        ):
            return self._reject(
                client, msg.req_id, "This instance does not generate text.", "invalid_request"
            )
        mm_items = {f.mm_hash: item for f, item in zip(msg.mm_features, items, strict=True) if item}
        self.scheduler.add_request(
            Request(
                req_id=msg.req_id,
                client=client,
                prompt_token_ids=msg.prompt_token_ids,
                sampling=msg.sampling,
                mm_features=[msgspec.structs.replace(f, tensors=None, store=False) for f in msg.mm_features],
                mm_items=mm_items,
                cache_salt=msg.cache_salt,
                priority=msg.priority,
                encoder_only_hashes=encoder_only,
                awaits_grammar=msg.constraint is not None,
            )
        )
        if msg.constraint is not None:
            assert self.grammars is not None
            self.grammar_tickets[msg.req_id] = self.grammars.request(msg.constraint, self.vocab_size)
            return self.resolve_grammars()  # a cache hit is ready at once
        return {}

    def resolve_grammars(self) -> Outputs:
        """Called after every inbox turn and step, and when a compile ends: requests whose grammar is
        ready may be scheduled from now on; those whose compile failed or overran its time end with its
        error. Cheap when nothing waits."""
        outputs: Outputs = defaultdict(list)
        for req_id, ticket in list(self.grammar_tickets.items()):
            request = self.scheduler.requests.get(req_id)
            if request is None or not request.awaits_grammar:  # ended meanwhile (aborted)
                self._drop_ticket(req_id)
                continue
            assert self.grammars is not None and isinstance(self.scheduler, Scheduler)
            try:
                compiled = self.grammars.poll(ticket)
            except CompileError as exc:
                self._drop_ticket(req_id)
                self.scheduler.abort(req_id)
                error = ErrorInfo(message=str(exc), code=exc.code, http_status=exc.http_status)
                outputs[request.client].append(
                    RequestOutput(req_id, finish_reason=FinishReason.ABORT, error=error)
                )
                continue
            if compiled is None:
                continue
            self._drop_ticket(req_id)
            self.scheduler.grammar_ready(
                request, self.grammars.matcher(ticket, list(request.sampling.eos_token_ids))
            )
            if request.is_finished:  # a grammar that allows nothing but the empty answer, or nothing
                outputs[request.client].append(
                    RequestOutput(
                        req_id,
                        finish_reason=request.finish_reason,
                        num_prompt_tokens=request.num_prompt_tokens,
                        error=request.error,
                    )
                )
        return dict(outputs)

    def _drop_ticket(self, req_id: str) -> None:
        """The request stopped waiting for its grammar: a compile nobody waits for may be cancelled."""
        ticket = self.grammar_tickets.pop(req_id)
        if self.grammars is not None:
            self.grammars.release(ticket)

    def _stale_shm_refs(self, features: Sequence[MMFeature]) -> list[str]:
        """Shared-memory references whose chunk header does not match (a stale or corrupt reference,
        or a ring this process cannot open): the API re-sends those items with their payload."""
        stale = []
        for f in features:
            if f.shm is not None and (problem := self.shm_reader.check(f.shm)) is not None:
                log.warning("stale shared-memory reference for %s: %s", f.mm_hash, problem)
                stale.append(f.mm_hash)
        self.metrics.count(EngineCounter.SHM_STALE_REFS, len(stale))
        return stale

    def _reject(
        self,
        client: bytes,
        req_id: str,
        message: str,
        code: str,
        missing: list[str] | None = None,
        http_status: int = 400,
        param: str | None = None,
    ) -> Outputs:
        error = ErrorInfo(
            message=message, code=code, http_status=http_status, missing_mm_hashes=missing or [], param=param
        )
        return {client: [RequestOutput(req_id, finish_reason=FinishReason.ABORT, error=error)]}

    def abort(self, client: bytes, msg: Abort) -> Outputs:
        """Ends the client's requests; each gets a final output, which tells the API that nothing of
        the request (its shared-memory items included) is read any more."""
        outputs: list[RequestOutput] = []
        for req_id in msg.req_ids:
            request = self.scheduler.requests.get(req_id)
            if request is not None and request.client == client and self.scheduler.abort(req_id):
                outputs.append(RequestOutput(req_id, finish_reason=FinishReason.ABORT))
        return {client: outputs} if outputs else {}

    def reset_caches(self, client: bytes, msg: ResetCaches) -> Outputs:
        self.receiver_caches.drop(client)
        if msg.encoder:
            self.scheduler.reset_caches()
        return {}

    def drain(self) -> None:
        """From now on every new request is refused with 503 ``server_shutting_down`` (after its
        mirror decisions were applied); the requests already held run to the end."""
        self.draining = True

    def fail_all(self, error: ErrorInfo) -> Outputs:
        """Ends every request held, running or waiting, with ``error``: the worker is gone. The core
        is not used for steps afterwards (its caches describe the lost worker)."""
        for req_id in list(self.grammar_tickets):
            self._drop_ticket(req_id)
        outputs: Outputs = defaultdict(list)
        for request in list(self.scheduler.requests.values()):
            self.scheduler.abort(request.req_id)
            outputs[request.client].append(
                RequestOutput(request.req_id, finish_reason=FinishReason.ABORT, error=error)
            )
        return dict(outputs)

    # ------------------------------------------------------------------ step

    @property
    def has_work(self) -> bool:
        """Whether a step could run now."""
        return self.scheduler.has_work

    @property
    def holds_requests(self) -> bool:
        """Whether any request is held, waiting for its grammar included."""
        return bool(self.scheduler.requests)

    @property
    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be launched before the one in flight is answered
        (``--async-scheduling``): not on an encoder-only instance, nor while a constrained request
        samples in the step in flight (its grammar must accept the token before the next bitmask is
        made), nor where the free KV blocks do not hold every running request's next tokens (the step
        after the answer preempts; docs/architecture.md, "Engine step")."""
        scheduler = self.scheduler
        return (
            isinstance(scheduler, Scheduler)
            and not any(r.grammar is not None and r.num_pending_outputs for r in scheduler.running)
            and scheduler.has_room_ahead()
        )

    def step(self) -> Outputs:
        """One engine step: ``launch`` then ``finish``. Raises ``WorkerLost``."""
        return self.finish(self.launch())

    def advance(self, *, ahead: bool) -> Outputs:
        """The engine loop's turn (docs/architecture.md, "Engine step"): with a step in flight, first
        launches the next one if ``ahead`` (``--async-scheduling``) allows and ``can_schedule_ahead``,
        then waits for the oldest step and postprocesses it; then, with none in flight, launches the
        next. Returns the outputs to publish (those of the step that ended, and of requests that ended
        while a step was scheduled). A step scheduled on the answer of one that failed fails with it
        (``finish``). Raises ``WorkerLost``."""
        outputs: Outputs = {}
        if self.in_flight:
            if ahead and len(self.in_flight) == 1 and self.has_work and self.can_schedule_ahead:
                outputs = self._launch_into(outputs)
                if len(self.in_flight) == 2:
                    self.metrics.count(EngineCounter.ENGINE_STEPS_AHEAD)
            outputs = _merged(outputs, self.finish(self.in_flight.popleft()))
        if not self.in_flight and self.has_work:
            outputs = self._launch_into(outputs)
        return outputs

    def _launch_into(self, outputs: Outputs) -> Outputs:
        launched = self.launch()
        if launched.sent:
            self.in_flight.append(launched)  # (its ``outputs`` come with its own answer)
            return outputs
        return _merged(outputs, self.finish(launched))

    def launch(self) -> Launched:
        """Schedules a step and sends it to the worker, without waiting for the reply: until ``finish``
        the caller may publish outputs and take in messages (new requests wait for the next step;
        aborts and cache resets only release what the step does not need before it ends). Raises
        ``WorkerLost``."""
        plan = self.scheduler.schedule()
        self.metrics.record_admitted(plan.new_requests)
        launched = Launched(plan, defaultdict(list))
        for request in plan.unavailable:  # ended before the step: nothing here can produce its embeddings
            launched.outputs[request.client].append(_unavailable_output(request.req_id))
        if plan.sends_nothing:
            return launched
        sched, frames = to_scheduler_output(plan, self.scheduler.kv_cache, self._sampling_grammars(plan))
        try:
            self.executor.send(sched, frames)
        except WorkerLost:
            raise
        except WorkerFailed as exc:  # not sent: the step fails as one the worker failed
            for client, failed in self._roll_back([launched], exc).items():
                launched.outputs[client] += failed
            return launched
        launched.sent = True
        return launched

    def finish(self, launched: Launched) -> Outputs:
        """Waits for the launched step's reply, then postprocesses; when the worker failed the step,
        rolls it back and fails its requests, with the step sent after it if one is in flight
        (``in_flight``, scheduled on this one's answer). Raises ``WorkerLost``."""
        plan, outputs = launched.plan, launched.outputs
        if not launched.sent:
            return dict(outputs)
        try:
            runner_output = self.executor.wait(plan.step_id)
            check_runner_output(plan, runner_output, self.scheduler.requests)
        except WorkerLost:
            raise
        except BadMessage as bad:
            self.bad_messages.record("worker", bad)
            return self._fail(launched, WorkerFailed(str(bad)))
        except WorkerFailed as exc:
            return self._fail(launched, exc)
        result = self.scheduler.postprocess(plan, runner_output)
        self.metrics.record_step(plan, runner_output)

        finished = {r.req_id: r for r in result.finished}
        logprobs = dict(zip(runner_output.req_ids, runner_output.logprobs, strict=True))
        # an encoder-only instance's requests finish without a token once their items are saved
        no_token: dict[str, list[int]] = {r: [] for r in finished if r not in result.new_token_ids}
        for req_id, token_ids in (result.new_token_ids | no_token).items():
            request = finished.get(req_id) or self.scheduler.requests[req_id]
            if token_ids:
                self.metrics.record_tokens(request)
            entry = logprobs.get(req_id)
            outputs[request.client].append(
                RequestOutput(
                    req_id=req_id,
                    new_token_ids=token_ids,
                    logprobs=[entry] if entry is not None and token_ids else None,
                    finish_reason=request.finish_reason,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_cached_tokens=request.num_cached_tokens,
                    error=request.error,
                    prompt_logprobs=request.take_prompt_logprobs(),  # (with its first output)
                )
            )
        return dict(outputs)

    def _fail(self, launched: Launched, exc: WorkerFailed) -> Outputs:
        """The worker did not complete ``launched``: it and the step sent after it, if one is in flight
        (it continued requests from tokens and K/V this one did not produce, and may have registered
        blocks that hold them or shared its encoder entries), are rolled back together
        (``Scheduler.fail_steps``); the follower's reply is awaited and dropped first (the worker runs
        steps in order). Every request of either ends with the step's error. Raises ``WorkerLost``."""
        failed = [launched]
        if self.in_flight:
            follower = self.in_flight.popleft()
            if follower.sent:
                try:
                    self.executor.wait(follower.plan.step_id)
                except WorkerLost:
                    raise
                except (WorkerFailed, BadMessage):
                    pass  # failed too
            failed.append(follower)
        outputs: Outputs = defaultdict(list)
        for step in failed:
            for client, ended in step.outputs.items():
                outputs[client] += ended
        for client, ended in self._roll_back(failed, exc).items():
            outputs[client] += ended
        return dict(outputs)

    def _roll_back(self, failed: list[Launched], exc: WorkerFailed) -> Outputs:
        """``Scheduler.fail_steps`` of ``failed``; each of their requests' error output."""
        log.error("step %s failed: %s", " and ".join(str(f.plan.step_id) for f in failed), exc)
        error = ErrorInfo(
            message=f"internal error while running the model: {exc}", code="internal_error", http_status=500
        )
        if exc.unavailable_mm_hashes:
            error = ENCODER_OUTPUT_UNAVAILABLE
        outputs: Outputs = defaultdict(list)
        self.metrics.count(EngineCounter.FAILED_STEPS, len(failed))
        for request in self.scheduler.fail_steps([step.plan for step in failed]):
            outputs[request.client].append(
                RequestOutput(request.req_id, finish_reason=FinishReason.ABORT, error=error)
            )
        return dict(outputs)

    def _sampling_grammars(self, plan: StepPlan) -> list[tuple[str, RequestGrammar]]:
        """The constrained requests that sample in the step (it computes their last known token)."""
        found = []
        for req_id in plan.sampling_req_ids:
            request = self.scheduler.requests.get(req_id)
            if request is not None and request.grammar is not None:
                assert isinstance(request.grammar, RequestGrammar)
                found.append((req_id, request.grammar))
        return found

    def stats(self) -> EngineStats:
        return self.metrics.snapshot(self.scheduler, self.connector, self.grammars)


ENCODER_OUTPUT_UNAVAILABLE = ErrorInfo(
    message="An image's encoder output is neither cached nor in the encoder-cache store, and this "
    "instance has no vision tower to encode it (--language-model-only); retry shortly.",
    code="encoder_output_unavailable",
    http_status=503,
)


def _unavailable_output(req_id: str) -> RequestOutput:
    return RequestOutput(req_id, finish_reason=FinishReason.ABORT, error=ENCODER_OUTPUT_UNAVAILABLE)


def _merged(first: Outputs, second: Outputs) -> Outputs:
    """Both steps' outputs, the first's first for each client."""
    both: Outputs = {client: list(outputs) for client, outputs in first.items()}
    for client, outputs in second.items():
        both.setdefault(client, []).extend(outputs)
    return both
