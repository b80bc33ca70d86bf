"""The portable batched backend (CPU and CUDA): the step's spans run as at most three padded batches,
one attention call each per layer, whatever the number of requests.

    decodes  (1 new token each)   q [B, heads, 1, d]     x  K/V [B, kv_heads, Lmax, d]
    decodes sharing leading blocks with others: the shared blocks once per group, then each one's own
        (``workers.attention.shared_prefix``)
    prefills (chunks, resumes)    q [B, heads, Qmax, d]  x  K/V [B, kv_heads, Lmax, d]
        on a CPU, a span from its first token alone, as causal attention without a mask, and the
        others in batches of like sizes (each pads its spans' attention to at most 1.25x their own)

Everything that depends only on the step is built once, before the first layer, and copied to the
device in one transfer: each batch's query rows (which of the step's tokens, padded), each span's
block table (padded with block 0), which rows are real, and an additive mask (query i of a span at
position past + i sees keys 0..past + i and none of the padding). Per layer a batch is then one gather
of K and one of V from the pool, whole blocks at a time (a few large copies instead of one per token:
several times faster), one attention call and one scatter of the real rows back into the step's token
order. Decodes and prefills are separate batches so a long
prefill chunk does not pad every decode to its length.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.attention.base import SeqSpan, StepAttention, write_slots
from workers.attention.shared_prefix import SharedPrefixes, group_decodes, host_tensors, suffix_spans
from workers.kv_pool import KVPool


@dataclass(frozen=True)
class _Batch:
    """Spans attended together. Indices are flat: row r of span b is ``b * num_queries + r``."""

    num_spans: int
    num_queries: int  # Qmax
    num_keys: int  # Lmax: the longest span's keys, rounded up to whole blocks
    query_tokens: torch.Tensor  # [B * Qmax]: the step's token index of each query row (padding: a real one)
    real_rows: torch.Tensor  # [n]: flat rows that are real queries
    real_tokens: torch.Tensor  # [n]: the step's token index of each of them
    key_blocks: torch.Tensor  # [B * Lmax / block_size]: each span's block table, padded with block 0
    mask: torch.Tensor  # [B, 1, Qmax, Lmax] additive (0 or -inf), the query's dtype
    shared: SharedPrefixes | None = None  # decodes only: leading blocks attended once per group
    causal: bool = False  # one span from its first token: the kernel's causal path, without the mask


class BatchedAttention(StepAttention):
    def __init__(self, pool: KVPool, spans: list[SeqSpan], device: torch.device, dtype: torch.dtype) -> None:
        starts, start = [], 0
        for span in spans:
            starts.append(start)
            start += span.num_new_tokens
        decodes = [i for i, s in enumerate(spans) if s.num_new_tokens == 1]
        prefills = [i for i, s in enumerate(spans) if s.num_new_tokens > 1]
        host: list[torch.Tensor] = []
        # decodes sharing leading blocks (the same image) attend them once per group, in a batch of
        # their own holding only each one's remaining blocks: a long-context decode in no group would
        # pad them all to its length
        grouped, groups = group_decodes(spans, decodes, pool.block_size)
        in_groups = set(grouped)
        plain = [i for i in decodes if i not in in_groups]
        grouped_spans = [spans[i] for i in grouped]
        planned = list(spans)
        for i, suffix in zip(grouped, suffix_spans(grouped_spans, groups, pool.block_size), strict=True):
            planned[i] = suffix
        members = [m for m in (plain, grouped, *_prefill_batches(spans, prefills, device)) if m]
        plans = [_plan(pool, planned, starts, m, host) for m in members]
        if groups:
            group_tensors, (max_members, max_blocks) = host_tensors(groups, grouped_spans)
            host += group_tensors
        host.append(write_slots(spans, pool.block_size))
        parts = iter(torch.cat([t.flatten() for t in host]).to(device).split([t.numel() for t in host]))
        self.batches = []
        for (num_spans, num_queries, num_keys), batch in zip(plans, members, strict=True):
            query_tokens, real_rows, real_tokens, key_blocks, last_key = (next(parts) for _ in range(5))
            self.batches.append(
                _Batch(
                    num_spans,
                    num_queries,
                    num_keys,
                    query_tokens,
                    real_rows,
                    real_tokens,
                    key_blocks,
                    _additive_mask(last_key.view(num_spans, num_queries), num_keys, dtype),
                    causal=num_queries > 1 and len(batch) == 1 and spans[batch[0]].num_past_tokens == 0,
                )
            )
        if groups:
            shared = SharedPrefixes.from_device(
                [next(parts) for _ in range(4)], max_members, max_blocks, pool.block_size, dtype
            )
            index = members.index(grouped)
            self.batches[index] = dataclasses.replace(self.batches[index], shared=shared)
        super().__init__(pool, spans, next(parts))

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        num_heads, num_tokens, head_dim = query.shape
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
        k_blocks, v_blocks = self.pool.blocks(layer_idx, 0), self.pool.blocks(layer_idx, 1)
        num_kv_heads = self.pool.kv.shape[3]
        for b in self.batches:
            q = query.index_select(1, b.query_tokens).view(num_heads, b.num_spans, b.num_queries, head_dim)
            k = k_blocks.index_select(0, b.key_blocks).view(b.num_spans, b.num_keys, num_kv_heads, head_dim)
            v = v_blocks.index_select(0, b.key_blocks).view(b.num_spans, b.num_keys, num_kv_heads, head_dim)
            if b.shared is not None:  # decodes, one query each
                o = b.shared.attend(
                    q.transpose(0, 1).reshape(b.num_spans, num_kv_heads, num_heads // num_kv_heads, head_dim),
                    k.transpose(1, 2),
                    v.transpose(1, 2),
                    b.mask,
                    k_blocks,
                    v_blocks,
                    head_dim**-0.5 if scaling is None else scaling,
                )
                out.index_copy_(0, b.real_tokens, o.reshape(b.num_spans, num_heads, head_dim))
                continue
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=None if b.causal else b.mask,
                is_causal=b.causal,  # (query i sees keys 0..i; the padding keys lie past every query)
                scale=scaling,
                enable_gqa=num_heads != num_kv_heads,
            )  # [B, heads, Qmax, d]
            rows = o.transpose(1, 2).reshape(b.num_spans * b.num_queries, num_heads, head_dim)
            out.index_copy_(0, b.real_tokens, rows.index_select(0, b.real_rows))
        return out


PREFILL_PADDING = 1.25  # on a CPU: a prefill batch's padded attention over its spans' own, at most
CAUSAL_ALONE = 256  # on a CPU: a span of this many tokens or more from its first runs alone, causal


def _prefill_batches(spans: list[SeqSpan], prefills: list[int], device: torch.device) -> list[list[int]]:
    """The prefill spans' batches. On a GPU one (a call per span costs more than the padding). On a CPU,
    whose attention kernel computes every padded query and key, and every masked one (an additive mask
    keeps it off its causal path, which skips the keys past each query), a long span from its first
    token runs alone, causal, and the others (short ones, later chunks, resumes: equal short spans gain
    from one call) in batches of like sizes, longest first:
    a span joins the batch being filled while the batch's padded area (spans x Qmax x Lmax) stays
    within ``PREFILL_PADDING`` x its spans' own. Measured (a step of the tiny LLaVA, one thread, its
    prompts from their first token), in one batch and so: eight of 64-448 tokens, 40 and 26 ms; one of
    512 and seven of 64, 40 and 12 ms; one of 2,048, 79 and 51 ms; two of 1,024, 46 and 36 ms; sixteen
    of 128, 20 ms either way."""
    if device.type == "cuda" or len(prefills) < 2:
        return [prefills]
    alone = {i for i in prefills if spans[i].num_past_tokens == 0 and spans[i].num_new_tokens >= CAUSAL_ALONE}
    batches = [[i] for i in prefills if i in alone]
    rest = [i for i in prefills if i not in alone]
    order = sorted(rest, key=lambda i: (spans[i].num_kv_tokens, spans[i].num_new_tokens), reverse=True)
    start = len(batches)
    for i in order:
        batch = batches[-1] if len(batches) > start else []
        members = [spans[j] for j in (*batch, i)]
        padded = len(members) * max(m.num_new_tokens for m in members) * members[0].num_kv_tokens
        if batch and padded <= PREFILL_PADDING * sum(m.num_new_tokens * m.num_kv_tokens for m in members):
            batch.append(i)
        else:
            batches.append([i])
    return batches


def _plan(
    pool: KVPool, spans: list[SeqSpan], starts: list[int], group: list[int], host: list[torch.Tensor]
) -> tuple[int, int, int]:
    """Appends one batch's host tensors to ``host`` (query tokens, real rows, real tokens, key slots,
    each query row's last visible key); returns (B, Qmax, Lmax)."""
    members = [spans[i] for i in group]
    num_queries = max(s.num_new_tokens for s in members)
    block_size = pool.block_size
    num_blocks = -(-max(s.num_kv_tokens for s in members) // block_size)
    num_keys = num_blocks * block_size
    new = torch.tensor([s.num_new_tokens for s in members], dtype=torch.long)
    past = torch.tensor([s.num_past_tokens for s in members], dtype=torch.long)
    first = torch.tensor([starts[i] for i in group], dtype=torch.long)
    row = torch.arange(num_queries, dtype=torch.long)
    real = row.unsqueeze(0) < new.unsqueeze(1)  # [B, Qmax]
    # a padding row repeats the span's first query and sees what it sees: never an empty row
    query_tokens = first.unsqueeze(1) + torch.where(real, row.unsqueeze(0), 0)
    last_key = past.unsqueeze(1) + torch.where(real, row.unsqueeze(0), 0)  # query i sees keys 0..past + i
    real_rows = real.flatten().nonzero().squeeze(1)
    tables = [s.block_ids[: -(-s.num_kv_tokens // block_size)] for s in members]
    key_blocks = torch.tensor([t + [0] * (num_blocks - len(t)) for t in tables], dtype=torch.long)
    host += [query_tokens, real_rows, query_tokens.flatten()[real_rows], key_blocks, last_key]
    return len(members), num_queries, num_keys


def _additive_mask(last_key: torch.Tensor, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, Qmax, Lmax]: 0 where key j <= ``last_key[b, i]``, -inf elsewhere (padding keys included,
    since a real query's last key is below its span's key count)."""
    keys = torch.arange(num_keys, device=last_key.device)
    visible = keys.view(1, 1, -1) <= last_key.unsqueeze(2)
    mask = torch.zeros(visible.shape, dtype=dtype, device=last_key.device)
    return mask.masked_fill_(~visible, float("-inf")).unsqueeze(1)
