"""Decode-only steps replayed as CUDA graphs (docs/architecture.md, "Decode steps as CUDA graphs").

A decode step of a 7B model is about a thousand small kernels (28 layers of transformers' modules, each
op a launch); launched one by one from Python the GPU waits on the host. Here a step whose spans all
compute one token (and carry no deepstack inputs) runs in fixed shapes instead, captured once per shape
as a CUDA graph and replayed with new contents:

    B = the batch rounded up to a bucket (1, 2, 4, 8, then multiples of 8)
    N = the blocks of its longest context rounded up to a power of two (at least ``MIN_KEY_BLOCKS``)

    device inputs, written before each replay   the graph (the decoder's own modules)
      embeds     [B, hidden]                      rotary embedding of positions
      positions  [rows, B]  (1-D or M-RoPE)       each layer: projections, RoPE, write K/V at write_slots,
      block_tables [B, N], num_keys [B],            FixedDecodeAttention, MLP
      write_slots [B]                             final norm, LM head -> logits [B, vocab] (float32)

Padding rows and padding table entries point at the pool's spare block, so a replay writes K/V only into
the step's own slots and the spare block. Shapes are captured lazily, the first time a step needs one
(a few hundred milliseconds each for a 7B model), within a bound on B x N x block_size; a step beyond it,
a prefill chunk or a failed capture runs eagerly (``PagedLanguageModel``), so answers never depend on
whether a graph ran: both compute the same thing. On CPU nothing is captured: the fixed-shape forward
runs as it is, which is how the tests check it (tests/integration/test_decode_graphs.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from workers.attention import SeqSpan
from workers.attention.fixed_decode import FixedDecodeAttention
from workers.attention.triton_decode import triton_available
from workers.fused_decode import FusedDecoder, fusable, merge_projections
from workers.host_copies import to_device
from workers.paged_lm import Deepstack, PagedLanguageModel
from workers.prompt_logprobs import PromptLogprobRows

logger = logging.getLogger(__name__)

MIN_KEY_BLOCKS = 16
MAX_KEY_SLOTS = 64 * 8192  # B x N x block_size of the largest shape captured: bounds its K/V gathers
MAX_GRAPHS = 96


def batch_bucket(num_rows: int) -> int:
    if num_rows <= 8:
        return 1 << (num_rows - 1).bit_length()
    return -(-num_rows // 8) * 8


def key_blocks_bucket(num_blocks: int) -> int:
    return max(MIN_KEY_BLOCKS, 1 << (num_blocks - 1).bit_length())


def prepare_weights(language_model: Any, device: torch.device) -> None:
    """Called before the KV pool is sized: merges the projections the fused layers will use with
    Triton (``merge_projections``), then hands the replaced weights' memory back to the device, so the
    pool is sized against the weights as they will be and no freed copy stays reserved."""
    layers = PagedLanguageModel.decoder_layers(language_model)
    if not (triton_available(device) and fusable(layers)):
        return
    for layer in layers:
        merge_projections(layer)
    torch.cuda.empty_cache()


@dataclass
class _Shape:
    """One captured shape: its device inputs (views of one int64 buffer, written with one copy), its
    pinned host staging buffer, its logits, and the graph (None on CPU)."""

    num_rows: int
    num_blocks: int
    position_rows: int  # 1, or M-RoPE's 3
    embeds: torch.Tensor
    ints: torch.Tensor  # [B * N + 2 * B + rows * B]: block tables, num_keys, write slots, positions
    host: torch.Tensor
    logits: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None
    # the last copy of ``host`` to ``ints`` (on CUDA): the next step's inputs wait for it before they are
    # written there, since the worker prepares a step while the one before still runs
    copied: torch.cuda.Event | None = None


class DecodeGraphs:
    """Called as ``PagedLanguageModel`` is; decode-only steps it can shape run fixed-shape (captured on
    CUDA), the rest go to ``model``."""

    def __init__(self, model: PagedLanguageModel, embed_dim: int) -> None:
        self.model = model
        self.pool = model.kv_pool
        assert self.pool.kv.shape[2] > self.pool.num_blocks * self.pool.block_size, "needs a spare block"
        self.embed_dim = embed_dim
        self.device = self.pool.kv.device
        self.dtype = self.pool.kv.dtype
        self.capture = self.device.type == "cuda"
        self.shapes: dict[tuple[int, int], _Shape] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.triton = triton_available(self.device)  # the Triton kernels, while they work
        self.fused = fusable(model.layers)  # the layers' elementwise work in fewer kernels
        self.decoder = self._fused_decoder()
        self.enabled = True
        self.num_replays = 0

    def reset(self, triton: bool, fused: bool = True) -> None:
        """Drop every captured shape (they are captured again as steps need them), with the Triton
        kernels or not, and the fused layers or transformers' from now on. A new memory pool too: the
        old graphs' pool goes with them, and capturing into a released pool fails."""
        self.shapes.clear()
        self.triton = triton and triton_available(self.device)
        self.fused = fused and fusable(self.model.layers)
        self.decoder = self._fused_decoder()
        if self.capture:
            self.graph_pool = torch.cuda.graph_pool_handle()

    def __call__(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        spans: list[SeqSpan],
        logits_rows: list[int],
        deepstack: Deepstack | None = None,
        prompt_logprobs: PromptLogprobRows | None = None,
    ) -> torch.Tensor:
        eager = deepstack is not None or (prompt_logprobs is not None and bool(prompt_logprobs.rows))
        shape = None if eager else self._shape_for(spans, position_ids.shape[0])
        if shape is None:
            return self.model(inputs_embeds, position_ids, spans, logits_rows, deepstack, prompt_logprobs)
        logits = self._replay(shape, inputs_embeds, position_ids, spans)
        if logits_rows == list(range(len(spans))):
            return logits
        return logits.index_select(0, to_device(logits_rows, self.device, torch.long))

    def _shape_for(self, spans: list[SeqSpan], position_rows: int) -> _Shape | None:
        if not self.enabled or not spans or any(s.num_new_tokens != 1 for s in spans):
            return None
        block_size = self.pool.block_size
        num_rows = batch_bucket(len(spans))
        num_blocks = key_blocks_bucket(-(-max(s.num_kv_tokens for s in spans) // block_size))
        if num_rows * num_blocks * block_size > MAX_KEY_SLOTS:
            return None
        shape = self.shapes.get((num_rows, num_blocks))
        if shape is None and len(self.shapes) < MAX_GRAPHS:
            shape = self._make(num_rows, num_blocks, position_rows)
        return shape

    def _make(self, num_rows: int, num_blocks: int, position_rows: int) -> _Shape | None:
        started = time.perf_counter()
        size = num_rows * num_blocks + 2 * num_rows + position_rows * num_rows
        shape = _Shape(
            num_rows,
            num_blocks,
            position_rows,
            embeds=torch.zeros(num_rows, self.embed_dim, dtype=self.dtype, device=self.device),
            ints=torch.zeros(size, dtype=torch.long, device=self.device),
            host=torch.zeros(size, dtype=torch.long, pin_memory=self.capture),
        )
        self._fill_host(shape, [], torch.zeros(position_rows, 0, dtype=torch.long))
        shape.ints.copy_(shape.host)  # every row padding: warm-up and capture write only the spare block
        if self.capture:
            if not self._try_capture(shape):
                return None
            logger.info(
                "captured the decode CUDA graph for %d rows x %d key blocks in %.0f ms",
                num_rows,
                num_blocks,
                1e3 * (time.perf_counter() - started),
            )
        self.shapes[(num_rows, num_blocks)] = shape
        return shape

    def _try_capture(self, shape: _Shape) -> bool:
        """Captures ``shape``; where that fails, again without the Triton kernel, and where that fails
        too, decode steps run eagerly from then on (logged, never a failed step)."""
        try:
            self._capture(shape)
            return True
        except Exception:
            if self.triton:
                logger.exception("capturing with the Triton kernels failed: capturing without them")
                self.triton = False
                self.decoder = self._fused_decoder()  # the fused layers' PyTorch path (projections apart)
                # a fresh pool: a failed capture may have released the one it used
                self.graph_pool = torch.cuda.graph_pool_handle()
                return self._try_capture(shape)
            logger.exception("capturing a decode CUDA graph failed: decode steps run eagerly from now on")
            self.enabled = False
            return False

    def _capture(self, shape: _Shape) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up, as torch.cuda.graphs advises: lazy inits happen here
            for _ in range(2):
                self._forward(shape)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            shape.logits = self._forward(shape)
        shape.graph = graph

    def _views(self, shape: _Shape, ints: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(block_tables [B, N], num_keys [B], write_slots [B], positions [rows, B]) in ``ints``."""
        b, n, r = shape.num_rows, shape.num_blocks, shape.position_rows
        tables, num_keys, slots, positions = ints.split([b * n, b, b, r * b])
        return tables.view(b, n), num_keys, slots, positions.view(r, b)

    def _forward(self, shape: _Shape) -> torch.Tensor:
        """The fixed-shape step: device work only."""
        tables, num_keys, slots, positions = self._views(shape, shape.ints)
        step = FixedDecodeAttention(self.pool, tables, num_keys, slots, self.triton)
        if self.decoder is not None:
            hidden = self.decoder(shape.embeds, positions, step)
        else:
            hidden = self.model.decoder(shape.embeds, positions, step)
        return self.model.logits(hidden)

    def _fused_decoder(self) -> FusedDecoder | None:
        """The fused layers, built here and not while a graph is captured (the first build merges
        the layers' projections, which allocates)."""
        if not self.fused:
            return None
        return FusedDecoder(self.model.lm, self.model.layers, self.triton)

    def _fill_host(self, shape: _Shape, spans: list[SeqSpan], positions: torch.Tensor) -> None:
        """The step's inputs into the host buffer; rows and table entries past the real ones point at
        the spare block (padding rows see one key there)."""
        block_size, spare = self.pool.block_size, self.pool.spare_block
        tables, num_keys, slots, host_positions = (t.numpy() for t in self._views(shape, shape.host))
        tables.fill(spare)
        num_keys.fill(1)
        slots.fill(spare * block_size)
        host_positions.fill(0)
        for row, span in enumerate(spans):
            past = span.num_past_tokens
            table = span.block_ids[: shape.num_blocks]
            tables[row, : len(table)] = table
            num_keys[row] = past + 1
            slots[row] = table[past // block_size] * block_size + past % block_size
        host_positions[:, : len(spans)] = positions.numpy()

    def _replay(
        self, shape: _Shape, embeds: torch.Tensor, positions: torch.Tensor, spans: list[SeqSpan]
    ) -> torch.Tensor:
        n = len(spans)
        if shape.copied is not None:
            shape.copied.synchronize()  # (long done, as a rule: it came before the last replay)
        self._fill_host(shape, spans, positions.cpu())
        shape.ints.copy_(shape.host, non_blocking=self.capture)
        if self.capture:
            shape.copied = torch.cuda.Event()
            shape.copied.record()
        shape.embeds[:n].copy_(embeds)
        self.num_replays += 1
        if shape.graph is None:
            return self._forward(shape)[:n]
        shape.graph.replay()
        assert shape.logits is not None
        return shape.logits[:n]
