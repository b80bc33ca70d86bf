"""What tests call to get transformers' own answers for videos: each call is one subprocess in the
reference environment (tests/reference/hf_video.py over ``.venv/hf-reference``), which costs ~3-5 s to
start, so batch: ``run_reference`` takes any number of requests (``*_request`` build them) for any
number of checkpoints, and the ``hf_*`` helpers take lists.

Errors HF raised come back as strings ("TypeName: message") in place of the answer; a crash of the
subprocess itself raises ``ReferenceError`` with its stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.reference import setup_env
from tests.reference.hf_video import load, save

HARNESS = Path(__file__).with_name("hf_video.py")


class ReferenceError(RuntimeError):
    """The reference subprocess failed as a whole (not HF refusing one request)."""


# Set where the interpreter's own environment already has a torchvision that matches its torch (the GPU
# machine's CUDA image: bench/gpu/run.sh): the reference subprocess then needs no folder of its own.
OWN_TORCHVISION = "MMSERVE_REFERENCE_OWN_TORCHVISION"


def reference_path() -> str:
    """What the reference subprocess puts first on its ``PYTHONPATH``: ``.venv/hf-reference``, installed
    on first use if missing (tests/reference/setup_env.py), or nothing under ``OWN_TORCHVISION``."""
    if os.environ.get(OWN_TORCHVISION):
        return ""
    return str(reference_dir())


def reference_dir() -> Path:
    """``.venv/hf-reference``, installed on first use if missing (tests/reference/setup_env.py)."""
    target = setup_env.default_target()
    meta = target / "torchvision" / "_meta_registrations.py"
    if not (meta.exists() and "_register_fake_if_has_ops" in meta.read_text()):
        subprocess.run([sys.executable, setup_env.__file__, str(target)], check=True)
    return target


def run_reference(requests: Sequence[Mapping[str, Any]], *, timeout_s: float = 600) -> list[dict[str, Any]]:
    """Answer ``requests`` (see hf_video.py) in one subprocess; arrays come back as numpy arrays."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (reference_path(), os.environ.get("PYTHONPATH")) if p),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    with tempfile.TemporaryDirectory(prefix="hf-reference-") as tmp:
        request_path, result_path = Path(tmp) / "requests.npz", Path(tmp) / "results.npz"
        save(request_path, [dict(request) for request in requests])
        done = subprocess.run(
            [sys.executable, str(HARNESS), str(request_path), str(result_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode != 0 or not result_path.exists():
            raise ReferenceError(f"hf_video.py exited with {done.returncode}:\n{done.stderr[-4000:]}")
        return load(result_path)


def sample_request(
    model_dir: str | Path,
    total_num_frames: int,
    video_fps: float | None,
    *,
    fps: float | None = None,
    num_frames: int | None = None,
) -> dict[str, Any]:
    return {
        "op": "sample",
        "model_dir": str(model_dir),
        "total_num_frames": total_num_frames,
        "video_fps": video_fps,
        "fps": fps,
        "num_frames": num_frames,
    }


def video_request(
    model_dir: str | Path, frames: np.ndarray, metadata: Mapping[str, Any], **kwargs: Any
) -> dict[str, Any]:
    """``metadata``: total_num_frames, fps and frames_indices of the video ``frames`` were sampled from."""
    return {
        "op": "video",
        "model_dir": str(model_dir),
        "frames": frames,
        "metadata": dict(metadata),
        "kwargs": kwargs,
    }


def model_inputs_request(
    model_dir: str | Path,
    messages: list[dict[str, Any]],
    images: Sequence[np.ndarray] = (),
    videos: Sequence[tuple[np.ndarray, Mapping[str, Any]]] = (),
    **kwargs: Any,
) -> dict[str, Any]:
    return {
        "op": "model_inputs",
        "model_dir": str(model_dir),
        "messages": messages,
        "images": list(images),
        "videos": [{"frames": frames, "metadata": dict(metadata)} for frames, metadata in videos],
        "kwargs": kwargs,
    }


def answer(result: dict[str, Any]) -> dict[str, Any] | str:
    """A result with its arrays as torch tensors, or HF's error string."""
    if "error" in result:
        return str(result["error"])
    return {key: _tensors(value) for key, value in result.items()}


def hf_sample_indices(
    model_dir: str | Path, cases: Sequence[tuple[int, float | None, float | None, int | None]]
) -> list[list[int] | str]:
    """HF's ``sample_frames`` for each (total_num_frames, video_fps, fps, num_frames)."""
    results = run_reference(
        [
            sample_request(model_dir, total, video_fps, fps=fps, num_frames=n)
            for total, video_fps, fps, n in cases
        ]
    )
    return [result.get("error") or result["indices"] for result in results]


def hf_process_video(
    model_dir: str | Path, videos: Sequence[tuple[np.ndarray, Mapping[str, Any], Mapping[str, Any]]]
) -> list[dict[str, Any] | str]:
    """HF's video processor (``do_sample_frames=False``) on each (frames, metadata, kwargs):
    pixel_values_videos, video_grid_thw (tensors), and second_per_grid_ts / timestamps where the family has
    them."""
    results = run_reference(
        [video_request(model_dir, frames, metadata, **kwargs) for frames, metadata, kwargs in videos]
    )
    return [answer(result) for result in results]


def hf_model_inputs(
    model_dir: str | Path,
    messages: list[dict[str, Any]],
    images: Sequence[np.ndarray] = (),
    videos: Sequence[tuple[np.ndarray, Mapping[str, Any]]] = (),
    **kwargs: Any,
) -> dict[str, Any]:
    """What ``model.generate(**inputs)`` takes for this chat, from the checkpoint's own HF processor:
    ``{"prompt": str, "inputs": {name: tensor}}``. ``images`` are uint8 [H, W, 3]; ``videos`` are
    (sampled frames uint8 [T, H, W, 3], metadata with total_num_frames, fps and frames_indices)."""
    result = answer(run_reference([model_inputs_request(model_dir, messages, images, videos, **kwargs)])[0])
    if isinstance(result, str):
        raise ReferenceError(result)
    return result


def _tensors(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, dict):
        return {key: _tensors(item) for key, item in value.items()}
    return value
