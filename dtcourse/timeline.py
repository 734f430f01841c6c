"""Timelines of what each rank computed and communicated, measured, then drawn as a Gantt chart.

Lesson 02 uses them to show DDP hiding gradient all-reduces behind backward (Li et al.,
"PyTorch Distributed", arXiv 2006.15704); the pipeline lesson draws its schedules with them.
A ``Timeline`` belongs to one rank and stores spans ``(kind, name, start, end)`` in seconds
after its ``origin``. ``Timeline.record`` has the signature of the ``on_event`` hook of
``dtcourse.data_parallel.DistributedDataParallel``; ``Timeline.span`` times your own code::

    timeline = Timeline(shared_origin())        # inside a rank: t = 0 is just after a barrier
    ddp = DistributedDataParallel(GPT(config), on_event=timeline.record)
    with timeline.span("optimizer", "AdamW step"):
        opt.step()

The lesson's one-liner records real DDP steps on forked ranks and shows them::

    from dtcourse.timeline import ddp_timeline_widget
    ddp_timeline_widget(world_size=2)           # a dropdown over the three strategies

Clocks: every rank reads ``time.perf_counter``, which on Linux is CLOCK_MONOTONIC,
one clock shared by every process of the machine. So two ranks' absolute readings
are directly comparable and ``merge`` only has to subtract one common origin.
``shared_origin`` makes that origin a meaningful instant (rank 0's clock just after
a barrier). Ranks on different machines would need their clock offsets estimated
first, as NTP or PTP do; the course's ranks never leave one machine.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from dtcourse.data_parallel import STRATEGIES, DistributedDataParallel
from dtcourse.figure_widget import figure_widget, png
from dtcourse.launcher import launch
from dtcourse.models import GPT, GPTConfig, lm_loss, token_batch

if TYPE_CHECKING:   # matplotlib and ipywidgets are imported only when something is drawn
    import ipywidgets
    from matplotlib.figure import Figure

__all__ = ["Span", "Timeline", "shared_origin", "merge", "ddp_spans", "TimelineView",
           "timeline_figure", "timeline_widget", "OverlapSummary", "overlap_summary", "record_ddp_runs",
           "record_ddp_steps", "describe", "ddp_timeline_widget", "DDP_GPT"]

# 867k parameters (3.3 MiB of float32 gradients): big enough that all-reducing them shows
# on a timeline, small enough that a step on one CPU thread takes tens of milliseconds.
DDP_GPT = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, d_model=128)
COMMUNICATION_KINDS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv"})
COLOURS = MappingProxyType({"forward": "tab:blue", "backward": "tab:orange", "sync": "tab:gray",
                            "wait": "tab:red", "optimizer": "tab:green", "all_reduce": "tab:purple"})
OTHER_COLOURS = ("tab:brown", "tab:pink", "tab:olive", "tab:cyan", "gold", "navy")   # other kinds, in turn
Recording = dict[int, list["Span"]]        # rank -> that rank's spans, on one shared time axis


@dataclass(frozen=True)
class Span:
    """One interval of one rank's time, in seconds after an origin. ``start == end`` marks a point."""

    kind: str
    name: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


def _in_order(spans) -> list[Span]:
    """By start time; of spans starting together the longer first, so an enclosing span leads."""
    return sorted(spans, key=lambda s: (s.start, -s.end))


class Timeline:
    """One rank's spans. Picklable, so a function run by ``launch`` can return it."""

    def __init__(self, origin: float | None = None):
        self.origin = time.perf_counter() if origin is None else origin
        self.spans: list[Span] = []

    def record(self, kind: str, name: str, start: float, end: float) -> None:
        """Add a span given in absolute ``time.perf_counter()`` seconds (DDP's ``on_event`` signature)."""
        if end < start:
            raise ValueError(f"Timeline.record: span {kind}/{name} ends ({end}) before it starts ({start}).")
        self.spans.append(Span(kind, name, start - self.origin, end - self.origin))

    @contextlib.contextmanager
    def span(self, kind: str, name: str | None = None) -> Iterator[None]:
        """Record the time the body takes as one span (also when the body raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(kind, name or kind, start, time.perf_counter())

    def restart(self, origin: float | None = None) -> None:
        """Forget every span and measure from a new origin (for example the start of the next step)."""
        self.origin = time.perf_counter() if origin is None else origin
        self.spans = []


def shared_origin(group: dist.ProcessGroup | None = None) -> float:
    """Rank 0's ``perf_counter`` just after a barrier, the same value on every rank of ``group``."""
    dist.barrier(group=group)
    t = torch.tensor([time.perf_counter()], dtype=torch.float64)   # float64: microseconds survive
    dist.broadcast(t, group_src=0, group=group)                    # 8 bytes to every other rank
    return t.item()


def merge(timelines: Mapping[int, Timeline] | Sequence[Timeline], origin: float | None = None) -> Recording:
    """Put every rank's spans on one time axis: seconds after ``origin`` (default: the earliest origin).

    Valid because all ranks read the same CLOCK_MONOTONIC (see the module docstring).
    """
    items = list(timelines.items() if isinstance(timelines, Mapping) else enumerate(timelines))
    origin = min(t.origin for _, t in items) if origin is None else origin
    return {rank: _in_order(replace(s, start=s.start + t.origin - origin, end=s.end + t.origin - origin)
                            for s in t.spans) for rank, t in items}


def ddp_spans(recording: Recording) -> Recording:
    """Split DDP's ``backward`` span where autograd's work ends, from measured times.

    DDP's ``backward`` lasts until ``backward()`` returns, which includes the engine callback
    that launches the remaining all-reduces and waits for them. It is cut at its last ``grad``
    point: autograd's work before it stays ``backward``, the rest becomes ``sync``.
    """
    out: Recording = {}
    for rank, spans in recording.items():
        grads = [s.start for s in spans if s.kind == "grad"]
        result = []
        for s in spans:
            last = max((g for g in grads if s.start <= g <= s.end), default=s.end)
            if s.kind == "backward" and last < s.end:
                result += [replace(s, end=last), Span("sync", "after the last gradient", last, s.end)]
            else:
                result.append(s)
        out[rank] = _in_order(result)
    return out


@dataclass(frozen=True)
class OverlapSummary:
    """How one rank's all-reduces sat against its backward computation, in milliseconds.

    Only asynchronous all-reduces (those DDP waited on) can hide: a synchronous one
    (``comm="ring"``) stops backward while it runs, even inside the backward span. An async
    all-reduce's span ends when ``wait()`` returned, an upper bound on when the data arrived,
    so ``comm_ms`` is an upper bound and ``hidden_fraction`` a lower bound.
    """

    step_ms: float             # first span start to last span end
    backward_ms: float         # backward start to the last gradient
    comm_ms: float             # time covered by at least one all_reduce span
    hidden_ms: float           # the async part of comm_ms inside the backward computation
    all_reduces: int
    launched_during_backward: int   # all_reduce spans that start before the last gradient

    @property
    def hidden_fraction(self) -> float:
        return self.hidden_ms / self.comm_ms if self.comm_ms else 0.0


def overlap_summary(spans: Sequence[Span]) -> OverlapSummary:
    """Summarise one rank's DDP step (raw or ``ddp_spans`` spans: the grad points decide)."""
    backward = [s for s in spans if s.kind == "backward"]
    if len(backward) != 1:
        raise ValueError(f"overlap_summary needs exactly one backward span (one step), got {len(backward)}.")
    start = backward[0].start
    end = max((s.start for s in spans if s.kind == "grad" and s.start >= start), default=backward[0].end)
    waited = {s.name for s in spans if s.kind == "wait"}
    comm = sorted((s.start, s.end, s.name in waited) for s in spans if s.kind == "all_reduce")
    covered = hidden = 0.0
    reach = float("-inf")                         # how far the all-reduces seen so far cover
    for lo, hi, is_async in comm:
        lo = max(lo, reach)                       # count time covered by two all-reduces once
        if hi > lo:
            covered += hi - lo
            hidden += max(0.0, min(hi, end) - max(lo, start)) if is_async else 0.0
        reach = max(reach, hi)
    return OverlapSummary(1e3 * (max(s.end for s in spans) - min(s.start for s in spans)), 1e3 * (end - start),
                          1e3 * covered, 1e3 * hidden, len(comm), sum(c[0] < end for c in comm))


# --------------------------------------------------------------------------- #
# Drawing
# --------------------------------------------------------------------------- #
def _pack(spans: list[Span]) -> list[int]:
    """Sub-row of each span so that no two spans in one sub-row overlap (first one that fits)."""
    row_ends: list[float] = []
    rows = []
    for s in spans:                               # in _in_order order
        row = next((i for i, e in enumerate(row_ends) if e <= s.start), len(row_ends))
        if row == len(row_ends):
            row_ends.append(s.end)
        row_ends[row] = s.end
        rows.append(row)
    return rows


class TimelineView:
    """A Gantt chart of a recording: per rank a compute lane and a communication lane, time in ms.

    Spans that overlap within a lane (an all-reduce in flight while the next is launched) are
    stacked in thinner sub-rows. Points (``grad``) are ticks above the compute lane. ``bars``
    keeps ``(rank, span, Rectangle)`` for every bar drawn, and ``ticks`` each rank's tick line.
    """

    def __init__(self, recording: Recording | None = None, xlim_ms: float | None = None, title: str = ""):
        import matplotlib.pyplot as plt

        self.figure, self.ax = plt.subplots(figsize=(9.0, 3.2))
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
        self.figure.set_size_inches(9.0, 1.4 + 0.45 * 2 * len(ranks))      # two lanes per rank
        self.bars, self.ticks, seen = [], {}, {}
        for r, rank in enumerate(ranks):
            spans = [s for s in recording[rank] if s.end > s.start]
            for lane in (0, 1):                                     # 0: compute, 1: communication
                mine = _in_order(s for s in spans if (s.kind in COMMUNICATION_KINDS) == lane)
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
        ax.legend(handles=[Patch(color=c, label=k) for k, c in seen.items()], fontsize=7, ncols=len(seen),
                  loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
        ax.set_title(title, fontsize=9, pad=22)
        self.figure.tight_layout()

    def png(self) -> bytes:
        """The figure as PNG bytes, as the widget shows it."""
        return png(self.figure)


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

    return figure_widget({"dropdown": dropdown, "shared": shared}, redraw, view.figure, max_width="820px",
                         view=view, runs=runs)


# --------------------------------------------------------------------------- #
# Recording real DDP steps
# --------------------------------------------------------------------------- #
def _record_rank(runs: dict[str, dict], config: GPTConfig, batch_size: int, seq_len: int,
                 steps: int) -> dict[str, Timeline]:
    idx, targets = token_batch(config, batch_size, seq_len, seed=dist.get_rank())   # this rank's data
    out = {}
    for label, ddp_kwargs in runs.items():
        timeline = Timeline()
        model = GPT(config, seed=0)
        ddp = DistributedDataParallel(model, on_event=timeline.record, **ddp_kwargs)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(steps):                 # each step starts a fresh timeline: the last one is kept
            timeline.restart(shared_origin())
            opt.zero_grad()
            logits = ddp(idx)
            with timeline.span("forward", "loss"):
                loss = lm_loss(logits, targets)
            loss.backward()
            with timeline.span("optimizer", "AdamW step"):
                opt.step()
        out[label] = timeline
    return out


def record_ddp_runs(world_size: int, runs: Mapping[str, Mapping[str, Any]], steps: int = 3,
                    config: GPTConfig = DDP_GPT, batch_size: int = 4, seq_len: int = 32,
                    timeout: float = 120) -> dict[str, Recording]:
    """Train the GPT for ``steps`` AdamW steps per run, in one launch; return each run's last step.

    ``runs`` maps a label to ``DistributedDataParallel`` keyword arguments, for example
    ``{"1 MiB": {"strategy": "overlapped", "bucket_cap_mb": 1}}``. The steps before the last
    warm up the allocator and gloo's connections. Each rank trains on its own ``batch_size`` x
    ``seq_len`` tokens. The spans come back merged and passed through ``ddp_spans``.
    """
    if steps < 1:
        raise ValueError(f"record_ddp_runs: steps must be at least 1 (the last one is kept), got {steps}.")
    per_rank = launch(_record_rank, world_size, {k: dict(v) for k, v in runs.items()}, config, batch_size,
                      seq_len, steps, timeout=timeout)
    return {label: ddp_spans(merge([r[label] for r in per_rank])) for label in runs}


def record_ddp_steps(world_size: int = 2, strategy: str = "overlapped", bucket_cap_mb: float = 1.0,
                     comm: str = "backend", **kwargs: Any) -> Recording:
    """The last of a few real DDP steps of one strategy (other arguments as ``record_ddp_runs``).

    The default 1 MiB cap cuts ``DDP_GPT``'s 3.3 MiB of gradients into 4 buckets; at 25 MiB
    there would be one, which fills only with the last gradient, so nothing could overlap.
    """
    run = {"strategy": strategy, "bucket_cap_mb": bucket_cap_mb, "comm": comm}
    return record_ddp_runs(world_size, {strategy: run}, **kwargs)[strategy]


def describe(label: str, recording: Recording) -> str:
    """One line for a figure title: step time and how much all-reduce time backward hid (rank 0)."""
    s = overlap_summary(recording[min(recording)])
    return (f"{label}: step {s.step_ms:.1f} ms on rank 0; {s.launched_during_backward} of {s.all_reduces} "
            f"all-reduces launched during backward; {100 * s.hidden_fraction:.0f}% of all-reduce time hidden")


def ddp_timeline_widget(world_size: int = 2, bucket_cap_mb: float = 1.0, comm: str = "backend",
                        **kwargs: Any) -> ipywidgets.VBox:
    """Record one step of each strategy on ``world_size`` ranks; a dropdown picks the timeline shown."""
    runs = record_ddp_runs(world_size, {s: {"strategy": s, "bucket_cap_mb": bucket_cap_mb, "comm": comm}
                                        for s in STRATEGIES}, **kwargs)
    return timeline_widget(runs, {label: describe(label, rec) for label, rec in runs.items()})
