"""Install the test-only Triton in ``.venv/triton``: the version the GPU image pairs with its CUDA torch
(docs/development.md, "The GPU kit"), without its dependencies.

The product's venv has no Triton beside a CPU torch (Makefile: xgrammar's is removed, since transformers
would import it into every process). tests/triton/check_kernels.py runs with this folder on its
``PYTHONPATH``, in a subprocess, so that no other test imports it.

Usage: ``python tests/triton/setup_env.py [TARGET]`` (default ``<venv>/triton``). Does nothing when that
version is already there.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

VERSION = "3.6.0"


def default_target() -> Path:
    return Path(sys.prefix) / "triton"


def install(target: Path) -> Path:
    if not (target / f"triton-{VERSION}.dist-info").is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(target),
             f"triton=={VERSION}"],
            check=True,
        )  # fmt: skip
    return target


if __name__ == "__main__":
    install(Path(sys.argv[1]) if len(sys.argv) > 1 else default_target())
