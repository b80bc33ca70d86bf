"""Several choices and penalties, side by side in one run on one server per family (tiny LLaVA and tiny
Qwen2.5-VL).

    python bench/bench_sampling.py [--families llava,qwen2_5_vl] [--images 10] [--requests 64]
                                   [--rounds 8] [--chart PATH]

Choices: a never-seen 1024x1024 JPEG per request, asked for four answers of 64 tokens (``ignore_eos``,
temperature 1, streamed) either as one request with ``n=4``, as four requests with the same prompt sent
at once, or as those four one after another (what a client without ``n`` does in a loop); one image at a
time, the three ways in turn over ``--images`` images each (every image new).
Per way: choices/s (choices over the summed wall time), and per image the server's processor runs, encoder
runs and prefix-cache hit tokens, from ``/metrics`` read before and after each image.

Penalties: ``--requests`` streamed requests at concurrency 16, 64 tokens, temperature 1, ``ignore_eos``,
one of eight pool images each, with ``frequency_penalty`` 0.5, ``presence_penalty`` 0.3 and
``repetition_penalty`` 1.1 or with none; the two loads alternate (A B, then B A) over ``--rounds`` rounds:
the median requests/s and TPOT p50 of each, and the median of the rounds' penalised / unpenalised
requests/s. Before the loads, a greedy request with and without the
penalties must answer differently (the penalties took effect). Draws ``--chart``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from contextlib import ExitStack
from datetime import date
from pathlib import Path
from typing import Any

import httpx
from bench_input_scale import machine, scrape
from bench_throughput import REPO, chat_body, git, start_serve
from charts import Panel, draw
from engine_loads import AB_MAX_TOKENS, Load, Requests, Result, send
from images import jpeg_data_url

from workers.families.tiny import build_tiny_model

NUM_CHOICES, MAX_TOKENS, CONCURRENCY = 4, 64, 16
PENALTIES = {"frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.1}
LOAD = Load("penalties", "reuse100", CONCURRENCY, MAX_TOKENS)
COUNTERS = {  # column -> the /metrics sample whose difference it is
    "processor runs": "mmserve_mm_processor_seconds_count",
    "encoder runs": "mmserve_encoder_runs_total",
    "prefix-hit tokens": "mmserve_prefix_cache_hits_total",
}
WAYS = (f"n={NUM_CHOICES}", f"{NUM_CHOICES} requests at once", f"{NUM_CHOICES} requests in turn")


def with_fields(body: bytes, **fields: Any) -> bytes:
    return json.dumps({**json.loads(body), **fields}).encode()


def choices_bodies(model: str, image_url: str, way: str) -> list[bytes]:
    """The request(s) of one image: one with ``n``, or ``n`` alike."""
    body = json.dumps(chat_body(model, "What does this picture show?", image_url, MAX_TOKENS)).encode()
    if way == WAYS[0]:
        return [with_fields(body, temperature=1.0, n=NUM_CHOICES)]
    return [with_fields(body, temperature=1.0)] * NUM_CHOICES


def run(base_url: str, bodies: list[bytes], concurrency: int, max_tokens: int) -> Result:
    """Sends ``bodies``, ``concurrency`` at a time; each must stream ``max_tokens`` tokens (all choices)."""
    wall_s, answers = asyncio.run(send(base_url, ((b, False) for b in bodies), concurrency, 600.0))
    result = Result(wall_s, answers, max_tokens)
    if result.failures() != "0":
        raise RuntimeError(f"{base_url}: failed requests: {result.failures()}")
    return result


def one_image(base_url: str, model: str, image_url: str, way: str) -> tuple[float, dict[str, float]]:
    """(wall s, the counters' differences) of one image's choices."""
    bodies = choices_bodies(model, image_url, way)
    before = scrape(base_url)
    concurrency = 1 if way == WAYS[2] else len(bodies)
    result = run(base_url, bodies, concurrency, NUM_CHOICES * MAX_TOKENS // len(bodies))
    after = scrape(base_url)
    return result.wall_s, {k: after.get(name, 0.0) - before.get(name, 0.0) for k, name in COUNTERS.items()}


def choices(base_url: str, model: str, images: list[str]) -> dict[str, dict[str, float]]:
    """The ways in turn, each on its own new images (``images``: one per way per round)."""
    walls: dict[str, list[float]] = {way: [] for way in WAYS}
    totals: dict[str, dict[str, float]] = {way: dict.fromkeys(COUNTERS, 0.0) for way in WAYS}
    num_ways = len(WAYS)
    for round_index in range(len(images) // num_ways):
        order = WAYS[round_index % num_ways :] + WAYS[: round_index % num_ways]
        round_images = images[num_ways * round_index : num_ways * (round_index + 1)]
        for way, image_url in zip(order, round_images, strict=True):
            wall_s, deltas = one_image(base_url, model, image_url, way)
            walls[way].append(wall_s)
            for k, v in deltas.items():
                totals[way][k] += v
            print(f"  image {round_index + 1} {way}: {1e3 * wall_s:.0f} ms, {deltas}", flush=True)
    table = {}
    for way in WAYS:
        num_images = len(walls[way])
        row = {"choices/s": NUM_CHOICES * num_images / sum(walls[way])}
        row |= {k: v / num_images for k, v in totals[way].items()}
        table[way] = row
    return table


def penalties(base_url: str, requests: Requests, num: int, rounds: int) -> dict[str, dict[str, float]]:
    """Unpenalised and penalised loads, alternating; the median of each figure over the rounds, and (as
    the penalised load's "ratio") the median of the rounds' penalised / unpenalised requests/s: a round's
    two loads ran back to back, so their ratio drifts less with the machine's other work."""
    arms = {"none": {"temperature": 1.0}, "penalties": {"temperature": 1.0, **PENALTIES}}
    figures: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    for round_index in range(rounds):
        for arm in list(arms) if round_index % 2 == 0 else list(arms)[::-1]:
            bodies = [with_fields(requests.body(LOAD, i)[0], **arms[arm]) for i in range(num)]
            result = run(base_url, bodies, CONCURRENCY, MAX_TOKENS)
            tpot = [a.tpot_s for a in result.ok if a.tpot_s is not None]
            row = {"req/s": result.req_per_s, "TPOT ms": 1e3 * statistics.median(tpot)}
            figures[arm].append(row)
            print(f"  round {round_index + 1} {arm}: {row}", flush=True)
    table = {arm: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for arm, rs in figures.items()}
    pairs = zip(figures["penalties"], figures["none"], strict=True)
    table["penalties"]["ratio"] = statistics.median(pen["req/s"] / none["req/s"] for pen, none in pairs)
    return table


def check_effects(base_url: str, model: str, image_url: str) -> None:
    """``n`` answers with that many choices, not all alike at temperature 1; greedy answers differ with
    the penalties (so they took effect)."""
    url = f"{base_url}/v1/chat/completions"
    streamed = chat_body(model, "What does this picture show?", image_url, MAX_TOKENS)
    body = {k: v for k, v in streamed.items() if k not in ("stream", "stream_options")}

    def texts(**fields: Any) -> list[str]:
        response = httpx.post(url, json={**body, **fields}, timeout=120.0)
        response.raise_for_status()
        return [c["message"]["content"] for c in response.json()["choices"]]

    several = texts(temperature=1.0, n=NUM_CHOICES)
    if len(several) != NUM_CHOICES or len(set(several)) == 1:
        raise RuntimeError(f"n={NUM_CHOICES} at temperature 1 answered {several}")
    if texts() == texts(**PENALTIES):
        raise RuntimeError("the penalties changed no greedy answer")


def warm_up(base_url: str, model: str, requests: Requests, images: list[str]) -> None:
    run(base_url, [b for b, _ in requests.pool_bodies()], CONCURRENCY, AB_MAX_TOKENS)
    check_effects(base_url, model, images[0])
    for way, image_url in zip(WAYS, images[1:], strict=False):
        bodies = choices_bodies(model, image_url, way)
        run(base_url, bodies, len(bodies), NUM_CHOICES * MAX_TOKENS // len(bodies))
    for fields in ({}, PENALTIES):
        bodies = [with_fields(requests.body(LOAD, i, warmup=True)[0], **fields) for i in range(CONCURRENCY)]
        run(base_url, bodies, CONCURRENCY, MAX_TOKENS)


Table = dict[str, dict[str, dict[str, float]]]  # family -> way or load -> figure -> value


def print_tables(choices_table: Table, penalties_table: Table, args: argparse.Namespace) -> None:
    print(f"\n{NUM_CHOICES} choices of {MAX_TOKENS} tokens per new 1024x1024 JPEG, one image at a time, "
          f"{args.images} images per way; counts per image:")  # fmt: skip
    print("| model | way | choices/s | processor runs | encoder runs | prefix-hit tokens |")
    print("|---|---|---|---|---|---|")
    for family, rows in choices_table.items():
        for way, row in rows.items():
            counts = " | ".join(f"{row[k]:.2f}" for k in ("processor runs", "encoder runs"))
            hits = row["prefix-hit tokens"]
            print(f"| {family} | {way} | {row['choices/s']:.1f} | {counts} | {hits:.0f} |")
    print(f"\nconcurrency {CONCURRENCY}, {MAX_TOKENS} tokens, temperature 1, {args.requests} requests "
          f"per load, median of {args.rounds} rounds:")  # fmt: skip
    print("| model | req/s none | req/s penalties | ratio of medians | median ratio | TPOT p50 none / pen |")
    print("|---|---|---|---|---|---|")
    for family, loads in penalties_table.items():
        none, pen = loads["none"], loads["penalties"]
        ratios = f"{pen['req/s'] / none['req/s']:.2f}x | {pen['ratio']:.2f}x"
        tpot = f"{none['TPOT ms']:.1f} / {pen['TPOT ms']:.1f} ms"
        print(f"| {family} | {none['req/s']:.1f} | {pen['req/s']:.1f} | {ratios} | {tpot} |")
    for family, rows in choices_table.items():
        for other in WAYS[1:]:
            speedup = rows[WAYS[0]]["choices/s"] / rows[other]["choices/s"]
            print(f"{family}: choices/s, {WAYS[0]} / {other}: {speedup:.2f}x (target >= 2x)")
        runs = " / ".join(f"{rows[way]['encoder runs']:.2f}" for way in WAYS)
        print(f"{family}: encoder runs per image, {' / '.join(WAYS)}: {runs} (target 1 / 1-4)")
        ratio = penalties_table[family]["penalties"]["ratio"]
        print(f"{family}: req/s, penalties / none, median round: {ratio:.2f}x (target >= 0.95x)")


def draw_chart(path: Path, choices_table: Table, penalties_table: Table, revision: str) -> None:
    def per_way(figure: str) -> dict[str, dict[str, float]]:
        return {family: {way: rows[way][figure] for way in WAYS} for family, rows in choices_table.items()}

    req_per_s = {family: {k: v["req/s"] for k, v in arms.items()} for family, arms in penalties_table.items()}

    draw(
        path,
        f"Sampling: n={NUM_CHOICES} vs {NUM_CHOICES} requests per new image; penalties vs none, "
        f"c={CONCURRENCY}",
        [
            Panel(
                f"Choices/s, {NUM_CHOICES} x {MAX_TOKENS} tokens per new image",
                "choices/s",
                per_way("choices/s"),
                fmt="{:.1f}",
            ),
            Panel("Encoder runs per image", "runs", per_way("encoder runs"), fmt="{:.2f}"),
            Panel("Prefix-cache hit tokens per image", "tokens", per_way("prefix-hit tokens")),
            Panel(f"Requests/s, c={CONCURRENCY}, {MAX_TOKENS} tokens", "req/s", req_per_s, fmt="{:.1f}"),
        ],  # fmt: skip
        f"bench/bench_sampling.py · {date.today()} · revision {revision} · {machine()}",
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", default="llava,qwen2_5_vl")
    parser.add_argument("--images", type=int, default=10, help="new images per way, per family")
    parser.add_argument("--requests", type=int, default=64, help="requests per penalties load")
    parser.add_argument("--rounds", type=int, default=8, help="penalties rounds (each: both loads)")
    parser.add_argument("--chart", type=Path, default=REPO / "docs/img/sampling.png")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="mmserve-bench-sampling-"))
    pool = [jpeg_data_url(1024, seed=i) for i in range(8)]
    warm = [jpeg_data_url(1024, seed=900 + i) for i in range(1 + len(WAYS))]
    choices_table: Table = {}
    penalties_table: Table = {}
    for offset, family in enumerate(args.families.split(",")):
        model_dir = build_tiny_model(family, folder / f"tiny-{family}")
        first_seed = 10_000 * (offset + 1)
        new = [jpeg_data_url(1024, seed=first_seed + i) for i in range(len(WAYS) * args.images)]
        requests = Requests(model_dir.name, pool, [], warm)
        with ExitStack() as stack:  # the server, stopped with its process group on leaving
            base_url = start_serve(f"mmserve {family}", REPO, ["--model", str(model_dir)], folder, stack)
            warm_up(base_url, model_dir.name, requests, warm)
            choices_table[family] = choices(base_url, model_dir.name, new)
            penalties_table[family] = penalties(base_url, requests, args.requests, args.rounds)
    revision = git("rev-parse", "--short", "HEAD").strip()
    print(f"\n{machine()}, revision {revision}, {date.today()}")
    print_tables(choices_table, penalties_table, args)
    draw_chart(args.chart, choices_table, penalties_table, revision)
    print(f"logs: {folder}")


if __name__ == "__main__":
    main()
