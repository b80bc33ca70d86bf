"""A family's own transformers text model run over one step's flattened tokens with paged attention.

Every family's decoder layers (Llama for LLaVA, Qwen2 for Qwen2-VL / Qwen2.5-VL, Qwen3 for Qwen3-VL) are
called as transformers wrote them; ``paged_attention`` (registered through transformers' attention
interface) is the only piece that differs from ``generate``. Positions come from the family (1-D, or
three M-RoPE rows that the text model's own rotary embedding lays out); deepstack features, where the
family has them, are added after the first layers exactly where transformers adds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from workers.attention import AttentionBackend, SeqSpan, StepAttention
from workers.host_copies import to_device
from workers.kv_pool import KVPool
from workers.paged_attention import PAGED_ATTENTION, register_paged_attention
from workers.prompt_logprobs import PromptLogprobRows


@dataclass(frozen=True)
class Deepstack:
    """Qwen3-VL's extra visual levels for one step: ``levels[i]`` ([num_visual, hidden]) is added to
    the hidden states at ``mask`` ([num_tokens] bool, the step's placeholder tokens) after layer i."""

    mask: torch.Tensor
    levels: list[torch.Tensor]

    def after_layer(self, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
        if layer_idx >= len(self.levels):
            return hidden
        hidden = hidden.clone()  # as transformers' _deepstack_process: hidden + visual, in that order
        hidden[0, self.mask, :] = hidden[0, self.mask, :] + self.levels[layer_idx]
        return hidden


class PagedLanguageModel:
    """``language_model`` is the family's transformers text model (typed ``Any``: transformers' modules
    expose config and submodules dynamically); its config is switched to paged attention here."""

    def __init__(self, language_model: Any, lm_head: nn.Module, kv_pool: KVPool, attention: AttentionBackend):
        register_paged_attention()
        language_model.config._attn_implementation = PAGED_ATTENTION
        self.lm = language_model
        self.lm_head = lm_head
        self.kv_pool = kv_pool
        self.attention = attention
        self.layers = self.decoder_layers(language_model)

    @staticmethod
    def decoder_layers(language_model: Any) -> list[Any]:
        return list(language_model.layers[: language_model.config.num_hidden_layers])

    @staticmethod
    def kv_shape(language_model: Any) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim): what one token's K/V needs in the pool."""
        config = language_model.config
        head_dim = language_model.layers[0].self_attn.head_dim
        return config.num_hidden_layers, config.num_key_value_heads, head_dim

    def __call__(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        spans: list[SeqSpan],
        logits_rows: list[int],
        deepstack: Deepstack | None = None,
        prompt_logprobs: PromptLogprobRows | None = None,
    ) -> torch.Tensor:
        """Forward ``inputs_embeds`` ([num_tokens, hidden], ordered as ``spans``) at ``position_ids``
        ([rows, num_tokens]: one row, or M-RoPE's three), writing the new K/V into the pool; return
        float32 logits of the rows ``logits_rows`` ([len(logits_rows), vocab]). ``prompt_logprobs``:
        prompt positions whose logprobs the step computes too, from the same hidden states."""
        device = inputs_embeds.device
        assert inputs_embeds.shape[0] == sum(span.num_new_tokens for span in spans)
        step = self.attention(self.kv_pool, spans, device)
        hidden = self.decoder(inputs_embeds, position_ids.to(device), step, deepstack)
        if prompt_logprobs is not None:
            prompt_logprobs.compute(hidden, self.logits)
        rows = to_device(logits_rows, device, torch.long)
        return self.logits(hidden.index_select(0, rows))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of the last hidden states ``hidden`` ([rows, hidden]): final norm, LM head."""
        return self.lm_head(self.lm.norm(hidden)).float()

    def decoder(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        step: StepAttention,
        deepstack: Deepstack | None = None,
    ) -> torch.Tensor:
        """The decoder layers over ``inputs_embeds`` ([num_tokens, hidden]) at ``position_ids`` (on the
        device), attending through ``step``: the last hidden states, [num_tokens, hidden], before the
        final norm. Device work only (nothing read back, no host tensor): a CUDA graph can capture it."""
        hidden = inputs_embeds.unsqueeze(0)
        # 1-D rotary takes [batch, T]; M-RoPE takes [3, batch, T].
        positions = position_ids if position_ids.shape[0] == 1 else position_ids.unsqueeze(1)
        position_embeddings = self.lm.rotary_emb(hidden, positions)
        for layer_idx, layer in enumerate(self.layers):
            hidden = layer(
                hidden, attention_mask=None, position_embeddings=position_embeddings, paged_step=step
            )
            if deepstack is not None:
                hidden = deepstack.after_layer(layer_idx, hidden)
        return hidden[0]
