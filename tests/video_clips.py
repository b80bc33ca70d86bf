"""Test videos made in memory with PyAV: deterministic moving patterns, and the odd files the video
decoder must refuse, each made the cheapest real way (encoded, muxed, or a real clip's header edited
in place the way another writer would have written it). Nothing here touches the disk or the network.
Used by tests/unit/test_video_decoding.py.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Sequence
from fractions import Fraction

import av
import numpy as np
from PIL import Image

_ENCODERS = {
    "h264": "libx264",
    "hevc": "libx265",
    "vp8": "libvpx",
    "vp9": "libvpx-vp9",
    "av1": "libsvtav1",
    "mpeg4": "mpeg4",  # MPEG-4 part 2, refused
    "mjpeg": "mjpeg",  # refused
}
_TICKS_PER_FRAME = 100  # clips are written with time base 1 / (fps * 100): room for irregular pts
_STBL = [b"moov", b"trak", b"mdia", b"minf", b"stbl"]


def pattern_frame(index: int, *, width: int, height: int, seed: int = 0) -> np.ndarray:
    """Frame ``index`` of the pattern, RGB: a gradient in colours drawn from ``seed``, and a square of
    another colour moving across it (so every index gives different pixels)."""
    rng = np.random.default_rng(seed)
    start, end, square = (rng.integers(0, 256, size=3) for _ in range(3))
    ramp = (np.arange(width, dtype=np.float32) / max(width - 1, 1))[None, :, None]
    shade = (np.arange(height, dtype=np.float32) / max(height - 1, 1))[:, None, None]
    frame = np.clip((start * (1 - ramp) + end * ramp) * (0.6 + 0.4 * shade), 0, 255).astype(np.uint8)
    side = max(4, min(width, height) // 4)
    x, y = (index * 3) % max(width - side, 1), (index * 2) % max(height - side, 1)
    frame[y : y + side, x : x + side] = square.astype(np.uint8)
    return frame


def make_clip(
    *,
    width: int = 64,
    height: int = 48,
    fps: int = 30,
    num_frames: int = 30,
    codec: str = "h264",
    container: str = "mp4",
    gop: int = 10,
    seed: int = 0,
    pts: Sequence[int] | None = None,
    rotation_degrees: float | None = None,
) -> bytes:
    """A clip of the moving pattern: ``codec`` (h264, hevc, vp8, vp9, av1, mpeg4, mjpeg) in
    ``container`` (a PyAV output format: mp4, mov, webm, matroska, avi, flv, mpegts...), a keyframe
    every ``gop`` frames. Frame i is at i / ``fps`` s unless ``pts`` gives each frame's timestamp in
    1 / (``fps`` * 100) s units (irregular ones make a variable frame rate). ``rotation_degrees`` writes
    a display matrix (MP4 ``tkhd`` matrix, Matroska projection roll). MP4s have their index (moov) last,
    as FFmpeg writes them; ``mp4_index_first`` moves it."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(_ENCODERS[codec], rate=fps, options=_encoder_options(codec, gop))
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        ticks = 1 if codec == "mpeg4" else _TICKS_PER_FRAME  # mpeg4 takes only its frame rate's
        time_base = Fraction(1, fps * ticks)
        stream.codec_context.time_base = time_base
        if rotation_degrees is not None:
            stream.set_display_rotation(rotation_degrees)
        for i in range(num_frames):
            rgb = pattern_frame(i, width=width, height=height, seed=seed)
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts, frame.time_base = (pts[i] if pts is not None else i * ticks), time_base
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def _encoder_options(codec: str, gop: int) -> dict[str, str]:
    if codec == "h264":  # B-frames on, so presentation and decode order differ
        return {"g": str(gop), "preset": "ultrafast", "bf": "2", "sc_threshold": "0"}
    if codec == "hevc":
        return {"preset": "ultrafast", "x265-params": f"keyint={gop}:min-keyint={gop}:log-level=none"}
    if codec in ("vp8", "vp9"):
        return {"g": str(gop), "deadline": "realtime", "cpu-used": "8", "lag-in-frames": "0"}
    if codec == "av1":
        return {"g": str(gop), "preset": "12"}
    return {"g": str(gop)}


def sequential_frames(data: bytes) -> np.ndarray:
    """Every frame of the first video stream, decoded in order from the start (the reference)."""
    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


# -- images, other containers, no video ----------------------------------------------------------


def image_bytes(fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pattern_frame(0, width=32, height=24)).save(buf, format=fmt)
    return buf.getvalue()


def animated_webp(num_frames: int = 4) -> bytes:
    frames = [Image.fromarray(pattern_frame(i, width=32, height=24)) for i in range(num_frames)]
    buf = io.BytesIO()
    frames[0].save(buf, format="WEBP", save_all=True, append_images=frames[1:], duration=100)
    return buf.getvalue()


def audio_only_mp4(num_packets: int = 10) -> bytes:
    """AAC in MP4 (an .m4a): a valid file without a video stream."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("aac", rate=16000)
        for i in range(num_packets):
            samples = np.sin(np.arange(1024, dtype=np.float32) * 0.05 * (i + 1))[None, :]
            frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 16000, i * 1024
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


# -- MP4 boxes, edited in place ----------------------------------------------------------------------


def mp4_boxes(
    data: bytes | bytearray, start: int = 0, end: int | None = None
) -> list[tuple[bytes, int, int]]:
    """The boxes between ``start`` and ``end``: (type, offset of the box, offset past its end)."""
    boxes, pos, stop = [], start, len(data) if end is None else end
    while pos + 8 <= stop:
        size, kind = struct.unpack_from(">I4s", data, pos)
        size = size or stop - pos
        boxes.append((kind, pos, pos + size))
        pos += size
    return boxes


def mp4_find(data: bytes | bytearray, path: Sequence[bytes]) -> list[int]:
    """Offsets of every box at ``path`` (e.g. ``[b"moov", b"trak", b"tkhd"]``), in file order."""
    found, level = [], [(0, len(data))]
    for depth, kind in enumerate(path):
        inner = []
        for start, end in level:
            for box_kind, box_start, box_end in mp4_boxes(data, start, end):
                if box_kind == kind:
                    inner.append((box_start + 8, box_end))
                    if depth == len(path) - 1:
                        found.append(box_start)
        level = inner
    return found


def mp4_index_first(data: bytes) -> bytes:
    """The MP4 with its index (moov) before the media data, as ``-movflags +faststart`` writes it (PyAV
    cannot: that needs a second pass over a named file); the chunk offsets move by the moov's size."""
    boxes = {kind: (start, end) for kind, start, end in mp4_boxes(data)}
    moov_start, moov_end = boxes[b"moov"]
    moov = bytearray(data[moov_start:moov_end])
    for stco in mp4_find(moov, [*_STBL, b"stco"]):
        (count,) = struct.unpack_from(">I", moov, stco + 12)
        for i in range(count):
            at = stco + 16 + 4 * i
            struct.pack_into(">I", moov, at, struct.unpack_from(">I", moov, at)[0] + len(moov))
    ftyp_end = boxes[b"ftyp"][1]
    return data[:ftyp_end] + bytes(moov) + data[ftyp_end:moov_start] + data[moov_end:]


def mp4_without_samples(data: bytes) -> bytes:
    """The MP4 with its sample tables emptied and durations zero: a video track holding no frame, as a
    recorder stopped before its first frame writes it."""
    edited = bytearray(data)
    for box in (b"stts", b"stsc", b"stco", b"stss", b"ctts"):
        for at in mp4_find(edited, [*_STBL, box]):
            struct.pack_into(">I", edited, at + 12, 0)  # entry count
    for at in mp4_find(edited, [*_STBL, b"stsz"]):
        struct.pack_into(">II", edited, at + 12, 0, 0)  # sample size, sample count
    for path, offset in (([b"moov", b"mvhd"], 24), ([b"moov", b"trak", b"tkhd"], 28)):
        for at in mp4_find(edited, path):
            struct.pack_into(">I", edited, at + offset, 0)  # duration
    for at in mp4_find(edited, [b"moov", b"trak", b"mdia", b"mdhd"]):
        struct.pack_into(">I", edited, at + 24, 0)
    return bytes(edited)


def mp4_claiming_frames(data: bytes, num_frames: int) -> bytes:
    """The MP4 with its time-to-sample table declaring ``num_frames`` frames (the count FFmpeg reports)."""
    edited = bytearray(data)
    (at,) = mp4_find(edited, [*_STBL, b"stts"])
    struct.pack_into(">I", edited, at + 16, num_frames)  # the first entry's sample count
    return bytes(edited)


def mp4_claiming_size(data: bytes, width: int, height: int) -> bytes:
    """The MP4 with its sample entry and track header declaring ``width`` x ``height``; for VP9, so do
    the keyframes' own headers (a file whose every header agrees on the size, though its pixels are
    the small clip's)."""
    edited = bytearray(vp9_claiming_size(data, width, height))
    (stsd,) = mp4_find(edited, [*_STBL, b"stsd"])
    struct.pack_into(">HH", edited, stsd + 16 + 32, width, height)
    (tkhd,) = mp4_find(edited, [b"moov", b"trak", b"tkhd"])
    struct.pack_into(">II", edited, tkhd + 8 + 76, width << 16, height << 16)
    return bytes(edited)


def mp4_with_codec_tag(data: bytes, tag: bytes) -> bytes:
    """The MP4 with its sample entry's codec four-cc replaced (``b"xxxx"``: a codec FFmpeg has no
    decoder for)."""
    edited = bytearray(data)
    (stsd,) = mp4_find(edited, [*_STBL, b"stsd"])
    edited[stsd + 16 + 4 : stsd + 16 + 8] = tag
    return bytes(edited)


def mp4_media_to_end(data: bytes) -> bytes:
    """The MP4 with its mdat box's size 0 ("runs to the end of the file", as live writers leave it), so
    a cut is seen only from the packets."""
    edited = bytearray(data)
    for kind, start, _ in mp4_boxes(edited):
        if kind == b"mdat":
            struct.pack_into(">I", edited, start, 0)
    return bytes(edited)


# -- VP9 and Matroska -------------------------------------------------------------------------------


def vp9_claiming_size(data: bytes, width: int, height: int) -> bytes:
    """Every VP9 keyframe header (profile 0) rewritten to say ``width`` x ``height``. The size fields sit
    at fixed bits: a frame-marker byte, the sync code 49 83 42, 4 bits of colour, then width - 1 and
    height - 1 in 16 bits each."""
    edited = bytearray(data)
    at = edited.find(b"\x49\x83\x42")
    while at > 0:
        marker = edited[at - 1]
        if marker & 0xF0 == 0x80 and not marker & 0x04:  # frame marker, profile 0, keyframe
            bits = int.from_bytes(edited[at + 3 : at + 8], "big")
            bits = (bits & ~(0xFFFFFFFF << 4)) | (((width - 1) << 16 | (height - 1)) << 4)
            edited[at + 3 : at + 8] = bits.to_bytes(5, "big")
        at = edited.find(b"\x49\x83\x42", at + 3)
    return bytes(edited)


def matroska_unknown_size(data: bytes) -> bytes:
    """The Matroska file with its Segment's size "unknown" (all ones), as live recorders (a browser's
    MediaRecorder) write it, so a cut is seen only from the packets and durations."""
    edited = bytearray(data)
    at = edited.find(b"\x18\x53\x80\x67") + 4  # the Segment id, then its size
    length = 9 - edited[at].bit_length()
    edited[at : at + length] = bytes([(1 << (9 - length)) - 1]) + b"\xff" * (length - 1)
    return bytes(edited)


def matroska_live(data: bytes) -> bytes:
    """The Matroska file as a browser's MediaRecorder writes it: Segment size unknown and no Duration
    (the element overwritten by a Void one of the same length), so its length is known only by
    counting its frames."""
    edited = bytearray(matroska_unknown_size(data))
    at = edited.find(b"\x44\x89", edited.find(b"\x15\x49\xa9\x66"))  # Duration, inside Info
    length = edited[at + 2] & 0x7F
    edited[at : at + 3 + length] = bytes([0xEC, 0x80 | (length + 1)]) + bytes(length + 1)
    return bytes(edited)


def matroska_claiming_duration(data: bytes, duration_s: float) -> bytes:
    """The Matroska file with its Segment Info Duration (a float, in ms) saying ``duration_s``."""
    edited = bytearray(data)
    at = edited.find(b"\x44\x89", edited.find(b"\x15\x49\xa9\x66"))  # Duration, inside Info
    length = edited[at + 2] & 0x7F  # its size: a one-byte vint here (4 or 8)
    fmt = ">f" if length == 4 else ">d"
    struct.pack_into(fmt, edited, at + 3, duration_s * 1000.0)
    return bytes(edited)
