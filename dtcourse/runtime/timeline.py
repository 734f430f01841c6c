"""Timelines of what each rank computed and communicated, recorded on one clock.

A ``Timeline`` belongs to one rank and stores spans ``(kind, name, start, end)`` in seconds after
its ``origin``. ``Timeline.record`` takes absolute ``time.perf_counter`` seconds (hooks and the
observer's records give those); ``Timeline.span`` times your own code::

    timeline = Timeline(shared_origin())        # inside a rank: t = 0 is just after a barrier
    timeline.record("grad", "net.0.weight", t, t)
    with timeline.span("optimizer", "AdamW step"):
        opt.step()

Lesson 02 records DDP steps with it (``dtcourse.lab.data_parallel``) and the pipeline lesson its
schedules; ``dtcourse.lab.timeline`` draws any recording as a Gantt chart.

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
from typing import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["Span", "Timeline", "Recording", "shared_origin", "merge", "in_order", "COMMUNICATION_KINDS"]

COMMUNICATION_KINDS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv"})
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


def in_order(spans) -> list[Span]:
    """By start time; of spans starting together the longer first, so an enclosing span leads."""
    return sorted(spans, key=lambda s: (s.start, -s.end))


class Timeline:
    """One rank's spans. Picklable, so a function run by ``launch`` can return it."""

    def __init__(self, origin: float | None = None):
        self.origin = time.perf_counter() if origin is None else origin
        self.spans: list[Span] = []

    def record(self, kind: str, name: str, start: float, end: float) -> None:
        """Add a span given in absolute ``time.perf_counter()`` seconds."""
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
    return {rank: in_order(replace(s, start=s.start + t.origin - origin, end=s.end + t.origin - origin)
                            for s in t.spans) for rank, t in items}
