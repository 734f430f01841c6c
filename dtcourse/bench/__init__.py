"""Benchmarks, one per stem (``dtcourse bench <stem>``): each times an implementation against its reference in
the same run, the variants taking turns step by step so that a burst of load from elsewhere hits them alike.

Shared by them: ``turns`` (the order of one round, rotating; from ``dtcourse.runtime.turns``, since lesson 01's
measurements take turns too), ``step_times`` (a variant's step times with their
median and quartiles, in ms),
``paired_ratio`` (the median of the step-by-step ratios of two variants that took turns), ``find`` and
``paired`` (a row of results, and a row's paired ratio to the reference variant at its world size); for the
tables ``text_table``, ``times_cell`` and ``ratio_cell``; for the figures ``world_panels`` (a column of
panels per world size), ``bars`` (bars side by side, medians with their IQR) and ``finish``.
"""

from __future__ import annotations

import statistics
from typing import Sequence

from dtcourse.runtime.turns import turns

__all__ = ["turns", "step_times", "paired_ratio", "find", "paired", "text_table", "times_cell", "ratio_cell",
           "world_panels", "bars", "finish"]


def step_times(times: Sequence[float]) -> dict:
    """``{"times", "median_ms", "q1_ms", "q3_ms"}`` of step times in seconds (one time: all three equal it)."""
    q1, median, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"times": list(times), "median_ms": 1e3 * median, "q1_ms": 1e3 * q1, "q3_ms": 1e3 * q3}


def paired_ratio(ours: Sequence[float], theirs: Sequence[float]) -> float:
    """The median of ``ours[i] / theirs[i]``: steps i of both ran back to back, under the same load."""
    return statistics.median(a / b for a, b in zip(ours, theirs))


def find(rows: Sequence[dict], **fields) -> dict | None:
    """The first of ``rows`` whose ``fields`` have the values given (``world_size=2, variant="FSDP2"``), or None."""
    return next((r for r in rows if all(r[k] == v for k, v in fields.items())), None)


def paired(row: dict, rows: Sequence[dict], reference: str) -> float | None:
    """The median of the round-by-round ratios of ``row`` to ``reference`` at the same world size (rows keyed
    by ``"variant"``, with their ``"times"``); None where ``rows`` has no such reference."""
    ref = find(rows, world_size=row["world_size"], variant=reference)
    return None if ref is None else paired_ratio(row["times"], ref["times"])


def text_table(head: str, lines: Sequence[str]) -> str:
    """The header, a rule as wide as it, and the lines."""
    return "\n".join([head, "-" * len(head), *lines])


def times_cell(times: dict, width: int = 10, q1_width: int = 8) -> str:
    """A ``step_times`` median, then its quartiles ``q1 - q3`` (ms, one decimal), right-aligned in ``width`` and
    ``q1_width`` characters, the q3 left-aligned in 5."""
    return f"{times['median_ms']:>{width}.1f}{times['q1_ms']:>{q1_width}.1f} - {times['q3_ms']:<5.1f}"


def ratio_cell(ratio: float | None, width: int) -> str:
    """``1.23x`` right-aligned in ``width`` characters; blanks where there is no ratio."""
    return f"{ratio:>{width - 1}.2f}x" if ratio is not None else " " * width


def world_panels(rows: Sequence[dict], width: float, height: float, nrows: int = 1,
                 ylabel: str = "step time (ms)"):
    """A figure with a column of ``nrows`` panels per world size in ``rows``, ``width`` inches each but the
    notebook column's width at most in all, ``ylabel`` on the first: ``(fig, axes, [(N, rows at N), ...])``."""
    import matplotlib.pyplot as plt
    from dtcourse.lab.widgets import COLUMN_IN

    worlds = sorted({r["world_size"] for r in rows})
    fig, axes = plt.subplots(nrows, len(worlds), figsize=(min(COLUMN_IN, width * len(worlds)), height),
                             squeeze=False)
    axes[0][0].set_ylabel(ylabel)
    return fig, axes, [(n, [r for r in rows if r["world_size"] == n]) for n in worlds]


def bars(ax, labels: Sequence[str], series: Sequence[tuple], **ticks) -> None:
    """One bar per label for each of ``series``, side by side in 0.8 of a tick: ``(legend label or None, values,
    color or colors)``, the values ``step_times`` dicts (their medians, the IQR as error bars) or plain
    heights. ``ticks`` (rotation, ha, fontsize) go to the x tick labels."""
    width = 0.8 / len(series)
    for k, (label, values, color) in enumerate(series):
        xs = [x + (k - (len(series) - 1) / 2) * width for x in range(len(labels))]
        options = {} if label is None else {"label": label}
        if values and isinstance(values[0], dict):
            options.update(capsize=2, yerr=[[v["median_ms"] - v["q1_ms"] for v in values],
                                            [v["q3_ms"] - v["median_ms"] for v in values]])
            values = [v["median_ms"] for v in values]
        ax.bar(xs, values, width, color=color, **options)
    ax.set_xticks(range(len(labels)), labels, **ticks)


def finish(fig, title: str = ""):
    """``title`` above the panels (if any), the layout tightened: the figure."""
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig
