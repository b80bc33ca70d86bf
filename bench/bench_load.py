"""Load without loss: a bounded locust run against a real ``mmserve serve`` on loopback, then the checks.

    python bench/bench_load.py [--users 32] [--duration 60] [--model models/tiny-llava] [--port 0]

The server starts with explicit, modest cache sizes (``SERVER_FLAGS``); after ``/health`` and a warm-up
of three requests, ``bench/locustfile_load.py`` runs headless (``--users`` users, ``--duration`` s, then
up to 60 s for the requests in flight to finish; killed outright past that) mixing text, repeated
images, unique images and hostile requests (every 20th: 5 %). Checked, each a line of the verdict:

- every normal request got exactly one complete answer, every hostile one its own 4xx and error code,
  and none was left unsettled (cut off by locust at the stop);
- the server's counters agree: finished requests and generated tokens grew by exactly what the clients
  received, no IPC-cache resend;
- afterwards ``/health`` is 200 and ``mmserve_num_requests_running`` / ``_waiting`` are 0;
- the resident memory (VmRSS, sampled every second) of each process stays within
  bound = baseline + its configured caches + its stated overhead (``STATED_OVERHEAD_MIB``: the work of
  the requests in flight and allocator slack), where baseline is its RSS after the
  warm-up (the model, the KV pool and one-time initialisation are in it) and its caches are: API, the
  processor cache (the IPC mirror holds keys and sizes, no tensors); engine, the receiver cache
  (= ``--mm-ipc-cache-gb``); worker, the encoder cache (tokens x text hidden size x 4 bytes on CPU);
- no process restarted; SIGINT to ``mmserve serve`` alone stops it gracefully within 30 s (uvicorn's
  "Finished server process" logged; status 0),
  leaving no child process; the server log before that shows no traceback, ERROR or 5xx.

Exits 1 if any check fails. The server log and locust's CSVs stay in the folder printed at the start.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from bench_throughput import REPO, Proc, chat_body, free_port, git, wait_healthy  # bench/ is on sys.path
from images import jpeg_data_url
from prometheus_client.parser import text_string_to_metric_families

MIB = 1 << 20
PROCESSOR_CACHE_GB = 0.25
IPC_CACHE_GB = 0.25
ENCODER_CACHE_TOKENS = 8192
KV_CACHE_TOKENS = 16384
MAX_REQUEST_BODY_MB = 1
SERVER_FLAGS = [
    "--mm-processor-cache-gb", str(PROCESSOR_CACHE_GB),
    "--mm-ipc-cache-gb", str(IPC_CACHE_GB),
    "--encoder-cache-tokens", str(ENCODER_CACHE_TOKENS),
    "--kv-cache-tokens", str(KV_CACHE_TOKENS),
    "--block-size", "16",
    "--max-num-seqs", "64",
    "--max-request-body-mb", str(MAX_REQUEST_BODY_MB),
]  # fmt: skip
STOP_TIMEOUT_S = 60  # locust's --stop-timeout: users finish the request in flight
KILL_MARGIN_S = 60  # past duration + stop timeout + this, locust is killed and the run fails
ROLES = ("api", "engine", "worker")


@dataclass
class RssTrack:
    proc: psutil.Process
    start_mib: float = 0.0
    baseline_mib: float = 0.0
    peak_mib: float = 0.0
    final_mib: float = 0.0
    samples_mib: list[float] = field(default_factory=list)


def find_roles(serve: psutil.Process, timeout_s: float = 30.0) -> dict[str, psutil.Process]:
    """The api (``serve`` itself) and its engine and worker children, found by process title."""
    deadline = time.monotonic() + timeout_s
    while True:
        roles = {"api": serve}
        for child in serve.children(recursive=True):
            try:
                title = " ".join(child.cmdline())
            except psutil.Error:
                continue
            for role in ("engine", "worker"):
                if title.startswith(f"mmserve: {role}"):
                    roles[role] = child
        if len(roles) == len(ROLES) or time.monotonic() > deadline:
            return roles
        time.sleep(0.2)


def rss_mib(proc: psutil.Process) -> float:
    return proc.memory_info().rss / MIB


class RssSampler(threading.Thread):
    """Samples every role's RSS once a second, and notices a role whose process changed (a restart)."""

    def __init__(self, serve: psutil.Process, tracks: dict[str, RssTrack]) -> None:
        super().__init__(daemon=True)
        self.serve, self.tracks = serve, tracks
        self.stop_event = threading.Event()
        self.restarted: set[str] = set()

    def run(self) -> None:
        while not self.stop_event.wait(1.0):
            self.sample()

    def sample(self) -> None:
        current = find_roles(self.serve, timeout_s=0)
        for role, track in self.tracks.items():
            if role not in current or current[role].pid != track.proc.pid:
                self.restarted.add(role)
                continue
            try:
                mib = rss_mib(track.proc)
            except psutil.Error:
                self.restarted.add(role)
                continue
            track.samples_mib.append(mib)
            track.peak_mib = max(track.peak_mib, mib)


def scrape(base_url: str) -> dict[str, float]:
    """``/metrics`` as {name: value}, labelled samples summed per name."""
    text = httpx.get(f"{base_url}/metrics", timeout=10.0).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def warm_up(base_url: str, model_name: str) -> None:
    """One text request and one image request streamed and not: lazy one-time setup is then done."""
    image = jpeg_data_url(336, seed=12345)
    for image_url, stream in ((None, False), (image, True), (image, False)):
        body = {**chat_body(model_name, "Warm up.", image_url, 4), "stream": stream}
        if not stream:
            del body["stream_options"]
        response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120.0)
        response.raise_for_status()


def run_locust(args: argparse.Namespace, base_url: str, model_name: str, folder: Path) -> tuple[int, dict]:
    """Runs the locustfile headless in its own process group; (exit status, the users' tally)."""
    results_path = folder / "tally.json"
    command = [
        str(Path(sys.executable).with_name("locust")),
        "-f", str(REPO / "bench" / "locustfile_load.py"),
        "--headless", "-u", str(args.users), "-r", str(args.spawn_rate), "-t", f"{args.duration}s",
        "--stop-timeout", str(STOP_TIMEOUT_S), "--host", base_url,
        "--csv", str(folder / "locust"), "--only-summary", "--loglevel", "WARNING",
    ]  # fmt: skip
    env = {
        **os.environ,
        "MMSERVE_MODEL_NAME": model_name,
        "MMSERVE_LOAD_RESULTS": str(results_path),
        "MMSERVE_LOAD_BODY_CAP_MB": str(MAX_REQUEST_BODY_MB),
    }
    hard_limit_s = args.duration + STOP_TIMEOUT_S + KILL_MARGIN_S
    with (folder / "locust.log").open("wb") as log:
        locust = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            status = locust.wait(hard_limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(locust.pid, signal.SIGKILL)
            locust.wait()
            print(f"locust still running after {hard_limit_s} s: killed")
            return -1, {}
    if not results_path.exists():
        print((folder / "locust.log").read_text(errors="replace")[-3000:])
        return status, {}
    return status, json.loads(results_path.read_text())


def wait_idle(base_url: str, timeout_s: float = 15.0) -> dict[str, float]:
    """/metrics once the engine reports nothing running or waiting (its stats arrive periodically)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(base_url)
        idle = metrics["mmserve_num_requests_running"] == 0 and metrics["mmserve_num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(0.5)


def stop_serve(server: Proc, roles: dict[str, psutil.Process]) -> tuple[int | None, list[str]]:
    """SIGINT to ``serve`` only (its children must be stopped by it); (exit status or None if it had to
    be killed, descriptions of processes left behind)."""
    descendants = {p.pid: p for p in roles.values()}
    with contextlib.suppress(psutil.Error):
        descendants.update({p.pid: p for p in roles["api"].children(recursive=True)})
    os.kill(server.popen.pid, signal.SIGINT)
    try:
        status: int | None = server.popen.wait(30)
    except subprocess.TimeoutExpired:
        status = None
    time.sleep(1.0)  # children reparented at the parent's exit get a moment to go
    left = []
    for pid, proc in descendants.items():
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {' '.join(proc.cmdline())}")
        except psutil.Error:
            pass
    if status is None or left:
        server.stop()  # SIGINT, then SIGKILL to the whole group
        for proc in descendants.values():
            if proc.is_running():
                proc.kill()
    return status, left


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else sum(values)


def print_requests(kinds: dict[str, dict], duration_s: float) -> None:
    columns, widths = ("sent", "ok", "expected_4xx", "unexpected", "cut_off"), (7, 7, 17, 12, 9)
    header = f"{'kind':<24}{'sent':>7}{'ok':>7}{'4xx as expected':>17}{'unexpected':>12}{'cut off':>9}"
    print(f"\n{header}{'p50 ms':>9}{'p95 ms':>9}")
    for kind, t in kinds.items():
        p50, p95 = percentile(t["latencies_ms"], 50), percentile(t["latencies_ms"], 95)
        row = "".join(f"{t[key]:>{width}}" for key, width in zip(columns, widths, strict=True))
        print(f"{kind:<24}{row}{p50:>9.0f}{p95:>9.0f}")
    total = {key: sum(t[key] for t in kinds.values()) for key in columns}
    hostile = sum(t["sent"] for kind, t in kinds.items() if kind.startswith("hostile"))
    row = "".join(f"{total[key]:>{width}}" for key, width in zip(columns, widths, strict=True))
    print(
        f"{'total':<24}{row}   ({total['sent'] / duration_s:.1f} req/s, "
        f"{100 * hostile / max(total['sent'], 1):.1f} % hostile)"
    )


# What a process may hold beyond its baseline and its caches while 32 users load it: API, the encoded,
# decoded and processed images of the requests in flight (a 336x336 image is ~1.3 MiB as float32 pixel
# values, several copies on the way) plus the malloc arenas of the processing threads; engine, the
# payload frames of requests in flight; worker, activations of the largest step.
STATED_OVERHEAD_MIB = {"api": 192.0, "engine": 64.0, "worker": 128.0}


def print_memory(tracks: dict[str, RssTrack], caches_mib: dict[str, float]) -> dict[str, bool]:
    print(
        f"\n{'process':<8}{'pid':>8}{'start':>8}{'baseline':>10}{'peak':>8}{'final':>8}{'caches':>8}"
        f"{'stated':>7}{'bound':>8}{'overhead':>10}  MiB"
    )
    passed = {}
    for role, t in tracks.items():
        slack_mib = STATED_OVERHEAD_MIB[role]
        bound_mib = t.baseline_mib + caches_mib[role] + slack_mib
        overhead_mib = t.peak_mib - t.baseline_mib - caches_mib[role]
        passed[role] = t.peak_mib <= bound_mib
        print(
            f"{role:<8}{t.proc.pid:>8}{t.start_mib:>8.0f}{t.baseline_mib:>10.0f}{t.peak_mib:>8.0f}"
            f"{t.final_mib:>8.0f}{caches_mib[role]:>8.0f}{slack_mib:>7.0f}{bound_mib:>8.0f}"
            f"{overhead_mib:>+10.0f}  {'PASS' if passed[role] else 'FAIL'}"
        )
    print("RSS every 10 s of the run (MiB):")
    for role, t in tracks.items():
        print(f"  {role:<8}" + " ".join(f"{mib:.0f}" for mib in t.samples_mib[::10]))
    return passed


def encoder_cache_mib(model_dir: Path) -> float:
    """The worker's encoder cache at full: tokens x the text hidden size x 4 bytes (CPU runs in fp32)."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden = (config.get("text_config") or config)["hidden_size"]
    return ENCODER_CACHE_TOKENS * hidden * 4 / MIB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--spawn-rate", type=float, default=8.0, help="users started per second")
    parser.add_argument("--duration", type=int, default=60, help="seconds of load")
    parser.add_argument("--model", default="models/tiny-llava", help="built (tiny llava) if missing")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    args = parser.parse_args()
    model_dir = Path(args.model).resolve()
    if not (model_dir / "config.json").exists():
        from workers.families.tiny import build_tiny_model

        build_tiny_model("llava", str(model_dir))
    port = args.port or free_port()
    base_url = f"http://127.0.0.1:{port}"
    folder = Path(tempfile.mkdtemp(prefix="mmserve-load-"))
    flags = ["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port), *SERVER_FLAGS]
    head = git("rev-parse", "--short", "HEAD").strip()
    head += " + uncommitted edits" if git("status", "--porcelain", "--untracked-files=no") else ""
    print(f"tree {head}\nmmserve serve {' '.join(flags)}\nlogs and CSVs: {folder}", flush=True)

    server = Proc(["serve", *flags], REPO, folder / "serve.log")
    try:
        wait_healthy(base_url, [server])
        serve = psutil.Process(server.popen.pid)
        roles = find_roles(serve)
        if set(roles) != set(ROLES):
            raise RuntimeError(f"found only {sorted(roles)} among the children of {serve.pid}")
        tracks = {role: RssTrack(proc) for role, proc in roles.items()}
        for t in tracks.values():
            t.start_mib = rss_mib(t.proc)
        warm_up(base_url, model_dir.name)
        for t in tracks.values():
            t.baseline_mib = t.peak_mib = rss_mib(t.proc)
        before = scrape(base_url)
        sampler = RssSampler(serve, tracks)
        sampler.start()
        print(f"locust: {args.users} users, {args.duration} s ...", flush=True)
        t_start_s = time.monotonic()
        locust_status, tally = run_locust(args, base_url, model_dir.name, folder)
        load_s = time.monotonic() - t_start_s
        after = wait_idle(base_url)
        healthy = httpx.get(f"{base_url}/health", timeout=10.0).status_code == 200
        sampler.stop_event.set()
        sampler.join()
        sampler.sample()
        for t in tracks.values():
            t.final_mib = t.samples_mib[-1] if t.samples_mib else 0.0
    except BaseException:
        server.stop()
        print(f"server log: {folder / 'serve.log'}")
        raise
    status, left = stop_serve(server, roles)

    kinds = tally.get("kinds", {})
    if kinds:
        print_requests(kinds, args.duration)
    caches_mib = {
        "api": PROCESSOR_CACHE_GB * 1024,
        "engine": IPC_CACHE_GB * 1024,
        "worker": encoder_cache_mib(model_dir),
    }
    rss_passed = print_memory(tracks, caches_mib)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    num_ok = sum(t["ok"] for t in kinds.values())
    num_tokens = sum(t["completion_tokens"] for t in kinds.values())
    hits = {
        name: f"{delta(f'mmserve_{name}_hits_total'):.0f}/{delta(f'mmserve_{name}_queries_total'):.0f}"
        for name in ("mm_processor_cache", "mm_ipc_cache", "encoder_cache", "prefix_cache")
    }
    print(
        f"\nserver, over the run: finished requests {delta('mmserve_request_success_total'):.0f}, "
        f"generated tokens {delta('mmserve_generation_tokens_total'):.0f}, "
        f"preemptions {delta('mmserve_num_preemptions_total'):.0f}; hits/queries: "
        + ", ".join(f"{name} {value}" for name, value in hits.items())
    )
    log_text = (folder / "serve.log").read_text(errors="replace")
    shut_down = "Finished server process" in log_text
    server_errors = [
        line for line in log_text.splitlines() if re.search(r'Traceback| ERROR |"POST [^"]*" 5\d\d', line)
    ]
    checks = {
        f"locust finished in time (status {locust_status})": locust_status >= 0 and bool(kinds),
        "no unexpected answer": bool(kinds) and all(t["unexpected"] == 0 for t in kinds.values()),
        "every request sent was settled (none cut off at the stop)": all(
            t["sent"] == t["ok"] + t["expected_4xx"] + t["unexpected"] for t in kinds.values()
        ),
        f"finished requests on the server = complete answers received ({num_ok})": (
            delta("mmserve_request_success_total") == num_ok
        ),
        f"generated tokens on the server = tokens received ({num_tokens})": (
            delta("mmserve_generation_tokens_total") == num_tokens
        ),
        "no IPC-cache resend": delta("mmserve_mm_ipc_cache_resends_total") == 0,
        "/health 200 after the run": healthy,
        "requests running = waiting = 0 after the run": (
            after["mmserve_num_requests_running"] == 0 and after["mmserve_num_requests_waiting"] == 0
        ),
        "RSS of every process within its bound": all(rss_passed.values()),
        "no process restarted": not sampler.restarted,
        f"SIGINT stopped serve gracefully (status {status})": shut_down and status == 0,
        "no process left behind": not left,
        f"no error in the server log ({len(server_errors)})": not server_errors,
    }
    print()
    for name, passed in checks.items():
        print(f"{'PASS' if passed else 'FAIL'}  {name}")
    for example in tally.get("unexpected_examples", []):
        print(f"unexpected: {json.dumps(example)[:1500]}")
    for line in server_errors[:10] + left:
        print(f"  {line}")
    print(f"load {load_s:.0f} s wall (with the stop timeout); logs: {folder}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
