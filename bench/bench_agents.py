"""An agent loop on ``/v1/responses`` (tiny LLaVA, real ``mmserve`` processes): 16 agents at once, each
conversation five turns, each turn a new 1024x1024 JPEG screenshot and a question, as a computer-use
agent sends them. Two ways to send the history, side by side in one run on one server, beside a control:

- **full history**: every turn resends the whole conversation (earlier screenshots and answers), with
  ``store`` false, as a client of a server without stored responses must;
- **previous_response_id**: every turn sends only its new screenshot and question, chained on the
  previous turn's stored response;
- **no history** (the control): every turn sends its new screenshot and question as a new
  conversation: the same arrivals and new work, without the history.

    python bench/bench_agents.py [--model models/tiny-llava] [--agents 16] [--turns 5] [--rounds 3]

The agents run in a steady state (``run_steady``): they start 0.1 s apart, and each runs a warm-up
conversation of its own length, ``MEASURED`` measured conversations and a cool-down, so that every turn
runs beside the same mix of short and long contexts. Per turn (median over the measured conversations
and rounds): the request body's size and TTFT (the first ``response.output_text.delta`` event of the
stream); per load: turns per second. Then the same loop for one agent alone, ``NUM_ALONE`` agents one
after another: TTFT by turn without queueing, the history's own cost. Every turn's screenshot is new to
the server, so each turn runs the processor and the encoder for one image, and the history's images are
what the caches (and the store) hold. The loads' order turns round each round. Draws ``--chart``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from datetime import date
from pathlib import Path
from typing import Any

import httpx
from bench_input_scale import machine
from bench_throughput import REPO, Proc, free_port, git, wait_healthy
from charts import Panel, draw
from images import jpeg_data_url

MAX_TOKENS = 16
STAGGER_S = 0.1  # about a turn's length (1.6 s here) over 16 agents
NUM_ALONE = 4  # agents run one after another, per load and round: the history's cost without queueing
# a control for loads of agents: each turn its new input alone, as a new conversation (the same arrivals
# and new work, no history), so that what the history costs under load reads apart from queueing
NO_HISTORY = "no history"
LOADS = ("full history", "previous_response_id")
MEASURED = 2  # conversations of each agent at once, between its warm-up and its cool-down


def user_turn(screenshot: str, turn: int) -> dict[str, Any]:
    text = f"Step {turn + 1}: what should I click next?"
    content = [{"type": "input_text", "text": text}, {"type": "input_image", "image_url": screenshot}]
    return {"role": "user", "content": content}


async def stream_turn(client: httpx.AsyncClient, url: str, body: bytes) -> tuple[float, dict[str, Any]]:
    """(TTFT in seconds, the finished response object) of one streamed turn."""
    start = time.perf_counter()
    ttft_s: float | None = None
    async with client.stream("POST", url, content=body, headers={"Content-Type": "application/json"}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"turn failed: {resp.status_code} {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "response.output_text.delta" and ttft_s is None:
                ttft_s = time.perf_counter() - start
            elif event["type"] in ("response.completed", "response.incomplete"):
                return ttft_s if ttft_s is not None else time.perf_counter() - start, event["response"]
            elif event["type"] == "error":
                raise RuntimeError(f"turn failed: {event}")
    raise RuntimeError("the stream ended without a response")


def turn_body(
    model: str, load: str, history: list[dict[str, Any]], previous: str | None, new: dict[str, Any]
) -> bytes:
    """A turn's request: the whole history and the new input, the new input on the previous response, or
    (``NO_HISTORY``) the new input alone."""
    fields: dict[str, Any] = {
        "model": model,
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    if load == "full history":
        fields |= {"input": [*history, new], "store": False}
    elif load == NO_HISTORY:
        fields |= {"input": [new], "store": False}
    else:
        fields |= {"input": [new], **({"previous_response_id": previous} if previous else {})}
    return json.dumps(fields).encode()


STAGES = {  # where a turn's time goes, from the server's histograms
    "processor": "mmserve_mm_processor_seconds_sum",
    "encoder": "mmserve_encoder_seconds_sum",
    "LM steps": "mmserve_forward_seconds_sum",  # its prefill and its decode steps
}


def scrape(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {stage: float(values.get(name, 0.0)) for stage, name in STAGES.items()}


def agent_alone(base_url: str, model: str, load: str, screenshots: list[str]) -> list[dict[str, float]]:
    """One agent with the server to itself: each turn's TTFT, cached prompt tokens and seconds per stage."""

    async def turns() -> list[dict[str, float]]:
        history: list[dict[str, Any]] = []
        previous: str | None = None
        figures = []
        async with httpx.AsyncClient(timeout=600.0) as client:
            for turn, screenshot in enumerate(screenshots):
                new = user_turn(screenshot, turn)
                before = scrape(base_url)
                ttft_s, response = await stream_turn(
                    client, f"{base_url}/v1/responses", turn_body(model, load, history, previous, new)
                )
                after = scrape(base_url)
                figures.append(
                    {
                        "TTFT": ttft_s,
                        "cached tokens": response["usage"]["input_tokens_details"]["cached_tokens"],
                        "prompt tokens": response["usage"]["input_tokens"],
                        **{stage: after[stage] - before[stage] for stage in STAGES},
                    }
                )
                history += [new, *response["output"]]
                previous = response["id"]
        return figures

    return asyncio.run(turns())


async def agent(
    client: httpx.AsyncClient, url: str, model: str, load: str, screenshots: list[str], delay_s: float
) -> list[tuple[int, float]]:
    """One agent's turns, the first after ``delay_s``: (request bytes, TTFT s) for each."""
    await asyncio.sleep(delay_s)
    return await conversation(client, url, model, load, screenshots)


async def conversation(
    client: httpx.AsyncClient, url: str, model: str, load: str, screenshots: list[str]
) -> list[tuple[int, float]]:
    """One conversation's turns, a screenshot each: (request bytes, TTFT s) for each."""
    history: list[dict[str, Any]] = []
    previous: str | None = None
    figures = []
    for turn, screenshot in enumerate(screenshots):
        new = user_turn(screenshot, turn)
        body = turn_body(model, load, history, previous, new)
        ttft_s, response = await stream_turn(client, url, body)
        figures.append((len(body), ttft_s))
        history += [new, *response["output"]]
        previous = response["id"]
    return figures


def run_load(
    base_url: str, model: str, load: str, screenshots: list[list[str]], stagger_s: float = STAGGER_S
) -> dict[str, Any]:
    """Every agent at once, agent i starting ``i * stagger_s`` after the first (agents in lockstep would
    all encode at once on turn 1 and never again)."""

    async def all_agents() -> tuple[float, list[list[tuple[int, float]]]]:
        limits = httpx.Limits(max_connections=len(screenshots))
        async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
            url = f"{base_url}/v1/responses"
            start = time.perf_counter()
            runs = await asyncio.gather(
                *(
                    agent(client, url, model, load, shots, i * stagger_s)
                    for i, shots in enumerate(screenshots)
                )
            )
            return time.perf_counter() - start, runs

    wall_s, runs = asyncio.run(all_agents())
    num_turns = len(screenshots[0])
    return {
        "turns/s": len(screenshots) * num_turns / wall_s,
        "bytes": [statistics.median(run[t][0] for run in runs) for t in range(num_turns)],
        "ttft": [[run[t][1] for run in runs] for t in range(num_turns)],
    }


def run_steady(
    base_url: str, model: str, load: str, conversations: list[list[list[str]]], stagger_s: float = STAGGER_S
) -> dict[str, Any]:
    """Agents at once in a steady state: agent i runs ``conversations[i]`` one after another, starting
    ``i * stagger_s`` after the first. Its first and last conversations are a warm-up and a cool-down
    of complementary lengths (``steady_conversations``), so that the agents are at every turn in even
    shares through the conversations between, which are measured: turn 1 runs beside as many long
    contexts as turn 5 does, where agents that all start together run their first turns on an emptier
    server (and those that end together, their last). Figures as ``run_load``'s."""

    async def all_agents() -> tuple[float, list[list[list[tuple[int, float]]]]]:
        limits = httpx.Limits(max_connections=len(conversations))
        async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
            url = f"{base_url}/v1/responses"

            async def one_agent(index: int) -> list[list[tuple[int, float]]]:
                await asyncio.sleep(index * stagger_s)
                return [await conversation(client, url, model, load, shots) for shots in conversations[index]]

            start = time.perf_counter()
            runs = await asyncio.gather(*(one_agent(i) for i in range(len(conversations))))
            return time.perf_counter() - start, runs

    wall_s, runs = asyncio.run(all_agents())
    measured = [figures for agent_runs in runs for figures in agent_runs[1:-1]]
    num_turns = len(measured[0])
    return {
        "turns/s": sum(len(c) for agent_convs in conversations for c in agent_convs) / wall_s,
        "bytes": [statistics.median(run[t][0] for run in measured) for t in range(num_turns)],
        "ttft": [[run[t][1] for run in measured] for t in range(num_turns)],
    }


def steady_conversations(
    num_agents: int, num_turns: int, num_measured: int, screenshot: Callable[[], str]
) -> list[list[list[str]]]:
    """Each agent's screenshots for ``run_steady``: agent i's warm-up conversation of ``num_turns - i %
    num_turns`` turns (its phase), ``num_measured`` of ``num_turns``, and a cool-down of ``i % num_turns``
    (maybe none): every agent runs as many turns."""
    return [
        [[screenshot() for _ in range(num_turns - i % num_turns)]]
        + [[screenshot() for _ in range(num_turns)] for _ in range(num_measured)]
        + [[screenshot() for _ in range(i % num_turns)]]
        for i in range(num_agents)
    ]


def agents_arguments(doc: str | None, chart: str) -> argparse.Namespace:
    """The command line of a benchmark of agents at once: ``--model``, ``--agents``, ``--turns``,
    ``--rounds`` and ``--chart`` (default ``docs/img/<chart>``)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "models/tiny-llava")
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chart", type=Path, default=REPO / "docs/img" / chart)
    return parser.parse_args()


def screenshot_source(image_px: int = 1024, first_seed: int = 0) -> Callable[[], str]:
    """Each call a new image_px x image_px JPEG data URL (seeds from ``first_seed`` on)."""
    seeds = itertools.count(first_seed)
    return lambda: jpeg_data_url(image_px, next(seeds))


def main() -> None:
    args = agents_arguments(__doc__, "agents.png")
    folder = Path(tempfile.mkdtemp(prefix="mmserve-bench-agents-"))
    model = args.model.name
    screenshot = screenshot_source()

    def screenshots() -> list[list[str]]:
        return [[screenshot() for _ in range(args.turns)] for _ in range(args.agents)]

    at_once = (*LOADS, NO_HISTORY)
    results: dict[str, list[dict[str, Any]]] = {load: [] for load in at_once}
    alone: dict[str, list[list[dict[str, float]]]] = {load: [[] for _ in range(args.turns)] for load in LOADS}
    with ExitStack() as stack:
        port = free_port()
        server = Proc(["serve", "--model", str(args.model), "--port", str(port)], REPO, folder / "serve.log")
        stack.callback(server.stop)
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, [server])
        for load in at_once:  # warm-up: every code path once, discarded
            run_load(base_url, model, load, screenshots()[:4])
        for round_index in range(args.rounds):
            for load in at_once if round_index % 2 == 0 else reversed(at_once):
                conversations = steady_conversations(args.agents, args.turns, MEASURED, screenshot)
                result = run_steady(base_url, model, load, conversations)
                results[load].append(result)
                ttft = [round(1e3 * statistics.median(t)) for t in result["ttft"]]
                print(f"round {round_index + 1} {load}: {result['turns/s']:.2f} turns/s, TTFT ms {ttft}")
                if load == NO_HISTORY:
                    continue
                for shots in screenshots()[:NUM_ALONE]:
                    for turn, figures in enumerate(agent_alone(base_url, model, load, shots)):
                        alone[load][turn].append(figures)
    turns = range(args.turns)
    table = {
        load: {
            "turns/s": statistics.median(r["turns/s"] for r in runs),
            "bytes": [statistics.median(r["bytes"][t] for r in runs) for t in turns],
            "ttft_ms": [1e3 * statistics.median(x for r in runs for x in r["ttft"][t]) for t in turns],
        }
        for load, runs in results.items()
    }
    revision = git("rev-parse", "--short", "HEAD").strip()
    print(f"\n{machine()}, revision {revision}, {date.today()}")
    print(f"\n{args.agents} agents at once in a steady state, {args.turns} turns a conversation, "
          f"{MAX_TOKENS} tokens a turn, median over {MEASURED} conversations an agent and {args.rounds} "
          "rounds:")  # fmt: skip
    print("| history sent as | " + " | ".join(f"turn {t + 1}" for t in turns) + " | turns/s |")
    print("|---|" + "---|" * (args.turns + 1))
    for load, row in table.items():
        cells = " | ".join(
            f"{kb / 1e3:.1f} KB, {ms:.0f} ms" for kb, ms in zip(row["bytes"], row["ttft_ms"], strict=True)
        )
        print(f"| {load} | {cells} | {row['turns/s']:.2f} |")
    alone_ms = {load: [1e3 * statistics.median(f["TTFT"] for f in t) for t in alone[load]] for load in LOADS}
    print(f"\nOne agent alone (median of {NUM_ALONE * args.rounds}), TTFT by turn:")
    for load in LOADS:
        print(f"| {load} | " + " | ".join(f"{ms:.0f} ms" for ms in alone_ms[load]) + " |")
    print("\nOne agent alone, previous_response_id, by turn (medians):")
    print("| turn | prompt tokens | cached | " + " | ".join(f"{stage} ms" for stage in STAGES) + " |")
    print("|---|---|---|" + "---|" * len(STAGES))
    for t in turns:
        rows = alone["previous_response_id"][t]
        med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        stages = " | ".join(f"{1e3 * med[stage]:.0f}" for stage in STAGES)
        print(f"| {t + 1} | {med['prompt tokens']:.0f} | {med['cached tokens']:.0f} | {stages} |")
    chained, full = table["previous_response_id"], table["full history"]
    last = args.turns - 1
    ttft_ratio = chained["ttft_ms"][last] / chained["ttft_ms"][0]
    bytes_ratio = chained["bytes"][last] / chained["bytes"][0]
    print(f"\nprevious_response_id, turn {args.turns} / turn 1: TTFT {ttft_ratio:.2f}x (target <= 1.2x), "
          f"request bytes {bytes_ratio:.2f}x (target: flat)")  # fmt: skip
    full_ttft, full_bytes = full["ttft_ms"][last] / full["ttft_ms"][0], full["bytes"][last] / full["bytes"][0]
    print(f"full history, turn {args.turns} / turn 1: TTFT {full_ttft:.2f}x, request bytes {full_bytes:.2f}x")
    print(f"turns/s, previous_response_id / full history: {chained['turns/s'] / full['turns/s']:.2f}x")
    control = table[NO_HISTORY]
    over = ", ".join(f"{a / b:.2f}x" for a, b in zip(chained["ttft_ms"], control["ttft_ms"], strict=True))
    print(f"previous_response_id over no history: TTFT by turn {over}; "
          f"turns/s {chained['turns/s'] / control['turns/s']:.2f}x")  # fmt: skip
    solo = alone_ms["previous_response_id"]
    print(
        f"one agent alone, previous_response_id, turn {args.turns} / turn 1: TTFT {solo[last] / solo[0]:.2f}x"
    )
    draw(
        args.chart,
        f"Agent loops on /v1/responses: {args.agents} agents, a new 1024x1024 screenshot a turn, tiny LLaVA",
        [
            Panel(
                "TTFT p50 by turn",
                "ms",
                {f"turn {t + 1}": {load: table[load]["ttft_ms"][t] for load in at_once} for t in turns},
            ),
            Panel(
                "Request body by turn",
                "KB",
                {f"turn {t + 1}": {load: table[load]["bytes"][t] / 1e3 for load in LOADS} for t in turns},
            ),
            Panel(
                "Turns per second",
                "turns/s",
                {load: {"turns/s": table[load]["turns/s"]} for load in at_once},
                fmt="{:.2f}",
            ),  # fmt: skip
        ],
        f"bench/bench_agents.py · {date.today()} · revision {revision} · {machine()}",
    )
    print(f"\nchart: {args.chart}; logs: {folder}")


if __name__ == "__main__":
    main()
