"""Whole-server benchmark on real ``mmserve`` processes: output tok/s by concurrency for HEAD and a
reference revision, and the worker's resident memory over a long run of short requests.

    python bench/bench_throughput.py --model models/tiny-llava [--ref 16623bd] [--concurrency 1,4,16,64]
        [--max-tokens 64] [--repeats 3] [--memory-requests 2000] [--skip-throughput] [--skip-memory]

Throughput: each request has the same image and then a text of its own, streams with ``ignore_eos``
at temperature 0; ``c`` requests stay in flight; tok/s = completion tokens / wall time. Servers: the
reference (run in a ``git worktree`` of it: with cwd first on ``sys.path``, its packages shadow the
editable install), HEAD without prefix caching, and HEAD. Memory: HEAD's roles start separately, so the
worker's pid is known; its VmRSS is sampled every 250 requests of repeated images, new images and text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
from images import jpeg_data_url  # bench/ is on sys.path: scripts run as bench/<name>.py

REPO = Path(__file__).resolve().parents[1]
COMMON_FLAGS = ["--max-model-len", "4096"]
HEAD_KV_FLAGS = ["--kv-cache-tokens", "65536", "--block-size", "16"]  # the CPU defaults, stated
SAMPLING = {"temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cli_module(tree: Path) -> str:
    """The CLI's module in ``tree``: ``app.launch.cli``, or ``app.cli`` in revisions before the app
    subpackages."""
    return "app.launch.cli" if (tree / "app/launch/cli.py").exists() else "app.cli"


class Proc:
    """``python -m <cli> ROLE ...`` in ``cwd``'s tree, in its own process group, output to a log file."""

    def __init__(self, args: list[str], cwd: Path, log_path: Path) -> None:
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", cli_module(cwd), *args],
                cwd=cwd,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self) -> None:
        """SIGINT to the group (as Ctrl-C would), SIGKILL if it is not gone within 30 s."""
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGINT)
        try:
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()


def wait_healthy(base_url: str, procs: list[Proc], timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.popen.poll() is not None:
                tail = p.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{p.log_path.stem} exited with {p.popen.returncode}:\n{tail}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{base_url} not healthy after {timeout_s} s")


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, check=True).stdout


@contextmanager
def reference_worktree(rev: str) -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="mmserve-ref-")) / "tree"
    git("worktree", "add", "--detach", str(folder), rev)
    try:
        yield folder
    finally:
        git("worktree", "remove", "--force", str(folder))
        folder.parent.rmdir()


def check_reference(tree: Path) -> None:
    """Sanity: processes started in ``tree`` import its packages (not the editable install's)."""

    def python(*args: str) -> str:
        return subprocess.run([sys.executable, *args], cwd=tree, capture_output=True, text=True).stdout

    files = python("-c", "import app, engine, workers as w; print(app.__file__, engine.__file__, w.__file__)")
    if not all(Path(f).is_relative_to(tree) for f in files.split()):
        raise RuntimeError(f"the reference imports packages outside its worktree: {files}")
    has_kv_flag = "--kv-cache-tokens" in python("-m", cli_module(tree), "serve", "--help")
    print(f"reference imports {tree}/{{app,engine,workers}}; has --kv-cache-tokens: {has_kv_flag}")


def chat_body(model: str, text: str, image_url: str | None, max_tokens: int) -> dict[str, object]:
    content: list[dict[str, object]] = [{"type": "text", "text": text}]
    if image_url is not None:  # image first: the shared part of the prompt comes first
        content.insert(0, {"type": "image_url", "image_url": {"url": image_url}})
    messages = [{"role": "user", "content": content}]
    return {"model": model, "messages": messages, "max_tokens": max_tokens, **SAMPLING}


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> tuple[float, dict]:
    """(seconds to the first content token, usage) of one streamed completion."""
    start, ttft, usage = time.perf_counter(), None, None
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {") or (ttft is not None and '"usage":null' in line):
                continue  # after the first token, only the usage chunk is parsed
            chunk = json.loads(line[6:])
            if ttft is None and any(choice["delta"].get("content") for choice in chunk["choices"]):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    if ttft is None or usage is None:
        raise RuntimeError(f"stream without content or usage: {body['messages']}")
    return ttft, usage


async def run_load(base_url: str, bodies: list[dict], concurrency: int) -> tuple[float, list[tuple]]:
    """Sends ``bodies`` keeping ``concurrency`` in flight; returns (wall seconds, [(ttft, usage)])."""
    url, todo, results = f"{base_url}/v1/chat/completions", iter(bodies), []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:

        async def lane() -> None:
            for body in todo:
                results.append(await stream_chat(client, url, body))

        start = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        return time.perf_counter() - start, results


def start_serve(label: str, cwd: Path, flags: list[str], folder: Path, stack: ExitStack) -> str:
    """Starts ``mmserve serve`` in ``cwd`` (stopped when ``stack`` closes); returns its base URL."""
    port = free_port()
    print(f"[{label}] mmserve serve {' '.join(flags)} --port {port}   (cwd {cwd})", flush=True)
    server = Proc(["serve", *flags, "--port", str(port)], cwd, folder / f"serve-{port}.log")
    stack.callback(server.stop)
    wait_healthy(f"http://127.0.0.1:{port}", [server])
    return f"http://127.0.0.1:{port}"


def measure(base_url: str, bodies: list[dict], concurrency: int) -> tuple[float, float, float]:
    """(output tok/s, mean TTFT ms, mean cached prompt tokens) of ``bodies``, ``concurrency`` at a time."""
    wall_s, results = asyncio.run(run_load(base_url, bodies, concurrency))
    num_tokens = sum(usage["completion_tokens"] for _, usage in results)
    expected = sum(int(body["max_tokens"]) for body in bodies)  # ignore_eos: every request runs to the end
    if num_tokens != expected:
        raise RuntimeError(f"{base_url}: {num_tokens} completion tokens, expected {expected}")
    ttft_ms = 1e3 * statistics.mean(ttft for ttft, _ in results)
    cached = statistics.mean(usage["prompt_tokens_details"]["cached_tokens"] for _, usage in results)
    return num_tokens / wall_s, ttft_ms, cached


def throughput(args: argparse.Namespace, model_name: str) -> None:
    counts = {c: min(max(8 * c, 32), args.max_requests) for c in args.concurrency}
    image_url = jpeg_data_url(args.image_size, seed=0)
    print(
        f"\n== throughput: the same {args.image_size} px image + a new text per request, max_tokens "
        f"{args.max_tokens}, ignore_eos, temperature 0, streamed; requests per level: "
        + ", ".join(f"c{c}={n}" for c, n in counts.items())
        + f"; {args.repeats} rounds, servers interleaved within each round, median reported"
    )
    serial = iter(range(10**9))  # every text is new, across all levels and servers

    def bodies(n: int) -> list[dict]:
        texts = (f"Request {next(serial)}: what does this picture show?" for _ in range(n))
        return [chat_body(model_name, text, image_url, args.max_tokens) for text in texts]

    common = ["--model", args.model, *COMMON_FLAGS]
    head = git("rev-parse", "--short", "HEAD").strip()
    head += "+edits" if git("status", "--porcelain", "--untracked-files=no") else ""  # the tree runs
    samples: dict[tuple[str, int], list[tuple[float, float, float]]] = defaultdict(list)
    with (
        reference_worktree(args.ref) as tree,
        tempfile.TemporaryDirectory(prefix="mmserve-bench-") as logs,
        ExitStack() as stack,
    ):
        check_reference(tree)
        ref = f"ref {git('rev-parse', '--short', 'HEAD', cwd=tree).strip()}"
        engines = [
            (ref, tree, common),
            (f"head {head} no-prefix", REPO, [*common, *HEAD_KV_FLAGS, "--no-enable-prefix-caching"]),
            (f"head {head}", REPO, [*common, *HEAD_KV_FLAGS]),
        ]
        servers = {label: start_serve(label, cwd, flags, Path(logs), stack) for label, cwd, flags in engines}
        for base_url in servers.values():
            measure(base_url, bodies(16), 4)  # warm-up
        for round_ in range(1, args.repeats + 1):
            for c, n in counts.items():
                line = f"  round {round_} c={c:<3}"
                for label, base_url in servers.items():
                    samples[label, c].append(measure(base_url, bodies(n), c))
                    line += f"  {label}: {samples[label, c][-1][0]:5.0f}"
                print(line + "  tok/s", flush=True)

    def median(label: str, c: int, i: int) -> float:
        return statistics.median(sample[i] for sample in samples[label, c])

    print("\noutput tok/s, median of rounds (mean TTFT ms)")
    header = "".join(f"{f'c={c}':>15}" for c in counts)
    print(f"{'engine':<30}{header}{'c16/c1':>8}  rises with c  cached prompt tok/req")
    for label in servers:
        tps = [median(label, c, 0) for c in counts]
        rises = "yes" if all(b > a for a, b in zip(tps, tps[1:], strict=False)) else "NO"
        has_c1_c16 = {1, 16} <= counts.keys()
        scaling = f"{median(label, 16, 0) / median(label, 1, 0):7.2f}x" if has_c1_c16 else " " * 8
        cells = "".join(f"{f'{median(label, c, 0):.0f} ({median(label, c, 1):.0f})':>15}" for c in counts)
        cached = statistics.mean(median(label, c, 2) for c in counts)
        print(f"{label:<30}{cells}{scaling}  {rises:<12}  {cached:.0f}")
    for label in list(servers)[1:]:
        ratios = "  ".join(f"c={c}: {median(label, c, 0) / median(ref, c, 0):.2f}x" for c in counts)
        print(f"{label} / ref:  {ratios}")


def memory(args: argparse.Namespace, model_name: str) -> None:
    num_warmup, sample_every = 64, 250
    pool = [jpeg_data_url(args.image_size, seed) for seed in range(1, 5)]
    print(
        f"\n== memory: HEAD worker VmRSS; {num_warmup} warm-up + {args.memory_requests} requests, "
        f"max_tokens 8, concurrency 16; of every 4: 2 images from a pool of {len(pool)}, "
        "1 unique image, 1 text only"
    )

    def body(i: int) -> dict:
        image = None  # i % 4 == 3: text only
        if i % 4 < 2:
            image = pool[i % len(pool)]
        elif i % 4 == 2:
            image = jpeg_data_url(args.image_size, seed=10_000 + i)
        return chat_body(model_name, f"Request {i}: describe it briefly.", image, 8)

    with tempfile.TemporaryDirectory(prefix="mmserve-mem-") as folder, ExitStack() as stack:
        port = free_port()
        ipc = f"ipc://{folder}"
        addrs = ["--engine-addr", f"{ipc}/engine.sock", "--worker-addr", f"{ipc}/worker.sock"]
        flags = ["--model", args.model, *COMMON_FLAGS, *HEAD_KV_FLAGS, *addrs]
        print(f"mmserve engine|worker|api {' '.join(flags)}  (api: --port {port})", flush=True)
        procs = {}
        for role in ("engine", "worker", "api"):  # stopped in reverse order
            extra = ["--port", str(port)] if role == "api" else []
            procs[role] = Proc([role, *flags, *extra], REPO, Path(folder) / f"{role}.log")
            stack.callback(procs[role].stop)
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, list(procs.values()))
        pool_mib = re.search(r"KV pool .*\(([\d.]+) MiB\)", procs["worker"].log_path.read_text())
        print(f"{'requests':>9} {'worker MiB':>11} {'engine MiB':>11} {'api MiB':>9}")

        def sample(name: str) -> float:
            rss = {role: rss_mib(p.popen.pid) for role, p in procs.items()}
            print(f"{name:>9} {rss['worker']:>11.1f} {rss['engine']:>11.1f} {rss['api']:>9.1f}", flush=True)
            return rss["worker"]

        sample("started")
        asyncio.run(run_load(base_url, [body(-i) for i in range(1, num_warmup + 1)], 16))
        worker_mib = {0: sample("0 (warm)")}
        for done in range(sample_every, args.memory_requests + 1, sample_every):
            asyncio.run(run_load(base_url, [body(i) for i in range(done - sample_every, done)], 16))
            worker_mib[done] = sample(str(done))
        end = max(worker_mib)
        mid = end // 2 // sample_every * sample_every
        growth = worker_mib[end] - worker_mib[0]
        print(
            f"worker RSS growth 0 -> {end}: {growth:+.1f} MiB ({100 * growth / worker_mib[0]:+.1f}%); "
            f"{mid} -> {end}: {worker_mib[end] - worker_mib[mid]:+.1f} MiB"
        )
        pool_size = pool_mib.group(1) if pool_mib else "?"
        print(
            f"(the KV pool, {pool_size} MiB, is zero-filled at worker start, so it is resident from the "
            "first sample; api and engine grow with the unique images, bounded by --mm-*-cache-gb)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-llava")
    parser.add_argument("--ref", default="16623bd", help="reference revision (before paged KV)")
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-requests", type=int, default=512, help="cap on requests per level")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over all levels and servers")
    parser.add_argument("--image-size", type=int, default=336)
    parser.add_argument("--memory-requests", type=int, default=2000, help="rounded down to 250s")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    args.model = str(Path(args.model).resolve())
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    model_name, start = Path(args.model).name, time.monotonic()
    if not args.skip_throughput:
        throughput(args, model_name)
    if not args.skip_memory:
        memory(args, model_name)
    print(f"\ntotal {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
