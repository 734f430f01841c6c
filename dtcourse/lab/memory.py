"""What lesson 00 draws: a training step's bytes by kind, measured beside the formula.

    from dtcourse.lab.memory import plot_step_memory, table
    plot_step_memory({"MLP, fp32 Adam": (measured, predicted)})
"""

from __future__ import annotations

from typing import Mapping

from dtcourse.memory import StepMemory

__all__ = ["plot_step_memory", "table"]

_UNITS = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}


def plot_step_memory(cases: Mapping[str, tuple[StepMemory, StepMemory]], unit: str = "KiB"):
    """Grouped bars, one panel per case: measured beside predicted bytes for each kind.

    ``cases`` maps a title to ``(measured, predicted)``. Each panel's first bar
    container is the measured one, the second the prediction (labels say so).
    Returns the matplotlib Figure (no pyplot, so it draws headlessly).
    """
    from matplotlib.figure import Figure

    if unit not in _UNITS:
        raise ValueError(f"plot_step_memory: unit must be one of {list(_UNITS)}, got {unit!r}.")
    scale = _UNITS[unit]
    fig = Figure(figsize=(4.2 * len(cases), 3.6), layout="constrained")
    axes = fig.subplots(1, len(cases), sharey=True, squeeze=False)[0]
    x = range(len(StepMemory.KINDS))
    for ax, (title, (measured, predicted)) in zip(axes, cases.items()):
        for offset, label, mem, color in ((-0.2, "measured", measured, "tab:blue"),
                                          (0.2, "predicted", predicted, "tab:orange")):
            heights = [getattr(mem, kind) / scale for kind in StepMemory.KINDS]
            ax.bar([i + offset for i in x], heights, width=0.4, label=label, color=color)
        ax.set_xticks(list(x), ["params", "grads", "optimizer\nstates", "activations"])
        ax.set_title(f"{title}\nmeasured total {measured.total / scale:,.0f} {unit}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel(unit)
    axes[0].legend()
    return fig


def table(columns: Mapping[str, StepMemory]) -> str:
    """A text table of bytes: one row per kind plus model states and total, one column per entry."""
    width = max(14, *(len(name) + 2 for name in columns))
    lines = [" " * 18 + "".join(f"{name:>{width}}" for name in columns)]
    for row in (*StepMemory.KINDS, "model_states", "total"):
        lines.append(f"{row:<18}" + "".join(f"{getattr(m, row):>{width},}" for m in columns.values()))
    return "\n".join(lines)

