"""The frames of one video stream: first as its packets tell them, without decoding any
(``PacketTable``: each frame's presentation timestamp in presentation order, and the keyframes), then
decoded, only those wanted (``FrameDecoder``, which seeks to a far frame's keyframe).

``scan_packets`` runs in ``probe_video`` (to count frames and check their timing) and again in
``decode_frames`` (to name each decoded frame's index from its timestamp, and to know where a seek can
land). Demuxing is cheap next to decoding: microseconds a packet.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
from av.container import InputContainer
from av.sidedata.sidedata import SideData
from av.sidedata.sidedata import Type as SideDataType
from av.video.stream import VideoStream

from app.errors import MediaError
from app.media.video_checks import matrix_turns, rotated_error, truncated_error

# Seek rule: jump to the keyframe before the next wanted frame when that skips more than this many
# frames the decoder would otherwise decode and drop. A seek throws away what the decoder holds (its
# reorder and thread delay, a few frames), so shorter jumps decode straight on.
SEEK_MIN_SKIPPED_FRAMES = 8


@dataclass(frozen=True)
class PacketTable:
    """One entry per frame of the stream, frame i being the i-th in presentation order."""

    pts: np.ndarray  # int64 presentation timestamps, ascending, in ``time_base`` units
    keyframes: np.ndarray  # int64 indices of the frames a decode can start from, ascending
    time_base: Fraction
    truncated: bool  # a packet was cut short, or the demuxer failed after reading some

    @property
    def num_frames(self) -> int:
        return len(self.pts)

    def num_intact_frames(self, num_frames_probed: int) -> int:
        """How many frames, from the first, are whole and named by the right index: all of them, unless
        the data holds fewer frames than the probe counted or a packet was cut. Then only the frames
        before the last keyframe read: that group of pictures may miss frames (in decode order, a
        B-frame comes after the frame it precedes), which would shift the indices of the frames after."""
        if not self.truncated and self.num_frames >= num_frames_probed:
            return self.num_frames
        return int(self.keyframes[-1]) if len(self.keyframes) else 0

    def times_regular(self) -> bool:
        """Whether the timestamps are those of a constant frame rate: every frame within half a frame
        interval of where the mean interval puts it, i.e. frame i is the frame nearest to i / fps.
        Timestamp rounding and capture jitter pass; a rate that changes does not, nor two frames at one
        time."""
        if self.num_frames < 3:
            return self.num_frames < 2 or int(self.pts[1]) > int(self.pts[0])
        offsets = self.pts - int(self.pts[0])
        span, last = int(offsets[-1]), self.num_frames - 1
        if np.any(np.diff(offsets) <= 0):
            return False
        # |offset_i - i * span / last| <= span / last / 2, in integers: no rounding on long clips.
        deviation = np.abs(offsets * last - np.arange(self.num_frames, dtype=np.int64) * span)
        return bool(np.all(2 * deviation <= span))

    def span_s(self, fps: float) -> float:
        """Seconds from the first frame's start to the last frame's end."""
        if not self.num_frames:
            return 0.0
        return float((int(self.pts[-1]) - int(self.pts[0])) * self.time_base) + 1.0 / fps

    def measured_fps(self) -> float:
        """Frames a second from the timestamps (0.0 with fewer than two frames)."""
        if self.num_frames < 2 or self.pts[-1] <= self.pts[0]:
            return 0.0
        return (self.num_frames - 1) / float((int(self.pts[-1]) - int(self.pts[0])) * self.time_base)

    def index_of(self, pts: int | None) -> int | None:
        """The index of the frame with this timestamp, or None if no frame has it."""
        if pts is None:
            return None
        index = int(np.searchsorted(self.pts, pts))
        return index if index < self.num_frames and int(self.pts[index]) == pts else None

    def pts_of(self, index: int) -> int:
        return int(self.pts[index])

    def keyframe_at_or_before(self, index: int) -> int:
        """The last keyframe at or before frame ``index`` (0 if none is: the stream's start)."""
        at = int(np.searchsorted(self.keyframes, index, side="right")) - 1
        return int(self.keyframes[at]) if at >= 0 else 0


def scan_packets(
    container: InputContainer,
    stream: VideoStream,
    *,
    max_frames: int,
    deadline: Callable[[], None],
) -> PacketTable:
    """Demux every packet of ``stream`` from the start (at most ``max_frames`` + 1 of them, so a
    caller sees when there are more), calling ``deadline`` between packets.

    A packet without a timestamp is a ValueError (the caller maps it, and FFmpeg's errors, to a 400); a
    demuxer error after some packets marks the table truncated instead, as the data most likely ends
    there.
    """
    pts: list[int] = []
    key_pts: list[int] = []
    truncated = False
    try:
        for packet in container.demux(stream):
            deadline()
            if packet.size == 0:  # the empty packet at the end, which flushes a decoder
                continue
            if packet.pts is None:
                raise ValueError("a video packet has no timestamp")
            pts.append(packet.pts)
            if packet.is_keyframe:
                key_pts.append(packet.pts)
            truncated = truncated or packet.is_corrupt
            if len(pts) > max_frames:
                break
    except av.error.FFmpegError:
        if not pts:
            raise
        truncated = True
    sorted_pts = np.sort(np.asarray(pts, dtype=np.int64))
    keyframes = np.searchsorted(sorted_pts, np.sort(np.asarray(key_pts, dtype=np.int64)))
    time_base = stream.time_base or Fraction(1, 1)
    return PacketTable(sorted_pts, keyframes.astype(np.int64), time_base, truncated)


class FrameDecoder:
    """Decodes the wanted frames of one opened stream, in order, seeking forward when it pays.

    Frame indices come from timestamps (``PacketTable``), so a seek may land anywhere at or before the
    keyframe it asked for; one that lands past it (a demuxer seeking by decode time) turns seeking off
    and decoding starts over from the first frame.
    """

    def __init__(
        self,
        container: InputContainer,
        stream: VideoStream,
        table: PacketTable,
        size: tuple[int, int],
        deadline: Callable[[], None],
    ) -> None:
        self._container, self._stream, self._table, self._size = container, stream, table, size
        self._deadline = deadline
        self._decoded: Iterator[tuple[int, av.VideoFrame]] = iter(())
        self._next_index: int | None = None  # the index the decoder yields next; None: not started
        self._seeks_land = True
        self.num_decoded_frames = 0
        self.num_seeks = 0

    def frames_at(self, targets: list[int], *, param: str) -> Iterator[tuple[int, np.ndarray]]:
        """(index, RGB pixels) for each target (ascending, unique)."""
        for target in targets:
            keyframe = self._table.keyframe_at_or_before(target) if self._seeks_land else 0
            if self._next_index is None or keyframe - self._next_index > SEEK_MIN_SKIPPED_FRAMES:
                self._restart(keyframe, param)
            frame = self._advance_to(target, param)
            if frame is None:
                self._seeks_land = False
                self._restart(0, param)
                frame = self._advance_to(target, param)
            if frame is None:
                raise MediaError("The video's frames are out of order.", param=param, code="invalid_video")
            yield target, self._rgb(frame, param)

    def _advance_to(self, target: int, param: str) -> av.VideoFrame | None:
        """Decode on to frame ``target``; None if the decoder is already past it."""
        for index, frame in self._decoded:
            if index > target:
                return None
            self._next_index = index + 1
            if index == target:
                return frame
        raise truncated_error(f"ends before frame {target}", param)

    def _restart(self, keyframe: int, param: str) -> None:
        """Seek to ``keyframe`` (the stream's first frame for 0) and decode from there."""
        self._container.seek(self._table.pts_of(keyframe), stream=self._stream, backward=True)
        self.num_seeks += keyframe > 0
        self._next_index = keyframe
        self._decoded = self._decode(param)

    def _decode(self, param: str) -> Iterator[tuple[int, av.VideoFrame]]:
        for packet in self._container.demux(self._stream):
            self._deadline()
            if packet.is_corrupt:
                raise truncated_error("ends inside a frame", param)
            for frame in packet.decode():
                self.num_decoded_frames += 1
                self._deadline()
                index = self._table.index_of(frame.pts)
                if index is None:
                    raise MediaError(
                        "A decoded frame has no known timestamp.", param=param, code="invalid_video"
                    )
                yield index, frame

    def _rgb(self, frame: av.VideoFrame, param: str) -> np.ndarray:
        if (frame.width, frame.height) != self._size:
            raise MediaError(
                f"The video changes frame size mid-stream, to {frame.width}x{frame.height}.",
                param=param,
                code="invalid_video",
            )
        matrix = frame.side_data.get(SideDataType.DISPLAYMATRIX.name)
        if isinstance(matrix, SideData):
            a, b, _, c, d = struct.unpack("=5i", bytes(matrix)[:20])
            if matrix_turns(a, b, c, d):
                raise rotated_error(param)
        return frame.to_ndarray(format="rgb24")
