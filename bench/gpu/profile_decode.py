"""Where a decode step's time goes: the worker's ``ModelRunner`` in this process (no API, engine or IPC),
``--batches`` of text requests of ``--prompt-tokens`` each prefilled, then decode steps timed with the
decode CUDA graphs (workers/decode_graphs.py: with the fused layers and the Triton kernels; with
transformers' layers; where Triton is there, without it) and without graphs (eager), then steps back to
back one at a time and overlapped as with ``--worker-step-overlap`` (wall time per step), and the largest
batch's graph steps under the torch profiler.

    python bench/gpu/profile_decode.py --model DIR --out DIR [--device cuda] [--batches 1,16,64]

Writes ``profile.txt``: per batch and mode, the worker's step time (its ``forward_seconds``, as served
steps report it), the language model's part of it (synchronised before and after) and the rest (the
host's step preparation and sampling); then, for the graph steps, the GPU's busy time per step (the sum of
its kernels) and the top operators by GPU and by CPU time. A step whose time is far above its kernels'
sum is bound by the host; one whose kernels add up to it is bound by them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.integration.fake_engine import FakeEngine, Prompt  # noqa: E402
from wire.protocol import SamplingParams  # noqa: E402
from workers.decode_graphs import DecodeGraphs  # noqa: E402
from workers.model_runner import ModelRunner  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt-tokens", type=int, default=280)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--image-px", type=int, default=1024, help="the encoder's image, square")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    cuda = args.device.startswith("cuda")
    steps = args.steps
    max_tokens = 12 * steps + 16  # enough for every measured step below
    kv_tokens = sum(batches) * (args.prompt_tokens + max_tokens + 32)
    runner = ModelRunner(str(args.model), args.device, kv_cache_tokens=kv_tokens, decode_graphs=True)
    graphs = runner.lm_forward
    assert isinstance(graphs, DecodeGraphs)
    has_triton, can_fuse = graphs.triton, graphs.fused
    lm_seconds = [0.0]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed_lm(*call_args: Any, **kwargs: Any) -> torch.Tensor:
        sync()
        started = time.perf_counter()
        logits = graphs(*call_args, **kwargs)
        sync()
        lm_seconds[0] += time.perf_counter() - started
        return logits

    def measure(engine: FakeEngine, phase_split: bool) -> tuple[float, float]:
        """(worker ms per step, LM ms per step) over ``steps`` decode steps."""
        lm_seconds[0] = 0.0
        runner.lm_forward = timed_lm if phase_split else graphs  # type: ignore[assignment]
        worker = sum(engine.step().forward_seconds for _ in range(steps))
        runner.lm_forward = graphs
        return 1e3 * worker / steps, 1e3 * lm_seconds[0] / steps

    def wall_ms(engine: FakeEngine, overlapped: bool) -> float:
        """Wall time per decode step, each step finished before the next is launched or, as with
        --worker-step-overlap, launched before the one before is finished (its tokens on the device)."""
        sync()
        started = time.perf_counter()
        if overlapped:
            engine.decode_overlapped(steps)
        else:
            for _ in range(steps):
                engine.step()
        sync()
        return 1e3 * (time.perf_counter() - started) / steps

    lines = [
        f"decode steps, {args.prompt_tokens}-token prompts, {runner.device} {runner.dtype}",
        "",
        "| batch | mode | worker step ms | LM ms (synchronised) | rest ms |",
        "|---|---|---|---|---|",
    ]
    overlap_lines = [
        "",
        "steps back to back (graphs, fused, Triton where there): wall ms per step",
        "",
        "| batch | one at a time | overlapped (--worker-step-overlap) |",
        "|---|---|---|",
    ]
    gen = torch.Generator().manual_seed(0)
    profiled = None
    for batch in batches:
        engine = FakeEngine(runner)
        for i in range(batch):
            ids = torch.randint(10, 2000, (args.prompt_tokens,), generator=gen).tolist()
            sampling = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
            engine.add(f"b{batch}-r{i}", Prompt(ids, [], [], [], torch.empty(0)), sampling)
        engine.step()  # every prompt in one step
        for _ in range(3):  # warm-up decode steps (their shapes are captured here)
            engine.step()
        # (mode, graphs on, Triton kernels, fused layers); each graph mode captures its shapes again
        modes = [("graphs", True, has_triton, True), ("graphs, unfused layers", True, has_triton, False)]
        if has_triton:
            modes.append(("graphs, no Triton", True, False, True))
        modes.append(("eager", False, has_triton, True))
        for mode, enabled, triton, fused in modes:
            graphs.enabled = enabled
            if enabled and (graphs.triton, graphs.fused) != (triton, fused and can_fuse):
                graphs.reset(triton, fused)
                engine.step()
            step_ms, _ = measure(engine, phase_split=False)
            _, lm_ms = measure(engine, phase_split=True)
            lines.append(f"| {batch} | {mode} | {step_ms:.2f} | {lm_ms:.2f} | {step_ms - lm_ms:.2f} |")
            print(lines[-1], flush=True)
        graphs.enabled = True
        if (graphs.triton, graphs.fused) != (has_triton, can_fuse):
            graphs.reset(has_triton)
            engine.step()
        one_at_a_time, overlapped = wall_ms(engine, False), wall_ms(engine, True)
        overlap_lines.append(f"| {batch} | {one_at_a_time:.2f} | {overlapped:.2f} |")
        print(overlap_lines[-1], flush=True)
        if batch == max(batches):
            profiled = _profile(engine, steps, cuda)
        engine.run()
    lines += overlap_lines
    lines += ["", f"decode graphs captured: {sorted(graphs.shapes)} (rows, key blocks)", ""]
    lines += profiled or []
    lines += _encoder(runner, args.model, args.image_px, cuda)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.txt").write_text("\n".join(lines) + "\n")


def _profile(engine: FakeEngine, steps: int, cuda: bool) -> list[str]:
    """The engine's next ``steps`` steps under the torch profiler: kernel time per step, top operators."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:  # every step's events, not only the last cycle's
        profiler = profile(activities=activities, acc_events=True)
    except TypeError:
        profiler = profile(activities=activities)
    with profiler as prof:
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    # the kernels' rows (no CPU time of their own): an operator's row repeats its kernels' time
    kernels = [e for e in events if e.self_cpu_time_total == 0]
    device_us = sum(getattr(e, "self_device_time_total", 0.0) for e in kernels) if cuda else 0.0
    per_step_ms = device_us / 1e3 / steps
    lines = [f"graph steps under the profiler: GPU kernels per step (sum) {per_step_ms:.2f} ms", ""]
    if cuda:
        lines += ["by GPU time:", _by_gpu_time(events), ""]
    return lines + ["by CPU time:", events.table(sort_by="self_cpu_time_total", row_limit=20)]


def _encoder(runner: ModelRunner, model: Path, image_px: int, cuda: bool) -> list[str]:
    """The vision encoder on one random ``image_px`` square image, processed by the checkpoint's image
    processor as the API would: its time (median of 5 after 2 warm-ups), a Qwen tower's patch embedding
    alone as transformers' class runs it and as the worker does, and on CUDA one run under the torch
    profiler by GPU time."""
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor

    pixels = np.random.default_rng(0).integers(0, 256, (image_px, image_px, 3), dtype=np.uint8)
    processed = AutoImageProcessor.from_pretrained(model)(
        images=[Image.fromarray(pixels)], return_tensors="pt"
    )
    item = {name: processed[name] for name in runner.model.item_tensors["image"]}
    ms = _median_ms(lambda: runner.model.encode([item]), cuda)
    shape = tuple(processed["pixel_values"].shape)
    lines = ["", f"encoder: one {image_px}x{image_px} image (pixels {shape}): {ms:.1f} ms (median of 5)"]
    visual = getattr(runner.model.hf_model.model, "visual", None)
    if visual is not None:  # a Qwen family: its patch embedding alone, as transformers' class and the worker
        embed = visual.patch_embed
        pixel_values = processed["pixel_values"].to(runner.model.device)
        with torch.inference_mode():
            stock = _median_ms(lambda: type(embed).forward(embed, pixel_values), cuda)
            worker = _median_ms(lambda: embed(pixel_values), cuda)
        lines.append(
            f"patch embedding: {stock:.2f} ms as transformers' Conv3d, {worker:.2f} ms as the worker runs it"
        )
    lines.append("")
    print("\n".join(lines), flush=True)
    if cuda:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            runner.model.encode([item])
            torch.cuda.synchronize()
        lines += ["encoder by GPU time:", _by_gpu_time(prof.key_averages())]
    return lines


def _median_ms(call: Any, cuda: bool) -> float:
    """``call()``'s time in ms: the median of 5, after 2 warm-ups."""

    def once() -> float:
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        call()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    for _ in range(2):
        once()
    return 1e3 * sorted(once() for _ in range(5))[2]


def _by_gpu_time(events: Any) -> str:
    """The profiler's top 20 operators by their own GPU time (the column's name varies by torch)."""
    try:
        return str(events.table(sort_by="self_device_time_total", row_limit=20))
    except (KeyError, AttributeError, ValueError):
        return str(events.table(sort_by="self_cuda_time_total", row_limit=20))


if __name__ == "__main__":
    main()
