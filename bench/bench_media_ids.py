"""Media ids on real ``mmserve`` processes (tiny LLaVA): the same eight 1024x1024 JPEGs asked about again
and again, sent every time as data URLs vs named by their ``uuid`` alone, beside text-only requests of
the same prompt length, on one server, in one run.

    python bench/bench_media_ids.py [--model models/tiny-llava] [--requests 400] [--rounds 3]

Each load: ``--requests`` streamed requests of 16 tokens at concurrency 16, keep-alive connections, every
prompt's text numbered (no two equal). Before the loads every image is sent once with its uuid, so
100 % of the image requests hit every cache. Per load (median over ``--rounds`` rounds, the three loads
interleaved within each): requests/s, TTFT p50, CPU time per request of the API (its process and its
preprocessing processes), the engine and the worker (from /proc), and the request body's size. Text-only
prompts start with the same filler (a shared prefix, as each image is for one request in eight). Draws
``--chart``.
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

import httpx
from bench_input_scale import machine
from bench_throughput import REPO, Proc, chat_body, free_port, git, stream_chat, wait_healthy
from charts import Panel, draw
from engine_loads import Result, send
from images import jpeg_data_url

MAX_TOKENS = 16
CONCURRENCY = 16
NUM_IMAGES = 8
LOADS = ("media every time", "uuid only", "text only")
TICKS_PER_S = 100  # os.sysconf("SC_CLK_TCK") on Linux


def cpu_by_role(pid: int) -> dict[str, float]:
    """User + system CPU seconds of ``serve``'s processes by role: ``api`` (the ``serve`` process, which
    is API process 0, and its preprocessing processes), ``engine`` and ``worker``."""
    roles = {"api": _cpu_s(pid), "engine": 0.0, "worker": 0.0}
    for child in Path("/proc").glob("[0-9]*"):
        try:
            title = (child / "cmdline").read_bytes().split(b"\0")[0].decode()
            if not title.startswith("mmserve: ") or not _descends(child, pid):
                continue
            role = {"preprocess": "api"}.get(title.removeprefix("mmserve: "), title.removeprefix("mmserve: "))
            if role in roles:
                roles[role] += _cpu_s(int(child.name))
        except (OSError, ValueError):
            continue
    return roles


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def _descends(proc: Path, ancestor: int) -> bool:
    while True:
        parent = int((proc / "stat").read_text().rpartition(")")[2].split()[1])
        if parent == ancestor:
            return True
        if parent <= 1:
            return False
        proc = Path(f"/proc/{parent}")


class Bodies:
    """The three loads' request bodies, numbered through the whole run."""

    def __init__(self, model: str, images: list[str], filler_words: int) -> None:
        self.model, self.images, self.filler = model, images, " a" * filler_words
        self.serial = 0

    def body(self, load: str, i: int) -> bytes:
        self.serial += 1
        text = f"Request {self.serial}: what does this picture show?"
        uuid = f"image-{i % NUM_IMAGES}"
        if load == "text only":  # the filler first, shared by every prompt, as an image is by 1 in 8
            return json.dumps(chat_body(self.model, self.filler + text, None, MAX_TOKENS)).encode()
        body = chat_body(self.model, text, self.images[i % NUM_IMAGES], MAX_TOKENS)
        part = body["messages"][0]["content"][0]  # type: ignore[index]
        part["uuid"] = uuid
        if load == "uuid only":
            part["image_url"] = None
        return json.dumps(body).encode()


def prompt_tokens(base_url: str, body: dict[str, object]) -> int:
    async def one() -> int:
        async with httpx.AsyncClient(timeout=120.0) as client:
            _, usage = await stream_chat(client, f"{base_url}/v1/chat/completions", body)
            return int(usage["prompt_tokens"])

    return asyncio.run(one())


def filler_for(base_url: str, model: str, image: str) -> int:
    """Filler words (`` a`` each) that give a text-only prompt the image prompt's length."""
    text = "Request 1: what does this picture show?"
    with_image = prompt_tokens(base_url, chat_body(model, text, image, MAX_TOKENS))
    base = prompt_tokens(base_url, chat_body(model, text, None, MAX_TOKENS))
    per_word = prompt_tokens(base_url, chat_body(model, " a" * 100 + text, None, MAX_TOKENS)) - base
    return round((with_image - base) * 100 / per_word)


def run_load(base_url: str, pid: int, bodies: list[bytes]) -> dict[str, float]:
    before = cpu_by_role(pid)
    wall_s, answers = asyncio.run(send(base_url, iter((b, False) for b in bodies), CONCURRENCY, 600.0))
    after = cpu_by_role(pid)
    result = Result(wall_s, answers, MAX_TOKENS)
    if result.failures() != "0":
        raise RuntimeError(f"failed requests: {result.failures()}")
    cpu_ms = {role: 1e3 * (after[role] - before[role]) / len(bodies) for role in after}
    return {
        "req/s": result.req_per_s,
        "TTFT p50 ms": result.ttft_ms(50) or 0.0,
        "API CPU ms/req": cpu_ms["api"],
        "engine CPU ms/req": cpu_ms["engine"],
        "worker CPU ms/req": cpu_ms["worker"],
        "request KB": statistics.mean(len(b) for b in bodies) / 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=REPO / "models/tiny-llava")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chart", type=Path, default=REPO / "docs/img/media_ids.png")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="mmserve-bench-media-ids-"))
    model = args.model.name
    images = [jpeg_data_url(1024, seed=i) for i in range(NUM_IMAGES)]
    runs: dict[str, list[dict[str, float]]] = {load: [] for load in LOADS}
    with ExitStack() as stack:
        port = free_port()
        server = Proc(["serve", "--model", str(args.model), "--port", str(port)], REPO, folder / "serve.log")
        stack.callback(server.stop)
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, [server])
        bodies = Bodies(model, images, filler_for(base_url, model, images[0]))
        warm_up = [bodies.body("media every time", i) for i in range(NUM_IMAGES)]
        warm_up += [bodies.body(load, i) for load in LOADS for i in range(2 * CONCURRENCY)]
        run_load(base_url, server.popen.pid, warm_up)
        for round_index in range(args.rounds):
            for load in LOADS:
                figures = run_load(
                    base_url, server.popen.pid, [bodies.body(load, i) for i in range(args.requests)]
                )
                runs[load].append(figures)
                print(f"round {round_index + 1} {load}: {figures}", flush=True)
    table = {load: {k: statistics.median(r[k] for r in runs[load]) for k in runs[load][0]} for load in LOADS}
    revision = git("rev-parse", "--short", "HEAD").strip()
    print(f"\n{machine()}, revision {revision}, {date.today()}")
    print(f"\n{args.requests} requests per load, concurrency {CONCURRENCY}, {MAX_TOKENS} tokens, median of "
          f"{args.rounds} rounds:")  # fmt: skip
    print("| load | req/s | TTFT p50 | CPU per request: API / engine / worker | request body |")
    print("|---|---|---|---|---|")
    for load, row in table.items():
        cpu = " / ".join(f"{row[f'{role} CPU ms/req']:.2f}" for role in ("API", "engine", "worker"))
        print(
            f"| {load} | {row['req/s']:.1f} | {row['TTFT p50 ms']:.0f} ms | {cpu} ms "
            f"| {row['request KB']:.1f} KB |"
        )
    media, uuid, text = (table[load] for load in LOADS)
    print(f"\nuuid only / media every time, req/s: {uuid['req/s'] / media['req/s']:.2f}x (target >= 1.3x)")
    gap = uuid["API CPU ms/req"] - text["API CPU ms/req"]
    print(f"API CPU per request, uuid only - text only: {gap:+.2f} ms (target within 0.3 ms)")
    draw(
        args.chart,
        "Media ids: eight 1024x1024 JPEGs at 100 % reuse, tiny LLaVA",
        [
            Panel(
                "Requests/s (concurrency 16)", "req/s", {k: {"req/s": v["req/s"]} for k, v in table.items()}
            ),
            Panel(
                "API CPU per request",
                "ms",
                {k: {"ms": v["API CPU ms/req"]} for k, v in table.items()},
                fmt="{:.2f}",
            ),  # fmt: skip
            Panel("TTFT p50", "ms", {k: {"ms": v["TTFT p50 ms"]} for k, v in table.items()}),
        ],
        f"bench/bench_media_ids.py · {date.today()} · revision {revision} · {machine()}",
    )
    print(f"\nchart: {args.chart}; logs: {folder}")


if __name__ == "__main__":
    main()
