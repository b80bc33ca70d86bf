"""The one near-tie rule of every tier's parity check against transformers' ``generate``
(tests/integration/runner_support.py, tests/e2e/parity.py).

Greedy output must equal the oracle's token for token. Two computations of the same logits in fp32 (a
batched, paged forward and ``generate``'s) agree to a few ulp, not bit for bit, so where the oracle's
best two tokens are closer than that, argmax may pick either. The rule at the first position where the
served token differs from the oracle's:

- the served token must be the oracle's **runner-up** there (its best token other than the oracle's own
  choice; any of several exactly tied runners-up), and
- the oracle's logprob gap between its token and the served one must be under the tier's bound.

Anything else fails. Once accepted, the two sequences have different prefixes, so nothing after that
position can be compared: the check stops there by design. Every acceptance is a ``NearTieWarning``, which
pytest lists in its warnings summary with the position and the gap, so a run shows how often parity was
excused.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch


class NearTieWarning(UserWarning):
    """A divergence from the oracle accepted as a true near-tie (shown in pytest's warnings summary)."""


def first_divergence(served: Sequence[object], oracle: Sequence[object]) -> int | None:
    """The first position where the two sequences (of equal length) differ; None if they are equal."""
    assert len(served) == len(oracle), f"{len(served)} served tokens, the oracle has {len(oracle)}"
    return next((pos for pos, (a, b) in enumerate(zip(served, oracle, strict=True)) if a != b), None)


def runners_up(logprobs: torch.Tensor, oracle_id: int) -> list[int]:
    """The token ids with the highest logprob other than ``oracle_id`` (several only on an exact tie)."""
    others = logprobs.clone()
    others[oracle_id] = float("-inf")
    return torch.nonzero(others == others.max()).flatten().tolist()


def accept_near_tie(
    pos: int,
    served: object,
    oracle_id: int,
    logprobs: torch.Tensor,
    bound: float,
    spell: Callable[[int], object] = int,
) -> float:
    """Called at ``pos``, the first position where the served token differs from the oracle's
    ``oracle_id``, with the oracle's logprobs over the vocabulary there. ``served`` is what the tier sees
    of the served token (its id, or over HTTP its text) and ``spell`` turns an id into the same form.
    Raises ``AssertionError`` unless ``served`` is the oracle's runner-up with a gap under ``bound``;
    otherwise warns ``NearTieWarning`` and returns the gap. The caller compares nothing after ``pos``."""
    candidates = runners_up(logprobs, oracle_id)
    runner_up = candidates[0]
    gap = float(logprobs[oracle_id] - logprobs[runner_up])
    assert served in [spell(token_id) for token_id in candidates], (
        f"diverged at token {pos}: served {served!r}, the oracle's token is {spell(oracle_id)!r} and its "
        f"runner-up {spell(runner_up)!r} (logprob gap {gap:.3g}); only the runner-up may differ"
    )
    assert gap < bound, (
        f"diverged at token {pos} to the oracle's runner-up {served!r}, but the logprob gap {gap:.3g} is "
        f"not a near-tie (bound {bound:g})"
    )
    warnings.warn(
        NearTieWarning(
            f"near-tie accepted at token {pos}: served the oracle's runner-up {served!r} instead of "
            f"{spell(oracle_id)!r}, logprob gap {gap:.2e} (bound {bound:g}); later tokens not compared"
        ),
        stacklevel=3,
    )
    return gap
