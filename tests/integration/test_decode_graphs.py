"""Decode-only steps in the fixed shapes that CUDA graphs capture (workers/decode_graphs.py), run without
capture on the CPU: the same tokens and, step by step, the same logits as the eager forward, for batches
that pad to a bucket, contexts of different lengths in one step, and requests joining and finishing.
(On a GPU, the CUDA tier checks the captured graphs against transformers' ``generate``.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.integration.fake_engine import FakeEngine, Prompt
from tests.integration.runner_support import BACKEND_LOGITS_ATOL, record_logits
from wire.protocol import SamplingParams
from workers.decode_graphs import DecodeGraphs, batch_bucket, key_blocks_bucket
from workers.model_runner import ModelRunner

pytestmark = pytest.mark.slow


def text_prompt(num_tokens: int, seed: int) -> Prompt:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 200, (num_tokens,), generator=gen).tolist()
    return Prompt(ids, [], [], [], torch.empty(0))


def run(model_dir: Path, graphs: bool) -> tuple[FakeEngine, list[torch.Tensor], object]:
    """Three requests (one with a 300-token prompt), two more joining while they decode."""
    runner = ModelRunner(str(model_dir), device="cpu", kv_cache_tokens=4096, decode_graphs=graphs)
    forward = runner.lm_forward
    logits = record_logits(runner)
    engine = FakeEngine(runner, shuffle_seed=1)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    for i, length in enumerate([20, 300, 45]):
        engine.add(f"r{i}", text_prompt(length, i), greedy)
    for _ in range(4):
        engine.step()
    engine.add("r3", text_prompt(80, 3), greedy)
    engine.add("r4", text_prompt(7, 4), SamplingParams(max_tokens=20, temperature=0.0))
    engine.run()
    return engine, logits, forward


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_fixed_shape_decode_steps_give_the_eager_logits(tiny_model: Callable[[str], Path], family: str):
    eager, eager_logits, _ = run(tiny_model(family), graphs=False)
    fixed, fixed_logits, forward = run(tiny_model(family), graphs=True)
    assert fixed.outputs == eager.outputs
    assert len(fixed_logits) == len(eager_logits)
    for step, (got, expected) in enumerate(zip(fixed_logits, eager_logits, strict=True)):
        torch.testing.assert_close(got, expected, atol=BACKEND_LOGITS_ATOL, rtol=0, msg=f"step {step}")
    assert isinstance(forward, DecodeGraphs)
    assert forward.fused  # the layers ran as workers/fused_decode.py computes them
    assert forward.num_replays >= 20
    rows = {num_rows for num_rows, _ in forward.shapes}
    assert {4, 8} <= rows, "batches of 3 and 5 decodes ran padded"
    # with the 300-token prompt in the batch every row reads 32 blocks; after it, 16
    assert {num_blocks for _, num_blocks in forward.shapes} == {16, 32}


def test_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 17, 64, 65)] == [1, 2, 4, 8, 8, 16, 24, 64, 72]
    assert [key_blocks_bucket(n) for n in (1, 16, 17, 33, 100)] == [16, 16, 32, 64, 128]
