"""transformers' own video processing, run in the test-only reference environment (torchvision installed):

    PYTHONPATH=.venv/hf-reference python tests/reference/hf_video.py REQUESTS.npz RESULTS.npz

REQUESTS.npz holds a list of requests (JSON; arrays stand apart in the archive, see ``pack``), each
answered in RESULTS.npz by a dict, or by ``{"error": "TypeName: message"}`` where HF raised:

    {"op": "sample", "model_dir", "total_num_frames", "video_fps", "fps", "num_frames"}
        -> {"indices"}: video_processor.sample_frames(metadata, fps=..., num_frames=...)
    {"op": "video", "model_dir", "frames" (uint8 [T, H, W, 3]), "metadata", "kwargs"}
        -> {"pixel_values_videos", "video_grid_thw", "second_per_grid_ts"?, "timestamps"?}:
           video_processor(videos=[frames], video_metadata=[metadata], do_sample_frames=False, **kwargs);
           second_per_grid_ts as Qwen2_5_VLProcessor computes it, timestamps as Qwen3VLProcessor does
    {"op": "model_inputs", "model_dir", "messages", "images" ([H, W, 3] each), "videos" ({"frames",
     "metadata"} each), "kwargs"}
        -> {"prompt", "inputs": {name: tensor as array}}: the chat template, then
           processor(text=[prompt], images=..., videos=..., do_sample_frames=False, return_tensors="pt"),
           i.e. what ``model.generate(**inputs)`` takes

The processor is ``AutoProcessor.from_pretrained(model_dir)`` with its image processor replaced by the
PIL backend the product uses (``Qwen2VLImageProcessorPil``): with torchvision present AutoProcessor
would pick the torchvision one, whose resize differs. Loaded once per folder and run.

Never import transformers' video code in the test process itself: torchvision there would switch every
image processor to its torchvision backend. This module's top level is plain numpy so that
tests/reference/client.py can share ``pack`` / ``unpack``.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np

_ARRAY = "__array__"


def pack(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    """``value`` as JSON-able data, each numpy array (or torch tensor) moved into ``arrays`` and
    replaced by ``{"__array__": name}``."""
    if hasattr(value, "numpy") and hasattr(value, "detach"):  # a torch tensor, without importing torch
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        name = f"a{len(arrays)}"
        arrays[name] = value
        return {_ARRAY: name}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(key): pack(item, arrays) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [pack(item, arrays) for item in value]
    return value


def unpack(value: Any, arrays: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {_ARRAY}:
            return arrays[value[_ARRAY]]
        return {key: unpack(item, arrays) for key, item in value.items()}
    if isinstance(value, list):
        return [unpack(item, arrays) for item in value]
    return value


def save(path: str | Path, items: list[Any]) -> None:
    arrays: dict[str, np.ndarray] = {}
    document = json.dumps(pack(items, arrays))
    payload: dict[str, Any] = {"__json__": np.array(document), **arrays}
    np.savez(path, **payload)


def load(path: str | Path) -> list[Any]:
    with np.load(path, allow_pickle=False) as archive:
        arrays = {name: archive[name] for name in archive.files}
    return unpack(json.loads(str(arrays.pop("__json__"))), arrays)


class _Reference:
    """HF's processors per checkpoint folder, loaded on first use."""

    def __init__(self) -> None:
        self.processors: dict[str, Any] = {}

    def processor(self, model_dir: str) -> Any:
        if model_dir not in self.processors:
            from transformers import AutoProcessor, Qwen2VLImageProcessorPil

            processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
            processor.image_processor = Qwen2VLImageProcessorPil.from_pretrained(
                model_dir, local_files_only=True
            )
            self.processors[model_dir] = processor
        return self.processors[model_dir]

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        return getattr(self, f"op_{request['op']}")(request)

    def op_sample(self, request: dict[str, Any]) -> dict[str, Any]:
        from transformers.video_utils import VideoMetadata

        video_processor = self.processor(request["model_dir"]).video_processor
        metadata = VideoMetadata(total_num_frames=request["total_num_frames"], fps=request["video_fps"])
        indices = video_processor.sample_frames(
            metadata, fps=request.get("fps"), num_frames=request.get("num_frames")
        )
        return {"indices": [int(index) for index in indices]}

    def op_video(self, request: dict[str, Any]) -> dict[str, Any]:
        processor = self.processor(request["model_dir"])
        frames, metadata = request["frames"], request["metadata"]
        kwargs = {"do_sample_frames": False, "return_tensors": "pt", **request.get("kwargs", {})}
        if type(processor).__name__ == "Qwen2_5_VLProcessor":  # it adds second_per_grid_ts
            batch, _ = processor._process_videos(
                [frames], video_metadata=[dict(metadata)], return_metadata=True, **kwargs
            )
        else:
            batch = processor.video_processor(videos=[frames], video_metadata=[dict(metadata)], **kwargs)
        out = {name: batch[name] for name in ("pixel_values_videos", "video_grid_thw")}
        if "second_per_grid_ts" in batch:
            out["second_per_grid_ts"] = [float(x) for x in batch["second_per_grid_ts"]]
        if hasattr(processor, "_calculate_timestamps"):  # Qwen3VLProcessor
            tps = processor.video_processor.temporal_patch_size
            out["timestamps"] = processor._calculate_timestamps(
                list(metadata["frames_indices"]), metadata["fps"], tps
            )
        return out

    def op_model_inputs(self, request: dict[str, Any]) -> dict[str, Any]:
        from PIL import Image

        processor = self.processor(request["model_dir"])
        prompt = processor.apply_chat_template(
            request["messages"], add_generation_prompt=True, tokenize=False
        )
        images = [Image.fromarray(image) for image in request.get("images", [])]
        videos = request.get("videos", [])
        inputs = processor(
            text=[prompt],
            images=images or None,
            videos=[video["frames"] for video in videos] or None,
            video_metadata=[dict(video["metadata"]) for video in videos] or None,
            do_sample_frames=False,
            return_tensors="pt",
            **request.get("kwargs", {}),
        )
        return {"prompt": prompt, "inputs": {name: value for name, value in inputs.items()}}


def main() -> None:
    import transformers

    transformers.logging.set_verbosity_error()  # the cap_pixels_per_frame notice, once per processor
    requests = load(sys.argv[1])
    reference = _Reference()
    results = []
    for request in requests:
        try:
            results.append(reference.run(request))
        except Exception as exc:  # the answer is HF's error; the caller compares it with the product's
            if request["op"] not in ("sample", "video"):
                traceback.print_exc()
            results.append({"error": f"{type(exc).__name__}: {exc}"})
    save(sys.argv[2], results)


if __name__ == "__main__":
    main()
