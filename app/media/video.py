"""Probe and decode the videos of a request (Qwen-VL families), in a preprocessing process.

``probe_video`` checks a video from its header and its packets, decoding no picture: container and
codec allowed, a video stream with frames, size, length and frame rate within limits, upright.
``decode_frames`` then decodes only the frames a sampling asks for, seeking to the keyframe before a
far one. Both are bounded by ``VideoLimits.decode_timeout_s`` and raise nothing but ``MediaError``
(HTTP 400) for what a client sends; each refusal has its own code (``app.errors.MediaError``).

FFmpeg opens the bytes only with the demuxer ``video_checks.sniff_container`` chose from their first
bytes, and its decoders refuse frames over ``max_pixels`` before allocating them, so a header that
lies about the frame size costs nothing.
"""

from __future__ import annotations

import functools
import io
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import av
import av.logging
import numpy as np
from av.container import InputContainer
from av.video.stream import VideoStream

from app.errors import MediaError
from app.media.images import DEFAULT_MAX_IMAGE_PIXELS
from app.media.video_checks import (
    cut_short,
    read_track_header,
    rotated_error,
    sniff_container,
    truncated_error,
)
from app.media.video_frames import FrameDecoder, PacketTable, scan_packets

# Codecs decoded, by FFmpeg's codec name, with the decoders that decode them in software. FFmpeg's own
# "av1" decoder needs a hardware accelerator, so AV1 is taken only where the wheel has libdav1d.
_DECODERS = {
    "h264": frozenset({"h264"}),
    "hevc": frozenset({"hevc"}),
    "vp8": frozenset({"vp8", "libvpx"}),
    "vp9": frozenset({"vp9", "libvpx-vp9"}),
    "av1": frozenset({"libdav1d", "libaom-av1"}),
}
_CODEC_NAMES = "H.264, H.265/HEVC, VP8, VP9 or AV1"


@dataclass(frozen=True)
class VideoLimits:
    """What one video may be. ``decode_timeout_s`` bounds each call (probe, decode) on its own; a caller
    wanting one budget for both passes what is left to the second."""

    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # per frame, width * height
    max_frames: int = 100_000  # frames the stream may hold
    max_duration_s: float = 3600.0
    decode_timeout_s: float = 30.0  # wall clock


@dataclass(frozen=True)
class VideoInfo:
    """A probed video. Frame i (0-based, presentation order) is shown at about i / fps seconds."""

    container: str  # FFmpeg's demuxer name: "mov,mp4,m4a,3gp,3g2,mj2" or "matroska,webm"
    codec: str  # FFmpeg's codec name: "h264", "hevc", "vp8", "vp9" or "av1"
    width: int
    height: int
    fps: float  # the stream's average frame rate
    num_frames: int
    duration_s: float  # num_frames / fps


@dataclass(frozen=True)
class DecodeStats:
    """The work one ``decode_frames`` did: frames out of the decoder, and seeks."""

    num_decoded_frames: int
    num_seeks: int


def probe_video(data: bytes, *, limits: VideoLimits, param: str) -> VideoInfo:
    """Check a video from its header and packets, decoding no picture, and say what it holds.

    Called once per video part, before any frame is decoded. Refusals: from the first bytes,
    ``video_is_an_image``, ``unsupported_video_format`` and ``invalid_video`` (not a video); from the
    container header, before FFmpeg opens it, ``video_truncated`` (the file ends inside a box or segment
    its header sizes), ``video_dimensions_too_large`` and ``video_rotated``; from FFmpeg's reading of
    the streams, ``invalid_video`` (unreadable), ``video_stream_missing``, ``unsupported_video_codec``,
    ``video_dimensions_too_large`` and ``video_too_long`` (declared frames or duration); from the packets,
    ``video_too_long`` (counted), ``video_truncated`` (a packet cut short, fewer frames or seconds than
    declared), ``video_empty``, ``video_variable_frame_rate``; and ``video_decode_timeout`` throughout.
    """
    deadline = _Deadline(limits.decode_timeout_s, param)
    with _as_media_error(param, deadline):
        family = sniff_container(data, param=param)
        if cut_short(data, family):
            raise truncated_error(f"ends at byte {len(data)}, inside what its header declares", param)
        header = read_track_header(data, family)
        if header is not None:
            _check_size(header.width, header.height, limits=limits, param=param)
            if header.turned:
                raise rotated_error(param)
        with _open(data, family.value, limits, deadline) as container:
            return _probe_opened(container, limits, deadline, param)


def _probe_opened(
    container: InputContainer, limits: VideoLimits, deadline: _Deadline, param: str
) -> VideoInfo:
    """``probe_video`` once FFmpeg has opened the container: its streams, then its packets."""
    stream = _video_stream(container, param)
    context = stream.codec_context  # None where FFmpeg has no decoder for the codec at all
    codec = context.codec.canonical_name if context is not None else "unknown"
    if codec not in _DECODERS or context.name not in _DECODERS[codec]:
        raise MediaError(
            f"Video codec {codec} is not supported (or not decodable here): send {_CODEC_NAMES}.",
            param=param,
            code="unsupported_video_codec",
        )
    width, height = context.width, context.height
    if width <= 0 or height <= 0:
        raise MediaError(
            f"The video's frame size could not be read (or is over {limits.max_pixels} pixels).",
            param=param,
            code="invalid_video",
        )
    _check_size(width, height, limits=limits, param=param)
    declared_s = _declared_duration_s(container, stream)
    _check_length(stream.frames, declared_s or 0.0, limits=limits, param=param)
    table = scan_packets(container, stream, max_frames=limits.max_frames, deadline=deadline.check)
    if table.num_frames > limits.max_frames:
        raise _too_long(f"holds more than {limits.max_frames} frames", param)
    fps = float(stream.average_rate or 0) or table.measured_fps()
    _check_complete(table, stream.frames, declared_s, fps, param)
    if not table.times_regular():
        raise MediaError(
            "The video has a variable frame rate: send a constant frame rate video.",
            param=param,
            code="video_variable_frame_rate",
        )
    if fps <= 0:
        raise MediaError("The video's frame rate is unknown.", param=param, code="invalid_video")
    duration_s = table.num_frames / fps
    _check_length(table.num_frames, duration_s, limits=limits, param=param)
    return VideoInfo(container.format.name, codec, width, height, fps, table.num_frames, duration_s)


def decode_frames(
    data: bytes, info: VideoInfo, indices: Sequence[int], *, limits: VideoLimits, param: str
) -> np.ndarray:
    """Frames ``indices`` (ascending, repeats allowed, each below ``info.num_frames``) of a video
    ``probe_video`` accepted, as a uint8 RGB array [len(indices), height, width, 3].

    Called after the probe, with the sampling's indices. Pixel for pixel what a sequential decode of the
    whole stream gives at those indices, decoding only from the keyframe before each far wanted frame
    (``video_frames.SEEK_MIN_SKIPPED_FRAMES``). Refusals: ``video_truncated`` (the data ends before a
    wanted frame), ``video_decode_timeout``, ``video_rotated`` (from the decoded frames' own display
    matrix), ``invalid_video`` (anything FFmpeg cannot decode, frames over ``max_pixels`` or changing
    size). Indices out of order or range are the caller's bug: ValueError.
    """
    return decode_frames_with_stats(data, info, indices, limits=limits, param=param)[0]


def decode_frames_with_stats(
    data: bytes, info: VideoInfo, indices: Sequence[int], *, limits: VideoLimits, param: str
) -> tuple[np.ndarray, DecodeStats]:
    """``decode_frames``, plus the work it took (for metrics, and for the tests that it stays small)."""
    wanted = [int(i) for i in indices]
    if any(b < a for a, b in zip(wanted, wanted[1:], strict=False)) or (
        wanted and not 0 <= wanted[0] <= wanted[-1] < info.num_frames
    ):
        raise ValueError(f"frame indices must be ascending and below {info.num_frames}")
    frames = np.empty((len(wanted), info.height, info.width, 3), dtype=np.uint8)
    if not wanted:
        return frames, DecodeStats(0, 0)
    deadline = _Deadline(limits.decode_timeout_s, param)
    with (
        _as_media_error(param, deadline),
        _open(data, sniff_container(data, param=param).value, limits, deadline) as container,
    ):
        stream = _video_stream(container, param)
        table = scan_packets(container, stream, max_frames=limits.max_frames, deadline=deadline.check)
        if wanted[-1] >= table.num_intact_frames(info.num_frames):
            raise truncated_error(f"ends before frame {wanted[-1]}", param)
        decoder = FrameDecoder(container, stream, table, (info.width, info.height), deadline.check)
        positions: dict[int, list[int]] = {}
        for position, index in enumerate(wanted):
            positions.setdefault(index, []).append(position)
        for index, rgb in decoder.frames_at(sorted(positions), param=param):
            frames[positions[index]] = rgb
        return frames, DecodeStats(decoder.num_decoded_frames, decoder.num_seeks)


class _Deadline:
    """The wall-clock budget of one call."""

    def __init__(self, budget_s: float, param: str) -> None:
        self._budget_s, self._param = budget_s, param
        self._end = time.monotonic() + budget_s

    def remaining_s(self) -> float:
        return self._end - time.monotonic()

    def check(self) -> None:
        if time.monotonic() > self._end:
            raise MediaError(
                f"Decoding the video took longer than the limit of {self._budget_s:g} s.",
                param=self._param,
                code="video_decode_timeout",
            )


@functools.cache
def _quiet_ffmpeg() -> None:
    """FFmpeg logs every damaged packet of every client's video; the refusals say what matters."""
    av.logging.set_level(av.logging.PANIC)


@contextmanager
def _open(data: bytes, demuxer: str, limits: VideoLimits, deadline: _Deadline) -> Iterator[InputContainer]:
    """The container, opened with one demuxer. ``max_pixels`` reaches every decoder FFmpeg opens (its
    stream probing's, and ours through the stream's options) so none allocates a frame over it."""
    _quiet_ffmpeg()
    deadline.check()
    guard = {"max_pixels": str(limits.max_pixels)}
    container = av.open(
        io.BytesIO(data), mode="r", format=demuxer, options=guard, timeout=deadline.remaining_s()
    )
    try:
        for stream in container.streams.video:
            if stream.codec_context is not None:
                stream.codec_context.options = dict(guard)
        yield container
    finally:
        container.close()


@contextmanager
def _as_media_error(param: str, deadline: _Deadline) -> Iterator[None]:
    """Whatever FFmpeg or PyAV raise on a client's bytes (FFmpegError, OSError, ValueError, EOFError,
    MemoryError...) is a 400, never a server fault; FFmpeg's own stop at the deadline (its interrupt
    callback, during open and reads) is the timeout."""
    try:
        yield
    except MediaError:
        raise
    except Exception as exc:
        deadline.check()
        raise MediaError(
            "The video could not be read: the bytes are not a complete, valid video.",
            param=param,
            code="invalid_video",
        ) from exc


def _video_stream(container: InputContainer, param: str) -> VideoStream:
    """The first video stream that is not a cover picture."""
    for stream in container.streams.video:
        if not stream.disposition & av.stream.Disposition.attached_pic:
            return stream
    raise MediaError("The video has no video stream.", param=param, code="video_stream_missing")


def _declared_duration_s(container: InputContainer, stream: VideoStream) -> float | None:
    """The stream's duration as its header says; the file's when it holds this stream only."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration and len(container.streams) == 1:
        return container.duration / av.time_base
    return None


def _check_size(width: int, height: int, *, limits: VideoLimits, param: str) -> None:
    if width * height > limits.max_pixels:
        raise MediaError(
            f"Video frames of {width}x{height} pixels exceed the limit of {limits.max_pixels} pixels.",
            param=param,
            code="video_dimensions_too_large",
        )


def _check_length(num_frames: int, duration_s: float, *, limits: VideoLimits, param: str) -> None:
    if num_frames > limits.max_frames:
        raise _too_long(f"has {num_frames} frames, over the limit of {limits.max_frames}", param)
    if duration_s > limits.max_duration_s:
        raise _too_long(f"lasts {duration_s:.1f} s, over the limit of {limits.max_duration_s:g} s", param)


def _check_complete(
    table: PacketTable, declared_frames: int, declared_s: float | None, fps: float, param: str
) -> None:
    """Refuse a stream cut short (against its own header), then one without frames."""
    if table.truncated:
        raise truncated_error(f"ends inside frame {table.num_frames}", param)
    if declared_frames > table.num_frames:
        raise truncated_error(f"holds {table.num_frames} of the {declared_frames} frames it declares", param)
    if table.num_frames and declared_s is not None and fps > 0:
        held_s = table.span_s(fps)
        # Audio and video of one file end a little apart; a cut file misses far more.
        if declared_s - held_s > max(0.5, 0.05 * declared_s):
            raise truncated_error(f"holds {held_s:.2f} s of the {declared_s:.2f} s it declares", param)
    if table.num_frames == 0:
        raise MediaError("The video has no frames.", param=param, code="video_empty")


def _too_long(what: str, param: str) -> MediaError:
    return MediaError(f"The video {what}.", param=param, code="video_too_long")
