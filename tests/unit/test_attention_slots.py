"""Where a step's new tokens' K/V go in the pool: ``write_slots`` against the slot of every position
(``slot_matrix``), for decodes and chunks that start and end anywhere in their blocks."""

from __future__ import annotations

import random

import pytest

from workers.attention.base import SeqSpan, slot_matrix, write_slots


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_write_slots_are_the_new_positions_slots(block_size):
    rng = random.Random(block_size)
    free = iter(rng.sample(range(10_000), 10_000))
    spans = []
    for n in range(30):
        past = rng.randint(0, 90)
        new = 1 if rng.random() < 0.6 else rng.randint(2, 70)
        table = [next(free) for _ in range(-(-(past + new) // block_size))]
        spans.append(SeqSpan(f"r{n}", past, new, table))
    matrix = slot_matrix(spans, block_size, max(s.num_kv_tokens for s in spans))
    expected = [
        int(x) for row, s in enumerate(spans) for x in matrix[row, s.num_past_tokens : s.num_kv_tokens]
    ]
    assert write_slots(spans, block_size).tolist() == expected


def test_the_docstring_example():
    # table [7, 2, 9], block_size 4: positions 4..7 -> slots 8..11, 8 -> 36
    assert write_slots([SeqSpan("a", 5, 4, [7, 2, 9])], 4).tolist() == [9, 10, 11, 36]
    assert write_slots([SeqSpan("a", 8, 1, [7, 2, 9])], 4).tolist() == [36]
