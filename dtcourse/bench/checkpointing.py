"""Benchmark: what activation checkpointing keeps and what it costs, measured beside its models.

    python -m dtcourse.bench.checkpointing                 # segment sweep and GPT policies
    python -m dtcourse.bench.checkpointing --quick         # fewer repeats (too few to quote)
    python -m dtcourse.bench.checkpointing --out bench-results/checkpointing.png

**Memory** is measured by ``HeldBytes``, a ``TorchDispatchMode`` that sees every op, notes
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
"""

from __future__ import annotations

import argparse
import io
import math
import os
import statistics
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dtcourse.checkpointing import (apply_full_recomputation, apply_selective_recomputation,
                                    checkpoint_sequential, segment_bounds)
from dtcourse.memory import gpt_layer_activation_bytes
from dtcourse.models import GPT, MLP, GPTConfig, lm_loss, token_batch

if TYPE_CHECKING:
    import ipywidgets
    from matplotlib.figure import Figure

__all__ = ["HeldBytes", "mlp_layers", "SegmentPoint", "predicted_segment_units", "measure_segments",
           "PolicyPoint", "POLICIES", "RECOMPUTE_GPT", "predicted_policy_bytes", "recompute_flops",
           "measure_policies", "plot_segments", "plot_policies", "TraceView", "trace_widget", "main"]

POLICIES = ("none", "selective", "full")
# a·s/h = 8 (GPT-3's is 16): the scores are a third of what a layer keeps.
RECOMPUTE_GPT = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=8, d_model=128)


class HeldBytes(TorchDispatchMode):
    """Within ``with HeldBytes() as held:``, the bytes of the storages that ops allocated and that are alive.

    ``held.now`` is the current total, ``held.peak`` its largest value, ``held.trace`` the
    total after every op, in order, and ``held.mark()`` the trace's length so far (to find
    the end of the forward in it later).
    """

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self.trace: list[int] = []
        self._live: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            # A view or an in-place op returns an input's storage: nothing new was allocated.
            if storage.data_ptr() in inputs or id(storage) in self._live or storage.nbytes() == 0:
                continue
            self._live[id(storage)] = weakref.ref(storage, self._on_free(id(storage), storage.nbytes()))
            self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        self.trace.append(self.now)
        return out

    def _on_free(self, key: int, nbytes: int) -> Callable[[Any], None]:
        def freed(_: Any) -> None:
            self._live.pop(key, None)
            self.now -= nbytes
        return freed

    def mark(self) -> int:
        return len(self.trace)


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


class TraceView:
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

    def png(self) -> bytes:
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png", dpi=90)
        return buffer.getvalue()


def trace_widget(points: Sequence[SegmentPoint]) -> ipywidgets.VBox:
    """A slider over the measured segment counts, drawing that step's memory trace."""
    import ipywidgets as widgets

    view = TraceView(points)
    slider = widgets.SelectionSlider(options=sorted(view.points), value=view.segments, description="segments")
    image = widgets.Image(value=view.png(), format="png", layout=widgets.Layout(max_width="760px"))

    def redraw(change: dict) -> None:
        view.show(change["new"])
        image.value = view.png()

    slider.observe(redraw, names="value")
    box = widgets.VBox([slider, image])
    box.view, box.slider, box.image = view, slider, image          # handles for tests and the curious
    return box


# --------------------------------------------------------------------------- #
# The script
# --------------------------------------------------------------------------- #
def _torch_step_ms(n_layers: int, width: int, batch: int, ks: Sequence[int],
                   repeats: int) -> dict[int, float]:
    """torch.utils.checkpoint.checkpoint_sequential (non-reentrant) on the same stack: the reference."""
    from torch.utils.checkpoint import checkpoint_sequential as torch_sequential

    layers, x = mlp_layers(n_layers, width), torch.randn(batch, width)
    times: dict[int, list[float]] = {k: [] for k in ks}
    for round_ in range(repeats + 1):
        for k in ks:
            start = time.perf_counter()
            torch_sequential(layers, k, x, use_reentrant=False).sum().backward()
            if round_:
                times[k].append(time.perf_counter() - start)
    return {k: _median_ms(t) for k, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="3 repeats: a smoke test, too few to quote")
    parser.add_argument("--out", help="save the segment figure here, the policy one as *_policies.png")
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else args.repeats
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    points = measure_segments(args.layers, args.width, args.batch, repeats=repeats)
    divisors = [p.segments for p in points if args.layers % p.segments == 0]
    reference = _torch_step_ms(args.layers, args.width, args.batch, divisors, repeats)
    predicted = predicted_step_ms(points)
    print(f"\nSegment sweep: {args.layers} layers of Linear({args.width}) + ReLU, batch {args.batch}; "
          f"unit = {points[0].unit / 1024:g} KiB; torch = torch.utils.checkpoint.checkpoint_sequential "
          "(timed where k divides n, where both cut the same segments)")
    head = (f"{'k':>3}{'held KiB':>10}{'predicted':>10}{'peak KiB':>10}{'recomputed':>11}{'step ms':>9}"
            f"{'predicted':>10}{'torch ms':>9}{'vs torch':>9}")
    print(head + "\n" + "-" * len(head))
    for p in points:
        ref = reference.get(p.segments)
        tail = f"{ref:>9.2f}{p.step_ms / ref:>8.2f}x" if ref else ""
        print(f"{p.segments:>3}{p.held_after_forward / 1024:>10,.0f}{p.predicted_held / 1024:>10,.0f}"
              f"{p.peak / 1024:>10,.0f}{p.recomputed_layers:>11}{p.step_ms:>9.2f}"
              f"{predicted[p.segments]:>10.2f}{tail}")
    policies = measure_policies(repeats=repeats)
    c = RECOMPUTE_GPT
    print(f"\nRecomputation policies: GPT n_layer={c.n_layer}, d_model={c.d_model}, n_head={c.n_head}, "
          f"seq {c.block_size}, batch 4")
    head = (f"{'policy':<10}{'held MiB':>10}{'predicted':>10}{'peak MiB':>10}{'step ms':>9}{'vs none':>9}"
            f"{'FLOPs':>8}")
    print(head + "\n" + "-" * len(head))
    plain = policies[0].step_ms
    for p in policies:
        print(f"{p.policy:<10}{p.held_after_forward / 2**20:>10.2f}{p.predicted_held / 2**20:>10.2f}"
              f"{p.peak / 2**20:>10.2f}{p.step_ms:>9.1f}{p.step_ms / plain - 1:>+9.0%}"
              f"{p.predicted_overhead:>+8.0%}")
    if args.out:
        policies_out = os.path.splitext(args.out)[0] + "_policies.png"
        plot_segments(points).savefig(args.out, dpi=100)
        plot_policies(policies).savefig(policies_out, dpi=100)
        print(f"\nsaved {args.out} and {policies_out}")

if __name__ == "__main__":
    main()
