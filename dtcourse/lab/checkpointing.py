"""What lesson 05 runs and draws: what activation checkpointing keeps and what it costs, beside its models.

Each measurement comes with the prediction it is checked against, and a figure that draws both;
``python -m dtcourse.bench.checkpointing`` prints them as tables. ``plot_segments`` puts the
segment sweep's held bytes and step times beside Chen et al.'s predictions, ``plot_policies``
the recomputation policies' beside Korthikanti et al.'s, and ``trace_widget`` steps through the
bytes alive after every op of one training step::

    from dtcourse.lab import checkpointing as lab
    points = lab.measure_segments(n_layers=16)   # one SegmentPoint per segment count k
    lab.trace_widget(points)                     # a slider over k, the memory trace below it

**Memory** is measured by ``memory.HeldBytes``, a ``TorchDispatchMode`` that sees every op, notes
each storage an op allocates, and notes again, through a weak reference, when that storage
is freed. ``memory.SavedTensors`` counts what autograd saves, but a checkpoint hides its
region from it by design (it pushes its own saved-tensor hooks) and holds its inputs itself;
only a count of live storages sees everything a checkpointed step holds, the tensors
recomputed during backward included. Storages that existed before (parameters, the batch,
``.grad`` buffers allocated beforehand) are not counted.

**Segment sweep** (Chen et al. 2016, arXiv 1604.06174): a stack of n equal layers
(Linear + ReLU, from ``models.MLP``) under ``checkpoint_sequential`` with k segments. Each
layer keeps one (B, width) tensor, so after the forward the stack holds the k - 1 inputs of
the checkpointed segments plus the m layers of the last one: k - 1 + m units, m = n // k,
least near k = sqrt(n). Backward re-runs the n - m layers of the checkpointed segments:
step(k) ≈ step(1) + forward(1)·(n - m)/n, at most one extra forward pass.

**Recomputation policies** (Korthikanti et al. 2022, arXiv 2205.05198) for the layers of a
``models.GPT``: none, selective (attention core only) and full (every layer). Per layer, in
fp32 with dropout 0, with L = ``memory.gpt_layer_activation_bytes`` = 4(16sbh + as²b + 4sb):

* none keeps L;
* selective keeps L - 4as²b: the scores go, and the (B, T, 3C) projection that the core
  starts from takes the place of the copies of q, k and v that the matmuls kept;
* full keeps 4sbh, the layer's input.

Times are medians over interleaved repeats: every variant runs once per round, so a burst of
load from elsewhere lands on all of them alike. They are printed and drawn, never asserted.
Figures are built with ``matplotlib.figure.Figure`` (no pyplot), so they draw headlessly and a
notebook shows each one once.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn as nn

from dtcourse.checkpointing import (apply_full_recomputation, apply_selective_recomputation,
                                    checkpoint_sequential, segment_bounds)
from dtcourse.lab.widgets import FigureView, figure_widget
from dtcourse.memory import HeldBytes, gpt_layer_activation_bytes
from dtcourse.models import GPT, MLP, RECOMPUTE_GPT, GPTConfig, lm_loss, token_batch

if TYPE_CHECKING:
    import ipywidgets
    from matplotlib.figure import Figure

__all__ = ["mlp_layers", "SegmentPoint", "predicted_segment_units", "measure_segments",
           "predicted_step_ms", "PolicyPoint", "POLICIES", "RECOMPUTE_GPT", "predicted_policy_bytes",
           "recompute_flops", "measure_policies", "plot_segments", "plot_policies", "TraceView", "trace_widget"]

POLICIES = ("none", "selective", "full")


def _zero_grads(model: nn.Module) -> None:
    # Allocated before measuring, so backward accumulates into them in place: the
    # gradients (the same for every variant) stay out of the activation counts.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


# --------------------------------------------------------------------------- #
# Segment sweep
# --------------------------------------------------------------------------- #
def mlp_layers(n_layers: int, width: int, seed: int = 0) -> nn.Sequential:
    """``models.MLP((width,) * (n_layers + 1))`` regrouped as n layers: (Linear, ReLU), ..., Linear."""
    net = MLP((width,) * (n_layers + 1), seed=seed).net
    return nn.Sequential(*(nn.Sequential(net[i], net[i + 1]) for i in range(0, len(net) - 1, 2)), net[-1])


def predicted_segment_units(n_layers: int, segments: int) -> int:
    """Layer outputs held after the forward: k - 1 checkpointed segments' inputs + the last segment's m."""
    start, end = segment_bounds(n_layers, segments)[-1]
    return segments - 1 + (end - start)


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
    _zero_grads(layers)
    calls = [0]
    count = lambda *_: calls.__setitem__(0, calls[0] + 1)          # noqa: E731
    hooks = [layer.register_forward_pre_hook(count) for layer in layers]
    memory = {}
    try:
        for k in ks:
            calls[0] = 0
            with HeldBytes() as held:
                y = checkpoint_sequential(layers, k, x)
                after, forward_ops = held.now, held.mark()
                y.sum().backward()
                del y
            memory[k] = (after, held.peak, calls[0] - n_layers, tuple(held.trace), forward_ops)
    finally:
        for hook in hooks:
            hook.remove()
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


def _median_ms(seconds: Sequence[float]) -> float:
    return 1e3 * statistics.median(seconds)


def predicted_step_ms(points: Sequence[SegmentPoint]) -> dict[int, float]:
    """Chen et al.'s cost: the plain step (k = 1) plus the forward of every recomputed layer."""
    plain = next(p for p in points if p.segments == 1)
    return {p.segments: plain.step_ms + plain.forward_ms * p.recomputed_layers / p.n_layers for p in points}


# --------------------------------------------------------------------------- #
# Recomputation policies for a GPT
# --------------------------------------------------------------------------- #
def predicted_policy_bytes(config: GPTConfig, batch: int, seq_len: int, policy: str) -> int:
    """Bytes the GPT's layers hold after the forward under ``policy`` (fp32, dropout 0); see the docstring."""
    s, b, h, a = seq_len, batch, config.d_model, config.n_head
    layer = gpt_layer_activation_bytes(config, b, s)
    per_layer = {"none": layer, "selective": layer - 4 * a * s * s * b, "full": 4 * s * b * h}
    if policy not in per_layer:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}.")
    return config.n_layer * per_layer[policy]


def recompute_flops(config: GPTConfig, batch: int, seq_len: int, policy: str) -> tuple[int, int]:
    """(FLOPs recomputed in backward, FLOPs of a plain training step), counting matmuls at 2 per multiply-add.

    A layer's forward is 24bsh² (the four linear layers) + 4bs²h (q·kᵀ and the product with v);
    the LM head adds 2bshV; a step is three forwards' worth (backward is two).
    """
    s, b, h, n = seq_len, batch, config.d_model, config.n_layer
    layer = 24 * b * s * h * h + 4 * b * s * s * h
    step = 3 * (n * layer + 2 * b * s * h * config.vocab_size)
    extra = {"none": 0, "selective": n * 4 * b * s * s * h, "full": n * layer}
    if policy not in extra:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}.")
    return extra[policy], step


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


# --------------------------------------------------------------------------- #
# Figures
# --------------------------------------------------------------------------- #
def plot_segments(points: Sequence[SegmentPoint]) -> Figure:
    """Left: bytes held after the forward (measured, predicted) and the peak, against k. Right: step time."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    ks = [p.segments for p in points]
    kib = 1024
    left.plot(ks, [p.predicted_held / kib for p in points], "-", color="tab:orange",
              label="predicted: (k - 1 + n//k) layer outputs")
    left.plot(ks, [p.held_after_forward / kib for p in points], "o", color="tab:blue",
              label="measured after forward")
    left.plot(ks, [p.peak / kib for p in points], "s", color="tab:red", markersize=4,
              label="measured peak (forward + backward)")
    left.set_ylabel("KiB of activations")
    left.set_ylim(bottom=0)
    left.legend(fontsize=7)
    left.set_title("what the stack holds", fontsize=10)
    predicted = predicted_step_ms(points)
    right.plot(ks, [predicted[k] for k in ks], "-", color="tab:orange",
               label="predicted: step(1) + forward(1)·recomputed/n")
    right.plot(ks, [p.step_ms for p in points], "o", color="tab:blue", label="measured (median)")
    right.set_ylabel("ms per step (forward + backward)")
    right.set_ylim(bottom=0)
    right.legend(fontsize=7)
    right.set_title("what it costs", fontsize=10)
    n = points[0].n_layers
    for ax in (left, right):
        ax.axvline(math.sqrt(n), color="gray", linestyle=":", linewidth=1)
        ax.set_xlabel(f"segments k (n = {n} layers; dotted: k = √n)")
        ax.grid(alpha=0.3)
    return fig


def plot_policies(points: Sequence[PolicyPoint]) -> Figure:
    """Bars per policy: bytes the layers hold (measured beside predicted), and step time (measured)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.4), layout="constrained")
    left, right = fig.subplots(1, 2)
    names = [p.policy for p in points]
    x = range(len(points))
    left.bar([i - 0.2 for i in x], [p.held_after_forward / 2**20 for p in points], 0.4, label="measured")
    left.bar([i + 0.2 for i in x], [p.predicted_held / 2**20 for p in points], 0.4, label="predicted")
    left.set_ylabel("MiB held by the layers after forward")
    left.legend(fontsize=7)
    plain = next((p.step_ms for p in points if p.policy == "none"), None)
    bars = right.bar(list(x), [p.step_ms for p in points], 0.5, color="tab:green")
    for bar, p in zip(bars, points):
        measured = f"{p.step_ms / plain - 1:+.0%} measured\n" if plain else ""
        right.annotate(f"{measured}{p.predicted_overhead:+.0%} FLOPs", (bar.get_x() + bar.get_width() / 2,
                       bar.get_height()), ha="center", va="bottom", fontsize=7)
    right.set_ylabel("ms per training step (median)")
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
        self.figure = Figure(figsize=(8, 3.2), layout="constrained")
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
