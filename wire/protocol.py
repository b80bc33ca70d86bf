"""Wire contract between the API, engine and worker processes.

Every message is a tagged ``msgspec.Struct`` encoded with msgpack into the first ZeroMQ frame of a
multipart message; tensors travel as the following frames, untouched (no pickle, no copies into
msgpack). A ``TensorRef`` names the frame that holds a tensor's bytes::

    frame 0            frame 1          frame 2
    msgpack(message)   pixel bytes A    pixel bytes B ...
       └─ MMFeature.tensors["pixel_values"] = TensorRef(dtype, shape, frame=1)

    API ──AddRequest/Abort/ResetCaches/Drain/Shutdown──▶ engine ──SchedulerOutput──▶ worker
    API ◀──EngineReady/EngineOutputs/EngineDead───────── engine ◀──WorkerReady/RunnerOutput── worker

This module is the only piece of ``engine`` that ``app`` and ``workers`` import. It imports neither
torch nor numpy.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from wire.bounds import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROB_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    Int64,
    NonNegInt,
    PosInt,
    TokenId,
)
from wire.prompt_logprobs import PromptLogprobs


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class TensorRef(msgspec.Struct, frozen=True, array_like=True):
    """A tensor carried in frame ``frame`` of the same multipart message (frame 0 is the msgpack
    message itself, so tensor frames are numbered from 1)."""

    dtype: str  # numpy dtype name, e.g. "float32"
    shape: tuple[int, ...]
    frame: int


class ShmTensor(msgspec.Struct, frozen=True, array_like=True):
    """A tensor inside an item of a shared-memory ring: ``offset`` bytes from the start of the item's
    payload (see ``wire/shm_ring.py``)."""

    dtype: str
    shape: tuple[int, ...]
    offset: int


class ShmItemRef(msgspec.Struct, frozen=True):
    """Where a processed item lies in the API process's shared-memory ring (``--mm-processor-cache-type
    shm``): ring ``ring`` (a /dev/shm name), a chunk at byte ``offset`` whose header must carry the
    monotonic ``item_id`` and payload size ``size``, or the reference is stale. The API keeps the chunk
    from being overwritten until the engine's final output for every request that carried it."""

    ring: str
    offset: int
    item_id: int
    size: int
    tensors: dict[str, ShmTensor]


class SamplingParams(msgspec.Struct, frozen=True):
    max_tokens: PosInt
    temperature: Annotated[float, Meta(ge=0.0, le=1e6)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=1, le=INT64_MAX)] | None = None  # None: off
    seed: Int64 | None = None
    min_tokens: Annotated[int, Meta(ge=0, le=INT64_MAX)] = 0
    ignore_eos: bool = False
    eos_token_ids: tuple[TokenId, ...] = ()
    stop_token_ids: tuple[TokenId, ...] = ()
    # None: no logprobs at all; 0: only the sampled token's
    num_top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # with logprobs, these ids' logprobs at each position in place of the top ones (vLLM's)
    logprob_token_ids: (
        Annotated[tuple[TokenId, ...], Meta(min_length=1, max_length=MAX_LOGPROB_TOKEN_IDS)] | None
    ) = None
    # None: none; k: each prompt token's after the first, with its position's k most likely tokens
    # (the engine then computes the whole prompt, without prefix-cache hits)
    num_prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # penalties and biases, as vLLM applies them (workers/sampler.py); the defaults are off
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0  # x count of the id in the output
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0  # once if the id is in the output
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=1e6)] = 1.0  # ids in prompt or output
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    logit_bias: dict[TokenId, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    allowed_token_ids: tuple[TokenId, ...] | None = None  # None: every id
    # vLLM's bad_words as token sequences: a sequence's last id is masked where the output ends with
    # the ids before it (always, for a one-token sequence)
    bad_words: tuple[Annotated[tuple[TokenId, ...], Meta(min_length=1)], ...] | None = None

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler must count the request's tokens (workers/sampler.py)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)


class ConstraintKind(enum.StrEnum):
    """What a request's output must match (docs/api.md, "Structured outputs")."""

    JSON_SCHEMA = "json_schema"  # spec: the schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; spec is empty
    REGEX = "regex"  # spec: the regular expression
    CHOICE = "choice"  # spec: a JSON list of the strings allowed, one of which is the whole output
    GRAMMAR = "grammar"  # spec: an EBNF grammar as xgrammar reads it (GBNF), rule ``root`` first
    # spec: JSON {"format": xgrammar's structural-tag format, "tools": OpenAI function tools,
    # "tool_choice": "auto" | "required" | a named function, "parallel_tool_calls": bool}
    TOOL_CALLS = "tool_calls"


MAX_CONSTRAINT_CHARS = 65536  # a longer schema, regex or grammar is refused at the HTTP edge


class Constraint(msgspec.Struct, frozen=True):
    """A request's structured-output constraint, as the engine compiles it into a grammar
    (engine/structured/). Two requests with equal constraints share one compiled grammar."""

    kind: ConstraintKind
    spec: Annotated[str, Meta(max_length=MAX_CONSTRAINT_CHARS)] = ""
    # JSON kinds: whitespace between elements is free but bounded (docs/api.md); False: none beyond the
    # separators ", " and ": " (vLLM's disable_any_whitespace)
    any_whitespace: bool = True

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the compiled-grammar cache is keyed by."""
        return (self.kind.value, self.spec, self.any_whitespace)


class MMFeature(msgspec.Struct, frozen=True):
    """One multimodal item placed in a prompt.

    ``tensors`` is None when the item travels as a key only (the API's mirror says the engine's
    receiver cache holds it). ``store`` tells the engine to insert the item into its receiver cache.

    The item covers the prompt tokens ``[offset, end)``. Usually those are all placeholders, one per row
    of its encoder output (``num_tokens``). A family may write text between an item's placeholders
    (Qwen3-VL: a timestamp before each frame group of a video); then ``num_span_tokens`` counts the
    whole range, and the placeholders are the tokens in it with the family's placeholder id, in order::

        offset                                                        end
        <0.5 seconds><|vision_start|>▮▮▮▮<|vision_end|><1.5 seconds><|vision_start|>▮▮▮▮...
    """

    mm_hash: Annotated[str, Meta(min_length=1, max_length=256)]
    offset: NonNegInt  # index of the first prompt token the item covers (its first placeholder)
    num_tokens: PosInt  # number of placeholder tokens (= encoder output positions)
    modality: Literal["image", "video"] = "image"
    tensors: dict[str, TensorRef] | None = None
    store: bool = False
    # Instead of ``tensors``: the item lies in the sender's shared-memory ring (not stored in the
    # receiver cache; the worker reads it in place).
    shm: ShmItemRef | None = None
    # The family's grid of the item's placeholders (Qwen: (t, h, w) in patches, which decides their
    # M-RoPE positions); empty where positions do not depend on it. Travels with key-only items too.
    grid_thw: tuple[int, ...] = ()
    num_span_tokens: NonNegInt = 0  # prompt tokens the item covers; 0: num_tokens (placeholders only)
    # Qwen2.5-VL videos: seconds between temporal groups (M-RoPE spaces them by it); None elsewhere
    second_per_grid_t: Annotated[float, Meta(gt=0.0, le=3600.0)] | None = None
    # A media id's item the sender's mirror does not hold (bound through another API process): key only,
    # outside the mirror's decisions; the engine takes it from any receiver-cache partition that holds
    # it, touching none, or reports it missing.
    borrowed: bool = False

    @property
    def end(self) -> int:
        """One past the last prompt token the item covers."""
        return self.offset + (self.num_span_tokens or self.num_tokens)


# ---------------------------------------------------------------- API -> engine


class AddRequest(msgspec.Struct, frozen=True, tag="add"):
    """A new request. ``evicted_mm_hashes`` are the receiver-cache keys the API's mirror evicted since
    its previous message; the engine drops them before it applies ``mm_features`` in order."""

    req_id: Annotated[str, Meta(min_length=1, max_length=256)]
    prompt_token_ids: Annotated[list[TokenId], Meta(min_length=1)]
    sampling: SamplingParams
    mm_features: list[MMFeature] = []
    evicted_mm_hashes: list[str] = []
    # the request's cache scope (``CacheScope.salt``, a digest): folded into its first KV block's hash,
    # so requests of different salts share no prefix-cache hit (their mm_hashes already differ)
    cache_salt: Annotated[str, Meta(max_length=128)] | None = None
    # structured output: the request waits for its grammar (compiled off the step loop), then every
    # token it samples is masked by it (docs/architecture.md, "Structured outputs")
    constraint: Constraint | None = None
    # a later choice of an ``n > 1`` request: part of a request the engine admitted (its first choice),
    # so not counted against --max-waiting-requests, which admits or refuses a request as a whole
    later_choice: bool = False
    # the order it is taken in under ``--scheduling-policy priority`` (lower first); 0 under fcfs
    priority: Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)] = 0


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    """Sent by an API process when it connects and then every few seconds: the engine's ROUTER only
    learns a sender's identity from a message, and answers each Hello with EngineReady (whose epoch
    tells the API whether the engine restarted and its mirror must be emptied)."""


class Abort(msgspec.Struct, frozen=True, tag="abort"):
    req_ids: list[str]


class ResetCaches(msgspec.Struct, frozen=True, tag="reset"):
    """Empties the sender's receiver-cache partition and, with ``encoder``, every freeable
    encoder-cache entry (an API process that closes sends it with ``encoder=False``)."""

    encoder: bool = True


class Drain(msgspec.Struct, frozen=True, tag="drain"):
    """Stop admitting: from now on every ``AddRequest`` is answered at once with a 503
    ``server_shutting_down`` error (its mirror decisions still applied), while the requests already held
    run to the end. A ``Shutdown`` after ``Drain`` stops the engine once it holds no request."""


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    """Stop the engine now; after ``Drain``, once the requests it holds have finished."""


EngineInbound = Hello | AddRequest | Abort | ResetCaches | Drain | Shutdown


# ---------------------------------------------------------------- engine -> API


class Logprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    sampled: Logprob
    top: list[Logprob]


class ErrorInfo(msgspec.Struct, frozen=True):
    message: str
    code: str  # OpenAI error code, e.g. "context_length_exceeded"
    http_status: int = 400
    missing_mm_hashes: list[str] = []  # safety net: the receiver cache lacked these
    param: str | None = None  # the request field the error is about, where one is


class RequestOutput(msgspec.Struct, frozen=True):
    req_id: str
    new_token_ids: list[int] = []
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    # with the first output token, where the request asked for them: every prompt token's from the second
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    error: ErrorInfo | None = None


class EngineStats(msgspec.Struct, frozen=True):
    """Cumulative counters and current gauges of the engine and its workers, plus the observations
    made since the previous stats message (for histograms)."""

    counters: dict[str, float]
    gauges: dict[str, float]
    observations: dict[str, list[float]]


class EngineOutputs(msgspec.Struct, frozen=True, tag="outputs"):
    outputs: list[RequestOutput]
    stats: EngineStats | None = None


class EngineReady(msgspec.Struct, frozen=True, tag="ready"):
    epoch: str  # new for every engine start; a new epoch empties the API's mirror


class EngineDead(msgspec.Struct, frozen=True, tag="dead"):
    """The engine stopped, or lost its worker (every request it held was failed with 503
    ``worker_unavailable`` first). It answers no ``Hello`` until it is ready again; then an
    ``EngineReady`` with a new epoch is sent to every known API process."""

    reason: str


EngineOutbound = EngineOutputs | EngineReady | EngineDead


# ---------------------------------------------------------------- engine <-> worker


class NewRequestData(msgspec.Struct, frozen=True):
    """Sent once, in the step a request is first scheduled. ``num_computed_tokens`` tokens already have
    KV in ``block_ids`` (prefix-cache hits); the worker computes from there."""

    req_id: str
    prompt_token_ids: list[int]
    mm_features: list[MMFeature]  # placements only (tensors travel as EncoderInput)
    sampling: SamplingParams
    block_ids: list[int] = []
    num_computed_tokens: int = 0


class ResumedRequestData(msgspec.Struct, frozen=True):
    """A preempted request scheduled again: a fresh block table; the worker recomputes its tokens
    (prompt + the outputs it already sampled) from ``num_computed_tokens``."""

    req_id: str
    block_ids: list[int]
    num_computed_tokens: int


class EncoderInput(msgspec.Struct, frozen=True):
    """An item to encode this step: its tensors are frames of the step's message, or (``shm``) lie in
    an API process's shared-memory ring, read in place."""

    mm_hash: str
    modality: str
    tensors: dict[str, TensorRef] = {}
    shm: ShmItemRef | None = None


class ECConnectorMeta(msgspec.Struct, frozen=True):
    """The encoder-cache connector's part of one step (``build_connector_meta``): the worker loads
    ``load_mm_hashes`` from the external store into its encoder store before embeddings are gathered.
    An item to load that also comes as an ``EncoderInput`` (this instance has the vision tower) is
    encoded instead when its load fails; one that does not fails the step with 503
    ``encoder_output_unavailable``. ``save_mm_hashes``: outputs already in the worker's encoder store
    that a producer saves again (the store lost them)."""

    load_mm_hashes: list[str] = []
    save_mm_hashes: list[str] = []


class GrammarBitmask(msgspec.Struct, frozen=True):
    """The tokens each constrained request may sample this step: row i (int32 words, bit j of word w set
    = token 32 * w + j allowed, xgrammar's layout) is for ``req_ids[i]``, one row per constrained request
    that samples in the step. The tensor is a frame of the step's message."""

    req_ids: list[str]
    bitmask: TensorRef


class SchedulerOutput(msgspec.Struct, frozen=True, tag="sched"):
    """One step. ``num_scheduled_tokens`` maps every request that runs this step to how many of its
    tokens it computes; the worker samples for those whose step computes their last known token (the
    end of the prompt, then each newest output; a resumed request first recomputes all of them).

    Before running the step the worker drops ``free_mm_hashes`` (encoder outputs),
    ``finished_req_ids`` (all state) and ``preempted_req_ids`` (block tables only: token lists and
    sampling state stay for the resume), appends ``forced_tokens`` to their requests' token lists, then
    applies ``resumed_requests``, ``new_requests`` and ``new_block_ids`` (blocks appended to running
    requests' tables), and makes ``kv_copies``: each (source block, destination block, n) copies the
    K/V of the source's first n slots, every layer, into the destination's (a prefix-cache hit of a
    block's first tokens; the destination is a table's block that the step goes on filling)."""

    step_id: int
    new_requests: list[NewRequestData]
    num_scheduled_tokens: dict[str, int]
    encoder_inputs: list[EncoderInput]
    free_mm_hashes: list[str]
    finished_req_ids: list[str]
    resumed_requests: list[ResumedRequestData] = []
    new_block_ids: dict[str, list[int]] = {}
    preempted_req_ids: list[str] = []
    ec_meta: ECConnectorMeta | None = None  # None: no connector, or nothing to load or save
    grammar_bitmask: GrammarBitmask | None = None  # None: no constrained request samples this step
    # Tokens the engine appended to requests without sampling (a grammar that allows one token only):
    # req_id -> (the request's number of tokens before them, the tokens). Applied once: an entry the
    # worker's list already holds there (a resend after a failed step) changes nothing.
    forced_tokens: dict[str, tuple[int, list[TokenId]]] = {}
    kv_copies: list[tuple[NonNegInt, NonNegInt, PosInt]] = []

    def copy_destinations(self, block_size: int) -> dict[int, int]:
        """The blocks a ``kv_copies`` entry may fill, each with its n: the block where a new or resumed
        request of this step starts computing mid-block, and the tokens before that in it."""
        added: list[NewRequestData | ResumedRequestData] = [*self.new_requests, *self.resumed_requests]
        return {
            data.block_ids[data.num_computed_tokens // block_size]: data.num_computed_tokens % block_size
            for data in added
            if data.num_computed_tokens % block_size
        }


class WorkerShutdown(msgspec.Struct, frozen=True, tag="wshutdown"):
    pass


WorkerInbound = SchedulerOutput | WorkerShutdown


class WorkerReady(msgspec.Struct, frozen=True, tag="wready"):
    """Sent once the model is loaded and the KV pool allocated: the engine sizes its block
    bookkeeping from ``num_kv_blocks`` x ``block_size``."""

    device: str
    dtype: str
    num_kv_blocks: int = 0
    block_size: int = 16
    has_vision_tower: bool = True  # False: --language-model-only (encoder outputs come from the store)
    has_language_model: bool = True  # False: --encoder-only (encodes and saves, generates nothing)
    vocab_size: int = 0  # the language model's; token ids at or above it are refused at admission


class ECStepStats(msgspec.Struct, frozen=True):
    """What the worker's encoder-cache connector did in one step (becomes the ``mmserve_ec_*``
    metrics). A failed load was encoded locally instead (``num_fallback_encodes``); a failed save is
    counted and forgotten."""

    num_loads: int = 0
    num_load_failures: int = 0
    num_fallback_encodes: int = 0
    num_saves: int = 0
    num_save_failures: int = 0
    load_bytes: int = 0
    save_bytes: int = 0
    load_seconds: list[float] = []  # one per item loaded


class RunnerOutput(msgspec.Struct, frozen=True, tag="runner"):
    step_id: int
    req_ids: list[str]  # requests that sampled a token this step
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    num_encoded_items: int
    encoder_seconds: float
    forward_seconds: float
    step_seconds: float = 0.0  # the worker's whole time on the step, from receiving it to replying
    ec_stats: ECStepStats | None = None
    num_bad_messages: int = 0  # messages from the engine this worker dropped so far (all steps)
    # the prompt logprobs this step computed, per request that asked (a run of its prompt's tokens)
    prompt_logprobs: dict[str, PromptLogprobs] = {}


UNDECODABLE_STEP_ID = -1  # WorkerError.step_id when frame 0 was not a valid WorkerInbound message


class WorkerError(msgspec.Struct, frozen=True, tag="werror"):
    """The step ``step_id`` failed (``UNDECODABLE_STEP_ID``: the worker could not decode the message,
    which the engine takes as the step it is waiting for). A reply for an older step than the one
    awaited is late (that step timed out): the engine discards it, as it does a late ``RunnerOutput``."""

    step_id: int
    message: str
    # the step needed these encoder outputs, the store could not give them and this worker cannot
    # encode (--language-model-only): its requests end with 503 encoder_output_unavailable
    unavailable_mm_hashes: list[str] = []
    num_bad_messages: int = 0  # as RunnerOutput's


WorkerOutbound = WorkerReady | RunnerOutput | WorkerError


_encoder = msgspec.msgpack.Encoder()
_engine_in = msgspec.msgpack.Decoder(EngineInbound)
_engine_out = msgspec.msgpack.Decoder(EngineOutbound)
_worker_in = msgspec.msgpack.Decoder(WorkerInbound)
_worker_out = msgspec.msgpack.Decoder(WorkerOutbound)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_engine_inbound(buf: bytes | memoryview) -> EngineInbound:
    return _engine_in.decode(buf)


def decode_engine_outbound(buf: bytes | memoryview) -> EngineOutbound:
    return _engine_out.decode(buf)


def decode_worker_inbound(buf: bytes | memoryview) -> WorkerInbound:
    return _worker_in.decode(buf)


def decode_worker_outbound(buf: bytes | memoryview) -> WorkerOutbound:
    return _worker_out.decode(buf)
