"""What lesson 01 runs and draws: the six collectives' before/after pictures, the measured
busbw beside the alpha-beta model, and a step-through widget of ring all-reduce.

* ``collectives_figure``: lesson 01 runs each collective on 4 ranks where rank r starts with
  ``[10r, 10r+1, 10r+2, 10r+3]``, so every value says which rank it came from; one panel per
  collective shows each rank's tensor before and after, coloured by source rank.
* ``measure`` / ``ping_pong`` / ``fitted_model`` / ``table`` / ``plot``: naive, tree and ring
  all-reduce timed against the backend's own (the median of several iterations; each
  iteration's time is the slowest rank's), with algbw and busbw as nccl-tests defines them and
  the alpha-beta model fitted from a two-rank ping-pong. ``python -m dtcourse.bench.collectives``
  runs the full sweep.
* ``ring_widget``: ``record_ring_all_reduce`` runs ``dtcourse.collectives.ring_all_reduce`` with a
  ``ByteCounter`` and keeps every message; replaying them (``ring_states``) gives, for each step,
  which ranks' values each chunk on each rank already holds (a reduce-scatter message adds the
  sender's partial sum into the receiver's chunk, an all-gather message overwrites it).
  ``RingView`` draws one step and ``ring_widget`` puts a slider on it::

    from dtcourse.lab.collectives import ring_widget
    ring_widget(world_size=4)          # in a notebook cell
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from dtcourse.collectives import (ALGORITHMS, ByteCounter, Message, busbw, chunk_sizes, fit_alpha_beta,
                                  predict_time, ring_all_reduce)
from dtcourse.lab.widgets import FigureView, figure_widget
from dtcourse.runtime.launch import launch


# --------------------------------------------------------------------------- #
# The six collectives, before and after
# --------------------------------------------------------------------------- #
Run = Sequence[tuple[Sequence[float] | None, Sequence[float] | None]]   # per rank: (before, after)


def source_colour(value: float, n_ranks: int) -> str:
    """Matplotlib colour for a value from rank r (values in [10r, 10r+10)); grey for a sum."""
    return f"C{int(value) // 10}" if 0 <= value < 10 * n_ranks else "0.75"


def draw_before_after(ax, title: str, per_rank: Run, n_ranks: int) -> None:
    """One panel: row r is rank r, its tensor before and after; ``None`` means undefined there."""
    from matplotlib.patches import Rectangle

    for r, (before, after) in enumerate(per_rank):
        ax.text(-0.7, -r, f"rank {r}", ha="right", va="center", fontsize=8)
        ax.text(4.6, -r, "→", ha="center", va="center")
        for x0, values in ((0, before), (5.5, after)):
            if values is None:
                ax.text(x0 + 1.5, -r, "undefined", ha="center", va="center", fontsize=8, color="0.5")
                continue
            for j, v in enumerate(values):
                ax.add_patch(Rectangle((x0 + j - 0.45, -r - 0.4), 0.9, 0.8, color=source_colour(v, n_ranks),
                                       alpha=0.45))
                ax.text(x0 + j, -r, f"{v:g}", ha="center", va="center", fontsize=8)
    ax.set(xlim=(-2.4, 9.1), ylim=(-len(per_rank) + 0.5, 0.9), title=title)
    ax.axis("off")


def collectives_figure(runs: dict[str, Run], n_ranks: int, columns: int = 3):
    """A grid of before/after panels, one per collective, in the order given."""
    import matplotlib.pyplot as plt

    rows = -(-len(runs) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.4 * columns, 2.5 * rows), squeeze=False)
    for ax, (name, per_rank) in zip(axes.flat, runs.items()):
        draw_before_after(ax, name, per_rank, n_ranks)
    for ax in list(axes.flat)[len(runs):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- #
# Measured time against the alpha-beta model
# --------------------------------------------------------------------------- #
BACKEND = "backend"   # the process group's own dist.all_reduce (gloo here, nccl on GPUs)
DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _iterations(nbytes: int) -> int:
    return 20 if nbytes <= (1 << 20) else 8 if nbytes <= (16 << 20) else 5


def _time_rank(sizes: list[int], algorithms: list[str]) -> list[dict]:
    """Inside every rank: time each algorithm at each size; rank 0's list is the answer."""
    world = dist.get_world_size()
    rows = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        for name in algorithms:
            run = (lambda t: dist.all_reduce(t)) if name == BACKEND else ALGORITHMS[name]
            times = []
            for i in range(_iterations(nbytes) + 2):            # the first 2 are warm-up
                x.fill_(1.0)                                    # repeated sums would overflow to inf
                dist.barrier()
                start = time.perf_counter()
                run(x)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # an iteration lasts as long as its slowest rank
                if i >= 2:
                    times.append(elapsed.item())
            seconds = statistics.median(times)
            rows.append({"algorithm": name, "world_size": world, "nbytes": nbytes, "seconds": seconds,
                         "algbw": nbytes / seconds, "busbw": busbw("all_reduce", nbytes, seconds, world)})
    return rows


def measure(world_size: int, sizes: list[int] | None = None,
            algorithms: tuple[str, ...] = ("naive", "tree", "ring", BACKEND), timeout: float = 600) -> list[dict]:
    """Time all-reduce algorithms at one world size; one dict per (algorithm, size)."""
    return launch(_time_rank, world_size, list(sizes or DEFAULT_SIZES), list(algorithms), timeout=timeout)[0]


def _ping_pong_rank(sizes: list[int], repeats: int) -> list[tuple[int, float]]:
    rank = dist.get_rank()
    out = []
    for nbytes in sizes:
        buf = torch.ones(max(nbytes // 4, 1))
        times = []
        for _ in range(repeats + 2):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - start) / 2)      # one way = half a round trip
        out.append((buf.nbytes, statistics.median(times[2:])))
    return out


def ping_pong(sizes: list[int] | None = None, repeats: int = 10) -> list[tuple[int, float]]:
    """One-way message time between two ranks, for fitting alpha (latency) and beta (s/byte)."""
    sizes = sizes or [4, 4 << 10, 64 << 10, 1 << 20, 4 << 20]
    return launch(_ping_pong_rank, 2, sizes, repeats)[0]


def fitted_model(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """alpha (s) and beta (s/byte) from ping-pong samples."""
    return fit_alpha_beta([s for s, _ in samples], [t for _, t in samples])


def human_size(nbytes: int) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def table(rows: list[dict]) -> str:
    """Text table: one line per (world size, size), busbw per algorithm and ring/backend ratio."""
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    head = f"{'N':>3} {'size':>8} " + " ".join(f"{a + ' GB/s':>13}" for a in algorithms) + "  ring/backend"
    lines = [head, "-" * len(head)]
    keys = sorted({(r["world_size"], r["nbytes"]) for r in rows})
    for n, nbytes in keys:
        by_alg = {r["algorithm"]: r for r in rows if (r["world_size"], r["nbytes"]) == (n, nbytes)}
        cells = " ".join(f"{by_alg[a]['busbw'] / 1e9:13.3f}" for a in algorithms)
        ratio = (by_alg["ring"]["busbw"] / by_alg[BACKEND]["busbw"]) if {"ring", BACKEND} <= by_alg.keys() else float("nan")
        lines.append(f"{n:>3} {human_size(nbytes):>8} {cells}  {ratio:12.2f}")
    return "\n".join(lines)


def plot(rows: list[dict], alpha: float | None = None, beta: float | None = None):
    """busbw against message size, one panel per world size, with the alpha-beta predictions dashed."""
    import matplotlib.pyplot as plt

    worlds = sorted({r["world_size"] for r in rows})
    fig, axes = plt.subplots(1, len(worlds), figsize=(5 * len(worlds), 3.8), squeeze=False, sharey=True)
    for ax, n in zip(axes[0], worlds):
        for name in dict.fromkeys(r["algorithm"] for r in rows):
            mine = sorted((r for r in rows if r["world_size"] == n and r["algorithm"] == name),
                          key=lambda r: r["nbytes"])
            sizes = [r["nbytes"] for r in mine]
            line, = ax.plot(sizes, [r["busbw"] / 1e9 for r in mine], "o-", label=f"{name} (measured)")
            if alpha is not None and name in ALGORITHMS:
                predicted = [busbw("all_reduce", s, predict_time(name, s, n, alpha, beta), n) / 1e9 for s in sizes]
                ax.plot(sizes, predicted, "--", color=line.get_color(), alpha=0.7, label=f"{name} (model)")
        ax.set_xscale("log")
        ax.set_yscale("log")                     # small messages are latency-bound: keep them visible
        ax.set_title(f"all-reduce, N = {n}")
        ax.set_xlabel("message size (bytes)")
    axes[0][0].set_ylabel("bus bandwidth (GB/s)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- #
# Ring all-reduce, step by step
# --------------------------------------------------------------------------- #
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


class RingView(FigureView):
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


def ring_widget(world_size: int = 4, numel: int = 8):
    """A slider over the steps of a recorded ring all-reduce, with the figure below it."""
    import ipywidgets as widgets

    view = RingView(record_ring_all_reduce(world_size, numel))
    slider = widgets.IntSlider(value=0, min=0, max=view.steps, description="step")
    return figure_widget({"slider": slider}, view.show, view.figure, max_width="560px", view=view)
