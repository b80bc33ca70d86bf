"""Prompt logprobs: for a request that asks (``SamplingParams.num_prompt_logprobs``), the logprob of
each prompt token after the first, given the tokens before it, and that position's most likely tokens
(docs/api.md, "Completions": ``echo`` with ``logprobs``). They are read from the hidden states of the
prompt's positions that a step computes anyway (the engine computes such a prompt whole, never from the
prefix cache: docs/architecture.md, "Prompt logprobs"), a slice of rows at a time, so that a long chunk
never holds its whole [tokens, vocab] logits at once. Values are ``log_softmax`` of the raw logits, as
the sampled tokens' logprobs are (workers/sampler.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from wire.protocol import PromptLogprobs
from workers.host_copies import HostCopies, to_device

ROWS_PER_SLICE = 256  # positions whose [vocab] logits exist at once


@dataclass(frozen=True)
class _Run:
    req_id: str
    first: int  # the prompt token the run's first entry is for
    count: int
    num_top: int


@dataclass
class PromptLogprobRows:
    """One step's positions whose next prompt token's logprob is asked for, filled while the step's
    tokens are laid out (``add``), computed on the device after the decoder (``compute``), read back
    with the step's sampled tokens (``to_host``)."""

    rows: list[int] = field(default_factory=list)  # each position's index among the step's tokens
    targets: list[int] = field(default_factory=list)  # the prompt token that follows it
    runs: list[_Run] = field(default_factory=list)
    _result: HostCopies | None = None  # on their way to the host

    def add(self, req_id: str, first_row: int, first: int, targets: list[int], num_top: int) -> None:
        """Positions ``first_row``, ``first_row + 1``, ... of the step predict prompt tokens ``first``,
        ``first + 1``, ... (``targets``)."""
        if targets:
            self.rows += range(first_row, first_row + len(targets))
            self.targets += targets
            self.runs.append(_Run(req_id, first, len(targets), num_top))

    def compute(self, hidden: torch.Tensor, logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """From the step's last hidden states ([tokens, hidden]) and the model's ``logits`` of a few:
        each row's target logprob, its rank and the top tokens, on the device."""
        if not self.rows:
            return
        device = hidden.device
        num_top = max(run.num_top for run in self.runs)
        rows = to_device(self.rows, device, torch.long)
        targets = to_device(self.targets, device, torch.long)
        chosen, ranks, top_values, top_ids = [], [], [], []
        for start in range(0, len(self.rows), ROWS_PER_SLICE):
            stop = start + ROWS_PER_SLICE
            logprobs = torch.log_softmax(logits(hidden.index_select(0, rows[start:stop])), dim=-1)
            target = logprobs.gather(1, targets[start:stop].unsqueeze(1))
            chosen.append(target.squeeze(1))
            ranks.append((logprobs > target).sum(dim=1) + 1)
            values, ids = logprobs.topk(num_top, dim=-1)
            top_values.append(values)
            top_ids.append(ids)
        self._result = HostCopies(
            [torch.cat(chosen), torch.cat(ranks), torch.cat(top_values), torch.cat(top_ids)]
        )

    def to_host(self) -> dict[str, PromptLogprobs]:
        """Each asking request's run of this step, in columns (waits for their copy, not for the
        device's work queued after it)."""
        if self._result is None:
            return {}
        chosen, ranks, top_values, top_ids = self._result.wait()
        result: dict[str, PromptLogprobs] = {}
        row = 0
        for run in self.runs:
            rows, n = slice(row, row + run.count), run.num_top
            result[run.req_id] = PromptLogprobs(
                run.first,
                n,
                chosen[rows].tolist(),
                ranks[rows].tolist(),
                top_ids[rows, :n].reshape(-1).tolist(),
                top_values[rows, :n].reshape(-1).tolist(),
            )
            row += run.count
        return result
