"""A step's input embeddings: token embeddings with each placeholder position replaced by its
row of the item's encoder output (what transformers does with ``masked_scatter``), sliced at chunk
boundaries; and, for families whose outputs have deeper levels (Qwen3-VL's deepstack), those levels'
rows for the same positions."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from workers.attention import SeqSpan
from workers.encoder_store import EncoderStore
from workers.host_copies import to_device
from workers.paged_lm import Deepstack
from workers.runner_requests import RequestState, StepError


def step_embeddings(
    embed_tokens: nn.Module,
    token_ids: list[int],
    spans: list[SeqSpan],
    requests: dict[str, RequestState],
    encoder_store: EncoderStore,
    device: torch.device,
    pending: Sequence[tuple[int, tuple[torch.Tensor, int]]] = (),
) -> tuple[torch.Tensor, Deepstack | None]:
    """[len(token_ids), hidden] embeddings of the step's tokens (ordered as ``spans``), and the
    deepstack inputs where the encoder outputs have deeper levels. ``pending``: (index, (tokens, row))
    of each token still on the device, sampled by the step before (its ``token_ids`` entry is a
    placeholder): read there, in one gather per tensor, after that step's sampling on the stream."""
    ids = to_device(token_ids, device, torch.long)
    for _, group in itertools.groupby(pending, key=lambda entry: id(entry[1][0])):
        entries = list(group)
        source = entries[0][1][0]
        at = to_device([index for index, _ in entries], device, torch.long)
        ids[at] = source[to_device([row for _, (_, row) in entries], device, torch.long)]
    embeds = embed_tokens(ids)
    deep_rows: list[torch.Tensor] = []
    deep_mask = torch.zeros(len(token_ids), dtype=torch.bool)
    base = 0
    for span in spans:
        start, end = span.num_past_tokens, span.num_past_tokens + span.num_new_tokens
        for placement in requests[span.req_id].placements:
            feat = placement.feature
            lo, hi = max(start, feat.offset), min(end, feat.end)
            if lo >= hi:
                continue
            output = encoder_store.get(feat.mm_hash)
            if output.shape[0] != feat.num_tokens:
                raise StepError(
                    f"mm item {feat.mm_hash!r} has {output.shape[0]} embeddings, "
                    f"its placement {feat.num_tokens}"
                )
            where: slice | torch.Tensor
            if placement.rows is None:  # all placeholders: row i at offset + i
                rows = output[lo - feat.offset : hi - feat.offset]
                where = slice(base + lo - start, base + hi - start)
            else:  # text between the placeholders: the rows whose positions the chunk covers
                covered = (placement.rows >= lo - feat.offset) & (placement.rows < hi - feat.offset)
                chosen = covered.nonzero().flatten()
                rows = output[chosen.to(output.device)]
                where = placement.rows[chosen] + (feat.offset - start + base)
            if rows.ndim == 3:  # [rows, levels, hidden]
                deep_rows.append(rows[:, 1:])
                deep_mask[where] = True
                rows = rows[:, 0]
            embeds[where] = rows.to(embeds.dtype)
        base += span.num_new_tokens
    if not deep_rows:
        return embeds, None
    # Placements were visited in token order, so the rows line up with the mask's True positions.
    levels = torch.cat(deep_rows).to(embeds.dtype).unbind(dim=1)
    return embeds, Deepstack(mask=deep_mask.to(device), levels=list(levels))
