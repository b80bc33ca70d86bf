"""What every attention backend shares: one request's slice of a step, and the step's attention object.

A backend turns one step's spans into a ``StepAttention`` once per step (``AttentionBackend``); each
decoder layer then calls it with that layer's query, key and value. Every backend writes the step's new
K/V into the pool the same way, before any read (a request may read a block another one fills in the
same step), and differs only in how it reads the pool and runs attention.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.kv_pool import KVPool


@dataclass(frozen=True)
class SeqSpan:
    """One request's slice of the step's flattened tokens."""

    req_id: str
    num_past_tokens: int  # tokens whose KV is in its blocks = index of its first token this step
    num_new_tokens: int
    block_ids: list[int]  # its block table; covers num_past_tokens + num_new_tokens positions

    @property
    def num_kv_tokens(self) -> int:
        """Positions its queries read this step: everything before them and the new ones."""
        return self.num_past_tokens + self.num_new_tokens


class StepAttention(ABC):
    """Attention of one step over the paged pool: built once per step, called once per layer."""

    def __init__(self, pool: KVPool, spans: list[SeqSpan], write_slots: torch.Tensor) -> None:
        self.pool = pool
        self.spans = spans
        self.write_slots = write_slots  # [num_tokens] on the device: where each new token's K/V goes

    def __call__(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float | None,
    ) -> torch.Tensor:
        """query [heads, T, d], key/value [kv_heads, T, d] (RoPE applied) -> [T, heads, d]."""
        self.pool.write(layer_idx, self.write_slots, key.transpose(0, 1), value.transpose(0, 1))
        return self.attend(layer_idx, query, scaling)

    @abstractmethod
    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Causal attention of every span's queries over its pooled K/V of ``layer_idx``."""


AttentionBackend = Callable[[KVPool, list[SeqSpan], torch.device], StepAttention]


def slot_matrix(spans: list[SeqSpan], block_size: int, num_positions: int) -> torch.Tensor:
    """[len(spans), num_positions] CPU int64: the pool slot of each span's positions 0..num_positions-1
    (slot 0 past the end of its table: padding that callers mask out)."""
    num_blocks = -(-num_positions // block_size)
    tables = torch.zeros(len(spans), num_blocks, dtype=torch.long)
    for row, span in enumerate(spans):
        ids = span.block_ids[:num_blocks]
        tables[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    offsets = torch.arange(block_size, dtype=torch.long)
    slots = (tables.unsqueeze(2) * block_size + offsets).flatten(1)[:, :num_positions]
    return slots.contiguous()


def write_slots(spans: list[SeqSpan], block_size: int) -> torch.Tensor:
    """[num_tokens] CPU int64: the pool slot of every span's new tokens, in the step's token order. A
    decode's one slot is plain arithmetic; a chunk's come from its blocks (no [spans, positions] matrix:
    that would cost a row of the longest context per decode)."""
    parts: list[torch.Tensor] = []
    decodes: list[int] = []  # consecutive decodes' slots, not yet in ``parts``
    offsets = torch.arange(block_size, dtype=torch.long)
    for span in spans:
        past = span.num_past_tokens
        if span.num_new_tokens == 1:
            decodes.append(span.block_ids[past // block_size] * block_size + past % block_size)
            continue
        if decodes:
            parts.append(torch.tensor(decodes, dtype=torch.long))
            decodes = []
        first = past // block_size
        table = torch.tensor(span.block_ids[first : -(-span.num_kv_tokens // block_size)], dtype=torch.long)
        slots = (table.unsqueeze(1) * block_size + offsets).flatten()
        parts.append(slots[past - first * block_size : span.num_kv_tokens - first * block_size])
    if decodes:
        parts.append(torch.tensor(decodes, dtype=torch.long))
    return torch.cat(parts)
