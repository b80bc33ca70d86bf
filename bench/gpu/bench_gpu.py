"""mmserve on a GPU at realistic size, beside the card's roofline.

    python bench/gpu/bench_gpu.py --model DIR --out DIR [--dry]

``DIR`` is a checkpoint from bench/gpu/checkpoint.py (Qwen2.5-VL-7B-shaped, random weights). One
``mmserve serve --device cuda`` (bf16) answers, streamed, with EOS ignored:

- **images**: 1024x1024 JPEGs at concurrency 64, 128 output tokens, every image new (0 % reuse) and then
  90 % reuse (one request in ten brings a new image, the rest draw from 8 sent before): requests/s, TTFT
  p50, output tokens/s, and encoder ms per image (the worker's encoder time over its encoder runs);
- **agent loop**: one agent alone, five turns on ``/v1/responses`` chained by ``previous_response_id``,
  each a new image (bench/bench_agents.py's loop): TTFT per turn, turn 5's over turn 1's (the history's
  cost; docs/benchmarks.md, "Agent loops"); then 16 agents at once in a steady state
  (bench/bench_agents.py's ``run_steady``: agents 0.1 s apart, each a warm-up conversation of its own
  length, two measured ones and a cool-down, so every turn runs beside the same mix of contexts): TTFT
  p50 per turn, turn 5's over turn 1's under load; and the same load with no history (each turn its new
  input alone), whose TTFT is what the arrivals alone give: the chained load's over it is what the
  history costs every turn under load;
- **decode**: 1, 16 and 64 text requests at once (~280-token prompts, 128 tokens), their prompts sent
  once before (one output token) so that they come from the prefix cache: time per output token (client
  p50) and the worker's mean forward time per step.

Each figure has its roofline beside it (docs/benchmarks.md, "The GPU path"): a decode step cannot beat
(weights it reads + the batch's KV bytes) / HBM bandwidth; an encoder or prefill step cannot beat its
FLOPs / the card's bf16 rate. ``--dry`` runs the same on the CPU at toy sizes (bench/gpu/run.sh --dry).
``--loads`` picks among ``images``, ``decode``, ``agent`` (alone) and ``agents`` (at once). Writes
``gpu_bench.json`` and ``serve.log`` into ``--out``; prints a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from bench_agents import (  # noqa: E402
    NO_HISTORY,
    agent_alone,
    run_steady,
    screenshot_source,
    steady_conversations,
)
from bench_input_scale import scrape  # noqa: E402
from bench_throughput import Proc, chat_body, free_port, wait_healthy  # noqa: E402
from charts import Panel, draw  # noqa: E402
from engine_loads import Answer, Result, send  # noqa: E402
from images import jpeg_data_url  # noqa: E402

HBM_BYTES_PER_S = 3.35e12  # H100 SXM's datasheet (an H200: 4.8e12)
BF16_FLOPS = 800e12  # an 8192^3 bf16 matmul here: 769-798 TFLOP/s on the H100 and H200
POOL = 8
AGENT_TURNS, NUM_AGENTS = 5, 3
LOADS = ("images", "decode", "agent", "agents")
AGENT_COUNTERS = (
    "encoder_runs_total",
    "encoder_cache_hits_total",
    "worker_busy_seconds_total",
    "prompt_tokens_total",
    "prefix_cache_hits_total",
    # a first token's wait, summed over the load's requests: all of it (the API's), the engine's queue,
    # the prefill
    "time_to_first_token_seconds_sum",
    "request_queue_time_seconds_sum",
    "request_prefill_time_seconds_sum",
)


@dataclass(frozen=True)
class Sizes:
    concurrency: int
    num_requests: int
    max_tokens: int
    image_px: int
    decode_batches: tuple[int, ...]
    prompt_words: int
    agents: int  # at once, in the agent load
    agent_conversations: int  # each agent's measured conversations, at once


FULL = Sizes(64, 128, 128, 1024, (1, 16, 64), 240, 16, 2)
DRY = Sizes(3, 6, 8, 448, (1, 3), 40, 3, 1)


def measure_images(base_url: str, model: str, sizes: Sizes, figures: dict[str, Any]) -> None:
    """One image's probe, the pool's images sent once, then the loads at 0 % and 90 % reuse."""
    image = probe(base_url, image_bodies(model, sizes, reuse=False, seed=99)[0][0])
    # Qwen2.5-VL's resize: each side to the nearest multiple of 28 px, one token per 28x28
    image["image_tokens"] = round(sizes.image_px / 28) ** 2
    figures["image_probe"] = image
    pool = [
        (json.dumps(chat_body(model, "Describe it.", jpeg_data_url(sizes.image_px, s), 8)).encode(), True)
        for s in range(POOL)
    ]
    asyncio.run(send(base_url, iter(pool), len(pool), duration_s=3600))
    for key, reuse, seed in (("image_0pct", False, 1), ("image_90pct", True, 2)):
        figures[key] = run(
            base_url, image_bodies(model, sizes, reuse, seed), sizes.concurrency, sizes.max_tokens
        )
        print(key, json.dumps(figures[key]), flush=True)


def image_bodies(model: str, sizes: Sizes, reuse: bool, seed: int) -> list[tuple[bytes, bool]]:
    """(body, new image?) for each request: every image new, or one in ten new and the rest from POOL."""
    rng = random.Random(seed)
    bodies = []
    for i in range(sizes.num_requests):
        new = not reuse or i % 10 == 5
        image_seed = seed * 1000 + i if new else rng.randrange(POOL)
        url = jpeg_data_url(sizes.image_px, image_seed)
        text = f"Request {seed}-{i}: what does this picture show?"
        bodies.append((json.dumps(chat_body(model, text, url, sizes.max_tokens)).encode(), new))
    return bodies


def text_bodies(model: str, sizes: Sizes, batch: int) -> list[tuple[bytes, bool]]:
    """``batch`` different ~``prompt_words``-word prompts (no two share a prefix block)."""
    rng = random.Random(batch)
    words = [
        "red",
        "green",
        "blue",
        "cat",
        "dog",
        "tree",
        "house",
        "river",
        "cloud",
        "sun",
        "window",
        "door",
        "chair",
        "table",
        "book",
    ]
    bodies = []
    for i in range(batch):
        text = f"{i} " + " ".join(rng.choice(words) for _ in range(sizes.prompt_words))
        bodies.append((json.dumps(chat_body(model, text, None, sizes.max_tokens)).encode(), False))
    return bodies


def run(base_url: str, bodies: list[tuple[bytes, bool]], concurrency: int, max_tokens: int) -> dict[str, Any]:
    """Sends ``bodies`` with ``concurrency`` in flight; the load's figures and the /metrics deltas."""
    before = scrape(base_url)
    wall_s, answers = asyncio.run(send(base_url, iter(bodies), concurrency, duration_s=3600))
    after = scrape(base_url)
    result = Result(wall_s, answers, max_tokens)

    def diff(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    encoder_runs = diff("mmserve_encoder_runs_total")
    steps = diff("mmserve_forward_seconds_count")
    tpots = [a.tpot_s for a in result.ok if a.tpot_s is not None]
    return {
        **result.to_json(),
        "tpot_ms_p50": 1e3 * statistics.median(tpots) if tpots else None,
        "encoder_runs": encoder_runs,
        "encoder_ms_per_image": 1e3 * diff("mmserve_encoder_seconds_sum") / encoder_runs
        if encoder_runs
        else None,
        "forward_steps": steps,
        "forward_ms_per_step": 1e3 * diff("mmserve_forward_seconds_sum") / steps if steps else None,
        "prompt_tokens": diff("mmserve_prompt_tokens_total") / max(len(result.ok), 1),
    }


def probe(base_url: str, body: bytes) -> dict[str, Any]:
    """One request alone: its usage (prompt tokens) and the encoder runs it caused."""
    before = scrape(base_url)
    _, answers = asyncio.run(send(base_url, iter([(body, True)]), 1, duration_s=3600))
    after = scrape(base_url)
    answer: Answer = answers[0]
    assert answer.error is None, answer.error
    return {
        "prompt_tokens": after["mmserve_prompt_tokens_total"] - before.get("mmserve_prompt_tokens_total", 0),
        "ttft_ms": 1e3 * (answer.ttft_s or 0.0),
    }


def agent_turns(base_url: str, model: str, sizes: Sizes) -> dict[str, Any]:
    """TTFT per turn of ``NUM_AGENTS`` agents alone, one after another (the median per turn), each turn a
    new image, and turn 5's over turn 1's."""
    runs = [
        agent_alone(
            base_url,
            model,
            "previous_response_id",
            [jpeg_data_url(sizes.image_px, 5000 + 10 * agent + turn) for turn in range(AGENT_TURNS)],
        )
        for agent in range(NUM_AGENTS)
    ]
    ttft_ms = [1e3 * statistics.median(run[turn]["TTFT"] for run in runs) for turn in range(AGENT_TURNS)]
    return {
        "ttft_ms": ttft_ms,
        "prompt_tokens": [runs[0][turn]["prompt tokens"] for turn in range(AGENT_TURNS)],
        "cached_tokens": [runs[0][turn]["cached tokens"] for turn in range(AGENT_TURNS)],
        "last_over_first": ttft_ms[-1] / ttft_ms[0],
    }


def agents_at_once(base_url: str, model: str, sizes: Sizes) -> dict[str, Any]:
    """``sizes.agents`` agents at once in a steady state (``run_steady``), chained by
    ``previous_response_id``, every turn a new image, beside the same load with no history (each turn
    its new input alone), whose TTFT is what the arrivals alone give: the chained load's TTFT over it,
    turn by turn, is the history's cost under load. The control runs first (the server's first long
    contexts then fall in the chained load's warm-up conversations). TTFT p50 per turn over the measured
    conversations, turns/s over the whole load, and each load's server counters."""
    loads = (("no_history_", NO_HISTORY), ("", "previous_response_id"))
    figures: dict[str, Any] = {"agents": sizes.agents, "conversations": sizes.agent_conversations}
    for index, (key, load) in enumerate(loads):
        screenshot = screenshot_source(sizes.image_px, 7000 + 100_000 * index)  # every image new
        conversations = steady_conversations(sizes.agents, AGENT_TURNS, sizes.agent_conversations, screenshot)
        before = scrape(base_url)
        result = run_steady(base_url, model, load, conversations)
        after = scrape(base_url)
        figures[f"{key}ttft_ms_p50"] = [1e3 * statistics.median(turn) for turn in result["ttft"]]
        figures[f"{key}turns_per_s"] = result["turns/s"]
        # where the load's time went: encoder runs (a history image is encoded again when a chunk covers
        # its last tokens and the encoder cache no longer holds it), the worker's busy time
        figures[f"{key}server"] = {
            name: after.get(f"mmserve_{name}", 0.0) - before.get(f"mmserve_{name}", 0.0)
            for name in AGENT_COUNTERS
        }
        print(f"agents_at_once {load}", json.dumps(result["ttft"]), flush=True)
    figures["last_over_first"] = figures["ttft_ms_p50"][-1] / figures["ttft_ms_p50"][0]
    figures["history_over_none"] = [
        a / b for a, b in zip(figures["ttft_ms_p50"], figures["no_history_ttft_ms_p50"], strict=True)
    ]
    return figures


def rooflines(
    checkpoint: dict[str, Any], config: dict[str, Any], figures: dict[str, Any], hbm: float, flops: float
) -> dict[str, Any]:
    """Each figure's floor on this card (see the module docstring)."""
    text, vision = config["text_config"], config["vision_config"]
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    kv_bytes_per_token = 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * head_dim * 2
    weights = checkpoint["decode_weight_bytes"]
    out: dict[str, Any] = {"kv_bytes_per_token": kv_bytes_per_token, "decode_weight_bytes": weights}
    for key, fig in figures.items():
        if key.startswith("decode_"):
            batch = int(key.removeprefix("decode_"))
            context = fig["prompt_tokens"] + fig["max_tokens"] / 2  # mid-generation
            step_s = (weights + batch * context * kv_bytes_per_token) / hbm
            out[key] = {"step_ms": 1e3 * step_s, "tpot_ms": 1e3 * step_s}
    image = figures.get("image_probe")
    if image is not None:
        prompt = image["prompt_tokens"]
        num_image_tokens = image["image_tokens"]
        patches = num_image_tokens * vision.get("spatial_merge_size", 2) ** 2
        encoder_flops = 2 * checkpoint["vision_params"] * patches
        # the LM over the prompt: 2 x params x tokens for the matmuls, 2 x 2 x layers x T^2 / 2 x d for
        # causal attention's two products
        attention = 2 * text["num_hidden_layers"] * prompt * prompt * text["hidden_size"]
        prefill_flops = 2 * checkpoint["decode_params"] * prompt + attention
        decode_share = figures.get("decode_64") and out.get("decode_64")
        decode_s = FULL.max_tokens * out["decode_64"]["step_ms"] / 1e3 / 64 if decode_share else 0.0
        per_request_s = (encoder_flops + prefill_flops) / flops + decode_s
        out["image"] = {
            "encoder_ms_per_image": 1e3 * encoder_flops / flops,
            "prefill_ms": 1e3 * prefill_flops / flops,
            "ttft_ms_alone": 1e3 * (encoder_flops + prefill_flops) / flops,
            "req_per_s_0pct_reuse": 1 / per_request_s if per_request_s else None,
            "output_tok_per_s_0pct_reuse": FULL.max_tokens / per_request_s if per_request_s else None,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dry", action="store_true", help="toy loads on the CPU (the kit's dry run)")
    parser.add_argument("--hbm-bytes-per-s", type=float, default=HBM_BYTES_PER_S)
    parser.add_argument("--flops", type=float, default=BF16_FLOPS)
    parser.add_argument("--preprocess-processes", type=int, default=8)
    parser.add_argument("--chart", type=Path, help="also draw the figures beside their rooflines (PNG)")
    parser.add_argument("--chart-from", type=Path, help="only draw --chart from a gpu_bench.json")
    parser.add_argument("--card", default="", help="the card's name, for the chart's title")
    parser.add_argument("--loads", default=",".join(LOADS), help=f"comma-separated, of {','.join(LOADS)}")
    args = parser.parse_args()
    loads = set(args.loads.split(","))
    if not loads <= set(LOADS):
        parser.error(f"--loads: unknown {sorted(loads - set(LOADS))}")
    if args.chart_from is not None:
        draw_chart(json.loads(args.chart_from.read_text()), args.chart, args.card)
        return
    sizes = DRY if args.dry else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model.name
    checkpoint = json.loads((args.model / "bench_checkpoint.json").read_text())
    config = json.loads((args.model / "config.json").read_text())
    port = free_port()
    flags = [
        "serve", "--model", str(args.model), "--port", str(port), "--device", args.device,
        "--max-model-len", "8192", "--max-num-seqs", "64",
        "--mm-preprocess-processes", str(1 if args.dry else args.preprocess_processes),
    ]  # fmt: skip
    if args.dry:
        flags += ["--kv-cache-tokens", "16384"]
    proc = Proc(flags, REPO, args.out / "serve.log")
    base_url = f"http://127.0.0.1:{port}"
    figures: dict[str, Any] = {"sizes": sizes.__dict__, "checkpoint": checkpoint}
    try:
        wait_healthy(base_url, [proc], timeout_s=900)
        if "images" in loads:
            measure_images(base_url, model, sizes, figures)
        if "decode" in loads:
            for batch in sizes.decode_batches:
                # the prompts once with one output token first: the measured run finds them in the
                # prefix cache, so its steps are decodes (and one short prefill), not prefill chunks
                warm = text_bodies(model, dataclasses.replace(sizes, max_tokens=1), batch)
                asyncio.run(send(base_url, iter(warm), batch, duration_s=3600))
                figures[f"decode_{batch}"] = run(
                    base_url, text_bodies(model, sizes, batch), batch, sizes.max_tokens
                )
                print(f"decode_{batch}", json.dumps(figures[f"decode_{batch}"]), flush=True)
        if "agent" in loads:
            figures["agent"] = agent_turns(base_url, model, sizes)
            print("agent", json.dumps(figures["agent"]), flush=True)
        if "agents" in loads:
            figures["agents_at_once"] = agents_at_once(base_url, model, sizes)
            print("agents_at_once", json.dumps(figures["agents_at_once"]), flush=True)
    finally:
        proc.stop()
    figures["roofline"] = rooflines(checkpoint, config, figures, args.hbm_bytes_per_s, args.flops)
    (args.out / "gpu_bench.json").write_text(json.dumps(figures, indent=2) + "\n")
    print_table(figures)
    if args.chart is not None:
        draw_chart(figures, args.chart, args.card)


def draw_chart(figures: dict[str, Any], path: Path, card: str) -> None:
    """Each measured figure beside its roofline (lower is better for times, higher for rates)."""
    roof = figures["roofline"]
    decodes = [k for k in figures if k.startswith("decode_")]
    step = {
        f"batch {k.removeprefix('decode_')}": {
            "measured (TPOT p50)": figures[k]["tpot_ms_p50"] or 0.0,
            "roofline": roof[k]["step_ms"],
        }
        for k in decodes
    }
    image = roof.get("image", {})
    encoder = {
        "1024x1024 image": {
            "measured": figures["image_0pct"]["encoder_ms_per_image"] or 0.0,
            "roofline": image.get("encoder_ms_per_image", 0.0),
        }
    }
    rates = {
        "0 % reuse": {
            "measured": figures["image_0pct"]["req_per_s"],
            "roofline": image.get("req_per_s_0pct_reuse") or 0.0,
        },
        "90 % reuse": {"measured": figures["image_90pct"]["req_per_s"]},
    }
    panels = [
        Panel("decode: time per output token (ms)", "ms per token", step, fmt="{:.1f}"),
        Panel("encoder per image (ms)", "ms", encoder, fmt="{:.1f}"),
        Panel("images at c=64, 128 tokens (req/s)", "requests/s", rates, fmt="{:.1f}"),
    ]
    checkpoint = figures["checkpoint"]
    lm, vision = checkpoint["decode_params"] / 1e9, checkpoint["vision_params"] / 1e9
    footnote = (
        f"Qwen2.5-VL-7B-shaped ({lm:.1f}B LM + {vision:.2f}B vision), bf16, random weights; "
        "bench/gpu/bench_gpu.py. Rooflines: HBM 3.35 TB/s, 800 TFLOP/s bf16."
    )
    draw(path, f"mmserve on {card or 'a GPU'}: measured beside the roofline", panels, footnote)


def print_table(figures: dict[str, Any]) -> None:
    roof = figures["roofline"]
    columns = ("load", "req/s", "TTFT p50 ms", "out tok/s", "enc ms/img", "TPOT ms", "step ms", "roofline")
    print("  ".join(f"{c:>12}" for c in columns))
    image = roof.get("image", {})
    for key in (k for k in figures if k.startswith(("image_", "decode_")) and k != "image_probe"):
        f = figures[key]
        if key.startswith("decode_"):
            bound = f"step {roof[key]['step_ms']:.2f} ms"
        else:
            bound = f"{image.get('req_per_s_0pct_reuse') or 0:.1f} req/s"
        values = (
            key,
            f"{f['req_per_s']:.2f}",
            f"{f['ttft_ms']['p50'] or 0:.0f}",
            f"{f['output_tok_per_s']:.0f}",
            f"{f['encoder_ms_per_image'] or 0:.1f}",
            f"{f['tpot_ms_p50'] or 0:.1f}",
            f"{f['forward_ms_per_step'] or 0:.1f}",
            bound,
        )
        print("  ".join(f"{v:>12}" for v in values))
    print(f"encoder roofline per image: {image.get('encoder_ms_per_image', 0):.2f} ms")
    agent = figures.get("agent")
    if agent is not None:
        detail = f" (prompt tokens {agent['prompt_tokens']})"
        print(_turns_line("agent loop alone, TTFT", agent["ttft_ms"], detail, agent["last_over_first"]))
    crowd = figures.get("agents_at_once")
    if crowd is not None:
        label = f"{crowd['agents']} agents at once (steady, {crowd['conversations']} conversations each)"
        label += ", TTFT p50"
        detail = f", {crowd['turns_per_s']:.2f} turns/s"
        print(_turns_line(label, crowd["ttft_ms_p50"], detail, crowd["last_over_first"]))
        none = crowd["no_history_ttft_ms_p50"]
        print(
            f"the same load with no history, TTFT p50 by turn: {', '.join(f'{t:.0f}' for t in none)} ms, "
            f"{crowd['no_history_turns_per_s']:.2f} turns/s; with the history over without, by turn: "
            + ", ".join(f"{r:.2f}x" for r in crowd["history_over_none"])
        )
        for label, key in (("with the history", "server"), ("no history", "no_history_server")):
            print(f"  {label}: " + ", ".join(f"{k} {v:.1f}" for k, v in crowd[key].items()))


def _turns_line(label: str, ttft_ms: list[float], detail: str, last_over_first: float) -> str:
    turns = ", ".join(f"{t:.0f}" for t in ttft_ms)
    ratio = f"turn {AGENT_TURNS} / turn 1: {last_over_first:.2f}x (target <= 1.2x)"
    return f"{label} by turn: {turns} ms{detail}; {ratio}"


if __name__ == "__main__":
    main()
