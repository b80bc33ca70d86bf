"""Video on real ``mmserve`` processes: a tiny Qwen2.5-VL and 10 s 640x360 H.264 clips (30 fps, a moving
pattern), sampled at 2 frames per second (20 frames, 2,520 placeholder tokens).

    python bench/bench_video.py [--repeats 5] [--requests 120] [--chart docs/img/video.png]

1. Per clip, in this process: the header check, the decode of the 20 sampled frames, the family's
   processing (resize, normalize, patches), each the median of ``--repeats``; the encoder's time per clip
   is the server's ``mmserve_encoder_seconds`` over the cold requests of part 2.
2. Time to first token (streamed, 16 tokens, median of ``--repeats``): cold (a new clip each time, every
   cache on), with only the encoder cache warm (processor cache, IPC cache and prefix cache off, the same
   clip again), with every cache warm (the same clip again), and a second sampling of a clip seen before
   (``num_frames`` 16 after ``fps`` 2: decoded again, processed and encoded again).
3. Requests per second at concurrency 8 when 80 % of requests ask about one of 5 clips (a seeded draw)
   and every fifth brings a new one, every cache on vs every cache off, the same request sequence, in the
   same run; each server is warmed up first with one request about each of the 5 clips (the steady state,
   where the 80 % are repeats).

"Every cache on" is the defaults plus an encoder cache of ``ENCODER_CACHE_TOKENS`` (13 of these clips):
the default space is the largest item the limits allow (64 frames: 8,192 tokens, 3 clips), which a
working set of 5 clips at concurrency 8 would thrash.

Draws the TTFT and req/s tables into ``--chart``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import random
import statistics
import tempfile
import time
from contextlib import ExitStack
from datetime import date
from pathlib import Path

from bench_families import ALL_OFF, ENCODER_ONLY, MAX_TOKENS, ttft_s
from bench_input_scale import machine, scrape
from bench_throughput import REPO, SAMPLING, git, run_load, start_serve
from charts import Panel, draw
from clips import moving_clip

from app.inputs.preprocess.video_item import VideoRules
from app.media.video import VideoLimits, decode_frames, probe_video
from workers.families import load_processing
from workers.families.processing import VideoMetadata
from workers.families.tiny import build_tiny_model

FAMILY = "qwen2_5_vl"
SAMPLED = {"fps": 2}
ENCODER_CACHE_TOKENS = 32768
ON = ["--encoder-cache-tokens", str(ENCODER_CACHE_TOKENS)]
OTHER_SAMPLING = {"num_frames": 16}


def data_url(clip: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(clip).decode()


def video_body(model: str, text: str, clip: bytes, kwargs: dict) -> dict[str, object]:
    content = [{"type": "video_url", "video_url": {"url": data_url(clip)}}, {"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    return {
        "model": model,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "mm_processor_kwargs": kwargs,
        **SAMPLING,
    }


def stage_times(model_dir: Path, clip: bytes, repeats: int) -> dict[str, float]:
    """Median seconds of the header check, the decode of the sampled frames and the processing."""
    family = load_processing(model_dir)
    options = family.hash_video_options(SAMPLED)
    limits = VideoRules(VideoLimits(), 64).limits
    times: dict[str, list[float]] = {"header check": [], "decode (20 frames)": [], "processing": []}
    for _ in range(repeats):
        start = time.perf_counter()
        info = probe_video(clip, limits=limits, param="video")
        probed = time.perf_counter()
        metadata = VideoMetadata(fps=info.fps, num_frames=info.num_frames)
        indices = family.sample_video(metadata, options)
        frames = decode_frames(clip, info, indices, limits=limits, param="video")
        decoded = time.perf_counter()
        family.process_video(frames, metadata, indices, options)
        done = time.perf_counter()
        times["header check"].append(probed - start)
        times["decode (20 frames)"].append(decoded - probed)
        times["processing"].append(done - decoded)
    return {stage: statistics.median(values) for stage, values in times.items()}


def ttft_table(model: str, model_dir: Path, folder: Path, repeats: int) -> tuple[dict[str, float], float]:
    """TTFT medians, and the encoder's seconds per cold clip."""
    flags = ["--model", str(model_dir), "--max-model-len", "8192"]
    with ExitStack() as stack:
        all_on = start_serve("all caches on", REPO, [*flags, *ON], folder, stack)
        encoder_only = start_serve("encoder cache only", REPO, [*flags, *ENCODER_ONLY], folder, stack)
        same = video_body(model, "What happens in the clip?", moving_clip(seed=1), SAMPLED)
        ttft_s(all_on, video_body(model, "Warm up.", moving_clip(seed=2), SAMPLED))
        before = scrape(all_on)
        cold = [
            ttft_s(all_on, video_body(model, "What happens?", moving_clip(seed=100 + i), SAMPLED))
            for i in range(repeats)
        ]
        after = scrape(all_on)
        encoder_s = (after["mmserve_encoder_seconds_sum"] - before["mmserve_encoder_seconds_sum"]) / repeats
        ttft_s(encoder_only, same)
        encoder_warm = [ttft_s(encoder_only, same) for _ in range(repeats)]
        ttft_s(all_on, same)
        all_warm = [ttft_s(all_on, same) for _ in range(repeats)]
        resampled = [
            ttft_s(all_on, video_body(model, "What happens?", moving_clip(seed=100 + i), OTHER_SAMPLING))
            for i in range(repeats)
        ]
    ttft = {
        "cold": statistics.median(cold),
        "encoder cache warm": statistics.median(encoder_warm),
        "all caches warm": statistics.median(all_warm),
        "seen clip, other sampling": statistics.median(resampled),
    }
    return ttft, encoder_s


POPULAR = [1000 + i for i in range(5)]  # the seeds of the five clips most requests ask about


def reuse_bodies(model: str, num_requests: int) -> list[dict]:
    """Every fifth request brings a clip never seen; the others ask about one of the five popular clips,
    which the warm-up has asked about once (a server in its steady state: 80 % of requests repeat)."""
    rng = random.Random(0)
    popular = [moving_clip(seed=seed) for seed in POPULAR]
    bodies = []
    for i in range(num_requests):
        clip = moving_clip(seed=5000 + i) if i % 5 == 4 else popular[rng.randrange(len(popular))]
        bodies.append(video_body(model, f"Question {i}: what moves?", clip, SAMPLED))
    return bodies


def throughput_table(model: str, model_dir: Path, folder: Path, num_requests: int) -> dict[str, float]:
    bodies = reuse_bodies(model, num_requests)
    warm_up = [video_body(model, "Warm up.", moving_clip(seed=seed), SAMPLED) for seed in POPULAR]
    rates = {}
    for label, flags in (("all caches on", ON), ("all caches off", ALL_OFF)):
        with ExitStack() as stack:
            flags = ["--model", str(model_dir), "--max-model-len", "8192", *flags]
            url = start_serve(label, REPO, flags, folder, stack)
            asyncio.run(run_load(url, warm_up, 2))
            wall_s, _ = asyncio.run(run_load(url, bodies, 8))
            rates[label] = len(bodies) / wall_s
    return rates


def revision() -> str:
    return git("rev-parse", "--short", "HEAD").strip()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--chart", type=Path, default=REPO / "docs/img/video.png")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="mmserve-bench-video-"))
    model_dir = build_tiny_model(FAMILY, folder / f"tiny-{FAMILY}")
    clip = moving_clip(seed=1)
    stages = stage_times(model_dir, clip, args.repeats)
    ttft, encoder_s = ttft_table(model_dir.name, model_dir, folder, args.repeats)
    rates = throughput_table(model_dir.name, model_dir, folder, args.requests)

    print(f"\n{machine()}, revision {revision()}, {date.today()}")
    print(f"\nPer clip (10 s 640x360 H.264, {len(clip) / 1e6:.2f} MB, sampled at 2 fps), ms:")
    print("| header check | decode (20 frames) | processing | encoder |")
    print("|---|---|---|---|")
    print(" | ".join(f"{s * 1e3:.0f}" for s in [*stages.values(), encoder_s]).join(["| ", " |"]))
    print(f"\nTTFT, {MAX_TOKENS} tokens, median of {args.repeats} (ms):")
    print("| cold | encoder cache warm | all caches warm | seen clip, other sampling | cold / all warm |")
    print("|---|---|---|---|---|")
    cold, warm = ttft["cold"], ttft["all caches warm"]
    cells = [f"{v * 1e3:.0f}" for v in ttft.values()]
    print(f"| {' | '.join(cells)} | {cold / warm:.1f}x |")
    on, off = rates["all caches on"], rates["all caches off"]
    print(f"\nreq/s, concurrency 8, {args.requests} requests, 80 % about one of 5 clips:")
    print("| all caches on | all caches off | on / off |")
    print("|---|---|---|")
    print(f"| {on:.2f} | {off:.2f} | {on / off:.2f}x |")
    draw(
        args.chart,
        "Video: tiny Qwen2.5-VL, 10 s 640x360 H.264 clips sampled at 2 fps",
        [
            Panel("Time to first token (ms, median)", "ms", {k: {"TTFT": v * 1e3} for k, v in ttft.items()}),
            Panel("Requests/s, concurrency 8, 80 % reuse of 5 clips", "req/s", {"": rates}, fmt="{:.2f}"),
        ],
        f"bench/bench_video.py · {date.today()} · revision {revision()} · {machine()}",
    )
    print(f"\nlogs: {folder}")


if __name__ == "__main__":
    main()
