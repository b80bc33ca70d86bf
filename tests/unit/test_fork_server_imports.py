"""The fork server only imports (app/child_processes.py): its forks may use the GPU only if nothing it
imports asks torch about CUDA. CUDA does not survive a fork once the parent has initialised its driver,
and ``torch.cuda.is_available()`` or ``device_count()`` does that on a CUDA build; a worker forked from
such a fork server would fail on its first CUDA call. Checked here on any build: in a fresh interpreter
whose torch.cuda queries raise, the fork server's modules (the API's too) import."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from app.child_processes import API_PRELOAD, PRELOAD

REPO = Path(__file__).resolve().parents[2]
# Every torch.cuda function that initialises CUDA or reads the driver
QUERIES = ["is_available", "device_count", "_lazy_init", "init", "current_device", "get_device_capability",
           "get_device_properties", "is_bf16_supported", "mem_get_info", "set_device"]  # fmt: skip


def test_the_fork_server_s_modules_import_without_asking_for_cuda() -> None:
    script = textwrap.dedent(
        f"""
        import importlib, torch.cuda

        def refuse(name):
            def query(*args, **kwargs):
                raise AssertionError(f"torch.cuda.{{name}}() while importing the fork server's modules")
            return query

        for name in {QUERIES!r}:
            setattr(torch.cuda, name, refuse(name))
        for module in {[*PRELOAD, API_PRELOAD]!r}:
            importlib.import_module(module)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
