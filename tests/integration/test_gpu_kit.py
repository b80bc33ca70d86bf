"""The GPU kit's dry run (bench/gpu/run.sh --dry): every step the device machine runs — the CUDA tier (on
the CPU in fp32, one family), the 7B-shaped checkpoint builder (at toy sizes), the benchmark and the
decode profile — runs here, so the kit is known to work before device time is spent on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_kit_runs_dry_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", "bench/gpu/run.sh", "--dry", "--budget-s", "600"],
        cwd=REPO,
        env={**os.environ, "OUT": str(out), "PY": sys.executable},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    for step in ("tier", "checkpoint", "bench", "profile"):
        assert f"| {step} | ok |" in summary, summary
    assert "passed" in summary and "failed" not in summary, summary
    bench = summary.split("## bench")[1].split("## profile")[0]
    assert "decode_3" in bench and "turn 5 / turn 1" in bench, bench  # the benchmark's own table
    figures = json.loads((out / "gpu_bench.json").read_text())
    for key in ("image_0pct", "image_90pct", "decode_1", "decode_3"):
        assert figures[key]["num_ok"] == figures[key]["num_requests"] > 0, figures[key]
        assert figures[key]["failures"] == "0"
    assert figures["image_0pct"]["encoder_runs"] == figures["image_0pct"]["num_requests"]
    assert 0 < figures["image_90pct"]["encoder_runs"] < figures["image_90pct"]["num_requests"]
    assert figures["roofline"]["decode_3"]["step_ms"] > 0
    agent = figures["agent"]  # five chained turns: each turn's history is in its prompt, and cached
    assert len(agent["ttft_ms"]) == 5 and all(t > 0 for t in agent["ttft_ms"])
    assert all(a < b for a, b in zip(agent["prompt_tokens"], agent["prompt_tokens"][1:], strict=False))
    assert all(c > 0 for c in agent["cached_tokens"][1:])
    crowd = figures["agents_at_once"]  # three agents at once, a measured conversation of five turns each
    assert crowd["agents"] == 3 and crowd["conversations"] == 1
    assert len(crowd["ttft_ms_p50"]) == 5 and crowd["turns_per_s"] > 0
    # the same load with no history: the control that the history's cost under load is read against
    assert len(crowd["no_history_ttft_ms_p50"]) == 5 and len(crowd["history_over_none"]) == 5
    # each load's server counters: 15 turns, a new image each, and the history cached in the chained one
    for key in ("server", "no_history_server"):
        assert crowd[key]["encoder_runs_total"] >= 15 and crowd[key]["worker_busy_seconds_total"] > 0
        server = crowd[key]
        assert 0 < server["request_prefill_time_seconds_sum"] < server["time_to_first_token_seconds_sum"]
    assert crowd["server"]["prefix_cache_hits_total"] > crowd["no_history_server"]["prefix_cache_hits_total"]
    assert "agents at once" in bench and "with no history" in bench, bench
    profile = (out / "profile.txt").read_text()
    assert "| 3 | graphs |" in profile and "| 3 | eager |" in profile, profile
    assert "encoder: one 224x224 image" in profile and "encoder: one 224x224 image" in summary, profile
    assert "patch embedding: " in profile and "patch embedding: " in summary, profile
    assert len(list(out.iterdir())) <= 8  # what the device tool brings back
