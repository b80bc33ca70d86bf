"""Install the test-only reference environment: torchvision 0.28.0 in ``.venv/hf-reference``.

transformers' video processors need torchvision; the product does not (it has its own frame processing,
workers/families/qwen_vl/video_processing.py). The tests compare with HF's processors by running them in a
subprocess with ``PYTHONPATH=.venv/hf-reference`` (tests/reference/client.py), never in the test process:
torchvision there would switch transformers' image processors to their torchvision backends for every test.

Usage: ``python tests/reference/setup_env.py [TARGET]`` (default ``<venv>/hf-reference`` beside the running
interpreter's venv). Does nothing when torchvision is already there and imports.

PyPI's torchvision 0.28.0 is a CUDA build: its ``_C.so`` needs libtorch_cuda.so, so it cannot load next to
torch 2.13.0+cpu. It still imports, except that ``_meta_registrations.py`` calls
``torch.library.register_fake("torchvision::nms" / "qnms")`` unconditionally, which raises "operator
torchvision::nms does not exist". ``guard_fake_registrations`` makes those two conditional on
``torchvision.extension._has_ops()``, as ``register_meta`` already is. Only torchvision's C++ ops (nms,
roi_align, decode_jpeg, ...) are missing then; the transforms HF's processors use work.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TORCHVISION = "torchvision==0.28.0"
_HELPER = """

def _register_fake_if_has_ops(qualname):
    def wrapper(fn):
        if torchvision.extension._has_ops():
            return torch.library.register_fake(qualname)(fn)
        return fn
    return wrapper

"""


def default_target() -> Path:
    return Path(sys.prefix) / "hf-reference"


def guard_fake_registrations(target: Path) -> bool:
    """Patch ``torchvision/_meta_registrations.py`` under ``target``; False if it already was."""
    path = target / "torchvision" / "_meta_registrations.py"
    source = path.read_text()
    if "_register_fake_if_has_ops" in source:
        return False
    anchor = "def register_meta("
    if anchor not in source:
        raise RuntimeError(f"{path}: no {anchor!r} to put the guard before; torchvision changed")
    source = source.replace(anchor, _HELPER + anchor, 1)
    for op in ("nms", "qnms"):
        source = source.replace(
            f'@torch.library.register_fake("torchvision::{op}")',
            f'@_register_fake_if_has_ops("torchvision::{op}")',
        )
    path.write_text(source)
    return True


def imports(target: Path) -> bool:
    """Whether torchvision's v2 transforms import from ``target`` (in a subprocess, as the tests use it)."""
    env = {**os.environ, "PYTHONPATH": str(target)}
    probe = "import torchvision.transforms.v2.functional"
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0


def main() -> None:
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else default_target()
    if (target / "torchvision").is_dir() and imports(target):
        print(f"hf-reference: torchvision already in {target}")
        return
    # --no-deps: torch is the venv's own (CPU) one; the wheel's pinned torch would be a CUDA download.
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(target)]
    subprocess.run([*pip, TORCHVISION], check=True)
    guard_fake_registrations(target)
    if not imports(target):
        raise SystemExit(f"hf-reference: torchvision in {target} does not import after the guard")
    print(f"hf-reference: torchvision installed in {target}")


if __name__ == "__main__":
    main()
