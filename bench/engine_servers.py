"""The servers of bench/bench_engine.py: ``mmserve serve`` from a tree (this checkout, or a ``git worktree``
of another revision) with the flags that revision has, and vLLM's CPU peer through its ``serve.sh``; each
in its own process group, stopped with it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench_throughput import Proc, cli_module, free_port, wait_healthy

# what keeps the servers comparable: vLLM's serve.sh runs --max-model-len 4096, and these are the step
# budgets vLLM's CPU OpenAI server defaults to (128 seqs; at most 64 are ever in flight here); the KV pool
# and block size are mmserve's CPU defaults, stated
MMSERVE_FLAGS = [
    "--max-model-len", "4096", "--max-num-seqs", "64", "--max-num-batched-tokens", "2048",
    "--kv-cache-tokens", "65536", "--block-size", "16",
]  # fmt: skip
VLLM_FLAGS = "--max-num-seqs 64 --max-num-batched-tokens 2048"


@dataclass
class Server:
    label: str  # its first word names it in ratios and log files
    kind: str  # "mmserve" | "vllm"
    flags: list[str]
    cwd: Path | None = None  # mmserve: the tree it runs from
    notes: list[str] = field(default_factory=list)


class VllmProc:
    """``serve.sh PORT FLAGS`` in its own process group, output to a log file."""

    def __init__(self, serve_sh: Path, port: int, flags: list[str], vllm_dir: Path, log_path: Path) -> None:
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                ["bash", str(serve_sh), str(port), *flags],
                env={**os.environ, "VLLM_CPU_DIR": str(vllm_dir)},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self) -> None:
        """SIGTERM to the group (as serve.sh says), SIGKILL if it is not gone within 30 s."""
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()


@contextmanager
def serving(server: Server, vllm_peer: Path, vllm_dir: Path, folder: Path) -> Iterator[str]:
    """The server's base URL once ``/health`` answers 200; stopped, with its process group, on exit (a
    second Ctrl-C while it stops is ignored, so that none is left running)."""
    port = free_port()
    log_path = folder / f"{server.label.split()[0]}-{port}.log"
    proc: Proc | VllmProc
    if server.kind == "vllm":
        proc = VllmProc(vllm_peer / "serve.sh", port, server.flags, vllm_dir, log_path)
    else:
        assert server.cwd is not None
        proc = Proc(["serve", *server.flags, "--port", str(port)], server.cwd, log_path)
    try:
        started = time.monotonic()
        wait_healthy(f"http://127.0.0.1:{port}", [proc], timeout_s=600.0)
        print(f"  healthy after {time.monotonic() - started:.0f} s (log {log_path})", flush=True)
        yield f"http://127.0.0.1:{port}"
    finally:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            proc.stop()
        finally:
            signal.signal(signal.SIGINT, previous)


def mmserve_server(label: str, cwd: Path, model: str) -> Server:
    """``MMSERVE_FLAGS`` less those the tree's ``serve --help`` lacks (each dropped with a note)."""
    help_text = subprocess.run(
        [sys.executable, "-m", cli_module(cwd), "serve", "--help"],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    known = set(re.findall(r"--[a-z][a-z0-9-]*", help_text))
    flags, notes = ["--model", model], []
    for name, value in zip(MMSERVE_FLAGS[::2], MMSERVE_FLAGS[1::2], strict=True):
        if name in known:
            flags += [name, value]
        else:
            notes.append(f"{name} {value} dropped: its serve --help lacks it")
    return Server(label, "mmserve", flags, cwd, notes)


def vllm_server(vllm_peer: Path, vllm_dir: Path, flags: list[str]) -> Server | str:
    """The vLLM peer, or why it cannot run (not set up)."""
    needed = [
        vllm_dir / "venv/bin/python",
        vllm_dir / "vllm_cli.py",
        vllm_dir / "tiny-llava-vllm/config.json",
    ]
    missing = [str(p) for p in [*needed, vllm_peer / "serve.sh"] if not p.exists()]
    if missing:
        return f"not set up ({', '.join(missing)} missing): run {vllm_peer / 'setup.sh'} CHECKOUT"
    found = sorted(vllm_dir.glob("venv/lib/python*/site-packages/vllm_cpu-*.dist-info"))
    version = found[-1].name.removeprefix("vllm_cpu-").removesuffix(".dist-info") if found else "?"
    note = "serve.sh adds --max-model-len 4096 --dtype float32 (prefix caching: vLLM's default, on)"
    return Server(f"vLLM {version}", "vllm", flags, notes=[note])
