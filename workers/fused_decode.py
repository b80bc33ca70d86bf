"""The decoder layers of a decode-only step with fewer kernels, for the decode CUDA graphs
(docs/architecture.md, "Decode steps as CUDA graphs").

transformers' decoder layer launches some 40 kernels per token batch, most of them small elementwise
ones (the RMSNorm alone is about seven); inside a graph each still costs a few microseconds, which at
28 layers is milliseconds of a 7B step that the weights' bandwidth does not need. Here a layer of the
common shape (Llama for LLaVA, Qwen2 for Qwen2-VL / Qwen2.5-VL, Qwen3 for Qwen3-VL) is computed from the
same modules' weights in about a dozen::

    x, residual = add_rms_norm(mlp_out, residual)     # the residual add and input_layernorm: one kernel
    q, k, v = q_proj(x), k_proj(x), v_proj(x)          # the layer's own Linear modules
    (Qwen3: q_norm, k_norm over each head, as modules)
    q = rope_write(q, k, v, cos, sin, pool, slots)    # RoPE of q and k, K/V into the pool: one kernel
    o = o_proj(attention(q))                           # the step's FixedDecodeAttention
    x, residual = add_rms_norm(o, residual)           # post_attention_layernorm
    mlp_out = down_proj(silu_mul(gate_proj(x), up_proj(x)))

with the Triton kernels of ``workers.fused_kernels`` where Triton runs (CUDA), and otherwise as the
PyTorch calls below, which are transformers' own operations in its order: on the CPU this path gives
the eager forward's hidden states bit for bit (tests/unit/test_fused_decode.py). A model whose layers
have another shape is not fused (``fusable``): its graphs call transformers' layers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half  # every family's, the same

from workers import fused_kernels
from workers.attention.fixed_decode import FixedDecodeAttention

_LAYER_PARTS = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def _is_rms_norm(module: Any) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


def _is_silu(module: Any) -> bool:
    return isinstance(module, nn.SiLU) or type(module).__name__ == "SiLUActivation"


def fusable(layers: list[Any]) -> bool:
    """Whether every layer is the common pre-norm layer this path computes: RMSNorms, q/k/v/o and
    gate/up/down projections, SiLU, optional per-head q/k norms, no sliding window, and no other
    module with weights."""
    for layer in layers:
        try:
            parts = {name: layer.get_submodule(name) for name in _LAYER_PARTS}
        except AttributeError:
            return False
        attn, mlp = layer.self_attn, layer.mlp
        head_norms = {f"self_attn.{n}": getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n)}
        norms = [parts["input_layernorm"], parts["post_attention_layernorm"], *head_norms.values()]
        weighted = {
            name for name, module in layer.named_modules() if next(module.parameters(False), None) is not None
        }
        if weighted - set(_LAYER_PARTS) - set(head_norms) or not all(_is_rms_norm(n) for n in norms):
            return False
        if not _is_silu(getattr(mlp, "act_fn", None)) or getattr(attn, "sliding_window", None) is not None:
            return False
        if not hasattr(attn, "scaling"):
            return False
    return True


class FusedDecoder:
    """``PagedLanguageModel.decoder`` for a decode-only step in fixed shapes (hidden [B, hidden]):
    the same result from fewer kernels. ``use_triton``: the Triton kernels (CUDA), else PyTorch's."""

    def __init__(self, language_model: Any, layers: list[Any], use_triton: bool) -> None:
        self.lm, self.layers, self.use_triton = language_model, layers, use_triton

    def __call__(
        self, embeds: torch.Tensor, positions: torch.Tensor, step: FixedDecodeAttention
    ) -> torch.Tensor:
        """``embeds`` [B, hidden], ``positions`` [rows, B] on the device -> the last hidden states
        [B, hidden] (before the final norm)."""
        rows = embeds.shape[0]
        # the text model's rotary embedding, once per step: cos/sin [B, head_dim] (M-RoPE's sections
        # already recombined by the module)
        pos = positions if positions.shape[0] == 1 else positions.unsqueeze(1)
        cos, sin = (t.reshape(rows, -1) for t in self.lm.rotary_emb(embeds.unsqueeze(0), pos))
        hidden, residual = embeds, None
        for layer_idx, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x, residual = self._add_rms_norm(hidden, residual, layer.input_layernorm)
            head_dim = attn.head_dim
            q = attn.q_proj(x).view(rows, -1, head_dim)
            k = attn.k_proj(x).view(rows, -1, head_dim)
            v = attn.v_proj(x).view(rows, -1, head_dim)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = self._rope_write(layer_idx, q, k, v, cos, sin, step)  # [B, heads, d]
            out = step.attend(layer_idx, q.transpose(0, 1), attn.scaling)  # [B, heads, d]
            x, residual = self._add_rms_norm(
                attn.o_proj(out.reshape(rows, -1)), residual, layer.post_attention_layernorm
            )
            hidden = mlp.down_proj(self._silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
        assert residual is not None
        return residual + hidden

    def _add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.use_triton:
            return fused_kernels.add_rms_norm(x.contiguous(), residual, norm.weight, norm.variance_epsilon)
        if residual is not None:
            x = residual + x
        return norm(x), x

    def _rope_write(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: FixedDecodeAttention,
    ) -> torch.Tensor:
        pool = step.pool
        if self.use_triton:
            k_pool, v_pool = pool.kv[layer_idx, 0], pool.kv[layer_idx, 1]
            return fused_kernels.rope_write(
                q.contiguous(), k.contiguous(), v.contiguous(), cos, sin, k_pool, v_pool, step.write_slots
            )
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        pool.write(layer_idx, step.write_slots, k, v)
        return q

    def _silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            return fused_kernels.silu_mul(gate, up)
        return nn.functional.silu(gate) * up
