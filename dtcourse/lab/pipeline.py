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
for a message, posting one and the optimizer step count as idle. On the course's 2-core machine p = 2
ranks really run in parallel; at p = 4 they time-share two cores, so a rank's "busy" span also holds time
it spent descheduled, and the lesson takes p = 4's bubbles from the simulator (its memory counts, which
do not depend on timing, are measured).
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
from dtcourse.pipeline import (SCHEDULES, GPTStage, build, PipelineExecutor, balanced_partition, bubble_formula,
                               gpt_boundary_shape, peak_activations, run_schedule, simulate, split_gpt,
                               stages_of_rank, with_communication, write_chrome_trace)
from dtcourse.runtime.launch import launch
from dtcourse.runtime.timeline import Recording, Span, Timeline, merge, shared_origin

if TYPE_CHECKING:
    import ipywidgets

__all__ = ["PIPE_GPT", "ROWS_PER_MICROBATCH", "COMPUTE_KINDS", "Run", "record", "record_grid", "build",
           "bubble_table", "bubble_sweep_figure", "schedules_figure", "held_table", "BubbleView", "bubble_widget", "write_trace",
           "messages_per_step", "freeze_and_widen", "problem_gpipe_bubble", "problem_peak_held",
           "problem_interleaved_bubble", "problem_messages", "problem_zero_bubble"]

# 4 blocks, so p = 2 ranks can hold v = 2 chunks each; d_model = 128 over 32 tokens makes a stage's forward
# a few ms on one thread, long next to the executor's per-action overhead (tens of µs).
PIPE_GPT = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, d_model=256)
ROWS_PER_MICROBATCH = 4
COMPUTE_KINDS = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}
KIND_COLOURS = {"F": "tab:blue", "B": "tab:orange", "I": "gold", "W": "tab:green"}
GRID_M = (1, 2, 4, 8)
adamw = torch.optim.AdamW


# --------------------------------------------------------------------------- #
# Recorded runs
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class Run:
    """One schedule run on real ranks: the merged recording of its last step and what was measured.

    ``bubbles`` holds the overall bubble of every repeated step (their median is ``bubble``);
    ``peak_held``: per rank, the most micro-batches whose activations it held (``peak_held_rank``).
    """

    schedule: str
    p: int
    m: int
    v: int
    recording: Recording
    bubble_per_rank: dict[int, float]
    bubbles: tuple[float, ...]
    peak_held: dict[int, int]

    @property
    def bubble(self) -> float:
        return statistics.median(self.bubbles)

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


def measured_bubble(recording: Recording) -> tuple[dict[int, float], float]:
    """Per rank ``1 - busy / step`` and their mean, the step spanning every rank's compute (module docstring)."""
    compute = {r: [s for s in spans if s.kind in COMPUTE_KINDS] for r, spans in recording.items()}
    start = min(s.start for spans in compute.values() for s in spans)
    step = max(s.end for spans in compute.values() for s in spans) - start
    per_rank = {r: 1 - sum(s.duration for s in spans) / step for r, spans in compute.items()}
    return per_rank, statistics.mean(per_rank.values())


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
        runs[(name, p, m, v)] = Run(name, p, m, v, steps[-1], measured_bubble(steps[-1])[0], bubbles,
                                    {r: per_rank[r][i][1] for r in range(p)})
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
def bubble_table(runs: dict[tuple[str, int, int, int], Run]) -> list[tuple]:
    """Rows ``(schedule, p, m, v, measured median, min, max, simulated with measured times, formula)``."""
    return [(r.schedule, r.p, r.m, r.v, r.bubble, min(r.bubbles), max(r.bubbles), r.simulated().bubble, r.formula)
            for r in runs.values()]


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


def messages_per_step(p: int, m: int, v: int = 1) -> dict[str, int]:
    """SEND actions in one step of 1F1B and of interleaved 1F1B (v chunks), as ``with_communication`` lowers them."""
    count = lambda s, vv: sum(a.kind.startswith("SEND") for acts in with_communication(s, p, vv).values() for a in acts)
    out = {"1f1b": count(build("1f1b", p, m), 1)}
    if v > 1:
        out["interleaved_1f1b"] = count(build("interleaved_1f1b", p, m, v), v)
    return out


# --------------------------------------------------------------------------- #
# The bubble widget: a recorded run beside its simulation
# --------------------------------------------------------------------------- #
def _gantt(ax, timeline: Recording, scale: float, label_microbatches: bool) -> None:
    """Each rank's compute spans as bars on one row (rank 0 on top), coloured by kind, named as torch does ("2F1")."""
    from matplotlib.patches import Patch

    for rank, spans in timeline.items():
        for s in spans:
            kind = COMPUTE_KINDS.get(s.kind, s.kind)
            if kind not in KIND_COLOURS:
                continue
            ax.barh(rank, scale * s.duration, left=scale * s.start, height=0.7, color=KIND_COLOURS[kind],
                    edgecolor="black", linewidth=0.3)
            if label_microbatches:
                ax.text(scale * (s.start + s.end) / 2, rank, s.name, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(timeline)), [f"rank {r}" for r in timeline], fontsize=8)
    ax.set_ylim(len(timeline) - 0.5, -0.5)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in KIND_COLOURS.items()], fontsize=7, ncols=4,
              loc="lower right", bbox_to_anchor=(1.0, 1.0), frameon=False)


class BubbleView(FigureView):
    """Top: the recorded run of (schedule, p, m, v) if ``runs`` has it; bottom: ``simulate`` of the same schedule.

    With a recording the simulation uses its measured mean times, so both share one axis in ms; without one
    it uses t_f = 1, t_b = 2 and says so. ``measured``, ``predicted`` (simulated) and ``formula`` hold the
    bubbles drawn (``measured`` is None without a recording); ``recorded`` tells which case it was.
    """

    def __init__(self, runs: dict[tuple[str, int, int, int], Run]):
        import matplotlib.pyplot as plt

        self.runs = runs
        self.figure, (self.ax_real, self.ax_sim) = plt.subplots(2, 1, figsize=(COLUMN_IN, 4.6))
        plt.close(self.figure)
        self.measured: float | None = None
        self.predicted = self.formula = float("nan")
        self.recorded = False

    def key(self, schedule: str, p: int, m: int, v: int) -> tuple[str, int, int, int]:
        return (schedule, p, 1 if schedule == "naive" else m, v if schedule == "interleaved_1f1b" else 1)

    def show(self, schedule: str, p: int, m: int, v: int) -> None:
        schedule, p, m, v = self.key(schedule, p, m, v)
        for ax in (self.ax_real, self.ax_sim):
            ax.clear()
        self.measured, self.predicted, self.formula = None, float("nan"), float("nan")
        try:
            compute = build(schedule, p, m, v)
        except ValueError as err:                   # e.g. interleaving with v = 1, or m not a multiple of p
            self.recorded = False
            self.ax_real.text(0.5, 0.5, str(err), ha="center", va="center", wrap=True, fontsize=8,
                              transform=self.ax_real.transAxes)
            self.ax_sim.set_axis_off()
            return
        run = self.runs.get((schedule, p, m, v))
        self.recorded = run is not None
        labels = m * v <= 8
        self.formula = bubble_formula(schedule, p, m, v)
        if run is not None:
            prediction = run.simulated()
            self.measured = run.bubble
            _gantt(self.ax_real, {r: [s for s in spans] for r, spans in run.recording.items()}, 1e3, labels)
            start = min(s.start for spans in run.recording.values() for s in spans if s.kind in COMPUTE_KINDS)
            self.ax_real.set_xlim(1e3 * start, None)
            self.ax_real.set_title(f"recorded on {p} real ranks: measured bubble {run.bubble:.2f} "
                                   f"(median of {len(run.bubbles)} steps; min {min(run.bubbles):.2f})", fontsize=8, loc="left")
            self.ax_sim.set_xlabel("ms")
            scale, what = 1e3, "with the recorded mean times"
        else:
            prediction = simulate(compute, p, m, v)
            self.ax_real.text(0.5, 0.5, f"no recorded run for {schedule}, p = {p}, m = {m}, v = {v}:\nrecorded runs "
                              f"are p = 2 with m in {sorted({k[2] for k in self.runs})}; below, the simulation alone",
                              ha="center", va="center", fontsize=9, transform=self.ax_real.transAxes)
            self.ax_real.set_axis_off()
            self.ax_sim.set_xlabel("time (units of t_f; t_b = 2 t_f)")
            scale, what = 1.0, "t_f = 1, t_b = 2"
        self.predicted = prediction.bubble
        _gantt(self.ax_sim, prediction.timeline, scale, labels)
        self.ax_sim.set_title(f"simulated ({what}): bubble {prediction.bubble:.2f}; "
                              f"formula {self.formula:.2f}", fontsize=8, loc="left")
        if run is not None:                         # one time axis for both
            self.ax_sim.set_xlim(0, max(self.ax_real.get_xlim()[1] - self.ax_real.get_xlim()[0],
                                        1e3 * prediction.step * 1.02))
            self.ax_real.set_xlim(self.ax_real.get_xlim()[0], self.ax_real.get_xlim()[0] + self.ax_sim.get_xlim()[1])
        self.ax_real.set_axis_on() if run is not None else None
        self.figure.tight_layout()


def bubble_widget(runs: dict[tuple[str, int, int, int], Run], schedule: str = "1f1b", p: int = 2, m: int = 4,
                  v: int = 2) -> ipywidgets.VBox:
    """Choose the schedule, p, m and v (v: interleaved only); see the recorded run and the simulation."""
    import ipywidgets as widgets

    view = BubbleView(runs)
    view.show(schedule, p, m, v)
    controls = {"schedule": widgets.Dropdown(options=list(SCHEDULES), value=schedule, description="schedule"),
                "p": widgets.IntSlider(value=p, min=2, max=8, description="p ranks"),
                "m": widgets.IntSlider(value=m, min=1, max=16, description="m micro"),
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


def schedules_figure(names: Sequence[str] = ("naive", "gpipe", "1f1b", "interleaved_1f1b", "zb_h1"), p: int = 4,
                     m: int = 4, v: int = 2):
    """One simulated Gantt chart per schedule, drawn from the schedule's data: a rank's forward of its layers takes 1,
    its backward 2 (I and W 1 each); an interleaved chunk, 1/v of the rank's layers, 1/v of that."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(names), 1, figsize=(COLUMN_IN, 1.3 * len(names) * p / 3 + 0.6), sharex=True)
    plt.close(figure)
    for ax, name in zip(axes, names):
        mm = 1 if name == "naive" else m
        vv = v if name == "interleaved_1f1b" else 1      # a chunk holds 1/v of a rank's layers: 1/v of the time
        prediction = simulate(build(name, p, mm, vv), p, mm, vv, t_f=1 / vv, t_b=2 / vv)
        _gantt(ax, prediction.timeline, 1.0, False)
        ax.set_title(f"{name}: bubble {prediction.bubble:.2f}", fontsize=8, loc="left")
        if ax is not axes[0]:
            ax.get_legend().remove()
    axes[-1].set_xlabel(f"time (units of t_f), p = {p}, m = {m}" + (f", v = {v} for interleaved" if v > 1 else ""))
    figure.tight_layout()
    return figure
