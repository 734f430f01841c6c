"""Lesson 04's measurements and pictures: number formats, gradients against fp16's range, lost updates,
the training recipes side by side, and the lesson's problems.

Everything is computed from real tensors: ``torch.finfo`` for the formats, a real backward
of the course's GPT for the gradients, real fp16 rounding for what survives, ``train`` (one of
the ``RECIPES``, run by ``dtcourse.mixed_precision.Trainer``) for the loss curves, the bytes a
recipe's step really holds (``recipe_memory``) and the bytes a ring all-reduce of its gradients
really sends (``allreduce_bytes``)::

    from dtcourse.lab.mixed_precision import loss_scale_widget
    loss_scale_widget()            # a slider over log2(loss scale), with the histogram below it

Figures are built with ``matplotlib.figure.Figure`` (no pyplot), so they draw headlessly and
a notebook shows each one once; each fits the notebook column (``widgets.COLUMN_IN``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from dtcourse.collectives import ByteCounter, ring_all_reduce
from dtcourse.lab.problems import Answer
from dtcourse.lab.widgets import COLUMN_IN, FigureView, figure_widget
from dtcourse.memory import SavedTensors, storage_bytes
from dtcourse.mixed_precision import DynamicLossScaler, Recipe, Trainer
from dtcourse.mixed_precision_cost import MIXED_ADAM_BYTES_PER_PARAMETER, ring_all_reduce_bytes
from dtcourse.models import CURVE_GPT, GPT, GPTConfig, lm_loss, token_batch
from dtcourse.runtime import launch

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Recipe", "RECIPES", "TrainingRun", "train", "train_side_by_side", "LOSS_FACTOR", "CURVE_BATCH",
           "FORMATS", "NumberFormat", "number_formats", "plot_number_formats", "gradient_sample", "Fractions",
           "fp16_fractions", "scale_window", "LossScaleView", "loss_scale_widget", "scaler_trace", "lost_updates",
           "update_underflow", "plot_update_underflow", "loss_curves", "plot_loss_curves", "SAVED_KINDS",
           "RecipeMemory", "recipe_memory", "plot_recipe_memory", "allreduce_bytes", "problem_largest_scale",
           "problem_smallest_gradient", "problem_model_state_bytes", "problem_allreduce_bytes"]

FP16 = torch.finfo(torch.float16)

# --------------------------------------------------------------------------- #
# Training recipes, for the loss curves
# --------------------------------------------------------------------------- #
RECIPES = {
    "fp32": Recipe(),
    "fp16 copy, no loss scaling": Recipe(torch.float16),
    "fp16 copy, our dynamic scaler": Recipe(torch.float16, scaler=DynamicLossScaler),
    "fp16 autocast, GradScaler": Recipe(torch.float16, autocast=True, scaler=partial(torch.amp.GradScaler, "cpu")),
    "bf16 autocast": Recipe(torch.bfloat16, autocast=True),
}
# The loss curves' setting: batches of 16 x 32 tokens, and each loss multiplied by 2^-9 before
# backward, as one micro-batch's loss is divided by k = 512 under 512-way gradient accumulation.
CURVE_BATCH = 16
LOSS_FACTOR = 2.0 ** -9


@dataclass
class TrainingRun:
    """One recipe's training: the loss and the loss scale of every step, and the skipped steps."""

    name: str
    losses: list[float] = field(default_factory=list)    # unscaled, in fp32, also on skipped steps
    scales: list[float] = field(default_factory=list)    # the scale each step's loss was multiplied by
    skipped: list[int] = field(default_factory=list)     # steps whose update was skipped (inf/NaN)
    params: list[torch.Tensor] = field(default_factory=list)   # the fp32 weights (masters) at the end


def train(recipe: Recipe | str, steps: int = 60, *, config: GPTConfig = CURVE_GPT, batch_size: int = CURVE_BATCH,
          lr: float = 3e-3, loss_factor: float = 1.0, seed: int = 0,
          device: str | torch.device = "cpu") -> TrainingRun:
    """Train ``GPT(config, seed)`` with Adam for ``steps`` steps under ``recipe`` (or a name in RECIPES).

    Each step draws a fresh ``token_batch``; its fp32 loss is multiplied by ``loss_factor``
    before backward. A factor 1/k is what each micro-batch's loss gets under k-way gradient
    accumulation: every gradient of the backward comes out k times smaller (Adam, which divides
    each update by the gradient's running RMS, hardly notices; fp16 does).
    """
    name = recipe if isinstance(recipe, str) else repr(recipe)
    recipe = RECIPES[recipe] if isinstance(recipe, str) else recipe
    trainer = Trainer(GPT(config, seed=seed).to(device), recipe, lm_loss, partial(torch.optim.Adam, lr=lr))
    run = TrainingRun(name)
    for step in range(steps):
        x, y = (t.to(device) for t in token_batch(config, batch_size, seed=seed * 1_000_003 + step))
        loss = trainer.forward(x, y)
        run.losses.append(loss.item())
        run.scales.append(trainer.scale())
        trainer.backward(loss * loss_factor)
        if not trainer.step():
            run.skipped.append(step)
    run.params = [p.detach().clone() for p in trainer.optimizer.param_groups[0]["params"]]
    return run


# --------------------------------------------------------------------------- #
# Number formats
# --------------------------------------------------------------------------- #
FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class NumberFormat:
    """A floating-point format as ``torch.finfo`` describes it."""

    name: str
    bits: int
    exponent_bits: int
    mantissa_bits: int          # stored fraction bits; precision is one more (the implicit 1)
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float                  # the gap between 1 and the next number: relative precision


def number_formats() -> dict[str, NumberFormat]:
    """fp32, bf16 and fp16, read from ``torch.finfo``."""
    formats = {}
    for name, dtype in FORMATS.items():
        info = torch.finfo(dtype)
        mantissa = -int(math.log2(info.eps))
        # finfo has no smallest subnormal: it is the smallest normal's exponent with only the
        # last mantissa bit set, smallest_normal * eps (2^-14 * 2^-10 = 2^-24 for fp16).
        formats[name] = NumberFormat(name, info.bits, info.bits - 1 - mantissa, mantissa, info.max,
                                     info.smallest_normal, info.smallest_normal * info.eps, info.eps)
    return formats


def plot_number_formats() -> Figure:
    """Each format's range on one log2 axis: subnormals light, normal numbers dark; eps in the labels."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(COLUMN_IN, 2.8), layout="constrained")
    ax = fig.subplots()
    formats = list(number_formats().values())
    for row, f in enumerate(formats):
        low, normal, high = (math.log2(v) for v in (f.smallest_subnormal, f.smallest_normal, f.max))
        ax.barh(row, normal - low, left=low, height=0.5, color=f"C{row}", alpha=0.35)
        ax.barh(row, high - normal, left=normal, height=0.5, color=f"C{row}")
        ax.text(high + 2, row, f"max {f.max:.5g}" if f.max < 1e6 else f"max {f.max:.3g}", va="center", fontsize=8)
        ax.text(low - 2, row, f"{f.smallest_subnormal:.2g}", va="center", ha="right", fontsize=8)
        ax.text(normal, row + 0.3, f"{f.smallest_normal:.2g}", va="bottom", ha="center", fontsize=8)
    ax.set_yticks(range(len(formats)), [f"{f.name}: {f.exponent_bits} exp, {f.mantissa_bits} mant.\n"
                                        f"eps = 2^{math.log2(f.eps):g}" for f in formats], fontsize=8)
    ax.set_xlim(-200, 175)
    ax.set_ylim(-0.5, len(formats) - 0.2)
    ax.set_xlabel("log2 |x|")
    ax.axvline(0, color="0.5", lw=0.5)
    ax.set_title("Range of each format (torch.finfo): subnormals light, normal numbers dark", fontsize=9)
    return fig


# --------------------------------------------------------------------------- #
# Gradients against fp16's range, and the loss-scale widget
# --------------------------------------------------------------------------- #
def gradient_sample(config: GPTConfig = CURVE_GPT, batch_size: int = CURVE_BATCH,
                    loss_factor: float = LOSS_FACTOR, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every nonzero gradient of one fp32 backward of ``GPT(config)``: ``{"activation": ..., "weight": ...}``.

    Activation gradients are those of every submodule's output (what backward passes from
    layer to layer); weight gradients are the parameters' ``.grad``. The loss is multiplied by
    ``loss_factor`` as in ``train``.
    """
    model = GPT(config, seed=seed)
    caught: list[torch.Tensor] = []

    def catch(module: nn.Module, inputs, output) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda g: caught.append(g.detach().flatten()))

    handles = [m.register_forward_hook(catch) for m in model.modules() if m is not model]
    x, y = token_batch(config, batch_size, seed=seed)
    (lm_loss(model(x), y) * loss_factor).backward()
    for handle in handles:
        handle.remove()
    grads = {"activation": torch.cat(caught),
             "weight": torch.cat([p.grad.flatten() for p in model.parameters()])}
    return {kind: g[g != 0] for kind, g in grads.items()}


@dataclass(frozen=True)
class Fractions:
    """What becomes of values ``x * scale`` when they are rounded to fp16."""

    zero: float         # flushed to 0: lost entirely
    subnormal: float    # below 2^-14: kept with fewer than 11 significant bits
    overflow: float     # above 65504: inf, and the step must be skipped


def fp16_fractions(values: torch.Tensor, scale: float) -> Fractions:
    """Round ``values * scale`` (nonzero fp32) to fp16 for real and count what happened."""
    rounded = (values.float() * scale).to(torch.float16)    # as a kernel computing in fp32 would
    n = values.numel()
    return Fractions(zero=(rounded == 0).sum().item() / n,
                     subnormal=((rounded != 0) & (rounded.abs() < FP16.smallest_normal)).sum().item() / n,
                     overflow=rounded.isinf().sum().item() / n)


def scale_window(grads: Mapping[str, torch.Tensor], lost: float = 1e-3, kind: str = "activation") -> tuple[int, int]:
    """(lowest, highest) k such that S = 2^k rounds at most ``lost`` of ``grads[kind]`` to 0, and nothing to inf.

    Both ends are found by rounding the scaled gradients to fp16 for real, k = 0, 1, 2, ...
    """
    lowest = next(k for k in range(0, 64) if fp16_fractions(grads[kind], 2.0 ** k).zero <= lost)
    values = torch.cat([g.flatten() for g in grads.values()])
    largest = values.abs().topk(min(1024, values.numel())).values     # if none of these overflows, none does
    highest = next(k for k in range(lowest, 128) if fp16_fractions(largest, 2.0 ** (k + 1)).overflow > 0)
    return lowest, highest


class LossScaleView(FigureView):
    """Histograms of log2|g * S| for each kind of gradient, over fp16's zones; ``show(k)`` sets S = 2^k."""

    BINS = torch.arange(-64.0, 40.5, 0.5)          # log2 |value|, half an octave per bin

    def __init__(self, grads: Mapping[str, torch.Tensor]):
        from matplotlib.figure import Figure

        self.grads = dict(grads)
        self.log2 = {kind: g.abs().double().log2() for kind, g in self.grads.items()}
        self.figure = Figure(figsize=(COLUMN_IN, 4.0), layout="constrained")
        # the histogram above, the counts below it: no peak can draw over the text
        self.ax, text_ax = self.figure.subplots(2, 1, height_ratios=(4, 1))
        text_ax.axis("off")
        zones = ((-64, -25, "tab:red", "flushes to 0"),
                 (-25, math.log2(FP16.smallest_normal), "tab:orange", "subnormal"),
                 (math.log2(FP16.smallest_normal), math.log2(FP16.max), "tab:green", "normal fp16"),
                 (math.log2(FP16.max), 40, "tab:red", "inf"))
        for lo, hi, colour, label in zones:
            self.ax.axvspan(lo, hi, color=colour, alpha=0.12, lw=0)
            self.ax.text((lo + hi) / 2, 0.97, label, transform=self.ax.get_xaxis_transform(), ha="center",
                         va="top", fontsize=8, color=colour)
        self.stairs = {kind: self.ax.stairs(torch.zeros(len(self.BINS) - 1).numpy(), self.BINS.numpy(),
                                            label=f"{kind} gradients ({g.numel():,})", lw=1.5)
                       for kind, g in self.grads.items()}
        self.ax.set_xlim(-64, 40)
        self.ax.set_xlabel("log2 |gradient x loss scale|")
        self.ax.set_ylabel("fraction per bin")
        self.ax.legend(loc="center left", fontsize=8)
        self.note = text_ax.text(0.0, 1.0, "", transform=text_ax.transAxes, va="top", fontsize=8,
                                 family="monospace")
        self.log2_scale = 0
        self.fractions: dict[str, Fractions] = {}
        self.show(0)

    def show(self, log2_scale: int) -> None:
        """Redraw for the loss scale S = 2^log2_scale."""
        self.log2_scale = log2_scale
        top = 0.0
        for kind, values in self.log2.items():
            counts = torch.histogram(values + log2_scale, self.BINS.double()).hist / values.numel()
            self.stairs[kind].set_data(counts.numpy())
            top = max(top, counts.max().item())
            self.fractions[kind] = fp16_fractions(self.grads[kind], 2.0 ** log2_scale)
        self.ax.set_ylim(0, 1.25 * top)               # headroom for the zone labels
        self.note.set_text("rounded to fp16, counted:\n" + "\n".join(
            f"{kind:<10} gradients: zero {f.zero:6.1%}   subnormal {f.subnormal:6.1%}   inf {f.overflow:6.1%}"
            for kind, f in self.fractions.items()))
        self.ax.set_title(f"Gradients x loss scale S = 2^{log2_scale} = {2.0 ** log2_scale:,.0f}", fontsize=10)


def loss_scale_widget(grads: Mapping[str, torch.Tensor] | None = None, max_log2_scale: int = 40):
    """A slider over log2 of the loss scale, with a ``LossScaleView`` of ``grads`` (or ``gradient_sample()``)."""
    import ipywidgets as widgets

    view = LossScaleView(gradient_sample() if grads is None else grads)
    slider = widgets.IntSlider(value=0, min=0, max=max_log2_scale, description="log2 S")
    return figure_widget({"slider": slider}, view.show, view.figure, view=view)


# --------------------------------------------------------------------------- #
# A loss scaler's decisions, step by step
# --------------------------------------------------------------------------- #
def scaler_trace(scaler, steps: int = 12, planted: Mapping[int, float] | None = None):
    """Train a small MLP with SGD under ``scaler``, planting ``planted[step]`` in one gradient.

    Works with any object with GradScaler's methods (ours or ``torch.amp.GradScaler``).
    Returns ``([(scale after update(), step skipped), ...], final parameters)``.
    """
    import torch.nn.functional as F
    from dtcourse.models import MLP, regression_batch

    planted = {3: math.inf, 4: math.nan, 9: math.inf} if planted is None else planted
    model = MLP((4, 8, 3), seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    trace = []
    for step in range(steps):
        x, y = regression_batch(8, 4, 3, seed=step)
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if step in planted:
            model.net[0].weight.grad[0, 0] = planted[step]    # an overflow, as a too-large scale makes
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        skipped = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        trace.append((scaler.get_scale(), skipped))
    return trace, [p.detach() for p in model.parameters()]


# --------------------------------------------------------------------------- #
# Updates too small for fp16 weights
# --------------------------------------------------------------------------- #
def lost_updates(weights: torch.Tensor, updates: torch.Tensor,
                 dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """True where a nonzero update, added to the weight held in ``dtype``, leaves it unchanged."""
    w = weights.to(dtype)
    return (updates != 0) & ((w.float() + updates).to(dtype) == w)


def update_underflow(weight: float = 1.0, update: float = 1e-4, steps: int = 1000) -> dict[str, list[float]]:
    """Add ``update`` to ``weight`` ``steps`` times, in an fp16 weight and in an fp32 master (also rounded)."""
    w16 = torch.tensor(weight, dtype=torch.float16)
    master = torch.tensor(weight, dtype=torch.float32)
    history: dict[str, list[float]] = {"fp16 weight": [], "fp32 master": [], "fp16 copy of the master": []}
    for _ in range(steps):
        w16 = w16 + update                      # rounds to fp16 after every step
        master = master + update
        history["fp16 weight"].append(w16.item())
        history["fp32 master"].append(master.item())
        history["fp16 copy of the master"].append(master.to(torch.float16).item())
    return history


def plot_update_underflow(history: Mapping[str, list[float]], weight: float = 1.0,
                          update: float = 1e-4) -> Figure:
    """The weight after each step of ``update_underflow``'s three versions, with fp16's spacing in the title."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.subplots()
    for (name, values), style in zip(history.items(), ("-", "--", ":")):
        ax.plot(range(1, len(values) + 1), values, style, label=name, lw=2 if style == "-" else 1.5)
    w = torch.tensor(weight, dtype=torch.float16)
    ulp = (torch.nextafter(w, torch.tensor(math.inf, dtype=torch.float16)) - w).item()   # 2^-10 at 1.0
    ax.set(xlabel="step", ylabel="weight",
           title=f"{weight:g} + {update:g} per step; fp16's spacing near {weight:g} is {ulp:.2g}")
    ax.legend(fontsize=8)
    return fig


# --------------------------------------------------------------------------- #
# Loss curves
# --------------------------------------------------------------------------- #
def _train_rank(jobs: list[tuple[str, Recipe | str]], steps: int, kwargs: dict) -> TrainingRun:
    name, recipe = jobs[dist.get_rank()]
    run = train(recipe, steps, **kwargs)
    run.name = name
    return run


def train_side_by_side(recipes: Mapping[str, Recipe | str], steps: int = 60, **kwargs) -> dict[str, TrainingRun]:
    """``train(recipe, steps, **kwargs)`` for each entry, each in a process of its own (``dtcourse.launch``).

    The runs do not talk to each other: they are exactly the runs ``train`` makes one by one,
    but on a laptop's cores they finish together, in about the time of the slowest.
    """
    jobs = list(recipes.items())
    runs = launch(_train_rank, len(jobs), jobs, steps, kwargs, backend="gloo", timeout=600)
    return dict(zip(recipes, runs))


def loss_curves(steps: int = 60, names: tuple[str, ...] = tuple(RECIPES), **kwargs) -> dict[str, TrainingRun]:
    """Each recipe of ``names`` trained side by side, at the lesson's batch and loss factor unless told."""
    return train_side_by_side({name: name for name in names}, steps, **{"loss_factor": LOSS_FACTOR, **kwargs})


def _running_mean(values: list[float], smooth: int) -> list[float]:
    kernel = torch.ones(1, 1, smooth) / smooth
    return torch.nn.functional.conv1d(torch.tensor(values).view(1, 1, -1), kernel).flatten().tolist()


def plot_loss_curves(runs: Mapping[str, TrainingRun], smooth: int = 10, *, title: str = "Loss per step",
                     reference: str | None = None, compare: tuple[str, ...] | None = None) -> Figure:
    """Loss per step (running mean over ``smooth`` steps) above; below, one of two panels.

    Without ``reference``: the loss scale of the runs that scaled, skipped steps as red crosses.
    With ``reference`` (a key of ``runs``): each run of ``compare`` (default: all the others)
    minus the reference, step by step, which shows the gaps that the upper panel's overlapping
    curves hide.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(COLUMN_IN, 5.2), layout="constrained")
    loss_ax, low_ax = fig.subplots(2, 1, sharex=True, height_ratios=(2.2, 1))
    styles = [dict(lw=4, alpha=0.4), dict(lw=1.5), dict(lw=1.5, ls="--"), dict(lw=2, ls=":"),
              dict(lw=1.5, ls="-.")]          # the first (the reference) wide and pale, so overlaps show
    style = {name: dict(color=f"C{i}", **styles[i % len(styles)]) for i, name in enumerate(runs)}
    steps = range(smooth - 1, max(len(run.losses) for run in runs.values()))
    for name, run in runs.items():
        loss_ax.plot(steps[:len(run.losses) - smooth + 1], _running_mean(run.losses, smooth), label=name,
                     **style[name])
    loss_ax.axhline(math.log(CURVE_GPT.vocab_size), color="0.6", lw=0.8, ls=":")
    loss_ax.set(ylabel=f"loss (mean of {smooth} steps)", title=f"{title} (dotted: ln 256, a uniform guess)")
    loss_ax.legend(fontsize=8)
    if reference is None:
        for name, run in runs.items():
            if any(s != 1.0 for s in run.scales):
                low_ax.plot([math.log2(s) for s in run.scales], label=name, **style[name])
            if run.skipped:
                low_ax.plot(run.skipped, [math.log2(run.scales[s]) for s in run.skipped], "x", color="tab:red",
                            label=f"{name}: skipped step")
        low_ax.set(ylabel="log2 S", title="Loss scale S before each step; red x: the step was skipped")
    else:
        ref = _running_mean(runs[reference].losses, smooth)
        for name in compare if compare is not None else [n for n in runs if n != reference]:
            diff = [a - b for a, b in zip(_running_mean(runs[name].losses, smooth), ref)]
            low_ax.plot(steps[:len(diff)], diff, label=name, **{**style[name], "lw": 1.5, "alpha": 1.0})
        low_ax.axhline(0.0, color=style[reference]["color"], lw=4, alpha=0.4)
        low_ax.set(ylabel=f"loss - {reference}", title=f"Each curve minus {reference}'s: the gaps the curves hide")
    low_ax.set_xlabel("step")
    if low_ax.lines:
        low_ax.legend(fontsize=8)
    return fig


# --------------------------------------------------------------------------- #
# What each recipe holds in memory
# --------------------------------------------------------------------------- #
SAVED_KINDS = ("fp32 activations", "16-bit activations", "16-bit weight copies", "integers")


def _saved_kind(model: nn.Module) -> Callable[[torch.Tensor], str]:
    """Which of ``SAVED_KINDS`` a saved tensor is: a 16-bit tensor equal to a weight is its autocast copy."""
    weights = [p.detach() for p in model.parameters()]

    def kind(t: torch.Tensor) -> str:
        if not t.is_floating_point():
            return "integers"
        if t.dtype == torch.float32:
            return "fp32 activations"
        whole = t.as_strided((t.untyped_storage().nbytes() // t.itemsize,), (1,), 0)   # the storage, flat
        copy = any(w.numel() == whole.numel() and torch.equal(w.flatten().to(t.dtype), whole) for w in weights)
        return "16-bit weight copies" if copy else "16-bit activations"

    return kind


@dataclass(frozen=True)
class RecipeMemory:
    """Bytes one training step of a recipe holds, counted tensor by tensor."""

    params: int            # how many parameters the model has (Ψ)
    weights: int           # the weights forward reads: params, or the 16-bit copy
    masters: int           # fp32 master weights (copy recipes only)
    grads: int             # every .grad after backward: what a data-parallel all-reduce sends
    optimizer: int         # Adam's m, v and step counts
    saved: dict[str, int]  # what autograd saved for backward, by kind (SAVED_KINDS)

    @property
    def model_states(self) -> int:
        return self.weights + self.masters + self.grads + self.optimizer

    @property
    def activations(self) -> int:
        return sum(self.saved.values())


def recipe_memory(recipe: Recipe | str, config: GPTConfig = GPTConfig(), batch_size: int = 8,
                  seed: int = 0) -> RecipeMemory:
    """One Adam step of ``GPT(config)`` under ``recipe``, run by the same ``Trainer`` as ``train``; its bytes."""
    recipe = RECIPES[recipe] if isinstance(recipe, str) else recipe
    model = GPT(config, seed=seed)
    trainer = Trainer(model, recipe, lm_loss)                    # a copy recipe makes the model 16-bit here
    x, y = token_batch(config, batch_size, seed=seed)
    with SavedTensors(model, classify=_saved_kind(model)) as saved:
        loss = trainer.forward(x, y)
    trainer.backward(loss)
    grads = storage_bytes(p.grad for p in model.parameters())
    trainer.step()
    state = [t for s in trainer.optimizer.state.values() for t in s.values()]
    masters = storage_bytes(trainer.master.parameters()) if trainer.master is not None else 0
    return RecipeMemory(params=sum(p.numel() for p in model.parameters()), weights=storage_bytes(model.parameters()),
                        masters=masters, grads=grads, optimizer=storage_bytes(state), saved={**dict.fromkeys(SAVED_KINDS, 0), **saved.by_kind})


def plot_recipe_memory(memories: Mapping[str, RecipeMemory]) -> Figure:
    """Per recipe: model states in bytes per parameter (left) and saved activations by kind (right).

    The first recipe (fp32, say) is drawn on top; the activation bars are labelled with their
    total and its ratio to the first recipe's.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(COLUMN_IN, 3.6), layout="constrained")
    states_ax, act_ax = fig.subplots(1, 2, sharey=True)
    names = list(memories)
    rows = range(len(names))
    parts = {"weights": "weights", "masters": "fp32 masters", "grads": "gradients", "optimizer": "Adam m, v"}
    left = [0.0] * len(names)
    for (part, label), colour in zip(parts.items(), ("C0", "C1", "C2", "C3")):
        widths = [getattr(m, part) / m.params for m in memories.values()]
        states_ax.barh(rows, widths, left=left, color=colour, label=label)
        left = [a + b for a, b in zip(left, widths)]
    states_ax.axvline(16, color="k", ls="--", lw=1)                 # ZeRO's 2 + 2 + 12 = 4 + 4 + 8
    states_ax.set_yticks(list(rows), [n.replace(" + ", "\n+ ") for n in names], fontsize=8)
    states_ax.invert_yaxis()
    states_ax.set(xlabel="bytes per parameter", title="Model states (dashed: 16 B)")
    states_ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)
    left = [0.0] * len(names)
    for kind, colour in zip(SAVED_KINDS, ("C4", "C5", "C6", "0.6")):
        widths = [m.saved[kind] / 2 ** 20 for m in memories.values()]
        act_ax.barh(rows, widths, left=left, color=colour, label=kind)
        left = [a + b for a, b in zip(left, widths)]
    first = memories[names[0]].activations
    for row, m in zip(rows, memories.values()):
        act_ax.text(m.activations / 2 ** 20, row, f" {m.activations / first:.2f}x", va="center", fontsize=8)
    act_ax.set_xlim(0, 1.25 * max(left))
    act_ax.set(xlabel="MiB", title="Saved for backward, by kind")
    act_ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)
    return fig


# --------------------------------------------------------------------------- #
# What a data-parallel all-reduce of the gradients sends
# --------------------------------------------------------------------------- #
# No return annotation: DDP compares it with Future[Tensor], and under `from __future__ import
# annotations` it would be a string.
def _ring_hook(state: tuple[torch.dtype, ByteCounter], bucket):
    """A DDP communication hook: as torch's ``bf16_compress_hook`` (cast, divide by N, all-reduce,
    cast back), with the course's ring all-reduce, which counts the bytes it sends; returns a done Future.

    ``state`` is ``(wire dtype, ByteCounter)``.
    """
    wire, counter = state
    buffer = bucket.buffer()                                     # fp32: autocast leaves gradients fp32
    on_wire = buffer.to(wire).div_(dist.get_world_size())
    ring_all_reduce(on_wire, counter=counter)                    # sends 2(N-1)/N * on_wire.nbytes
    buffer.copy_(on_wire)
    done = torch.futures.Future()
    done.set_result(buffer)
    return done


def _allreduce_rank(wire: torch.dtype, config: GPTConfig, batch_size: int) -> tuple[int, list[torch.Tensor]]:
    ddp = torch.nn.parallel.DistributedDataParallel(GPT(config, seed=0))
    counter = ByteCounter()
    ddp.register_comm_hook((wire, counter), _ring_hook)
    x, y = token_batch(config, batch_size, seed=dist.get_rank())   # each rank its own batch
    with torch.autocast("cpu", dtype=torch.bfloat16):              # the bf16 autocast recipe
        logits = ddp(x)
    lm_loss(logits.float(), y).backward()
    return counter.sent, [p.grad for p in ddp.parameters()]


def allreduce_bytes(world_size: int = 2, wire: torch.dtype = torch.bfloat16, config: GPTConfig = GPTConfig(),
                    batch_size: int = 4) -> tuple[list[int], list[torch.Tensor]]:
    """Bytes each rank's ring all-reduce sends for one bf16-autocast step of torch DDP, with the
    gradients sent as ``wire`` (float32: as they are; bfloat16: as ``bf16_compress_hook`` sends them).

    Returns the bytes sent by each rank and rank 0's averaged gradients.
    """
    results = launch(_allreduce_rank, world_size, wire, config, batch_size, backend="gloo")
    return [sent for sent, _ in results], results[0][1]


# --------------------------------------------------------------------------- #
# The lesson's problems: each measures, and computes the lesson's formula beside it
# --------------------------------------------------------------------------- #
def problem_largest_scale(grads: Mapping[str, torch.Tensor]) -> Answer:
    """Problem 1: log2 of the largest power-of-two loss scale at which no gradient overflows fp16."""
    values = torch.cat([g.flatten() for g in grads.values()]).float()
    k = 0
    while not (values * 2.0 ** (k + 1)).to(torch.float16).isinf().any():     # real fp16 casts
        k += 1
    formula = math.floor(math.log2(FP16.max / values.abs().max().item()))
    return Answer(measured=k, formula=formula, unit="", rtol=0.0,
                  why="exact: a power-of-two scale changes no significant bit (only a largest value landing "
                      "in [65504, 65520), which rounds down to 65504 instead of up to inf, could differ)")


def problem_smallest_gradient(scale: float = 2.0 ** 16) -> Answer:
    """Problem 2: the smallest positive fp32 gradient g for which g * scale rounded to fp16 is not 0."""
    def survives(bits: int) -> bool:
        g = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
        return bool((g * scale).to(torch.float16) != 0)

    lo, hi = 0, torch.tensor(1.0).view(torch.int32).item()          # fp32 bit patterns: 0.0 and 1.0
    while hi - lo > 1:                                               # positive floats sort as their bits
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if survives(mid) else (mid, hi)
    measured = torch.tensor(hi, dtype=torch.int32).view(torch.float32).item()
    return Answer(measured=measured, formula=number_formats()["fp16"].smallest_subnormal / 2 / scale, unit="",
                  rtol=1e-6, why="the measurement is the first fp32 number above the tie at half the smallest "
                                 "subnormal, which rounds to even, to 0; fp32's spacing there is 2^-23 relative")


def problem_model_state_bytes(recipe: str | Recipe = Recipe(torch.bfloat16),
                              config: GPTConfig = GPTConfig()) -> Answer:
    """Problem 3: bytes of model states per parameter, counted after one Adam step of ``recipe``."""
    m = recipe_memory(recipe, config, batch_size=1)
    n_tensors = len(list(GPT(config).parameters()))
    return Answer(measured=m.model_states / m.params, formula=MIXED_ADAM_BYTES_PER_PARAMETER, unit="B", rtol=1e-4,
                  why=f"Adam also keeps a 4-byte step count for each of the {n_tensors} parameter tensors: "
                      f"{4 * n_tensors / m.params:.5f} B per parameter")


def problem_allreduce_bytes(world_size: int = 4, config: GPTConfig = GPTConfig()) -> Answer:
    """Problem 4: bytes one rank's ring all-reduce sends per bf16-autocast step, gradients compressed to bf16."""
    sent, _ = allreduce_bytes(world_size, torch.bfloat16, config)
    n_params = sum(p.numel() for p in GPT(config).parameters())
    return Answer(measured=max(sent), formula=ring_all_reduce_bytes(world_size, n_params, 2), unit="B",
                  rtol=1e-4, why="when N does not divide the gradient's length, the ring's chunks differ by one "
                                 "element, a few bytes in 10^5")
