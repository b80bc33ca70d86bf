"""vLLM's ``prompt_logprobs`` (on chat and on completions): each prompt token's logprob given the tokens
before it, as vLLM shapes them: ``[null, {token id: {"logprob", "rank", "decoded_token"}}, ...]``, one
dict per prompt token (the first has nothing before it), holding the token itself and its position's
``prompt_logprobs`` most likely tokens, each with its rank there (1: the most likely). The engine
computes them from the whole prompt (docs/architecture.md, "Prompt logprobs")."""

from __future__ import annotations

from typing import Any

from app.api.detokenizer import IncrementalDetokenizer
from app.api.outputs import finite
from wire.protocol import PromptLogprobs


def vllm_prompt_logprobs(
    run: PromptLogprobs, detok: IncrementalDetokenizer, num_top: int
) -> list[dict[str, dict[str, Any]] | None]:
    """The prompt's logprobs in vLLM's shape, from the engine's ``run`` (tokens 1, 2, ...)."""

    def one(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {
            "logprob": finite(logprob),
            "rank": rank,
            "decoded_token": detok.token_strings([token_id])[0],
        }

    result: list[dict[str, dict[str, Any]] | None] = [None]  # (a prompt is never empty)
    for entry, rank in zip(run.entries, run.ranks, strict=True):
        position = {str(entry.sampled.token_id): one(entry.sampled.token_id, entry.sampled.logprob, rank)}
        for top_rank, top in enumerate(entry.top[:num_top], start=1):
            position.setdefault(str(top.token_id), one(top.token_id, top.logprob, top_rank))
        result.append(position)
    return result
