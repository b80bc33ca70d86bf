"""Attention backends on one worker step, and the kernel candidates for a batched backend.

    python bench/bench_attention.py --model models/tiny-llava [--repeats 30] [--compiled-flex]
        [--malloc both|glibc-default|kept]

Part 1, the language model's forward over one step (every layer, the pool written and read) with each
registered backend (``workers.attention``), at step shapes the engine produces: N decodes over 600-token
contexts (a warm image), N decodes over 40-token contexts (text), and one 512-token prefill chunk next to
15 decodes. Random embeddings stand in for tokens: attention cost does not depend on their values.
Run twice, each in its own process: with glibc's malloc defaults and with the worker's tuning
(``workers.worker_main.keep_freed_memory``).

Part 2, the kernel alone on the batched layout (16 decodes, or 16 x 64-token chunks, over 608 keys):
``scaled_dot_product_attention`` with an additive mask against PyTorch's ``flex_attention`` with a block
mask, eager (the only mode that needs no compiler) and, with ``--compiled-flex``, ``torch.compile``d
(about 20 s of compilation per shape, not counted).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from workers.attention import ATTENTION_BACKENDS, SeqSpan
from workers.model_runner import ModelRunner
from workers.worker_main import keep_freed_memory


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls, after two unmeasured ones."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


SHARED_PREFIX_TOKENS = 576  # a LLaVA image's prompt: the blocks requests for the same image share


def step_shapes() -> dict[str, list[tuple[int, int, int | None]]]:
    """name -> [(num_past_tokens, num_new_tokens, image) per request]: requests with the same ``image``
    share the blocks of their first ``SHARED_PREFIX_TOKENS`` tokens (prefix-cache hits), None: no one."""
    return {
        "16 decodes, 600-token contexts": [(600, 1, None)] * 16,
        "16 decodes, 600, 8 shared images": [(600, 1, i % 8) for i in range(16)],
        "64 decodes, 600-token contexts": [(600, 1, None)] * 64,
        "64 decodes, 600, 8 shared images": [(600, 1, i % 8) for i in range(64)],
        "16 decodes, 40-token contexts": [(40, 1, None)] * 16,
        "64 decodes, 40-token contexts": [(40, 1, None)] * 64,
        "512-token chunk + 15 decodes": [(0, 512, None)] + [(600, 1, None)] * 15,
    }


def forward_ms(
    runners: dict[str, ModelRunner], shape: list[tuple[int, int, int | None]], repeats: int
) -> dict[str, float]:
    """Median ms of each runner's LM forward on one step of ``shape``; the backends take turns, call by
    call, so that load from elsewhere on the machine affects them alike."""
    calls = {name: _forward_call(runner, shape) for name, runner in runners.items()}
    samples: dict[str, list[float]] = {name: [] for name in calls}
    with torch.inference_mode():
        for i in range(repeats + 2):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                if i >= 2:  # two unmeasured rounds first
                    samples[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(values) for name, values in samples.items()}


def _forward_call(runner: ModelRunner, shape: list[tuple[int, int, int | None]]) -> Callable[[], object]:
    lm = runner.lm_forward
    assert lm is not None
    block_size, spans, next_block = runner.block_size, [], 0
    shared: dict[int, list[int]] = {}
    for i, (past, new, image) in enumerate(shape):
        table = []
        if image is not None:
            if image not in shared:
                num_shared = SHARED_PREFIX_TOKENS // block_size
                shared[image] = list(range(next_block, next_block + num_shared))
                next_block += num_shared
            table = list(shared[image])
        num_blocks = -(-(past + new) // block_size) - len(table)
        table += range(next_block, next_block + num_blocks)
        next_block += num_blocks
        spans.append(SeqSpan(f"r{i}", past, new, table))
    num_tokens = sum(new for _, new, _ in shape)
    hidden = runner.embed_tokens.weight.shape[1]
    embeds = torch.randn(num_tokens, hidden, dtype=runner.dtype)
    positions = torch.cat([torch.arange(past, past + new) for past, new, _ in shape]).unsqueeze(0)
    rows = list(range(num_tokens))
    return lambda: lm(embeds, positions, spans, rows)


def kernel_ms(num_queries: int, repeats: int, compiled_flex: bool) -> dict[str, float]:
    torch.manual_seed(0)
    batch, heads, kv_heads, head_dim, num_keys = 16, 4, 2, 32, 608
    q = torch.randn(batch, heads, num_queries, head_dim)
    k, v = (torch.randn(batch, kv_heads, num_keys, head_dim) for _ in range(2))
    lengths = torch.randint(300, num_keys, (batch,))

    def visible(b, h, q_idx, kv_idx):  # noqa: ARG001 (flex's mask signature)
        return kv_idx <= lengths[b] - num_queries + q_idx

    keys, rows = torch.arange(num_keys).view(1, 1, 1, -1), torch.arange(num_queries).view(1, 1, -1, 1)
    allowed = keys <= lengths.view(-1, 1, 1, 1) - num_queries + rows
    additive = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    block_mask = create_block_mask(visible, batch, None, num_queries, num_keys, device="cpu")
    results = {
        "sdpa + additive mask": timed(
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=additive, enable_gqa=True), repeats
        ),
        "flex_attention (eager)": timed(
            lambda: flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True), max(3, repeats // 10)
        ),
    }
    if compiled_flex:
        compiled = torch.compile(flex_attention, dynamic=False)
        compiled(q, k, v, block_mask=block_mask, enable_gqa=True)  # compiles
        results["flex_attention (compiled)"] = timed(
            lambda: compiled(q, k, v, block_mask=block_mask, enable_gqa=True), repeats
        )
    return {name: 1000 * seconds for name, seconds in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="models/tiny-llava")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--compiled-flex", action="store_true")
    parser.add_argument(
        "--malloc",
        choices=["both", "glibc-default", "kept"],
        default="both",
        help="glibc's defaults, the worker's tuning (keep_freed_memory), or each in its own process",
    )
    args = parser.parse_args()
    if args.malloc == "both":
        for mode in ("glibc-default", "kept"):
            child = [arg for arg in sys.argv[1:] if not arg.startswith("--malloc")]
            subprocess.run([sys.executable, __file__, *child, f"--malloc={mode}"], check=True)
        return
    if args.malloc == "kept":
        keep_freed_memory()
    torch.set_num_threads(1)  # the worker's share of this 2-core machine

    runners = {
        name: ModelRunner(args.model, device="cpu", kv_cache_tokens=65536, attention=name)
        for name in ATTENTION_BACKENDS
    }
    where = f"{args.model}, 1 thread, malloc {args.malloc}"
    print(f"\nLM forward of one step, ms (median of {args.repeats}), {where}")
    print(f"{'step':34}" + "".join(f"{name:>14}" for name in ATTENTION_BACKENDS) + f"{'ratio':>10}")
    for label, shape in step_shapes().items():
        times = forward_ms(runners, shape, args.repeats)
        ratio = times["per-request"] / times["batched"]
        print(f"{label:34}" + "".join(f"{times[n]:14.2f}" for n in ATTENTION_BACKENDS) + f"{ratio:9.1f}x")

    if args.malloc == "kept":
        return  # the kernels: once is enough
    print("\nattention kernel alone, 16 sequences x 608 keys, 4 heads (2 KV heads) x 32, ms")
    for num_queries in (1, 64):
        for name, ms in kernel_ms(num_queries, args.repeats, args.compiled_flex).items():
            print(f"  {num_queries:>2} queries each  {name:28} {ms:9.3f}")


if __name__ == "__main__":
    main()
