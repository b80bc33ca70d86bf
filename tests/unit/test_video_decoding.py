"""``probe_video`` and ``decode_frames`` on small clips of every accepted codec and container, and on
every kind of file they refuse; all made in memory by tests/video_clips.py.

Decoded frames must equal, pixel for pixel, a plain sequential decode of the whole stream at the same
indices, whether the decoder seeks there or decodes straight on. Each refusal is a 400 with its own
code, the given param, and comes back within a couple of seconds.
"""

from __future__ import annotations

import functools
import resource
import time
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from app.errors import MediaError
from app.media.video import (
    DecodeStats,
    VideoInfo,
    VideoLimits,
    decode_frames,
    decode_frames_with_stats,
    probe_video,
)
from app.media.video_checks import (
    _SEGMENT,
    _TRACKS,
    ContainerFamily,
    TrackHeader,
    _elements,
    read_track_header,
    sniff_container,
)
from app.media.video_frames import SEEK_MIN_SKIPPED_FRAMES
from tests import video_clips as clips

PARAM = "messages[0].content[1].video_url.url"
LIMITS = VideoLimits()
MP4 = "mov,mp4,m4a,3gp,3g2,mj2"
MATROSKA = "matroska,webm"
_CRC32 = 0xBF  # the EBML CRC-32 element
REFUSAL_BUDGET_S = 2.0
VIDEO_CODES = {
    "invalid_video",
    "video_is_an_image",
    "unsupported_video_format",
    "unsupported_video_codec",
    "video_stream_missing",
    "video_empty",
    "video_dimensions_too_large",
    "video_too_long",
    "video_variable_frame_rate",
    "video_rotated",
    "video_truncated",
    "video_decode_timeout",
}

# (codec, PyAV output format): every accepted codec, in the containers clients send it in.
STREAMS = [
    ("h264", "mp4"),
    ("hevc", "mp4"),
    ("vp8", "webm"),
    ("vp9", "webm"),
    ("av1", "mp4"),
    ("av1", "webm"),
    ("vp9", "mp4"),
    ("h264", "matroska"),
]


@functools.cache
def clip(codec: str = "h264", container: str = "mp4", **options: int) -> bytes:
    """90 frames of 64x48 at 30 fps, a keyframe every 10 frames, unless ``options`` say otherwise."""
    settings = {"num_frames": 90, "gop": 10} | options
    return clips.make_clip(codec=codec, container=container, **settings)


@functools.cache
def reference(codec: str, container: str) -> np.ndarray:
    return clips.sequential_frames(clip(codec, container))


def probe(data: bytes, limits: VideoLimits = LIMITS) -> VideoInfo:
    return probe_video(data, limits=limits, param=PARAM)


def decode(
    data: bytes, indices: Sequence[int], limits: VideoLimits = LIMITS
) -> tuple[np.ndarray, DecodeStats]:
    return decode_frames_with_stats(data, probe(data), indices, limits=limits, param=PARAM)


def refusal(call: Callable[[], object]) -> MediaError:
    """The MediaError ``call`` raises, after checking it is a 400 naming PARAM, in time."""
    started = time.perf_counter()
    with pytest.raises(MediaError) as info:
        call()
    assert time.perf_counter() - started < REFUSAL_BUDGET_S
    err = info.value
    assert (err.http_status, err.err_type, err.param) == (400, "invalid_request_error", PARAM)
    assert err.code in VIDEO_CODES
    return err


def probe_refusal(data: bytes, limits: VideoLimits = LIMITS) -> str:
    return refusal(lambda: probe(data, limits)).code or ""


# -- probe ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("codec", "container"), STREAMS)
def test_probe_reports_the_stream(codec: str, container: str) -> None:
    family = MP4 if container == "mp4" else MATROSKA
    assert probe(clip(codec, container)) == VideoInfo(family, codec, 64, 48, 30.0, 90, 3.0)


def test_probe_reports_size_rate_and_length() -> None:
    data = clips.make_clip(width=320, height=240, fps=25, num_frames=40)
    assert probe(data) == VideoInfo(MP4, "h264", 320, 240, 25.0, 40, 1.6)


def test_probe_takes_an_index_first_mp4_and_a_live_webm() -> None:
    assert probe(clips.mp4_index_first(clip())).num_frames == 90
    assert probe(clips.matroska_unknown_size(clip("vp9", "webm"))).num_frames == 90
    live = clips.matroska_live(clip("vp9", "webm"))
    assert probe(live) == VideoInfo(MATROSKA, "vp9", 64, 48, 30.0, 90, 3.0)
    assert np.array_equal(decode(live, [0, 45, 89])[0], reference("vp9", "webm")[[0, 45, 89]])


def test_a_little_timestamp_jitter_is_a_constant_rate() -> None:
    jitter = [i * 100 + (13 if i % 3 == 1 else -9 if i % 3 == 2 else 0) for i in range(30)]
    assert probe(clips.make_clip(num_frames=30, pts=jitter)).fps == pytest.approx(30.0, rel=0.01)


@pytest.mark.parametrize(
    ("make", "family", "header"),
    [
        (lambda: clip(), ContainerFamily.MP4, TrackHeader(64, 48, False)),
        (lambda: clip("vp9", "webm"), ContainerFamily.MATROSKA, TrackHeader(64, 48, False)),
        (lambda: clips.make_clip(rotation_degrees=90), ContainerFamily.MP4, TrackHeader(64, 48, True)),
        (
            lambda: clips.make_clip(container="matroska", rotation_degrees=180),
            ContainerFamily.MATROSKA,
            TrackHeader(64, 48, True),
        ),
    ],
    ids=["mp4", "webm", "mp4-rotated", "mkv-rotated"],
)
def test_the_container_header_is_read_before_ffmpeg(
    make: Callable[[], bytes], family: ContainerFamily, header: TrackHeader
) -> None:
    data = make()
    assert sniff_container(data, param=PARAM) is family
    assert read_track_header(data, family) == header


def test_a_matroska_crc_whose_bytes_are_no_element_does_not_hide_the_track() -> None:
    """FFmpeg writes a CRC-32 first in Tracks; its 4 payload bytes are a checksum, not elements (all
    zeros cannot even start one)."""
    data = bytearray(clips.make_clip(container="matroska", rotation_degrees=180))
    ((_, start, end),) = [e for e in _elements(bytes(data), 0, len(data)) if e[0] == _SEGMENT]
    ((_, tracks_start, tracks_end),) = [e for e in _elements(bytes(data), start, end) if e[0] == _TRACKS]
    crc_id, crc_start, crc_end = _elements(bytes(data), tracks_start, tracks_end)[0]
    assert (crc_id, crc_end - crc_start) == (_CRC32, 4)
    data[crc_start:crc_end] = bytes(4)
    assert read_track_header(bytes(data), ContainerFamily.MATROSKA) == TrackHeader(64, 48, True)


# -- decode equals a sequential decode ----------------------------------------------------------------

SAMPLINGS = {
    "sparse": (list(range(0, 90, 30)), True),  # every 30th: seeks
    "dense": (list(range(90)), False),
    "every 7th": (list(range(0, 90, 7)), False),  # nearer than a seek pays
    "repeats": ([0, 0, 5, 5, 5, 89, 89], True),
    "first and last": ([0, 89], True),
    "last only": ([89], True),
    "first only": ([0], False),
}


@pytest.mark.parametrize(("codec", "container"), STREAMS)
def test_decoded_frames_equal_a_sequential_decode(codec: str, container: str) -> None:
    data, expected = clip(codec, container), reference(codec, container)
    assert expected.shape == (90, 48, 64, 3)
    for name, (indices, seeks) in SAMPLINGS.items():
        frames, stats = decode(data, indices)
        assert frames.dtype == np.uint8 and frames.shape == (len(indices), 48, 64, 3), name
        assert np.array_equal(frames, expected[indices]), name
        assert (stats.num_seeks > 0) == seeks, name


def test_decode_frames_returns_what_the_stats_variant_returns() -> None:
    data = clip()
    frames = decode_frames(data, probe(data), [3, 40], limits=LIMITS, param=PARAM)
    assert np.array_equal(frames, reference("h264", "mp4")[[3, 40]])


def test_no_indices_decode_nothing() -> None:
    frames, stats = decode(clip(), [])
    assert frames.shape == (0, 48, 64, 3) and stats == DecodeStats(0, 0)


def test_sparse_sampling_of_a_long_clip_decodes_few_frames() -> None:
    data = clip(num_frames=600)
    indices = list(range(5, 600, 60))  # 10 frames, each 5 past a keyframe
    frames, stats = decode(data, indices)
    assert np.array_equal(frames, clips.sequential_frames(data)[indices])
    assert stats.num_seeks == len(indices) - 1
    # From the keyframe before each wanted frame to it: 6 frames each, against 600 for the stream.
    assert stats.num_decoded_frames <= len(indices) * 10 < 600 // 5


def test_near_frames_decode_straight_on() -> None:
    step = SEEK_MIN_SKIPPED_FRAMES  # the next keyframe is never more than the rule's frames ahead
    indices = list(range(0, 90, step))
    _, stats = decode(clip(), indices)
    assert stats.num_seeks == 0 and stats.num_decoded_frames == indices[-1] + 1


def test_indices_out_of_order_or_range_are_a_caller_bug() -> None:
    data = clip()
    info = probe(data)
    for indices in ([5, 3], [-1], [90]):
        with pytest.raises(ValueError, match="ascending"):
            decode_frames(data, info, indices, limits=LIMITS, param=PARAM)


# -- refusals: probe ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (np.random.default_rng(4096).bytes(4096), "invalid_video"),
        (b"Not a video, just text.\n" * 40, "invalid_video"),
        (b"", "invalid_video"),
        (
            b"\x00\x00\x00\x18ftypisom" + np.random.default_rng(4000).bytes(4000),
            "invalid_video",
        ),  # MP4 magic, then junk
        (
            b"\x1a\x45\xdf\xa3" + np.random.default_rng(4000).bytes(4000),
            "invalid_video",
        ),  # Matroska magic, then junk
        (clips.image_bytes("PNG"), "video_is_an_image"),
        (clips.image_bytes("JPEG"), "video_is_an_image"),
        (clips.image_bytes("GIF"), "video_is_an_image"),
        (clips.image_bytes("WEBP"), "video_is_an_image"),
        (clips.image_bytes("AVIF"), "video_is_an_image"),  # an MP4-family file: FFmpeg would open it
        (clips.image_bytes("TIFF"), "video_is_an_image"),
        (clips.image_bytes("BMP"), "video_is_an_image"),
        (clips.animated_webp(), "video_is_an_image"),  # (an animated image, as a GIF)
    ],
    ids=[
        "random",
        "text",
        "empty",
        "mp4-junk",
        "mkv-junk",
        "png",
        "jpeg",
        "gif",
        "webp",
        "avif",
        "tiff",
        "bmp",
        "anim-webp",
    ],
)
def test_bytes_that_are_not_an_accepted_video(data: bytes, code: str) -> None:
    assert probe_refusal(data) == code


@pytest.mark.parametrize("container", ["avi", "flv", "mpegts"])
def test_other_containers_are_refused(container: str) -> None:
    assert probe_refusal(clips.make_clip(container=container, num_frames=10)) == "unsupported_video_format"


@pytest.mark.parametrize(("codec", "container"), [("mpeg4", "mp4"), ("mjpeg", "mov"), ("mjpeg", "matroska")])
def test_other_codecs_are_refused(codec: str, container: str) -> None:
    err = refusal(lambda: probe(clips.make_clip(codec=codec, container=container, num_frames=10)))
    assert err.code == "unsupported_video_codec" and codec in err.message


def test_a_codec_ffmpeg_cannot_decode_is_refused() -> None:
    assert probe_refusal(clips.mp4_with_codec_tag(clip(), b"xxxx")) == "unsupported_video_codec"


def test_audio_only_is_refused() -> None:
    assert probe_refusal(clips.audio_only_mp4()) == "video_stream_missing"


def test_a_video_track_without_frames_is_refused() -> None:
    empty = clips.mp4_without_samples(clips.mp4_index_first(clip()))
    assert probe_refusal(empty) == "video_empty"


def test_a_header_claiming_a_huge_frame_size_is_refused() -> None:
    huge = clips.mp4_claiming_size(clips.mp4_index_first(clip("vp9", "mp4")), 20000, 20000)
    err = refusal(lambda: probe(huge))
    assert err.code == "video_dimensions_too_large" and "20000x20000" in err.message


def test_frames_over_the_pixel_limit_are_refused() -> None:
    err = refusal(lambda: probe(clip(), VideoLimits(max_pixels=64 * 48 - 1)))
    assert err.code == "video_dimensions_too_large" and str(64 * 48 - 1) in err.message


@pytest.mark.parametrize("container", ["mp4", "webm"])
def test_a_keyframe_lying_about_its_size_allocates_nothing(container: str) -> None:
    """The container says 64x48; the VP9 keyframes say 16000x16000, which FFmpeg accepts: without the
    decoders' pixel guard, the probe's stream analysis and the decode each took 416 MB to try it."""
    lying = clips.vp9_claiming_size(clip("vp9", container), 16000, 16000)
    info = VideoInfo(MP4, "vp9", 64, 48, 30.0, 90, 3.0)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert probe_refusal(lying) == "invalid_video"
    err = refusal(lambda: decode_frames(lying, info, [0, 50], limits=LIMITS, param=PARAM))
    assert err.code == "invalid_video"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_kb < 50_000


@pytest.mark.parametrize(
    ("make", "limits"),
    [
        (lambda: clips.mp4_claiming_frames(clips.mp4_index_first(clip()), 1_000_000), LIMITS),
        (lambda: clips.make_clip(num_frames=90, fps=1, pts=[i * 5000 for i in range(90)]), LIMITS),
        (lambda: clips.matroska_claiming_duration(clip("vp9", "webm"), 10 * 3600.0), LIMITS),
        (lambda: clip(), VideoLimits(max_frames=89)),
        (lambda: clip("vp9", "webm"), VideoLimits(max_frames=89)),  # WebM declares no frame count
        (lambda: clip(), VideoLimits(max_duration_s=2.5)),
        (lambda: clips.matroska_live(clip("vp9", "webm")), VideoLimits(max_duration_s=2.5)),
    ],
    ids=[
        "1M-frames-declared",
        "timelapse-1-frame-in-50s",
        "10h-webm-declared",
        "frames",
        "frames-counted",
        "duration",
        "duration-counted",
    ],
)
def test_videos_over_the_length_limits_are_refused(make: Callable[[], bytes], limits: VideoLimits) -> None:
    assert probe_refusal(make(), limits) == "video_too_long"


@pytest.mark.parametrize("container", ["mp4", "webm"])
def test_a_variable_frame_rate_is_refused(container: str) -> None:
    codec = "h264" if container == "mp4" else "vp9"
    irregular = [0, 100, 200, 400, 500, 800, 900, 1000, 1300, 1400, 1500, 1600]  # 30, then 15 fps...
    vfr = clips.make_clip(codec=codec, container=container, num_frames=12, pts=irregular)
    assert probe_refusal(vfr) == "video_variable_frame_rate"


@pytest.mark.parametrize(
    ("container", "degrees"), [("mp4", 90), ("mp4", 180), ("webm", 270), ("matroska", 90)]
)
def test_a_rotated_video_is_refused(container: str, degrees: int) -> None:
    codec = "vp9" if container == "webm" else "h264"
    rotated = clips.make_clip(codec=codec, container=container, num_frames=10, rotation_degrees=degrees)
    assert probe_refusal(rotated) == "video_rotated"


@pytest.mark.parametrize(
    "cut",
    [
        lambda: clip(),  # index last: the cut takes it away
        lambda: clips.mp4_index_first(clip()),
        lambda: clip("vp9", "webm"),
        lambda: clips.mp4_media_to_end(clips.mp4_index_first(clip())),  # seen from the packets
        lambda: clips.matroska_unknown_size(clip("vp9", "webm")),  # seen from the duration
    ],
    ids=["mp4", "mp4-index-first", "webm", "mp4-media-to-end", "webm-live"],
)
def test_a_truncated_video_is_refused(cut: Callable[[], bytes]) -> None:
    data = cut()
    assert probe_refusal(data[: len(data) * 6 // 10]) == "video_truncated"


def test_a_probe_over_its_time_budget_is_refused() -> None:
    assert probe_refusal(clip(), VideoLimits(decode_timeout_s=0.0)) == "video_decode_timeout"


# -- refusals: decode -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make", [lambda: clips.mp4_index_first(clip()), lambda: clip("vp9", "webm")], ids=["mp4", "webm"]
)
def test_decoding_past_the_end_of_a_cut_file_is_refused(make: Callable[[], bytes]) -> None:
    data = make()
    info = probe(data)
    cut = data[: len(data) * 6 // 10]
    err = refusal(lambda: decode_frames(cut, info, [0, 45, 89], limits=LIMITS, param=PARAM))
    assert err.code == "video_truncated"
    assert np.array_equal(
        decode_frames(cut, info, [0, 20], limits=LIMITS, param=PARAM), clips.sequential_frames(data)[[0, 20]]
    )


def test_a_decode_over_its_time_budget_is_refused() -> None:
    data = clips.make_clip(width=320, height=240, num_frames=120, gop=120)
    info = probe(data)
    tiny = VideoLimits(decode_timeout_s=0.005)
    err = refusal(lambda: decode_frames(data, info, list(range(120)), limits=tiny, param=PARAM))
    assert err.code == "video_decode_timeout"


def test_decoded_frames_carrying_a_rotation_are_refused() -> None:
    """The probe refuses this file from its header; the frames' own display matrix is checked too."""
    rotated = clips.make_clip(num_frames=10, rotation_degrees=90)
    info = VideoInfo(MP4, "h264", 64, 48, 30.0, 10, 1 / 3)
    err = refusal(lambda: decode_frames(rotated, info, [0], limits=LIMITS, param=PARAM))
    assert err.code == "video_rotated"


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (np.random.default_rng(2048).bytes(2048), "invalid_video"),
        (clips.image_bytes("PNG"), "video_is_an_image"),
    ],
    ids=["random", "png"],
)
def test_decoding_bytes_that_are_not_a_video_is_refused(data: bytes, code: str) -> None:
    info = VideoInfo(MP4, "h264", 64, 48, 30.0, 10, 1 / 3)
    assert refusal(lambda: decode_frames(data, info, [0], limits=LIMITS, param=PARAM)).code == code


@pytest.mark.parametrize(
    ("make", "region"),
    [
        (lambda: clip(), None),
        (lambda: clips.mp4_index_first(clip()), 1200),  # the index: boxes, sizes, tables
        (lambda: clip("vp9", "webm"), 400),  # EBML header, segment info, tracks
        (lambda: clip("vp9", "webm"), None),
    ],
    ids=["mp4", "mp4-index", "webm-header", "webm"],
)
def test_damaged_bytes_give_frames_or_a_400_never_another_error(
    make: Callable[[], bytes], region: int | None
) -> None:
    """Bytes of a valid clip overwritten at random (seeded), anywhere or in its header: whatever FFmpeg
    makes of them, the answer is a probe and frames, or a MediaError, in time."""
    data = make()
    rng = np.random.default_rng(0)
    for _ in range(40):
        damaged = bytearray(data)
        for position in rng.integers(0, region or len(data), size=4):
            damaged[int(position)] = int(rng.integers(0, 256))
        started = time.perf_counter()
        try:
            info = probe(bytes(damaged))
            decode_frames(bytes(damaged), info, [0, info.num_frames - 1], limits=LIMITS, param=PARAM)
        except MediaError as err:
            assert (err.param, err.http_status, err.code in VIDEO_CODES) == (PARAM, 400, True)
        assert time.perf_counter() - started < REFUSAL_BUDGET_S
