"""Draws docs/img/dashboard.png: the panels of monitoring/grafana/dashboards/mmserve.json, laid out as in
Grafana, each drawn with matplotlib from a real Prometheus's answers to that panel's queries. Not a
Grafana screenshot (no Grafana here): the same queries, the same layout, plain charts.

    make dashboard-image    # or: .venv/bin/python monitoring/draw_dashboard.py [--model DIR] [--out PNG]

It runs what tests/e2e/test_monitoring.py runs (tests/e2e/monitoring_stack.py): ``mmserve serve`` on the
tiny LLaVA model with the encoder-cache connector on a local folder, ``mmserve proxy`` in front of it,
Debian's ``prometheus`` with monitoring/prometheus.yml and rules.yml, all on loopback; then traffic in
three phases (cold: mostly new images; warm: mostly images sent before, some through the proxy; after
``POST /reset_mm_cache``: the repeated images come back from the connector's store).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402
from PIL import Image  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as monitoring/draw_dashboard.py: the repository's packages and tests

from tests.e2e.monitoring_stack import (  # noqa: E402
    Mix,
    Prometheus,
    dashboard,
    every_kind_of_request,
    scraped_up,
    start_prometheus,
    steady_traffic,
    substitute,
    wait_until,
)
from tests.e2e.server import free_port, serving, start_proxy  # noqa: E402

RATE_INTERVAL = "15s"  # what Grafana would use for a 1 s scrape interval at this zoom
STEP_S = 2.0
PHASES = (
    ("cold: mostly new images", Mix(text=1, repeated=1, new=3), 2),
    ("warm: mostly images seen before", Mix(text=1, repeated=5, new=0.5), 3),
    ("after POST /reset_mm_cache", Mix(text=1, repeated=5, new=0.5), 3),
)


# --- the run ------------------------------------------------------------------------------------


def run(
    model: Path, folder: Path, phase_seconds: float
) -> tuple[Prometheus, float, float, list[tuple[str, float]]]:
    """Starts the stack, drives the phases; returns Prometheus (still running), the start and end of the
    traffic and each phase's (label, start). The servers are stopped; Prometheus keeps what it scraped."""
    connector = (
        "--ec-connector",
        "shared-storage",
        "--ec-storage-path",
        str(folder / "ec"),
        "--ec-role",
        "both",
    )
    with serving(model, folder, *connector) as server:
        proxy_port = free_port()
        targets = {
            "api:8000": f"127.0.0.1:{server.port}",
            "epd-encoder:8001": f"127.0.0.1:{free_port()}",  # not started
            "epd-lm:8002": f"127.0.0.1:{free_port()}",
            "epd-proxy:8010": f"127.0.0.1:{proxy_port}",
        }
        prometheus = start_prometheus(targets, folder / "prometheus")
        proxy = start_proxy(folder, server.base_url, server.base_url, port=proxy_port)
        try:
            wait_until(lambda: scraped_up(prometheus, "epd-proxy:8010"), 30, "proxy scraped", prometheus)
            time.sleep(5)  # a few idle scrapes first
            start, marks = time.time(), []
            for index, (label, mix, concurrency) in enumerate(PHASES):
                marks.append((label, time.time()))
                print(
                    f"phase {index + 1}: {label} ({phase_seconds:.0f} s, {concurrency} clients)", flush=True
                )
                if index == 2:
                    httpx.post(f"{server.base_url}/reset_mm_cache").raise_for_status()
                every_kind_of_request(server.base_url, proxy.base_url)
                through_proxy = threading.Thread(
                    target=steady_traffic,
                    args=(proxy.base_url, phase_seconds),
                    kwargs={"concurrency": 1, "mix": mix},
                )
                if index == 1:
                    through_proxy.start()
                steady_traffic(server.base_url, phase_seconds, concurrency=concurrency, mix=mix)
                if index == 1:
                    through_proxy.join()
            time.sleep(5)  # the last scrapes
            end = time.time()
        finally:
            proxy.process.interrupt()
    return prometheus, start, end, marks


# --- drawing ------------------------------------------------------------------------------------

ROW_HEIGHT = 0.5  # inches per Grafana grid unit


def _format(unit: str) -> FuncFormatter:
    def fmt(value: float, _pos: object = None) -> str:
        if unit == "percentunit":
            return f"{value * 100:.0f}%"
        if unit == "s":
            return f"{value * 1000:.0f} ms" if abs(value) < 1 else f"{value:.1f} s"
        if unit == "Bps":
            for scale, name in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s")):
                if abs(value) >= scale:
                    return f"{value / scale:.1f} {name}"
            return f"{value:.0f} B/s"
        for scale, name in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(value) >= scale:
                return f"{value / scale:.3g}{name}"
        return f"{value:.3g}"

    return FuncFormatter(fmt)


def _series(
    prometheus: Prometheus, expr: str, start: float, end: float
) -> list[tuple[dict[str, str], list[float], list[float]]]:
    """Each series of the answer on the full time axis (minutes since ``start``): a step without a value
    (e.g. a ``> 0`` filter) is NaN, a gap in the line rather than a segment across it."""
    answer = prometheus.query_range(substitute(expr, RATE_INTERVAL), start, end, STEP_S)
    num_steps = int((end - start) // STEP_S) + 1
    times = [k * STEP_S / 60 for k in range(num_steps)]
    series = []
    for item in answer:
        values = [math.nan] * num_steps
        for t, v in item["values"]:
            values[round((float(t) - start) / STEP_S)] = float(v)
        series.append((item["metric"], times, values))
    return series


def _legend(template: str, labels: dict[str, str]) -> str:
    for name, value in labels.items():
        template = template.replace("{{" + name + "}}", value)
    return template


def _draw_panel(
    ax: Axes, panel: dict[str, Any], data: list[tuple[str, list[Any]]], marks: list[float]
) -> None:
    unit = panel["fieldConfig"]["defaults"].get("unit", "short")
    ax.set_title(panel["title"], fontsize=10, loc="left")
    ax.tick_params(labelsize=8)
    ax.yaxis.set_major_formatter(_format(unit))
    if panel["type"] == "stat":
        last = [v for _, series in data for _, _, values in series for v in values if math.isfinite(v)]
        text = _format(unit)(last[-1]) if last else "no data"
        ax.text(
            0.5, 0.42, text, fontsize=20, ha="center", va="center", transform=ax.transAxes, color="tab:green"
        )
        for _, series in data:
            for _, times, values in series:
                ax.fill_between(times, values, alpha=0.15, color="tab:green")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    drawn = False
    for legend, series in data:
        for labels, times, values in series:
            ax.plot(times, values, linewidth=1.1, label=_legend(legend, labels))
            drawn = True
    for minute in marks:
        ax.axvline(minute, color="dimgray", linewidth=0.9, linestyle=":")
    highest = max(
        (v for _, series in data for _, _, values in series for v in values if math.isfinite(v)), default=0
    )
    ax.set_ylim(0, highest * 1.15 if highest > 0 else 1)  # a flat line stays below the frame
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7, loc="best", framealpha=0.6)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")


def draw(prometheus: Prometheus, start: float, end: float, marks: list[tuple[str, float]], out: Path) -> None:
    board = dashboard()
    panels = board["panels"]
    height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig_height = height * ROW_HEIGHT + 1.4
    fig = plt.figure(figsize=(24, fig_height))
    top = 1 - 1.3 / fig_height
    grid = fig.add_gridspec(height, 24, left=0.03, right=0.995, bottom=0.01, top=top, hspace=3.6, wspace=1.2)
    mark_minutes = [(t - start) / 60 for _, t in marks]
    for panel in panels:
        pos = panel["gridPos"]
        if panel["type"] == "row":
            ax = fig.add_subplot(grid[pos["y"], :])
            ax.axis("off")
            ax.text(-0.02, 0.0, panel["title"], fontsize=13, fontweight="bold", transform=ax.transAxes)
            continue
        ax = fig.add_subplot(grid[pos["y"] : pos["y"] + pos["h"], pos["x"] : pos["x"] + pos["w"]])
        data = [
            (target.get("legendFormat", ""), _series(prometheus, target["expr"], start, end))
            for target in panel["targets"]
        ]
        _draw_panel(ax, panel, data, mark_minutes)
    phases = "; ".join(f"{(t - start) / 60:.1f} min: {label}" for label, t in marks)
    fig.suptitle(
        "mmserve dashboard (monitoring/grafana/dashboards/mmserve.json): each panel's queries answered by a "
        "real Prometheus, drawn with matplotlib by monitoring/draw_dashboard.py - not a Grafana screenshot",
        fontsize=14,
        x=0.01,
        y=1 - 0.2 / fig_height,
        ha="left",
    )
    fig.text(
        0.01,
        1 - 0.6 / fig_height,
        f"tiny LLaVA on 2 CPU cores, {datetime.now(UTC):%Y-%m-%d}; $__rate_interval = {RATE_INTERVAL}, "
        f"scrape every 1 s; x axes: minutes; dotted lines: phases ({phases})",
        fontsize=11,
        color="dimgray",
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=72)
    plt.close(fig)
    shrink(out)
    print(f"dashboard: {out}")


def shrink(png: Path) -> None:
    """The PNG with a 256-colour palette: a third of the size, the same picture (flat-colour charts)."""
    image = Image.open(png).convert("RGB")
    image.quantize(colors=256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE).save(
        png, optimize=True
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, help="a tiny LLaVA checkpoint (default: built into a temp folder)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img" / "dashboard.png")
    parser.add_argument("--phase-seconds", type=float, default=40.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mmserve-dashboard-") as tmp:
        folder = Path(tmp)
        model = args.model
        if model is None:
            from workers.families.tiny import build_tiny_model

            model = build_tiny_model("llava", folder / "tiny-llava", seed=0)
        prometheus, start, end, marks = run(model, folder, args.phase_seconds)
        try:
            draw(prometheus, start, end, marks, args.out)
        finally:
            prometheus.stop()


if __name__ == "__main__":
    main()
