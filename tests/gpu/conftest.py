"""The CUDA tier (``pytest -m gpu``): the worker on a GPU in bf16 against transformers' bf16 ``generate``
on the same GPU. Skipped without CUDA. The GPU kit (bench/gpu/run.sh) runs it on the device machine; its
dry run here runs the same tests on the CPU in fp32 (``MMSERVE_GPU_TIER_DEVICE=cpu``), on the families
``MMSERVE_GPU_TIER_FAMILIES`` names, so the tier's own code is tested before device time is spent."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.e2e.conftest import Oracle
from tests.e2e.parity import NEAR_TIE
from tests.e2e.server import Server, ServerProcess, free_port, serve_args, stop_all, wait_healthy
from workers.families.tiny import TINY_FAMILIES

DEVICE_VAR, FAMILIES_VAR = "MMSERVE_GPU_TIER_DEVICE", "MMSERVE_GPU_TIER_FAMILIES"
# bf16 keeps 8 bits of mantissa: the served and the oracle's logits (two bf16 computations, with other
# kernels and batch shapes) differ by a few hundredths at the tiny models' logit scale (std ~6), so a
# greedy choice may flip only where the oracle's best two are that close. fp32's bound is NEAR_TIE.
BF16_NEAR_TIE = 0.25


@dataclass(frozen=True)
class Tier:
    device: str  # what the servers get as --device, and where the oracle runs
    dtype: torch.dtype
    near_tie: float  # tests/near_tie.py's bound for this precision
    families: tuple[str, ...]

    @property
    def quantized(self) -> bool:
        """The oracle's logits are bf16: tests/near_tie.py's ties are ties at their rounding step."""
        return self.dtype == torch.bfloat16


def tier() -> Tier:
    device = os.environ.get(DEVICE_VAR, "cuda")
    families = tuple(f for f in os.environ.get(FAMILIES_VAR, ",".join(TINY_FAMILIES)).split(",") if f)
    if device.startswith("cuda"):
        return Tier(device, torch.bfloat16, BF16_NEAR_TIE, families)
    return Tier(device, torch.float32, NEAR_TIE, families)


def cuda_missing() -> bool:
    return tier().device.startswith("cuda") and not torch.cuda.is_available()


# Every server of the tier: the pool is sized explicitly (several servers share one GPU, and the default
# takes a share of the whole card).
BASE = ("--max-model-len", "4096", "--kv-cache-tokens", "16384")
UNCACHED_CHUNKED = (
    "--mm-processor-cache-gb", "0", "--mm-ipc-cache-gb", "0", "--encoder-cache-tokens", "0",
    "--no-enable-prefix-caching", "--max-num-batched-tokens", "128",
)  # fmt: skip
# The shm store, and a pool of 1024 tokens: two one-image prompts of ~600 tokens cannot both fit, so
# concurrent requests are preempted and resumed.
SHM_SMALL_POOL = (
    "--mm-processor-cache-type", "shm", "--max-model-len", "4096", "--kv-cache-tokens", "1024",
    "--max-num-batched-tokens", "256", "--encoder-compute-budget-tokens", "1200",
)  # fmt: skip
KINDS = {"cached": BASE, "uncached_chunked": (*BASE, *UNCACHED_CHUNKED), "shm_small_pool": SHM_SMALL_POOL}


@pytest.fixture(scope="session")
def gpu_tier() -> Tier:
    return tier()


@pytest.fixture(scope="session")
def tier_servers(
    gpu_tier: Tier, tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[tuple[str, str], Server]]:
    """Every (family, kind) server of ``KINDS``, started together (their start-ups overlap)."""
    if cuda_missing():
        pytest.skip("needs a CUDA device")
    log_dir = tmp_path_factory.mktemp("gpu-tier")
    servers: dict[tuple[str, str], Server] = {}
    try:
        for family in gpu_tier.families:
            for kind, flags in KINDS.items():
                port = free_port()
                args = serve_args(tiny_model(family), port, ("--device", gpu_tier.device, *flags))
                process = ServerProcess(args, log_dir / f"{family}-{kind}.log").start()
                servers[family, kind] = Server(process, port)
        for server in servers.values():
            wait_healthy(server.base_url, server.process, timeout_s=300)
        yield servers
    finally:
        stop_all(list(servers.values()))


@pytest.fixture(scope="session")
def tier_oracle(gpu_tier: Tier, tiny_model: Callable[[str], Path]) -> Callable[[str], Oracle]:
    """transformers' model of each family in the tier's dtype, on its device (loaded once)."""
    loaded: dict[str, Oracle] = {}

    def get(family: str) -> Oracle:
        if family not in loaded:
            loaded[family] = Oracle.load(tiny_model(family), gpu_tier.dtype, gpu_tier.device)
        return loaded[family]

    return get
