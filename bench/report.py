"""Tables, files and plots of the benchmarks in bench/: one way to print a row, write a CSV or JSON and draw a chart.

    table = Table([Column("backend", "backend", left=True), Column("ms", "step_time_ms", ".2f")])
    print(table.header()); print(table.line(row))       # rows as they are measured
    print(table.render(rows))                            # or all at once
    write_csv(out / "x.csv", rows); write_json(out / "x.json", rows, **environment("cuda"), args=...)
    line_plot(out / "x.png", {"fa2": (xs, ys)}, xlabel="N", ylabel="TFLOP/s", title="...", log2_x=True)
    bar_chart(out / "y.png", ["ctx 1024"], {"fa2": [123_456.0]}, ylabel="tokens/s", title="...")

Files are written atomically (``utils.atomic``): a reader or a killed run never leaves a half-written file, so
a benchmark can rewrite its files after every row. Plots use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import csv
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch

from utils.atomic import atomic_write_text


@dataclass(frozen=True)
class Column:
    """One table column: ``header`` over the values ``value`` (a row key, or a function of the row) formatted with
    ``fmt`` (a ``format`` spec; None values print as "-"), right-aligned unless ``left``, at least ``width`` wide
    (0: the header's width)."""

    header: str
    value: Union[str, Callable[[dict], Any]]
    fmt: str = ""
    width: int = 0
    left: bool = False


def cell(value: Any, fmt: str = "") -> str:
    """``value`` formatted with ``fmt``; "-" for None."""
    return "-" if value is None else format(value, fmt)


class Table:
    """Fixed-width text table of dict rows; the width of a column is its header's or its ``width``, so rows printed
    one by one while a benchmark runs line up with the header."""

    def __init__(self, columns: Sequence[Column]):
        self.columns = list(columns)

    def _pad(self, column: Column, text: str) -> str:
        width = max(column.width, len(column.header))
        return format(text, f"<{width}" if column.left else f">{width}")

    def header(self) -> str:
        return " ".join(self._pad(c, c.header) for c in self.columns).rstrip()

    def line(self, row: dict) -> str:
        values = (c.value(row) if callable(c.value) else row.get(c.value) for c in self.columns)
        return " ".join(self._pad(c, cell(v, c.fmt)) for c, v in zip(self.columns, values)).rstrip()

    def render(self, rows: Sequence[dict]) -> str:
        return "\n".join([self.header(), *(self.line(r) for r in rows)])


def environment(device: str) -> dict:
    """Where and when a measurement ran: {"device": GPU name or "CPU", "torch", "triton", "cuda" (None on a CPU
    build), "date": YYYY-MM-DD}. ``device``: "cuda" or "cpu"."""
    import triton

    return dict(device=torch.cuda.get_device_name() if device == "cuda" else "CPU", torch=torch.__version__,
                triton=triton.__version__, cuda=torch.version.cuda, date=time.strftime("%Y-%m-%d"))


def write_csv(path: Path, rows: Sequence[dict], fields: Optional[Sequence[str]] = None) -> None:
    """``rows`` to the CSV file ``path`` (atomically), one column per field (default: the first row's keys, in
    order). Raises ValueError for a row key outside ``fields``."""
    fields = list(fields if fields is not None else (rows[0] if rows else []))
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(Path(path), text.getvalue())


def write_json(path: Path, rows: Sequence[dict], **meta) -> None:
    """``{**meta, "rows": rows}`` to the JSON file ``path`` (atomically; values JSON cannot hold as str)."""
    atomic_write_text(Path(path), json.dumps({**meta, "rows": list(rows)}, indent=1, default=str))


def short_number(x: float) -> str:
    """A bar label: 3 significant digits with a k/M/G suffix from 1000 on (23 -> "23", 12345 -> "12.3k",
    1234567 -> "1.23M"); values below 1000 keep their integer part (small figures must not read as 0)."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.0f}" if abs(x) >= 10 else f"{x:.2g}"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_plot(path: Path, series: dict[str, tuple[Sequence[float], Sequence[float]]], *, xlabel: str, ylabel: str,
              title: str, log2_x: bool = False) -> Path:
    """One line with markers per ``series`` entry (label -> (xs, ys)) into the PNG ``path``; returns ``path``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if log2_x:
        ax.set_xscale("log", base=2)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def bar_chart(path: Path, groups: Sequence[str], series: dict[str, Sequence[Optional[float]]], *, ylabel: str,
              title: str) -> list[str]:
    """Grouped bars into the PNG ``path``: one group per ``groups`` entry, one bar per ``series`` entry (label ->
    one value per group, None: no bar), each labelled with ``short_number``. Returns the bar labels drawn, series by
    series."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(groups) * len(series)), 4))
    width, drawn = 0.8 / max(1, len(series)), []
    for i, (label, values) in enumerate(series.items()):
        points = [(j + (i - (len(series) - 1) / 2) * width, y) for j, y in enumerate(values) if y is not None]
        bars = ax.bar([x for x, _ in points], [y for _, y in points], width, label=label)
        labels = [short_number(y) for _, y in points]
        ax.bar_label(bars, labels=labels, fontsize=7)
        drawn += labels
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


if __name__ == "__main__":
    raise SystemExit("bench.report holds the tables, files and plots the benchmarks share; it has no command line of "
                     "its own (the benchmarks: python -m bench.attention, bench.masks, bench.throughput, "
                     "bench.generate)")
