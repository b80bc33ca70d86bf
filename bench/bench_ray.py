"""Request routers on ``mmserve ray serve`` (tiny LLaVA, real processes, two replicas each): the
media-affinity router vs Ray Serve's default (power of two choices) vs Ray Serve LLM's
PrefixCacheAffinityRouter, under the same loads. One deployment per router (each its own Ray cluster),
all started first and running side by side; the loads then go to one deployment at a time.

    python bench/bench_ray.py [--model models/tiny-llava] [--users 32] [--turns 6]
        [--think-s 0 0.25 1] [--rounds 3] [--routers media default prefix]
        [--chart docs/img/ray_routers.png]

Each round runs one load per ``--think-s`` value, each load on every deployment in turn (the order
reversed from one load to the next, so a drift in the machine's speed reaches every router alike), each
with images and text of its own: users pause between turns for a uniform random time in
[0, 2 x think-s] (seeded per user), as people reading an answer or agents running a tool do; 0, no
pause, is a closed loop in which a user sends its next turn the moment the last one ends. Figures are
medians over the rounds, each round's shown beside them.

A load (bench/ray_conversations.py): ``--users`` conversations at once (user i starts ``i * STAGGER_S``
after the first), each ``--turns`` streamed chat completions of ``MAX_TOKENS`` tokens at temperature 0
(``ignore_eos``: every answer the same length). Every turn resends the whole conversation (its earlier
user messages with their images and the answers), and some turns add a new 1024x1024 JPEG of the user's
own: which ones is chosen (``new_image_turns``) so that, of all image parts sent over the run, the share
naming an image sent before is as near ``REPEAT_SHARE`` (80 %) as the turn count allows. With 6 turns:
new images at turns 1 and 3, so the turns send 1, 1, 2, 2, 2, 2 images: 10 references to 2 images,
exactly 80 % repeats. Each user's text starts with a tag of its own, so conversations share no text
prefix. The same images serve every router; each deployment first answers ``WARMUP_REQUESTS`` requests on
other images, not counted. The deployments waiting their turn are idle but for Ray's own periodic work,
alike for each.

Per router: requests/s (requests / wall time of the load), TTFT p50 (to the first content delta), and from
each replica's own instance (its URL in the ingress's ``GET /replicas``) the deltas over the load of
``mmserve_encoder_runs_total`` and ``mmserve_mm_processor_seconds_count`` (processor runs: processor-cache
misses), summed over the replicas, beside the number of distinct images; the media router's placements
(``mmserve_ray_placements_total`` on the ingress's ``/metrics``); requests per replica (the
``x-mmserve-replica`` header) and how many follow-up turns went to the replica of the previous turn; the
start time (launch to the ``mmserve: serving model`` line) and each replica's RSS after the load (its
instance's process and all its descendants, from /proc). Replicas run ``--mm-preprocess-processes 0``
and reserve ``REPLICA_CPUS`` CPUs each. Draws ``--chart``.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import httpx
from bench_input_scale import machine
from bench_throughput import REPO, Proc, free_port, git
from charts import Panel, draw
from images import jpeg_data_url
from ray_conversations import MAX_TOKENS, new_image_turns, run_load

ROUTERS = ("media", "default", "prefix")
NUM_REPLICAS = 2
REPLICA_CPUS = 0.5
WARMUP_REQUESTS = 4  # per deployment, each with a new image of its own, not counted
READY_LINE = "mmserve: serving model"
START_TIMEOUT_S = 600.0
PLACEMENTS = ("affinity", "fallback", "new")
PLACEMENTS_TOTAL = "mmserve_ray_placements_total{"  # not its _created series (the ingress has them)
PLACEMENT_LABEL = re.compile(r'placement="(\w+)"')
WORK = {  # where the replicas' time went: a counter's delta over the load, summed over the replicas
    "prompt tokens": "mmserve_prefix_cache_queries_total",
    "of them cached": "mmserve_prefix_cache_hits_total",
    "preemptions": "mmserve_num_preemptions_total",
    "engine steps": "mmserve_engine_steps_total",
    "worker busy s": "mmserve_worker_busy_seconds_total",
}


@dataclass
class Result:
    """One load on one deployment."""

    think_s: float  # mean pause between a user's turns
    wall_s: float = 0.0
    requests: int = 0
    ttft_s: list[float] = field(default_factory=list)
    encoder_runs: float = 0.0
    processor_misses: float = 0.0
    work: dict[str, float] = field(default_factory=dict)  # WORK counters' deltas, summed over replicas
    placements: dict[str, float] = field(default_factory=dict)
    by_replica: Counter[str] = field(default_factory=Counter)
    same_replica: int = 0  # follow-up turns answered by the replica of the user's previous turn
    follow_ups: int = 0

    @property
    def rps(self) -> float:
        return self.requests / self.wall_s

    @property
    def ttft_p50_ms(self) -> float:
        return 1e3 * statistics.median(self.ttft_s)

    @property
    def stickiness(self) -> float:
        return self.same_replica / max(self.follow_ups, 1)


@dataclass
class Deployment:
    """One running ``mmserve ray serve`` with one router, and its loads' results by pause length."""

    router: str
    base_url: str = ""
    start_s: float = 0.0
    listed: list[dict[str, Any]] = field(default_factory=list)  # its replicas, as /replicas lists them
    rss_mib: dict[str, float] = field(default_factory=dict)  # after its last load
    results: dict[float, list[Result]] = field(default_factory=dict)  # think_s -> one per round

    def median(self, think_s: float, figure: Callable[[Result], float]) -> float:
        return statistics.median(figure(r) for r in self.results[think_s])


def pauses(think_s: float) -> str:
    return f"0-{2 * think_s:g} s" if think_s else "none"


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as {name: value summed over label sets} (histogram buckets skipped), and
    ``placement:<label>`` for the media router's placements by label."""
    totals: dict[str, float] = defaultdict(float)
    for line in httpx.get(f"{url}/metrics", timeout=30.0).text.splitlines():
        if not line.startswith("mmserve_") or "_bucket{" in line:
            continue
        sample, _, value = line.rpartition(" ")
        totals[sample.partition("{")[0]] += float(value)
        if sample.startswith(PLACEMENTS_TOTAL) and (placement := PLACEMENT_LABEL.search(sample)):
            totals[f"placement:{placement[1]}"] += float(value)
    return dict(totals)


def listed_replicas(base_url: str, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """The ingress's ``/replicas`` once every replica has reported its instance (every few seconds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            listed = httpx.get(f"{base_url}/replicas", timeout=10.0).json()["replicas"]
        except (httpx.HTTPError, ValueError, KeyError):
            listed = []
        if len(listed) == NUM_REPLICAS and all(entry.get("url") and entry.get("pid") for entry in listed):
            return listed
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url}/replicas lists {listed} after {timeout_s} s")
        time.sleep(0.5)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def tree_rss_mib(root: int) -> float:
    """VmRSS of ``root`` and all its descendants (summed: pages they share count in each)."""
    parents = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            parents[int(entry.name)] = _parent(int(entry.name))
        except (OSError, ValueError):
            continue
    tree, grown = {root}, True
    while grown:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grown = bool(more)
    total_kib = 0
    for pid in tree:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total_kib += next(
            (int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0
        )
    return total_kib / 1024


def start(args: argparse.Namespace, router: str, port: int, log_path: Path) -> tuple[Proc, float]:
    """``mmserve ray serve`` with ``router``; (its process, seconds from launch to the ready line)."""
    flags = [
        "ray", "serve", "--model", str(args.model), "--host", "127.0.0.1", "--port", str(port),
        "--replicas", str(NUM_REPLICAS), "--replica-cpus", str(REPLICA_CPUS), "--router", router,
        "--mm-preprocess-processes", "0",
    ]  # fmt: skip
    launched = time.perf_counter()
    proc = Proc(flags, REPO, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while READY_LINE not in log_path.read_text(errors="replace"):
            if proc.popen.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"mmserve ray serve --router {router} did not start:\n{tail}")
            time.sleep(0.2)
    except BaseException:
        proc.stop()
        raise
    return proc, time.perf_counter() - launched


def stop(proc: Proc, instance_pids: list[int]) -> None:
    """Stops the deployment (SIGINT to its group), then waits for the replicas' instances (in sessions of
    their own) to go; one still there after 30 s is killed with its group."""
    proc.stop()
    deadline = time.monotonic() + 30.0
    for pid in instance_pids:
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        try:
            if b"mmserve" in Path(f"/proc/{pid}/cmdline").read_bytes():  # not a new process on its pid
                print(f"    replica instance {pid} outlived its deployment: killed", flush=True)
                os.killpg(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def measure(
    base_url: str,
    model: str,
    listed: list[dict[str, Any]],
    load: list[dict[int, str]],
    turns: int,
    think_s: float,
    first_user: int,
) -> Result:
    """One load on a running deployment: its figures, from the clients, the replicas and the ingress."""
    result = Result(think_s)
    before = {entry["url"]: scrape(entry["url"]) for entry in listed}
    ingress_before = scrape(base_url)
    result.wall_s, runs = run_load(base_url, model, load, turns, think_s, first_user)
    after = {url: scrape(url) for url in before}
    ingress_after = scrape(base_url)

    def delta(name: str) -> float:
        return sum(after[url].get(name, 0.0) - before[url].get(name, 0.0) for url in before)

    result.encoder_runs = delta("mmserve_encoder_runs_total")
    result.processor_misses = delta("mmserve_mm_processor_seconds_count")
    result.work = {label: delta(name) for label, name in WORK.items()}
    result.placements = {
        p: ingress_after.get(f"placement:{p}", 0.0) - ingress_before.get(f"placement:{p}", 0.0)
        for p in PLACEMENTS
    }
    for user_turns in runs:
        result.ttft_s += [ttft for ttft, _ in user_turns]
        result.by_replica.update(replica for _, replica in user_turns)
        result.follow_ups += len(user_turns) - 1
        result.same_replica += sum(a[1] == b[1] for a, b in zip(user_turns, user_turns[1:], strict=False))
    result.requests = sum(len(user_turns) for user_turns in runs)
    print(
        f"    {base_url}: {result.rps:.2f} req/s, TTFT p50 {result.ttft_p50_ms:.0f} ms, "
        f"encoder runs {result.encoder_runs:.0f}, processor misses {result.processor_misses:.0f}, "
        f"follow-ups on the same replica {result.stickiness:.0%}",
        flush=True,
    )
    return result


def deploy(args: argparse.Namespace, router: str, folder: Path, stack: ExitStack) -> Deployment:
    """``mmserve ray serve --router router``, started, warmed up and stopped when ``stack`` closes."""
    port = free_port()
    deployment = Deployment(router, base_url=f"http://127.0.0.1:{port}")
    print(f"[{router}] mmserve ray serve --router {router} --port {port}", flush=True)
    instance_pids: list[int] = []
    proc, deployment.start_s = start(args, router, port, folder / f"{router}.log")
    stack.callback(lambda: stop(proc, instance_pids))
    print(f"    ready in {deployment.start_s:.1f} s", flush=True)
    seeds = iter(range(90_000, 10**6))
    warmup = [{0: jpeg_data_url(1024, next(seeds))} for _ in range(WARMUP_REQUESTS)]
    run_load(deployment.base_url, args.model.name, warmup, 1, first_user=10**6)  # text of its own too
    deployment.listed = listed_replicas(deployment.base_url)
    instance_pids[:] = [int(entry["pid"]) for entry in deployment.listed]
    return deployment


def run_rounds(
    args: argparse.Namespace, deployments: dict[str, Deployment], loads: list[list[list[dict[int, str]]]]
) -> None:
    """Round r, pause length k: ``loads[r][k]`` on every deployment, one after another, the order
    reversed from one load to the next, so that a drift of the machine's speed reaches every router
    alike."""
    order = list(deployments)
    for r, round_loads in enumerate(loads):
        for k, (think_s, load) in enumerate(zip(args.think_s, round_loads, strict=True)):
            first_user = (r * len(args.think_s) + k) * args.users  # text of the load's own
            print(f"round {r + 1}, pauses {pauses(think_s)}:", flush=True)
            for router in order:
                d = deployments[router]
                result = measure(d.base_url, args.model.name, d.listed, load, args.turns, think_s, first_user)
                d.results.setdefault(think_s, []).append(result)
            order.reverse()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=REPO / "models/tiny-llava")
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--think-s", type=float, nargs="+", default=[0.0, 0.25, 1.0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    parser.add_argument("--chart", type=Path, default=REPO / "docs/img/ray_routers.png")
    args = parser.parse_args()
    args.model = args.model.resolve()
    folder = args.folder = Path(tempfile.mkdtemp(prefix="mmserve-bench-ray-"))
    starts = new_image_turns(args.turns)
    seeds = iter(range(10**6))
    loads = [
        [
            [{turn: jpeg_data_url(1024, next(seeds)) for turn in starts} for _ in range(args.users)]
            for _ in args.think_s
        ]
        for _ in range(args.rounds)
    ]
    refs = args.users * sum(args.turns - t for t in starts)
    distinct = args.users * len(starts)
    print(
        f"{args.users} users x {args.turns} turns; new images at turns {[t + 1 for t in starts]}: "
        f"{refs} image references to {distinct} images, {100 * (1 - distinct / refs):.0f} % repeats; "
        f"pauses between turns {', '.join(pauses(t) for t in args.think_s)}; {args.rounds} rounds",
        flush=True,
    )
    with ExitStack() as stack:
        deployments = {router: deploy(args, router, folder, stack) for router in args.routers}
        run_rounds(args, deployments, loads)
        for d in deployments.values():
            d.rss_mib = {str(entry["replica"]): tree_rss_mib(int(entry["pid"])) for entry in d.listed}
    report(args, deployments, distinct, refs)


def split(results: list[Result]) -> str:
    """Each round's requests per replica, the busier replica first."""
    return ", ".join("/".join(str(n) for n in sorted(r.by_replica.values(), reverse=True)) for r in results)


def report(args: argparse.Namespace, deployments: dict[str, Deployment], distinct: int, refs: int) -> None:
    revision = git("rev-parse", "--short", "HEAD").strip()
    print(f"\n{machine()}, revision {revision}, {date.today()}")
    print(f"\n{args.users} users at once, {args.turns} turns each (history resent), {MAX_TOKENS} tokens a "
          f"turn, {NUM_REPLICAS} replicas of {REPLICA_CPUS} CPU; each load {distinct} new distinct images, "
          f"{100 * (1 - distinct / refs):.0f} % of {refs} image references repeats; medians of "
          f"{args.rounds} rounds (each round's figures after the slash):")  # fmt: skip
    columns = [
        "pauses", "router", "req/s", "TTFT p50", "encoder runs", "processor misses",
        "placements (affinity/fallback/new)", "requests per replica", "follow-ups on the same replica",
        "worker busy s",
    ]  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for think_s in args.think_s:
        for router, d in deployments.items():
            results = d.results[think_s]

            def each(figure: Callable[[Result], float], fmt: str, results: list[Result] = results) -> str:
                values = [figure(r) for r in results]
                return f"{fmt.format(statistics.median(values))} / " + ", ".join(
                    fmt.format(v) for v in values
                )

            placed = "-"
            if router == "media":
                placed = "/".join(
                    f"{statistics.median(r.placements[p] for r in results):.0f}" for p in PLACEMENTS
                )
            print(
                f"| {pauses(think_s)} | {router} | {each(lambda r: r.rps, '{:.2f}')} | "
                f"{each(lambda r: r.ttft_p50_ms, '{:.0f}')} ms | "
                f"{each(lambda r: r.encoder_runs, '{:.0f}')} | "
                f"{each(lambda r: r.processor_misses, '{:.0f}')} | {placed} | {split(results)} | "
                f"{each(lambda r: 100 * r.stickiness, '{:.0f}')} % | "
                f"{each(lambda r: r.work['worker busy s'], '{:.1f}')} |"
            )
    print("\n| pauses | router | " + " | ".join(WORK) + " (medians) |")
    print("|---|---|" + "---|" * len(WORK))
    for think_s in args.think_s:
        for router, d in deployments.items():
            medians = {label: statistics.median(r.work[label] for r in d.results[think_s]) for label in WORK}
            figures = (f"{value:,.{1 if label.endswith(' s') else 0}f}" for label, value in medians.items())
            print(f"| {pauses(think_s)} | {router} | " + " | ".join(figures) + " |")
    print("\n| router | start (launch to ready) | RSS per replica after the loads (instance process tree) |")
    print("|---|---|---|")
    for router, d in deployments.items():
        rss = ", ".join(f"{mib:.0f} MiB" for _, mib in sorted(d.rss_mib.items()))
        print(f"| {router} | {d.start_s:.1f} s | {rss} |")
    print()
    if "media" in deployments:
        media = deployments["media"]
        for think_s in args.think_s:
            for peer in ("default", "prefix"):
                if peer not in deployments:
                    continue
                other = deployments[peer]
                ratios = [
                    m.rps / o.rps for m, o in zip(media.results[think_s], other.results[think_s], strict=True)
                ]
                target = " (target >= 1.5x)" if peer == "default" else ""
                ttft = other.median(think_s, lambda r: r.ttft_p50_ms) / media.median(
                    think_s, lambda r: r.ttft_p50_ms
                )
                print(
                    f"pauses {pauses(think_s)}, media / {peer}: "
                    f"req/s {statistics.median(ratios):.2f}x{target} "
                    f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)}), TTFT p50 {ttft:.2f}x lower"
                )
            runs = media.median(think_s, lambda r: r.encoder_runs)
            print(f"pauses {pauses(think_s)}, encoder runs / distinct images, media: {runs / distinct:.2f} "
                  "(target <= 1.1)")  # fmt: skip

    def by_load(figure: Callable[[Result], float]) -> dict[str, dict[str, float]]:
        return {
            f"pauses {pauses(t)}": {router: d.median(t, figure) for router, d in deployments.items()}
            for t in args.think_s
        }

    draw(
        args.chart,
        f"Ray Serve routers, {NUM_REPLICAS} replicas: {args.users} users x {args.turns} turns, "
        f"{100 * (1 - distinct / refs):.0f} % repeated 1024x1024 images, {args.model.name}; "
        f"medians of {args.rounds} rounds",
        [
            Panel("Requests per second", "req/s", by_load(lambda r: r.rps), "{:.1f}"),
            Panel("TTFT p50", "ms", by_load(lambda r: r.ttft_p50_ms)),
            Panel(f"Encoder runs ({distinct} distinct images)", "runs", by_load(lambda r: r.encoder_runs)),
        ],
        f"bench/bench_ray.py · {date.today()} · revision {revision} · {machine()}",
    )
    print(f"\nlogs: {args.folder}")


if __name__ == "__main__":
    main()
