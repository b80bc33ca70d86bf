"""Token sampling for one step, batched over the requests that sample.

Order of operations on each row of logits (float32, [vocab]):
1. logprobs, if asked, are ``log_softmax`` of the raw logits (before any masking or temperature);
2. structured output: tokens the request's grammar does not allow are masked (its bitmask row from the
   engine, applied with xgrammar's kernel for the device);
3. min_tokens: eos and stop token ids are masked while fewer than ``min_tokens`` outputs exist;
4. temperature 0 -> argmax; else temperature, top-k, top-p, then an exponential race
   ``argmax(probs / q)`` with ``q ~ Exp(1)`` drawn from the request's own generator, which samples
   exactly from ``probs`` and makes a seeded request's output independent of the batch it ran in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wire.protocol import Logprob, SamplingParams, TokenLogprobs

_GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request this step."""

    params: SamplingParams
    num_output_tokens: int  # outputs generated before this step
    generator: torch.Generator  # the request's own (seeded) or the worker-wide one
    allowed: torch.Tensor | None = None  # its grammar's bitmask row (int32 words); None: unconstrained


def make_generator(seed: int | None, device: torch.device, fallback: torch.Generator) -> torch.Generator:
    """Called once when a request arrives: its own generator when seeded, else the shared one."""
    if seed is None:
        return fallback
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Sample one token per row of ``logits`` ([len(rows), vocab], float32)."""
    num_rows, vocab_size = logits.shape
    assert num_rows == len(rows)
    if num_rows == 0:
        return [], []
    want_logprobs = [row.params.num_top_logprobs is not None for row in rows]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

    logits = logits.clone()
    _mask_grammars(logits, rows)
    _mask_min_tokens(logits, rows)
    token_ids = logits.argmax(dim=-1)
    random_rows = [i for i, row in enumerate(rows) if row.params.temperature >= _GREEDY_TEMPERATURE]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        sampled = _sample_random(logits.index_select(0, idx), [rows[i] for i in random_rows])
        token_ids = token_ids.index_copy(0, idx, sampled)

    token_list: list[int] = token_ids.tolist()
    logprobs: list[TokenLogprobs | None] = [None] * num_rows
    if raw_logprobs is not None:
        for i, row in enumerate(rows):
            if want_logprobs[i]:
                logprobs[i] = _token_logprobs(
                    raw_logprobs[i], token_list[i], row.params.num_top_logprobs or 0
                )
    return token_list, logprobs


def _mask_grammars(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """-inf on every token a constrained row's grammar does not allow (token ids past its bitmask
    included: the engine sizes it to the whole vocabulary)."""
    constrained = [i for i, row in enumerate(rows) if row.allowed is not None]
    if not constrained:
        return
    import xgrammar  # only a worker that gets a constrained request loads it

    num_words = rows[constrained[0]].allowed.shape[0]  # type: ignore[union-attr]
    bitmask = torch.full((len(rows), num_words), -1, dtype=torch.int32)
    for i in constrained:
        bitmask[i] = rows[i].allowed  # type: ignore[assignment]
    xgrammar.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device), vocab_size=logits.shape[1], indices=constrained
    )


def _mask_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab_size = logits.shape[1]
    for i, row in enumerate(rows):
        if row.num_output_tokens < row.params.min_tokens:
            banned = [
                t for t in (*row.params.eos_token_ids, *row.params.stop_token_ids) if 0 <= t < vocab_size
            ]
            if banned:
                logits[i, banned] = float("-inf")


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    device = logits.device
    vocab_size = logits.shape[1]
    temperature = torch.tensor([row.params.temperature for row in rows], device=device, dtype=logits.dtype)
    logits = logits / temperature.unsqueeze(1)

    top_k = [min(max(row.params.top_k, 1), vocab_size) if row.params.top_k else vocab_size for row in rows]
    top_p = [row.params.top_p for row in rows]
    if any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab_size, device=device).unsqueeze(0)
        remove = ranks >= torch.tensor(top_k, device=device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        probs_sorted = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p (the first always stays).
        mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
        p = torch.tensor(top_p, device=device, dtype=logits.dtype).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)

    probs = logits.softmax(dim=-1)
    q = torch.empty_like(probs)
    for i, row in enumerate(rows):
        q[i].exponential_(generator=row.generator)
    # A zero draw would make 0/0 = nan for a masked token, and argmax favours nan.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def _token_logprobs(logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    sampled = Logprob(token_id=token_id, logprob=float(logprobs[token_id]))
    top: list[Logprob] = []
    if num_top > 0:
        values, ids = logprobs.topk(min(num_top, logprobs.shape[0]))
        top = [Logprob(token_id=t, logprob=lp) for t, lp in zip(ids.tolist(), values.tolist(), strict=True)]
    return TokenLogprobs(sampled=sampled, top=top)
