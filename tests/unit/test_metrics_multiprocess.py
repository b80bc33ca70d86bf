"""/metrics with several API processes (``serve --api-server-count N``): API-side figures are summed over
the processes' files in ``PROMETHEUS_MULTIPROC_DIR``; the engine's, which every API process receives
alike, are rendered once. A second API process is simulated by a subprocess writing to the same folder."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client import values as prometheus_values

from app.metrics import BATCH_BUCKETS, MULTIPROC_DIR_ENV, ApiMetrics
from tests.e2e.metrics import parse_metrics
from wire.protocol import EngineStats

REPO = Path(__file__).resolve().parents[2]

STATS = EngineStats(
    counters={"engine_steps_total": 5.0, "mm_ipc_cache_resends_total": 0.0},
    gauges={"num_requests_running": 1.0},
    observations={"num_requests_per_step": [1.0, 2.0, 300.0], "encoder_seconds": [0.02]},
)

OTHER_PROCESS = textwrap.dedent(
    """
    from app.metrics import ApiMetrics
    from wire.protocol import EngineStats

    metrics = ApiMetrics()
    metrics.mm_items.inc(4)
    metrics.request_success.labels(finish_reason="stop").inc()
    metrics.request_success.labels(finish_reason="length").inc()
    metrics.ttft.observe(0.2)
    metrics.apply_engine_stats(EngineStats(
        counters={"engine_steps_total": 5.0, "mm_ipc_cache_resends_total": 0.0},
        gauges={"num_requests_running": 1.0},
        observations={"num_requests_per_step": [1.0, 2.0, 300.0], "encoder_seconds": [0.02]},
    ))
    """
)


@pytest.fixture
def multiprocess_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The variable set as ``serve`` sets it; prometheus_client's value class is restored afterwards
    (``ApiMetrics`` switches it, since the library was imported before the variable was set)."""
    folder = tmp_path / "metrics"
    folder.mkdir()
    monkeypatch.setenv(MULTIPROC_DIR_ENV, str(folder))
    monkeypatch.setattr(prometheus_values, "ValueClass", prometheus_values.ValueClass)
    return folder


def run_other_api_process(folder: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", MULTIPROC_DIR_ENV: str(folder)}
    subprocess.run([sys.executable, "-c", OTHER_PROCESS], cwd=REPO, env=env, check=True, timeout=60)


def test_api_figures_are_summed_engine_figures_are_not(multiprocess_dir: Path) -> None:
    metrics = ApiMetrics()
    metrics.mm_items.inc(3)
    metrics.request_success.labels(finish_reason="stop").inc(2)
    metrics.ttft.observe(0.02)
    metrics.apply_engine_stats(STATS)
    run_other_api_process(multiprocess_dir)  # it exited: its files stay, so its figures still count

    text = metrics.render().decode()
    values = parse_metrics(text)
    assert values["mmserve_mm_items_total"] == 7.0
    assert values['mmserve_request_success_total{finish_reason="stop"}'] == 3.0
    assert values['mmserve_request_success_total{finish_reason="length"}'] == 1.0
    assert values["mmserve_time_to_first_token_seconds_count"] == 2.0
    assert values['mmserve_time_to_first_token_seconds_bucket{le="0.025"}'] == 1.0
    # the engine's global values and this process's step observations, once
    assert values["mmserve_engine_steps_total"] == 5.0
    assert values["mmserve_mm_ipc_cache_resends_total"] == 0.0
    assert values["mmserve_num_requests_running"] == 1.0
    assert values["mmserve_num_requests_per_step_count"] == 3.0
    assert values['mmserve_num_requests_per_step_bucket{le="2.0"}'] == 2.0
    assert values["mmserve_encoder_seconds_count"] == 1.0
    # one family each, no pid label, no *_created series
    type_lines = [line for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(type_lines) == len(set(type_lines))
    assert "pid=" not in text and "_created" not in text


def test_a_process_started_later_sees_the_same_totals(multiprocess_dir: Path) -> None:
    run_other_api_process(multiprocess_dir)
    values = parse_metrics(ApiMetrics().render().decode())
    assert values["mmserve_mm_items_total"] == 4.0
    assert values["mmserve_num_requests_per_step_count"] == 0.0  # counted from this process's start


def test_engine_histograms_render_as_prometheus_histograms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the variable nothing changes: one registry, and the engine histograms (kept by hand)
    read exactly as prometheus_client's own ``Histogram`` with the same observations."""
    monkeypatch.delenv(MULTIPROC_DIR_ENV, raising=False)
    metrics = ApiMetrics()
    assert metrics.multiprocess_dir is None
    observations = [1.0, 2.0, 2.0, 3.0, 256.0, 300.0, 0.5]
    metrics.apply_engine_stats(EngineStats({}, {}, {"num_requests_per_step": observations}))
    reference = Histogram(
        "mmserve_num_requests_per_step",
        "Requests batched together in one engine step.",
        buckets=BATCH_BUCKETS,
        registry=(registry := CollectorRegistry()),
    )
    for value in observations:
        reference.observe(value)
    rendered = metrics.render().decode()
    expected = generate_latest(registry).decode()
    assert expected.strip() in rendered
