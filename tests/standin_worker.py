"""The tests' one stand-in for the worker process: it follows the engine⇄worker protocol
(``wire/protocol.py``) without a model, keeping the worker's books and refusing what it refuses.

    in process   EngineCore ──send(SchedulerOutput, frames), wait(step id)──▶ StandinWorker (an Executor)
    over ZeroMQ  WorkerClient (ROUTER) ──[SchedulerOutput, frames...]──▶ serve(): DEALER, StandinWorker
                              ◀──[WorkerReady | RunnerOutput | WorkerError]──
                 serve() (tests/standin_worker_process.py) runs in a thread (``serving``) or as a process

A step runs as in ``ModelRunner.execute`` (workers/model_runner.py), in its order, bytes for tensors:
drops (unknown ids ignored); forced tokens appended (a resend ignored), checked first; additions and
prefix copies (into the block a new or resumed request starts in, as many slots as it has computed
there), checked first; ``ec_meta`` loads from ``ec_store``; "encoding" (``pixel_values`` in a valid frame
or shm chunk; output ``b"output of " + mm_hash``); a producer's saves; each scheduled chunk checked
(request known and not preempted, tokens uncomputed, KV slots in its blocks, the encoder outputs its
placeholders need held), then advanced, sampling where the step computed the last known token. A
contradiction raises ``StepError``, as in the worker; stricter than the worker (the engine must never ask
it): encoding or loading an item already held, saving one not held, a prefix copy into any other block.

Tokens: ``next_token(req_id, token_ids)``, by default the last token + 1 modulo ``vocab_size`` (a prompt
ending in 19 goes on 20, 21, ... whatever the batch, step or preemption); no min_tokens masking (the
scheduler's stop rules are under test). A constrained request (a row of the step's grammar bitmask) takes
the first token its row allows from that one on, cyclically; a row for a request that does not sample, or
one that allows nothing, is a ``StepError``. Logprobs, when asked: the sampled token at ``SAMPLED_LOGPROB``;
top k: the sampled token and the ids after it, each 1.0 lower.

Failures: over ZeroMQ each is a ``WorkerError`` reply and serving goes on (as workers/worker_main.py).
In process ``execute`` raises what ``WorkerClient`` would (``WorkerFailed``, ``WorkerLost``), but
``StepError`` as is: the engine has a bug, and the test must fail rather than see a 500.

Options (keyword arguments; "steps" are step ids):
    num_kv_blocks, block_size, has_vision_tower, has_language_model   what ``ready`` announces
    next_token, vocab_size          the token rule
    ec_store, ec_role               the encoder-cache connector's store and role (None: none)
    encoder_seconds, forward_seconds   the timings reported for a step that encoded / computed tokens
    fail_steps {step: message}      the step fails (a CUDA error) at ``fail_stage``: "forward" (after
                                    its loads, encodes and saves) or "encoder" (before any of them)
    lose_steps                      the worker dies on receiving the step (nothing of it applied)
    delay_s {step: seconds}         the reply comes that late, reporting that many step_seconds
    held {step: threading.Event}    the reply waits until the test sets the event (in process: a reply
                                    late for sure, however busy the machine)
    drop_replies                    the step runs but is never answered (in process: a timeout)
    undecodable_steps               answered as if frame 0 could not be decoded
    misnumber_replies               every reply carries step id + this (a protocol violation)
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import msgspec

from engine.executor import WorkerFailed, WorkerLost
from tests.standin_books import RequestState, StepError, check_additions
from wire.ec_store import ECRole, ECStore, ECStoreError
from wire.protocol import (
    UNDECODABLE_STEP_ID,
    ECConnectorMeta,
    ECStepStats,
    EncoderInput,
    Logprob,
    RunnerOutput,
    SamplingParams,
    SchedulerOutput,
    TensorRef,
    TokenLogprobs,
    WorkerError,
    WorkerReady,
)
from wire.shm_ring import ShmRingReader

VOCAB_SIZE = 32_000
SAMPLED_LOGPROB = -0.5
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1}

NextToken = Callable[[str, Sequence[int]], int]
Buffer = Any  # bytes, memoryview, zmq frame buffers


class Step(NamedTuple):
    sched: SchedulerOutput
    frames: list[bytes]  # its tensor frames (frame 1 first)


class StandinWorker:
    def __init__(
        self,
        *,
        num_kv_blocks: int = 1024,
        block_size: int = 16,
        has_vision_tower: bool = True,
        has_language_model: bool = True,
        next_token: NextToken | None = None,
        vocab_size: int = VOCAB_SIZE,
        ec_store: ECStore | None = None,
        ec_role: ECRole | None = None,
        encoder_seconds: float = 0.0,
        forward_seconds: float = 0.0,
        fail_steps: Mapping[int, str] | None = None,
        fail_stage: Literal["encoder", "forward"] = "forward",
        lose_steps: Collection[int] = (),
        delay_s: Mapping[int, float] | None = None,
        held: Mapping[int, threading.Event] | None = None,
        drop_replies: Collection[int] = (),
        undecodable_steps: Collection[int] = (),
        misnumber_replies: int = 0,
    ) -> None:
        self.ready = WorkerReady(
            device="cpu",
            dtype="float32",
            num_kv_blocks=num_kv_blocks if has_language_model else 0,
            block_size=block_size,
            has_vision_tower=has_vision_tower,
            has_language_model=has_language_model,
        )
        self.vocab_size = vocab_size
        self.next_token = next_token or self.count_up
        assert (ec_store is None) == (ec_role is None), "a connector needs its store and its role"
        self.ec_store, self.ec_role = ec_store, ec_role
        self.encoder_seconds, self.forward_seconds = encoder_seconds, forward_seconds
        self.fail_steps, self.fail_stage = dict(fail_steps or {}), fail_stage
        self.lose_steps, self.drop_replies = set(lose_steps), set(drop_replies)
        self.delay_s = dict(delay_s or {})
        self.held = dict(held or {})
        self.undecodable_steps = set(undecodable_steps)
        self.misnumber_replies = misnumber_replies

        self.requests: dict[str, RequestState] = {}
        self.outputs: dict[str, bytes] = {}  # the encoder store
        self.steps: list[Step] = []  # every step received, in order
        self.errors: list[str] = []  # over ZeroMQ: the StepErrors answered as WorkerError
        self.dead = False  # a lose_steps step arrived
        self._sent: deque[tuple[int, RunnerOutput | Exception]] = deque()  # sends' outcomes, until waited
        self._shm_reader: ShmRingReader | None = None

    def count_up(self, req_id: str, token_ids: Sequence[int]) -> int:
        """The default token rule: the request's last token + 1, modulo ``vocab_size``."""
        return (token_ids[-1] + 1) % self.vocab_size

    # ------------------------------------------------------------------ what tests read

    @property
    def received_step_ids(self) -> list[int]:
        return [step.sched.step_id for step in self.steps]

    @property
    def encoder_inputs(self) -> list[str]:
        """The mm_hashes sent to encode, over all steps, in order."""
        return [enc.mm_hash for step in self.steps for enc in step.sched.encoder_inputs]

    @property
    def tensor_frames(self) -> list[bytes]:
        return [frame for step in self.steps for frame in step.frames]

    # ------------------------------------------------------------------ the Executor

    def send(self, sched: SchedulerOutput, frames: Sequence[Buffer]) -> None:
        """``engine.executor.Executor``: runs the step at once; ``wait`` gives its outcome. A third step
        sent while two are unanswered is a bug in the engine (``StepError``)."""
        if len(self._sent) == 2:
            unanswered = [step_id for step_id, _ in self._sent]
            raise StepError(f"step {sched.step_id} sent while steps {unanswered} are unanswered")
        try:
            outcome: RunnerOutput | Exception = self.execute(sched, frames)
        except WorkerLost:
            raise  # send reports a lost worker at once, as WorkerClient does for a closed pipe
        except WorkerFailed as exc:
            outcome = exc
        self._sent.append((sched.step_id, outcome))

    def wait(self, step_id: int) -> RunnerOutput:
        assert self._sent and self._sent[0][0] == step_id, f"step {step_id} is not the oldest sent"
        outcome = self._sent.popleft()[1]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def execute(self, sched: SchedulerOutput, frames: Sequence[Buffer]) -> RunnerOutput:
        """One step, send and wait in one: ``frames`` are the step's tensor frames (``TensorRef.frame``
        1 is ``frames[0]``). Raises what ``WorkerClient`` would, and ``StepError`` (see the module)."""
        reply = self.handle(sched, frames)
        if self.dead:
            raise WorkerLost("the worker's connection closed (stand-in: lose_steps)")
        if reply is None:
            raise WorkerFailed(f"worker did not answer step {sched.step_id} (stand-in: drop_replies)")
        if isinstance(reply, WorkerError):
            raise WorkerFailed(
                f"worker failed step {sched.step_id}: {reply.message}", reply.unavailable_mm_hashes
            )
        return reply

    def handle(self, sched: SchedulerOutput, frames: Sequence[Buffer]) -> RunnerOutput | WorkerError | None:
        """One step as the worker process answers it; None: no answer (dropped, or ``dead``)."""
        self.steps.append(Step(sched, [bytes(f) for f in frames]))
        if sched.step_id in self.lose_steps:
            self.dead = True
            return None
        reply: RunnerOutput | WorkerError
        if sched.step_id in self.undecodable_steps:
            reply = WorkerError(UNDECODABLE_STEP_ID, "undecodable message (stand-in: undecodable_steps)")
        else:
            try:
                reply = self._run(sched, frames)
            except WorkerFailed as exc:
                reply = WorkerError(sched.step_id, str(exc), exc.unavailable_mm_hashes)
        delay_s = self.delay_s.get(sched.step_id, 0.0)
        time.sleep(delay_s)
        if sched.step_id in self.held:
            assert self.held[sched.step_id].wait(60), f"step {sched.step_id} was never released"
        if isinstance(reply, RunnerOutput) and delay_s:  # busy all that time, as far as the engine knows
            reply = msgspec.structs.replace(reply, step_seconds=delay_s)
        if sched.step_id in self.drop_replies:
            return None
        if self.misnumber_replies and reply.step_id != UNDECODABLE_STEP_ID:
            reply = msgspec.structs.replace(reply, step_id=reply.step_id + self.misnumber_replies)
        return reply

    def close(self) -> None:
        if self._shm_reader is not None:
            self._shm_reader.close()

    # ------------------------------------------------------------------ one step

    def _run(self, sched: SchedulerOutput, frames: Sequence[Buffer]) -> RunnerOutput:
        self._apply_decisions(sched)
        failure = self.fail_steps.get(sched.step_id)
        if failure is not None and self.fail_stage == "encoder":
            raise WorkerFailed(failure)
        num_encoded, ec_stats = self._load_and_encode(sched, frames)
        if failure is not None:
            raise WorkerFailed(failure)
        to_sample: list[RequestState] = []
        if self.ready.has_language_model:
            to_sample = self._advance_chunks(sched.num_scheduled_tokens)
        elif any(sched.num_scheduled_tokens.values()):
            raise StepError("tokens scheduled on an encoder-only worker (it has no language model)")
        allowed = self._grammar_rows(sched, frames, {req.req_id for req in to_sample})
        for req in to_sample:
            token = self.next_token(req.req_id, req.token_ids) % self.vocab_size
            if req.req_id in allowed:
                token = _first_allowed(allowed[req.req_id], token, self.vocab_size, req.req_id)
            req.token_ids.append(token)
        return RunnerOutput(
            step_id=sched.step_id,
            req_ids=[req.req_id for req in to_sample],
            sampled_token_ids=[req.token_ids[-1] for req in to_sample],
            logprobs=[self._logprobs(req.sampling, req.token_ids[-1]) for req in to_sample],
            num_encoded_items=num_encoded,
            encoder_seconds=self.encoder_seconds if num_encoded else 0.0,
            forward_seconds=self.forward_seconds if any(sched.num_scheduled_tokens.values()) else 0.0,
            ec_stats=ec_stats,
        )

    def _apply_decisions(self, sched: SchedulerOutput) -> None:
        for mm_hash in sched.free_mm_hashes:
            self.outputs.pop(mm_hash, None)
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in sched.preempted_req_ids:
            if (req := self.requests.get(req_id)) is not None:
                req.block_ids, req.num_computed_tokens = None, 0
        self._append_forced(sched.forced_tokens)
        check_additions(sched, self.requests, self.ready)
        for resumed in sched.resumed_requests:
            req = self.requests[resumed.req_id]
            req.block_ids, req.num_computed_tokens = list(resumed.block_ids), resumed.num_computed_tokens
        for new in sched.new_requests:
            self.requests[new.req_id] = RequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids),
                mm_features=list(new.mm_features),
                sampling=new.sampling,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
        for req_id, block_ids in sched.new_block_ids.items():
            table = self.requests[req_id].block_ids
            assert table is not None  # checked
            table.extend(block_ids)

    def _append_forced(self, forced_tokens: Mapping[str, tuple[int, list[int]]]) -> None:
        """Each entry continues its request's list, or was appended already (a resend); all checked first."""
        entries = [(self.requests.get(r), n, tokens) for r, (n, tokens) in forced_tokens.items()]
        for req, num_before, tokens in entries:
            if (
                req is not None
                and len(req.token_ids) != num_before
                and req.token_ids[num_before:][: len(tokens)] != tokens
            ):
                raise StepError(
                    f"request {req.req_id!r}: forced tokens after {num_before} of {len(req.token_ids)}"
                )
        for req, num_before, tokens in entries:
            if req is not None and len(req.token_ids) == num_before:
                req.token_ids.extend(tokens)

    def _load_and_encode(
        self, sched: SchedulerOutput, frames: Sequence[Buffer]
    ) -> tuple[int, ECStepStats | None]:
        inputs = list(sched.encoder_inputs)
        if self.ec_store is None or self.ec_role is None:
            return self._encode(inputs, frames), None
        counts: Counter[str] = Counter()
        meta = sched.ec_meta if sched.ec_meta is not None else ECConnectorMeta()
        failed = []
        for mm_hash in meta.load_mm_hashes:
            self._check_not_held(mm_hash, "load")
            with contextlib.suppress(ECStoreError):
                if (value := self.ec_store.get(mm_hash)) is not None:
                    self.outputs[mm_hash] = value
                    counts.update(num_loads=1, load_bytes=len(value))
                    continue
            counts["num_load_failures"] += 1
            failed.append(mm_hash)
        loaded = set(meta.load_mm_hashes) - set(failed)
        inputs = [item for item in inputs if item.mm_hash not in loaded]
        unavailable = sorted(set(failed) - {item.mm_hash for item in inputs})
        if unavailable:
            raise WorkerFailed(
                f"encoder outputs not in the store and no vision tower here: {unavailable}", unavailable
            )
        counts["num_fallback_encodes"] += len(failed)
        num_encoded = self._encode(inputs, frames)
        if self.ec_role.saves:
            for mm_hash in dict.fromkeys([*(item.mm_hash for item in inputs), *meta.save_mm_hashes]):
                if mm_hash not in self.outputs:
                    raise StepError(f"asked to save {mm_hash!r}, which this worker does not hold")
                stored = False
                with contextlib.suppress(ECStoreError):
                    stored = self.ec_store.put(mm_hash, self.outputs[mm_hash])
                if stored:
                    counts.update(num_saves=1, save_bytes=len(self.outputs[mm_hash]))
                else:
                    counts["num_save_failures"] += 1
        if not any(counts.values()):
            return num_encoded, None
        return num_encoded, ECStepStats(**counts, load_seconds=[0.0] * counts["num_loads"])

    def _encode(self, inputs: Sequence[EncoderInput], frames: Sequence[Buffer]) -> int:
        if inputs and not self.ready.has_vision_tower:
            raise StepError("items to encode on a worker without a vision tower (--language-model-only)")
        seen: set[str] = set()
        for item in inputs:
            self._check_not_held(item.mm_hash, "encode")
            if item.mm_hash in seen:
                raise StepError(f"mm item {item.mm_hash!r} sent to encode twice in one step")
            seen.add(item.mm_hash)
            names = item.shm.tensors if item.shm is not None else item.tensors
            if item.modality != "image" or "pixel_values" not in names:
                raise StepError(f"cannot encode {item.modality!r} item {item.mm_hash!r} with {sorted(names)}")
            if item.shm is not None:
                self._shm_reader = self._shm_reader or ShmRingReader()
                if (problem := self._shm_reader.check(item.shm)) is not None:
                    raise StepError(f"mm item {item.mm_hash!r}: {problem}")
            for name, ref in item.tensors.items():
                self._check_frame(f"{item.mm_hash!r}/{name}", ref, frames)
        for item in inputs:
            self.outputs[item.mm_hash] = f"output of {item.mm_hash}".encode()
        return len(inputs)

    def _check_not_held(self, mm_hash: str, what: str) -> None:
        if mm_hash in self.outputs:
            raise StepError(f"asked to {what} {mm_hash!r}, which this worker already holds")

    @staticmethod
    def _check_frame(what: str, ref: TensorRef, frames: Sequence[Buffer]) -> None:
        if not 1 <= ref.frame <= len(frames):
            raise StepError(f"{what}: tensor frame {ref.frame} not among the step's {len(frames)} frames")
        if (itemsize := DTYPE_BYTES.get(ref.dtype)) is None:
            raise StepError(f"{what}: unsupported tensor dtype {ref.dtype!r}")
        expected, nbytes = itemsize * math.prod(ref.shape), memoryview(frames[ref.frame - 1]).nbytes
        if nbytes != expected:
            raise StepError(f"{what}: frame {ref.frame} holds {nbytes} bytes, {ref.shape} needs {expected}")

    def _advance_chunks(self, num_scheduled_tokens: Mapping[str, int]) -> list[RequestState]:
        """Checks every scheduled chunk, then advances them all; returns the requests that sample."""
        chunks = []
        for req_id, num_new_tokens in num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None or req.block_ids is None:
                state = "unknown" if req is None else "preempted (no blocks)"
                raise StepError(f"request {req_id!r} is scheduled but {state} on this worker")
            start, num_slots = req.num_computed_tokens, len(req.block_ids) * self.ready.block_size
            end = start + num_new_tokens
            if not start < end <= len(req.token_ids):
                num_known = len(req.token_ids) - start
                raise StepError(
                    f"request {req_id!r} scheduled {num_new_tokens} tokens, {num_known} are computable"
                )
            if end > num_slots:
                raise StepError(f"request {req_id!r} needs {end} KV slots, its blocks hold {num_slots}")
            needed = {f.mm_hash for f in req.mm_features if f.offset < end and f.end > start}
            if missing := sorted(needed - self.outputs.keys()):
                raise StepError(f"request {req_id!r} needs the encoder output of {missing}, not held here")
            chunks.append((req, end))
        for req, end in chunks:  # all checked: the step's state changes only now
            req.num_computed_tokens = end
        return [req for req, end in chunks if end == len(req.token_ids)]

    def _grammar_rows(
        self, sched: SchedulerOutput, frames: Sequence[Buffer], sampling: set[str]
    ) -> dict[str, list[int]]:
        """Each constrained request's bitmask row (int32 words as unsigned ints), checked as the worker
        checks them (workers/runner_requests.py, ``grammar_rows``)."""
        bitmask = sched.grammar_bitmask
        if bitmask is None:
            return {}
        ref, req_ids = bitmask.bitmask, bitmask.req_ids
        if ref.dtype != "int32" or tuple(ref.shape) != (len(req_ids), -(-self.vocab_size // 32)):
            raise StepError(
                f"grammar bitmask {ref.dtype}{list(ref.shape)} does not fit {len(req_ids)} requests"
            )
        if not set(req_ids) <= sampling:
            raise StepError(
                f"grammar bitmask rows for requests that do not sample: {set(req_ids) - sampling}"
            )
        self._check_frame("grammar bitmask", ref, frames)
        words = memoryview(frames[ref.frame - 1]).cast("B").cast("I")
        num_words = ref.shape[1]
        return {req_id: list(words[i * num_words : (i + 1) * num_words]) for i, req_id in enumerate(req_ids)}

    def _logprobs(self, sampling: SamplingParams, token: int) -> TokenLogprobs | None:
        if sampling.num_top_logprobs is None:
            return None
        top = [
            Logprob((token + i) % self.vocab_size, SAMPLED_LOGPROB - i)
            for i in range(sampling.num_top_logprobs)
        ]
        return TokenLogprobs(Logprob(token, SAMPLED_LOGPROB), top)


def _first_allowed(words: Sequence[int], start: int, vocab_size: int, req_id: str) -> int:
    """The first token from ``start`` on (cyclically) whose bit is set in the bitmask row ``words``."""
    for offset in range(vocab_size):
        token = (start + offset) % vocab_size
        if words[token // 32] >> (token % 32) & 1:
            return token
    raise StepError(f"request {req_id!r}: its grammar allows no token")
