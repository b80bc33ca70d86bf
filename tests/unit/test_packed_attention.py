"""The vision towers' packed attention (workers/packed_attention.py) against one attention call per span,
transformers' own loop for implementations other than flash attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.packed_attention import packed_attention


def per_span(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    outs = [
        F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b])
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    return torch.cat(outs, dim=2).transpose(1, 2)


def test_spans_of_different_lengths_attend_only_within_themselves() -> None:
    torch.manual_seed(0)
    bounds = [0, 1, 17, 81, 90, 154]  # a one-token span, a full window, ragged edges
    q, k, v = (torch.randn(1, 4, bounds[-1], 16) for _ in range(3))
    got, weights = packed_attention(None, q, k, v, None, cu_seq_lens_q=torch.tensor(bounds))
    assert weights is None
    torch.testing.assert_close(got, per_span(q, k, v, bounds), atol=1e-5, rtol=1e-5)


def test_one_span_is_plain_attention() -> None:
    q, k, v = (torch.randn(1, 2, 10, 8) for _ in range(3))
    got, _ = packed_attention(None, q, k, v, None, cu_seq_lens_q=torch.tensor([0, 10]))
    torch.testing.assert_close(got, per_span(q, k, v, [0, 10]))
