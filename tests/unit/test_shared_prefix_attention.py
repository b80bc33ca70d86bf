"""Decodes that share leading KV blocks (cascade attention in the batched backend) against the reference
backend, on a random pool: the groups found, and the same attention output within fp32 rounding."""

from __future__ import annotations

import random

import pytest
import torch

from workers.attention.base import SeqSpan
from workers.attention.batched import BatchedAttention
from workers.attention.per_request import PerRequestAttention
from workers.attention.shared_prefix import MIN_SHARED_KEYS, PrefixGroup, prefix_groups
from workers.kv_pool import KVPool

BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
CPU = torch.device("cpu")


def decode(req_id: str, table: list[int], num_past: int) -> SeqSpan:
    return SeqSpan(req_id, num_past, 1, table)


def test_groups_are_decodes_sharing_enough_leading_blocks():
    need = MIN_SHARED_KEYS // BLOCK
    image = list(range(100, 100 + need + 3))  # one image's prompt blocks, shared
    other = list(range(200, 200 + need + 3))
    decodes = [
        decode("a", [*image, 1], (len(image) + 1) * BLOCK - 3),
        decode("text", [7, 8], 20),  # shares nothing
        decode("b", [*image, 2, 3], (len(image) + 1) * BLOCK + 5),
        decode("c", [*image[:need], 4], need * BLOCK + 2),  # a shorter run of the same blocks
        decode("d", [*other, 5], (len(other) + 1) * BLOCK - 1),  # alone on its image: no group
        decode("e", [*image[: need - 1], 6], (need - 1) * BLOCK + 1),  # too little shared
    ]
    assert prefix_groups(decodes, BLOCK) == [PrefixGroup([3, 0, 2], need)]
    decodes[3] = decode("c", [*image, 4], (len(image) + 1) * BLOCK - 1)
    assert prefix_groups(decodes, BLOCK) == [PrefixGroup([0, 2, 3], len(image))]


def test_a_shared_block_holding_the_new_token_stays_in_the_suffix():
    """A decode's own position is never in the shared part, even where tables agree up to it (a
    request resumed onto another's blocks): it is written this step, so the suffix must hold it."""
    table = list(range(20))
    decodes = [decode("a", table, 10 * BLOCK), decode("b", table, 12 * BLOCK + 3)]
    assert prefix_groups(decodes, BLOCK) == [PrefixGroup([0, 1], 10)]


@pytest.mark.parametrize("seed", range(4))
def test_batched_with_shared_prefixes_equals_the_reference(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pool = KVPool(1, 512, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, CPU)
    pool.kv.normal_()
    free = iter(rng.sample(range(1, 512), 511))
    images = [[next(free) for _ in range(rng.randint(9, 14))] for _ in range(3)]
    spans = []
    for n in range(rng.randint(6, 12)):
        if rng.random() < 0.2:  # a text-only request
            num_past = rng.randint(0, 40)
            table = [next(free) for _ in range(num_past // BLOCK + 1)]
        else:  # a warm image: its blocks, then the request's own
            image = rng.choice(images)
            num_past = len(image) * BLOCK + rng.randint(0, 40)
            table = image + [next(free) for _ in range(num_past // BLOCK + 1 - len(image))]
        spans.append(SeqSpan(f"r{n}", num_past, 1, table))
    spans.insert(2, SeqSpan("prefill", 40, 23, [next(free) for _ in range(4)]))  # not a decode
    num_tokens = sum(s.num_new_tokens for s in spans)
    query = torch.randn(HEADS, num_tokens, HEAD_DIM)
    key, value = torch.randn(KV_HEADS, num_tokens, HEAD_DIM), torch.randn(KV_HEADS, num_tokens, HEAD_DIM)

    batched = BatchedAttention(pool, spans, CPU, torch.float32)
    grouped = [b for b in batched.batches if b.shared is not None]
    assert len(grouped) == 1 and grouped[0].shared.num_groups >= 1
    # their own batch: only each one's blocks past the image (<= 40 tokens + its own), not padded to
    # the length of a decode alone on its image
    assert grouped[0].num_keys <= 3 * BLOCK
    got = batched(0, query, key, value, None)
    expected = PerRequestAttention(pool, spans, CPU)(0, query, key, value, None)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_no_shared_prefix_keeps_the_plain_batch():
    pool = KVPool(1, 64, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, CPU)
    spans = [SeqSpan("a", 20, 1, [1, 2]), SeqSpan("b", 20, 1, [3, 4])]
    assert all(b.shared is None for b in BatchedAttention(pool, spans, CPU, torch.float32).batches)
