"""The dynamic-resolution families on real ``mmserve`` processes (tiny Qwen2-VL and tiny Qwen3-VL).

    python bench/bench_families.py [--families qwen2_vl,qwen3_vl] [--repeats 5] [--requests 160]

1. Time to first token (streamed, 16 tokens, median of ``--repeats``) for one 1024x768 JPEG:
   cold (a new image every time, every cache on), with only the encoder cache warm (processor cache, IPC
   cache and prefix cache off, the same image again), and with every cache warm (the same image again).
2. Requests per second at concurrency 16 when 80 % of requests reuse one of 20 images of mixed sizes
   (224x224 to 1280x720) and 20 % bring a new one, 16 tokens each: every cache on vs every cache off,
   the same request sequence, in the same run.

Draws both tables into ``--chart`` (docs/img/caches_on_off.png).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
from contextlib import ExitStack
from datetime import date
from pathlib import Path

import httpx
from bench_input_scale import machine
from bench_throughput import REPO, chat_body, git, run_load, start_serve, stream_chat
from charts import Panel, draw
from images import jpeg_data_url  # bench/ is on sys.path: scripts run as bench/<name>.py

from workers.families.tiny import build_tiny_model

MAX_TOKENS = 16
SIZES = [(224, 224), (448, 448), (640, 480), (800, 600), (1024, 768), (1280, 720)]
ALL_OFF = [
    "--mm-processor-cache-gb", "0", "--mm-ipc-cache-gb", "0", "--encoder-cache-tokens", "0",
    "--no-enable-prefix-caching",
]  # fmt: skip
ENCODER_ONLY = ["--mm-processor-cache-gb", "0", "--mm-ipc-cache-gb", "0", "--no-enable-prefix-caching"]


def ttft_s(base_url: str, body: dict) -> float:
    async def one() -> float:
        async with httpx.AsyncClient(timeout=600.0) as client:
            return (await stream_chat(client, f"{base_url}/v1/chat/completions", body))[0]

    return asyncio.run(one())


def ttft_table(model: str, args: argparse.Namespace, model_dir: Path, folder: Path) -> dict[str, float]:
    with ExitStack() as stack:
        all_on = start_serve("all caches on", REPO, ["--model", str(model_dir)], folder, stack)
        encoder_only = start_serve(
            "encoder cache only", REPO, ["--model", str(model_dir), *ENCODER_ONLY], folder, stack
        )
        same = chat_body(model, "Describe the picture.", jpeg_data_url((1024, 768), 1), MAX_TOKENS)
        ttft_s(all_on, chat_body(model, "Warm up.", None, 2))
        cold = [
            ttft_s(all_on, chat_body(model, "Describe.", jpeg_data_url((1024, 768), 100 + i), MAX_TOKENS))
            for i in range(args.repeats)
        ]
        ttft_s(encoder_only, same)
        encoder_warm = [ttft_s(encoder_only, same) for _ in range(args.repeats)]
        ttft_s(all_on, same)
        all_warm = [ttft_s(all_on, same) for _ in range(args.repeats)]
    return {
        "cold": statistics.median(cold),
        "encoder cache warm": statistics.median(encoder_warm),
        "all caches warm": statistics.median(all_warm),
    }


def reuse_bodies(model: str, num_requests: int) -> list[dict]:
    rng = random.Random(0)
    pool = [jpeg_data_url(SIZES[i % len(SIZES)], 1000 + i) for i in range(20)]
    bodies = []
    for i in range(num_requests):
        if rng.random() < 0.8:
            image = pool[rng.randrange(len(pool))]
        else:
            image = jpeg_data_url(SIZES[rng.randrange(len(SIZES))], 5000 + i)
        bodies.append(chat_body(model, f"Request {i}: what do you see?", image, MAX_TOKENS))
    return bodies


def throughput_table(model: str, args: argparse.Namespace, model_dir: Path, folder: Path) -> dict[str, float]:
    bodies = reuse_bodies(model, args.requests)
    rates = {}
    for label, flags in (("all caches on", []), ("all caches off", ALL_OFF)):
        with ExitStack() as stack:
            url = start_serve(label, REPO, ["--model", str(model_dir), *flags], folder, stack)
            asyncio.run(run_load(url, bodies[:8], 4))  # warm-up: imports, first allocations
            wall_s, _ = asyncio.run(run_load(url, bodies, 16))
            rates[label] = len(bodies) / wall_s
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", default="qwen2_vl,qwen3_vl")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--chart", type=Path, default=REPO / "docs/img/caches_on_off.png")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="mmserve-bench-families-"))
    results = {}
    for family in args.families.split(","):
        model_dir = build_tiny_model(family, folder / f"tiny-{family}")
        ttft = ttft_table(model_dir.name, args, model_dir, folder)
        rates = throughput_table(model_dir.name, args, model_dir, folder)
        results[family] = (ttft, rates)
    print(f"\nTTFT, one 1024x768 JPEG, {MAX_TOKENS} tokens, median of {args.repeats} (ms):")
    print("| family | cold | encoder cache warm | all caches warm | cold / all warm |")
    print("|---|---|---|---|---|")
    for family, (ttft, _) in results.items():
        cold, enc, warm = ttft["cold"], ttft["encoder cache warm"], ttft["all caches warm"]
        print(f"| {family} | {cold * 1e3:.0f} | {enc * 1e3:.0f} | {warm * 1e3:.0f} | {cold / warm:.1f}x |")
    print(f"\nreq/s, concurrency 16, {args.requests} requests, 80 % reuse of 20 mixed-size images:")
    print("| family | all caches on | all caches off | on / off |")
    print("|---|---|---|---|")
    for family, (_, rates) in results.items():
        on, off = rates["all caches on"], rates["all caches off"]
        print(f"| {family} | {on:.2f} | {off:.2f} | {on / off:.2f}x |")
    revision = git("rev-parse", "--short", "HEAD").strip()
    draw(
        args.chart,
        "Every cache on against every cache off: tiny Qwen-VL checkpoints, JPEG images",
        [
            Panel(
                f"TTFT, one 1024x768 JPEG (ms, median of {args.repeats})",
                "ms",
                {family: {k: v * 1e3 for k, v in ttft.items()} for family, (ttft, _) in results.items()},
            ),
            Panel(
                "Requests/s, concurrency 16, 80 % reuse of 20 images",
                "req/s",
                {family: rates for family, (_, rates) in results.items()},
                fmt="{:.1f}",
            ),
        ],
        f"bench/bench_families.py · {date.today()} · revision {revision} · {machine()}",
    )
    print(f"\nlogs: {folder}")


if __name__ == "__main__":
    main()
