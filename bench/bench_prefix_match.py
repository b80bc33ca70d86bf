"""Prefix-cache hits of whole blocks against hits up to the first token that differs (``--prefix-match
block`` and ``token``), side by side: one server each (tiny LLaVA, the defaults otherwise), both up for
the whole run, the same agent load on each in turn.

    python bench/bench_prefix_match.py [--model models/tiny-llava] [--agents 16] [--turns 5] [--rounds 3]

The load is bench/bench_agents.py's: 16 agents at once in a steady state (``run_steady``), conversations
of five streamed turns on ``/v1/responses`` chained by ``previous_response_id``, each turn a new
1024x1024 JPEG screenshot after its question, so the screenshot ends a few tokens before the assistant's
answer. A next turn re-renders that
answer, which differs from the sampled tokens (random weights), so its whole-block hit stops at the
last block boundary before it: where that falls inside the screenshot's placeholders, the screenshot is
encoded again for its last few. Per server and round: turns per second, TTFT p50 by turn, and from
``/metrics`` the encoder runs, the encoder-cache hits, the prompt tokens served from the prefix cache and
the worker's busy seconds, over the whole load (warm-up and cool-down conversations included). Medians
over ``--rounds`` rounds, the servers' order alternating. Draws ``--chart``.
"""

from __future__ import annotations

import statistics
import tempfile
from contextlib import ExitStack
from datetime import date
from pathlib import Path
from typing import Any

from bench_agents import (
    MEASURED,
    agents_arguments,
    run_load,
    run_steady,
    screenshot_source,
    steady_conversations,
)
from bench_input_scale import machine, scrape
from bench_throughput import REPO, Proc, free_port, git, wait_healthy
from charts import Panel, draw

MODES = ("block", "token")
COUNTERS = {  # figure -> the server's counter
    "encoder runs": "mmserve_encoder_runs_total",
    "encoder-cache hits": "mmserve_encoder_cache_hits_total",
    "prefix-cache hits (tokens)": "mmserve_prefix_cache_hits_total",
    "worker busy (s)": "mmserve_worker_busy_seconds_total",
}


def measure(base_url: str, model: str, conversations: list[list[list[str]]]) -> dict[str, Any]:
    before = scrape(base_url)
    result = run_steady(base_url, model, "previous_response_id", conversations)
    after = scrape(base_url)
    counters = {figure: after.get(name, 0.0) - before.get(name, 0.0) for figure, name in COUNTERS.items()}
    return {"turns/s": result["turns/s"], "ttft": result["ttft"], **counters}


def main() -> None:
    args = agents_arguments(__doc__, "prefix_match.png")
    folder = Path(tempfile.mkdtemp(prefix="mmserve-bench-prefix-match-"))
    model = args.model.name
    screenshot = screenshot_source()

    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with ExitStack() as stack:
        urls = {}
        for mode in MODES:
            port = free_port()
            flags = ["serve", "--model", str(args.model), "--port", str(port), "--prefix-match", mode]
            server = Proc(flags, REPO, folder / f"serve-{mode}.log")
            stack.callback(server.stop)
            urls[mode] = f"http://127.0.0.1:{port}"
            wait_healthy(urls[mode], [server])
        for mode in MODES:  # warm-up: every code path once, discarded
            warm_up = [[screenshot() for _ in range(args.turns)] for _ in range(4)]
            run_load(urls[mode], model, "previous_response_id", warm_up)
        for round_index in range(args.rounds):
            for mode in MODES if round_index % 2 == 0 else reversed(MODES):
                conversations = steady_conversations(args.agents, args.turns, MEASURED, screenshot)
                run = measure(urls[mode], model, conversations)  # every screenshot new
                runs[mode].append(run)
                ttft = [round(1e3 * statistics.median(t)) for t in run["ttft"]]
                print(f"round {round_index + 1} {mode}: {run['turns/s']:.2f} turns/s, TTFT ms {ttft}, "
                      f"encoder runs {run['encoder runs']:.0f}")  # fmt: skip
    turns = range(args.turns)
    table = {
        mode: {
            "ttft_ms": [1e3 * statistics.median(x for r in rs for x in r["ttft"][t]) for t in turns],
            **{figure: statistics.median(r[figure] for r in rs) for figure in ("turns/s", *COUNTERS)},
        }
        for mode, rs in runs.items()
    }
    revision = git("rev-parse", "--short", "HEAD").strip()
    num_turns = args.agents * args.turns * (MEASURED + 1)  # a warm-up and a cool-down make one more
    print(f"\n{machine()}, revision {revision}, {date.today()}")
    print(f"\n{args.agents} agents at once in a steady state, conversations of {args.turns} chained turns; "
          f"TTFT p50 of the measured ones; counters over the load ({num_turns} turns, as many new "
          f"screenshots); medians of {args.rounds} rounds:")  # fmt: skip
    print("| --prefix-match | " + " | ".join(f"turn {t + 1} TTFT" for t in turns) + " | turns/s | "
          + " | ".join(COUNTERS) + " |")  # fmt: skip
    print("|---|" + "---|" * (args.turns + 1 + len(COUNTERS)))
    for mode, row in table.items():
        ttft = " | ".join(f"{ms:.0f} ms" for ms in row["ttft_ms"])
        counters = " | ".join(f"{row[figure]:.1f}" for figure in COUNTERS)
        print(f"| {mode} | {ttft} | {row['turns/s']:.2f} | {counters} |")
    token, block = table["token"], table["block"]
    print(f"\ntoken / block: turns/s {token['turns/s'] / block['turns/s']:.2f}x, encoder runs "
          f"{token['encoder runs'] / block['encoder runs']:.2f}x (each turn's own screenshot: {num_turns}), "
          f"worker busy {token['worker busy (s)'] / block['worker busy (s)']:.2f}x")  # fmt: skip
    draw(
        args.chart,
        f"Prefix-cache hits: whole blocks vs up to the first new token ({args.agents} agents, tiny LLaVA)",
        [
            Panel(
                "Encoder runs per load",
                "runs",
                {"encoder runs": {m: table[m]["encoder runs"] for m in MODES}},
            ),
            Panel(
                "Turns per second", "turns/s", {"turns/s": {m: table[m]["turns/s"] for m in MODES}}, "{:.2f}"
            ),
            Panel(
                "TTFT p50 by turn",
                "ms",
                {f"turn {t + 1}": {m: table[m]["ttft_ms"][t] for m in MODES} for t in turns},
            ),
        ],
        f"bench/bench_prefix_match.py · {date.today()} · revision {revision} · {machine()}",
    )
    print(f"\nchart: {args.chart}; logs: {folder}")


if __name__ == "__main__":
    main()
