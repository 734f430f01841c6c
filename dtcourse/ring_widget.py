"""A step-through view of ring all-reduce, drawn from the messages the real code sent.

``record_ring_all_reduce`` runs ``dtcourse.collectives.ring_all_reduce`` on
``world_size`` ranks with a ``ByteCounter`` and keeps every message. Replaying
those messages (``ring_states``) gives, for each step, which ranks' values each
chunk on each rank already holds: a reduce-scatter message adds the sender's
partial sum into the receiver's chunk, an all-gather message overwrites it with
the finished chunk. ``RingView`` draws one step; ``ring_widget`` puts a slider
on it::

    from dtcourse.ring_widget import ring_widget
    ring_widget(world_size=4)          # in a notebook cell
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtcourse.collectives import ByteCounter, Message, chunk_sizes, ring_all_reduce
from dtcourse.figure_widget import figure_widget, png
from dtcourse.launcher import launch

State = list[list[frozenset]]  # state[rank][chunk] -> ranks whose values are summed in


@dataclass(frozen=True)
class RingRecording:
    world_size: int
    numel: int
    messages: tuple[Message, ...]   # every rank's sent messages, in step order
    results: tuple[tuple[float, ...], ...]  # each rank's tensor after the all-reduce


def _record_rank(numel: int):
    counter = ByteCounter()
    x = torch.full((numel,), float(dist.get_rank() + 1))   # rank r contributes r + 1 everywhere
    ring_all_reduce(x, counter=counter)
    return counter.messages, tuple(x.tolist())


def record_ring_all_reduce(world_size: int = 4, numel: int = 8) -> RingRecording:
    """Run the real ring all-reduce and collect the messages every rank sent."""
    if world_size < 2:
        raise ValueError(f"a ring needs at least 2 ranks, got world_size={world_size}")
    if numel < world_size:
        raise ValueError(f"numel={numel} < world_size={world_size} leaves empty chunks, which send nothing "
                         "and so cannot be drawn; use numel >= world_size")
    per_rank = launch(_record_rank, world_size, numel)
    messages = sorted((m for sent, _ in per_rank for m in sent), key=lambda m: (m.step, m.src))
    return RingRecording(world_size, numel, tuple(messages), tuple(r for _, r in per_rank))


def ring_states(recording: RingRecording) -> list[State]:
    """``states[t]`` is the state after t steps; there are 2(N-1) steps, so 2N-1 states."""
    n = recording.world_size
    state: State = [[frozenset([r]) for _ in range(n)] for r in range(n)]
    states = [state]
    for step in range(2 * (n - 1)):
        new = [row[:] for row in state]
        for m in recording.messages:
            if m.step != step:
                continue
            if m.phase == "reduce-scatter":
                new[m.dst][m.chunk] = state[m.dst][m.chunk] | state[m.src][m.chunk]
            else:  # all-gather: the finished chunk replaces what was there
                new[m.dst][m.chunk] = state[m.src][m.chunk]
        states.append(new)
        state = new
    return states


class RingView:
    """Draws the ring at one step: each rank's chunks, shaded by how many ranks they hold, and arrows."""

    def __init__(self, recording: RingRecording):
        import matplotlib.pyplot as plt

        self.recording = recording
        self.states = ring_states(recording)
        self.steps = len(self.states) - 1
        self.figure, self.ax = plt.subplots(figsize=(6.4, 6.0))
        plt.close(self.figure)  # shown through the widget, not by the inline backend
        self.cells: dict[tuple[int, int], tuple] = {}
        self.arrows: list = []   # one per message in flight
        self.notes: list = []    # the chunk each arrow carries
        self.step = 0
        self._draw_static()
        self.show(0)

    def _position(self, rank: int) -> tuple[float, float]:
        angle = math.pi / 2 - 2 * math.pi * rank / self.recording.world_size   # clockwise from the top
        return 1.2 * math.cos(angle), 1.2 * math.sin(angle)

    def _position_between(self, src: int, dst: int) -> tuple[float, float]:
        n = self.recording.world_size
        angle = math.pi / 2 - 2 * math.pi * (src + 0.5 * ((dst - src) % n)) / n
        return 0.3 * math.cos(angle), 0.3 * math.sin(angle)

    def _draw_static(self) -> None:
        from matplotlib.patches import Rectangle

        n, ax = self.recording.world_size, self.ax
        width, height = 0.62, 0.12
        for rank in range(n):
            x, y = self._position(rank)
            top = y + height * n / 2
            ax.text(x, top + 0.04, f"rank {rank}", ha="center", va="bottom", fontsize=9, weight="bold")
            for chunk in range(n):   # chunks stacked top to bottom
                bottom = top - (chunk + 1) * height
                box = Rectangle((x - width / 2, bottom), width, height, edgecolor="black", linewidth=0.6)
                ax.add_patch(box)
                ax.text(x - width / 2 - 0.02, bottom + height / 2, f"c{chunk}", ha="right", va="center",
                        fontsize=6, color="gray")
                label = ax.text(x, bottom + height / 2, "", ha="center", va="center", fontsize=7)
                self.cells[rank, chunk] = (box, label)
        ax.set_xlim(-1.9, 1.9)
        ax.set_ylim(-1.75, 1.75)
        ax.set_aspect("equal")
        ax.axis("off")

    def in_flight(self, step: int) -> list[Message]:
        """Messages sent during ``step`` (they turn state ``step`` into state ``step + 1``)."""
        return [m for m in self.recording.messages if m.step == step]

    def show(self, step: int) -> None:
        from matplotlib import colormaps
        from matplotlib.patches import FancyArrowPatch

        if not 0 <= step <= self.steps:
            raise ValueError(f"step must be between 0 and {self.steps}, got {step}")
        self.step = step
        n, cmap = self.recording.world_size, colormaps["Blues"]
        for (rank, chunk), (box, label) in self.cells.items():
            holders = self.states[step][rank][chunk]
            box.set_facecolor(cmap(0.15 + 0.75 * len(holders) / n))
            label.set_text("+".join(str(r) for r in sorted(holders)))
        for artist in self.arrows + self.notes:
            artist.remove()
        self.arrows, self.notes = [], []
        for m in self.in_flight(step):
            (x0, y0), (x1, y1) = self._position(m.src), self._position(m.dst)
            color = "tab:red" if m.phase == "reduce-scatter" else "tab:green"
            arrow = FancyArrowPatch((x0 * 0.55, y0 * 0.55), (x1 * 0.55, y1 * 0.55), arrowstyle="-|>",
                                    mutation_scale=12, connectionstyle="arc3,rad=-0.3", color=color)
            self.ax.add_patch(arrow)
            mid = self._position_between(m.src, m.dst)
            note = self.ax.text(*mid, f"c{m.chunk}", color=color, fontsize=8, ha="center", va="center")
            self.arrows.append(arrow)
            self.notes.append(note)
        phase = "done" if step == self.steps else self.in_flight(step)[0].phase if self.in_flight(step) else ""
        sizes = chunk_sizes(self.recording.numel, n)
        self.ax.set_title(f"step {step} of {self.steps}: {phase}\n"
                          f"cell = ranks summed into that chunk; chunk sizes {sizes}", fontsize=9)

    def png(self) -> bytes:
        """The figure as PNG bytes, as the widget shows it."""
        return png(self.figure)


def ring_widget(world_size: int = 4, numel: int = 8):
    """A slider over the steps of a recorded ring all-reduce, with the figure below it."""
    import ipywidgets as widgets

    view = RingView(record_ring_all_reduce(world_size, numel))
    slider = widgets.IntSlider(value=0, min=0, max=view.steps, description="step")
    return figure_widget({"slider": slider}, view.show, view.figure, max_width="560px", view=view)
