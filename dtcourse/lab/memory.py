"""What lesson 00 runs and draws: a training step's bytes by kind, its peak op by op, and the problems.

* ``plot_step_memory`` stacks each case's measured bytes by kind in one bar, fp32 master weights
  as their own segment, with the prediction as a marker at the top of every kind;
* ``trace_step`` follows the bytes a step holds after every op (``memory.HeldBytes``), cut into
  the phases ``memory.measure_step`` marks, and ``plot_step_trace`` draws it beside the formulas;
* ``attention_saved`` lists what attention saves for backward, written out and fused;
* ``problem_*`` measure the answers of the lesson's predict-then-check problems.

    from dtcourse.lab.memory import plot_step_memory, table
    plot_step_memory({"MLP, fp32 Adam": (measured, predicted)})
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

from dtcourse.lab.problems import Answer
from dtcourse.lab.widgets import COLUMN_IN
from dtcourse.memory import (PHASES, HeldBytes, LossFn, OptimizerFactory, StepMemory, gpt_activation_bytes,
                             measure_step)
from dtcourse.models import GPT, MLP, GPTConfig, lm_loss, regression_batch, token_batch

__all__ = ["plot_step_memory", "table", "StepTrace", "trace_step", "plot_step_trace", "attention_saved",
           "problem_sgd_momentum_step", "problem_model_states", "problem_attention_scores",
           "problem_before_first_step"]

_UNITS = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}
# The segments of a stacked bar, bottom to top: (label, bytes of a StepMemory, colour).
_SEGMENTS = (
    ("parameters", lambda m: m.params, "tab:blue"),
    ("gradients", lambda m: m.grads, "tab:orange"),
    ("fp32 master weights", lambda m: m.master_weights, "tab:purple"),
    ("optimizer states", lambda m: m.optimizer_states - m.master_weights, "tab:green"),
    ("activations", lambda m: m.activations, "tab:gray"),
)


def _scale(unit: str, caller: str) -> int:
    if unit not in _UNITS:
        raise ValueError(f"{caller}: unit must be one of {list(_UNITS)}, got {unit!r}.")
    return _UNITS[unit]


def plot_step_memory(cases: Mapping[str, tuple[StepMemory, StepMemory]], unit: str = "KiB",
                     title: str = "One training step's bytes, by kind"):
    """One stacked bar per case, kinds stacked; the prediction's top of each kind as a black marker.

    ``cases`` maps a bar's label to ``(measured, predicted)``. Bar containers come in the order of
    the segments (parameters, gradients, fp32 master weights, optimizer states, activations), one
    bar per case each, leaving out a kind no case has (master weights without mixed precision);
    the markers are the line labelled "predicted". Returns the matplotlib Figure (no pyplot, so
    it draws headlessly).
    """
    from matplotlib.figure import Figure

    scale = _scale(unit, "plot_step_memory")
    fig = Figure(figsize=(COLUMN_IN, 3.4), layout="constrained")
    ax = fig.subplots()
    x = list(range(len(cases)))
    bottoms = [0.0] * len(cases)
    for label, part, color in _SEGMENTS:
        heights = [part(measured) / scale for measured, _ in cases.values()]
        if not any(heights):
            continue
        ax.bar(x, heights, width=0.55, bottom=bottoms, label=label, color=color)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    marks_x, marks_y = [], []
    for i, (_, predicted) in enumerate(cases.values()):
        top = 0.0
        for _, part, _ in _SEGMENTS:
            if part(predicted):                       # a kind the case does not have gets no marker
                top += part(predicted) / scale
                marks_x.append(i)
                marks_y.append(top)
    ax.plot(marks_x, marks_y, linestyle="none", marker="_", markersize=28, markeredgewidth=1.5,
            color="black", label="predicted (top of each kind)")
    for i, total in enumerate(bottoms):
        ax.annotate(f"{total:,.{1 if total < 100 else 0}f} {unit}", (i, total), xytext=(0, 3), textcoords="offset points",
                    ha="center", fontsize=8)
    ax.set_xticks(x, list(cases))
    ax.set_xlim(-0.6, len(cases) - 0.4)
    ax.set_ylim(0, max(bottoms) * 1.12)
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def table(columns: Mapping[str, StepMemory]) -> str:
    """A text table of bytes: one row per kind, model states and total, one column per entry.

    In mixed precision ``optimizer_states`` includes the fp32 master weights (ZeRO's K); the row
    "of which master" under it says how much, and appears when any column has master weights.
    """
    width = max(14, *(len(name) + 2 for name in columns))
    rows = ["params", "grads", "optimizer_states", "master_weights", "activations", "model_states", "total"]
    if not any(m.master_weights for m in columns.values()):
        rows.remove("master_weights")
    lines = [" " * 18 + "".join(f"{name:>{width}}" for name in columns)]
    for row in rows:
        label = "  of which master" if row == "master_weights" else row
        lines.append(f"{label:<18}" + "".join(f"{getattr(m, row):>{width},}" for m in columns.values()))
    return "\n".join(lines)


# --------------------------------------------------------------------------- #
# The step op by op: what it holds at its peak
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class StepTrace:
    """The bytes one step's ops had allocated and still held after each op, and where each phase ends.

    ``held[i]`` is ``HeldBytes.now`` after op i. ``ends[phase]`` is ``(ops run, bytes held)`` when
    ``phase`` (one of ``memory.PHASES``) ended. ``counted`` is ``measure_step``'s count of the same step.
    """

    held: tuple[int, ...]
    ends: dict[str, tuple[int, int]]
    counted: StepMemory

    @property
    def peak(self) -> int:
        return max(self.held)

    def at_end(self, phase: str) -> int:
        """Bytes held when ``phase`` ended."""
        return self.ends[phase][1]

    def phase_peak(self, phase: str) -> int:
        """The most bytes held during ``phase``: after each of its ops, and when it began and ended."""
        i = PHASES.index(phase)
        start, before = self.ends[PHASES[i - 1]] if i else (0, 0)
        return max(before, self.ends[phase][1], *self.held[start:self.ends[phase][0]])


def trace_step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], loss_fn: LossFn,
               make_optimizer: OptimizerFactory = torch.optim.Adam, *,
               mixed_dtype: torch.dtype | None = None) -> StepTrace:
    """``measure_step`` under ``HeldBytes``: every storage the step's ops allocate, alive or freed, op by op.

    The step starts from nothing: copying the model is its first allocation. Tensors made
    outside it (the batch), or from Python numbers rather than by an op (Adam's ``step``
    counters, ``torch.tensor(0.0)``), are not seen. Runs on the CPU, where backward runs on this
    thread; on CUDA backward's ops run on another thread, out of the mode's sight.
    """
    ends: dict[str, tuple[int, int]] = {}
    with HeldBytes() as held:
        counted = measure_step(model, batch, loss_fn, make_optimizer, mixed_dtype=mixed_dtype,
                               mark=lambda phase: ends.__setitem__(phase, (held.mark(), held.now)))
    return StepTrace(tuple(held.trace), ends, counted)


# Phases drawn as shaded spans, with the PHASES they run from (None: the first op) and to.
_SPANS = (("copy the model", None, "master", "tab:purple"), ("forward", "batch", "forward", "tab:blue"),
          ("backward", "forward", "backward", "tab:orange"), ("optimizer step", "backward", "end", "tab:green"))


def plot_step_trace(traces: Mapping[str, StepTrace], unit: str = "KiB"):
    """One panel per trace: bytes held after every op, phases shaded, beside the table's levels.

    Two dashed lines give what the step-memory table adds up: the model states (16Ψ for Adam)
    and the model states plus the activations. A dot marks the measured peak.
    """
    from matplotlib.figure import Figure

    scale = _scale(unit, "plot_step_trace")
    fig = Figure(figsize=(COLUMN_IN, 3.3), layout="constrained")
    axes = fig.subplots(1, len(traces), squeeze=False)[0]
    for ax, (title, trace) in zip(axes, traces.items()):
        for label, start, end, color in _SPANS:
            ax.axvspan(trace.ends[start][0] if start else 0, trace.ends[end][0], color=color, alpha=0.12,
                       label=label)
        ax.plot(range(1, len(trace.held) + 1), [h / scale for h in trace.held], color="black", lw=1.2,
                label="held, measured")
        top = trace.held.index(trace.peak) + 1
        ax.plot([top], [trace.peak / scale], "o", color="tab:red", label="peak")
        c = trace.counted
        for level, style, label in ((c.model_states, "--", "model states (table)"),
                                    (c.total, ":", "model states + activations")):
            ax.axhline(level / scale, color="tab:red", linestyle=style, lw=1, label=label)
        ax.set_title(f"{title}: peak {trace.peak / scale:,.0f} {unit}", fontsize=9)
        ax.set_xlabel("ops run", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"held ({unit})", fontsize=9)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=4, fontsize=8)
    return fig


# --------------------------------------------------------------------------- #
# Attention: the s×s matrix, written out and fused
# --------------------------------------------------------------------------- #
def attention_saved(config: GPTConfig = GPTConfig(), batch_size: int = 8) -> dict[str, list[tuple]]:
    """What one attention saves for backward, two ways: ``(shape, bytes of its storage)`` per storage.

    "written out" is ``models.CausalSelfAttention.core`` (q @ k^T, mask, softmax, @ v);
    "scaled_dot_product_attention" is PyTorch's fused kernel on the same q, k and v, which
    keeps a log-sum-exp per row instead of the (B, nh, T, T) matrix and recomputes it in backward.
    """
    from dtcourse.models import CausalSelfAttention

    attn = CausalSelfAttention(config)
    B, T, C, nh = batch_size, config.block_size, config.d_model, config.n_head
    qkv = torch.randn(B, T, 3 * C, requires_grad=True)                 # (B, T, 3C), c_attn's output

    def fused(qkv: torch.Tensor) -> torch.Tensor:
        # (B, nh, T, hs) each, made contiguous so that each shows as its own saved tensor
        q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2).contiguous() for t in qkv.split(C, dim=2))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)

    found = {}
    for name, fn in (("written out", attn.core), ("scaled_dot_product_attention", fused)):
        saved: dict[int, torch.Tensor] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() != attn.future_mask.untyped_storage().data_ptr():   # a buffer
                saved.setdefault(t.untyped_storage().data_ptr(), t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(qkv)
        found[name] = [(tuple(t.shape), t.untyped_storage().nbytes()) for t in saved.values()]
    return found


# --------------------------------------------------------------------------- #
# Predict-then-check problems
# --------------------------------------------------------------------------- #
_EXACT = "on the CPU the count is the tensors' sizes, to the byte: no allocator rounds or caches"


def problem_sgd_momentum_step(config: GPTConfig = GPTConfig(), batch_size: int = 8) -> Answer:
    """Bytes of one fp32 step of the lesson's GPT with SGD(momentum=0.9) instead of AdamW, measured."""
    gpt = GPT(config, seed=0)
    sgd = measure_step(gpt, token_batch(config, batch_size), lm_loss,
                       lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    n_params = sum(p.numel() for p in gpt.parameters())
    formula = (4 + 4 + 4) * n_params + gpt_activation_bytes(config, batch_size)   # weights, grads, momentum
    return Answer(measured=sgd.total, formula=formula, unit="B", rtol=0.0, why=_EXACT)


def problem_model_states(sizes: tuple[int, ...] = (256, 512, 256), mixed_dtype: torch.dtype = torch.bfloat16,
                         batch_size: int = 16) -> Answer:
    """Model-state bytes of ``MLP(sizes)`` under mixed-precision Adam, measured against 16Ψ + 4 per tensor."""
    measured = measure_step(MLP(sizes), regression_batch(batch_size, sizes[0], sizes[-1]), F.mse_loss,
                            torch.optim.Adam, mixed_dtype=mixed_dtype)
    n_params = sum(i * o + o for i, o in zip(sizes[:-1], sizes[1:]))     # weights and biases
    n_tensors = 2 * (len(sizes) - 1)
    return Answer(measured=measured.model_states, formula=16 * n_params + 4 * n_tensors, unit="B", rtol=0.0,
                  why=_EXACT)


def problem_attention_scores(config: GPTConfig = GPTConfig(), batch_size: int = 8) -> Answer:
    """Bytes of the (B, nh, T, T) tensors the lesson's GPT saves for backward, over all its layers."""
    gpt, (idx, _) = GPT(config, seed=0), token_batch(config, batch_size)
    T = idx.shape[1]
    square: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.dim() == 4 and tuple(t.shape[-2:]) == (T, T):   # not the bool mask
            square[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gpt(idx)
    formula = config.n_layer * config.n_head * T * T * batch_size * 4      # L · a s² b, 4 bytes each
    return Answer(measured=sum(square.values()), formula=formula, unit="B", rtol=0.0,
                  why="each layer's softmax output is one saved storage, counted to the byte")


def problem_before_first_step(config: GPTConfig = GPTConfig(), batch_size: int = 8,
                              mixed_dtype: torch.dtype = torch.bfloat16) -> Answer:
    """Bytes a mixed-precision Adam step of the lesson's GPT holds just before its first ``optimizer.step()``."""
    gpt = GPT(config, seed=0)
    trace = trace_step(gpt, token_batch(config, batch_size), lm_loss, torch.optim.Adam, mixed_dtype=mixed_dtype)
    n_params = sum(p.numel() for p in gpt.parameters())
    # 16-bit weights and grads, fp32 master weights and their fp32 grads; no m or v yet
    formula = (2 + 2 + 4 + 4) * n_params
    return Answer(measured=trace.at_end("upcast"), formula=formula, unit="B", rtol=0.0,
                  why="HeldBytes counts every storage the step's ops allocated and still hold, to the byte; "
                      "the int64 token batch was made before the step and is not among them")
