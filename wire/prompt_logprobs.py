"""A run of a prompt's logprobs as it crosses the pipes (worker → engine → API: docs/architecture.md,
"Prompt logprobs"), a column per field: a scored prompt is thousands of positions, and lists of numbers
encode and decode many times faster than a struct per position, in the worker, the engine and the API
alike."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from wire.bounds import MAX_TOP_LOGPROBS, PosInt, TokenId


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Position ``i`` of the run is prompt token ``first + i`` (the first prompt token has none:
    ``first`` >= 1): its logprob given the tokens before it (``logprobs[i]``), its rank there
    (``ranks[i]``, 1: the most likely), and that position's ``num_top`` most likely tokens, best first
    (``top_ids`` and ``top_logprobs``, ``num_top`` per position: ``top(i)``)."""

    first: PosInt
    num_top: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
    logprobs: list[float]
    ranks: list[PosInt]
    top_ids: list[TokenId]
    top_logprobs: list[float]

    @property
    def count(self) -> int:
        return len(self.logprobs)

    @property
    def is_whole(self) -> bool:
        """Every column holds ``count`` positions (a run that does not is a bad message)."""
        num = len(self.logprobs)
        return len(self.ranks) == num and len(self.top_ids) == len(self.top_logprobs) == num * self.num_top

    def top(self, i: int) -> tuple[list[int], list[float]]:
        """Position ``i``'s most likely tokens and their logprobs, best first."""
        k = self.num_top
        return self.top_ids[i * k : (i + 1) * k], self.top_logprobs[i * k : (i + 1) * k]

    def after(self, skip: int) -> PromptLogprobs:
        """The run from its position ``skip`` on."""
        if skip <= 0:
            return self
        k = self.num_top
        return PromptLogprobs(
            self.first + skip,
            k,
            self.logprobs[skip:],
            self.ranks[skip:],
            self.top_ids[skip * k :],
            self.top_logprobs[skip * k :],
        )

    def then(self, more: PromptLogprobs) -> PromptLogprobs:
        """This run and ``more``, which starts where it ends, as one."""
        assert more.first == self.first + self.count and more.num_top == self.num_top
        return PromptLogprobs(
            self.first,
            self.num_top,
            self.logprobs + more.logprobs,
            self.ranks + more.ranks,
            self.top_ids + more.top_ids,
            self.top_logprobs + more.top_logprobs,
        )


def empty_run(first: int, num_top: int) -> PromptLogprobs:
    """A run of no position, at prompt token ``first``."""
    return PromptLogprobs(first, num_top, [], [], [], [])
