"""What lesson 01 runs and draws: the six collectives before and after, measured bus bandwidth beside
the alpha-beta-gamma model, a step-through widget of ring all-reduce, and the lesson's problems.

* ``collectives_figure``: lesson 01 runs each collective on 4 ranks where rank r starts with
  ``[10r, 10r+1, 10r+2, 10r+3]``, so every value says which rank it came from; one panel per
  collective shows each rank's tensor before and after, coloured by source rank.
* ``measure`` / ``fit_link`` / ``table`` / ``plot``: our all-reduces (and ring reduce-scatter and
  all-gather) timed against the backend's own, taking turns iteration by iteration, so that the
  ratios are paired (each iteration lasts as long as its slowest rank; the median is kept), with
  algbw and busbw as nccl-tests defines them. ``fit_link`` measures the model's parameters the way
  the ring uses the machine: alpha and beta from a ring shift on all N ranks at once, gamma from
  every rank adding a buffer at once. ``python -m dtcourse.bench.collectives`` runs the full sweep.
* ``ring_widget``: ``record_ring_all_reduce`` runs ``dtcourse.collectives.ring_all_reduce`` with a
  ``ByteCounter`` and keeps every message; replaying them (``ring_states``) gives, after each step,
  which ranks' values each chunk on each rank already holds. ``RingView`` draws one state with the
  arrows of the next step, and ``ring_widget`` puts a slider on it::

    from dtcourse.lab.collectives import ring_widget
    ring_widget(world_size=4)          # in a notebook cell
* ``problem_*``: the lesson's predict-then-check problems, each measured or counted on real ranks.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from dtcourse.runtime.turns import turns
from dtcourse.collectives import (ALGORITHMS, ByteCounter, Message, algbw, busbw, chunk_sizes, fast_ring_all_gather,
                                  fast_ring_all_reduce, fast_ring_reduce_scatter, fit_alpha_beta, predict_time,
                                  ring_all_reduce)
from dtcourse.collectives.messages import exchange
from dtcourse.lab.problems import Answer, pretty
from dtcourse.lab.widgets import COLUMN_IN, FigureView, figure_widget
from dtcourse.runtime.compat import all_gather_single, reduce_scatter_single
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
                ax.text(x0 + 1.5, -r, "undefined", ha="center", va="center", fontsize=8, color="0.4")
                continue
            for j, v in enumerate(values):
                ax.add_patch(Rectangle((x0 + j - 0.45, -r - 0.4), 0.9, 0.8, color=source_colour(v, n_ranks),
                                       alpha=0.45))
                ax.text(x0 + j, -r, f"{v:g}", ha="center", va="center", fontsize=8)
    ax.set(xlim=(-2.4, 9.1), ylim=(-len(per_rank) + 0.5, 0.9))
    ax.set_title(title, fontsize=10)
    ax.axis("off")


def collectives_figure(runs: dict[str, Run], n_ranks: int, columns: int = 2):
    """A grid of before/after panels, one per collective, in the order given; as wide as the column."""
    import matplotlib.pyplot as plt

    rows = -(-len(runs) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(COLUMN_IN, 0.5 + 0.45 * n_ranks * rows), squeeze=False)
    for ax, (name, per_rank) in zip(axes.flat, runs.items()):
        draw_before_after(ax, name, per_rank, n_ranks)
    for ax in list(axes.flat)[len(runs):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- #
# Measured time against the alpha-beta-gamma model
# --------------------------------------------------------------------------- #
BACKEND = "backend"   # the process group's own collective (gloo here, nccl on GPUs)
AGAIN = "backend again"   # the same collective timed a second time in each round: the noise floor of a ratio
SLICES = 2            # the pipelined ring's slices per chunk, as "ring/2" (gloo's ring uses at least 2)
CHUNK_BYTES = 4 << 20  # the ring in blocks, "ring/blocks": no message above 4 MB (16 MB blocks on 4 ranks)
BLOCKS = "ring/blocks"
DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _iterations(nbytes: int) -> int:
    return 20 if nbytes <= (1 << 20) else 8 if nbytes <= (16 << 20) else 5


def _ours(collective: str, name: str) -> Callable:
    """(big, small) -> None: one of our algorithms; ``big`` holds S bytes, ``small`` S/N."""
    if collective == "all_reduce":
        algorithm, _, slices = name.partition("/")
        fn = fast_ring_all_reduce if algorithm == "ring" else ALGORITHMS[algorithm]   # the ring as libraries run it
        if slices == "blocks":
            return lambda big, small: fn(big, chunk_bytes=CHUNK_BYTES)
        return (lambda big, small: fn(big, slices=int(slices))) if slices else (lambda big, small: fn(big))
    if collective == "reduce_scatter":
        return lambda big, small: fast_ring_reduce_scatter(small, big)
    return lambda big, small: fast_ring_all_gather(big, small)


_BACKEND = {"all_reduce": lambda big, small: dist.all_reduce(big),
            "reduce_scatter": lambda big, small: reduce_scatter_single(small, big),
            "all_gather": lambda big, small: all_gather_single(big, small)}


LEAD_IN = 1   # untimed calls of an algorithm just before each timed one: a call runs slower after a different one


def _time_rank(collective: str, sizes: list[int], algorithms: list[str], iterations: int | None,
               lead_in: int = LEAD_IN) -> list[dict]:
    """Inside every rank: the algorithms take turns at each size, so their times are paired, in a rotating order.

    In its turn an algorithm runs ``lead_in`` untimed calls, then the timed one: here a call that follows a
    different algorithm runs 1-2 ms slower at 16 MB on 4 ranks (a ring after gloo's all-reduce, or gloo after
    the ring; BENCHMARKS.md), and a training loop calls the same all-reduce over and over.
    """
    world = dist.get_world_size()
    rows = []
    for nbytes in sizes:
        big = torch.ones(nbytes // 4)                       # (S/4,) float32: the all-reduced tensor, RS input
        small = torch.ones(big.numel() // world)            # (S/4N,): RS output, AG input
        big = big[: small.numel() * world]                  # RS and AG need N | numel
        runs = {name: _BACKEND[collective] if name in (BACKEND, AGAIN) else _ours(collective, name)
                for name in algorithms}
        times: dict[str, list[float]] = {name: [] for name in algorithms}
        for i in range((iterations or _iterations(nbytes)) + 2):          # the first 2 rounds are warm-up
            for name in turns(list(runs), i):                 # the first place rotates
                run = runs[name]
                for _ in range(lead_in):
                    big.fill_(1.0)
                    run(big, small)
                big.fill_(1.0)                                            # repeated sums would overflow
                dist.barrier()
                start = time.perf_counter()
                run(big, small)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # an iteration lasts as long as its slowest rank
                if i >= 2:
                    times[name].append(elapsed.item())
        for name in algorithms:
            seconds = statistics.median(times[name])
            rows.append({"collective": collective, "algorithm": name, "world_size": world, "nbytes": big.nbytes,
                         "seconds": seconds, "times": times[name], "algbw": algbw(big.nbytes, seconds),
                         "busbw": busbw(collective, big.nbytes, seconds, world)})
    return rows


def measure(world_size: int, sizes: list[int] | None = None,
            algorithms: Sequence[str] = ("naive", "tree", "ring", BACKEND), collective: str = "all_reduce",
            iterations: int | None = None, timeout: float = 600, lead_in: int = LEAD_IN) -> list[dict]:
    """Time ``collective`` at one world size; one dict per (algorithm, size).

    ``algorithms`` for all-reduce: ``naive``, ``tree``, ``ring``, ``ring/k`` (k slices per chunk), ``ring/blocks``
    (no message above ``CHUNK_BYTES``) and ``backend``; for ``reduce_scatter`` and ``all_gather``: ``ring`` and
    ``backend``. ``AGAIN`` times the backend a second time in each round, a control: its ratio to ``backend``
    would be 1.0 without noise.
    ``lead_in``: untimed calls of an algorithm before each of its timed calls (``_time_rank``).
    """
    return launch(_time_rank, world_size, collective, list(sizes or DEFAULT_SIZES), list(algorithms), iterations,
                  lead_in, timeout=timeout)[0]


def paired_ratio(rows: list[dict], algorithm: str, collective: str, world_size: int, nbytes: int) -> float:
    """The median over iterations of t_backend / t_algorithm: algorithm's busbw over the backend's."""
    pick = {r["algorithm"]: r["times"] for r in rows
            if (r["collective"], r["world_size"], r["nbytes"]) == (collective, world_size, nbytes)}
    return statistics.median(b / a for a, b in zip(pick[algorithm], pick[BACKEND]))


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
    """One-way message time between two ranks, one message at a time: (bytes, median seconds) per size."""
    sizes = sizes or [4, 4 << 10, 64 << 10, 1 << 20, 4 << 20]
    return launch(_ping_pong_rank, 2, sizes, repeats)[0]


def fitted_model(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """alpha (s) and beta (s/byte) from (bytes, seconds) samples; ``ValueError`` when too noisy to fit."""
    return fit_alpha_beta([s for s, _ in samples], [t for _, t in samples])


def fit_ping_pong(sizes: list[int] | None = None, repeats: int = 10,
                  attempts: int = 3) -> tuple[list[tuple[int, float]], float, float]:
    """``(samples, alpha, beta)`` from a ping-pong, measured again when noise spoils the fit (``ValueError``)."""
    for attempt in range(attempts):
        samples = ping_pong(sizes, repeats)
        try:
            return (samples, *fitted_model(samples))
        except ValueError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class LinkModel:
    """The model's three parameters, measured on ``world_size`` ranks at once."""

    world_size: int
    alpha: float    # s per message
    beta: float     # s per byte sent
    gamma: float    # s per byte added

    def predict(self, algorithm: str, nbytes: float, collective: str = "all_reduce") -> float:
        return predict_time(algorithm, nbytes, self.world_size, self.alpha, self.beta, self.gamma, collective)


def _link_rank(sizes: list[int], repeats: int) -> tuple[list[tuple[int, float]], float]:
    """Every rank sends one message right while receiving one from the left (a ring step), 2(N-1) times
    in a row as in a ring all-reduce; then every rank adds two buffers at once, as a reduce-scatter does."""
    rank, world = dist.get_rank(), dist.get_world_size()
    steps, samples, add_times = 2 * (world - 1), [], []
    for nbytes in sizes:
        send, recv = torch.ones(max(nbytes // 4, 1)), torch.empty(max(nbytes // 4, 1))
        for i in range(repeats + 1):                       # the first is warm-up
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):                          # as the ring sends: through exchange()
                exchange([(send, (rank + 1) % world, 0)], [(recv, (rank - 1) % world)], None, None, "shift", 0)
            elapsed = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
            if i:
                samples.append((send.nbytes, elapsed.item()))
    mine, theirs = torch.ones(max(sizes) // 4), torch.ones(max(sizes) // 4)
    for i in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        mine.add_(theirs)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i:
            add_times.append(elapsed.item())
    return samples, statistics.median(add_times) / mine.nbytes


def fit_link(world_size: int, sizes: list[int] | None = None, repeats: int = 7, attempts: int = 3) -> LinkModel:
    """alpha and beta fitted to a ring shift on ``world_size`` ranks, gamma from a timed addition.

    A fit that comes out non-positive (a noisy machine) is measured again, up to ``attempts``
    times; then ``fit_alpha_beta``'s ``ValueError`` says what went wrong. The largest message, 16 MB,
    takes tens of ms to move even on a loaded laptop, far above the few ms a busy scheduler adds to
    every message (with 2 MB at most, a make test run under load once saw every size take 2.6 ms).
    """
    sizes = sizes or [4, 16 << 10, 256 << 10, 2 << 20, 16 << 20]
    for attempt in range(attempts):
        samples, gamma = launch(_link_rank, world_size, sizes, repeats, timeout=300)[0]
        try:
            alpha, beta = fit_alpha_beta([s for s, _ in samples], [t for _, t in samples])
            return LinkModel(world_size, alpha, beta, gamma)
        except ValueError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def human_size(nbytes: int) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def table(rows: list[dict]) -> str:
    """Text table: one line per (collective, N, size), busbw per algorithm and each ring's paired ratio."""
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    rings = [a for a in algorithms if a.startswith("ring")] if BACKEND in algorithms else []
    width = {a: max(11, len(a) + 2) for a in algorithms}                    # a column wide enough for its name
    ratio_width = {a: max(15, len(a) + 10) for a in rings}
    head = (f"{'collective':<15}{'N':>2} {'size':>5} " + "".join(f"{a:>{width[a]}}" for a in algorithms)
            + "".join(f"{a + '/backend':>{ratio_width[a]}}" for a in rings))
    lines = ["busbw (bytes/s); ratios are paired medians of t_backend / t_ring", head, "-" * len(head)]
    for key in dict.fromkeys((r["collective"], r["world_size"], r["nbytes"]) for r in rows):
        by_alg = {r["algorithm"]: r for r in rows if (r["collective"], r["world_size"], r["nbytes"]) == key}
        cells = "".join(f"{pretty(by_alg[a]['busbw'], 'B/s') if a in by_alg else '-':>{width[a]}}" for a in algorithms)
        ratios = "".join(f"{paired_ratio(rows, a, *key):>{ratio_width[a]}.2f}" if {a, BACKEND} <= by_alg.keys()
                         else f"{'-':>{ratio_width[a]}}" for a in rings)
        lines.append(f"{key[0]:<15}{key[1]:>2} {human_size(key[2]):>5} {cells}{ratios}")
    return "\n".join(lines)


def plot(rows: list[dict], models: dict[int, LinkModel] | None = None):
    """busbw against size, one panel per (collective, N); solid measured, dashed the model."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    order = ("all_reduce", "reduce_scatter", "all_gather")        # one row per collective, N across
    panels = sorted(dict.fromkeys((r["collective"], r["world_size"]) for r in rows),
                    key=lambda p: (order.index(p[0]), p[1]))
    columns = min(2, len(panels))
    n_rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(n_rows, columns, figsize=(COLUMN_IN, 0.9 + 2.7 * n_rows), squeeze=False,
                             sharey=True)
    colours = {a: f"C{i}" for i, a in enumerate(dict.fromkeys(r["algorithm"] for r in rows))}
    for ax, (collective, n) in zip(axes.flat, panels):
        for name in colours:
            mine = sorted((r for r in rows if (r["collective"], r["world_size"], r["algorithm"])
                           == (collective, n, name)), key=lambda r: r["nbytes"])
            if not mine:
                continue
            sizes = [r["nbytes"] for r in mine]
            ax.plot(sizes, [r["busbw"] / 1e6 for r in mine], "o-", color=colours[name], markersize=4)
            algorithm = name.partition("/")[0]
            if models and n in models and algorithm in ALGORITHMS and not name.count("/"):
                predicted = [busbw(collective, s, models[n].predict(algorithm, s, collective), n) / 1e6 for s in sizes]
                ax.plot(sizes, predicted, "--", color=colours[name], alpha=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")                     # small messages are latency-bound: keep them visible
        ax.set_title(f"{collective.replace('_', '-')}, N = {n}", fontsize=10)
        ax.set_xlabel("size S (bytes)", fontsize=9)
        ax.tick_params(labelsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("busbw (MB/s)", fontsize=9)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles = [Line2D([], [], color=c, marker="o", markersize=4, label=a) for a, c in colours.items()]
    if models:
        handles.append(Line2D([], [], color="0.3", linestyle="--", label="model (fitted α, β, γ)"))
    legend_rows = -(-len(handles) // 5)
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 5), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, (0.1 + 0.25 * legend_rows) / fig.get_figheight(), 1, 1))
    return fig


# --------------------------------------------------------------------------- #
# Ring all-reduce, step by step
# --------------------------------------------------------------------------- #
State = list[list[frozenset]]  # state[rank][chunk] -> ranks summed in


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
    """Draws the state after some steps (boxes, shaded by how many ranks they hold) and the next step's arrows."""

    def __init__(self, recording: RingRecording):
        import matplotlib.pyplot as plt

        self.recording = recording
        self.states = ring_states(recording)
        self.steps = len(self.states) - 1
        self.figure, self.ax = plt.subplots(figsize=(6.4, 5.3))
        plt.close(self.figure)  # shown through the widget, not by the inline backend
        self.cells: dict[tuple[int, int], tuple] = {}
        self.arrows: list = []   # one per message of the next step
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
        width, height = 0.74, 0.15
        for rank in range(n):
            x, y = self._position(rank)
            top = y + height * n / 2
            ax.text(x, top + 0.04, f"rank {rank}", ha="center", va="bottom", fontsize=10, weight="bold")
            for chunk in range(n):   # chunks stacked top to bottom
                bottom = top - (chunk + 1) * height
                box = Rectangle((x - width / 2, bottom), width, height, edgecolor="black", linewidth=0.6)
                ax.add_patch(box)
                ax.text(x - width / 2 - 0.03, bottom + height / 2, f"c{chunk}", ha="right", va="center",
                        fontsize=9, color="0.3")
                label = ax.text(x, bottom + height / 2, "", ha="center", va="center", fontsize=10)
                self.cells[rank, chunk] = (box, label)
        ax.set_xlim(-2.0, 2.0)
        ax.set_ylim(-1.62, 1.72)
        ax.set_aspect("equal")
        ax.axis("off")

    def in_flight(self, step: int) -> list[Message]:
        """Messages of step ``step + 1`` (numbered from 1): they turn state ``step`` into ``step + 1``."""
        return [m for m in self.recording.messages if m.step == step]

    def show(self, step: int) -> None:
        """Boxes: the state after ``step`` steps. Arrows: the messages of the next step."""
        from matplotlib import colormaps
        from matplotlib.patches import FancyArrowPatch

        if not 0 <= step <= self.steps:
            raise ValueError(f"step must be between 0 and {self.steps}, got {step}")
        self.step = step
        n, cmap = self.recording.world_size, colormaps["Blues"]
        for (rank, chunk), (box, label) in self.cells.items():
            holders = self.states[step][rank][chunk]
            shade = 0.12 + 0.6 * (len(holders) - 1) / max(n - 1, 1)     # at most mid-blue
            box.set_facecolor(cmap(shade))
            label.set_text("+".join(str(r) for r in sorted(holders)))
            complete = len(holders) == n
            label.set_color("white" if complete else "black")
            label.set_fontweight("bold" if complete else "normal")
            if complete:
                box.set_facecolor("#08306b")                           # finished: navy, with white text
        for artist in self.arrows + self.notes:
            artist.remove()
        self.arrows, self.notes = [], []
        for m in self.in_flight(step):
            (x0, y0), (x1, y1) = self._position(m.src), self._position(m.dst)
            color = "tab:red" if m.phase == "reduce-scatter" else "tab:green"
            arrow = FancyArrowPatch((x0 * 0.55, y0 * 0.55), (x1 * 0.55, y1 * 0.55), arrowstyle="-|>",
                                    mutation_scale=14, connectionstyle="arc3,rad=-0.3", color=color, linewidth=1.5)
            self.ax.add_patch(arrow)
            mid = self._position_between(m.src, m.dst)
            note = self.ax.text(*mid, f"c{m.chunk}", color=color, fontsize=10, ha="center", va="center",
                                weight="bold")
            self.arrows.append(arrow)
            self.notes.append(note)
        self.ax.set_title(self.title(step), fontsize=10)

    def title(self, step: int) -> str:
        n = self.recording.world_size
        if step == 0:
            boxes = "boxes: the start, every rank holds only its own data"
        elif step == self.steps:
            boxes = f"boxes: after all {self.steps} steps, every chunk summed on every rank"
        else:
            phase = "reduce-scatter" if step <= n - 1 else "all-gather"
            boxes = f"boxes: after step {step} of {self.steps} ({phase})"
        upcoming = self.in_flight(step)
        arrows = (f"arrows: step {step + 1}, {upcoming[0].phase}" + (" (adds)" if upcoming[0].phase == "reduce-scatter"
                                                                     else " (copies)")
                  if upcoming else "no arrows: done")
        return f"{boxes}\n{arrows}; cell = ranks summed in; chunk sizes {chunk_sizes(self.recording.numel, n)}"


def ring_widget(world_size: int = 4, numel: int = 8):
    """A slider over the states of a recorded ring all-reduce, with the figure below it."""
    import ipywidgets as widgets

    view = RingView(record_ring_all_reduce(world_size, numel))
    slider = widgets.IntSlider(value=0, min=0, max=view.steps, description="after step")
    return figure_widget({"slider": slider}, view.show, view.figure, max_width="640px", view=view)


# --------------------------------------------------------------------------- #
# Problems: predict, then measure
# --------------------------------------------------------------------------- #
def _count_rank(numel: int, slices: int) -> tuple[int, int]:
    counter = ByteCounter()
    fast_ring_all_reduce(torch.ones(numel), counter=counter, slices=slices)
    return counter.sent, len(counter.messages)


def problem_ring_bytes(numel: int = 1_000_000, world_size: int = 5) -> Answer:
    """Bytes rank 0 sends in one ring all-reduce of ``numel`` float32 values, counted."""
    sent, _ = launch(_count_rank, world_size, numel, 1)[0]
    return Answer(measured=sent, formula=2 * (world_size - 1) / world_size * 4 * numel, unit="B",
                  rtol=0.0 if numel % world_size == 0 else 1e-3,
                  why="exact when N divides the element count; otherwise chunks differ by one element")


def problem_sliced_messages(world_size: int = 4, slices: int = SLICES, numel: int = 4096) -> Answer:
    """Messages each rank sends in ``fast_ring_all_reduce(..., slices=k)``, counted on every rank."""
    counts = {messages for _, messages in launch(_count_rank, world_size, numel, slices)}
    if len(counts) != 1:
        raise AssertionError(f"ranks sent different numbers of messages: {sorted(counts)}")
    return Answer(measured=counts.pop(), formula=2 * (world_size - 1) * slices, unit="messages",
                  rtol=0.0, why="every step of the ring sends from every rank; none may be empty here")


def problem_busbw_from_time(nbytes: int = 4 << 20, seconds: float = 2e-3, world_size: int = 8) -> Answer:
    """busbw (GB/s) of an all-reduce of ``nbytes`` that took ``seconds`` on N ranks: bytes a rank sends / time."""
    sent, _ = launch(_count_rank, world_size, nbytes // 4, 1)[0]
    return Answer(measured=sent / seconds / 1e9, formula=busbw("all_reduce", nbytes, seconds, world_size) / 1e9,
                  unit="GB/s", rtol=1e-9 if (nbytes // 4) % world_size == 0 else 1e-3,
                  why="busbw is by definition the rate of the bytes each rank of a ring actually sends")


def _rounds_rank(numel: int, chunk_bytes: int) -> int:
    counter = ByteCounter()
    fast_ring_all_reduce(torch.ones(numel), counter=counter, chunk_bytes=chunk_bytes)
    return len({m.step for m in counter.messages})


def problem_blocked_rounds(numel: int = 4 << 20, world_size: int = 3, chunk_bytes: int = 1 << 20) -> Answer:
    """Rounds of ``fast_ring_all_reduce(x, chunk_bytes=c)`` on ``numel`` float32 values: rounds in which rank 0 sent."""
    rounds = set(launch(_rounds_rank, world_size, numel, chunk_bytes))
    if len(rounds) != 1:
        raise AssertionError(f"ranks sent in different numbers of rounds: {sorted(rounds)}")
    blocks = math.ceil(4 * numel / (world_size * chunk_bytes))
    return Answer(measured=rounds.pop(), formula=(blocks + 1) * (world_size - 1), unit="rounds", rtol=0.0,
                  why="every round of every block sends from every rank; none may be empty here")


def _tree_rank(numel: int) -> int:
    counter = ByteCounter()
    ALGORITHMS["tree"](torch.ones(numel), counter=counter)
    return counter.sent


def problem_tree_root_bytes(numel: int = 1 << 18, world_size: int = 8) -> Answer:
    """Bytes rank 0 (the tree's root) sends in one binomial-tree all-reduce, counted."""
    sent = launch(_tree_rank, world_size, numel)[0]
    return Answer(measured=sent, formula=math.ceil(math.log2(world_size)) * 4 * numel, unit="B", rtol=0.0,
                  why="the root sends the whole tensor once to each of its ceil(log2 N) children")
