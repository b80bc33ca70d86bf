"""Sampling math on hand-made logits: no model, no processes."""

from __future__ import annotations

import pytest
import torch

from wire.protocol import SamplingParams
from workers.sampler import SamplingRow, TokenHistory, make_generator, sample

VOCAB = 50
EOS = 3


def _logits(num_rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _row(gen: torch.Generator | None = None, num_output_tokens: int = 0, **params) -> SamplingRow:
    sampling = SamplingParams(max_tokens=16, **params)
    return SamplingRow(
        sampling,
        num_output_tokens,
        gen or make_generator(sampling.seed, torch.device("cpu"), torch.Generator()),
    )


def test_greedy_is_argmax_and_top_k_1_too():
    logits = _logits(3)
    tokens, logprobs = sample(
        logits, [_row(temperature=0.0), _row(temperature=1.0, top_k=1), _row(temperature=0.7, top_p=1e-6)]
    )
    best = logits.argmax(dim=-1).tolist()
    assert tokens == best
    assert logprobs == [None, None, None]


def test_a_top_p_that_rounds_to_zero_keeps_the_best_token():
    """1e-300 is a valid top_p (over 0) that float32 rounds to 0: the best token still stays, as vLLM's."""
    logits = _logits(2)
    rows = [_row(temperature=1.0, top_p=1e-300, seed=s) for s in range(2)]
    assert sample(logits, rows)[0] == logits.argmax(dim=-1).tolist()


def test_same_seed_same_tokens_regardless_of_batch():
    logits = _logits(1) / 3  # flat enough that 20 draws differ
    runs = []
    for batch_size in (1, 4):
        rows = [_row(temperature=1.0, seed=42)] + [_row(temperature=1.0) for _ in range(batch_size - 1)]
        runs.append([sample(logits.expand(batch_size, VOCAB), rows)[0][0] for _ in range(20)])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1  # actually random
    other_seed = _row(temperature=1.0, seed=43)
    other = [sample(logits, [other_seed])[0][0] for _ in range(20)]
    assert other != runs[0]


def test_every_bit_of_a_64_bit_seed_counts():
    """The CPU generator keeps 32 bits of a seed: seeds equal in those would share a stream."""
    logits = _logits(1) / 3
    streams = {}
    for seed in (1, 2**32 + 1, 0, 2**40, -1, 2**63 - 1):
        row = _row(temperature=1.0, seed=seed)
        streams[seed] = tuple(sample(logits, [row])[0][0] for _ in range(20))
    assert len(set(streams.values())) == len(streams)


def test_samples_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [0.0] * (VOCAB - 3)]))
    row = _row(temperature=1.0, seed=0)
    counts = torch.bincount(torch.tensor([sample(logits, [row])[0][0] for _ in range(3000)]), minlength=VOCAB)
    assert counts[3:].sum() == 0
    assert counts[:3].tolist() == pytest.approx([1500, 900, 600], abs=120)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1] + [0.0] * (VOCAB - 4)]))
    top_k = {sample(logits, [_row(temperature=1.0, top_k=2, seed=s)])[0][0] for s in range(200)}
    assert top_k == {0, 1}
    # 0.4 + 0.3 < 0.75: the third token is still needed to cover top_p, the fourth is not.
    top_p = {sample(logits, [_row(temperature=1.0, top_p=0.75, seed=s)])[0][0] for s in range(300)}
    assert top_p == {0, 1, 2}


def test_min_tokens_masks_eos_and_stop_ids_until_met():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 7], logits[0, 9] = 10.0, 9.0, 8.0
    params = {"temperature": 0.0, "min_tokens": 2, "eos_token_ids": (EOS,), "stop_token_ids": (7,)}
    assert sample(logits, [_row(num_output_tokens=1, **params)])[0] == [9]
    assert sample(logits, [_row(num_output_tokens=2, **params)])[0] == [EOS]
    # The sampler does not stop anything itself: eos is just a token once min_tokens is met.
    assert sample(logits, [_row(temperature=0.0, eos_token_ids=(EOS,))])[0] == [EOS]


def test_logprobs_are_raw_log_softmax():
    logits = _logits(2)
    rows = [
        _row(temperature=0.0, num_top_logprobs=4),
        _row(temperature=2.0, top_k=3, seed=1, num_top_logprobs=0),
    ]
    tokens, logprobs = sample(logits, rows)
    expected = torch.log_softmax(logits, dim=-1)
    greedy = logprobs[0]
    assert greedy.sampled.token_id == tokens[0] == greedy.top[0].token_id
    assert greedy.sampled.logprob == pytest.approx(float(expected[0].max()))
    assert [t.token_id for t in greedy.top] == expected[0].topk(4).indices.tolist()
    assert [t.logprob for t in greedy.top] == sorted((t.logprob for t in greedy.top), reverse=True)
    # Temperature and top-k change the choice, not the reported logprob.
    assert logprobs[1].top == []
    assert logprobs[1].sampled.logprob == pytest.approx(float(expected[1, tokens[1]]))


def _bitmask_row(allowed: list[int]) -> torch.Tensor:
    """A grammar's bitmask row over VOCAB (int32 words, xgrammar's layout) allowing ``allowed``."""
    words = [0] * -(-VOCAB // 32)
    for token in allowed:
        words[token // 32] |= 1 << (token % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def test_a_grammar_row_masks_before_temperature_and_keeps_raw_logprobs():
    """Only the allowed tokens are sampled (greedy, and 200 random draws); logprobs stay those of the raw
    logits; the unconstrained row beside it samples as it would alone."""
    logits = _logits(2)
    allowed = [7, 33, 49]
    best = max(allowed, key=lambda t: float(logits[0, t]))
    constrained = _row(temperature=0.0, num_top_logprobs=2)
    constrained.allowed = _bitmask_row(allowed)
    tokens, logprobs = sample(logits, [constrained, _row(temperature=0.0)])
    assert tokens == [best, int(logits[1].argmax())]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert logprobs[0] is not None and logprobs[0].sampled.logprob == pytest.approx(float(raw[best]))
    assert [top.token_id for top in logprobs[0].top] == raw.topk(2).indices.tolist()  # unmasked alternatives
    gen = torch.Generator().manual_seed(1)
    draws = set()
    for _ in range(200):
        row = _row(gen, temperature=2.0, top_k=40, top_p=0.99)
        row.allowed = _bitmask_row(allowed)
        draws.add(sample(_logits(1, seed=3), [row])[0][0])
    assert draws <= set(allowed) and len(draws) > 1


# ---------------------------------------------------------------- penalties, biases, min_p


def _penalised_row(history: list[int], num_prompt: int, **params) -> SamplingRow:
    row = _row(temperature=0.0, **params)
    row.num_output_tokens = len(history) - num_prompt
    row.history = TokenHistory(history, num_prompt)
    return row


def _greedy_after(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    return sample(logits, rows)[0]


def test_penalties_match_transformers_and_openai_formulas():
    """Repetition as transformers' processor (over prompt and output), then frequency and presence as
    OpenAI defines them (over the output only), in a batch with an unpenalised row."""
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = _logits(1, seed=3)
    prompt, output = [1, 2, 2, 7], [7, 9, 9, 9, 11]
    ids = prompt + output
    params = {"repetition_penalty": 1.7, "frequency_penalty": 0.4, "presence_penalty": 0.9}
    expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([ids]), logits.clone())
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB).float()
    expected = expected - 0.4 * counts - 0.9 * (counts > 0).float()
    # the sampler's masked logits: read them through a greedy pick per token, masking one at a time
    rows = [_penalised_row(ids, len(prompt), **params), _row(temperature=0.0)]
    seen = []
    work = logits.expand(2, VOCAB).clone()
    for _ in range(6):  # the ranking of the penalised row equals the expected ranking, top 6
        tokens = _greedy_after(work, rows)
        assert tokens[1] == int(work[1].argmax())  # the plain row is untouched
        seen.append(tokens[0])
        work[0, tokens[0]] = float("-inf")
    assert seen == expected[0].topk(6).indices.tolist()


def test_penalty_counts_follow_new_outputs():
    """The history counts outputs appended after it was first read (no recount, no stale count)."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 1.0
    logits[0, 6] = 0.9
    history = [1, 2]
    row = _penalised_row(history, 2, frequency_penalty=0.2)
    assert _greedy_after(logits, [row]) == [5]
    history.append(5)  # the runner appends the sampled token to the request's own list
    assert _greedy_after(logits, [row]) == [6]  # 1.0 - 0.2 < 0.9
    history.append(6)
    assert _greedy_after(logits, [row]) == [5]  # 0.8 vs 0.7


def test_logit_bias_and_allowed_ids():
    logits = _logits(3, seed=5)
    rows = [
        _row(temperature=0.0, logit_bias={17: 100.0}),
        _row(temperature=0.0, allowed_token_ids=(4, 9)),
        _row(temperature=0.0, logit_bias={int(logits[2].argmax()): -100.0}),
    ]
    tokens = sample(logits, rows)[0]
    assert tokens[0] == 17
    assert tokens[1] == (4 if logits[1, 4] > logits[1, 9] else 9)
    assert tokens[2] == int(logits[2].topk(2).indices[1])


def test_min_p_drops_tokens_below_its_share_of_the_top():
    """min_p 0.5 keeps exactly the tokens whose probability is at least half the top one's."""
    from transformers import MinPLogitsWarper

    logits = torch.log(torch.tensor([[0.4, 0.25, 0.19, 0.16] + [0.0] * (VOCAB - 4)]))
    row = _row(temperature=1.0, min_p=0.5, seed=1)
    drawn = {sample(logits, [row])[0][0] for _ in range(400)}
    kept = MinPLogitsWarper(0.5)(torch.tensor([[0]]), logits.clone())[0].isfinite().nonzero().flatten()
    assert drawn == set(kept.tolist()) == {0, 1}


def test_an_overflowing_logit_falls_back_to_the_top_token():
    """A repetition penalty near 0 divides a positive logit to inf: the softmax is nan, the row takes
    its top logit instead of a nan-picked (perhaps masked) token."""
    logits = torch.full((1, VOCAB), -1.0)
    logits[0, 7] = 2.0
    logits[0, 3] = float("-inf")  # masked
    row = _penalised_row([7, 1], 2, repetition_penalty=5e-324)
    row.params = SamplingParams(max_tokens=16, temperature=0.5, repetition_penalty=5e-324, seed=1)
    assert sample(logits, [row])[0] == [7]


def test_bad_words_mask_as_transformers_does_where_the_prefix_is_in_the_output():
    """Each sequence's last id is masked where the output ends with the ids before it, as transformers'
    NoBadWordsLogitsProcessor masks it (here the prefixes are never in the prompt, where transformers
    would look too and vLLM's rule does not); a one-token word always; a row without words untouched."""
    from transformers import NoBadWordsLogitsProcessor

    logits = _logits(1, seed=9)
    prompt, output = [1, 2, 3], [40, 41, 42]
    bad_words = ((5,), (41, 42, 8), (42, 9), (40, 10), (45, 42, 11), (47,))
    ids = prompt + output
    expected = NoBadWordsLogitsProcessor([list(w) for w in bad_words], eos_token_id=0)(
        torch.tensor([ids]), logits.clone()
    )
    assert torch.isinf(expected[0, [5, 8, 9, 47]]).all() and torch.isfinite(expected[0, [10, 11]]).all()
    rows = [_penalised_row(ids, len(prompt), bad_words=bad_words), _row(temperature=0.0)]
    work = logits.expand(2, VOCAB).clone()
    seen = []
    for _ in range(VOCAB - 4):  # every id the row may take, best first, then only masked ones are left
        tokens = _greedy_after(work, rows)
        assert tokens[1] == int(work[1].argmax())
        seen.append(tokens[0])
        work[:, tokens[0]] = float("-inf")
    assert seen == expected[0].topk(VOCAB - 4).indices.tolist()
    assert not {5, 8, 9, 47} & set(seen)


def test_named_ids_give_their_own_logprobs_in_their_order_beside_top_ones():
    """A row that names ``logprob_token_ids`` gets exactly those ids' raw logprobs, in its order, however
    unlikely; a row beside it keeps its top ones; the sampled tokens do not change."""
    logits = _logits(2, seed=11)
    named = (int(logits[0].argmin()), 3, int(logits[0].argmax()))
    rows = [
        _row(temperature=0.0, num_top_logprobs=0, logprob_token_ids=named),
        _row(temperature=0.0, num_top_logprobs=4),
    ]
    tokens, logprobs = sample(logits, rows)
    assert tokens == [int(logits[0].argmax()), int(logits[1].argmax())]
    raw = torch.log_softmax(logits, dim=-1)
    first, second = logprobs
    assert first is not None and second is not None
    assert [alt.token_id for alt in first.top] == list(named)
    assert [alt.logprob for alt in first.top] == pytest.approx(raw[0, list(named)].tolist())
    assert [alt.token_id for alt in second.top] == raw[1].topk(4).indices.tolist()
