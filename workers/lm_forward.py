"""A varlen Llama decoder forward over a step's flattened tokens, on the HF modules' own weights.

One step's tokens from all requests (prefill chunks and decode tokens mixed) are one [num_tokens,
hidden] tensor. Projections, norms and MLPs run batched over all of them; K/V of the step's tokens are
written into the paged pool in one batched copy per layer; then attention runs per request against
that request's K/V, gathered from its own blocks (its past tokens plus this step's)::

    tokens:   [ req A chunk (past 0, 100 new) | req B decode (past 612, 1 new) | ... ]
    write      K/V of all 101 tokens -> their slots (A's table, B's table)
    attention  A: q[0:100]  x  K[slots_A(0:100)]   causal
               B: q[100:101] x K[slots_B(0:613)]   sees everything

Slot indices are computed once per step (``StepSlots``) and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from workers.kv_pool import KVPool


@dataclass(frozen=True)
class SeqSpan:
    """One request's slice of the step's flattened tokens."""

    req_id: str
    num_past_tokens: int  # tokens whose KV is in its blocks = position of its first token this step
    num_new_tokens: int
    block_ids: list[int]  # its block table; covers num_past_tokens + num_new_tokens positions


@dataclass(frozen=True)
class StepSlots:
    """Pool slots of one step, on the device: where the step's tokens are written (in token order)
    and, per span, the slots of all its positions [0, num_past + num_new) that attention reads."""

    write: torch.Tensor  # [num_tokens]
    read: list[torch.Tensor]  # one [num_past + num_new] per span

    @classmethod
    def build(cls, pool: KVPool, spans: list[SeqSpan], device: torch.device) -> StepSlots:
        read = [pool.slot_ids(s.block_ids, s.num_past_tokens + s.num_new_tokens) for s in spans]
        write = torch.cat([slots[s.num_past_tokens :] for s, slots in zip(spans, read, strict=True)])
        # One host-to-device copy for the whole step.
        parts = torch.cat([*read, write]).to(device).split([len(t) for t in read] + [len(write)])
        return cls(write=parts[-1], read=list(parts[:-1]))


class LlamaForward:
    """Runs a ``LlamaModel``'s decoder layers (plus final norm and ``lm_head``) over varlen batches.

    ``language_model`` is typed ``Any``: transformers' modules expose config and submodules dynamically.
    """

    def __init__(self, language_model: Any, lm_head: nn.Module, kv_pool: KVPool):
        self.lm = language_model
        self.lm_head = lm_head
        self.kv_pool = kv_pool
        config = language_model.config
        self.layers = list(language_model.layers[: config.num_hidden_layers])
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = self.layers[0].self_attn.head_dim
        self.scaling = self.layers[0].self_attn.scaling

    @staticmethod
    def kv_shape(language_model: Any) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim): what one token's K/V needs in the pool."""
        config = language_model.config
        head_dim = language_model.layers[0].self_attn.head_dim
        return config.num_hidden_layers, config.num_key_value_heads, head_dim

    def __call__(
        self, inputs_embeds: torch.Tensor, spans: list[SeqSpan], logits_rows: list[int]
    ) -> torch.Tensor:
        """Forward ``inputs_embeds`` ([num_tokens, hidden], ordered as ``spans``), writing the new K/V
        into the pool; return float32 logits of the rows ``logits_rows`` ([len(logits_rows), vocab])."""
        device = inputs_embeds.device
        num_tokens = inputs_embeds.shape[0]
        assert num_tokens == sum(span.num_new_tokens for span in spans)
        positions = torch.cat(
            [torch.arange(s.num_past_tokens, s.num_past_tokens + s.num_new_tokens) for s in spans]
        ).to(device)
        cos, sin = self.lm.rotary_emb(inputs_embeds, positions.unsqueeze(0))
        cos, sin = cos[0], sin[0]  # [num_tokens, head_dim]
        slots = StepSlots.build(self.kv_pool, spans, device)

        hidden = inputs_embeds
        for layer_idx, layer in enumerate(self.layers):
            residual = hidden
            h = layer.input_layernorm(hidden)
            attn = layer.self_attn
            q = attn.q_proj(h).view(num_tokens, self.num_heads, self.head_dim)
            k = attn.k_proj(h).view(num_tokens, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(h).view(num_tokens, self.num_kv_heads, self.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
            # All writes before any read: a request may read a block another one fills this step.
            self.kv_pool.write(layer_idx, slots.write, k, v)
            attn_out = self._attention(layer_idx, q, spans, slots)
            hidden = residual + attn.o_proj(attn_out)
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))

        rows = torch.tensor(logits_rows, dtype=torch.long, device=device)
        return self.lm_head(self.lm.norm(hidden.index_select(0, rows))).float()

    def _attention(
        self, layer_idx: int, q: torch.Tensor, spans: list[SeqSpan], slots: StepSlots
    ) -> torch.Tensor:
        """Per-request causal attention over K/V gathered from the pool; q [T, heads, d] -> [T, heads * d]."""
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        start = 0
        for span, read_slots in zip(spans, slots.read, strict=True):
            end = start + span.num_new_tokens
            k_all, v_all = self.kv_pool.read(layer_idx, read_slots)  # [num_kv, kv_heads, d]
            num_kv = k_all.shape[0]
            mask = None
            if span.num_new_tokens > 1 and span.num_past_tokens > 0:
                # Query i sits at position past + i and sees keys 0..past + i.
                mask = torch.ones(span.num_new_tokens, num_kv, dtype=torch.bool, device=q.device).tril(
                    diagonal=span.num_past_tokens
                )
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1).unsqueeze(0),
                k_all.transpose(0, 1).unsqueeze(0),
                v_all.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=span.num_new_tokens > 1 and span.num_past_tokens == 0,
                scale=self.scaling,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            out[start:end] = o[0].transpose(0, 1).reshape(span.num_new_tokens, -1)
            start = end
        return out
