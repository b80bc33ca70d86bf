"""The decoder layers of a decode-only step with fewer kernels, for the decode CUDA graphs
(docs/architecture.md, "Decode steps as CUDA graphs").

transformers' decoder layer launches some 40 kernels per token batch, most of them small elementwise
ones (the RMSNorm alone is about seven); inside a graph each still costs a few microseconds, which at
28 layers is milliseconds of a 7B step that the weights' bandwidth does not need. Here a layer of the
common shape (Llama for LLaVA, Qwen2 for Qwen2-VL / Qwen2.5-VL, Qwen3 for Qwen3-VL) is computed from the
same modules' weights in about a dozen::

    x, residual = add_rms_norm(mlp_out, residual)     # the residual add and input_layernorm: one kernel
    q, k, v = split(x @ qkv.T + qkv_bias)              # q/k/v projections as one matmul
    (Qwen3: q_norm, k_norm over each head, as modules)
    q = rope_write(q, k, v, cos, sin, pool, slots)    # RoPE of q and k, K/V into the pool: one kernel
    o = o_proj(attention(q))                           # the step's FixedDecodeAttention
    x, residual = add_rms_norm(o, residual)           # post_attention_layernorm
    gate, up = split(x @ gate_up.T)                    # gate/up projections as one matmul
    mlp_out = down_proj(silu_mul(gate, up))

The merged projections (``merge_projections``) are one weight per layer whose row slices the q/k/v (and
gate/up) modules now hold as views, so the model's memory does not grow and its other paths (prefill,
transformers' layers) read the same weights. One matmul instead of three gives the thin k/v
projections (a 7B's 512 columns) the bandwidth of a wide one and saves two launches and two bias adds.
Each output element is the same dot product, but a matmul kernel chosen for more columns may sum in
another order (as a GPU's choice for another batch size already does), so the CPU's path, which gives
transformers' bits, keeps the projections apart.

with the Triton kernels of ``workers.fused_kernels`` where Triton runs (CUDA), and otherwise as the
PyTorch calls below, which are transformers' own operations in its order: on the CPU this path gives
the eager forward's hidden states bit for bit (tests/unit/test_fused_decode.py). A model whose layers
have another shape is not fused (``fusable``): its graphs call transformers' layers.
"""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class MergedProjections:
    """One layer's q/k/v projections as one weight (and bias, where they have one), its gate/up as
    another; ``qkv_sizes`` and ``gate_up_sizes`` split their outputs."""

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    qkv_sizes: list[int]
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    gate_up_sizes: list[int]


def _merge(modules: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """The modules' weights (and biases) concatenated; each module's own then a view of its rows."""
    with torch.no_grad():
        weight = torch.cat([m.weight for m in modules])
        has_bias = [m.bias is not None for m in modules]
        bias = torch.cat([m.bias for m in modules]) if all(has_bias) else None
        sizes = [m.weight.shape[0] for m in modules]
        start = 0
        for module, size in zip(modules, sizes, strict=True):
            module.weight = nn.Parameter(weight[start : start + size], requires_grad=False)
            if bias is not None:
                module.bias = nn.Parameter(bias[start : start + size], requires_grad=False)
            start += size
    return weight, bias, sizes


def merge_projections(layer: Any) -> MergedProjections | None:
    """The layer's merged projections, made on the first call (the worker makes them before it sizes
    its KV pool, ``decode_graphs.prepare_weights``; never while a graph is captured: it allocates);
    None where some of q/k/v (or gate/up) have a bias and others not, or are not plain ``Linear``
    layers of one dtype."""
    merged = getattr(layer, "_mmserve_merged", None)
    if merged is not None:
        return merged
    attn, mlp = layer.self_attn, layer.mlp
    groups = ([attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj])
    if any(len({m.bias is None for m in group}) > 1 for group in groups):
        return None
    # plain Linear layers of one dtype only (a quantized layer's weight is not what F.linear takes)
    if any(type(m) is not nn.Linear or m.weight.dtype != attn.q_proj.weight.dtype for g in groups for m in g):
        return None
    merged = MergedProjections(*_merge(groups[0]), *_merge(groups[1]))
    layer._mmserve_merged = merged
    return merged


class FusedDecoder:
    """``PagedLanguageModel.decoder`` for a decode-only step in fixed shapes (hidden [B, hidden]):
    the same result from fewer kernels. ``use_triton``: the Triton kernels (CUDA), else PyTorch's.
    ``merge`` (default: with Triton) merges the layers' projections, once per model, so it is built
    outside graph capture. The CPU's path keeps them apart: there a one-row matmul's sum can round
    differently with more columns or with its weights at another alignment, and this path is the one
    that gives transformers' bits."""

    def __init__(
        self, language_model: Any, layers: list[Any], use_triton: bool, merge: bool | None = None
    ) -> None:
        self.lm, self.layers, self.use_triton = language_model, layers, use_triton
        merge = use_triton if merge is None else merge
        self.merged = [merge_projections(layer) if merge else None for layer in layers]

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
        for layer_idx, (layer, merged) in enumerate(zip(self.layers, self.merged, strict=True)):
            attn, mlp = layer.self_attn, layer.mlp
            x, residual = self._add_rms_norm(hidden, residual, layer.input_layernorm)
            head_dim = attn.head_dim
            if merged is not None:
                qkv = nn.functional.linear(x, merged.qkv_weight, merged.qkv_bias)
                q, k, v = (t.view(rows, -1, head_dim) for t in qkv.split(merged.qkv_sizes, -1))
            else:
                q, k, v = (p(x).view(rows, -1, head_dim) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = self._rope_write(layer_idx, q, k, v, cos, sin, step)  # [B, heads, d]
            out = step.attend(layer_idx, q.transpose(0, 1), attn.scaling)  # [B, heads, d]
            x, residual = self._add_rms_norm(
                attn.o_proj(out.reshape(rows, -1)), residual, layer.post_attention_layernorm
            )
            if merged is not None:
                gate_up = nn.functional.linear(x, merged.gate_up_weight, merged.gate_up_bias)
                gate, up = gate_up.split(merged.gate_up_sizes, -1)
            else:
                gate, up = mlp.gate_proj(x), mlp.up_proj(x)
            hidden = mlp.down_proj(self._silu_mul(gate, up))
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
            q, k, v = (_heads_dense(t) for t in (q, k, v))
            return fused_kernels.rope_write(q, k, v, cos, sin, k_pool, v_pool, step.write_slots)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        pool.write(layer_idx, step.write_slots, k, v)
        return q

    def _silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``gate``/``up`` [B, intermediate], each row dense (row slices of one matmul's output)."""
        if self.use_triton:
            return fused_kernels.silu_mul(gate, up)
        return nn.functional.silu(gate) * up


def _heads_dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` [B, heads, d] with each row's heads side by side (a row slice of a merged projection's
    output is), as the RoPE kernel reads it; else a contiguous copy."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()
