"""Priority scheduling under overload: how long an interactive request waits behind a bulk load, at the
bulk's priority and at a higher one, on mmserve and on vLLM's CPU build (the tiny LLaVA on both, each
with ``--scheduling-policy priority --max-num-seqs 4``), side by side in one run.

    python bench/bench_priority.py [--bulk-clients 16] [--interactive 16] [--rounds 4]
                                   [--vllm-dir /tmp/vllmcpu] [--skip-vllm] [--chart PATH]

The bulk load: ``--bulk-clients`` clients, each sending one streamed chat request after the other (a text
prompt, 96 tokens, ``ignore_eos``, ``priority`` 10), against 4 running requests at most: a queue of
about ``bulk-clients - 4`` requests always waits. Meanwhile one interactive client sends
``--interactive`` requests one at a time (16 tokens, ``ignore_eos``), a new one 0.1 s after the last
answered, either at the bulk's priority (``same``: it queues behind the bulk requests that came first,
as under fcfs) or at priority 0 (``higher``: it goes first in the queue). Each round runs, on each
server in turn (the order alternating), the bulk load with 3 s to fill the queue, then the two cells
(their order alternating); per cell the interactive requests' TTFT and latency (p50, p90) and the
bulk's output tokens/s meanwhile. Medians of the rounds; per server the median of the rounds' same /
higher TTFT ratios; mmserve / vLLM per cell. Both servers are up for the whole run, each idle while the
other is measured. Every answer is checked for its token count. Draws ``--chart``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import httpx
from bench_input_scale import machine
from bench_throughput import REPO, git
from charts import Panel, draw
from engine_servers import Server, serving, vllm_server

from workers.families.tiny import build_tiny_model

MAX_NUM_SEQS = 4
BULK_TOKENS, BULK_PRIORITY = 96, 10
INTERACTIVE_TOKENS, HIGHER_PRIORITY = 16, 0
PAUSE_S = 0.1  # between an interactive answer and the next request
WARM_S = 3.0  # the bulk load runs this long before the interactive requests start
CELLS = {"same": BULK_PRIORITY, "higher": HIGHER_PRIORITY}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle, number {}."


def body(i: int, max_tokens: int, priority: int) -> dict[str, Any]:
    return {
        "model": "tiny-llava",
        "messages": [{"role": "user", "content": PROMPT.format(i)}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "priority": priority,
    }


async def streamed(client: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> tuple[float, float]:
    """(seconds to the first token, seconds to the end) of one streamed chat request, its token count
    checked."""
    start, ttft, tokens = time.perf_counter(), None, None
    async with client.stream("POST", url, json=payload) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(choice["delta"].get("content") for choice in chunk["choices"]):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if ttft is None or tokens != payload["max_tokens"]:
        raise RuntimeError(f"answer of {tokens} tokens, expected {payload['max_tokens']}")
    return ttft, time.perf_counter() - start


@dataclass
class Bulk:
    """The bulk clients' answered tokens over time, and whether they should stop."""

    tokens: list[tuple[float, int]] = field(default_factory=list)  # (end time, tokens) of each answer
    stop: bool = False

    def tokens_per_s(self, start: float, end: float) -> float:
        return sum(n for at, n in self.tokens if start <= at < end) / (end - start)


async def bulk_client(client: httpx.AsyncClient, url: str, lane: int, bulk: Bulk) -> None:
    i = 0
    while not bulk.stop:
        i += 1
        await streamed(client, url, body(1000 * lane + i, BULK_TOKENS, BULK_PRIORITY))
        bulk.tokens.append((time.perf_counter(), BULK_TOKENS))


async def interactive(
    client: httpx.AsyncClient, url: str, num: int, priority: int
) -> list[tuple[float, float]]:
    results = []
    for i in range(num):
        results.append(await streamed(client, url, body(i, INTERACTIVE_TOKENS, priority)))
        await asyncio.sleep(PAUSE_S)
    return results


async def one_server(base_url: str, args: argparse.Namespace, first: str) -> dict[str, dict[str, float]]:
    """One round on one server: its bulk load running, each cell (``first`` first) in turn."""
    url = f"{base_url}/v1/chat/completions"
    limits = httpx.Limits(max_connections=args.bulk_clients + 2)
    figures: dict[str, dict[str, float]] = {}
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
        bulk = Bulk()
        lanes = [
            asyncio.create_task(bulk_client(client, url, lane, bulk)) for lane in range(args.bulk_clients)
        ]
        await asyncio.sleep(WARM_S)  # the queue fills
        try:
            for cell in sorted(CELLS, key=lambda c: c != first):
                start = time.perf_counter()
                results = await interactive(client, url, args.interactive, CELLS[cell])
                end = time.perf_counter()
                ttfts, latencies = sorted(t for t, _ in results), sorted(e for _, e in results)
                figures[cell] = {
                    "ttft_p50_ms": 1e3 * statistics.median(ttfts),
                    "ttft_p90_ms": 1e3 * ttfts[int(0.9 * (len(ttfts) - 1))],
                    "latency_p50_ms": 1e3 * statistics.median(latencies),
                    "bulk_tokens_per_s": bulk.tokens_per_s(start, end),
                }
        finally:
            bulk.stop = True
            await asyncio.gather(*lanes)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bulk-clients", type=int, default=16)
    parser.add_argument("--interactive", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--vllm-dir", type=Path, default=Path("/tmp/vllmcpu"))
    parser.add_argument("--vllm-peer", type=Path, default=REPO.parent / "shared/peers/vllm-cpu")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--chart", type=Path, default=REPO / "docs" / "img" / "priority.png")
    args = parser.parse_args()
    revision = git("rev-parse", "--short", "HEAD").strip()  # the code the servers start with
    folder = Path(tempfile.mkdtemp(prefix="mmserve-bench-priority-"))
    model_dir = build_tiny_model("llava", folder / "tiny-llava")  # (vLLM's copy: the same tensors)
    flags = ["--scheduling-policy", "priority", "--max-num-seqs", str(MAX_NUM_SEQS)]
    servers = [Server("mmserve", "mmserve", ["--model", str(model_dir), *flags], REPO)]
    if not args.skip_vllm:
        peer = vllm_server(args.vllm_peer, args.vllm_dir, flags)
        print(f"vLLM: {peer}") if isinstance(peer, str) else servers.append(peer)
    with ExitStack() as stack:  # every server up at once, each idle while another is measured
        urls = {
            s.label: stack.enter_context(serving(s, args.vllm_peer, args.vllm_dir, folder)) for s in servers
        }
        for base_url in urls.values():  # warm-up (vLLM compiles on its first requests)
            asyncio.run(interactive_once(base_url))
        per_round: dict[tuple[str, str], list[dict[str, float]]] = {}
        for r in range(args.rounds):
            for label in list(urls) if r % 2 == 0 else list(urls)[::-1]:
                first = list(CELLS)[r % 2]
                for cell, figures in asyncio.run(one_server(urls[label], args, first)).items():
                    per_round.setdefault((label, cell), []).append(figures)
                    print(
                        f"  round {r + 1} {label} {cell:6}: "
                        + "  ".join(f"{k} {v:.0f}" for k, v in figures.items()),
                        flush=True,
                    )
    report(per_round, [s.label for s in servers], args, revision)


async def interactive_once(base_url: str) -> None:
    async with httpx.AsyncClient(timeout=600.0) as client:
        await interactive(client, f"{base_url}/v1/chat/completions", 2, BULK_PRIORITY)


def report(
    per_round: dict[tuple[str, str], list[dict[str, float]]],
    labels: list[str],
    args: argparse.Namespace,
    revision: str,
) -> None:
    medians = {
        key: {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        for key, rounds in per_round.items()
    }
    print(f"\nmmserve {revision}, {date.today()}, {machine()}")
    print(
        f"{args.bulk_clients} bulk clients ({BULK_TOKENS} tokens, priority {BULK_PRIORITY}), --max-num-seqs "
        f"{MAX_NUM_SEQS}; interactive {INTERACTIVE_TOKENS} tokens, {args.interactive} per cell, "
        f"{args.rounds} rounds"
    )
    print("| server | interactive priority | TTFT p50 ms | TTFT p90 ms | latency p50 ms | bulk tokens/s |")
    print("|---|---|---|---|---|---|")
    for (label, cell), m in medians.items():
        print(
            f"| {label} | {cell} ({CELLS[cell]}) | {m['ttft_p50_ms']:.0f} | {m['ttft_p90_ms']:.0f} | "
            f"{m['latency_p50_ms']:.0f} | {m['bulk_tokens_per_s']:.0f} |"
        )
    for label in labels:
        same, higher = per_round[label, "same"], per_round[label, "higher"]
        ratio = statistics.median(
            s["ttft_p50_ms"] / h["ttft_p50_ms"] for s, h in zip(same, higher, strict=True)
        )
        print(f"{label}: interactive TTFT p50, same / higher priority (median of the rounds): {ratio:.1f}x")
    if len(labels) == 2:
        for cell in CELLS:
            ours, theirs = medians[labels[0], cell], medians[labels[1], cell]
            ttft = ours["ttft_p50_ms"] / theirs["ttft_p50_ms"]
            bulk = ours["bulk_tokens_per_s"] / theirs["bulk_tokens_per_s"]
            print(
                f"{cell}: mmserve / vLLM: interactive TTFT p50 {ttft:.2f}x, bulk output tokens/s {bulk:.2f}x"
            )
    draw(
        args.chart,
        "An interactive request behind a bulk load, by its priority (tiny LLaVA, CPU)",
        [
            Panel(
                "Interactive TTFT p50",
                "ms",
                {label: {cell: medians[label, cell]["ttft_p50_ms"] for cell in CELLS} for label in labels},
            ),
            Panel(
                "Bulk throughput meanwhile",
                "output tokens/s",
                {
                    label: {cell: medians[label, cell]["bulk_tokens_per_s"] for cell in CELLS}
                    for label in labels
                },
            ),
        ],
        f"mmserve {revision}, {date.today()}; {machine()}; median of {args.rounds} rounds",
    )


if __name__ == "__main__":
    main()
