"""Attention backends over the paged KV pool (``--attention-backend``).

- ``batched`` (default, CPU and CUDA): the step's decodes as one padded batch and its prefill chunks as
  another (on a CPU, in batches of like sizes), one attention call each per layer
  (``workers.attention.batched``).
- ``per-request``: one attention call per request and layer (``workers.attention.per_request``); the
  reference the others are tested against.

Every backend writes a step's new K/V the same way and must give the same logits (within the dtype's
rounding); which one runs changes only speed.
"""

from __future__ import annotations

import torch

from workers.attention.base import AttentionBackend, SeqSpan, StepAttention
from workers.attention.batched import BatchedAttention
from workers.attention.per_request import PerRequestAttention

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "SeqSpan", "StepAttention", "attention_backend"]

ATTENTION_BACKENDS = ("batched", "per-request")


def attention_backend(name: str, dtype: torch.dtype) -> AttentionBackend:
    """The backend called ``name`` (one of ``ATTENTION_BACKENDS``), for a model computing in ``dtype``."""
    if name == "batched":
        return lambda pool, spans, device: BatchedAttention(pool, spans, device, dtype)
    if name == "per-request":
        return PerRequestAttention
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")
