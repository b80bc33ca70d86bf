"""What one scheduler step is, on the engine's side: the scheduler's settings for a worker
(``SchedulerConfig``), a step's plan (``StepPlan``, turned into the wire ``SchedulerOutput`` by
engine/step_wire.py) and what ``postprocess`` made of its answer (``StepResult``). Shared by the
continuous-batching scheduler (engine/scheduler.py) and the encoder-only one (engine/encode_scheduler.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from engine.block_pool import BlockHash
from engine.config import SchedulerOptions
from engine.request import MMItem, Request
from wire.protocol import ECConnectorMeta


@dataclass(frozen=True)
class SchedulerConfig(SchedulerOptions):
    """The settings' knobs plus what the worker's ``WorkerReady`` says: its KV pool and whether it can
    encode. Built by the engine for each worker it adopts (``for_worker``)."""

    num_kv_blocks: int
    block_size: int  # tokens per KV block
    can_encode: bool  # False: the worker has no vision tower (encoder outputs come from the store)

    @classmethod
    def for_worker(
        cls, options: SchedulerOptions, *, num_kv_blocks: int, block_size: int, can_encode: bool
    ) -> SchedulerConfig:
        # every field of the base class is one of ours
        return cls(
            **asdict(options),
            num_kv_blocks=num_kv_blocks,
            block_size=block_size,
            can_encode=can_encode,
        )


@dataclass
class StepPlan:
    """What one step runs. Turned into a wire ``SchedulerOutput`` by the engine core."""

    step_id: int
    new_requests: list[Request]
    num_scheduled_tokens: dict[str, int]
    encoder_items: list[tuple[str, MMItem]]  # (mm_hash, item) to encode this step, each once
    free_mm_hashes: list[str]
    finished_req_ids: list[str]
    resumed_requests: list[Request] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)  # blocks appended to running tables
    preempted_req_ids: list[str] = field(default_factory=list)
    # (block id, hash) this step registered in the prefix cache: taken back if the step fails
    cached_blocks: list[tuple[int, BlockHash]] = field(default_factory=list)
    ec_meta: ECConnectorMeta | None = None  # the connector's loads (and saves) of this step
    # ended before the step: an item neither cached, nor in the store, nor encodable here (503)
    unavailable: list[Request] = field(default_factory=list)
    # tokens appended without sampling since the last step: req_id -> (tokens before them, the tokens)
    forced_tokens: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    # the requests whose last known token the step computes: the worker samples one token for each
    sampling_req_ids: list[str] = field(default_factory=list)
    # (source block, destination block, tokens): partial prefix-cache hits, copied before the forward
    kv_copies: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def load_mm_hashes(self) -> list[str]:
        return self.ec_meta.load_mm_hashes if self.ec_meta is not None else []

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    @property
    def sends_nothing(self) -> bool:
        """No tokens and nothing for the worker to drop or append: the step is not sent."""
        return self.is_empty and not (
            self.free_mm_hashes or self.finished_req_ids or self.preempted_req_ids or self.forced_tokens
        )

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass
class StepResult:
    """Outcome of ``postprocess``: new tokens per request and which requests finished."""

    new_token_ids: dict[str, list[int]] = field(default_factory=dict)
    finished: list[Request] = field(default_factory=list)
