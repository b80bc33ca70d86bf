"""Decodes that share leading KV blocks attend to them together (cascade attention).

Requests for the same image share its prompt's KV blocks through the prefix cache: the same block ids
lead their block tables. Attending one decode at a time re-gathers those blocks for every request and
multiplies each query alone against them (memory-bound). Here the decodes of a step are grouped by a
common leading run of block ids, and each group's prefix is gathered once and attended by all of the
group's queries in one matrix product; each decode then attends its own remaining keys (its suffix) as
before, and the two partial results are combined exactly by their log-sum-exps::

    o = o_suffix + sigmoid(lse_prefix - lse_suffix) * (o_prefix - o_suffix)

which is softmax attention over prefix + suffix, rounded differently. A decode's query sits at its last
position, so it sees every key of a shared prefix: the prefix needs no causal mask, only padding masks.

Groups: the decodes sorted by block table; neighbours join a group while they share at least
``MIN_SHARED_KEYS`` leading keys with its first member, capped so that every member keeps its own new
token in its suffix. The grouped decodes form a batch of their own (their suffixes are short); decodes in
no group stay in the plain padded batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from workers.attention.base import SeqSpan

MIN_SHARED_KEYS = 128  # below this a group costs more ops than the gathers it saves (tiny models, CPU)


@dataclass(frozen=True)
class PrefixGroup:
    members: list[int]  # indices into the decode batch
    num_blocks: int  # shared leading blocks


def prefix_groups(decodes: list[SeqSpan], block_size: int) -> list[PrefixGroup]:
    """Groups of at least two decodes sharing at least ``MIN_SHARED_KEYS`` leading keys."""
    min_blocks = max(1, -(-MIN_SHARED_KEYS // block_size))
    order = sorted(
        (i for i, s in enumerate(decodes) if s.num_past_tokens // block_size >= min_blocks),
        key=lambda i: decodes[i].block_ids,
    )
    groups: list[PrefixGroup] = []
    start = 0
    while start < len(order):
        first = decodes[order[start]]
        end, num_blocks = start + 1, first.num_past_tokens // block_size
        while end < len(order):
            other = decodes[order[end]]
            shared = min(len(os.path.commonprefix([first.block_ids, other.block_ids])), num_blocks)
            shared = min(shared, other.num_past_tokens // block_size)
            if shared < min_blocks:
                break
            num_blocks, end = shared, end + 1
        if end - start >= 2:
            groups.append(PrefixGroup(order[start:end], num_blocks))
        start = end
    return groups


def group_decodes(
    spans: list[SeqSpan], decodes: list[int], block_size: int
) -> tuple[list[int], list[PrefixGroup]]:
    """The step's decodes (``decodes``: indices into ``spans``) that are in a group, group by group, and
    the groups with their members numbered by position in that list."""
    grouped: list[int] = []
    groups = []
    for group in prefix_groups([spans[i] for i in decodes], block_size):
        groups.append(
            PrefixGroup(list(range(len(grouped), len(grouped) + len(group.members))), group.num_blocks)
        )
        grouped += [decodes[i] for i in group.members]
    return grouped, groups


def suffix_spans(decodes: list[SeqSpan], groups: list[PrefixGroup], block_size: int) -> list[SeqSpan]:
    """Each decode's span less its group's shared blocks (unchanged outside any group)."""
    out = list(decodes)
    for group in groups:
        for i in group.members:
            span, skip = decodes[i], group.num_blocks
            out[i] = SeqSpan(span.req_id, span.num_past_tokens - skip * block_size, 1, span.block_ids[skip:])
    return out


def host_tensors(
    groups: list[PrefixGroup], decodes: list[SeqSpan]
) -> tuple[list[torch.Tensor], tuple[int, int]]:
    """The groups (of every one of ``decodes``) as padded index tensors, for the step's one
    host-to-device copy: each group's member rows (padding repeats its first member), its shared block
    ids (padding: block 0), its number of shared blocks, and each decode's row in the groups' flattened
    [num_groups * Gmax] member grid. Returns them and (Gmax, Pmax)."""
    max_members = max(len(g.members) for g in groups)
    max_blocks = max(g.num_blocks for g in groups)
    members, blocks, row_of = [], [], [0] * len(decodes)
    for g, group in enumerate(groups):
        members.append(group.members + group.members[:1] * (max_members - len(group.members)))
        # every member's table starts with the shared blocks: take the first member's
        shared = decodes[group.members[0]].block_ids[: group.num_blocks]
        blocks.append(shared + [0] * (max_blocks - group.num_blocks))
        for position, member in enumerate(group.members):
            row_of[member] = g * max_members + position
    num_blocks = [g.num_blocks for g in groups]
    as_tensors = [torch.tensor(x, dtype=torch.long) for x in (members, blocks, num_blocks, row_of)]
    return as_tensors, (max_members, max_blocks)


@dataclass(frozen=True)
class SharedPrefixes:
    """One step's prefix groups, on the device."""

    num_groups: int
    max_members: int  # Gmax
    num_keys: int  # Pmax * block_size
    members: torch.Tensor  # [num_groups * Gmax]: decode rows
    key_blocks: torch.Tensor  # [num_groups * Pmax]
    mask: torch.Tensor  # [num_groups, 1, 1, Pmax * block_size] additive
    row_of: torch.Tensor  # [num_decodes]

    @staticmethod
    def from_device(
        parts: list[torch.Tensor], max_members: int, max_blocks: int, block_size: int, dtype: torch.dtype
    ) -> SharedPrefixes:
        members, key_blocks, num_blocks, row_of = parts
        keys = torch.arange(max_blocks * block_size, device=members.device)
        visible = keys.view(1, -1) < (num_blocks * block_size).unsqueeze(1)
        mask = torch.zeros(visible.shape, dtype=dtype, device=members.device)
        mask = mask.masked_fill_(~visible, float("-inf")).view(len(num_blocks), 1, 1, -1)
        return SharedPrefixes(len(num_blocks), max_members, keys.numel(), members, key_blocks, mask, row_of)

    def attend(
        self,
        q: torch.Tensor,
        suffix_k: torch.Tensor,
        suffix_v: torch.Tensor,
        suffix_mask: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q [B, kv_heads, group, d] (one query per decode, heads grouped by their K/V head), suffix K/V
        [B, kv_heads, L, d] with its additive mask [B, 1, 1, L]; the pool's K/V blocks. -> [B, kv_heads,
        group, d]."""
        _, num_kv_heads, group, head_dim = q.shape
        o_suffix, lse_suffix = _attention(q, suffix_k, suffix_v, suffix_mask, scale)
        shape = (self.num_groups, self.num_keys, num_kv_heads, head_dim)
        k = k_blocks.index_select(0, self.key_blocks).view(shape).transpose(1, 2)
        v = v_blocks.index_select(0, self.key_blocks).view(shape).transpose(1, 2)
        q_groups = (
            q.index_select(0, self.members)
            .view(self.num_groups, self.max_members, num_kv_heads, group, head_dim)
            .transpose(1, 2)
            .reshape(self.num_groups, num_kv_heads, self.max_members * group, head_dim)
        )
        o_prefix, lse_prefix = _attention(q_groups, k, v, self.mask, scale)
        o_prefix = _per_member(o_prefix, self.max_members, group, head_dim)
        lse_prefix = _per_member(lse_prefix, self.max_members, group, 1)
        weight = torch.sigmoid(lse_prefix.index_select(0, self.row_of) - lse_suffix)
        return torch.lerp(o_suffix, o_prefix.index_select(0, self.row_of), weight.to(o_suffix.dtype))


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [N, kv_heads, M, d] over k/v [N, kv_heads, L, d] with an additive mask
    broadcast to [N, kv_heads, M, L]; returns the output and the log-sum-exp of the scores [.., M, 1]
    (fp32 where the inputs are narrower)."""
    scores = torch.matmul(q, k.transpose(2, 3)).float().mul_(scale).add_(mask)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = scores.sub_(lse).exp_().to(v.dtype)
    return torch.matmul(probs, v), lse


def _per_member(x: torch.Tensor, max_members: int, group: int, last: int) -> torch.Tensor:
    """[G, kv_heads, Gmax * group, last] -> [G * Gmax, kv_heads, group, last]."""
    num_groups, num_kv_heads = x.shape[:2]
    return (
        x.view(num_groups, num_kv_heads, max_members, group, last)
        .transpose(1, 2)
        .reshape(num_groups * max_members, num_kv_heads, group, last)
    )
