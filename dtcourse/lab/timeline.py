"""A recording of per-rank spans drawn as a Gantt chart, and a widget over several recordings.

Per rank, one lane for compute and one for communication (``COMMUNICATION_KINDS``); time in ms
since the shared origin. Lesson 02 draws DDP steps with it, the pipeline lesson its schedules::

    from dtcourse.lab.timeline import timeline_widget
    timeline_widget({"overlapped": recording})
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

from dtcourse.lab.widgets import COLUMN_IN, FigureView, figure_widget
from dtcourse.runtime.timeline import COMMUNICATION_KINDS, Recording, Span, in_order

if TYPE_CHECKING:   # matplotlib and ipywidgets are imported only when something is drawn
    import ipywidgets
    from matplotlib.figure import Figure

__all__ = ["TimelineView", "timeline_figure", "timeline_widget", "COLOURS"]

COLOURS = MappingProxyType({"forward": "tab:blue", "backward": "tab:orange", "sync": "tab:gray",
                            "wait": "tab:red", "optimizer": "tab:green", "all_reduce": "tab:purple"})
OTHER_COLOURS = ("tab:brown", "tab:pink", "tab:olive", "tab:cyan", "gold", "navy")   # other kinds, in turn


def _pack(spans: list[Span]) -> list[int]:
    """Sub-row of each span so that no two spans in one sub-row overlap (first one that fits)."""
    row_ends: list[float] = []
    rows = []
    for s in spans:                               # in in_order order
        row = next((i for i, e in enumerate(row_ends) if e <= s.start), len(row_ends))
        if row == len(row_ends):
            row_ends.append(s.end)
        row_ends[row] = s.end
        rows.append(row)
    return rows


class TimelineView(FigureView):
    """A Gantt chart of a recording: per rank a compute lane and a communication lane, time in ms.

    Spans that overlap within a lane (an all-reduce in flight while the next is launched) are
    stacked in thinner sub-rows. Points (``grad``) are ticks above the compute lane. ``bars``
    keeps ``(rank, span, Rectangle)`` for every bar drawn, and ``ticks`` each rank's tick line.
    """

    def __init__(self, recording: Recording | None = None, xlim_ms: float | None = None, title: str = ""):
        import matplotlib.pyplot as plt

        self.figure, self.ax = plt.subplots(figsize=(COLUMN_IN, 3.2))
        plt.close(self.figure)            # shown by the caller (or a widget), not by the inline backend
        self.xlim_ms = xlim_ms
        self.bars: list[tuple[int, Span, Any]] = []
        self.ticks: dict[int, Any] = {}
        if recording is not None:
            self.show(recording, title)

    def show(self, recording: Recording, title: str = "") -> None:
        from matplotlib.patches import Patch, Rectangle

        ax, ranks = self.ax, sorted(recording)
        ax.clear()
        self.figure.set_size_inches(COLUMN_IN, 1.6 + 0.45 * 2 * len(ranks))      # two lanes per rank
        self.bars, self.ticks, seen = [], {}, {}
        for r, rank in enumerate(ranks):
            spans = [s for s in recording[rank] if s.end > s.start]
            for lane in (0, 1):                                     # 0: compute, 1: communication
                mine = in_order(s for s in spans if (s.kind in COMMUNICATION_KINDS) == lane)
                rows = _pack(mine)
                height = 0.8 / (max(rows, default=0) + 1)          # the lane's 0.8 shared by sub-rows
                for s, row in zip(mine, rows):
                    other = OTHER_COLOURS[sum(k not in COLOURS for k in seen) % len(OTHER_COLOURS)]
                    colour = seen.setdefault(s.kind, COLOURS.get(s.kind, other))
                    bar = Rectangle((1e3 * s.start, 2 * r + lane - 0.4 + row * height), 1e3 * s.duration,
                                    height, facecolor=colour, edgecolor="black", linewidth=0.3)
                    ax.add_patch(bar)
                    self.bars.append((rank, s, bar))
            points = [1e3 * s.start for s in recording[rank] if s.end == s.start]
            self.ticks[rank], = ax.plot(points, [2 * r - 0.45] * len(points), "|", color="black", markersize=4)
        every = [s for spans in recording.values() for s in spans]
        ax.set_xlim(min([0.0] + [1e3 * s.start for s in every]),
                    self.xlim_ms or 1.02e3 * max([1e-3] + [s.end for s in every]))
        ax.set_ylim(2 * len(ranks) - 0.5, -0.7)            # rank 0 on top
        ax.set_yticks(range(2 * len(ranks)),
                      [f"rank {rank} {lane}" for rank in ranks for lane in ("compute", "comm")], fontsize=8)
        ax.set_xlabel("time since the shared origin (ms)")
        ax.legend(handles=[Patch(color=c, label=k) for k, c in seen.items()], fontsize=8, ncols=len(seen),
                  loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
        ax.set_title(title, fontsize=9, pad=22)
        self.figure.tight_layout()


def timeline_figure(recording: Recording, title: str = "") -> Figure:
    """The Gantt chart of ``recording`` as a matplotlib Figure."""
    return TimelineView(recording, title=title).figure


def timeline_widget(runs: Mapping[str, Recording], titles: Mapping[str, str] | None = None) -> ipywidgets.VBox:
    """A dropdown over recorded runs, and a checkbox that draws them all on one time axis (the
    longest run's), so their lengths compare, or each on its own, so a short one's detail shows."""
    import ipywidgets as widgets

    if not runs:
        raise ValueError("timeline_widget needs at least one recorded run, got none.")
    names, titles = list(runs), titles or {}
    longest = 1.02e3 * max(s.end for rec in runs.values() for spans in rec.values() for s in spans)
    view = TimelineView(runs[names[0]], xlim_ms=longest, title=titles.get(names[0], names[0]))
    dropdown = widgets.Dropdown(options=names, value=names[0], description="run")
    shared = widgets.Checkbox(value=True, description="same time axis for every run")

    def redraw(name: str, same_axis: bool) -> None:
        view.xlim_ms = longest if same_axis else None
        view.show(runs[name], titles.get(name, name))

    return figure_widget({"dropdown": dropdown, "shared": shared}, redraw, view.figure, view=view, runs=runs)
