"""What runs in a preprocessing process (app/inputs/preprocess/pool.py) and the typed messages on its pipe."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import setproctitle
import torch

from app.child_processes import leave_fork_server
from app.errors import InternalError, MMServeError, from_family_error
from app.inputs.preprocess.transfer import ShmOutput, write_output
from app.inputs.preprocess.video_item import VideoRules, decode_and_process_video
from app.media.images import decode_image
from workers.families import load_processing
from workers.families.errors import FamilyInputError
from workers.families.processing import FamilyProcessor, ProcessedItem


def decode_and_process(
    family: FamilyProcessor,
    data: bytes,
    options: dict[str, Any],
    param: str,
    modality: str = "image",
    video: VideoRules | None = None,
) -> ProcessedItem:
    """Runs in a pool process, or in a thread of the API process without a pool."""
    if modality == "video":
        assert video is not None, "a pool that takes videos has their rules"
        return decode_and_process_video(family, data, options, param, video)
    pixels = decode_image(data, param=param)
    try:
        return family.process_image(pixels, options, param=param)
    except FamilyInputError as exc:
        raise from_family_error(exc) from exc


# -- messages over a pool process's pipe ------------------------------------------------------------


class Preprocess(msgspec.Struct, frozen=True, tag=True):
    """API → process: one image or video, whose encoded bytes are the next frame; the result goes to
    ``out_name``."""

    out_name: str
    options: dict[str, Any]
    param: str
    modality: str = "image"


class Loaded(msgspec.Struct, frozen=True, tag=True):
    """Process → API, once, first: the family is loaded."""


class Processed(msgspec.Struct, frozen=True, tag=True):
    output: ShmOutput


class Refused(msgspec.Struct, frozen=True, tag=True):
    """A request error: ``error`` names the ``MMServeError`` subclass, rebuilt as pickle would."""

    error: str
    message: str
    param: str | None
    code: str | None


class Failed(msgspec.Struct, frozen=True, tag=True):
    """Any other exception: a bug, logged with its traceback by the process."""

    error: str


Answer = Processed | Refused | Failed
Reply = Loaded | Answer
encoder = msgspec.msgpack.Encoder()
_preprocess_decoder = msgspec.msgpack.Decoder(Preprocess)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def _error_name(cls: type[MMServeError]) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def request_error(refused: Refused) -> MMServeError:
    classes: list[type[MMServeError]] = [MMServeError]
    found: type[MMServeError] = InternalError
    while classes:
        cls = classes.pop()
        if _error_name(cls) == refused.error:
            found = cls
            break
        classes.extend(cls.__subclasses__())
    error = found(refused.message)
    error.param, error.code = refused.param, refused.code
    return error


# -- in a pool process ------------------------------------------------------------------------------


def child_main(model: str, api_pid: int, conn: Connection, video: VideoRules | None = None) -> None:
    """A pool process: dies with the API process, leaves Ctrl-C and SIGTERM to it (a signal to the
    process group: the API drains, and its requests in flight may still need this process), loads the
    family, then answers one call at a time until the API closes its end of the pipe.

    Its parent is the fork server (app/child_processes.py), which exits when the API process does: then
    PR_SET_PDEATHSIG ends this process. One whose API was gone before that was set exits here, or at
    its first write to the pipe."""
    leave_fork_server()
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    try:
        os.kill(api_pid, 0)
    except ProcessLookupError:  # the API process died before prctl
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setproctitle.setproctitle("mmserve: preprocess")
    # one image at a time per process: a second OpenMP thread would only spin on a core the worker needs
    torch.set_num_threads(1)
    # on failure: a traceback in the log, EOF for the API. No --chat-template: it renders no prompt here
    family = load_processing(model)
    try:
        conn.send_bytes(encoder.encode(Loaded()))
        while True:
            call = _preprocess_decoder.decode(conn.recv_bytes())
            data = conn.recv_bytes()
            conn.send_bytes(encoder.encode(_answer(family, call, data, video)))
    except (EOFError, OSError):  # the API closed the pipe, or is gone
        pass
    # Nothing is left to close: skip the interpreter's finalization (a second with torch imported),
    # which the API's shutdown would wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _answer(family: FamilyProcessor, call: Preprocess, data: bytes, video: VideoRules | None) -> Answer:
    try:
        item = decode_and_process(family, data, call.options, call.param, call.modality, video)
        return Processed(write_output(item, call.out_name))
    except MMServeError as exc:
        return Refused(_error_name(type(exc)), exc.message, exc.param, exc.code)
    except Exception as exc:
        traceback.print_exc()
        return Failed(f"{type(exc).__name__}: {exc}")


# -- in the API process -----------------------------------------------------------------------------
