"""vLLM's ``prompt_logprobs`` (on chat and on completions): each prompt token's logprob given the tokens
before it, as vLLM shapes them: ``[null, {token id: {"logprob", "rank", "decoded_token"}}, ...]``, one
dict per prompt token (the first has nothing before it), holding the token itself and its position's
``prompt_logprobs`` most likely tokens, each with its rank there (1: the most likely). The engine
computes them from the whole prompt (docs/architecture.md, "Prompt logprobs")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.api.detokenizer import IncrementalDetokenizer
from app.api.outputs import finite
from wire.protocol import PromptLogprobs


def vllm_prompt_logprobs(
    prompt_ids: Sequence[int], run: PromptLogprobs, detok: IncrementalDetokenizer, num_top: int
) -> list[dict[str, dict[str, Any]] | None]:
    """The logprobs of the prompt of ``prompt_ids`` in vLLM's shape, from the engine's ``run`` (tokens 1,
    2, ...)."""

    def one(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {
            "logprob": finite(logprob),
            "rank": rank,
            "decoded_token": detok.token_strings([token_id])[0],
        }

    result: list[dict[str, dict[str, Any]] | None] = [None]  # (a prompt is never empty)
    for i, token_id in enumerate(prompt_ids[run.first : run.first + run.count]):
        position = {str(token_id): one(token_id, run.logprobs[i], run.ranks[i])}
        top_ids, top_logprobs = run.top(i)
        for top_rank, (top_id, logprob) in enumerate(zip(top_ids[:num_top], top_logprobs, strict=False), 1):
            position.setdefault(str(top_id), one(top_id, logprob, top_rank))
        result.append(position)
    return result
