"""The input path at scale (issue 8) on real ``mmserve serve`` processes: cold-miss throughput by API
processes x preprocessing processes, 90 % image reuse with the lru vs the shm processor cache, and the
bytes each path moves per cache miss.

    python bench/bench_input_scale.py --model models/tiny-llava [--api-counts 1,2] [--process-counts 1,2,4]
        [--concurrency 32] [--cold-requests 192] [--reuse-requests 640] [--bytes-requests 32]
        [--max-tokens 4] [--image-size 1024]

Every request is one ``--image-size`` JPEG (bench/images.py, generated before any timing) and a text of
its own, streamed with ``ignore_eos`` at temperature 0 and ``--max-tokens`` (4) tokens, so the input path
dominates; ``--concurrency`` requests stay in flight, each on a new connection (``Connection: close``), so
SO_REUSEPORT spreads them over the API processes. TTFT is the time to the first content chunk. Each
configuration is a fresh server, warmed up with images of its own (not counted); the servers run one at
a time. The figures per run come from the client (req/s, TTFT, the ``x-mmserve-api-process`` header) and
from ``/metrics`` deltas around the run (processor seconds, cache hits, bytes).

1. Cold misses (every image new): ``--api-server-count`` x ``--mm-preprocess-processes``, the lru cache.
2. 90 % reuse: a pool of 8 images for 90 % of the requests, a new image for 10 %, shuffled with a fixed
   seed; the same sequence for ``--mm-processor-cache-type lru`` and ``shm`` (1 API process, default
   preprocess processes).
3. Bytes per miss: ``--bytes-requests`` new images on each of those two servers after their reuse run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from bench_throughput import COMMON_FLAGS, REPO, Proc, chat_body, free_port, wait_healthy
from images import jpeg_data_url  # bench/ is on sys.path: scripts run as bench/<name>.py

POOL_SIZE = 8  # images the reuse run repeats
REUSE_SHARE = 0.9
NUM_WARMUP = 16
SEEDS = {"warmup": 1_000_000, "cold": 2_000_000, "pool": 3_000_000, "unique": 4_000_000}
PREFIX = "mmserve_"


@dataclass
class Answer:
    status: int | None  # None: no HTTP answer (timeout, connection error)
    ttft_s: float | None = None
    api_process: str | None = None
    error: str | None = None


@dataclass
class Run:
    """One timed batch of requests against one server, with the ``/metrics`` deltas around it."""

    wall_s: float
    answers: list[Answer]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> list[Answer]:
        return [a for a in self.answers if a.status == 200 and a.error is None]

    @property
    def req_per_s(self) -> float:
        return len(self.ok) / self.wall_s

    def ttft_ms(self, quantile: int) -> float:
        """The ``quantile``-th percentile (50, 90) of the successful requests' TTFT, in ms."""
        values = sorted(1e3 * a.ttft_s for a in self.ok if a.ttft_s is not None)
        if not values:
            return float("nan")
        if len(values) == 1:
            return values[0]
        return statistics.quantiles(values, n=100, method="inclusive")[quantile - 1]

    def metric(self, name: str) -> float:
        return self.metrics.get(PREFIX + name, 0.0)

    def mean(self, histogram: str) -> float:
        count = self.metric(f"{histogram}_count")
        return self.metric(f"{histogram}_sum") / count if count else float("nan")

    def spread(self) -> str:
        by_process = Counter(a.api_process for a in self.answers if a.api_process is not None)
        return " / ".join(f"{by_process[p]}" for p in sorted(by_process, key=int)) or "-"

    def failures(self) -> str:
        bad = Counter(a.error or str(a.status) for a in self.answers if a.status != 200 or a.error)
        return ", ".join(f"{n}x {what}" for what, n in bad.most_common()) or "0"


# -- requests ---------------------------------------------------------------------------------------


def encoded(model: str, texts_and_images: list[tuple[str, str]], max_tokens: int) -> list[bytes]:
    """Request bodies as bytes, serialised before timing (the client shares the server's cores)."""
    return [json.dumps(chat_body(model, t, i, max_tokens)).encode() for t, i in texts_and_images]


async def one_request(client: httpx.AsyncClient, url: str, body: bytes) -> Answer:
    start = time.perf_counter()
    headers = {"content-type": "application/json", "connection": "close"}
    async with client.stream("POST", url, content=body, headers=headers) as response:
        answer = Answer(response.status_code, api_process=response.headers.get("x-mmserve-api-process"))
        if response.status_code != 200:
            await response.aread()
            return answer
        async for line in response.aiter_lines():
            if answer.ttft_s is None and line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if any(choice["delta"].get("content") for choice in chunk["choices"]):
                    answer.ttft_s = time.perf_counter() - start
    if answer.ttft_s is None:
        answer.error = "200 without content"
    return answer


async def send_all(base_url: str, bodies: list[bytes], concurrency: int, timeout_s: float) -> tuple:
    """Sends ``bodies`` keeping ``concurrency`` in flight, each on a new connection, each bounded by
    ``timeout_s``; returns (wall seconds, answers). Failures are answers, never exceptions."""
    url, todo, answers = f"{base_url}/v1/chat/completions", iter(bodies), []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def lane() -> None:
            for body in todo:
                try:
                    answers.append(await asyncio.wait_for(one_request(client, url, body), timeout_s))
                except TimeoutError:
                    answers.append(Answer(None, error="timeout"))
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    answers.append(Answer(None, error=type(exc).__name__))

        start = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        return time.perf_counter() - start, answers


def scrape(base_url: str) -> dict[str, float]:
    """``/metrics`` as {sample name: value summed over its label sets} (histogram buckets skipped)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30.0, headers={"connection": "close"}).text
    totals: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if not line.startswith(PREFIX) or "_bucket{" in line:
            continue
        name, _, value = line.rpartition(" ")
        totals[name.partition("{")[0]] += float(value)
    return dict(totals)


def measure(base_url: str, bodies: list[bytes], args: argparse.Namespace) -> Run:
    before = scrape(base_url)
    wall_s, answers = asyncio.run(send_all(base_url, bodies, args.concurrency, args.request_timeout))
    after = scrape(base_url)
    run = Run(wall_s, answers, {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after})
    print(
        f"    {len(bodies)} requests in {wall_s:.1f} s: {run.req_per_s:.2f} req/s, TTFT p50 "
        f"{run.ttft_ms(50):.0f} ms, p90 {run.ttft_ms(90):.0f} ms, API processes {run.spread()}, "
        f"failed {run.failures()}",
        flush=True,
    )
    return run


# -- servers ----------------------------------------------------------------------------------------


def start_server(label: str, flags: list[str], num_apis: int, folder: Path, stack: ExitStack) -> str:
    """``mmserve serve`` with ``flags`` (stopped, with its process group, when ``stack`` closes), once
    every one of its ``num_apis`` API processes answers ``/health``; returns its base URL."""
    port = free_port()
    print(f"[{label}] mmserve serve {' '.join(flags)} --port {port}", flush=True)
    server = Proc(["serve", *flags, "--port", str(port)], REPO, folder / f"serve-{port}.log")
    stack.callback(server.stop)
    base_url = f"http://127.0.0.1:{port}"
    wait_healthy(base_url, [server])
    seen: set[str | None] = set()
    deadline = time.monotonic() + 60.0
    while len(seen) < num_apis and time.monotonic() < deadline:
        try:  # a new connection each time, so the kernel picks the process anew
            response = httpx.get(f"{base_url}/health", timeout=2.0, headers={"connection": "close"})
            seen.add(response.headers.get("x-mmserve-api-process"))
        except httpx.HTTPError:
            time.sleep(0.1)
    if len(seen) < num_apis:
        print(f"    warning: only API processes {sorted(map(str, seen))} answered /health", flush=True)
    return base_url


def run_server(
    label: str, flags: list[str], num_apis: int, phases: list[list[bytes]], warmup: list[bytes],
    args: argparse.Namespace, folder: Path,
) -> list[Run] | str:  # fmt: skip
    """Starts a server, warms it up, measures each phase in turn, stops it. A server that fails to
    start or to answer is reported (its error text), not fatal."""
    with ExitStack() as stack:
        try:
            base_url = start_server(label, flags, num_apis, folder, stack)
            asyncio.run(send_all(base_url, warmup, min(len(warmup), 8), args.request_timeout))
            return [measure(base_url, bodies, args) for bodies in phases]
        except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
            print(f"    FAILED: {exc}", flush=True)
            return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"


# -- tables -----------------------------------------------------------------------------------------


def fmt_bytes(num_bytes: float) -> str:
    if num_bytes < 1 << 16:
        return f"{num_bytes:,.0f} B"
    return f"{num_bytes:,.0f} B ({num_bytes / (1 << 20):.2f} MiB)"


def ratio(value: float, first: float) -> str:
    if not first:
        return "-"
    return f"{value / first:.2f}x" if value / first >= 0.01 or not value else f"1/{first / value:,.0f}"


def cold_table(cells: dict[tuple[int, int], list[Run] | str], args: argparse.Namespace) -> None:
    print(
        f"\n### 1. Cold misses: {args.cold_requests} requests, each a new "
        f"{args.image_size}x{args.image_size} JPEG, concurrency {args.concurrency}, max_tokens "
        f"{args.max_tokens}, --mm-processor-cache-type lru\n"
    )
    print(
        "| API processes | preprocess processes / API process | req/s | vs first row | TTFT p50 ms | "
        "TTFT p90 ms | processor s / item | requests per API process | failed |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    first = next((c[0].req_per_s for c in cells.values() if not isinstance(c, str)), 0.0)
    for (num_apis, processes), cell in cells.items():
        if isinstance(cell, str):
            print(f"| {num_apis} | {processes} | did not run: {cell} | | | | | | |")
            continue
        run = cell[0]
        print(
            f"| {num_apis} | {processes} | {run.req_per_s:.2f} | {ratio(run.req_per_s, first)} | "
            f"{run.ttft_ms(50):.0f} | {run.ttft_ms(90):.0f} | {run.mean('mm_processor_seconds'):.3f} | "
            f"{run.spread()} | {run.failures()} |"
        )
    print(
        "\nprocessor s / item: mean of `mmserve_mm_processor_seconds` (the API process's wait for decode + "
        "HF processor of one miss, queueing for a free preprocess process included)."
    )


def reuse_table(servers: dict[str, list[Run] | str], args: argparse.Namespace, processes: str) -> None:
    num_unique = round((1 - REUSE_SHARE) * args.reuse_requests)
    print(
        f"\n### 2. {REUSE_SHARE:.0%} reuse: {args.reuse_requests} requests, "
        f"{args.reuse_requests - num_unique} of a pool of {POOL_SIZE} images + {num_unique} new ones "
        f"(shuffled, seed 0, the same sequence for both), concurrency {args.concurrency}, 1 API process, "
        f"{processes} preprocess processes\n"
    )
    print(
        "| cache type | req/s | vs first row | TTFT p50 ms | TTFT p90 ms | TTFT p50 vs first row | "
        "server TTFT mean ms | items | misses processed | processor-cache hits | IPC-cache hits | "
        "shm fallbacks | failed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    runs = {k: v[0] for k, v in servers.items() if not isinstance(v, str)}
    first = next(iter(runs.values()), None)
    for cache_type, result in servers.items():
        if isinstance(result, str):
            print(f"| {cache_type} | did not run: {result} |" + " |" * 11)
            continue
        run = result[0]
        assert first is not None
        counts = ["mm_items_total", "mm_processor_seconds_count", "mm_processor_cache_hits_total"]
        counts += ["mm_ipc_cache_hits_total", "mm_shm_fallbacks_total"]
        cells = [
            f"{run.req_per_s:.2f}",
            ratio(run.req_per_s, first.req_per_s),
            f"{run.ttft_ms(50):.0f}",
            f"{run.ttft_ms(90):.0f}",
            ratio(run.ttft_ms(50), first.ttft_ms(50)),
            f"{1e3 * run.mean('time_to_first_token_seconds'):.0f}",
            *(f"{run.metric(name):.0f}" for name in counts),
            run.failures(),
        ]
        print(f"| {cache_type} | {' | '.join(cells)} |")
    print(
        f"\nAt least {POOL_SIZE + num_unique} misses (each pool image's first request and the new images), "
        f"so at most {args.reuse_requests - POOL_SIZE - num_unique} hits; misses processed: "
        "`mmserve_mm_processor_seconds` count (processor runs: requests for an image whose processing is "
        "under way wait for that run). Prefix and encoder caches are on in both."
    )


def bytes_table(servers: dict[str, list[Run] | str], args: argparse.Namespace, processes: int | None) -> None:
    print(
        f"\n### 3. Bytes per miss: {args.bytes_requests} new images on each server of table 2, after its "
        "reuse run\n"
    )
    runs = {k: v[1] for k, v in servers.items() if not isinstance(v, str) and len(v) > 1}
    per_miss: dict[str, dict[str, float]] = {}
    for cache_type, run in runs.items():
        misses = run.metric("mm_items_total") - run.metric("mm_processor_cache_hits_total")
        per_miss[cache_type] = {
            "misses": misses,
            "payload": run.metric("mm_ipc_payload_bytes_total") / misses if misses else float("nan"),
            "ring": run.metric("mm_shm_bytes_total") / misses if misses else float("nan"),
            "fallbacks": run.metric("mm_shm_fallbacks_total"),
        }
    if "lru" not in per_miss or "shm" not in per_miss:
        print(f"(not measured: a server of table 2 did not run: {sorted(per_miss)} only)")
        return
    lru, shm = per_miss["lru"], per_miss["shm"]
    item = lru["payload"] - shm["payload"]  # the processed tensors: lru sends them, shm sends the key only
    pool = processes != 0
    pool_copy = "pool process → API process (a /dev/shm file); " if pool else ""
    pool_shm = item if pool else 0.0
    print(
        "| path | copies of the pixel tensors | bytes / miss over sockets | "
        "bytes / miss through shared memory | sockets vs first row |"
    )
    print("|---|---|---|---|---|")
    lru_socket = 2 * lru["payload"]
    print(
        f"| lru | {2 + pool}: {pool_copy}API → engine (socket); engine → worker (socket, the same frames "
        f"forwarded) | {fmt_bytes(lru_socket)} = {fmt_bytes(lru['payload'])} API → engine (measured) + the "
        f"same engine → worker (derived) | {fmt_bytes(pool_shm)} (pool → API) | 1.00x |"
    )
    print(
        f"| shm | {1 + pool}: {pool_copy}API → ring (the worker reads the ring in place) | "
        f"{fmt_bytes(shm['payload'])} API → engine (keys; the reference rides in the message) | "
        f"{fmt_bytes(pool_shm + shm['ring'])} = {fmt_bytes(pool_shm)} (pool → API) + "
        f"{fmt_bytes(shm['ring'])} (ring, measured) | {ratio(shm['payload'], lru_socket)} |"
    )
    print(
        f"\nMeasured over {lru['misses']:.0f} (lru) and {shm['misses']:.0f} (shm) misses: "
        f"`mmserve_mm_ipc_payload_bytes_total` and `mmserve_mm_shm_bytes_total` per miss. The processed "
        f"item ({fmt_bytes(item)}) is the lru payload per miss less the shm one (the key); the pool → API "
        f"transfer is one copy of it through a /dev/shm file (derived, not counted by a metric). Both paths "
        f"then copy the tensors once more to the model's device and dtype (not counted). shm fallbacks: "
        f"{shm['fallbacks']:.0f}."
    )


# -- main -------------------------------------------------------------------------------------------


def machine() -> str:
    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor() or "?",
    )  # fmt: skip
    cores = len(os.sched_getaffinity(0))
    return f"{cores} cores usable ({os.cpu_count()} online), {model}, Python {platform.python_version()}"


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default="models/tiny-llava")
    parser.add_argument("--api-counts", default="1,2", help="--api-server-count values, comma-separated")
    parser.add_argument("--process-counts", default="1,2,4", help="--mm-preprocess-processes values")
    parser.add_argument("--reuse-processes", type=int, default=None, help="table 2 (default: the server's)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--cold-requests", type=int, default=192, help="per configuration of table 1")
    parser.add_argument("--reuse-requests", type=int, default=640, help="per cache type of table 2")
    parser.add_argument("--bytes-requests", type=int, default=32, help="new images per server, table 3")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=1024)
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds, per request")
    args = parser.parse_args()
    command = shlex.join([os.path.relpath(sys.executable) if sys.executable else "python", *sys.argv])
    model_dir = Path(args.model).resolve()
    if not (model_dir / "config.json").exists():
        sys.exit(f"no model at {model_dir}: `make model` builds models/tiny-llava")
    # SIGTERM unwinds like Ctrl-C, so every server started is stopped with its process group
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    api_counts = [int(n) for n in args.api_counts.split(",")]
    process_counts = [int(n) for n in args.process_counts.split(",")]
    model, start = model_dir.name, time.monotonic()

    print(f"command: {command}")
    print(f"machine: {machine()}")
    print(f"generating {args.image_size}x{args.image_size} JPEGs ...", flush=True)
    size = args.image_size

    def images(kind: str, n: int) -> list[str]:
        return [jpeg_data_url(size, SEEDS[kind] + i) for i in range(n)]

    def bodies(urls: list[str], max_tokens: int = args.max_tokens) -> list[bytes]:
        return encoded(model, [(f"Request {i}: describe it.", u) for i, u in enumerate(urls)], max_tokens)

    warmup = bodies(images("warmup", NUM_WARMUP), 2)
    cold = bodies(images("cold", max(args.cold_requests, args.bytes_requests)))
    num_unique = round((1 - REUSE_SHARE) * args.reuse_requests)
    pool = images("pool", POOL_SIZE)
    sequence = [pool[i % POOL_SIZE] for i in range(args.reuse_requests - num_unique)]
    sequence += images("unique", num_unique)
    random.Random(0).shuffle(sequence)
    reuse = bodies(sequence)
    print(f"  {len(warmup) + len(cold) + len(reuse)} bodies, {len(cold[0]) / 1024:.0f} KiB each", flush=True)

    common = ["--model", str(model_dir), *COMMON_FLAGS]
    with tempfile.TemporaryDirectory(prefix="mmserve-bench-scale-") as logs:
        folder = Path(logs)
        cells: dict[tuple[int, int], list[Run] | str] = {}
        for num_apis in api_counts:
            for processes in process_counts:
                flags = [*common, "--api-server-count", str(num_apis)]
                flags += ["--mm-preprocess-processes", str(processes)]
                label = f"cold {num_apis} API x {processes} preprocess processes"
                cells[num_apis, processes] = run_server(
                    label, flags, num_apis, [cold[: args.cold_requests]], warmup, args, folder
                )
        reuse_flags = []
        if args.reuse_processes is not None:
            reuse_flags = ["--mm-preprocess-processes", str(args.reuse_processes)]
        servers = {
            cache_type: run_server(
                f"reuse {cache_type}",
                [*common, *reuse_flags, "--mm-processor-cache-type", cache_type],
                1,
                [reuse, cold[: args.bytes_requests]],
                warmup,
                args,
                folder,
            )
            for cache_type in ("lru", "shm")
        }

    default_processes = max(1, min(4, (os.cpu_count() or 1)))  # Settings.resolved_preprocess_processes, 1 API
    processes = args.reuse_processes if args.reuse_processes is not None else default_processes
    print(f"\ncommand: `{command}`\n\nmachine: {machine()}")
    cold_table(cells, args)
    reuse_table(servers, args, f"{processes}" + (" (the default)" if args.reuse_processes is None else ""))
    bytes_table(servers, args, processes)
    print(
        "\nVariance: the client and every server process share the machine's cores, and runs of the same "
        "configuration vary by 20-30 % here; ratios within one run are firmer than absolute figures."
    )
    print(f"\ntotal {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
