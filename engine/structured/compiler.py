"""Compiles constraints into grammars off the engine's step loop, into a compiled-grammar cache bounded
in bytes (docs/architecture.md, "Structured outputs").

    AddRequest(constraint) ──▶ request() ──▶ cache hit: a Ticket that is ready now
                                        └──▶ miss: a compile thread (one per constraint, however many
                                             requests ask) ──done──▶ wake() ──▶ the engine loop polls

xgrammar releases the GIL while it compiles, so steps run on meanwhile. A request that waited past the
timeout stops waiting (a 400). Its compile is then abandoned as far as xgrammar allows: one that has not
started is cancelled once no request waits for it (each ticket is released when its request stops
waiting, for whatever reason), so compiles nobody wants never queue up before wanted ones. One that
runs cannot be interrupted inside xgrammar (returning its grammar from a process that could be killed
costs several times the compile: ``CompiledGrammar`` crosses only as JSON): it runs to its end (the
constraint's size is bounded at the HTTP edge) and lands in the cache for whoever asks next. A
constraint whose compile alone ran past the timeout is refused at once for a while (``_too_slow``,
bounded), unless the cache holds its grammar: waiting would end in the same 400. All methods but the
compile itself run on the engine's thread.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from engine.config import StructuredOutputOptions
from engine.structured.backend import CompileError, XGrammarBackend
from engine.structured.grammar import RequestGrammar
from wire.protocol import Constraint

NUM_COMPILE_THREADS = 2
MAX_TOO_SLOW = 256  # constraints remembered as compiling past the timeout (refused at once) ...
TOO_SLOW_FOR_S = 600.0  # ... for this long: a compile slowed by a busy machine gets another chance
CacheKey = tuple[int, tuple[str, str, bool]]  # (vocab size, constraint key)


@dataclass
class Ticket:
    """A request's wait for its grammar: ``compiled`` at once on a cache hit, else a compile's future."""

    key: CacheKey
    deadline: float
    compiled: Any = None
    future: Future[tuple[Any, float]] | None = None


@dataclass
class CompilerStats:
    """Cumulative since the engine started (forwarded as the ``mmserve_structured_output_*`` metrics)."""

    num_hits: int = 0
    num_misses: int = 0
    num_failures: int = 0  # invalid constraints, timeouts included
    num_timeouts: int = 0
    compile_seconds: list[float] = field(default_factory=list)  # drained by each stats snapshot


class GrammarCompiler:
    def __init__(self, options: StructuredOutputOptions, wake: Callable[[], None]) -> None:
        """``wake``: called from a compile thread when a compile ends (the engine loop then polls)."""
        self.options = options
        self._wake = wake
        self._pool = ThreadPoolExecutor(NUM_COMPILE_THREADS, thread_name_prefix="mmserve-grammar")
        self._cache: OrderedDict[CacheKey, tuple[Any, int]] = OrderedDict()  # LRU: compiled, bytes
        self.cache_bytes = 0
        self._compiling: dict[CacheKey, Future[tuple[Any, float]]] = {}
        self._waiters: dict[CacheKey, int] = {}  # tickets still waiting for each compile
        self._started: dict[CacheKey, float] = {}  # when each running compile started (its thread sets it)
        self._too_slow: OrderedDict[CacheKey, float] = OrderedDict()  # compiles that alone overran: when
        self._backends: dict[int, XGrammarBackend] = {}
        self._backend_lock = threading.Lock()
        self._loaded_at: dict[int, float] = {}  # vocab size -> when its backend was ready
        self.stats = CompilerStats()

    def request(self, constraint: Constraint, vocab_size: int, now: float | None = None) -> Ticket:
        """Called when a constrained request arrives: its grammar from the cache, or a compile started
        (or joined, when another request already asked for the same constraint)."""
        now = time.monotonic() if now is None else now
        self._absorb_finished()
        key: CacheKey = (vocab_size, constraint.key)
        deadline = now + self.options.compile_timeout_s
        if key in self._cache:
            self._cache.move_to_end(key)
            self.stats.num_hits += 1
            return Ticket(key, deadline, compiled=self._cache[key][0])
        self.stats.num_misses += 1
        marked, started = self._too_slow.get(key), self._started.get(key)
        if (marked is not None and now - marked < TOO_SLOW_FOR_S) or (
            started is not None and now - started >= self.options.compile_timeout_s
        ):
            self._remember_too_slow(key, now)
            deadline = now  # its compile takes longer than a request may wait: the 400 at once
        future = self._compiling.get(key)
        if future is None and deadline > now:
            future = self._pool.submit(self._compile, key, constraint, vocab_size)
            future.add_done_callback(self._ended)
            self._compiling[key] = future
        if future is None:
            return Ticket(key, deadline)
        self._waiters[key] = self._waiters.get(key, 0) + 1
        return Ticket(key, deadline, future=future)

    def release(self, ticket: Ticket) -> None:
        """The ticket's request stopped waiting (its grammar came, it failed, or the request ended):
        a compile nobody waits for any more is cancelled if it has not started. Called once per
        ticket."""
        if ticket.future is None:
            return
        key = ticket.key
        self._waiters[key] -= 1
        if self._waiters[key] > 0:
            return
        del self._waiters[key]
        if self._compiling.get(key) is ticket.future and ticket.future.cancel():
            del self._compiling[key]

    def poll(self, ticket: Ticket, now: float | None = None) -> Any:
        """The compiled grammar, or None while it compiles; raises ``CompileError`` if it failed or the
        ticket's deadline passed (counted from the request's arrival, its wait for a compile thread
        included, but not before the backend has loaded: the first compile's load is not held against
        it)."""
        if ticket.compiled is not None:
            return ticket.compiled
        now = time.monotonic() if now is None else now
        loaded_at = self._loaded_at.get(ticket.key[0])  # loading xgrammar and the tokenizer is not compiling
        deadline = (
            ticket.deadline
            if loaded_at is None
            else max(ticket.deadline, loaded_at + self.options.compile_timeout_s)
        )
        if ticket.future is not None and ticket.future.done():
            self._absorb_finished()
            compiled, _ = ticket.future.result()  # raises the compile's CompileError
            # ready after the wait ended is a timeout, however late the loop looked (a busy machine's)
            if getattr(ticket.future, "ended_at", now) < deadline:
                ticket.compiled = compiled
                return compiled
            raise self._timed_out()
        if (loaded_at is not None or ticket.future is None) and now >= deadline:
            raise self._timed_out()
        return None

    def _timed_out(self) -> CompileError:
        self.stats.num_timeouts += 1
        self.stats.num_failures += 1
        return CompileError(
            f"compiling the constraint took longer than {self.options.compile_timeout_s:g} s "
            "(--structured-output-compile-timeout-s)",
            code="constraint_compile_timeout",
        )

    def _ended(self, future: Future[Any]) -> None:
        """A compile's end (in the thread that ran it): when its grammar became ready."""
        future.ended_at = time.monotonic()  # type: ignore[attr-defined]
        self._wake()

    def num_compiling(self) -> int:
        """Compiles still running (finished ones are moved into the cache first)."""
        self._absorb_finished()
        return len(self._compiling)

    def matcher(self, ticket: Ticket, stop_token_ids: list[int]) -> RequestGrammar:
        """A matcher of the ticket's compiled grammar for one request (after ``poll`` returned it)."""
        return self._backends[ticket.key[0]].matcher(ticket.compiled, stop_token_ids)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ internals

    def _absorb_finished(self) -> None:
        """Moves finished compiles into the cache (even those whose requests stopped waiting)."""
        for key, future in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[key]
            self._started.pop(key, None)
            try:
                compiled, seconds = future.result()
            except (CompileError, CancelledError):  # (cancelled: only by close)
                self.stats.num_failures += 1
                self._too_slow.pop(key, None)  # a repeat gets the real error, not a timeout
                continue
            self.stats.compile_seconds.append(seconds)
            self._insert(key, compiled)
            if key in self._cache:  # served from the cache, however long it took
                self._too_slow.pop(key, None)
            elif seconds >= self.options.compile_timeout_s:
                self._remember_too_slow(key, time.monotonic())

    def _remember_too_slow(self, key: CacheKey, now: float) -> None:
        self._too_slow[key] = now
        self._too_slow.move_to_end(key)
        while len(self._too_slow) > MAX_TOO_SLOW:
            self._too_slow.popitem(last=False)

    def _insert(self, key: CacheKey, compiled: Any) -> None:
        """LRU by bytes; a grammar larger than the whole cache is used once and not kept."""
        num_bytes = int(compiled.memory_size_bytes)
        if num_bytes > self.options.cache_bytes:
            return
        while self.cache_bytes + num_bytes > self.options.cache_bytes:
            _, (_, evicted_bytes) = self._cache.popitem(last=False)
            self.cache_bytes -= evicted_bytes
        self._cache[key] = (compiled, num_bytes)
        self.cache_bytes += num_bytes

    def _compile(self, key: CacheKey, constraint: Constraint, vocab_size: int) -> tuple[Any, float]:
        """In a compile thread: (compiled grammar, seconds it took). Raises ``CompileError``, whatever
        went wrong (the engine's loop must not see another exception)."""
        try:
            backend = self._backend(vocab_size)
            self._started[key] = time.monotonic()
            start = time.perf_counter()
            compiled = backend.compile(constraint)
        except CompileError:
            raise
        except MemoryError as exc:
            raise CompileError("compiling the constraint ran out of memory", "constraint_too_large") from exc
        except Exception as exc:  # an xgrammar fault: this request fails, the engine serves on
            raise CompileError(
                f"the constraint could not be compiled ({exc})", "constraint_compile_failed", 500
            ) from exc
        return compiled, time.perf_counter() - start

    def _backend(self, vocab_size: int) -> XGrammarBackend:
        with self._backend_lock:  # the first compile loads the tokenizer; the others wait for it
            if vocab_size not in self._backends:
                self._backends[vocab_size] = XGrammarBackend(self.options.model_dir, vocab_size)
                self._loaded_at[vocab_size] = time.monotonic()
            return self._backends[vocab_size]
