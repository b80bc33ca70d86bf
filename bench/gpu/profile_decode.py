"""Where a decode step's time goes: the worker's ``ModelRunner`` in this process (no API, engine or IPC),
``--batch`` text requests of ``--prompt-tokens`` each prefilled, then ``--steps`` decode steps under the
torch profiler.

    python bench/gpu/profile_decode.py --model DIR --out DIR [--device cuda] [--batch 64]

Writes ``profile.txt``: the wall time per step (host clock around ``execute``, synchronised), the GPU's
busy time per step (the sum of its kernels), and the top operators by GPU time and by CPU time. A step
whose wall time is far above its kernels' sum is bound by the host (Python, launches); one whose kernels
add up to it is bound by them, and the table says which.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.integration.fake_engine import FakeEngine, Prompt  # noqa: E402
from wire.protocol import SamplingParams  # noqa: E402
from workers.model_runner import ModelRunner  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    kv_tokens = args.batch * (args.prompt_tokens + 2 * args.steps + 64)
    runner = ModelRunner(str(args.model), args.device, kv_cache_tokens=kv_tokens)
    engine = FakeEngine(runner, chunk_tokens=args.prompt_tokens)
    gen = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        ids = torch.randint(10, 2000, (args.prompt_tokens,), generator=gen).tolist()
        sampling = SamplingParams(max_tokens=2 * args.steps + 8, temperature=0.0)
        engine.add(f"r{i}", Prompt(ids, [], [], [], torch.empty(0)), sampling)
    engine.step()  # every prompt in one step
    for _ in range(args.steps):  # warm-up decode steps
        engine.step()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    sync()
    started = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    wall_ms = 1e3 * (time.perf_counter() - started) / args.steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:  # every step's events, not only the last cycle's
        profiler = profile(activities=activities, acc_events=True)
    except TypeError:
        profiler = profile(activities=activities)
    with profiler as prof:
        for _ in range(args.steps):
            engine.step()
        sync()
    events = prof.key_averages()
    # the kernels' rows (no CPU time of their own): an operator's row repeats its kernels' time
    kernels = [e for e in events if e.self_cpu_time_total == 0]
    device_us = sum(getattr(e, "self_device_time_total", 0.0) for e in kernels) if cuda else 0.0
    lines = [
        f"decode at batch {args.batch}, {args.prompt_tokens}-token prompts, {runner.device} {runner.dtype}",
        f"wall per step (host clock, synchronised): {wall_ms:.2f} ms",
        f"GPU kernels per step (sum): {device_us / 1e3 / args.steps:.2f} ms",
        "",
    ]
    if cuda:
        try:
            by_gpu = events.table(sort_by="self_device_time_total", row_limit=25)
        except (KeyError, AttributeError, ValueError):
            by_gpu = events.table(sort_by="self_cuda_time_total", row_limit=25)
        lines += ["by GPU time:", by_gpu, ""]
    lines += ["by CPU time:", events.table(sort_by="self_cpu_time_total", row_limit=25)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:3]))


if __name__ == "__main__":
    main()
