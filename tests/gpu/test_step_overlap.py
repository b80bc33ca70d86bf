"""The worker's overlap on a GPU (docs/architecture.md, "Engine step"): step N+1 is launched, and step N
finished and answered, without the host waiting for the device's work queued after step N's tokens.
A long sleep kernel queued after step N stands for a long forward: launching N+1, finishing N and
sampling N+1 must all return while it still runs (any copy from pageable memory, or any other host
synchronisation on the way, would wait for it). The replies equal those of steps one at a time."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.integration.test_step_overlap import FRAMES, run_overlapped, steps
from wire.protocol import SchedulerOutput
from workers.model_runner import ModelRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SLEEP_CYCLES = 1_000_000_000  # about 0.5 s at an H100's clock: far longer than the host's work below


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_the_host_does_not_wait_for_the_device_between_steps(
    tiny_model: Callable[[str], Path], family: str
) -> None:
    def runner() -> ModelRunner:
        return ModelRunner(str(tiny_model(family)), device="cuda", kv_cache_tokens=4096, decode_graphs=True)

    sequential = runner()
    expected = [sequential.execute(step, FRAMES) for step in steps()]
    busy: list[torch.cuda.Event] = []

    def watch(step: SchedulerOutput, phase: str) -> None:
        if not 4 <= step.step_id <= 6:  # (the decode shapes were captured in the steps before)
            return
        if phase == "before":
            torch.cuda._sleep(SLEEP_CYCLES)  # the device is busy long after step N's tokens
            busy.append(torch.cuda.Event())
            busy[-1].record()
        elif phase == "sampled":  # launching N+1, finishing N and sampling N+1 did not wait for it
            assert not busy[-1].query(), f"step {step.step_id}: the host waited for the device"
            torch.cuda.synchronize()

    replies = run_overlapped(runner(), steps(), watch)
    assert len(busy) == 3
    assert [(r.req_ids, r.sampled_token_ids) for r in replies] == [
        (r.req_ids, r.sampled_token_ids) for r in expected
    ]
