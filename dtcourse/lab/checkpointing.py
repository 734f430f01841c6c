"""What lesson 05 runs and draws: what activation checkpointing keeps and what it costs, beside its models.

Each measurement comes with the prediction it is checked against; ``python -m dtcourse.bench.checkpointing``
prints them as tables. ``plot_segments`` draws the segment sweep beside Chen et al.'s model,
``plot_policies`` the recomputation policies beside Korthikanti et al.'s, ``trace_widget`` the bytes
alive after every op of one step, and the ``problem_*`` functions measure lesson 05's problems::

    from dtcourse.lab import checkpointing as lab
    points = lab.measure_segments(n_layers=16)   # one SegmentPoint per segment count k
    lab.trace_widget(points)                     # a slider over k, the memory trace below it

**Memory** is measured by ``memory.HeldBytes``, a ``TorchDispatchMode`` that notes each storage an
op allocates and, through a weak reference, when it is freed. ``memory.SavedTensors`` counts what
autograd saves, but a checkpoint hides its region from it (it pushes its own saved-tensor hooks)
and holds its inputs itself; only a count of live storages sees everything a checkpointed step
holds, recomputed tensors included. Storages that existed before (parameters, the batch, ``.grad``
buffers allocated beforehand) are not counted.

**Segment sweep** (Chen et al. 2016, arXiv 1604.06174): ``mlp_layers(n)``, n - 1 layers of
Linear + ReLU and a last Linear, under ``checkpoint_sequential`` with k segments. A unit is one
(B, width) fp32 tensor. After the forward the stack holds the inputs of segments 2 to k (k - 1
units) and, in the last segment of m = n // k layers, m - 1 ReLU outputs and the output: k - 1 + m
units, least near k = sqrt(n). (The batch, segment 1's input, existed before and is not counted.)
Backward re-runs the n - m layers of the checkpointed segments:
step(k) ≈ step(1) + forward(1)·(n - m)/n, at most one extra forward pass.

**Recomputation policies** (Korthikanti et al. 2022, arXiv 2205.05198) for the layers of a
``models.GPT``: none, selective (attention core only) and full (every layer). Per layer, in
fp32 with dropout 0, with L = ``memory.gpt_layer_activation_bytes`` = 4(16sbh + as²b + 4sb):
none keeps L; selective keeps L - 4as²b (the scores go, and the (B, T, 3C) projection that the
core starts from takes the place of the copies of q, k and v that the matmuls kept); full keeps
4sbh, the layer's input. ``attention_saved`` shows that fused attention
(``F.scaled_dot_product_attention``) saves no s x s tensor at all (Dao et al. 2022, arXiv 2205.14135).

**Offloading** (``measure_save_on_cpu``): ``torch.autograd.graph.save_on_cpu`` is a pair of
saved-tensor hooks whose pack copies each saved tensor to host memory. The counts of what it packs
and copies are exact on any machine; the device bytes it frees show only on a GPU.

Times are medians over interleaved repeats (every variant once per round, so a burst of load lands
on all alike), printed and drawn, never asserted. Figures use ``matplotlib.figure.Figure`` (no
pyplot), so they draw headlessly and a notebook shows each one once.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtcourse.checkpointing import (apply_full_recomputation, apply_selective_recomputation,
                                    checkpoint_sequential, segment_bounds)
from dtcourse.checkpointing_cost import POLICIES, predicted_policy_bytes, predicted_segment_units, recompute_flops
from dtcourse.lab.problems import Answer
from dtcourse.lab.widgets import COLUMN_IN, FigureView, figure_widget
from dtcourse.memory import HeldBytes
from dtcourse.models import GPT, MLP, RECOMPUTE_GPT, GPTConfig, lm_loss, token_batch

if TYPE_CHECKING:
    import ipywidgets
    from matplotlib.figure import Figure

__all__ = ["mlp_layers", "wide_layers", "SegmentPoint", "predicted_segment_units", "measure_segments",
           "predicted_step_ms", "PolicyPoint", "POLICIES", "RECOMPUTE_GPT", "predicted_policy_bytes",
           "recompute_flops", "measure_policies", "attention_saved", "OffloadPoint", "measure_save_on_cpu",
           "plot_segments", "plot_policies", "TraceView", "trace_widget", "problem_held_after_forward",
           "problem_best_segments", "problem_selective_flops", "problem_save_on_cpu_bytes"]



def _zero_grads(model: nn.Module) -> None:
    # Allocated before measuring, so backward accumulates into them in place: the
    # gradients (the same for every variant) stay out of the activation counts.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


# --------------------------------------------------------------------------- #
# Segment sweep
# --------------------------------------------------------------------------- #
def mlp_layers(n_layers: int, width: int, seed: int = 0) -> nn.Sequential:
    """``models.MLP((width,) * (n_layers + 1))`` regrouped as n layers: n - 1 of (Linear, ReLU), then a Linear."""
    net = MLP((width,) * (n_layers + 1), seed=seed).net
    return nn.Sequential(*(nn.Sequential(net[i], net[i + 1]) for i in range(0, len(net) - 1, 2)), net[-1])


def wide_layers(n_layers: int, width: int, ratio: int, seed: int = 0) -> nn.Sequential:
    """n layers of Linear(width, ratio·width), ReLU, Linear(ratio·width, width): each keeps 1 + ratio
    (B, width) units (its input and the hidden ReLU output) and passes on one."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(*(nn.Sequential(nn.Linear(width, ratio * width), nn.ReLU(),
                                             nn.Linear(ratio * width, width)) for _ in range(n_layers)))


@dataclass(frozen=True)
class SegmentPoint:
    """One segment count k of the sweep: measured bytes and times, and the recorded memory trace."""

    n_layers: int
    segments: int
    unit: int                  # bytes of one (B, width) fp32 activation
    held_after_forward: int    # bytes alive when the forward returns
    peak: int                  # bytes, the most alive at once over forward and backward
    recomputed_layers: int     # layer forwards run during backward (counted by forward hooks)
    forward_ms: float
    step_ms: float             # forward + backward
    trace: tuple[int, ...]     # bytes alive after each op
    forward_ops: int           # how many of those ops were the forward's

    @property
    def predicted_held(self) -> int:
        return self.unit * predicted_segment_units(self.n_layers, self.segments)


def measure_segments(n_layers: int = 16, width: int = 256, batch: int = 64,
                     segments: Sequence[int] | None = None, repeats: int = 5,
                     seed: int = 0) -> list[SegmentPoint]:
    """Run ``checkpoint_sequential(mlp_layers(n_layers, width), k, x)`` and backward for each k.

    One pass per k under ``HeldBytes`` measures the memory; then ``repeats`` timed rounds
    (after one warm-up round) run every k in turn, without the tracker.
    """
    layers = mlp_layers(n_layers, width, seed)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(seed))
    ks = list(segments) if segments is not None else list(range(1, n_layers + 1))
    for k in ks:
        segment_bounds(n_layers, k)                       # a bad k fails before anything runs
    memory = {k: _memory_pass(layers, k, x) for k in ks}
    times: dict[int, list[tuple[float, float]]] = {k: [] for k in ks}
    for round_ in range(repeats + 1):
        for k in ks:
            start = time.perf_counter()
            y = checkpoint_sequential(layers, k, x)
            forward = time.perf_counter()
            y.sum().backward()
            if round_:                                    # round 0 warms up
                times[k].append((forward - start, time.perf_counter() - start))
            del y
    unit = batch * width * 4
    return [SegmentPoint(n_layers, k, unit, *memory[k][:3], _median_ms([f for f, _ in times[k]]),
                         _median_ms([s for _, s in times[k]]), *memory[k][3:]) for k in ks]


def _memory_pass(layers: nn.Sequential, k: int, x: torch.Tensor) -> tuple:
    """One step under ``HeldBytes``: (held after forward, peak, layers recomputed, trace, forward's ops)."""
    _zero_grads(layers)
    calls = [0]
    count = lambda *_: calls.__setitem__(0, calls[0] + 1)          # noqa: E731
    hooks = [layer.register_forward_pre_hook(count) for layer in layers]
    try:
        with HeldBytes() as held:
            y = checkpoint_sequential(layers, k, x)
            after, forward_ops = held.now, held.mark()
            y.sum().backward()
            del y
    finally:
        for hook in hooks:
            hook.remove()
    return after, held.peak, calls[0] - len(layers), tuple(held.trace), forward_ops


def _median_ms(seconds: Sequence[float]) -> float:
    return 1e3 * statistics.median(seconds)


def predicted_step_ms(points: Sequence[SegmentPoint]) -> dict[int, float]:
    """Chen et al.'s cost: the plain step (k = 1) plus the forward of every recomputed layer."""
    plain = next(p for p in points if p.segments == 1)
    return {p.segments: plain.step_ms + plain.forward_ms * p.recomputed_layers / p.n_layers for p in points}


# --------------------------------------------------------------------------- #
# Recomputation policies for a GPT
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class PolicyPoint:
    policy: str
    held_after_forward: int    # bytes the layers hold when their forward returns, measured
    predicted_held: int
    peak: int                  # bytes, the most alive at once over the layers' forward and backward
    step_ms: float             # a whole training step: forward, loss, backward
    predicted_overhead: float  # recomputed FLOPs / plain step FLOPs


def _gpt(config: GPTConfig, policy: str, seed: int) -> GPT:
    model = GPT(config, seed=seed)
    if policy == "full":
        apply_full_recomputation(model)
    elif policy == "selective":
        apply_selective_recomputation(model)
    elif policy != "none":
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}.")
    return model


def measure_policies(config: GPTConfig = RECOMPUTE_GPT, batch: int = 4, repeats: int = 5,
                     policies: Sequence[str] = POLICIES, seed: int = 0) -> list[PolicyPoint]:
    """Memory of the layers alone (the embeddings' output is the input), time of whole steps."""
    idx, targets = token_batch(config, batch, seed=seed)
    s = idx.shape[1]
    models = {policy: _gpt(config, policy, seed) for policy in policies}
    memory = {}
    for policy, model in models.items():
        _zero_grads(model)
        x = (model.wte(idx) + model.wpe(torch.arange(s))).detach().requires_grad_()   # (B, T, C)
        with HeldBytes() as held:
            h = x
            for block in model.blocks:
                h = block(h)                                                       # (B, T, C)
            after = held.now
            h.sum().backward()
            del h
        memory[policy] = (after, held.peak)
    times: dict[str, list[float]] = {p: [] for p in policies}
    for round_ in range(repeats + 1):
        for policy, model in models.items():
            start = time.perf_counter()
            lm_loss(model(idx), targets).backward()
            if round_:
                times[policy].append(time.perf_counter() - start)
    points = []
    for policy in policies:
        extra, step = recompute_flops(config, batch, s, policy)
        points.append(PolicyPoint(policy, memory[policy][0], predicted_policy_bytes(config, batch, s, policy),
                                  memory[policy][1], _median_ms(times[policy]), extra / step))
    return points


def attention_saved(config: GPTConfig = RECOMPUTE_GPT, batch: int = 4) -> dict[str, list[tuple]]:
    """(shape, bytes) of each tensor the attention core saves for backward: written out, and fused.

    "explicit" is ``models.CausalSelfAttention.core`` (q·kᵀ, mask, softmax, ·v); "fused" is
    ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on the same projection. Both
    are seen by a saved-tensor pack hook, the mechanism of section 1, that only records.
    """
    s, h, a = config.block_size, config.d_model, config.n_head
    qkv = torch.randn(batch, s, 3 * h, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def fused(qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(batch, s, a, h // a).transpose(1, 2) for t in qkv.split(h, dim=2))  # (B, nh, T, hs)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)                        # (B, nh, T, hs)

    found = {}
    for name, core in (("explicit", GPT(config).blocks[0].attn.core), ("fused", fused)):
        saved: list[tuple] = []
        record = lambda t: saved.append((tuple(t.shape), t.numel() * t.element_size())) or t   # noqa: E731
        with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
            core(qkv)
        found[name] = saved
    return found


@dataclass(frozen=True)
class OffloadPoint:
    device: str
    held_plain: int        # bytes on the device after a plain forward (HeldBytes; memory_allocated on CUDA)
    held_offloaded: int    # the same under save_on_cpu
    packed: int            # bytes of every tensor autograd handed to save_on_cpu's pack
    copied: int            # bytes pack really copied to the host (none where a tensor already lives there)


class _CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """``save_on_cpu`` itself, with its pack hook wrapped to count what it is given and what it copies."""

    def __init__(self, pin_memory: bool):
        super().__init__(pin_memory=pin_memory)
        self.packed = self.copied = 0
        pack = self.pack_hook

        def counting_pack(t: torch.Tensor) -> tuple:
            device, host = pack(t)
            self.packed += t.numel() * t.element_size()
            if host.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
                self.copied += host.numel() * host.element_size()
            return device, host
        self.pack_hook = counting_pack


def measure_save_on_cpu(n_layers: int = 4, width: int = 256, batch: int = 64,
                        device: str | torch.device = "cpu") -> OffloadPoint:
    """``mlp_layers(n_layers, width)`` on ``device``: what its forward leaves there, plain and under save_on_cpu."""
    device = torch.device(device)
    layers, x = mlp_layers(n_layers, width).to(device), _batch(batch, width).to(device)
    _zero_grads(layers)
    if device.type == "cuda":
        layers(x).sum().backward()        # cuBLAS allocates its workspace at the first matmul: not here
    held = []
    for hooks in (None, _CountingSaveOnCpu(pin_memory=device.type == "cuda")):
        with contextlib.ExitStack() as stack:
            if hooks is not None:
                stack.enter_context(hooks)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                before = torch.cuda.memory_allocated(device)
                y = layers(x)
                torch.cuda.synchronize(device)
                held.append(torch.cuda.memory_allocated(device) - before)
            else:
                with HeldBytes() as tracker:
                    y = layers(x)
                held.append(tracker.now)
        y.sum().backward()
        del y
    return OffloadPoint(str(device), held[0], held[1], hooks.packed, hooks.copied)


# --------------------------------------------------------------------------- #
# Figures
# --------------------------------------------------------------------------- #
def plot_segments(points: Sequence[SegmentPoint]) -> Figure:
    """Left: bytes held after the forward (measured, predicted) and the peak, against k. Right: step time."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(COLUMN_IN, 3.6), layout="constrained")
    left, right = fig.subplots(1, 2)
    ks = [p.segments for p in points]
    kib = 1024
    left.plot(ks, [p.predicted_held / kib for p in points], "-", color="tab:orange",
              label="predicted: k − 1 + n//k units")
    left.plot(ks, [p.held_after_forward / kib for p in points], "o", color="tab:blue",
              label="measured after forward")
    left.plot(ks, [p.peak / kib for p in points], "s", color="tab:red", markersize=4,
              label="measured peak")
    left.set_ylabel("KiB of activations")
    left.set_ylim(bottom=0)
    left.legend(fontsize=8)
    left.set_title("Bytes the stack holds", fontsize=10)
    predicted = predicted_step_ms(points)
    right.plot(ks, [predicted[k] for k in ks], "-", color="tab:orange",
               label="predicted")
    right.plot(ks, [p.step_ms for p in points], "o", color="tab:blue", label="measured (median)")
    right.set_ylabel("ms per step (forward + backward)")
    right.set_ylim(bottom=0)
    right.legend(fontsize=8)
    right.set_title("Time a step takes", fontsize=10)
    n = points[0].n_layers
    for ax in (left, right):
        ax.axvline(math.sqrt(n), color="gray", linestyle=":", linewidth=1)
        ax.set_xlabel(f"segments k (n = {n}; dotted: k = √n)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    return fig


def plot_policies(points: Sequence[PolicyPoint]) -> Figure:
    """Bars per policy: bytes the layers hold (measured beside predicted), and step time (measured)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(COLUMN_IN, 3.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    names = [p.policy for p in points]
    x = range(len(points))
    left.bar([i - 0.2 for i in x], [p.held_after_forward / 2**20 for p in points], 0.4, label="measured")
    left.bar([i + 0.2 for i in x], [p.predicted_held / 2**20 for p in points], 0.4, label="predicted")
    left.set_ylabel("MiB held after forward")
    left.set_title("Bytes the GPT's layers hold", fontsize=10)
    left.legend(fontsize=8)
    plain = next((p.step_ms for p in points if p.policy == "none"), None)
    bars = right.bar(list(x), [p.step_ms for p in points], 0.5, color="tab:green")
    for bar, p in zip(bars, points):
        measured = f"{p.step_ms / plain - 1:+.0%} measured\n" if plain else ""
        right.annotate(f"{measured}{p.predicted_overhead:+.0%} FLOPs", (bar.get_x() + bar.get_width() / 2,
                       bar.get_height()), ha="center", va="bottom", fontsize=8)
    right.set_ylabel("ms per training step (median)")
    right.set_title("Time a training step takes", fontsize=10)
    right.set_ylim(top=1.25 * max(p.step_ms for p in points))
    for ax in (left, right):
        ax.set_xticks(list(x), names)
        ax.grid(axis="y", alpha=0.3)
    return fig


class TraceView(FigureView):
    """Bytes alive after each op of one step, for a chosen k, over the plain step's (k = 1)."""

    def __init__(self, points: Sequence[SegmentPoint]):
        from matplotlib.figure import Figure

        self.points = {p.segments: p for p in points}
        if 1 not in self.points:
            raise ValueError("TraceView needs the plain run (segments=1) to draw the others against.")
        self.figure = Figure(figsize=(COLUMN_IN, 3.2), layout="constrained")
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


def trace_widget(points: Sequence[SegmentPoint]) -> ipywidgets.VBox:
    """A slider over the measured segment counts, drawing that step's memory trace."""
    import ipywidgets as widgets

    view = TraceView(points)
    slider = widgets.SelectionSlider(options=sorted(view.points), value=view.segments, description="segments")
    return figure_widget({"slider": slider}, view.show, view.figure, max_width="760px", view=view)


# --------------------------------------------------------------------------- #
# Problems (part 6 of lesson 05): each measures a quantity and computes the lesson's formula apart
# --------------------------------------------------------------------------- #
def _batch(batch: int, width: int) -> torch.Tensor:
    return torch.randn(batch, width, generator=torch.Generator().manual_seed(0))   # leaves the global RNG alone


def problem_held_after_forward(n_layers: int = 10, segments: int = 3, width: int = 256,
                               batch: int = 64) -> Answer:
    """KiB that ``mlp_layers(n_layers)`` holds when a forward in ``segments`` segments returns (HeldBytes)."""
    after = _memory_pass(mlp_layers(n_layers, width), segments, _batch(batch, width))[0]
    m = n_layers // segments                          # the last segment is a shortest one
    return Answer(measured=after / 1024, formula=(segments - 1 + m) * batch * width * 4 / 1024, unit="KiB",
                  rtol=0.0, why="storages are counted to the byte, and every one is a whole (B, width) tensor")


def problem_best_segments(n_layers: int = 16, ratio: int = 3, width: int = 64, batch: int = 256) -> Answer:
    """The k dividing n whose step has the lowest measured peak, for ``wide_layers``, against the formula's."""
    layers, x = wide_layers(n_layers, width, ratio), _batch(batch, width)
    ks = [k for k in range(1, n_layers + 1) if n_layers % k == 0]
    peak = {k: _memory_pass(layers, k, x)[1] for k in ks}
    boundary, layer = 1, 1 + ratio                   # units of B·width fp32: a segment input, one layer
    model = {k: (k - 1) * boundary + (n_layers // k) * layer for k in ks}
    return Answer(measured=min(peak, key=peak.get), formula=min(model, key=model.get), unit="segments",
                  rtol=0.0, why="a choice among whole numbers; backward adds the same gradients in flight "
                  "to the peak at every k, so they move no minimum")


def problem_selective_flops(config: GPTConfig = RECOMPUTE_GPT, batch: int = 4) -> Answer:
    """Extra FLOPs of a training step with selective recomputation, counted by ``FlopCounterMode``."""
    from torch.utils.flop_counter import FlopCounterMode

    idx, targets = token_batch(config, batch)
    total = {}
    for policy in ("none", "selective"):
        model = _gpt(config, policy, seed=0)
        with FlopCounterMode(display=False) as counter:
            lm_loss(model(idx), targets).backward()
        total[policy] = counter.get_total_flops()
    s, h = idx.shape[1], config.d_model
    return Answer(measured=total["selective"] - total["none"], formula=config.n_layer * 4 * batch * s * s * h,
                  unit="FLOP", rtol=0.0, why="FlopCounterMode counts 2·m·n·k per matmul, exactly as the "
                  "formula does; neither counts the softmax or the mask")


def problem_save_on_cpu_bytes(n_layers: int = 6, width: int = 128, batch: int = 32) -> Answer:
    """KiB that save_on_cpu's pack hook is handed in one forward of ``mlp_layers`` (on a GPU: copied to the host)."""
    packed = measure_save_on_cpu(n_layers, width, batch).packed
    unit, weight = batch * width * 4, width * width * 4
    # The first Linear saves x only (x needs no gradient, so its weight is not saved); every other
    # Linear saves its input and its weight, and every ReLU its output: one storage, saved twice.
    formula = (1 + 2 * (n_layers - 1)) * unit + (n_layers - 1) * weight
    return Answer(measured=packed / 1024, formula=formula / 1024, unit="KiB", rtol=0.0,
                  why="every save passes through the hook once and is counted to the byte")
