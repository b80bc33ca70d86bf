"""Part 2 of bench/bench_ec.py: save and load latency per item on the real encoder-cache stores, in this
process (no servers): ``encode_output`` + ``put`` and ``get`` + ``decode_output``, as a producer's and a
consumer's worker do them (workers/ec_connector.py)."""

from __future__ import annotations

import os
import statistics
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load

from wire.ec_store import ECStore
from wire.ec_store.shared_storage import SharedStorageStore
from workers.ec_codec import decode_output, encode_output

HIDDEN_7B = 3584  # Qwen2.5-VL-7B: the projector's output width (the LM's hidden size)
WARMUP = 2
STEPS = ("encode", "put", "get", "decode")


def pct(values: list[float], q: int) -> float:
    """The ``q``-th percentile of ``values``, in ms."""
    if len(values) == 1:
        return 1e3 * values[0]
    return 1e3 * statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def measure(store: ECStore, tensor: torch.Tensor, items: int) -> tuple[dict[str, list[float]], int]:
    """Per-step seconds over ``items`` distinct keys (after ``WARMUP`` untimed ones): every put first,
    then every get, as a producer then a consumer; and the value's size in bytes."""
    keys = [f"bench-{uuid.uuid4().hex}" for _ in range(WARMUP + items)]
    times: dict[str, list[float]] = defaultdict(list)
    size = 0
    for i, key in enumerate(keys):
        t0 = time.perf_counter()
        value = encode_output(key, tensor)
        t1 = time.perf_counter()
        if not store.put(key, value):
            raise RuntimeError(f"the store refused a {len(value):,} B value")
        t2 = time.perf_counter()
        if i >= WARMUP:
            times["encode"].append(t1 - t0)
            times["put"].append(t2 - t1)
        size = len(value)
    for i, key in enumerate(keys):
        t0 = time.perf_counter()
        loaded = store.get(key)
        t1 = time.perf_counter()
        if loaded is None:
            raise RuntimeError(f"{key} not in the store after its put")
        decode_output(key, loaded, tensor.shape[0], tuple(tensor.shape[1:]))
        t2 = time.perf_counter()
        if i >= WARMUP:
            times["get"].append(t1 - t0)
            times["decode"].append(t2 - t1)
    return times, size


def tiny_output(store_dir: Path, tokens: int) -> tuple[torch.Tensor, str]:
    """A tensor shaped and typed as the tiny model's output that part 1's producer saved (read back from
    its folder); else [tokens, 128] float32, the tiny Qwen2.5-VL's on CPU."""
    for path in sorted(store_dir.glob("*.safetensors")):
        saved = load(path.read_bytes())["output"]
        if saved.shape[0] == tokens:
            return torch.randn(saved.shape).to(saved.dtype), "shape and dtype read back from part 1's store"
    return torch.randn(tokens, 128), "part 1 saved none: the tiny model's configured shape"


@contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """This process's file descriptor 2 into ``path`` (mooncake's client logs INFO lines there, and
    ignores GLOG_minloglevel)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("ab") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def store_latencies(
    ttft_store: Path, folder: Path, mooncake_master: str | None, tokens: int, items: int
) -> dict[tuple[str, str], Result]:
    """{(store, output): (per-step seconds, value bytes, note) or why it did not run}."""
    tiny, where = tiny_output(ttft_store, tokens)
    outputs = {
        f"tiny {list(tiny.shape)} {str(tiny.dtype).removeprefix('torch.')}": (tiny, where),
        f"7B [{tokens}, {HIDDEN_7B}] bfloat16": (torch.randn(tokens, HIDDEN_7B).to(torch.bfloat16), "random"),
    }
    stores: dict[str, ECStore | str] = {"shared-storage": SharedStorageStore(folder, 16 << 30)}
    with stderr_to(folder.parent / "mooncake-bench-client.log"):
        if mooncake_master is None:
            stores["mooncake"] = "not running"
        else:
            from wire.ec_store import ECStoreError
            from wire.ec_store.mooncake import MooncakeStore

            try:
                stores["mooncake"] = MooncakeStore(mooncake_master)
            except ECStoreError as exc:
                stores["mooncake"] = f"cannot connect: {exc}"
        return measure_all(stores, outputs, items)


Result = tuple[dict[str, list[float]], int, str] | str


def measure_all(
    stores: dict[str, ECStore | str], outputs: dict[str, tuple[torch.Tensor, str]], items: int
) -> dict[tuple[str, str], Result]:
    """Every output on every store, then every store closed."""
    results: dict[tuple[str, str], Result] = {}
    try:
        for name, store in stores.items():
            for label, (tensor, note) in outputs.items():
                if isinstance(store, str):
                    results[name, label] = store
                    continue
                try:
                    times, size = measure(store, tensor, items)
                    results[name, label] = (times, size, note)
                except (RuntimeError, OSError) as exc:  # ECStoreError is a RuntimeError
                    results[name, label] = f"failed: {exc}"
    finally:
        for store in stores.values():
            if not isinstance(store, str):
                store.close()
    return results


def print_store_table(results: dict[tuple[str, str], Result], items: int) -> None:
    print(
        f"\n### 2. Save and load per item, in-process on the real stores ({items} items each after "
        f"{WARMUP} untimed; all puts, then all gets)\n"
    )
    print(
        "| store | output | value | save p50 ms | save p90 ms | of which put p50 | load p50 ms | "
        "load p90 ms | of which get p50 | load MB/s (p50) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    notes = set()
    for (store, label), result in results.items():
        if isinstance(result, str):
            print(f"| {store} | {label} | {result} |" + " |" * 7)
            continue
        times, size, note = result
        notes.add(f"{label}: {note}")
        save = [e + p for e, p in zip(times["encode"], times["put"], strict=True)]
        load_ = [g + d for g, d in zip(times["get"], times["decode"], strict=True)]
        print(
            f"| {store} | {label} | {size / 1e6:.2f} MB | {pct(save, 50):.2f} | {pct(save, 90):.2f} | "
            f"{pct(times['put'], 50):.2f} | {pct(load_, 50):.2f} | {pct(load_, 90):.2f} | "
            f"{pct(times['get'], 50):.2f} | {size / 1e3 / pct(load_, 50):,.0f} |"
        )
    print(
        "\nsave = `encode_output` (safetensors + blake3 digest) + `put`; load = `get` + `decode_output` "
        "(parse + digest check). shared-storage: a folder on this machine's disk (reads come from the "
        "page cache); mooncake: TCP on loopback to the holder process. " + "; ".join(sorted(notes)) + "."
    )
