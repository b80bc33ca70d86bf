"""Checks on a video's bytes that need no FFmpeg: which container it is (so FFmpeg opens it with that
demuxer only), whether it was cut, and what its header declares for the first video track (size,
display matrix).

Called by ``app.media.video`` before FFmpeg sees the bytes, so that images, other containers and
oversized or rotated tracks are refused from the header, and FFmpeg's format probing (which would
consider every demuxer it has, playlists included) never runs on client bytes. Every function here is
bounded by the length of the data and raises nothing but ``MediaError``.
"""

from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass

from app.errors import MediaError


class ContainerFamily(enum.Enum):
    """The containers accepted; the value is the FFmpeg demuxer that opens them (its full name)."""

    MP4 = "mov,mp4,m4a,3gp,3g2,mj2"  # ISO BMFF and QuickTime: .mp4, .m4v, .mov, .3gp
    MATROSKA = "matroska,webm"  # .mkv and .webm


@dataclass(frozen=True)
class TrackHeader:
    """What the container header declares for its first video track."""

    width: int
    height: int
    turned: bool  # the display matrix rotates or mirrors the picture


_FORMAT_NAMES = "MP4/MOV or WebM/Matroska"
_MP4_FIRST_BOXES = frozenset({b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot"})
_MP4_TOP_BOXES = _MP4_FIRST_BOXES | {b"moof", b"mfra", b"meta", b"uuid", b"sidx", b"styp", b"udta", b"pdin"}
_HEIF_BRANDS = frozenset(
    {b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1", b"avif", b"avis"}
)
_EBML_MAGIC = b"\x1a\x45\xdf\xa3"
_IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"II*\x00", b"MM\x00*", b"BM")
_OTHER_CONTAINERS = (  # (what the bytes start with, at offset, name in the message)
    (b"AVI ", 8, "AVI"),
    (b"FLV\x01", 0, "FLV"),
    (b"\x00\x00\x01\xba", 0, "MPEG program stream"),
    (b"OggS", 0, "Ogg"),
    (b"\x30\x26\xb2\x75\x8e\x66\xcf\x11", 0, "ASF/WMV"),
    (b".RMF", 0, "RealMedia"),
)


def sniff_container(data: bytes, *, param: str) -> ContainerFamily:
    """The container the bytes are, from their first bytes; an image, another container or anything
    else is refused (``video_is_an_image``, ``unsupported_video_format``, ``invalid_video``)."""
    if data[:4] == _EBML_MAGIC:
        return ContainerFamily.MATROSKA
    if data[4:8] in _MP4_FIRST_BOXES:
        if data[4:8] == b"ftyp" and data[8:12] in _HEIF_BRANDS:
            raise _image(param, "a HEIF/AVIF image")
        return ContainerFamily.MP4
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        # VP8X's flags byte has the animation bit (0x02): an animated image, as an animated GIF is
        if data[12:16] == b"VP8X" and len(data) > 20 and data[20] & 0x02:
            raise _image(param, "an animated WebP image")
        raise _image(param, "a WebP image")
    if data.startswith(_IMAGE_MAGIC):
        raise _image(param, "an image")
    for magic, offset, name in _OTHER_CONTAINERS:
        if data[offset : offset + len(magic)] == magic:
            raise _unsupported(param, name)
    if _is_mpeg_ts(data):
        raise _unsupported(param, "MPEG transport stream")
    raise MediaError(
        f"The bytes are not a video: expected {_FORMAT_NAMES}.", param=param, code="invalid_video"
    )


def _is_mpeg_ts(data: bytes) -> bool:
    """188-byte packets each starting with 0x47 (or 192-byte M2TS packets, 4 bytes in)."""
    return any(
        len(data) > start + 2 * step and all(data[start + k * step] == 0x47 for k in range(3))
        for start, step in ((0, 188), (4, 192))
    )


def rotated_error(param: str) -> MediaError:
    return MediaError(
        "The video is rotated or mirrored by its display matrix: send it upright.",
        param=param,
        code="video_rotated",
    )


def truncated_error(what: str, param: str) -> MediaError:
    return MediaError(f"The video is cut short: it {what}.", param=param, code="video_truncated")


def _image(param: str, what: str) -> MediaError:
    return MediaError(
        f"The video is {what}: send images as image_url parts.", param=param, code="video_is_an_image"
    )


def _unsupported(param: str, name: str) -> MediaError:
    return MediaError(
        f"{name} videos are not supported: send {_FORMAT_NAMES}.",
        param=param,
        code="unsupported_video_format",
    )


def read_track_header(data: bytes, family: ContainerFamily) -> TrackHeader | None:
    """The first video track's declared size and display matrix, or None where the header cannot be
    read here (FFmpeg then has the last word, and the decoded frames are checked again)."""
    try:
        return _mp4_track(data) if family is ContainerFamily.MP4 else _matroska_track(data)
    except (struct.error, LookupError, ValueError):
        return None


def cut_short(data: bytes, family: ContainerFamily) -> bool:
    """Whether a top-level MP4 box, or the Matroska segment, runs past the end of the data: the file
    was cut (an MP4 cut before its index is otherwise just unreadable)."""
    try:
        if family is ContainerFamily.MATROSKA:
            header_size, pos = _vint(data, 4, keep_marker=False)  # the EBML header, after its magic
            if header_size < 0:
                return False
            segment_id, pos = _vint(data, pos + header_size, keep_marker=True)
            segment_size, pos = _vint(data, pos, keep_marker=False)  # -1: unknown, as live streams
            return segment_id == _SEGMENT and segment_size >= 0 and pos + segment_size > len(data)
        pos = 0
        while pos + 8 <= len(data):
            size, kind = struct.unpack_from(">I4s", data, pos)
            if kind not in _MP4_TOP_BOXES:
                return False  # not an MP4 box: FFmpeg judges
            if size == 1:
                size = struct.unpack_from(">Q", data, pos + 8)[0]
            if size == 0:
                return False  # runs to the end, whatever the end is
            if size < 8:
                return False
            if pos + size > len(data):
                return True
            pos += size
        return False
    except (struct.error, LookupError, ValueError):
        return False


# -- MP4: moov / trak / (tkhd, mdia / (hdlr, minf / stbl / stsd)) --------------------------------


def _boxes(data: bytes, start: int, end: int) -> dict[bytes, tuple[int, int]]:
    """The first box of each type between start and end: type -> (payload start, box end)."""
    found: dict[bytes, tuple[int, int]] = {}
    pos = start
    while pos + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, pos)
        header = 8
        if size == 1:
            size, header = struct.unpack_from(">Q", data, pos + 8)[0], 16
        elif size == 0:
            size = end - pos
        if size < header:
            break
        found.setdefault(kind, (pos + header, min(pos + size, end)))
        pos += size
    return found


def _traks(data: bytes, start: int, end: int) -> list[tuple[int, int]]:
    traks, pos = [], start
    while pos + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, pos)
        if size < 8:
            break
        if kind == b"trak":
            traks.append((pos + 8, min(pos + size, end)))
        pos += size
    return traks


def _mp4_track(data: bytes) -> TrackHeader | None:
    moov = _boxes(data, 0, len(data)).get(b"moov")
    if moov is None:
        return None
    top = _boxes(data, *moov)
    movie = _matrix(data, top[b"mvhd"][0], 36, 48) if b"mvhd" in top else (0x10000, 0, 0, 0x10000)
    for trak in _traks(data, *moov):
        boxes = _boxes(data, *trak)
        mdia = _boxes(data, *boxes[b"mdia"]) if b"mdia" in boxes else {}
        if b"hdlr" not in mdia or data[mdia[b"hdlr"][0] + 8 : mdia[b"hdlr"][0] + 12] != b"vide":
            continue
        stbl = _boxes(data, *_boxes(data, *mdia[b"minf"])[b"stbl"])
        entry = stbl[b"stsd"][0] + 8  # version/flags, entry count, then the first sample entry
        width, height = struct.unpack_from(">HH", data, entry + 32)
        ta, tb, tc, td = _matrix(data, boxes[b"tkhd"][0], 40, 52)
        ma, mb, mc, md = movie  # FFmpeg shows the track matrix times the movie's (16.16 fixed point)
        a, b = (ta * ma + tb * mc) >> 16, (ta * mb + tb * md) >> 16
        c, d = (tc * ma + td * mc) >> 16, (tc * mb + td * md) >> 16
        return TrackHeader(width, height, matrix_turns(a, b, c, d))
    return None


def _matrix(data: bytes, payload: int, offset_v0: int, offset_v1: int) -> tuple[int, int, int, int]:
    """The 2x2 part (a, b, c, d) of the 3x3 matrix of an mvhd or tkhd box (version 0 or 1 layout)."""
    at = payload + (offset_v1 if data[payload] == 1 else offset_v0)
    a, b, _, c, d = struct.unpack_from(">iiiii", data, at)
    return a, b, c, d


def matrix_turns(a: int, b: int, c: int, d: int) -> bool:
    """Whether a display matrix's 2x2 part rotates or mirrors (scaling alone does neither)."""
    return b != 0 or c != 0 or a < 0 or d < 0


# -- Matroska: Segment / Tracks / TrackEntry / Video / (PixelWidth, PixelHeight, Projection) -------

_SEGMENT, _TRACKS, _CLUSTER, _TRACK_ENTRY = 0x18538067, 0x1654AE6B, 0x1F43B675, 0xAE
_TRACK_TYPE, _VIDEO, _PIXEL_WIDTH, _PIXEL_HEIGHT, _PROJECTION = 0x83, 0xE0, 0xB0, 0xBA, 0x7670
_PROJECTION_TYPE, _YAW, _PITCH, _ROLL = 0x7671, 0x7673, 0x7674, 0x7675


def _elements(data: bytes, start: int, end: int) -> list[tuple[int, int, int]]:
    """The EBML elements between start and end: (id, payload start, payload end). An element of unknown
    size runs to ``end``; the walk stops at the first Cluster, where the media data begins."""
    found, pos = [], start
    while pos < end:
        element_id, pos = _vint(data, pos, keep_marker=True)
        size, pos = _vint(data, pos, keep_marker=False)
        stop = end if size < 0 else min(pos + size, end)
        found.append((element_id, pos, stop))
        if element_id == _CLUSTER or size < 0 and element_id != _SEGMENT:
            break
        pos = stop
    return found


def _vint(data: bytes, pos: int, *, keep_marker: bool) -> tuple[int, int]:
    """An EBML variable-length integer at pos: (value, position after it); -1 for an unknown size."""
    first = data[pos]
    length = 9 - first.bit_length() if first else 9
    if length > 8:
        raise ValueError("EBML integer longer than 8 bytes")
    value = int.from_bytes(data[pos : pos + length], "big")
    if not keep_marker:
        value &= (1 << (7 * length)) - 1
        if value == (1 << (7 * length)) - 1:
            value = -1
    return value, pos + length


def _matroska_track(data: bytes) -> TrackHeader | None:
    for segment_id, start, end in _elements(data, 0, len(data)):
        if segment_id != _SEGMENT:
            continue
        for tracks_id, tracks_start, tracks_end in _elements(data, start, end):
            if tracks_id != _TRACKS:
                continue
            for entry_id, entry_start, entry_end in _elements(data, tracks_start, tracks_end):
                if entry_id != _TRACK_ENTRY:
                    continue  # e.g. a CRC-32 (FFmpeg writes one), whose payload is no element
                entry = {e: (s, t) for e, s, t in _elements(data, entry_start, entry_end)}
                if _uint(data, entry.get(_TRACK_TYPE)) == 1:
                    return _matroska_video(data, entry.get(_VIDEO))
    return None


def _matroska_video(data: bytes, video: tuple[int, int] | None) -> TrackHeader | None:
    if video is None:
        return None
    fields = {e: (s, t) for e, s, t in _elements(data, *video)}
    width, height = _uint(data, fields.get(_PIXEL_WIDTH)), _uint(data, fields.get(_PIXEL_HEIGHT))
    turned = False
    if _PROJECTION in fields:
        projection = {e: (s, t) for e, s, t in _elements(data, *fields[_PROJECTION])}
        yaw, pitch, roll = (_float(data, projection.get(key)) for key in (_YAW, _PITCH, _ROLL))
        # FFmpeg's rule: a flat projection (type 0) turned by yaw 180 (a mirror) and/or a roll.
        turned = (
            _uint(data, projection.get(_PROJECTION_TYPE)) in (None, 0)  # 0, flat, is the default
            and pitch == 0.0
            and yaw in (0.0, 180.0, -180.0)
            and not math.isnan(roll)
            and (yaw != 0.0 or roll % 360.0 != 0.0)
        )
    if width is None or height is None:
        return None
    return TrackHeader(width, height, turned)


def _uint(data: bytes, span: tuple[int, int] | None) -> int | None:
    return None if span is None else int.from_bytes(data[span[0] : span[1]], "big")


def _float(data: bytes, span: tuple[int, int] | None) -> float:
    if span is None:
        return 0.0
    raw = data[span[0] : span[1]]
    return struct.unpack(">f" if len(raw) == 4 else ">d", raw)[0] if len(raw) in (4, 8) else 0.0
