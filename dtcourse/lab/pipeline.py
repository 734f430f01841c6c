"""What lesson 08 runs and draws: pipeline schedules recorded on real ranks, beside the simulator and the formulas.

GPipe (Huang et al., arXiv 1811.06965); 1F1B, PipeDream-flush (Narayanan et al., arXiv 2006.09503);
interleaved 1F1B (Megatron, arXiv 2104.04473); ZB-H1 (Qi et al., arXiv 2401.10241); PipeTransformer's
freezing (He et al., arXiv 2102.03161). Every schedule comes from ``dtcourse.pipeline.schedules`` and runs
through its ``PipelineExecutor`` on forked gloo ranks, every action timed::

    from dtcourse.lab import pipeline as lab
    run = lab.record("1f1b", p=2, m=4)          # run.recording, run.bubble_per_rank, run.peak_held
    grid = lab.record_grid()                     # p = 2: every schedule at a few m, in one launch
    lab.bubble_widget(grid)                      # a recorded run beside its simulation

**The measured bubble.** A rank's step runs from the first compute span of any rank to the last one's end;
its bubble is ``1 - busy / step``, busy being the rank's forward and backward spans (F, B, I, W). Waiting
for a message, posting one and the optimizer step count as idle. Schedules whose compute differs (ZB-H1's W
backpropagates through the stage again) compare by that step's length, ``Run.step``, not by their bubbles.
On the course's 2-core machine p = 2 ranks really run in parallel; at p = 4 they time-share two cores, so a
rank's "busy" span also holds time it spent descheduled, and the lesson takes p = 4's bubbles from the
simulator (its memory counts, which do not depend on timing, are measured).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist

from dtcourse.lab.problems import Answer
from dtcourse.lab.widgets import COLUMN_IN, FigureView, figure_widget
from dtcourse.models import GPT, GPTConfig, lm_loss, token_batch
from dtcourse.pipeline import (SCHEDULES, Action, GPTStage, build, PipelineExecutor, balanced_partition,
                               bubble_formula, gpt_boundary_shape, peak_activations, run_schedule, simulate, split_gpt,
                               stages_of_rank, with_communication, write_chrome_trace)
from dtcourse.runtime.launch import launch
from dtcourse.runtime.timeline import Recording, Span, Timeline, merge, shared_origin

if TYPE_CHECKING:
    import ipywidgets
    from matplotlib.patches import Rectangle

__all__ = ["PIPE_GPT", "ROWS_PER_MICROBATCH", "COMPUTE_KINDS", "Run", "record", "record_grid", "build",
           "bubble_table", "step_table", "sends", "bubble_sweep_figure", "schedules_figure", "held_table",
           "BubbleView", "bubble_widget", "write_trace", "messages_per_step", "freeze_and_widen",
           "problem_gpipe_bubble", "problem_peak_held", "problem_interleaved_bubble", "problem_messages",
           "problem_zero_bubble"]

# 4 blocks, so p = 2 ranks can hold v = 2 chunks each; d_model = 128 over 32 tokens makes a stage's forward
# a few ms on one thread, long next to the executor's per-action overhead (tens of µs).
PIPE_GPT = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, d_model=256)
ROWS_PER_MICROBATCH = 4
COMPUTE_KINDS = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}
KIND_COLOURS = {"F": "tab:blue", "B": "tab:orange", "I": "gold", "W": "tab:green"}
GRID_M = (1, 2, 4, 8)
M_MAX = 16                                       # the widget's m slider goes up to it
adamw = torch.optim.AdamW


# --------------------------------------------------------------------------- #
# Recorded runs
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class Run:
    """One schedule run on real ranks: the merged recording of its last step and what was measured.

    ``bubbles`` holds the overall bubble of every repeated step (their median is ``bubble``), ``steps`` their
    lengths in seconds, first compute span to last (median ``step``); ``peak_held``: per rank, the most
    micro-batches whose activations it held (``peak_held_rank``).
    """

    schedule: str
    p: int
    m: int
    v: int
    recording: Recording
    bubble_per_rank: dict[int, float]
    bubbles: tuple[float, ...]
    peak_held: dict[int, int]
    steps: tuple[float, ...]

    @property
    def bubble(self) -> float:
        return statistics.median(self.bubbles)

    @property
    def step(self) -> float:
        return statistics.median(self.steps)

    def posting(self) -> dict[int, float]:
        """Per rank, seconds of the last step spent posting messages (a batch of SEND/RECV posted together once)."""
        return {r: sum(end - start for start, end in {(s.start, s.end) for s in spans if s.kind in ("send", "recv")})
                for r, spans in self.recording.items()}

    @property
    def formula(self) -> float:
        return bubble_formula(self.schedule, self.p, self.m, self.v)

    def times(self) -> dict[str, float]:
        """Mean measured seconds per compute kind (one chunk of one rank): what ``simulate`` takes as t_f, t_b, ..."""
        found: dict[str, list[float]] = {}
        for spans in self.recording.values():
            for s in spans:
                if s.kind in COMPUTE_KINDS:
                    found.setdefault(COMPUTE_KINDS[s.kind], []).append(s.duration)
        return {k: statistics.mean(d) for k, d in found.items()}

    def simulated(self):
        """``simulate`` of the same schedule with this run's measured mean times (t_b = I + W when split)."""
        t = self.times()
        t_w = t.get("W")
        t_b = t["B"] if "B" in t else t["I"] + t_w
        return simulate(build(self.schedule, self.p, self.m, self.v), self.p, self.m, self.v,
                        t_f=t["F"], t_b=t_b, t_w=t_w)


def _record_rank(cases: list[tuple[str, int, int]], config: GPTConfig, repeats: int):
    rank, p = dist.get_rank(), dist.get_world_size()
    out = []
    for name, m, v in cases:
        model = GPT(config, seed=0)
        stages = split_gpt(model, p * v)
        ex = PipelineExecutor({s: stages[s] for s in stages_of_rank(rank, p, v)}, p * v, gpt_boundary_shape(model))
        optimizer = adamw([q for s in ex.stages.values() for q in s.parameters()], lr=1e-3)
        schedule = with_communication(build(name, p, m, v), p, v)
        idx, targets = token_batch(config, ROWS_PER_MICROBATCH * m, seed=1)
        steps = []
        for _ in range(1 + repeats):             # the first step warms up (allocator, autograd caches)
            ex.timeline = Timeline(shared_origin())
            run_schedule(ex, schedule, idx, targets, lm_loss, m, optimizer)
            steps.append(ex.timeline)
        out.append((steps[1:], ex.peak_held_rank))
    return out


def record_many(cases: Sequence[tuple[str, int, int]], p: int = 2, repeats: int = 3,
                config: GPTConfig = PIPE_GPT) -> dict[tuple[str, int, int, int], Run]:
    """Every ``(schedule, m, v)`` of ``cases`` on p ranks, in one launch: ``{(schedule, p, m, v): Run}``."""
    per_rank = launch(_record_rank, p, list(cases), config, repeats, timeout=300)
    runs = {}
    for i, (name, m, v) in enumerate(cases):
        steps = [merge([per_rank[r][i][0][k] for r in range(p)]) for k in range(repeats)]
        bubbles = tuple(measured_bubble(rec)[1] for rec in steps)
        lengths = tuple(end - start for start, end in map(step_span, steps))
        runs[(name, p, m, v)] = Run(name, p, m, v, steps[-1], measured_bubble(steps[-1])[0], bubbles,
                                    {r: per_rank[r][i][1] for r in range(p)}, lengths)
    return runs


def record(schedule_name: str, p: int, m: int, v: int = 1, repeats: int = 3, config: GPTConfig = PIPE_GPT) -> Run:
    """One schedule on p real ranks (a GPT cut by ``split_gpt`` into p·v stages): its recording, bubbles, peaks."""
    return record_many([(schedule_name, m, v)], p, repeats, config)[(schedule_name, p, m, v)]


def grid_cases(ms: Sequence[int] = GRID_M, p: int = 2) -> list[tuple[str, int, int]]:
    """naive, then GPipe, 1F1B and ZB-H1 at each m, and interleaved (v = 2) at each m that p divides."""
    cases = [("naive", 1, 1)]
    for m in ms:
        cases += [("gpipe", m, 1), ("1f1b", m, 1), ("zb_h1", m, 1)]
        cases += [("interleaved_1f1b", m, 2)] if m % p == 0 else []
    return cases


def record_grid(ms: Sequence[int] = GRID_M, p: int = 2, repeats: int = 3) -> dict[tuple[str, int, int, int], Run]:
    """The widget's pre-recorded runs: every schedule at p = 2 and each m of ``ms``, in one launch."""
    return record_many(grid_cases(ms, p), p, repeats)


def write_trace(run: Run, path) -> "Path":  # noqa: F821
    """The run's last step as a Chrome trace (open it in ui.perfetto.dev): one process per rank."""
    return write_chrome_trace(run.recording, path)


# --------------------------------------------------------------------------- #
# Tables: measured against the formula and the simulator
# --------------------------------------------------------------------------- #
def step_span(recording: Recording) -> tuple[float, float]:
    """(start, end) of a recorded step: the first compute span of any rank to the last one's end, in seconds."""
    compute = [s for spans in recording.values() for s in spans if s.kind in COMPUTE_KINDS]
    return min(s.start for s in compute), max(s.end for s in compute)


def measured_bubble(recording: Recording) -> tuple[dict[int, float], float]:
    """Per rank ``1 - busy / step`` and their mean, the step spanning every rank's compute (module docstring)."""
    compute = {r: [s for s in spans if s.kind in COMPUTE_KINDS] for r, spans in recording.items()}
    start, end = step_span(recording)
    step = end - start
    per_rank = {r: 1 - sum(s.duration for s in spans) / step for r, spans in compute.items()}
    return per_rank, statistics.mean(per_rank.values())


def bubble_table(runs: dict[tuple[str, int, int, int], Run]) -> list[tuple]:
    """Rows ``(schedule, p, m, v, measured median, min, max, simulated with measured times, formula)``."""
    return [(r.schedule, r.p, r.m, r.v, r.bubble, min(r.bubbles), max(r.bubbles), r.simulated().bubble, r.formula)
            for r in runs.values()]


def step_table(runs: dict[tuple[str, int, int, int], Run], names: Sequence[str] = ("1f1b", "interleaved_1f1b", "zb_h1"),
               ms: Sequence[int] = (2, 4, 8)) -> list[tuple]:
    """Rows ``(m, schedule, step median s, min, max, step / 1F1B's, bubble, compute s per micro-batch per rank,
    SENDs per step, posting s per rank)`` at p = 2, for each m and each of ``names`` recorded at that m."""
    rows = []
    for m in ms:
        base = runs[("1f1b", 2, m, 1)].step
        for name in names:
            r = runs.get((name, 2, m, 2 if name == "interleaved_1f1b" else 1))
            if r is None:
                continue
            busy = [sum(s.duration for s in spans if s.kind in COMPUTE_KINDS) for spans in r.recording.values()]
            rows.append((m, name, r.step, min(r.steps), max(r.steps), r.step / base, r.bubble,
                         statistics.mean(busy) / m, sends(name, r.p, m, r.v), statistics.mean(r.posting().values())))
    return rows


def held_table(runs: dict[tuple[str, int, int, int], Run]) -> list[tuple]:
    """Rows ``(schedule, p, m, rank, measured peak held, peak_activations of the schedule)``."""
    return [(r.schedule, r.p, r.m, rank, r.peak_held[rank], peak_activations(build(r.schedule, r.p, r.m, r.v), r.p)[rank])
            for r in runs.values() for rank in range(r.p)]


def bubble_sweep_figure(runs: dict[tuple[str, int, int, int], Run], p_sim: int = 4, ms: Sequence[int] = (1, 2, 4, 8, 16)):
    """Left: measured bubbles at p = 2 (dots, min-max bars) on the formulas (lines). Right: p_sim simulated."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(COLUMN_IN, 3.2), sharey=True)
    plt.close(figure)
    colours = {"gpipe": "tab:blue", "1f1b": "tab:orange", "interleaved_1f1b": "tab:purple", "zb_h1": "tab:green"}
    for name, colour in colours.items():
        v = 2 if name == "interleaved_1f1b" else 1
        mine = sorted((r for r in runs.values() if r.schedule == name and r.p == 2), key=lambda r: r.m)
        x = [r.m for r in mine]
        dx = {"gpipe": -0.06, "1f1b": 0.0, "interleaved_1f1b": 0.03, "zb_h1": 0.06}[name]
        axes[0].errorbar([m * (1 + dx) for m in x], [r.bubble for r in mine], fmt="o", color=colour,
                         yerr=[[r.bubble - min(r.bubbles) for r in mine], [max(r.bubbles) - r.bubble for r in mine]])
        grid = [m for m in ms if name != "interleaved_1f1b" or m % 2 == 0]
        axes[0].plot(grid, [bubble_formula(name, 2, m, v) for m in grid], "-", color=colour, label=f"{name}")
        sim_m = [m for m in ms if name != "interleaved_1f1b" or m % p_sim == 0]
        sim = [simulate(build(name, p_sim, m, v), p_sim, m, v).bubble for m in sim_m]
        axes[1].plot(sim_m, sim, "s", color=colour)
        axes[1].plot(sim_m, [bubble_formula(name, p_sim, m, v) for m in sim_m], "-", color=colour)
    axes[0].set_title("p = 2: measured (dots) vs formula", fontsize=9)
    axes[1].set_title(f"p = {p_sim}: simulated (squares) vs formula", fontsize=9)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batches m")
    axes[0].set_ylabel("bubble (idle share of the step)")
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    return figure


def sends(schedule: str, p: int, m: int, v: int = 1) -> int:
    """SEND actions in one step of ``schedule``, as ``with_communication`` lowers it: 2m(vp - 1) for every schedule."""
    return sum(a.kind.startswith("SEND") for acts in with_communication(build(schedule, p, m, v), p, v).values()
               for a in acts)


def messages_per_step(p: int, m: int, v: int = 1) -> dict[str, int]:
    """SEND actions in one step of 1F1B and of interleaved 1F1B (v chunks), as ``with_communication`` lowers them."""
    return {"1f1b": sends("1f1b", p, m), **({"interleaved_1f1b": sends("interleaved_1f1b", p, m, v)} if v > 1 else {})}


# --------------------------------------------------------------------------- #
# Gantt charts: a bar per compute action, coloured by kind, hatched by chunk, numbered by micro-batch
# --------------------------------------------------------------------------- #
CHUNK_HATCHES = ("", "///", "xxx", "...")       # chunk 0 plain; interleaving's later chunks hatched
NUMBER_PT = 8                                    # the micro-batch numbers inside the bars
NAMES = {"naive": "naive", "gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "interleaved 1F1B", "zb_h1": "ZB-H1"}


def _gantt(ax, timeline: Recording, scale: float = 1.0, origin: float = 0.0) -> list[tuple[Rectangle, str]]:
    """Each rank's compute spans as bars on one row (rank 0 on top), at (time - origin) · scale; returns every bar
    with its micro-batch, for ``_number`` to write in once the figure is laid out."""
    bars = []
    for rank, spans in timeline.items():
        for s in spans:
            kind = COMPUTE_KINDS.get(s.kind, s.kind)
            if kind not in KIND_COLOURS:
                continue
            action = Action.parse(s.name)                            # "2F1": stage 2, micro-batch 1
            chunk = action.stage // len(timeline)                    # rank r holds stages r, r + p, ...
            bar, = ax.barh(rank, scale * s.duration, left=scale * (s.start - origin), height=0.7, linewidth=0.3,
                           facecolor=KIND_COLOURS[kind], edgecolor="black", hatch=CHUNK_HATCHES[chunk], gid=kind)
            bars.append((bar, str(action.microbatch)))
    ax.set_yticks(range(len(timeline)), [f"rank {r}" for r in timeline], fontsize=9)
    ax.set_ylim(len(timeline) - 0.5, -0.5)
    return bars


def _legend(figure, bars: list[tuple[Rectangle, str]], chunks: int, y: float) -> None:
    """One legend for the figure, centred at height ``y`` (figure fraction): the kinds drawn, the chunks if v > 1."""
    from matplotlib.patches import Patch

    drawn = {bar.get_gid() for bar, _ in bars}
    handles = [Patch(facecolor=c, edgecolor="black", linewidth=0.3, label=k) for k, c in KIND_COLOURS.items()
               if k in drawn]
    handles += [Patch(facecolor="white", edgecolor="black", hatch=CHUNK_HATCHES[c], label=f"chunk {c}")
                for c in range(chunks)] if chunks > 1 else []
    figure.legend(handles=handles, fontsize=9, ncols=len(handles), loc="center", bbox_to_anchor=(0.5, y),
                  frameon=False, title="bar number: micro-batch", title_fontsize=8)


def _number(bars: list[tuple[Rectangle, str]]) -> None:
    """Write each bar's micro-batch inside it, where the number fits; narrower bars stay blank. Call it after the
    figure's layout: the fit is measured in display units, so it holds at any dpi."""
    for bar, label in bars:
        ax = bar.axes
        (x0, y0), (x1, y1) = ax.transData.transform([(bar.get_x(), bar.get_y()),
                                                     (bar.get_x() + bar.get_width(), bar.get_y() + bar.get_height())])
        points = ax.figure.dpi / 72                                  # display units per point
        if abs(x1 - x0) >= (0.64 * len(label) + 0.7) * NUMBER_PT * points and abs(y1 - y0) >= 1.4 * NUMBER_PT * points:
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_y() + bar.get_height() / 2, label, ha="center",
                    va="center", fontsize=NUMBER_PT, gid="microbatch",
                    bbox=dict(facecolor="white", edgecolor="none", pad=0.4, alpha=0.8) if bar.get_hatch() else None)


def schedules_figure(names: Sequence[str] = ("naive", "gpipe", "1f1b", "interleaved_1f1b", "zb_h1"), p: int = 4,
                     m: int = 4, v: int = 2):
    """One simulated Gantt chart per schedule, drawn from the schedule's data: a rank's forward of its layers takes 1,
    its backward 2 (I and W 1 each); an interleaved chunk, 1/v of the rank's layers, 1/v of that."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(names), 1, figsize=(COLUMN_IN, 1.3 * len(names) * p / 3 + 1.0), sharex=True)
    plt.close(figure)
    bars = []
    for ax, name in zip(axes, names):
        mm = 1 if name == "naive" else m
        vv = v if name == "interleaved_1f1b" else 1      # a chunk holds 1/v of a rank's layers: 1/v of the time
        prediction = simulate(build(name, p, mm, vv), p, mm, vv, t_f=1 / vv, t_b=2 / vv)
        bars += _gantt(ax, prediction.timeline)
        detail = {"naive": ", one micro-batch", "interleaved_1f1b": f", v = {vv} chunks per rank"}.get(name, "")
        ax.set_title(f"{NAMES[name]}{detail}: bubble {prediction.bubble:.2f}", fontsize=10, loc="left")
    axes[-1].set_xlabel(f"time (units of t_f), p = {p}, m = {m}", fontsize=9)
    axes[-1].set_xlim(0, max(b.get_x() + b.get_width() for b, _ in bars))    # no margin: the widest bars
    top = 0.6 / figure.get_figheight()                                # the legend's band, in figure fractions
    figure.tight_layout(rect=(0, 0, 1, 1 - top))
    _legend(figure, bars, v, 1 - top / 2)
    _number(bars)
    return figure


# --------------------------------------------------------------------------- #
# The bubble widget: a recorded run beside its simulation
# --------------------------------------------------------------------------- #
def _times(t: dict[str, float], scale: float, unit: str) -> str:
    return ", ".join(f"t_{k.lower()} {scale * x:.3g}" for k, x in t.items()) + unit


class BubbleView(FigureView):
    """Top: the recorded run of (schedule, p, m, v) if ``runs`` has it; bottom: ``simulate`` of the same schedule.

    With a recording the simulation uses its measured mean times, and both panels share one time axis: ms since
    the step's first compute span (same origin, same scale). Without one it uses t_f = 1, t_b = 2 and says so.
    ``measured``, ``predicted`` (simulated) and ``formula`` hold the bubbles drawn (``measured`` is None without a
    recording); ``recorded`` tells which case it was; ``message`` is the text shown when the setting cannot run
    (empty otherwise), and ``note`` what the figure says about sliders that do not apply.
    """

    def __init__(self, runs: dict[tuple[str, int, int, int], Run]):
        import matplotlib.pyplot as plt

        self.runs = runs
        self.figure, (self.ax_real, self.ax_sim) = plt.subplots(2, 1, figsize=(COLUMN_IN, 5.4))
        plt.close(self.figure)
        self.measured: float | None = None
        self.predicted = self.formula = float("nan")
        self.recorded, self.message, self.note = False, "", ""

    def key(self, schedule: str, p: int, m: int, v: int) -> tuple[str, int, int, int]:
        return (schedule, p, 1 if schedule == "naive" else m, v if schedule == "interleaved_1f1b" else 1)

    def show(self, schedule: str, p: int, m: int, v: int) -> None:
        asked_m = m
        schedule, p, m, v = self.key(schedule, p, m, v)
        for ax in (self.ax_real, self.ax_sim):
            ax.clear()
            ax.set_axis_on()
        for legend in list(self.figure.legends):
            legend.remove()
        self.measured, self.predicted, self.formula, self.message = None, float("nan"), float("nan"), ""
        setting = f"{NAMES[schedule]}, p = {p}, m = {m}" + (f", v = {v}" if v > 1 else "")
        try:
            compute = build(schedule, p, m, v)
        except ValueError as err:                   # interleaving with m not a multiple of p
            self._cannot_run(setting, schedule, p, m, err)
            return
        self.note = (f"naive is one micro-batch: the m slider ({asked_m}) does not apply" if schedule == "naive"
                     else "" if schedule == "interleaved_1f1b" else "the v slider applies to interleaved 1F1B only")
        self.figure.suptitle(setting + (f"   ({self.note})" if self.note else ""), x=0.01, ha="left", fontsize=10)
        run = self.runs.get((schedule, p, m, v))
        self.recorded = run is not None
        self.formula = bubble_formula(schedule, p, m, v)
        if run is not None:
            prediction, scale, unit, times = run.simulated(), 1e3, " ms", run.times()
            self.measured = run.bubble
            start, end = step_span(run.recording)
            bars = _gantt(self.ax_real, run.recording, scale, origin=start)
            self.ax_real.set_title(f"recorded on {p} real ranks, last of {len(run.bubbles)} steps: bubble "
                                   f"{measured_bubble(run.recording)[1]:.2f} (median of the {len(run.bubbles)}: "
                                   f"{run.bubble:.2f})", fontsize=9, loc="left")
            what = f"this run's mean times ({_times(times, scale, unit)}), messages free"
            xmax = 1.02 * scale * max(end - start, prediction.step)
            for ax in (self.ax_real, self.ax_sim):  # one time axis: same origin, same scale
                ax.set_xlim(0, xmax)
                ax.set_xlabel("ms since the step's first compute span", fontsize=9)
        else:
            prediction, scale, unit = simulate(compute, p, m, v), 1.0, ""
            times = {"F": 1.0, "I": 1.0, "W": 1.0} if schedule == "zb_h1" else {"F": 1.0, "B": 2.0}
            self.ax_real.text(0.5, 0.5, f"no recorded run for {setting}:\nrecorded runs are p = 2 with m in "
                              f"{sorted({k[2] for k in self.runs})}; below, the simulation alone",
                              ha="center", va="center", fontsize=10, transform=self.ax_real.transAxes)
            self.ax_real.set_axis_off()
            bars, what = [], f"{_times(times, scale, unit)} (units of t_f)"
            self.ax_sim.set_xlabel("time (units of t_f)", fontsize=9)
        self.predicted = prediction.bubble
        bars += _gantt(self.ax_sim, prediction.timeline, scale)
        self.ax_sim.set_title(f"simulated with {what}: bubble {prediction.bubble:.2f}\n"
                              + self._formula_line(schedule, times), fontsize=9, loc="left")
        self.figure.tight_layout(rect=(0, 0.07, 1, 1))
        _legend(self.figure, bars, v, 0.035)
        _number(bars)

    def _formula_line(self, schedule: str, times: dict[str, float]) -> str:
        """The formula's value, and why it may differ from the simulation above it."""
        if schedule != "zb_h1":
            return f"formula: {self.formula:.2f}, the simulation's for any t_f and t_b"
        if len({round(t, 12) for t in times.values()}) == 1:
            return f"formula: {self.formula:.2f}, for t_f = t_i = t_w as here"
        return f"formula: {self.formula:.2f}, which assumes t_f = t_i = t_w; the simulation uses the times above"

    def _cannot_run(self, setting: str, schedule: str, p: int, m: int, err: ValueError) -> None:
        """A text-only figure: why the setting cannot run, and what to change."""
        import textwrap

        self.recorded, self.note = False, ""
        multiples = ", ".join(str(k) for k in range(p, M_MAX + 1, p))
        hint = (f"set m to a multiple of p = {p} ({multiples}), or choose another schedule: only interleaved 1F1B "
                "needs one." if schedule == "interleaved_1f1b" and m % p else
                "change the setting the message names, or choose another schedule.")
        self.message = f"{err}\n\nWhat to change: {hint}"
        for ax in (self.ax_real, self.ax_sim):
            ax.set_axis_off()
        self.figure.suptitle(f"{setting}: this setting cannot run", x=0.01, ha="left", fontsize=11)
        self.ax_real.text(0.5, 0.55, "\n".join(textwrap.fill(part, 80) for part in self.message.split("\n")),
                          ha="center", va="center", fontsize=11, transform=self.figure.transFigure)


def bubble_widget(runs: dict[tuple[str, int, int, int], Run], schedule: str = "1f1b", p: int = 2, m: int = 4,
                  v: int = 2) -> ipywidgets.VBox:
    """Choose the schedule, p, m and v (v: interleaved only); see the recorded run and the simulation."""
    import ipywidgets as widgets

    view = BubbleView(runs)
    view.show(schedule, p, m, v)
    controls = {"schedule": widgets.Dropdown(options=list(SCHEDULES), value=schedule, description="schedule"),
                "p": widgets.IntSlider(value=p, min=2, max=8, description="p ranks"),
                "m": widgets.IntSlider(value=m, min=1, max=M_MAX, description="m micro"),
                "v": widgets.IntSlider(value=v, min=2, max=4, description="v chunks")}
    return figure_widget(controls, view.show, view.figure, view=view)


# --------------------------------------------------------------------------- #
# PipeTransformer's idea: freeze the first layers, shorten the pipeline, widen data parallelism
# --------------------------------------------------------------------------- #
def _timed_steps(step, steps: int) -> list[float]:
    """Wall seconds of each of ``steps`` calls of ``step()`` after one warm-up, between barriers."""
    times = []
    for _ in range(1 + steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times[1:]


def _freeze_rank(config: GPTConfig, rows: int, m: int, frozen: int, steps: int) -> dict[str, object]:
    rank, world = dist.get_rank(), dist.get_world_size()              # world = 4
    idx, targets = token_batch(config, rows, seed=2)
    # Before: one pipeline over all four ranks, every layer trained (1F1B).
    model = GPT(config, seed=0)
    ex = PipelineExecutor({rank: split_gpt(model, world)[rank]}, world, gpt_boundary_shape(model))
    opt = adamw(ex.stages[rank].parameters(), lr=1e-3)
    schedule = with_communication(build("1f1b", world, m), world)
    before = _timed_steps(lambda: run_schedule(ex, schedule, idx, targets, lm_loss, m, opt), steps)
    # After: embeddings and blocks [0, frozen) frozen; the rest cut by balanced_partition over 2 stages;
    # ranks {0, 1} and {2, 3} are two such pipelines, each on half the batch; {0, 2} and {1, 3} average gradients.
    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]          # every rank creates every group, in order
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pipe, dp, r = pipes[rank // 2], dps[rank % 2], rank % 2
    model = GPT(config, seed=0)
    for q in [*model.wte.parameters(), *model.wpe.parameters(), *model.blocks[:frozen].parameters()]:
        q.requires_grad_(False)
    start, end = [(frozen + a, frozen + b) for a, b in balanced_partition(config.n_layer - frozen, 2)][r]
    stage = GPTStage(model, start, end, first=False, last=r == 1)
    half = slice(rows // 2 * (rank // 2), rows // 2 * (rank // 2 + 1))  # this pipeline's half of the batch
    with torch.no_grad():   # AutoCache: the frozen layers' outputs are computed once and reused every step
        x = model.drop(model.wte(idx[half]) + model.wpe(torch.arange(idx.shape[1])))   # (B/2, T, C)
        for block in model.blocks[:frozen]:
            x = block(x)
    ex = PipelineExecutor({r: stage}, 2, lambda s, x: tuple(x.shape), group=pipe)   # (B, T, C) in and out
    trained = [q for q in stage.parameters() if q.requires_grad]
    opt = adamw(trained, lr=1e-3)
    actions = with_communication(build("1f1b", 2, m), 2)[r]

    def update(stage: int) -> None:             # the schedule's STEP: average over the data-parallel pair first
        for q in trained:                       # lesson 02's data parallelism, one all-reduce per parameter
            dist.all_reduce(q.grad, group=dp)   # sends 2(N-1)/N * nbytes per rank, N = 2
            q.grad /= 2
        opt.step()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        ex.run(actions, x, targets[half], lm_loss, m, step=update)
    after = _timed_steps(step, steps)
    return {"before": before, "after": after, "trained": sum(q.numel() for q in trained)}


def freeze_and_widen(config: GPTConfig = PIPE_GPT, rows: int = 16, m: int = 4, frozen: int = 2,
                     steps: int = 3) -> dict[str, float]:
    """PipeTransformer's idea (He et al., arXiv 2102.03161) on 4 ranks: samples/s of one 4-stage pipeline training
    every layer, then, with the embeddings and the first ``frozen`` blocks frozen, of two 2-stage pipelines side
    by side (data parallel) training the rest. Reported, never asserted: 4 ranks time-share 2 cores here."""
    per_rank = launch(_freeze_rank, 4, config, rows, m, frozen, steps, timeout=300)
    before, after = statistics.median(per_rank[0]["before"]), statistics.median(per_rank[0]["after"])
    return {"before samples/s": rows / before, "after samples/s": rows / after, "before step s": before,
            "after step s": after, "trained parameters per stage after": per_rank[1]["trained"]}


# --------------------------------------------------------------------------- #
# Problems
# --------------------------------------------------------------------------- #
def problem_gpipe_bubble(p: int = 4, m: int = 8) -> Answer:
    """GPipe's bubble at p = 4, m = 8: the validated schedule played by the simulator, against (p-1)/(m+p-1)."""
    measured = simulate(build("gpipe", p, m), p, m).bubble
    return Answer(measured, bubble_formula("gpipe", p, m), "", 1e-9,
                  "the simulator plays the validated schedule with t_b = 2 t_f: the formula to rounding")


def problem_peak_held(runs: dict[tuple[str, int, int, int], Run] | None = None, p: int = 4, m: int = 8) -> Answer:
    """Micro-batches rank 0 holds at peak under 1F1B, measured on p real ranks (``executor.peak_held_rank``)."""
    runs = runs if runs is not None else record_many([("gpipe", m, 1), ("1f1b", m, 1)], p, repeats=1)
    assert runs[("gpipe", p, m, 1)].peak_held[0] == m           # GPipe, for comparison: every micro-batch
    return Answer(runs[("1f1b", p, m, 1)].peak_held[0], min(p, m), "micro-batches", 0.0,
                  "a count of forwards not yet backpropagated: exact")


def problem_interleaved_bubble(p: int = 4, m: int = 8, v: int = 2) -> Answer:
    """Interleaved 1F1B's bubble at p = 4, m = 8, v = 2, simulated, against (p-1)/(v·m+p-1)."""
    measured = simulate(build("interleaved_1f1b", p, m, v), p, m, v).bubble
    return Answer(measured, bubble_formula("interleaved_1f1b", p, m, v), "", 1e-9,
                  "the simulator plays the validated schedule: the formula to rounding")


def problem_messages(p: int = 4, m: int = 8, v: int = 2) -> Answer:
    """SEND actions per step of interleaved 1F1B: every micro-batch crosses vp - 1 rank boundaries, both ways."""
    return Answer(messages_per_step(p, m, v)["interleaved_1f1b"], 2 * m * (v * p - 1), "messages", 0.0,
                  "counted in the schedule with_communication lowers: exact")


def problem_zero_bubble(p: int = 4, m: int = 8) -> Answer:
    """Idle time per rank of ZB-H1 as a share of 1F1B's (t_f = t_i = t_w = 1), simulated; the paper's 1/3."""
    idle = {name: (lambda pr: pr.bubble * p * pr.step)(simulate(build(name, p, m), p, m, t_f=1, t_b=2, t_w=1))
            for name in ("1f1b", "zb_h1")}
    return Answer(idle["zb_h1"] / idle["1f1b"], 1 / 3, "", 1e-9,
                  "(p-1)(t_f + t_i - t_w) against (p-1)(t_f + t_b), exact in the simulator")
