"""Worker process entry point: serve the engine's steps over a ZeroMQ DEALER socket.

    engine (ROUTER, binds worker_addr)                worker (DEALER, connects)
        ◀── [WorkerReady(device, dtype, num_kv_blocks, block_size)]   model loaded, KV pool allocated
        ──▶ [SchedulerOutput, tensor frames...]
        ◀── [RunnerOutput]  or  [WorkerError(step_id, message)]   one reply per step, in step order
        ──▶ [WorkerShutdown]                             the worker closes and returns

With ``--worker-step-overlap`` (on CUDA by default) a step whose successor is already waiting is answered
after that successor's forward was launched (``_serve``; docs/architecture.md, "Engine step").

A failing step is answered with ``WorkerError`` and the worker keeps serving; so is a message it cannot
take (one that does not decode, tensor frames that do not match, a step that contradicts its state),
which is also counted (wire/bad_messages.py) and reported in every reply's ``num_bad_messages``. SIGINT
ends the loop between steps; SIGTERM lets it serve on until ``WorkerShutdown`` (the engine drained) or
the shutdown timeout. If the engine goes away (its connection drops) the worker exits with
``ENGINE_LOST``: its KV and encoder outputs belong to that engine, and a new engine needs a new worker
(``mmserve serve`` and docker-compose's restart policy start one). The socket closes with linger 0.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec
import torch
import zmq
from transformers.utils import logging as transformers_logging
from zmq.utils.monitor import recv_monitor_message

from wire.bad_messages import BadMessage, BadMessageLog, check_tensor_frames, decode_frame0
from wire.curve import secure_client, uses_curve
from wire.protocol import (
    UNDECODABLE_STEP_ID,
    RunnerOutput,
    SchedulerOutput,
    WorkerError,
    WorkerInbound,
    WorkerReady,
    WorkerShutdown,
    decode_worker_inbound,
    encode,
)
from workers.config import WorkerConfig
from workers.frames import dtype_name
from workers.model_runner import EncoderOutputUnavailable, LaunchedStep, ModelRunner
from workers.runner_requests import StepError

logger = logging.getLogger(__name__)

# glibc's mallopt parameters
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
_POLL_INTERVAL_MS = 100  # how quickly a signal ends an idle loop
ENGINE_LOST = 3  # exit status when the engine's connection dropped
_Result = TypeVar("_Result", LaunchedStep, RunnerOutput)


class _Stop:
    """Set by signals: SIGINT stops between steps, SIGTERM at ``deadline`` unless WorkerShutdown comes
    first."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.now = threading.Event()
        self.deadline: float | None = None

    def on_sigterm(self) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + self.timeout_s
        else:
            self.now.set()

    def is_set(self) -> bool:
        return self.now.is_set() or (self.deadline is not None and time.monotonic() >= self.deadline)


def run_worker(config: WorkerConfig) -> int:
    """Load the model, connect to the engine, serve steps until WorkerShutdown or a signal; returns the
    exit status (0, or ``ENGINE_LOST``)."""
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # transformers' "Loading weights" bar would make tqdm create a multiprocessing RLock: under spawn or
    # forkserver a named semaphore in /dev/shm that only the resource tracker unlinks (a SIGKILLed group
    # leaks it)
    transformers_logging.disable_progress_bar()
    keep_freed_memory()
    torch.set_num_threads(config.threads or default_threads())
    runner = ModelRunner(
        config.model,
        config.device,
        block_size=config.block_size,
        kv_cache_tokens=config.kv_cache_tokens,
        gpu_memory_utilization=config.gpu_memory_utilization,
        attention=config.attention_backend,
        decode_graphs=False if config.enforce_eager else None,
        parts=config.parts,
        ec=config.ec,
    )
    stop = _Stop(config.shutdown_timeout)
    _handle_signals(stop)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if uses_curve(config.worker_addr, config.curve):
        assert config.curve is not None
        secure_client(sock, config.curve)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        sock.connect(config.worker_addr)
        ready = WorkerReady(
            device=str(runner.device),
            dtype=dtype_name(runner.dtype),
            num_kv_blocks=runner.num_kv_blocks,
            block_size=runner.block_size,
            has_vision_tower=config.parts.has_vision_tower,
            has_language_model=config.parts.has_language_model,
            vocab_size=runner.vocab_size,
        )
        sock.send_multipart([encode(ready)])
        logger.info("worker ready on %s, connected to %s", runner.device, config.worker_addr)
        overlap = config.step_overlap == "on" or (
            config.step_overlap == "auto" and runner.device.type == "cuda"
        )
        return _serve(sock, monitor, runner, stop, overlap)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()
        if threading.current_thread() is threading.main_thread():
            # stopping already: a further Ctrl-C must not cut the exit short
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        logger.info("worker stopped")


def default_threads() -> int:
    """The cores this process may use, less one for the API and engine processes, at least 1. More
    threads than free cores is much slower, not a little: PyTorch's OpenMP threads wait for each other at
    the end of every op, and one descheduled thread stalls them all (measured on 2 cores, tiny LLaVA,
    concurrency 16: 2 threads serve 5.7 requests/s with a cached image and 9.2 text-only, 1 thread 41 and
    53)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def keep_freed_memory() -> None:
    """glibc hands a freed block above 128 KiB straight back to the OS (mmap'd, or trimmed off the heap's
    top), so each step's large temporaries (K/V gathers, prefill activations) fault their pages in again,
    zeroed, every layer: on CPU that costs more than the copy itself. Keep up to 32 MiB blocks on the
    heap and up to 256 MiB free at its top (vLLM's CPU docs recommend tcmalloc for the same reason).
    A no-op where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_MMAP_THRESHOLD, 32 << 20)
    mallopt(M_TRIM_THRESHOLD, 256 << 20)


def _serve(sock: zmq.Socket, monitor: zmq.Socket, runner: ModelRunner, stop: _Stop, overlap: bool) -> int:
    """Serves steps until WorkerShutdown, a signal or the engine's loss (``_Steps`` runs them)."""
    bad_messages = BadMessageLog(logger)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)

    def send(reply: RunnerOutput | WorkerError) -> None:
        num_bad = sum(bad_messages.counts.values())
        sock.send_multipart([encode(msgspec.structs.replace(reply, num_bad_messages=num_bad))])

    steps = _Steps(runner, bad_messages, send, overlap)
    while not stop.is_set():
        if steps.in_flight is not None and not sock.poll(0):  # nothing waits behind it: answer it now
            steps.finish_in_flight()
            continue
        if steps.in_flight is None:
            events = dict(poller.poll(_POLL_INTERVAL_MS))
            if sock not in events:  # messages first: a WorkerShutdown comes just before the disconnect
                if monitor in events and recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
                    logger.error("the engine went away: exiting (a new engine needs a new worker)")
                    return ENGINE_LOST
                continue
        frames = sock.recv_multipart(copy=False)
        try:
            msg = decode_engine_message(frames)
        except BadMessage as bad:
            bad_messages.record("engine", bad)
            steps.finish_in_flight()
            steps.answer(WorkerError(UNDECODABLE_STEP_ID, str(bad)))
            continue
        if isinstance(msg, WorkerShutdown):
            steps.finish_in_flight()
            logger.info("shutdown requested by the engine")
            return 0
        steps.run(msg, frames)
    steps.finish_in_flight()
    return 0


class _Steps:
    """The worker's steps, answered in order. With ``overlap``, a step whose successor is already
    waiting stays unanswered (launched and sampled on the device, ``in_flight``) while that one is
    launched; then it is finished and answered, and the successor sampled. So the device runs step
    N+1's forward while the host finishes step N and answers it (docs/architecture.md, "Engine step").
    A successor with encoder work (items to encode or load) is launched only once the step before is
    answered: that work would hold the answer back."""

    def __init__(
        self,
        runner: ModelRunner,
        bad_messages: BadMessageLog,
        send: Callable[[RunnerOutput | WorkerError], None],
        overlap: bool,
    ) -> None:
        self.runner, self.bad_messages, self.send, self.overlap = runner, bad_messages, send, overlap
        self.in_flight: LaunchedStep | None = None  # sampled on the device, not answered
        self.after_failure = False  # the last step answered failed

    def answer(self, reply: RunnerOutput | WorkerError) -> None:
        self.send(reply)
        self.after_failure = isinstance(reply, WorkerError)

    def run(self, msg: SchedulerOutput, frames: Sequence[zmq.Frame]) -> None:
        loads = msg.ec_meta is not None and msg.ec_meta.load_mm_hashes
        if not self.overlap or msg.encoder_inputs or loads:
            self.finish_in_flight()
        launched = self._guarded(msg.step_id, _launch, self.runner, msg, frames)
        if not self.finish_in_flight() and isinstance(launched, LaunchedStep):
            # it continued from tokens the failed step did not produce (the engine fails it too)
            launched = WorkerError(launched.step_id, "the step before it failed")
        if isinstance(launched, WorkerError):
            self.answer(launched)
            return
        sampled = self._guarded(launched.step_id, self.runner.sample, launched)
        if isinstance(sampled, WorkerError):
            self.answer(sampled)
        elif self.overlap:
            self.in_flight = sampled
        else:
            self.answer(self._guarded(launched.step_id, self.runner.finish, launched))

    def finish_in_flight(self) -> bool:
        """Answers the step in flight, if any; False if it failed."""
        if self.in_flight is None:
            return True
        step, self.in_flight = self.in_flight, None
        reply = self._guarded(step.step_id, self.runner.finish, step)
        self.answer(reply)
        if isinstance(reply, WorkerError):
            self.runner.forget_pending()
        return isinstance(reply, RunnerOutput)

    def _guarded(self, step_id: int, call: Callable[..., _Result], *args: Any) -> _Result | WorkerError:
        """``call(*args)``, or the step's ``WorkerError`` when it failed or the step could not be taken
        (tensor frames that do not match its encoder inputs, a step contradicting this worker's state).
        A step refused right after a failed one is not counted as a bad message: the engine had sent
        it ahead of that failure's answer (it continues from what the failed step did not produce)."""
        try:
            return call(*args)
        except BadMessage as bad:
            self.bad_messages.record("engine", bad)
            return WorkerError(step_id=step_id, message=str(bad))
        except EncoderOutputUnavailable as exc:
            logger.warning("step %d: %s", step_id, exc)
            return WorkerError(step_id=step_id, message=str(exc), unavailable_mm_hashes=exc.mm_hashes)
        except StepError as exc:  # the step contradicts what this worker holds: nothing was changed
            if not self.after_failure:
                self.bad_messages.record("engine", BadMessage("step the worker cannot take", str(exc)))
            return WorkerError(step_id=step_id, message=f"{type(exc).__name__}: {exc}")
        except Exception as exc:
            logger.exception("step %d failed", step_id)
            return WorkerError(step_id=step_id, message=f"{type(exc).__name__}: {exc}")


def decode_engine_message(frames: Sequence[zmq.Frame]) -> WorkerInbound:
    """The engine's message in ``frames``; ``BadMessage`` when it does not decode."""
    msg: WorkerInbound = decode_frame0(decode_worker_inbound, [frames[0].buffer])
    if isinstance(msg, WorkerShutdown) and len(frames) != 1:
        raise BadMessage("extra frame", f"WorkerShutdown with {len(frames) - 1} more")
    return msg


def _launch(runner: ModelRunner, msg: SchedulerOutput, frames: Sequence[zmq.Frame]) -> LaunchedStep:
    """The step launched (``ModelRunner.launch``) once its tensor frames are checked against it."""
    refs = [ref for item in msg.encoder_inputs for ref in item.tensors.values()]
    if msg.grammar_bitmask is not None:
        refs.append(msg.grammar_bitmask.bitmask)
    check_tensor_frames(refs, [f.buffer for f in frames])
    return runner.launch(msg, frames)


def _handle_signals(stop: _Stop) -> None:
    """SIGINT/SIGTERM set ``stop``. Python only allows handlers in the main thread; elsewhere (a worker
    run in a thread, as tests do) the caller owns signals and this is a no-op."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_signal(signum: int, _frame: object) -> None:
        if signum == signal.SIGTERM:
            logger.info("SIGTERM: serving until the engine says shutdown, at most %gs", stop.timeout_s)
            stop.on_sigterm()
        else:
            logger.info("received %s, stopping", signal.Signals(signum).name)
            stop.now.set()

    signal.signal(signal.SIGINT, on_signal)
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:  # ignored: ``serve`` stops it by message
        signal.signal(signal.SIGTERM, on_signal)
