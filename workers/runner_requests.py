"""The worker's view of its requests, and the checks a step passes before it changes any of them.

The worker tracks, per request, its tokens, how many of them have K/V in its blocks, its block table
and its positions; everything else comes from the engine's ``SchedulerOutput``. A step that contradicts
that state (an unknown request, blocks outside the pool, more tokens than are known) raises
``StepError`` before anything changes, so a failed step leaves every request as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from wire.protocol import MMFeature, NewRequestData, ResumedRequestData, SamplingParams, SchedulerOutput
from workers.attention import SeqSpan
from workers.families.model import RequestPositions
from workers.frames import Buffer, tensor_from_frame
from workers.sampler import TokenHistory

# the family's positions of a prompt's tokens, from its items' placements
PromptPositions = Callable[[Sequence[int], list[MMFeature]], RequestPositions]


@dataclass(frozen=True)
class Placement:
    """One item in a request's prompt. ``rows`` (when the item's span holds text between its
    placeholders): each encoder output row's position in the prompt, relative to ``feature.offset``;
    None when the span is all placeholders, row i at offset + i."""

    feature: MMFeature
    rows: torch.Tensor | None = None


@dataclass(frozen=True)
class Layout:
    """What a new request's prompt fixes: its positions and where each item's rows go."""

    positions: RequestPositions
    placements: list[Placement]


class StepError(ValueError):
    """The step contradicts the worker's state (unknown request, too many tokens, bad placement)."""


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]  # prompt, then every token sampled for it
    num_prompt_tokens: int
    mm_features: list[MMFeature]
    sampling: SamplingParams
    generator: torch.Generator
    block_ids: list[int] | None  # None while preempted: the engine took its blocks back
    positions: RequestPositions  # rotary positions of its tokens, fixed by the prompt
    placements: list[Placement]  # its items, in prompt order
    num_computed_tokens: int = 0  # leading tokens whose K/V is in its blocks
    # its next token while the step that samples it is not finished: (that step's tokens on the
    # device, its row); a step launched meanwhile computes it from there (ModelRunner.launch)
    pending: tuple[torch.Tensor, int] | None = None
    history: TokenHistory = field(init=False)  # its tokens as the penalties count them

    def __post_init__(self) -> None:
        self.history = TokenHistory(self.token_ids, self.num_prompt_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(frozen=True)
class Pool:
    """What the checks need of the KV pool: its size (None: no language model, so no pool)."""

    num_blocks: int | None
    block_size: int


def check_additions(
    sched: SchedulerOutput,
    requests: dict[str, RequestState],
    pool: Pool,
    prompt_positions: PromptPositions,
    placeholder_token_ids: frozenset[int],
) -> dict[str, Layout]:
    """Raises StepError before any state changes; returns the new requests' layouts (positions built
    from their placements, which checks them too)."""
    layouts: dict[str, Layout] = {}
    if pool.num_blocks is None and (
        sched.new_requests or sched.resumed_requests or sched.new_block_ids or sched.kv_copies
    ):
        raise StepError("requests sent to an encoder-only worker (it has no language model)")
    for resumed in sched.resumed_requests:
        req = requests.get(resumed.req_id)
        if req is None or req.block_ids is not None:
            state = "unknown" if req is None else "not preempted"
            raise StepError(f"request {resumed.req_id!r} is resumed but {state} on this worker")
        _check_blocks(resumed.req_id, resumed.block_ids, pool)
        _check_num_computed(resumed, len(req.token_ids), pool)
    new_ids = set()
    for new in sched.new_requests:
        if new.req_id in requests or new.req_id in new_ids:
            raise StepError(f"request {new.req_id!r} is already running on this worker")
        new_ids.add(new.req_id)
        for feat in new.mm_features:
            if feat.offset < 0 or feat.end > len(new.prompt_token_ids):
                raise StepError(
                    f"mm item {feat.mm_hash!r} at {feat.offset}+{feat.num_tokens} is outside the prompt"
                )
        try:
            positions = prompt_positions(new.prompt_token_ids, list(new.mm_features))
        except ValueError as exc:
            raise StepError(f"request {new.req_id!r}: {exc}") from exc
        placements = [_placement(new.prompt_token_ids, f, placeholder_token_ids) for f in new.mm_features]
        layouts[new.req_id] = Layout(positions, sorted(placements, key=lambda p: p.feature.offset))
        _check_blocks(new.req_id, new.block_ids, pool)
        _check_num_computed(new, len(new.prompt_token_ids), pool)
    resumed_ids = {r.req_id for r in sched.resumed_requests}
    for req_id, block_ids in sched.new_block_ids.items():
        req = requests.get(req_id)
        if req_id not in new_ids | resumed_ids and (req is None or req.block_ids is None):
            state = "unknown" if req is None else "preempted"
            raise StepError(f"request {req_id!r} gets new blocks but is {state} on this worker")
        _check_blocks(req_id, block_ids, pool)
    # a prefix copy fills the first slots of the block a new or resumed request starts in, no more: any
    # other would overwrite K/V that another request reads
    starts = sched.copy_destinations(pool.block_size) if sched.kv_copies else {}
    for source, destination, num_tokens in sched.kv_copies:
        _check_blocks("(a prefix copy)", [source, destination], pool)
        if source == destination or starts.get(destination) != num_tokens:
            raise StepError(
                f"a prefix copy of {num_tokens} tokens from block {source} into block {destination}, "
                "where no request of the step starts after as many"
            )
    return layouts


def _placement(prompt_token_ids: list[int], feature: MMFeature, placeholders: frozenset[int]) -> Placement:
    if not feature.num_span_tokens:
        return Placement(feature)
    span = torch.tensor(prompt_token_ids[feature.offset : feature.end])
    rows = torch.isin(span, torch.tensor(sorted(placeholders))).nonzero().flatten()
    if len(rows) != feature.num_tokens:
        raise StepError(
            f"mm item {feature.mm_hash!r}: {len(rows)} placeholders in its span, not {feature.num_tokens}"
        )
    return Placement(feature, rows)


def _check_blocks(req_id: str, block_ids: list[int], pool: Pool) -> None:
    assert pool.num_blocks is not None  # (checked first: no blocks without a pool)
    bad = [b for b in block_ids if not 0 <= b < pool.num_blocks]
    if bad:
        raise StepError(f"request {req_id!r}: block ids {bad} outside the pool of {pool.num_blocks}")


def _check_num_computed(data: NewRequestData | ResumedRequestData, num_tokens: int, pool: Pool) -> None:
    # At least one token is left to compute: sampling needs the logits of the last one.
    if not 0 <= data.num_computed_tokens < num_tokens:
        raise StepError(
            f"request {data.req_id!r}: {data.num_computed_tokens} computed tokens of {num_tokens}"
        )
    if data.num_computed_tokens > len(data.block_ids) * pool.block_size:
        raise StepError(
            f"request {data.req_id!r}: {data.num_computed_tokens} computed tokens but only "
            f"{len(data.block_ids)} blocks"
        )


def append_forced_tokens(
    forced_tokens: Mapping[str, tuple[int, list[int]]], requests: Mapping[str, RequestState]
) -> None:
    """Appends the tokens the engine forced (``SchedulerOutput.forced_tokens``) to their requests'
    token lists; an entry a list already holds there (resent after a failed step) changes nothing, and
    an unknown request is ignored (it ended). ``StepError``, before anything changes, when an entry
    does not continue its list."""
    for req_id, (num_before, tokens) in forced_tokens.items():
        req = requests.get(req_id)
        if (
            req is None
            or len(req.token_ids) == num_before
            or req.token_ids[num_before:][: len(tokens)] == tokens
        ):
            continue
        raise StepError(
            f"request {req_id!r}: forced tokens after {num_before} of its {len(req.token_ids)} tokens"
        )
    for req_id, (num_before, tokens) in forced_tokens.items():
        req = requests.get(req_id)
        if req is not None and len(req.token_ids) == num_before:
            req.token_ids.extend(tokens)


def step_spans(
    num_scheduled_tokens: dict[str, int], requests: dict[str, RequestState], block_size: int
) -> list[SeqSpan]:
    """Each scheduled request's slice of the step, checked against what it knows and the blocks it has."""
    spans = []
    for req_id, num_new_tokens in num_scheduled_tokens.items():
        req = requests.get(req_id)
        if req is None:
            raise StepError(f"request {req_id!r} is scheduled but unknown to this worker")
        if req.block_ids is None:
            raise StepError(f"request {req_id!r} is scheduled but preempted (no blocks) on this worker")
        num_known = len(req.token_ids) + (req.pending is not None) - req.num_computed_tokens
        if not 0 < num_new_tokens <= num_known:
            raise StepError(
                f"request {req_id!r} scheduled {num_new_tokens} tokens, {num_known} are computable"
            )
        num_tokens = req.num_computed_tokens + num_new_tokens
        if num_tokens > len(req.block_ids) * block_size:
            raise StepError(
                f"request {req_id!r} needs {num_tokens} KV slots, its {len(req.block_ids)} blocks "
                f"hold {len(req.block_ids) * block_size}"
            )
        spans.append(SeqSpan(req_id, req.num_computed_tokens, num_new_tokens, req.block_ids))
    return spans


def grammar_rows(
    sched: SchedulerOutput, frames: Sequence[Buffer], vocab_size: int
) -> dict[str, torch.Tensor]:
    """Each constrained request's grammar bitmask row of the step (a view of the frame). ``StepError`` if
    the bitmask does not fit: int32, one row per named request, ``ceil(vocab_size / 32)`` words."""
    bitmask = sched.grammar_bitmask
    if bitmask is None:
        return {}
    ref, req_ids = bitmask.bitmask, bitmask.req_ids
    num_words = -(-vocab_size // 32)
    if (
        ref.dtype != "int32"
        or tuple(ref.shape) != (len(req_ids), num_words)
        or len(set(req_ids)) != len(req_ids)
    ):
        raise StepError(
            f"grammar bitmask {ref.dtype}{list(ref.shape)} for {len(req_ids)} requests does not fit "
            f"a vocabulary of {vocab_size}"
        )
    try:
        rows = tensor_from_frame(ref, frames)
    except ValueError as exc:
        raise StepError(f"grammar bitmask: {exc}") from exc
    return {req_id: rows[i] for i, req_id in enumerate(req_ids)}
