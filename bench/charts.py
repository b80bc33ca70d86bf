"""Bar charts the benchmark scripts draw with matplotlib (docs/benchmarks.md shows them): one panel per
table, one group of bars per row, one bar per column, each bar labelled with its value."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    rows: dict[str, dict[str, float]]  # group -> {bar: value}
    fmt: str = "{:.0f}"
    log: bool = False


def draw(path: Path, title: str, panels: list[Panel], footnote: str) -> Path:
    """Writes ``panels`` side by side to ``path`` (PNG), leaving out those without a value; returns the
    path."""
    panels = [panel for panel in panels if any(panel.rows.values())]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        bars = list(dict.fromkeys(bar for row in panel.rows.values() for bar in row))
        width = 0.8 / len(bars)
        for i, bar in enumerate(bars):
            xs = [g + (i - (len(bars) - 1) / 2) * width for g in range(len(panel.rows))]
            values = [row.get(bar, 0.0) for row in panel.rows.values()]
            drawn = ax.bar(xs, values, width, label=bar)
            # a group without this bar gets no bar and no label (not "0.0")
            labels = [panel.fmt.format(row[bar]) if bar in row else "" for row in panel.rows.values()]
            ax.bar_label(drawn, labels=labels, fontsize=8, padding=2)
        ax.set_xticks(range(len(panel.rows)), [textwrap.fill(name, 14) for name in panel.rows], fontsize=8)
        ax.set_title(panel.title, fontsize=10)
        ax.set_ylabel(panel.ylabel)
        if panel.log:
            ax.set_yscale("log")
        ax.margins(y=0.15)
        if len(bars) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.text(0.01, 0.01, footnote, fontsize=7, color="dimgray")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"chart: {path}")
    return path
