"""One video cache miss, from encoded bytes to a processed item, where images are processed: in a
preprocessing process (or a thread of the API process without a pool)::

    probe_video         header only: container, codec, size, frame count, frame rate, rotation
    family.sample_video the frames the family's video processor samples (the request's fps / num_frames)
    max sampled frames  --max-video-frames, and their pixels --max-video-pixels, before a frame is decoded
    decode_frames       only those frames, seeking where the container allows, under the time limit
    family.process_video

Every refusal is a 400 naming its cause (``app.media.video``'s codes, ``video_aspect_ratio_too_large``,
``video_too_short``, ``too_many_video_frames``, ``video_too_large``), and the video's part where the
video is the cause, ``mm_processor_kwargs`` where the request's sampling is.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from app.errors import MediaError, from_family_error
from app.media.video import VideoInfo, VideoLimits, decode_frames, probe_video
from app.settings import Settings
from workers.families.errors import FamilyInputError
from workers.families.processing import (
    KWARGS_PARAM,
    MAX_ASPECT_RATIO,
    FamilyProcessor,
    ProcessedItem,
    VideoMetadata,
    aspect_ratio_too_large,
)


@dataclass(frozen=True)
class VideoRules:
    """The video limits a preprocessing process applies; built from the settings, sent to each process."""

    limits: VideoLimits
    max_sampled_frames: int  # --max-video-frames
    max_decoded_pixels: int  # --max-video-pixels: the sampled frames' memory (a 4096 x 2048 frame is 25 MB)

    @classmethod
    def from_settings(cls, settings: Settings) -> VideoRules:
        # frames, size and duration a container may declare: VideoLimits' defaults (100,000 frames,
        # an hour, 8192 x 8192): the header pass reads every packet, ~0.5 s for the largest
        limits = VideoLimits(decode_timeout_s=settings.video_decode_timeout_s)
        return cls(limits, settings.max_video_frames, settings.max_video_pixels)


def decode_and_process_video(
    family: FamilyProcessor, data: bytes, options: Mapping[str, Any], param: str, rules: VideoRules
) -> ProcessedItem:
    start = time.monotonic()
    info = probe_video(data, limits=rules.limits, param=param)
    if aspect_ratio_too_large(info.width, info.height):
        raise MediaError(
            f"The video is {info.width}x{info.height} pixels: its longer side may be at most "
            f"{MAX_ASPECT_RATIO} times its shorter one.",
            param=param,
            code="video_aspect_ratio_too_large",
        )
    metadata = VideoMetadata(fps=info.fps, num_frames=info.num_frames)
    sampling = {key: options[key] for key in ("fps", "num_frames") if key in options}
    try:
        indices = family.sample_video(metadata, options)
    except FamilyInputError as exc:
        if sampling:  # the request's sampling asks what the clip cannot give
            raise from_family_error(exc) from exc
        # the clip itself is too short for the model's own sampling
        reason = exc.message.removeprefix("This video cannot be sampled so: ").rstrip(".")
        raise _too_short(info, reason, param) from exc
    if not sampling and len(indices) < family.min_video_frames:
        reason = f"{len(indices)} frames; it takes at least {family.min_video_frames}"
        raise _too_short(info, reason, param)
    if len(indices) > rules.max_sampled_frames:
        raise MediaError(
            f"This video's sampling gives {len(indices)} frames ({info.num_frames} frames at "
            f"{info.fps:g} fps, sampled {sampling or 'by the model default'}); at most "
            f"{rules.max_sampled_frames} are allowed (--max-video-frames). Ask for a lower fps or "
            "num_frames in mm_processor_kwargs.",
            param=KWARGS_PARAM if sampling else param,
            code="too_many_video_frames",
        )
    num_pixels = len(indices) * info.width * info.height
    if num_pixels > rules.max_decoded_pixels:
        raise MediaError(
            f"This video's {len(indices)} sampled frames of {info.width}x{info.height} are {num_pixels} "
            f"pixels; at most {rules.max_decoded_pixels} are decoded for one video (--max-video-pixels). "
            "Ask for a lower fps or num_frames in mm_processor_kwargs, or send a smaller video.",
            param=param,
            code="video_too_large",
        )
    # probe and decode share the item's one time limit
    remaining_s = max(0.0, rules.limits.decode_timeout_s - (time.monotonic() - start))
    limits = dataclasses.replace(rules.limits, decode_timeout_s=remaining_s)
    frames = decode_frames(data, info, indices, limits=limits, param=param)
    try:
        return family.process_video(frames, metadata, indices, options)
    except FamilyInputError as exc:
        raise from_family_error(exc) from exc


def _too_short(info: VideoInfo, reason: str, param: str) -> MediaError:
    return MediaError(
        f"This video ({info.num_frames} frames at {info.fps:g} fps) is too short for the model's sampling "
        f"({reason}).",
        param=param,
        code="video_too_short",
    )
