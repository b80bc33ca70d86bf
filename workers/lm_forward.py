"""A varlen Llama decoder forward over a step's flattened tokens, on the HF modules' own weights.

One step's tokens from all requests (prefill chunks and decode tokens mixed) are one [num_tokens,
hidden] tensor. Projections, norms and MLPs run batched over all of them; attention runs per request
against that request's K/V (its past tokens plus this step's)::

    tokens:   [ req A chunk (past 0, 100 new) | req B decode (past 612, 1 new) | ... ]
    attention  A: q[0:100]  x  K_A[0:100]   causal
               B: q[100:101] x K_B[0:613]   sees everything

K/V storage sits behind ``KVCache`` (reserve / write / advance / free) so that a paged block pool can
replace the contiguous per-request buffers without touching the forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

_MIN_CAPACITY_TOKENS = 256


class KVCache:
    """Contiguous K/V per request: one [num_layers, 2, num_kv_heads, capacity, head_dim] buffer each,
    grown by doubling. A request's first ``num_tokens(req_id)`` positions hold committed K/V.

    Protocol per step: ``reserve`` every scheduled request, then each layer calls ``write`` (which
    stores the step's K/V after the committed ones and returns all of them), then ``advance`` commits.
    """

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ):
        self._shape = (num_layers, 2, num_kv_heads)
        self._head_dim = head_dim
        self._dtype = dtype
        self._device = device
        self._buffers: dict[str, torch.Tensor] = {}
        self._num_tokens: dict[str, int] = {}

    def num_tokens(self, req_id: str) -> int:
        return self._num_tokens.get(req_id, 0)

    def reserve(self, req_id: str, num_new_tokens: int) -> None:
        """Make room for ``num_new_tokens`` more positions (allocating the request's buffer at first use)."""
        num_needed = self.num_tokens(req_id) + num_new_tokens
        buf = self._buffers.get(req_id)
        capacity = 0 if buf is None else buf.shape[3]
        if num_needed <= capacity:
            return
        new_capacity = max(_MIN_CAPACITY_TOKENS, capacity)
        while new_capacity < num_needed:
            new_capacity *= 2
        grown = torch.empty(
            (*self._shape, new_capacity, self._head_dim), dtype=self._dtype, device=self._device
        )
        if buf is not None:
            num_committed = self.num_tokens(req_id)
            grown[:, :, :, :num_committed] = buf[:, :, :, :num_committed]
        self._buffers[req_id] = grown
        self._num_tokens.setdefault(req_id, 0)

    def write(
        self, req_id: str, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's ``k``/``v`` ([num_kv_heads, n, head_dim]) of ``layer`` after the committed
        positions; return views of K and V over committed + new positions."""
        start = self.num_tokens(req_id)
        end = start + k.shape[1]
        buf = self._buffers[req_id]
        buf[layer, 0, :, start:end] = k
        buf[layer, 1, :, start:end] = v
        return buf[layer, 0, :, :end], buf[layer, 1, :, :end]

    def advance(self, req_id: str, num_new_tokens: int) -> None:
        """Commit the positions written this step (called once, after the last layer)."""
        self._num_tokens[req_id] += num_new_tokens

    def free(self, req_id: str) -> None:
        self._buffers.pop(req_id, None)
        self._num_tokens.pop(req_id, None)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._buffers


@dataclass(frozen=True)
class SeqSpan:
    """One request's slice of the step's flattened tokens."""

    req_id: str
    num_past_tokens: int  # tokens already in its KV cache = position of its first token this step
    num_new_tokens: int


class LlamaForward:
    """Runs a ``LlamaModel``'s decoder layers (plus final norm and ``lm_head``) over varlen batches.

    ``language_model`` is typed ``Any``: transformers' modules expose config and submodules dynamically.
    """

    def __init__(self, language_model: Any, lm_head: nn.Module, kv_cache: KVCache):
        self.lm = language_model
        self.lm_head = lm_head
        self.kv_cache = kv_cache
        config = language_model.config
        self.layers = list(language_model.layers[: config.num_hidden_layers])
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = self.layers[0].self_attn.head_dim
        self.scaling = self.layers[0].self_attn.scaling

    @staticmethod
    def make_kv_cache(language_model: Any, dtype: torch.dtype, device: torch.device) -> KVCache:
        config = language_model.config
        head_dim = language_model.layers[0].self_attn.head_dim
        return KVCache(config.num_hidden_layers, config.num_key_value_heads, head_dim, dtype, device)

    def __call__(
        self, inputs_embeds: torch.Tensor, spans: list[SeqSpan], logits_rows: list[int]
    ) -> torch.Tensor:
        """Forward ``inputs_embeds`` ([num_tokens, hidden], ordered as ``spans``); commit the new K/V;
        return float32 logits of the rows ``logits_rows`` ([len(logits_rows), vocab])."""
        device = inputs_embeds.device
        num_tokens = inputs_embeds.shape[0]
        assert num_tokens == sum(span.num_new_tokens for span in spans)
        positions = torch.cat(
            [torch.arange(s.num_past_tokens, s.num_past_tokens + s.num_new_tokens) for s in spans]
        ).to(device)
        cos, sin = self.lm.rotary_emb(inputs_embeds, positions.unsqueeze(0))
        cos, sin = cos[0], sin[0]  # [num_tokens, head_dim]
        for span in spans:
            self.kv_cache.reserve(span.req_id, span.num_new_tokens)

        hidden = inputs_embeds
        for layer_idx, layer in enumerate(self.layers):
            residual = hidden
            h = layer.input_layernorm(hidden)
            attn = layer.self_attn
            q = attn.q_proj(h).view(num_tokens, self.num_heads, self.head_dim)
            k = attn.k_proj(h).view(num_tokens, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(h).view(num_tokens, self.num_kv_heads, self.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
            attn_out = self._attention(layer_idx, q, k, v, spans)
            hidden = residual + attn.o_proj(attn_out)
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))

        for span in spans:
            self.kv_cache.advance(span.req_id, span.num_new_tokens)
        rows = torch.tensor(logits_rows, dtype=torch.long, device=device)
        return self.lm_head(self.lm.norm(hidden.index_select(0, rows))).float()

    def _attention(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[SeqSpan]
    ) -> torch.Tensor:
        """Per-request causal attention; q [T, heads, d], k/v [T, kv_heads, d] -> [T, heads * d]."""
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        start = 0
        for span in spans:
            end = start + span.num_new_tokens
            k_all, v_all = self.kv_cache.write(
                span.req_id, layer_idx, k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            )
            num_kv = k_all.shape[1]
            mask = None
            if span.num_new_tokens > 1 and span.num_past_tokens > 0:
                # Query i sits at position past + i and sees keys 0..past + i.
                mask = torch.ones(span.num_new_tokens, num_kv, dtype=torch.bool, device=q.device).tril(
                    diagonal=span.num_past_tokens
                )
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1).unsqueeze(0),
                k_all.unsqueeze(0),
                v_all.unsqueeze(0),
                attn_mask=mask,
                is_causal=span.num_new_tokens > 1 and span.num_past_tokens == 0,
                scale=self.scaling,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            out[start:end] = o[0].transpose(0, 1).reshape(span.num_new_tokens, -1)
            start = end
        return out
