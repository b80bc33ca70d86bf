"""The project's Triton kernels without a GPU (tests/triton/check_kernels.py, in a subprocess with the
test-only Triton of tests/triton/setup_env.py): each compiles to a cubin for the H100's architecture, and
the fused decode kernels compute what the PyTorch operations they replace compute. A kernel that does not
compile would otherwise be found only on a GPU, where the decode graphs fall back to slower steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.triton import setup_env

CHECK = Path(__file__).with_name("check_kernels.py")


@pytest.fixture(scope="module")
def triton_path() -> str:
    return str(setup_env.install(setup_env.default_target()))


@pytest.mark.xdist_group("triton")  # one process installs it on first use
@pytest.mark.parametrize("mode", ["compile", "interpret"])
def test_kernels(triton_path: str, mode: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = triton_path
    if mode == "interpret":
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run(
        [sys.executable, str(CHECK), mode], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert "FAILED" not in done.stdout and done.stdout.count(": ok") >= 3, done.stdout
