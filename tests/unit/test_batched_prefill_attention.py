"""The batched backend's prefill spans on a CPU (workers/attention/batched.py): a long span from its first
token runs alone on the kernel's causal path; the others (short ones, later chunks, resumes) in batches
of like sizes whose padding stays within ``PREFILL_PADDING``; on a GPU, one batch. Whatever the batches,
the output is the reference backend's, within fp32 rounding."""

from __future__ import annotations

import random

import pytest
import torch

from workers.attention.base import SeqSpan
from workers.attention.batched import CAUSAL_ALONE, PREFILL_PADDING, BatchedAttention, _prefill_batches
from workers.attention.per_request import PerRequestAttention
from workers.kv_pool import KVPool

BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
CPU = torch.device("cpu")


def spans_of(sizes: list[tuple[int, int]], rng: random.Random) -> list[SeqSpan]:
    """One span per (tokens before, new tokens), on blocks of its own, beside two decodes."""
    free = iter(rng.sample(range(1, 1024), 1023))
    spans = [SeqSpan("d0", 30, 1, [next(free) for _ in range(2)])]
    for n, (past, new) in enumerate(sizes):
        spans.append(SeqSpan(f"p{n}", past, new, [next(free) for _ in range(-(-(past + new) // BLOCK))]))
    spans.append(SeqSpan("d1", 70, 1, [next(free) for _ in range(5)]))
    return spans


SIZES = [(0, 300), (0, 40), (0, 37), (0, 9), (64, 80), (48, 90), (200, 20), (0, 256)]


@pytest.mark.parametrize("seed", range(3))
def test_prefills_in_batches_of_like_sizes_equal_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pool = KVPool(1, 1024, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, CPU)
    pool.kv.normal_()
    sizes = SIZES[:]
    rng.shuffle(sizes)
    spans = spans_of(sizes, rng)
    num_tokens = sum(s.num_new_tokens for s in spans)
    query = torch.randn(HEADS, num_tokens, HEAD_DIM)
    key, value = torch.randn(KV_HEADS, num_tokens, HEAD_DIM), torch.randn(KV_HEADS, num_tokens, HEAD_DIM)

    batched = BatchedAttention(pool, spans, CPU, torch.float32)
    prefills = [b for b in batched.batches if b.num_queries > 1]
    causal = {b.num_queries for b in prefills if b.causal}  # a span alone from its first token, each
    assert {300, 256} <= causal and all(b.num_spans == 1 for b in prefills if b.causal)
    assert len(prefills) > 3 and sum(b.num_spans for b in prefills) == len(SIZES)
    got = batched(0, query, key, value, None)
    expected = PerRequestAttention(pool, spans, CPU)(0, query, key, value, None)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_each_batch_pads_little_and_a_gpu_takes_one() -> None:
    spans = spans_of(SIZES, random.Random(0))
    prefills = [i for i, s in enumerate(spans) if s.num_new_tokens > 1]
    batches = _prefill_batches(spans, prefills, CPU)
    assert sorted(i for batch in batches for i in batch) == prefills
    for batch in batches:
        members = [spans[i] for i in batch]
        if len(members) == 1:
            continue
        assert all(m.num_past_tokens > 0 or m.num_new_tokens < CAUSAL_ALONE for m in members)
        padded = len(members) * max(m.num_new_tokens for m in members) * max(m.num_kv_tokens for m in members)
        assert padded <= PREFILL_PADDING * sum(m.num_new_tokens * m.num_kv_tokens for m in members)
    assert any(len(batch) > 1 for batch in batches), "like sizes share a call"
    assert _prefill_batches(spans, prefills, torch.device("cuda")) == [prefills]
