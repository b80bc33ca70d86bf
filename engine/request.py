"""Engine-side state of one request (plain Python, no tensors)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from wire.prompt_logprobs import empty_run
from wire.protocol import (
    ErrorInfo,
    FinishReason,
    MMFeature,
    PromptLogprobs,
    SamplingParams,
    ShmItemRef,
)


class OutputGrammar(Protocol):
    """A constrained request's matcher as the scheduler sees it (engine/structured/grammar.py)."""

    @property
    def is_complete(self) -> bool:
        """Nothing more may be generated: the request ends with ``stop``."""
        ...

    @property
    def is_dead_end(self) -> bool:
        """No token is allowed next, and the grammar is not complete: no answer can satisfy it."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advances past a sampled token; False if the grammar does not allow it."""
        ...

    def forced_token(self) -> int | None:
        """The one token the grammar allows next when it allows only one (no stop token), else None."""
        ...


@dataclass(frozen=True)
class MMItem:
    """A processed multimodal item held by the engine: tensor metadata plus the raw frame buffers
    exactly as they arrived from the API (forwarded to the worker without copying), or, with ``shm``,
    only where the item lies in the API's shared-memory ring (the worker reads it there)."""

    modality: str
    num_tokens: int
    dtypes_shapes: dict[str, tuple[str, tuple[int, ...]]]
    buffers: dict[str, memoryview]
    shm: ShmItemRef | None = None

    @property
    def num_bytes(self) -> int:
        return sum(buf.nbytes for buf in self.buffers.values())


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, its KV freed; recomputed when resumed
    FINISHED = "finished"


@dataclass
class Request:
    req_id: str
    client: bytes  # identity of the API process that sent it
    prompt_token_ids: list[int]
    sampling: SamplingParams
    mm_features: list[MMFeature]  # placements (tensors stripped)
    mm_items: dict[str, MMItem]  # mm_hash -> item, resolved at admission
    cache_salt: str | None = None  # the request's cache scope: its first KV block's hash covers it
    priority: int = 0  # lower first, under --scheduling-policy priority (engine/request_queue.py)
    arrival_order: int = 0  # its place among the scheduler's requests by arrival (set when it is added)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # by steps the worker answered
    # scheduled in steps sent and not answered yet: the next step starts after them (docs/architecture.md,
    # "Engine step"); and the tokens those steps sample, which the worker knows and the engine not yet
    num_inflight_tokens: int = 0
    num_pending_outputs: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # mm_hashes whose encoder-cache entry this request currently uses (acquired, not yet released)
    encoder_hashes_in_use: set[str] = field(default_factory=set)
    # mm_hashes admitted without their processed item (a media id whose encoder output is cached): used
    # from admission to the end, through preemption, since nothing could encode them again
    encoder_only_hashes: set[str] = field(default_factory=set)
    # mm_hashes already looked up once (an item that waits for budget is not counted again)
    encoder_hashes_queried: set[str] = field(default_factory=set)
    sent_to_worker: bool = False
    # engine-side times (time.monotonic()): its arrival, its first step, its first output token
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # mm_hash -> whether the encoder-cache connector's store held the item when first asked
    ec_in_store: dict[str, bool] = field(default_factory=dict)
    # structured output: True from admission until its grammar is compiled (it waits in the queue
    # without being scheduled); then ``grammar`` masks and follows every token it samples
    awaits_grammar: bool = False
    grammar: OutputGrammar | None = None
    error: ErrorInfo | None = None  # why it ended, when that is an error found while it ran
    # mm_hash -> end of its last placement: an image may appear several times in one prompt, and its
    # encoder output is needed until the last of them is computed
    mm_last_end: dict[str, int] = field(init=False)
    # where it asked for them (``sampling.num_prompt_logprobs``): its prompt tokens' logprobs from the
    # second token on, as one run, until they are sent (the worker's runs joined, each token kept once:
    # a resumed request computes them again), and how many were sent
    prompt_logprobs: PromptLogprobs | None = field(init=False)
    num_prompt_logprobs_sent: int = field(init=False)

    def __post_init__(self) -> None:
        num_top = self.sampling.num_prompt_logprobs
        self.prompt_logprobs = empty_run(1, num_top) if num_top is not None else None
        self.num_prompt_logprobs_sent = 0
        self.mm_last_end = {}
        for f in self.mm_features:
            self.mm_last_end[f.mm_hash] = max(self.mm_last_end.get(f.mm_hash, 0), f.end)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def _num_prompt_logprobs(self) -> int:
        """Prompt tokens whose logprobs it has had: sent, or kept to send."""
        kept = self.prompt_logprobs.count if self.prompt_logprobs is not None else 0
        return self.num_prompt_logprobs_sent + kept

    def follows_on(self, run: PromptLogprobs) -> bool:
        """Whether ``run`` is prompt logprobs this request asked for that leave no gap after those it
        has had (a resumed request's come again), stay within its prompt and have its number of top
        tokens."""
        return (
            self.prompt_logprobs is not None
            and run.num_top == self.prompt_logprobs.num_top
            and run.first <= self._num_prompt_logprobs + 1
            and run.first + run.count <= self.num_prompt_tokens
        )

    def add_prompt_logprobs(self, run: PromptLogprobs) -> None:
        """Keeps what a run that ``follows_on`` adds to the prompt logprobs it has had."""
        assert self.prompt_logprobs is not None
        self.prompt_logprobs = self.prompt_logprobs.then(run.after(self._num_prompt_logprobs + 1 - run.first))

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt logprobs kept, as one run, for its output (its first: all of them, its prompt
        computed); they are not kept after that. None where it did not ask, or none are kept."""
        run = self.prompt_logprobs
        if run is None or not run.count:
            return None
        self.num_prompt_logprobs_sent += run.count
        self.prompt_logprobs = empty_run(self.num_prompt_logprobs_sent + 1, run.num_top)
        return run

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt is computed whole, never read from the prefix cache: logprobs need its logits."""
        return self.prompt_logprobs is not None

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
