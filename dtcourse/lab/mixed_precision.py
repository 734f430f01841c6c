"""Lesson 04's measurements and pictures: number formats, gradients against fp16's range, lost updates.

Everything is computed from real tensors: ``torch.finfo`` for the formats, a real backward
of the course's GPT for the gradients, real fp16 rounding for what survives, and
``train`` (one of four recipes: fp32, fp16 with and without loss scaling, bf16 autocast) for the
loss curves::

    from dtcourse.lab.mixed_precision import loss_scale_widget
    loss_scale_widget()            # a slider over log2(loss scale), with the histogram below it

Figures are built with ``matplotlib.figure.Figure`` (no pyplot), so they draw headlessly and
a notebook shows each one once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.nn as nn

from dtcourse.lab.widgets import FigureView, figure_widget
from dtcourse.mixed_precision import LOW_PRECISION, DynamicLossScaler, MasterWeights
from dtcourse.models import CURVE_GPT, GPT, GPTConfig, lm_loss, token_batch

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Recipe", "RECIPES", "TrainingRun", "train", "FORMATS", "NumberFormat", "number_formats", "plot_number_formats", "gradient_sample", "Fractions",
           "fp16_fractions", "LossScaleView", "loss_scale_widget", "lost_updates", "update_underflow",
           "plot_update_underflow", "loss_curves", "plot_loss_curves", "LOSS_FACTOR", "CURVE_BATCH",
           "scaler_trace"]

# --------------------------------------------------------------------------- #
# Training recipes, for the loss curves of lesson 04
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class Recipe:
    """How a training step treats number formats.

    ``compute`` is the dtype forward and backward run in. With ``autocast=False`` a 16-bit
    copy of the model runs them and the optimizer steps fp32 ``MasterWeights``; with
    ``autocast=True`` the weights stay fp32 and ``torch.autocast`` runs matmuls in ``compute``.
    ``scaler`` builds a loss scaler (``DynamicLossScaler``, ``partial(StaticLossScaler, 2.0**10)``,
    or anything with GradScaler's methods, GradScaler itself included) or is None for no loss scaling.
    """

    compute: torch.dtype = torch.float32
    autocast: bool = False
    scaler: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        if self.compute not in (torch.float32, *LOW_PRECISION):
            raise ValueError(f"Recipe: compute must be float32, float16 or bfloat16, got {self.compute}.")
        if self.autocast and self.compute == torch.float32:
            raise ValueError("Recipe: autocast=True needs a 16-bit compute dtype (float16 or bfloat16).")


RECIPES = {
    "fp32": Recipe(),
    "fp16, no loss scaling": Recipe(torch.float16),
    "fp16, dynamic loss scaling": Recipe(torch.float16, scaler=DynamicLossScaler),
    "bf16 autocast": Recipe(torch.bfloat16, autocast=True),
}

@dataclass
class TrainingRun:
    """One recipe's training: the loss and the loss scale of every step, and the skipped steps."""

    name: str
    losses: list[float] = field(default_factory=list)    # unscaled, in fp32, also on skipped steps
    scales: list[float] = field(default_factory=list)    # the scale each step's loss was multiplied by
    skipped: list[int] = field(default_factory=list)     # steps whose update was skipped (inf/NaN)
    params: list[torch.Tensor] = field(default_factory=list)   # the fp32 weights (masters) at the end


def train(recipe: Recipe | str, steps: int = 200, *, config: GPTConfig = CURVE_GPT, batch_size: int = 16,
          lr: float = 3e-3, loss_factor: float = 1.0, seed: int = 0,
          device: str | torch.device = "cpu") -> TrainingRun:
    """Train ``GPT(config, seed)`` with Adam for ``steps`` steps under ``recipe`` (or a name in RECIPES).

    Each step draws a fresh ``token_batch``. The loss is computed in fp32 from the logits, then
    multiplied by ``loss_factor`` before backward: a factor below 1 gives the gradients the
    small magnitudes of a model that averages its loss over many more tokens (Adam, which
    divides each update by the gradient's running RMS, hardly notices; fp16 does).
    """
    name = recipe if isinstance(recipe, str) else repr(recipe)
    recipe = RECIPES[recipe] if isinstance(recipe, str) else recipe
    device = torch.device(device)
    model = GPT(config, seed=seed).to(device)
    master = None
    if not recipe.autocast and recipe.compute != torch.float32:
        master = MasterWeights(model, recipe.compute)                 # model is now 16-bit
    optimizer = torch.optim.Adam(model.parameters() if master is None else master.parameters(), lr=lr)
    scaler = recipe.scaler() if recipe.scaler is not None else None
    stepped = [0]                                                # optimizer.step() calls, to see skips
    optimizer.register_step_post_hook(lambda *_: stepped.__setitem__(0, stepped[0] + 1))
    run = TrainingRun(name)
    for step in range(steps):
        x, y = (t.to(device) for t in token_batch(config, batch_size, seed=seed * 1_000_003 + step))
        with torch.autocast(device.type, dtype=recipe.compute, enabled=recipe.autocast):
            logits = model(x)                                    # (B, T, vocab) in `compute`
        loss = lm_loss(logits.float(), y)                        # softmax and mean in fp32
        run.losses.append(loss.item())
        run.scales.append(1.0 if scaler is None else scaler.get_scale())
        loss = loss * loss_factor
        (loss if scaler is None else scaler.scale(loss)).backward()
        if master is not None:
            master.grads_to_master()                             # 16-bit grads -> fp32, still scaled
        calls = stepped[0]
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)                               # unscale, check, step or skip
            scaler.update()
        if stepped[0] == calls:
            run.skipped.append(step)
        optimizer.zero_grad(set_to_none=True)
        if master is not None:
            master.master_to_model()                             # round the masters into fp16/bf16
    run.params = [p.detach().clone() for p in optimizer.param_groups[0]["params"]]
    return run


# --------------------------------------------------------------------------- #
# Number formats, gradients and the loss-scale widget
# --------------------------------------------------------------------------- #
FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The loss curves' setting. Batches of 16 x 32 tokens, and the loss divided by 2^9 before
# backward: gradients as small as with 512 accumulated micro-batches (2^18 tokens a step).
CURVE_BATCH = 16
LOSS_FACTOR = 2.0 ** -9


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

    fig = Figure(figsize=(9, 2.8), layout="constrained")
    ax = fig.subplots()
    formats = list(number_formats().values())
    for row, f in enumerate(formats):
        low, normal, high = (math.log2(v) for v in (f.smallest_subnormal, f.smallest_normal, f.max))
        ax.barh(row, normal - low, left=low, height=0.5, color=f"C{row}", alpha=0.35)
        ax.barh(row, high - normal, left=normal, height=0.5, color=f"C{row}")
        ax.text(high + 2, row, f"max {f.max:.4g}", va="center", fontsize=8)
        ax.text(low - 2, row, f"{f.smallest_subnormal:.2g}", va="center", ha="right", fontsize=8)
        ax.text(normal, row + 0.3, f"{f.smallest_normal:.2g}", va="bottom", ha="center", fontsize=7)
    ax.set_yticks(range(len(formats)), [f"{f.name}: {f.exponent_bits} exp, {f.mantissa_bits} mantissa bits\n"
                                        f"eps = 2^{math.log2(f.eps):g}" for f in formats], fontsize=8)
    ax.set_xlim(-175, 160)
    ax.set_ylim(-0.5, len(formats) - 0.2)
    ax.set_xlabel("log2 |x|")
    ax.axvline(0, color="0.5", lw=0.5)
    ax.set_title("Range of each format (torch.finfo): subnormals light, from the smallest subnormal to the "
                 "smallest normal;\nnormal numbers dark, up to max", fontsize=9)
    return fig


# --------------------------------------------------------------------------- #
# Gradients against fp16's range
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
                     subnormal=((rounded != 0) & (rounded.abs() < torch.finfo(torch.float16).smallest_normal)
                                ).sum().item() / n,
                     overflow=rounded.isinf().sum().item() / n)


class LossScaleView(FigureView):
    """Histograms of log2|g * S| for each kind of gradient, over fp16's zones; ``show(k)`` sets S = 2^k."""

    BINS = torch.arange(-64.0, 40.5, 0.5)          # log2 |value|, half an octave per bin

    def __init__(self, grads: Mapping[str, torch.Tensor]):
        from matplotlib.figure import Figure

        self.grads = dict(grads)
        self.log2 = {kind: g.abs().double().log2() for kind, g in self.grads.items()}
        self.figure = Figure(figsize=(8.5, 3.6), layout="constrained")
        self.ax = self.figure.subplots()
        info = torch.finfo(torch.float16)
        zones = ((-64, -25, "tab:red", "flushes to 0"),
                 (-25, math.log2(info.smallest_normal), "tab:orange", "subnormal"),
                 (math.log2(info.smallest_normal), math.log2(info.max), "tab:green", "normal fp16"),
                 (math.log2(info.max), 40, "tab:red", "overflows to inf"))
        for lo, hi, colour, label in zones:
            self.ax.axvspan(lo, hi, color=colour, alpha=0.12, lw=0)
            self.ax.text((lo + hi) / 2, 0.98, label, transform=self.ax.get_xaxis_transform(), ha="center",
                         va="top", fontsize=8, color=colour)
        self.stairs = {kind: self.ax.stairs(torch.zeros(len(self.BINS) - 1).numpy(), self.BINS.numpy(),
                                            label=f"{kind} gradients ({g.numel():,})", lw=1.5)
                       for kind, g in self.grads.items()}
        self.ax.set_xlim(-64, 40)
        self.ax.set_xlabel("log2 |gradient x loss scale|")
        self.ax.set_ylabel("fraction per bin")
        self.ax.legend(loc="center left", fontsize=8)
        self.note = self.ax.text(0.99, 0.86, "", transform=self.ax.transAxes, ha="right", va="top",
                                 fontsize=8, family="monospace")
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
        self.ax.set_ylim(0, 1.15 * top)
        self.note.set_text("\n".join(f"{kind:<10} zero {f.zero:6.1%}  subnormal {f.subnormal:6.1%}  "
                                     f"inf {f.overflow:6.1%}" for kind, f in self.fractions.items()))
        self.ax.set_title(f"loss scale S = 2^{log2_scale} = {2.0 ** log2_scale:,.0f}", fontsize=10)


def loss_scale_widget(grads: Mapping[str, torch.Tensor] | None = None, max_log2_scale: int = 40):
    """A slider over log2 of the loss scale, with a ``LossScaleView`` of ``grads`` (or ``gradient_sample()``)."""
    import ipywidgets as widgets

    view = LossScaleView(gradient_sample() if grads is None else grads)
    slider = widgets.IntSlider(value=0, min=0, max=max_log2_scale, description="log2 S")
    return figure_widget({"slider": slider}, view.show, view.figure, max_width="760px", view=view)


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
def loss_curves(steps: int = 200, names: tuple[str, ...] = tuple(RECIPES), **kwargs) -> dict[str, TrainingRun]:
    """``train`` for each recipe, at the lesson's batch and loss factor unless told."""
    kwargs = {"batch_size": CURVE_BATCH, "loss_factor": LOSS_FACTOR, **kwargs}
    return {name: train(name, steps, **kwargs) for name in names}


def plot_loss_curves(runs: Mapping[str, TrainingRun], smooth: int = 10) -> Figure:
    """Loss per step (running mean over ``smooth`` steps); below, the scale of runs that scaled, skips in red."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5.2), layout="constrained")
    loss_ax, scale_ax = fig.subplots(2, 1, sharex=True, height_ratios=(2.2, 1))
    styles = [dict(lw=4, alpha=0.4), dict(lw=1.5), dict(lw=1.5, ls="--"), dict(lw=2, ls=":"),
              dict(lw=1.5, ls="-.")]          # the first (the reference) wide and pale, so overlaps show
    for i, (name, run) in enumerate(runs.items()):
        style = dict(color=f"C{i}", **styles[i % len(styles)])
        losses = torch.tensor(run.losses)
        kernel = torch.ones(1, 1, smooth) / smooth
        mean = torch.nn.functional.conv1d(losses.view(1, 1, -1), kernel).flatten()   # (steps - smooth + 1,)
        loss_ax.plot(range(smooth - 1, len(run.losses)), mean.tolist(), label=name, **style)
        if any(s != 1.0 for s in run.scales):
            scale_ax.plot([math.log2(s) for s in run.scales], label=name, **style)
        if run.skipped:
            scale_ax.plot(run.skipped, [math.log2(run.scales[s]) for s in run.skipped], "x", color="tab:red",
                          label=f"{name}: skipped step")
    loss_ax.axhline(math.log(CURVE_GPT.vocab_size), color="0.6", lw=0.8, ls=":")
    loss_ax.set(ylabel=f"loss (mean of {smooth} steps)", title="dotted grey: ln(vocab), a uniform guess")
    loss_ax.legend(fontsize=8)
    scale_ax.set(xlabel="step", ylabel="log2 loss scale")
    if scale_ax.lines:
        scale_ax.legend(fontsize=8)
    return fig
