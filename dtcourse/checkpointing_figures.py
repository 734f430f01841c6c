"""Lesson 05's pictures of activation checkpointing, drawn from ``checkpointing_measurements``.

``plot_segments`` puts the segment sweep's held bytes and step times beside Chen et al.'s
predictions, ``plot_policies`` the recomputation policies' beside Korthikanti et al.'s, and
``trace_widget`` steps through the bytes alive after every op of one training step::

    from dtcourse import checkpointing_figures as figures
    from dtcourse.checkpointing_measurements import measure_segments
    figures.trace_widget(measure_segments(n_layers=16))   # a slider over k, the memory trace below it

Figures are built with ``matplotlib.figure.Figure`` (no pyplot), so they draw headlessly and
a notebook shows each one once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

from dtcourse.checkpointing_measurements import PolicyPoint, SegmentPoint, predicted_step_ms
from dtcourse.figure_widget import figure_widget, png

if TYPE_CHECKING:
    import ipywidgets
    from matplotlib.figure import Figure

__all__ = ["plot_segments", "plot_policies", "TraceView", "trace_widget"]


def plot_segments(points: Sequence[SegmentPoint]) -> Figure:
    """Left: bytes held after the forward (measured, predicted) and the peak, against k. Right: step time."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    ks = [p.segments for p in points]
    kib = 1024
    left.plot(ks, [p.predicted_held / kib for p in points], "-", color="tab:orange",
              label="predicted: (k - 1 + n//k) layer outputs")
    left.plot(ks, [p.held_after_forward / kib for p in points], "o", color="tab:blue",
              label="measured after forward")
    left.plot(ks, [p.peak / kib for p in points], "s", color="tab:red", markersize=4,
              label="measured peak (forward + backward)")
    left.set_ylabel("KiB of activations")
    left.set_ylim(bottom=0)
    left.legend(fontsize=7)
    left.set_title("what the stack holds", fontsize=10)
    predicted = predicted_step_ms(points)
    right.plot(ks, [predicted[k] for k in ks], "-", color="tab:orange",
               label="predicted: step(1) + forward(1)·recomputed/n")
    right.plot(ks, [p.step_ms for p in points], "o", color="tab:blue", label="measured (median)")
    right.set_ylabel("ms per step (forward + backward)")
    right.set_ylim(bottom=0)
    right.legend(fontsize=7)
    right.set_title("what it costs", fontsize=10)
    n = points[0].n_layers
    for ax in (left, right):
        ax.axvline(math.sqrt(n), color="gray", linestyle=":", linewidth=1)
        ax.set_xlabel(f"segments k (n = {n} layers; dotted: k = √n)")
        ax.grid(alpha=0.3)
    return fig


def plot_policies(points: Sequence[PolicyPoint]) -> Figure:
    """Bars per policy: bytes the layers hold (measured beside predicted), and step time (measured)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.4), layout="constrained")
    left, right = fig.subplots(1, 2)
    names = [p.policy for p in points]
    x = range(len(points))
    left.bar([i - 0.2 for i in x], [p.held_after_forward / 2**20 for p in points], 0.4, label="measured")
    left.bar([i + 0.2 for i in x], [p.predicted_held / 2**20 for p in points], 0.4, label="predicted")
    left.set_ylabel("MiB held by the layers after forward")
    left.legend(fontsize=7)
    plain = next((p.step_ms for p in points if p.policy == "none"), None)
    bars = right.bar(list(x), [p.step_ms for p in points], 0.5, color="tab:green")
    for bar, p in zip(bars, points):
        measured = f"{p.step_ms / plain - 1:+.0%} measured\n" if plain else ""
        right.annotate(f"{measured}{p.predicted_overhead:+.0%} FLOPs", (bar.get_x() + bar.get_width() / 2,
                       bar.get_height()), ha="center", va="bottom", fontsize=7)
    right.set_ylabel("ms per training step (median)")
    right.set_ylim(top=1.25 * max(p.step_ms for p in points))
    for ax in (left, right):
        ax.set_xticks(list(x), names)
        ax.grid(axis="y", alpha=0.3)
    return fig


class TraceView:
    """Bytes alive after each op of one step, for a chosen k, over the plain step's (k = 1)."""

    def __init__(self, points: Sequence[SegmentPoint]):
        from matplotlib.figure import Figure

        self.points = {p.segments: p for p in points}
        if 1 not in self.points:
            raise ValueError("TraceView needs the plain run (segments=1) to draw the others against.")
        self.figure = Figure(figsize=(8, 3.2), layout="constrained")
        self.ax = self.figure.subplots()
        self.segments = 1
        self.show(min(self.points, key=lambda k: abs(k - math.sqrt(points[0].n_layers))))

    def show(self, segments: int) -> None:
        if segments not in self.points:
            raise ValueError(f"no measured run with segments={segments}; measured: {sorted(self.points)}")
        self.segments = segments
        ax, plain, point = self.ax, self.points[1], self.points[segments]
        ax.clear()
        self.curves = {}                      # segments -> the Line2D of its trace
        for p, label in ((plain, "k = 1 (plain)"), (point, f"k = {segments}")):
            if p.segments in self.curves:
                continue
            self.curves[p.segments], = ax.plot([b / 1024 for b in p.trace], label=label, linewidth=1.2)
            ax.axvline(p.forward_ops, color=self.curves[p.segments].get_color(), linestyle=":", linewidth=1)
        ax.set_xlabel("op (dotted: the forward ends, backward begins)")
        ax.set_ylabel("KiB alive")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        ax.set_title(f"k = {segments}: {point.held_after_forward / 1024:,.0f} KiB after forward, peak "
                     f"{point.peak / 1024:,.0f} KiB, {point.recomputed_layers} layers recomputed", fontsize=9)

    def png(self) -> bytes:
        """The figure as PNG bytes, as the widget shows it."""
        return png(self.figure)


def trace_widget(points: Sequence[SegmentPoint]) -> ipywidgets.VBox:
    """A slider over the measured segment counts, drawing that step's memory trace."""
    import ipywidgets as widgets

    view = TraceView(points)
    slider = widgets.SelectionSlider(options=sorted(view.points), value=view.segments, description="segments")
    return figure_widget({"slider": slider}, view.show, view.figure, max_width="760px", view=view)
