"""The encoder-cache connector on real ``mmserve serve`` processes: a tiny Qwen2.5-VL, 1024x768 JPEGs.

    python bench/bench_ec.py [--num-images 8] [--items 30] [--requests 160] [--concurrency 16]
        [--max-tokens 16] [--skip-mooncake]

1. TTFT (streamed, to the first content chunk; median and p90 over ``--num-images`` new images), every
   instance with ``--no-enable-prefix-caching`` (image tokens are prefilled every time) and its processor
   and IPC caches off (the HF processor runs on every request): cold on an instance without a connector;
   on a producer (``--ec-role producer``) seeing the image first; on a consumer (``--ec-role consumer``)
   getting it next, which loads instead of encoding (checked on its ``/metrics``), for shared-storage and
   Mooncake; warm on the cold instance (the output in its own encoder cache). Two warm-up rounds first;
   the three pairs (cold + warm, each producer + its consumer) take turns going first in each round.
2. Save (``encode_output`` + ``put``) and load (``get`` + ``decode_output``) per item, in this process, on
   the real stores (part 1's folder and Mooncake store): the tiny model's output for one such image and
   a 7B Qwen2.5-VL's ([tokens, 3584] bf16); ``--items`` items each, all puts then all gets.
3. req/s at ``--concurrency`` over two replicas (round-robin), 20 % new images and 80 % drawn from those
   already sent, ``--max-tokens`` tokens, default caches: ``--ec-connector shared-storage --ec-role both``
   on one folder vs no connector.
Every instance runs ``--mm-preprocess-processes 0`` (processing in the API process: fewer processes to
start on a small machine); parts 1 and 3 start their instances together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
from bench_input_scale import Answer, Run, encoded, machine, one_request, scrape
from bench_throughput import COMMON_FLAGS, REPO, Proc, free_port, wait_healthy
from ec_store_latency import print_store_table, store_latencies
from images import jpeg_data_url  # bench/ is on sys.path: scripts run as bench/<name>.py

from workers.families.tiny import build_tiny_model

FAMILY, SIZE = "qwen2_5_vl", (1024, 768)
SEEDS = {"warmup": 10_000, "ttft": 20_000, "reuse-warmup": 30_000, "reuse": 40_000}
NEW_SHARE = 0.2
WARMUP_ROUNDS = 2
PART1 = [
    "--no-enable-prefix-caching", "--mm-processor-cache-gb", "0", "--mm-ipc-cache-gb", "0",
]  # fmt: skip
# part 1's rows, in the order each image is sent: (server, what runs before the first token)
ROWS = {
    "cold, no connector": ("plain", "processor + encoder + prefill"),
    "warm, same instance": ("plain", "processor + own encoder-cache hit + prefill"),
    "shared-storage producer, first": ("ss-producer", "processor + encoder + save + prefill"),
    "shared-storage consumer": ("ss-consumer", "processor + load + prefill"),
    "mooncake producer, first": ("mc-producer", "processor + encoder + save + prefill"),
    "mooncake consumer": ("mc-consumer", "processor + load + prefill"),
}


def start_many(flag_sets: dict[str, list[str]], folder: Path, stack: ExitStack) -> dict[str, str | None]:
    """Starts one ``mmserve serve`` per entry at once (each stopped when ``stack`` closes); returns each
    one's base URL, or None (reported) where it did not become healthy."""
    procs = {}
    for name, flags in flag_sets.items():
        port = free_port()
        print(f"[{name}] mmserve serve {shlex.join(flags)} --port {port}", flush=True)
        procs[name] = (port, Proc(["serve", *flags, "--port", str(port)], REPO, folder / f"{name}.log"))
        stack.callback(procs[name][1].stop)
    urls: dict[str, str | None] = {}
    for name, (port, proc) in procs.items():
        urls[name] = url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, [proc], timeout_s=600.0)
        except (RuntimeError, TimeoutError) as exc:
            print(f"    [{name}] did not start: {str(exc)[-1500:]}", flush=True)
            urls[name] = None
    return urls


Metrics = dict[str, float]


def delta(before: Metrics, after: Metrics, name: str) -> float:
    return after.get(f"mmserve_{name}", 0.0) - before.get(f"mmserve_{name}", 0.0)


def mean_of(before: Metrics, after: Metrics, histogram: str) -> float:
    count = delta(before, after, f"{histogram}_count")
    return delta(before, after, f"{histogram}_sum") / count if count else float("nan")


def start_mooncake(items: int, folder: Path, stack: ExitStack) -> str | None:
    """A master and a holder on 127.0.0.1 (stopped when ``stack`` closes); the master's address, or None
    (said why) when Mooncake cannot run here."""
    try:
        import mooncake.store  # noqa: F401

        from wire.ec_store.mooncake_processes import start_holder, start_master

        master = start_master(log_path=folder / "mooncake-master.log")
        stack.callback(master.stop)
        segment = (128 << 20) + items * (16 << 20)  # part 2's 7B-sized values, twice over, and some
        holder = start_holder(master.address, segment, log_path=folder / "mooncake-holder.log")
        stack.callback(holder.stop)
    except (ImportError, OSError, RuntimeError, ValueError) as exc:
        print(f"mooncake cannot start here, its rows are skipped: {exc!r}", flush=True)
        return None
    print(f"mooncake: master {master.address}, holder mounting {segment >> 20} MiB", flush=True)
    return master.address


# -- part 1: TTFT -----------------------------------------------------------------------------------


def ttft_once(base_url: str, body: bytes) -> Answer:
    async def one() -> Answer:
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
            return await one_request(client, f"{base_url}/v1/chat/completions", body)

    try:
        return asyncio.run(one())
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return Answer(None, error=type(exc).__name__)


def ttft_part(
    args: argparse.Namespace, model_dir: Path, store: Path, mc: str | None, folder: Path, stack: ExitStack
) -> tuple[dict[str, Run | None], dict[str, tuple[Metrics, Metrics]]]:
    """Part 1's rows (None: its server did not run) and each server's metrics before/after the timed
    rounds."""
    common = ["--model", str(model_dir), *COMMON_FLAGS, "--mm-preprocess-processes", "0", *PART1]
    ss = ["--ec-connector", "shared-storage", "--ec-storage-path", str(store)]
    servers = {"plain": common}
    servers |= {f"ss-{role}": [*common, *ss, "--ec-role", role] for role in ("producer", "consumer")}
    if mc is not None:
        flags = ["--ec-connector", "mooncake", "--ec-mooncake-master", mc]
        servers |= {f"mc-{role}": [*common, *flags, "--ec-role", role] for role in ("producer", "consumer")}
    urls = start_many(servers, folder, stack)
    rows = {row: server for row, (server, _) in ROWS.items() if urls.get(server)}

    groups = list(dict.fromkeys(server.partition("-")[0] for server in rows.values()))  # plain, ss, mc

    def one_round(seed: int, shift: int) -> dict[str, Answer]:
        """The image to every row; the groups (cold + warm, each producer + its consumer) take turns
        going first, so that no row always follows the same one."""
        url = jpeg_data_url(SIZE, seed)
        [body] = encoded(model_dir.name, [("Describe the picture.", url)], args.max_tokens)
        order = groups[shift % len(groups) :] + groups[: shift % len(groups)]
        todo = [row for group in order for row, server in rows.items() if server.startswith(group)]
        return {row: ttft_once(str(urls[rows[row]]), body) for row in todo}

    print(
        f"part 1: {WARMUP_ROUNDS} warm-up rounds, then {args.num_images} images; TTFT s of " + ", ".join(rows)
    )
    for i in range(WARMUP_ROUNDS):
        one_round(SEEDS["warmup"] + i, i)
    before = {name: scrape(url) for name, url in urls.items() if url}
    answers: dict[str, list[Answer]] = {row: [] for row in rows}
    for i in range(args.num_images):
        for row, answer in one_round(SEEDS["ttft"] + i, i).items():
            answers[row].append(answer)
        print(f"  image {i}: " + ", ".join(f"{a[-1].ttft_s or 0:.2f}" for a in answers.values()), flush=True)
    after = {name: scrape(url) for name, url in urls.items() if url}
    runs = {row: Run(0.0, answers[row]) if row in answers else None for row in ROWS}
    return runs, {name: (before[name], after[name]) for name in before}


def print_ttft(
    runs: dict[str, Run | None], metrics: dict[str, tuple[Metrics, Metrics]], args: argparse.Namespace
) -> None:
    print(
        f"\n### 1. Time to first token: one new {SIZE[0]}x{SIZE[1]} JPEG per request, {args.num_images} "
        f"images, streamed, max_tokens {args.max_tokens}; --no-enable-prefix-caching, processor and IPC "
        "caches off on every instance; one request at a time, the three pairs taking turns going first\n"
    )
    print(
        "| path | what runs before the first token | TTFT p50 ms | TTFT p90 ms | TTFT min ms | p50 vs cold | "
        "min vs cold | failed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    cold = runs["cold, no connector"]

    def fastest(run: Run) -> float:
        return min((1e3 * a.ttft_s for a in run.ok if a.ttft_s is not None), default=float("nan"))

    for row, run in runs.items():
        if run is None:
            print(f"| {row} | {ROWS[row][1]} | did not run |" + " |" * 5)
            continue
        p50, low = run.ttft_ms(50), fastest(run)
        vs = f"{p50 / cold.ttft_ms(50):.2f}x | {low / fastest(cold):.2f}x" if cold else "- | -"
        print(
            f"| {row} | {ROWS[row][1]} | {p50:.0f} | {run.ttft_ms(90):.0f} | {low:.0f} | {vs} | "
            f"{run.failures()} |"
        )
    print(
        "\nmin: the least-disturbed sample (other work on these cores comes in bursts: single TTFTs vary "
        "several-fold)."
    )
    if "plain" in metrics:
        plain = metrics["plain"]
        encoder_ms = 1e3 * mean_of(*plain, "encoder_seconds")
        print(f"cold instance: encoder mean {encoder_ms:.0f} ms per image (`mmserve_encoder_seconds`).")
    for store in ("ss", "mc"):
        if f"{store}-consumer" not in metrics or f"{store}-producer" not in metrics:
            continue
        c, p = metrics[f"{store}-consumer"], metrics[f"{store}-producer"]
        loads, runs_c = delta(*c, "ec_loads_total"), delta(*c, "encoder_runs_total")
        ok = loads == args.num_images and runs_c == 0 and not delta(*c, "ec_load_failures_total")
        verdict = "OK: loaded, never encoded" if ok else "NOT AS EXPECTED"
        print(
            f"{'shared-storage' if store == 'ss' else 'mooncake'}: producer encoder runs "
            f"+{delta(*p, 'encoder_runs_total'):.0f} (mean {1e3 * mean_of(*p, 'encoder_seconds'):.0f} ms), "
            f"saves +{delta(*p, 'ec_saves_total'):.0f}; consumer "
            f"ec_loads +{loads:.0f}, encoder runs +{runs_c:.0f}, load failures "
            f"+{delta(*c, 'ec_load_failures_total'):.0f} ({verdict}); "
            f"load mean {1e3 * mean_of(*c, 'ec_load_seconds'):.2f} ms (`mmserve_ec_load_seconds`), "
            f"{delta(*c, 'ec_bytes_total') / max(loads, 1):,.0f} B per load."
        )


# -- part 3: req/s with reuse over two replicas -----------------------------------------------------


def reuse_sequence(num_requests: int) -> list[str]:
    """Exactly ``NEW_SHARE`` new images (the first request's included), the rest drawn uniformly from the
    images sent before; seed 0."""
    rng = random.Random(0)
    num_new = max(1, round(NEW_SHARE * num_requests))
    new_at = {0, *rng.sample(range(1, num_requests), num_new - 1)}
    sent: list[str] = []
    sequence = []
    for i in range(num_requests):
        if i in new_at:
            sent.append(jpeg_data_url(SIZE, SEEDS["reuse"] + len(sent)))
            sequence.append(sent[-1])
        else:
            sequence.append(rng.choice(sent))
    return sequence


async def spread(urls: list[str], bodies: list[bytes], concurrency: int) -> tuple[float, list[Answer]]:
    """Request i to ``urls[i % len(urls)]``, ``concurrency`` in flight; (wall seconds, answers)."""
    todo, answers = iter(enumerate(bodies)), []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as client:

        async def lane() -> None:
            for i, body in todo:
                url = f"{urls[i % len(urls)]}/v1/chat/completions"
                try:
                    answers.append(await one_request(client, url, body))
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    answers.append(Answer(None, error=type(exc).__name__))

        start = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        return time.perf_counter() - start, answers


def reuse_part(
    args: argparse.Namespace, model_dir: Path, folder: Path, stack: ExitStack
) -> dict[str, Run | None]:
    texts = [f"Request {i}: what do you see?" for i in range(args.requests)]
    bodies = encoded(
        model_dir.name, list(zip(texts, reuse_sequence(args.requests), strict=True)), args.max_tokens
    )
    common = ["--model", str(model_dir), *COMMON_FLAGS, "--mm-preprocess-processes", "0"]
    ss = [
        "--ec-connector",
        "shared-storage",
        "--ec-storage-path",
        str(folder / "reuse-store"),
        "--ec-role",
        "both",
    ]
    configs = {"shared-storage, both": ss, "no connector": []}
    servers = {f"{label} #{r}": [*common, *flags] for label, flags in configs.items() for r in (1, 2)}
    urls = start_many(servers, folder, stack)
    runs: dict[str, Run | None] = {}
    for n, label in enumerate(configs):
        replicas = [urls[f"{label} #{r}"] for r in (1, 2)]
        if None in replicas:
            runs[label] = None
            continue
        pair = [str(u) for u in replicas]
        warmup = [jpeg_data_url(SIZE, SEEDS["reuse-warmup"] + 10 * n + i) for i in range(4)]
        asyncio.run(spread(pair, encoded(model_dir.name, [("Warm up.", u) for u in warmup], 2), 4))
        before = [scrape(u) for u in pair]
        wall_s, answers = asyncio.run(spread(pair, bodies, args.concurrency))
        after = [scrape(u) for u in pair]
        names = ("encoder_runs_total", "ec_loads_total", "ec_saves_total", "ec_load_failures_total")
        metrics = {k: sum(delta(b, a, k) for b, a in zip(before, after, strict=True)) for k in names}
        metrics["capacity"] = after[0].get("mmserve_encoder_cache_capacity_tokens", 0.0)
        runs[label] = run = Run(wall_s, answers, metrics)
        print(
            f"  [{label}] {run.req_per_s:.2f} req/s, TTFT p50 {run.ttft_ms(50):.0f} ms, {metrics}", flush=True
        )
    return runs


def print_reuse(runs: dict[str, Run | None], args: argparse.Namespace, tokens: int) -> None:
    num_new = max(1, round(NEW_SHARE * args.requests))
    print(
        f"\n### 3. Two replicas, round-robin: {args.requests} requests, {num_new} new {SIZE[0]}x{SIZE[1]} "
        f"JPEGs and {args.requests - num_new} drawn from those already sent (seed 0, the same sequence for "
        f"both), concurrency {args.concurrency}, max_tokens {args.max_tokens}, default caches (prefix "
        "caching on)\n"
    )
    print(
        "| replicas | req/s | vs no connector | TTFT p50 ms | TTFT p90 ms | encoder runs (both) | "
        "ec loads | ec saves | load failures | failed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = runs.get("no connector")
    capacity = max((r.metrics["capacity"] for r in runs.values() if r), default=0.0)
    for label, run in runs.items():
        if run is None:
            print(f"| {label} | did not run |" + " |" * 8)
            continue
        vs = f"{run.req_per_s / base.req_per_s:.2f}x" if base else "-"
        counts = [f"{run.metrics[k]:.0f}" for k in ("encoder_runs_total", "ec_loads_total", "ec_saves_total")]
        print(
            f"| {label} | {run.req_per_s:.2f} | {vs} | {run.ttft_ms(50):.0f} | {run.ttft_ms(90):.0f} | "
            f"{' | '.join(counts)} | {run.metrics['ec_load_failures_total']:.0f} | {run.failures()} |"
        )
    print(
        f"\n{num_new} distinct images: at least {num_new} encoder runs in all. Without a connector each "
        f"replica encodes every image it lacks; each replica's encoder cache holds {capacity:,.0f} tokens, "
        f"{capacity // tokens:.0f} images of {tokens} tokens (the prefix cache also spares the encoder for "
        "an image whose blocks it still holds)."
    )


# -- main -------------------------------------------------------------------------------------------


def image_geometry(model_dir: Path) -> tuple[str, int]:
    """What the tiny model's processor makes of a ``SIZE`` image (resized? how many tokens)."""
    import PIL.Image
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir, local_files_only=True)
    _, h, w = (
        int(x)
        for x in processor(images=[PIL.Image.new("RGB", SIZE)], return_tensors="pt")["image_grid_thw"][0]
    )
    patch, merge = int(processor.patch_size), int(processor.merge_size)
    config = json.loads((model_dir / "preprocessor_config.json").read_text())
    tokens = h * w // (merge * merge)
    shrunk = "SHRUNK by max_pixels" if w * h * patch * patch < 0.9 * SIZE[0] * SIZE[1] else "not shrunk"
    return (
        f"tiny {FAMILY}: max_pixels {config['size']['longest_edge']:,}, so a {SIZE[0]}x{SIZE[1]} image "
        f"is {shrunk}: resized to {w * patch}x{h * patch} (multiples of {patch * merge}), "
        f"{tokens} image tokens"
    ), tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-images", type=int, default=8, help="part 1: images (rounds)")
    parser.add_argument("--items", type=int, default=30, help="part 2: items per store and size")
    parser.add_argument("--requests", type=int, default=160, help="part 3: requests per configuration")
    parser.add_argument("--concurrency", type=int, default=16, help="part 3")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--skip-mooncake", action="store_true")
    args = parser.parse_args()
    command = shlex.join([os.path.relpath(sys.executable), *sys.argv])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds like Ctrl-C: everything stopped
    start = time.monotonic()
    print(f"command: {command}\nmachine: {machine()}, load average {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="mmserve-bench-ec-") as tmp, ExitStack() as stack:
        folder = Path(tmp)
        model_dir = build_tiny_model(FAMILY, folder / f"tiny-{FAMILY}")
        geometry, tokens = image_geometry(model_dir)
        print(geometry, flush=True)
        mc = None if args.skip_mooncake else start_mooncake(args.items, folder, stack)
        if args.skip_mooncake:
            print("mooncake: skipped (--skip-mooncake)")
        with ExitStack() as servers:
            runs, metrics = ttft_part(args, model_dir, folder / "ttft-store", mc, folder, servers)
        print("part 2: store latencies ...", flush=True)
        latencies = store_latencies(folder / "ttft-store", folder / "latency-store", mc, tokens, args.items)
        print("part 3: two replicas ...", flush=True)
        with ExitStack() as servers:
            reuse = reuse_part(args, model_dir, folder, servers)
    print(f"\ncommand: `{command}`\n\nmachine: {machine()}\n\n{geometry}")
    print_ttft(runs, metrics, args)
    print_store_table(latencies, args.items)
    print_reuse(reuse, args, tokens)
    print(
        f"\ntotal {time.monotonic() - start:.0f} s; 1-minute load average now {os.getloadavg()[0]:.1f} (the "
        "client, every server and any other work share these cores: single TTFTs vary by hundreds of ms)"
    )


if __name__ == "__main__":
    main()
