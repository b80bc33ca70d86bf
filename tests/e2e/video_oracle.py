"""The video oracle: what transformers answers for a chat with clips, from the checkpoint's own HF
processor (in the reference environment, tests/reference) and ``generate``; and the request that asks the
server the same."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import av
import numpy as np
import PIL.Image

from tests.e2e.conftest import Oracle, data_url
from tests.e2e.parity import NUM_TOKENS
from tests.reference.client import answer, model_inputs_request, run_reference, sample_request
from tests.video_clips import sequential_frames

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Case:
    text: str
    media: tuple[bytes | PIL.Image.Image, ...]  # in prompt order: a clip's bytes or an image
    options: dict[str, Any] = field(default_factory=dict)  # mm_processor_kwargs


@dataclass(frozen=True)
class Expected:
    """What transformers gives for a case: the prompt's length and the greedy tokens with logprobs."""

    num_prompt_tokens: int
    ids: list[int]
    logprobs: Any


def video_url(clip: bytes) -> str:
    mime = "video/webm" if clip[:4] == b"\x1a\x45\xdf\xa3" else "video/mp4"
    return f"data:{mime};base64," + base64.b64encode(clip).decode()


def body(case: Case, family: str, n: int = NUM_TOKENS, **extra: Any) -> dict[str, Any]:
    """A greedy request for ``case``, with logprobs (as ``assert_matches_greedy`` compares them)."""
    parts: list[dict[str, Any]] = [
        {"type": "video_url", "video_url": {"url": video_url(m)}}
        if isinstance(m, bytes)
        else {"type": "image_url", "image_url": {"url": data_url(m)}}
        for m in case.media
    ]
    parts.append({"type": "text", "text": case.text})
    return {
        "model": f"tiny-{family}",
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 2,
        "mm_processor_kwargs": case.options,
        **extra,
    }


def frame_rate(clip: bytes) -> float:
    with av.open(io.BytesIO(clip)) as container:
        return float(container.streams.video[0].average_rate)


def expected_answers(
    cases: Mapping[K, tuple[str, Case]],
    tiny_model: Callable[[str], Path],
    family_oracle: Callable[[str], Oracle],
    max_new_tokens: int = NUM_TOKENS,
    generate: Callable[[Oracle, Any, int], tuple[list[int], Any]] | None = None,
) -> dict[K, Expected]:
    """Each (family, case)'s answer: HF's ``sample_frames`` picks each clip's frames (one batched
    reference call), HF's processor makes the model inputs from them (a second), ``generate`` answers
    (``generate(oracle, inputs, max_new_tokens)``; default: greedy with EOS ignored)."""
    clips = {m for _, case in cases.values() for m in case.media if isinstance(m, bytes)}
    frames = {clip: sequential_frames(clip) for clip in clips}
    rates = {clip: frame_rate(clip) for clip in clips}
    wanted = [
        (family, case, clip)
        for family, case in cases.values()
        for clip in case.media
        if isinstance(clip, bytes)
    ]
    samples = run_reference(
        [
            sample_request(
                tiny_model(family),
                len(frames[clip]),
                rates[clip],
                fps=case.options.get("fps"),
                num_frames=case.options.get("num_frames"),
            )
            for family, case, clip in wanted
        ]
    )
    indices = {
        (family, id(case), clip): [int(i) for i in np.asarray(sample["indices"])]
        for (family, case, clip), sample in zip(wanted, samples, strict=True)
    }
    requests = []
    for family, case in cases.values():
        content = [{"type": "video" if isinstance(m, bytes) else "image"} for m in case.media]
        messages = [{"role": "user", "content": [*content, {"type": "text", "text": case.text}]}]
        videos = []
        for clip in (m for m in case.media if isinstance(m, bytes)):
            picked = indices[family, id(case), clip]
            meta = {"total_num_frames": len(frames[clip]), "fps": rates[clip], "frames_indices": picked}
            videos.append((frames[clip][picked], meta))
        images = [np.asarray(m) for m in case.media if not isinstance(m, bytes)]
        requests.append(model_inputs_request(tiny_model(family), messages, images, videos))
    results: dict[K, Expected] = {}
    for (key, (family, _)), result in zip(cases.items(), run_reference(requests), strict=True):
        reference = answer(result)
        assert not isinstance(reference, str), reference
        inputs = reference["inputs"]
        oracle = family_oracle(family)
        if generate is None:
            ids, logprobs = oracle.greedy_inputs(inputs, max_new_tokens)
        else:
            ids, logprobs = generate(oracle, inputs, max_new_tokens)
        results[key] = Expected(int(inputs["input_ids"].shape[1]), ids, logprobs)
    return results
