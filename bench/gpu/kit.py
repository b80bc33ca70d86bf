"""The GPU kit's steps, run by bench/gpu/run.sh on the device machine (or here with ``--dry``):

1. ``env``: what the machine is (GPU, driver, torch, CUDA, transformers) -> env.txt
2. ``tier``: the CUDA tier, ``pytest -m gpu tests/gpu`` -> tier.log (while it runs, ``checkpoint`` builds the
   benchmark's checkpoint beside it: the tier hardly loads the GPU)
3. ``checkpoint``: bench/gpu/checkpoint.py, the Qwen2.5-VL-7B-shaped checkpoint -> checkpoint.log
4. ``bench``: bench/gpu/bench_gpu.py -> bench.log, gpu_bench.json, serve.log
5. ``profile``: bench/gpu/profile_decode.py, decode steps with and without CUDA graphs, the largest batch
   under the torch profiler -> profile.txt
   (its output in bench.log)

Each step has a time limit, cut to what is left of ``--budget-s``, so a step that hangs cannot take the
others' time; a failed step does not stop the next. ``summary.md`` says what each step gave and ends with
the benchmark's table; it is printed last. Everything lands flat in ``--out`` (at most 8 files, as the
device tool brings back).

``--dry``: on this machine's CPU in fp32, the tier on one family, the checkpoint at toy sizes, toy loads:
the same code paths, so the kit is tested before device time is spent (tests/integration/test_gpu_kit.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class Steps:
    def __init__(self, out: Path, budget_s: float) -> None:
        self.out, self.deadline = out, time.monotonic() + budget_s
        self.results: list[tuple[str, str, float]] = []  # (step, outcome, seconds)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def start(self, cmd: list[str], log: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        handle = (self.out / log).open("ab")
        return subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=handle,
            stderr=subprocess.STDOUT,
        )

    def finish(self, name: str, proc: subprocess.Popen[bytes], limit_s: float, started: float) -> bool:
        try:
            code = proc.wait(timeout=max(1.0, min(limit_s, self.left())))
            outcome = "ok" if code == 0 else f"exit {code}"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            outcome = "timed out"
        self.results.append((name, outcome, time.monotonic() - started))
        print(f"[kit] {name}: {outcome} after {time.monotonic() - started:.0f} s", flush=True)
        return outcome == "ok"

    def run(
        self, name: str, cmd: list[str], log: str, limit_s: float, env: dict[str, str] | None = None
    ) -> bool:
        if self.left() < 5:
            self.results.append((name, "skipped: no time left", 0.0))
            return False
        started = time.monotonic()
        return self.finish(name, self.start(cmd, log, env), limit_s, started)


def environment(out: Path) -> None:
    probe = (
        "import torch, transformers, sys; print('python', sys.version.split()[0]); "
        "print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available()); "
        "print('transformers', transformers.__version__); "
        "print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
    )
    lines = [subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout]
    if _has("nvidia-smi"):
        lines.append(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout)
    lines.append(subprocess.run(["df", "-h", "/dev/shm", "/tmp"], capture_output=True, text=True).stdout)
    lines.append(f"cpus {os.cpu_count()}\n")
    (out / "env.txt").write_text("".join(lines))


def _has(program: str) -> bool:
    return any((Path(d) / program).exists() for d in os.environ.get("PATH", "").split(os.pathsep))


def tier_summary(out: Path) -> str:
    """pytest's last line, and its near-tie warnings (each with its logprob gap)."""
    text = (out / "tier.log").read_text(errors="replace") if (out / "tier.log").exists() else ""
    lines = text.strip().splitlines()
    ties = [line.strip() for line in lines if "near-tie accepted" in line]
    return "\n".join([lines[-1] if lines else "(no output)", *ties])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry", action="store_true")
    parser.add_argument("--budget-s", type=float, default=540)
    parser.add_argument(
        "--skip", default="", help="comma-separated steps to leave out (tier, bench, profile)"
    )
    parser.add_argument(
        "--bench-loads",
        default="images,decode,agent,agents",
        help="the benchmark's loads (bench_gpu.py --loads)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    skip = set(args.skip.split(","))
    steps = Steps(args.out, args.budget_s)
    py = sys.executable
    device = "cpu" if args.dry else "cuda"
    checkpoint = Path("/tmp/mmserve-gpu-dry" if args.dry else _checkpoint_dir())
    environment(args.out)

    ckpt_cmd = [py, "bench/gpu/checkpoint.py", str(checkpoint), "--size", "dry" if args.dry else "7b"]
    ckpt_cmd += ["--device", "cpu", "--dtype", "float32"] if args.dry else []
    ckpt_started = time.monotonic()
    building = (
        steps.start(ckpt_cmd, "checkpoint.log") if "bench" not in skip or "profile" not in skip else None
    )
    if "tier" not in skip:
        tier_env = {"MMSERVE_GPU_TIER_DEVICE": device}
        if args.dry:
            tier_env["MMSERVE_GPU_TIER_FAMILIES"] = "qwen2_5_vl"
        tier_cmd = [py, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-p", "no:cacheprovider", "-rfE"]
        steps.run("tier", tier_cmd, "tier.log", limit_s=300, env=tier_env)
    built = building is not None and steps.finish("checkpoint", building, 240, ckpt_started)

    def script(name: str, *extra: str) -> list[str]:  # a bench/gpu script on the checkpoint
        return [
            py,
            f"bench/gpu/{name}.py",
            "--model",
            str(checkpoint),
            "--out",
            str(args.out),
            "--device",
            device,
            *extra,
        ]

    if built and "bench" not in skip:
        bench = script("bench_gpu", "--loads", args.bench_loads, *(["--dry"] if args.dry else []))
        # the agents loads, which decide the agent-loop target, run last: room for all of them first
        steps.run("bench", bench, "bench.log", limit_s=360)
    if built and "profile" not in skip:
        toy = (
            ["--batches", "1,3", "--prompt-tokens", "40", "--steps", "2", "--image-px", "224"]
            if args.dry
            else []
        )
        steps.run("profile", script("profile_decode", *toy), "bench.log", limit_s=200)
    write_summary(args.out, steps)


def _checkpoint_dir() -> str:
    """tmpfs when it has room for the ~17 GB checkpoint (written and read at memory speed), else /tmp."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize > 24 * 2**30:
        return "/dev/shm/mmserve-qwen2_5_vl-7b"
    return "/tmp/mmserve-qwen2_5_vl-7b"


def bench_table(log: list[str]) -> list[str]:
    """bench_gpu.py's table in bench.log, which the profile's output follows (else the log's end)."""
    headers = [i for i, line in enumerate(log) if "TTFT p50 ms" in line and "req/s" in line]
    if not headers:
        return log[-8:]
    table = log[headers[-1] :]
    ends = [
        i
        for i, line in enumerate(table)
        if "agents at once" in line
        or "with no history" in line
        or line.startswith(("agent loop", "  no history:"))
    ]
    return table[: ends[-1] + 1] if ends else table[:10]


def write_summary(out: Path, steps: Steps) -> None:
    lines = [
        "# GPU kit",
        "",
        (out / "env.txt").read_text(),
        "| step | outcome | seconds |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {name} | {outcome} | {seconds:.0f} |" for name, outcome, seconds in steps.results]
    lines += ["", "## tier", "", tier_summary(out)]
    bench_log = out / "bench.log"
    if bench_log.exists():
        lines += ["", "## bench", "", *bench_table(bench_log.read_text(errors="replace").splitlines())]
    profile = out / "profile.txt"
    if profile.exists():
        text = profile.read_text().splitlines()
        encoder = (line for line in text if line.startswith(("encoder: ", "patch embedding: ")))
        lines += ["", "## profile", "", *text[:14], *encoder]
    bench = out / "gpu_bench.json"
    if bench.exists():
        lines += ["", f"gpu_bench.json: {len(json.loads(bench.read_text()))} sections"]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
