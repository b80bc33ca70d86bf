"""The one near-tie rule of every tier's parity check against transformers' ``generate``
(tests/integration/runner_support.py, tests/e2e/parity.py).

Greedy output must equal the oracle's token for token. Two computations of the same logits in fp32 (a
batched, paged forward and ``generate``'s) agree to a few ulp, not bit for bit, so where the oracle's
best two tokens are closer than that, argmax may pick either. The rule at the first position where the
served token differs from the oracle's:

- the served token must be the oracle's **runner-up** there (its best token other than the oracle's own
  choice; any of several exactly tied runners-up), and
- the oracle's logprob gap between its token and the served one must be under the tier's bound.

Where the logits are bf16 (the CUDA tier: ``quantized``), "exactly tied" means tied at the logits'
rounding step: bf16 keeps 8 significant bits, so the oracle's logits of the tiny checkpoints come in
steps of 0.125, and two tokens one step apart there may be in either order in another bf16 computation of
the same logits. A token at most one step below the runner-up is then tied with it. The bound still
applies to the served token's own gap, so this admits only a token one step below a runner-up that
ties the oracle's token (three tokens within one step), never a token further down.

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


def runners_up(logprobs: torch.Tensor, oracle_id: int, resolution: float = 0.0) -> list[int]:
    """The token ids with the highest logprob other than ``oracle_id`` (several only on a tie), best first:
    with ``resolution``, every token at most that far below the best of them."""
    others = logprobs.clone()
    others[oracle_id] = float("-inf")
    best = others.max()
    # the margin covers float32's rounding of log_softmax, never a whole step
    tied = torch.nonzero(others >= best - resolution * (1 + 1e-3)).flatten()
    return tied[others[tied].argsort(descending=True, stable=True)].tolist()


def logit_step(logprobs: torch.Tensor, top: int = 64) -> float:
    """The rounding step of the logits behind ``logprobs`` at their top, for logits rounded to a short
    mantissa (bf16): the smallest difference between distinct logprobs among the ``top`` best (tokens with
    equal logits have equal logprobs; others differ by whole steps, a smaller step where the top straddles
    a power of two). 0.0 when those are all equal."""
    values = torch.unique(logprobs.topk(min(top, logprobs.numel())).values)
    gaps = values.diff()
    gaps = gaps[gaps > 1e-4]  # float32's rounding of log_softmax is far below any bf16 step
    return float(gaps.min()) if gaps.numel() else 0.0


def accept_near_tie(
    pos: int,
    served: object,
    oracle_id: int,
    logprobs: torch.Tensor,
    bound: float,
    spell: Callable[[int], object] = int,
    quantized: bool = False,
) -> float:
    """Called at ``pos``, the first position where the served token differs from the oracle's
    ``oracle_id``, with the oracle's logprobs over the vocabulary there. ``served`` is what the tier sees
    of the served token (its id, or over HTTP its text) and ``spell`` turns an id into the same form.
    ``quantized``: the oracle's logits are bf16, and ties are ties at their rounding step (``logit_step``).
    Raises ``AssertionError`` unless ``served`` is the oracle's runner-up with a gap under ``bound``;
    otherwise warns ``NearTieWarning`` and returns the gap. The caller compares nothing after ``pos``."""
    step = logit_step(logprobs) if quantized else 0.0
    # a token below the runner-up ties it only where the runner-up ties the oracle's token: three
    # tokens within one step, never a token two steps down at a smaller step
    best_two_tie = float(logprobs[oracle_id] - logprobs[runners_up(logprobs, oracle_id)[0]]) < step / 2
    candidates = runners_up(logprobs, oracle_id, step if best_two_tie else 0.0)
    runner_up = candidates[0]
    spelt = [spell(token_id) for token_id in candidates]
    tied = f" or a token within the logits' rounding step ({step:g}) of it" if quantized else ""
    assert served in spelt, (
        f"diverged at token {pos}: served {served!r}, the oracle's token is {spell(oracle_id)!r} and its "
        f"runner-up {spell(runner_up)!r} (logprob gap "
        f"{float(logprobs[oracle_id] - logprobs[runner_up]):.3g}); only the runner-up{tied} may differ"
    )
    served_id = candidates[spelt.index(served)]
    gap = float(logprobs[oracle_id] - logprobs[served_id])
    assert gap < bound, (
        f"diverged at token {pos} to the oracle's runner-up {served!r}, but the logprob gap {gap:.3g} is "
        f"not a near-tie (bound {bound:g})"
    )
    below = float(logprobs[runner_up] - logprobs[served_id])
    which = "runner-up" if below == 0 else f"token {below:g} below its runner-up (one logit step)"
    warnings.warn(
        NearTieWarning(
            f"near-tie accepted at token {pos}: served the oracle's {which} {served!r} instead of "
            f"{spell(oracle_id)!r}, logprob gap {gap:.2e} (bound {bound:g}); later tokens not compared"
        ),
        stacklevel=3,
    )
    return gap
