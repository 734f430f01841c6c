"""What lesson 06 runs and draws: ZeRO's per-rank memory and traffic, measured beside the paper's formulas.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (arXiv
1910.02054); stage 3 as PyTorch's FSDP (Zhao et al., arXiv 2304.11277); offloading as ZeRO-Offload
(Ren et al., arXiv 2101.06840). Everything measured runs ``dtcourse.zero.ZeRO`` on forked gloo ranks::

    from dtcourse.lab import zero as lab
    runs = lab.measure_memory(worlds=(2, 4))     # a RankMemory per rank, stage, optimizer and precision
    lab.memory_widget(runs)                      # predicted bars per stage, the measured ones beside them
    lab.measure_traffic(world=4)                 # every collective of one step per stage, bytes counted by the ring

**K.** The paper counts 2 bytes of parameter and 2 of gradient per parameter under mixed precision,
and K bytes of what only the optimizer step needs: the fp32 master copy (4) and the optimizer's fp32
states, Adam's m and v (8, K = 12), SGD's momentum (4, K = 8), plain SGD's nothing (K = 4). In fp32
there is no separate master: parameters and gradients take 4 bytes and K is the states alone (8, 4, 0).
**Offloading** (ZeRO-Offload) keeps those K bytes, and the step that uses them, in host memory: they
leave the device, whose per-rank bytes are then parameters and gradients only (lesson 07).

Measured model states agree with the formula exactly once Ψ is counted padded (each unit's flat
vector rounded up to a multiple of N, ``dtcourse.zero.flat``), plus 4 bytes per unit for Adam's step
counter. Gathered buffers (stage 3's full units), gradient buckets (stages 2-3) and activations are
not in the paper's table: they are measured, each at its own peak over the step, and drawn on top.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtcourse.lab.problems import Answer
from dtcourse.lab.timeline import timeline_widget
from dtcourse.lab.widgets import COLUMN_IN, FigureView, figure_widget
from dtcourse.mixed_precision import Recipe
from dtcourse.models import MLP, regression_batch
from dtcourse.offload import OffloadedOptimizer
from dtcourse.runtime.launch import launch
from dtcourse.runtime.timeline import Recording, Span, Timeline, merge, shared_origin
from dtcourse.collectives.cost import ring_bytes_sent
from dtcourse.runtime.observe import CommLog, label, observe
from dtcourse.zero import STAGES, ModelStateBytes, ZeRO, default_units, paper_bytes
from dtcourse.zero.cost import (OPTIMIZER_STATE_BYTES, Predicted, activation_bytes, optimizer_k, predicted_memory,
                                traffic_formula)

if TYPE_CHECKING:
    import ipywidgets

__all__ = ["OPTIMIZERS", "MEMORY_MLP", "PROBLEM_MLP", "TIMELINE_MLP", "KINDS", "Predicted", "predicted_memory",
           "activation_bytes", "RankMemory", "measure_memory", "Collective", "collectives_of", "observed_step",
           "measure_traffic",
           "traffic_formula",
           "collectives_by_unit", "record_stage3", "prefetch_overlaps", "requested_ahead", "fsdp2_parity", "MemoryView",
           "memory_widget", "zero_timeline_widget", "problem_stage2_bytes", "problem_stage3_traffic",
           "problem_padding", "problem_prefetch_memory"]

# name -> (label, fp32 bytes of optimizer state per parameter, factory)
OPTIMIZERS: dict[str, tuple[str, int, Callable[..., torch.optim.Optimizer]]] = {
    "adam": ("AdamW", OPTIMIZER_STATE_BYTES["adam"], functools.partial(torch.optim.AdamW, lr=1e-3)),
    "sgd_momentum": ("SGD, momentum", OPTIMIZER_STATE_BYTES["sgd_momentum"],
                     functools.partial(torch.optim.SGD, lr=1e-2, momentum=0.9)),
    "sgd": ("SGD", OPTIMIZER_STATE_BYTES["sgd"], functools.partial(torch.optim.SGD, lr=1e-2)),
}
MEMORY_MLP = (20, 30, 30, 5)        # units of 630, 930 and 155 parameters: padded at N = 4 (Ψ = 1,715)
PROBLEM_MLP = (64, 128, 128, 16)    # units of 8,320, 16,512 and 2,064: no padding at N = 2 or 4 (Ψ = 26,896)
TIMELINE_MLP = (256, 768, 768, 768, 256)   # four units big enough that a step's compute shows in ms
ROWS = 8                            # rows of the batch per rank
# Kinds of a per-rank bar, bottom to top, with their colours: the paper's three, then what it leaves out.
KINDS = {"parameters": "tab:blue", "gradients": "tab:orange", "optimizer states": "tab:green",
         "activations": "tab:gray", "gathered": "tab:cyan", "buckets": "tab:olive"}


def _recipe(mixed: bool) -> Recipe:
    return Recipe(torch.bfloat16) if mixed else Recipe()


# --------------------------------------------------------------------------- #
# Measured: memory by kind
# --------------------------------------------------------------------------- #
@dataclass(frozen=True, kw_only=True)
class RankMemory(ModelStateBytes):
    """One rank's measured bytes by kind after a step: ``ZeRO.memory()`` (the fields it inherits), the run
    it came from, and the activations its forward saved."""

    world: int
    rank: int
    stage: int
    optimizer: str
    mixed: bool
    sizes: tuple[int, ...]
    rows: int
    psi: int                 # parameters, unpadded
    padded: int              # Ψ after padding each unit to a multiple of N
    units: int               # flat vectors, each with one Adam step counter
    activations: int
    offload: bool = False    # the optimizer on the host (dtcourse.offload): its states leave the device

    @property
    def paper(self) -> float:
        """The paper's formula on the padded Ψ, plus Adam's 4-byte step counter per unit (K = 0 offloaded)."""
        if self.offload:
            e = 2 if self.mixed else 4
            return paper_bytes(self.stage, self.padded, self.world, 0, e, e)
        e, counters = (2 if self.mixed else 4), (4 * self.units if self.optimizer == "adam" else 0)
        return paper_bytes(self.stage, self.padded, self.world, optimizer_k(self.optimizer, self.mixed), e, e) + counters

    def by_kind(self) -> dict[str, int]:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer states": self.optimizer_states,
                "activations": self.activations, "gathered": self.gathered, "buckets": self.buckets}


class _SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Lesson 00's ``SavedTensors`` for a ZeRO model: a saved tensor in a unit's flat buffer is model state.

    The test is made when the tensor is saved, when the unit is gathered; each storage counts once.
    """

    def __init__(self, model: ZeRO):
        self.nbytes, self._seen = 0, {}
        flats = [f for u in model.units for f in u.flats]

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self._seen and ptr not in {f.full.untyped_storage().data_ptr() for f in flats}:
                self._seen[ptr] = t                 # held, so the address is not reused while counting
                self.nbytes += t.untyped_storage().nbytes()
            return t
        super().__init__(pack, lambda t: t)

    def __enter__(self) -> _SavedActivations:
        super().__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        super().__exit__(*exc_info)
        self._seen.clear()


def _step(model: ZeRO, x: torch.Tensor, y: torch.Tensor) -> int:
    """One training step; returns the bytes of activations the forward saved."""
    model.zero_grad()
    with _SavedActivations(model) as saved:
        out = model(x)
    F.mse_loss(out, y).backward()
    model.step()
    return saved.nbytes


def _memory_rank(configs: list[tuple[int, str, bool, bool]], sizes: tuple[int, ...], rows: int) -> list[RankMemory]:
    world, rank = dist.get_world_size(), dist.get_rank()
    x, y = regression_batch(rows, sizes[0], sizes[-1], seed=rank)
    out = []
    for stage, optimizer, mixed, offload in configs:
        make = OPTIMIZERS[optimizer][2]
        if offload:
            make = functools.partial(OffloadedOptimizer, inner=make)
        model = ZeRO(MLP(sizes, seed=0), stage, make, precision=_recipe(mixed))
        _step(model, x, y)                     # the first step creates the optimizer's states
        model.reset_peaks()
        saved = _step(model, x, y)
        m, flats = model.memory(), [f for u in model.units for f in u.flats]
        out.append(RankMemory(**dataclasses.asdict(m), world=world, rank=rank, stage=stage, optimizer=optimizer,
                              mixed=mixed, sizes=tuple(sizes), rows=rows, psi=sum(f.numel for f in flats),
                              padded=sum(f.padded for f in flats), units=len(flats), activations=saved,
                              offload=offload))
    return out


def measure_memory(worlds: Sequence[int] = (2, 4), sizes: Sequence[int] = MEMORY_MLP, rows: int = ROWS,
                   optimizers: Sequence[str] = ("adam", "sgd_momentum"), mixed: Sequence[bool] = (True, False),
                   stages: Sequence[int] = STAGES, offload: Sequence[bool] = (False, True)) -> list[RankMemory]:
    """Two steps of ``MLP(sizes)`` per stage, optimizer and precision, one launch per world size; every rank's
    bytes after the second step (peaks of gathered buffers and buckets over that step).

    ``offload`` also runs fp32 configurations with the optimizer on the host (lesson 07's
    ``OffloadedOptimizer``); not bf16 ones, where ZeRO keeps its fp32 master on the device and so
    offloads less than ZeRO-Offload's formula moves."""
    configs = [(s, o, m, f) for o in optimizers for m in mixed for s in stages for f in offload if not (f and m)]
    return [r for world in worlds for per_rank in launch(_memory_rank, world, configs, tuple(sizes), rows)
            for r in per_rank]


# --------------------------------------------------------------------------- #
# Measured: traffic, and which collective ran on which unit
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class Collective:
    """One of ZeRO's collectives as this rank issued it, from the observer's record.

    op: ``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"``; what: ``"parameters"`` (gathered) or
    ``"gradients"`` (reduced); unit: the unit's name (ZeRO's annotation); phase: ``"forward"``, ``"backward"``
    or ``"step"``; nbytes: the full tensor's bytes (the gathered output, the reduce-scatter's input, the
    all-reduced tensor), padding included; sent: the bytes a ring sends for it
    (``collectives.cost.ring_bytes_sent``, exact: ZeRO pads every flat to a multiple of N).
    """

    op: str
    what: str
    unit: str
    phase: str
    nbytes: int
    sent: int


def _phase(record) -> tuple[str, str]:
    """(phase, unit) of a record labelled by ZeRO, inside the lab's ``label("step")`` for the step."""
    parts = record.label.split("/")
    phase = "backward" if record.backward else "step" if parts[0] == "step" else "forward"
    return phase, parts[-1]


def collectives_of(log: CommLog) -> list[Collective]:
    """ZeRO's collectives among the observer's records (the backend's: one record per collective)."""
    out = []
    for r in log.records:
        op = r.collective
        if op not in ("all_gather", "reduce_scatter", "all_reduce"):
            continue
        full = r.nbytes * (r.group_size if op == "all_gather" else 1)      # an all-gather's record holds its part
        phase, unit = _phase(r)
        out.append(Collective(op, "parameters" if op == "all_gather" else "gradients", unit, phase, full,
                              ring_bytes_sent(op, full, r.group_size)))
    return out


def observed_step(model: ZeRO, x: torch.Tensor, y: torch.Tensor) -> CommLog:
    """One step, observed: ZeRO labels each collective by its unit, and the step's run under ``label("step")``."""
    model.zero_grad()
    with observe() as log:
        F.mse_loss(model(x), y).backward()
        with label("step"):
            model.step()
    return log


def _traffic_rank(sizes: tuple[int, ...], mixed: bool, stages: Sequence[int]) -> dict[int, tuple]:
    x, y = regression_batch(ROWS, sizes[0], sizes[-1], seed=dist.get_rank())
    out = {}
    for stage in stages:
        runs = {}
        for comm in ("backend", "ring"):
            model = ZeRO(MLP(sizes, seed=0), stage, OPTIMIZERS["adam"][2], comm=comm, precision=_recipe(mixed))
            _step(model, x, y)                 # the first step builds the optimizer's states
            runs[comm] = observed_step(model, x, y)      # the second step is the one counted
        sends = runs["ring"].select(op="send")
        by_unit: dict[str, int] = {}
        for r in sends:
            unit = _phase(r)[1]
            by_unit[unit] = by_unit.get(unit, 0) + r.nbytes
        out[stage] = (tuple(collectives_of(runs["backend"])), sum(r.nbytes for r in sends),
                      sum(f.padded for u in model.units for f in u.flats), by_unit)
    return out


def measure_traffic(world: int = 4, sizes: Sequence[int] = MEMORY_MLP, mixed: bool = True,
                    stages: Sequence[int] = STAGES) -> list[dict[int, tuple]]:
    """Per rank, per stage, of one step: ``(collectives, counted, padded Ψ, counted per unit)``.

    The same step runs twice, observed (``dtcourse.runtime.observe``): through the backend, whose records
    are ZeRO's collectives, each with a ring's bytes (``collectives_of``); and on lesson 01's ring
    (``comm="ring"``), whose every message is recorded, so ``counted`` is measured message by message,
    in all and per unit (ZeRO names each unit's collectives with ``label``).
    """
    return launch(_traffic_rank, world, tuple(sizes), mixed, tuple(stages))


def collectives_by_unit(log: Sequence[Collective]) -> dict[str, list[tuple[str, str, str, int]]]:
    """``{unit: [(op, what, phase, bytes sent), ...]}`` in the order they ran."""
    found: dict[str, list[tuple[str, str, str, int]]] = {}
    for c in log:
        found.setdefault(c.unit, []).append((c.op, c.what, c.phase, c.sent))
    return found


# --------------------------------------------------------------------------- #
# Recorded: stage 3's all-gathers against its compute, with and without prefetch
# --------------------------------------------------------------------------- #
def _hook_units(model: ZeRO, timeline: Timeline, started: dict[str, float]) -> None:
    """Hook each unit's module so that its forward lands in ``timeline`` and its backward's start in ``started``.

    A unit's forward runs from just after ZeRO's pre-hook (its gather waited for) to just before ZeRO's
    post-hook; its backward starts just after ZeRO's pre-backward hook (the gather) and ends when the
    reduce-scatter of its gradients is called (``_spans``), which ZeRO does as soon as the last is accumulated.
    """
    now = time.perf_counter
    for unit in model.units:
        name = unit.name
        unit.module.register_forward_pre_hook(lambda m, a, name=name: started.__setitem__(name + " fwd", now()))
        unit.module.register_forward_hook(lambda m, a, out, name=name: timeline.record(
            "forward", name, started.pop(name + " fwd"), now()), prepend=True)      # before ZeRO frees the unit
        unit.module.register_forward_hook(functools.partial(_on_backward, mark=started, name=name))


def _on_backward(module: nn.Module, args: Any, out: torch.Tensor, mark: dict[str, float], name: str) -> None:
    # registered after ZeRO's own hook on the output, so it runs after ZeRO's pre-backward (the gather)
    out.register_hook(lambda grad: mark.__setitem__(name, time.perf_counter()))


def _spans(log: CommLog, timeline: Timeline, started: dict[str, float]) -> None:
    """The observer's collectives as spans, from the call to the completion of the backend's work."""
    for r in log.records:
        if r.collective not in ("all_gather", "reduce_scatter"):
            continue
        phase, unit = _phase(r)
        if r.collective == "reduce_scatter" and unit in started:
            timeline.record("backward", unit, started.pop(unit), r.start)
        timeline.record(r.collective, f"{unit} {phase}", r.start, max(r.start, r.end or r.start))


def _stage3_rank(prefetches: list[bool], sizes: tuple[int, ...], rows: int, steps: int) -> dict[bool, Timeline]:
    x, y = regression_batch(rows, sizes[0], sizes[-1], seed=dist.get_rank())
    out = {}
    for prefetch in prefetches:
        model, timeline, started = ZeRO(MLP(sizes, seed=0), 3, OPTIMIZERS["adam"][2], prefetch=prefetch), Timeline(), {}
        _hook_units(model, timeline, started)
        for _ in range(steps):                 # the last step is kept; the first ones warm up
            timeline.restart(shared_origin())
            model.zero_grad()
            with observe() as log:
                F.mse_loss(model(x), y).backward()
            _spans(log, timeline, started)
            with timeline.span("optimizer", "AdamW step"):
                model.step()
        out[prefetch] = timeline
    return out


def record_stage3(world: int = 2, sizes: Sequence[int] = TIMELINE_MLP, rows: int = 512,
                  steps: int = 2) -> dict[str, Recording]:
    """The last of ``steps`` stage-3 steps (fp32, AdamW, backend collectives), with prefetch and without."""
    per_rank = launch(_stage3_rank, world, [True, False], tuple(sizes), rows, steps, timeout=120)
    return {("prefetch" if p else "no prefetch"): merge([r[p] for r in per_rank]) for p in (True, False)}


def prefetch_overlaps(spans: Sequence[Span]) -> list[tuple[Span, Span]]:
    """(parameter all-gather, compute span of another unit) pairs whose intervals overlap, on one rank.

    Measured: a gather's span ends when the backend completed it, so a short gather may finish before the
    compute it was issued ahead of starts. ``requested_ahead`` gives what the schedule guarantees."""
    gathers = [s for s in spans if s.kind == "all_gather"]
    compute = [s for s in spans if s.kind in ("forward", "backward")]
    return [(g, c) for g in gathers for c in compute
            if g.name.split()[0] != c.name and g.start < c.end and c.start < g.end]


def requested_ahead(spans: Sequence[Span]) -> list[tuple[Span, Span]]:
    """(all-gather of unit v, compute span of another unit u) pairs where the gather was issued before u's
    compute started, and u computes before v: v's parameters were asked for while u still had work to do."""
    gathers = [s for s in spans if s.kind == "all_gather"]
    compute = [s for s in spans if s.kind in ("forward", "backward")]
    starts = {(c.kind, c.name): c.start for c in compute}
    out = []
    for g in gathers:
        unit, phase = g.name.split()
        mine = starts.get((phase, unit))
        out += [(g, c) for c in compute if c.name != unit and c.kind == phase and g.start < c.start
                and mine is not None and c.start < mine]
    return out


def zero_timeline_widget(runs: dict[str, Recording]) -> ipywidgets.VBox:
    """A dropdown over ``record_stage3``'s runs, each drawn as a per-rank Gantt chart."""
    titles = {k: f"stage 3, {k}: {len(prefetch_overlaps(v[0]))} all-gather/compute overlaps on rank 0"
              for k, v in runs.items()}
    return timeline_widget(runs, titles)


# --------------------------------------------------------------------------- #
# FSDP2: PyTorch's stage 3
# --------------------------------------------------------------------------- #
def _fsdp2_rank(sizes: tuple[int, ...], steps: int) -> float:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    ours = ZeRO(MLP(sizes, seed=0), 3, OPTIMIZERS["adam"][2])
    theirs = MLP(sizes, seed=0)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for name in default_units(theirs):          # one FSDP unit per ZeRO unit, then the root
        fully_shard(theirs.get_submodule(name), mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    optimizer = OPTIMIZERS["adam"][2](theirs.parameters())
    for step in range(steps):
        x, y = regression_batch(ROWS, sizes[0], sizes[-1], seed=100 * step + dist.get_rank())
        _step(ours, x, y)
        optimizer.zero_grad()
        F.mse_loss(theirs(x), y).backward()
        optimizer.step()
    full = ours.full_parameters()
    return max((full[n] - p.full_tensor()).abs().max().item() for n, p in theirs.named_parameters())


def fsdp2_parity(world: int = 2, sizes: Sequence[int] = MEMORY_MLP, steps: int = 3) -> float:
    """Largest difference between ZeRO stage 3's parameters and ``fully_shard``'s after ``steps`` AdamW steps."""
    return max(launch(_fsdp2_rank, world, tuple(sizes), steps, timeout=120))


# --------------------------------------------------------------------------- #
# The memory widget
# --------------------------------------------------------------------------- #
_SCALES = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "B"))
PSI_OPTIONS = (("1,715", 1715), ("1M", 10**6), ("125M", 125 * 10**6), ("1.5B", 15 * 10**8),
               ("7.5B", 75 * 10**8), ("175B", 175 * 10**9), ("1T", 10**12))
WORLD_OPTIONS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
DEVICE_BYTES = 80e9                     # one 80 GB GPU, drawn as a line to fit under


class MemoryView(FigureView):
    """Left: per-rank bytes by kind for the four stages, predicted (paper) and, where a run exists, measured
    beside it. Right: predicted device bytes per rank against N for each stage.

    ``bars[(which, stage, kind)]`` is each Rectangle drawn (``which``: "predicted" or "measured"),
    ``totals[stage]`` each stage's predicted device bytes, written above the stage's bars as ``labels[stage]``,
    ``measured[stage]`` the run drawn, ``lines[stage]`` each curve of the right panel.
    """

    def __init__(self, runs: Sequence[RankMemory] = ()):
        from matplotlib.figure import Figure

        self.runs = list(runs)
        self.figure = Figure(figsize=(COLUMN_IN, 3.8), layout="constrained")
        self.ax, self.curves = self.figure.subplots(1, 2, width_ratios=(3, 2))
        self.show(75 * 10**8, 64, 2, "adam", True, False)

    def _run(self, psi: int, world: int, stage: int, optimizer: str, mixed: bool, offload: bool) -> RankMemory | None:
        found = [r for r in self.runs if (r.psi, r.world, r.stage, r.optimizer, r.mixed, r.offload) ==
                 (psi, world, stage, optimizer, mixed, offload)]
        return max(found, key=lambda r: (r.model_states, r.rank), default=None)   # the last: it holds the padding

    def show(self, psi: int, world: int, stage: int, optimizer: str, mixed: bool, offload: bool) -> None:
        self.state = dict(psi=psi, world=world, stage=stage, optimizer=optimizer, mixed=mixed, offload=offload)
        predicted = {s: predicted_memory(psi, world, s, optimizer, mixed, offload) for s in STAGES}
        self.totals = {s: p.device for s, p in predicted.items()}
        self.measured = {s: r for s in STAGES if (r := self._run(psi, world, s, optimizer, mixed, offload))}
        top = max([*self.totals.values()] + [sum(r.by_kind().values()) for r in self.measured.values()])
        scale, unit = next(((v, u) for v, u in _SCALES if top >= v), (1, "B"))
        ax, self.bars, self.labels = self.ax, {}, {}
        ax.clear()
        width = 0.38 if self.measured else 0.6
        for s in STAGES:
            p, alpha = predicted[s], 1.0 if s == stage else 0.35
            kinds = {"parameters": p.parameters, "gradients": p.gradients, "optimizer states": p.optimizer_states}
            if s in self.measured:              # the formula for the measured model's activations
                r = self.measured[s]
                kinds["activations"] = activation_bytes(r.sizes, r.rows, r.mixed)
            high = self._stack(s - (width / 2 if self.measured else 0), width, kinds, "predicted", s, scale, alpha)
            if s in self.measured:
                high = max(high, self._stack(s + width / 2, width, self.measured[s].by_kind(), "measured", s,
                                             scale, alpha, "//"))
            # the paper's total for the stage, above both bars: inside them the hatching would hide it
            self.labels[s] = ax.annotate(f"{p.device / scale:.3g}", (s, high), xytext=(0, 2),
                                         textcoords="offset points", ha="center", va="bottom", fontsize=8)
        from matplotlib.patches import Patch

        ax.set_xticks(list(STAGES), [f"stage {s}" for s in STAGES])
        ax.set_ylabel(f"{unit} per rank (on top: model states)")
        ax.set_ylim(0, 1.45 * top / scale)                     # room for the legend above the bars
        shown = list(dict.fromkeys(k[2] for k in self.bars))
        handles = [Patch(color=KINDS[k], label=k) for k in shown]
        if self.measured:
            handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="measured (right bar)"))
        ax.legend(handles=handles, fontsize=7, ncols=3, loc="upper center")
        title = (f"Ψ = {_count(psi)}, N = {world}, {'bf16 + fp32 master' if mixed else 'fp32'} "
                 f"{OPTIMIZERS[optimizer][0]} (K = {optimizer_k(optimizer, mixed)})")
        if offload:
            title += f"\noffloaded to the host: {predicted[stage].host / scale:.3g} {unit} per rank at stage {stage}"
        ax.set_title(title, fontsize=9)
        self._draw_curves(psi, world, stage, optimizer, mixed, offload, scale, unit)

    def _stack(self, x: float, width: float, kinds: dict[str, float], which: str, stage: int, scale: float,
               alpha: float, hatch: str | None = None) -> float:
        """Draws one bar of ``kinds`` stacked bottom to top; returns its top."""
        bottom = 0.0
        for kind, nbytes in kinds.items():
            (bar,) = self.ax.bar(x, nbytes / scale, width, bottom=bottom, color=KINDS[kind], alpha=alpha,
                                 hatch=hatch, edgecolor="black", linewidth=0.3)
            self.bars[which, stage, kind] = bar
            bottom += nbytes / scale
        return bottom

    def _draw_curves(self, psi: int, world: int, stage: int, optimizer: str, mixed: bool, offload: bool,
                     scale: float, unit: str) -> None:
        ax, self.lines = self.curves, {}
        ax.clear()
        for s in STAGES:
            y = [predicted_memory(psi, n, s, optimizer, mixed, offload).device / scale for n in WORLD_OPTIONS]
            (self.lines[s],) = ax.plot(WORLD_OPTIONS, y, linewidth=2.5 if s == stage else 1, label=f"stage {s}")
        ax.axvline(world, color="gray", linestyle=":", linewidth=1)
        if unit == "GB":                        # a GPU's memory, where the model is that large
            ax.axhline(DEVICE_BYTES / scale, color="black", linestyle="--", linewidth=0.8, label="80 GB GPU")
        ax.set(xscale="log", yscale="log", xlabel="ranks N (dotted: this N)", ylabel=f"{unit} per rank, predicted")
        ax.set_xticks(WORLD_OPTIONS[::2], [str(n) for n in WORLD_OPTIONS[::2]])
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        ax.set_title("model states against N", fontsize=9)


def _count(psi: float) -> str:
    """``7.5e9`` -> ``'7.5B'``; small counts stay whole: ``1715`` -> ``'1,715'``."""
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if psi >= size:
            return f"{psi / size:.3g}{suffix}"
    return f"{psi:,}"


def memory_widget(runs: Sequence[RankMemory] = ()) -> ipywidgets.VBox:
    """Controls for Ψ, N, stage, optimizer, mixed precision and offloading over a ``MemoryView`` of ``runs``."""
    import ipywidgets as widgets

    view = MemoryView(runs)
    psi_options = list(PSI_OPTIONS) + [(f"{r.psi:,}", r.psi) for r in runs    # readouts short enough to show
                                        if r.psi not in {v for _, v in PSI_OPTIONS}]
    measured = {r.psi: sorted({q.world for q in runs if q.psi == r.psi}) for r in runs}
    note = "; ".join(f"Ψ = {psi:,} on N = {', '.join(map(str, worlds))}" for psi, worlds in measured.items())
    controls = {
        "psi": widgets.SelectionSlider(options=list(dict.fromkeys(psi_options)), value=75 * 10**8,
                                       description="Ψ"),
        "world": widgets.SelectionSlider(options=WORLD_OPTIONS, value=64, description="N"),
        "stage": widgets.ToggleButtons(options=list(STAGES), value=2, description="stage",
                                       style={"button_width": "40px"}),
        "optimizer": widgets.Dropdown(options=[(v[0], k) for k, v in OPTIMIZERS.items()], value="adam",
                                      description="optimizer"),
        "mixed": widgets.Checkbox(value=True, description="mixed precision"),
        "offload": widgets.Checkbox(value=False, description="offload K to host"),
    }
    box = figure_widget(controls, view.show, view.figure, view=view,
                        note=widgets.Label(f"Measured runs, drawn hatched beside the prediction: {note}."
                                           if runs else "No measured runs: the bars are the paper's formulas."))
    row, image = box.children            # two rows of three controls read better than one of six
    items = list(controls.values())
    box.children = (widgets.HBox(items[:3]), widgets.HBox(items[3:]), box.note, image)
    return box


# --------------------------------------------------------------------------- #
# Problems (part 6 of lesson 06): each measures with ZeRO and computes the formula apart
# --------------------------------------------------------------------------- #
def _psi(sizes: Sequence[int]) -> int:
    return sum(i * o + o for i, o in zip(sizes[:-1], sizes[1:]))


def problem_stage2_bytes(world: int = 4, sizes: Sequence[int] = PROBLEM_MLP) -> Answer:
    """Bytes of model states one rank holds at stage 2, mixed-precision AdamW (``ZeRO.memory()``)."""
    run = max(measure_memory((world,), sizes, optimizers=("adam",), mixed=(True,), stages=(2,)),
              key=lambda r: r.model_states)
    psi = _psi(sizes)
    return Answer(measured=run.model_states, formula=2 * psi + 14 * psi / world + 4 * len(sizes[1:]), unit="B",
                  rtol=0.0, why="every unit divides by N, so nothing is padded, and each of the three units adds "
                  "one 4-byte AdamW step counter")


def problem_stage3_traffic(world: int = 4, sizes: Sequence[int] = PROBLEM_MLP) -> Answer:
    """Bytes one rank sends in one stage-3 step, bf16 parameters and gradients, counted by the ring."""
    _, sent, padded, _ = measure_traffic(world, sizes, mixed=True, stages=(3,))[-1][3]
    return Answer(measured=sent, formula=3 * 2 * _psi(sizes) * (world - 1) / world, unit="B", rtol=0.0,
                  why="the ring's messages are counted to the byte, and no unit needs padding")


def problem_padding(world: int = 4, sizes: Sequence[int] = MEMORY_MLP) -> Answer:
    """Bytes of padding the last rank holds at stage 3 with mixed-precision AdamW (``ZeRO.memory().padding``)."""
    last = [r for r in measure_memory((world,), sizes, optimizers=("adam",), mixed=(True,), stages=(3,))
            if r.rank == world - 1][0]
    pads = [-(i * o + o) % world for i, o in zip(sizes[:-1], sizes[1:])]
    return Answer(measured=last.padding, formula=sum(pads) * (2 + 2 + 12), unit="B", rtol=0.0,
                  why="each unit's zeros sit at the end of its flat vector, in the last rank's part, and cost "
                  "that rank 16 bytes each, as a parameter does")


def problem_prefetch_memory(world: int = 2, sizes: Sequence[int] = PROBLEM_MLP) -> Answer:
    """The most bytes of gathered units a stage-3 rank holds at once with prefetch (bf16 parameters)."""
    run = measure_memory((world,), sizes, optimizers=("adam",), mixed=(True,), stages=(3,))[0]
    units = [i * o + o for i, o in zip(sizes[:-1], sizes[1:])]
    return Answer(measured=run.gathered, formula=2 * max(a + b for a, b in zip(units, units[1:])), unit="B",
                  rtol=0.0, why="a unit computes while the next one is gathered, and nothing else is full; "
                  "no unit needs padding at N = 2")
