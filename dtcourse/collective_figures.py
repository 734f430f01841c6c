"""Before/after pictures of the six collectives, drawn from what real runs returned.

Lesson 01 runs each collective on 4 ranks where rank r starts with
``[10r, 10r+1, 10r+2, 10r+3]``, so every value says which rank it came from.
``collectives_figure`` draws one panel per collective: a row per rank, its
tensor before (left) and after (right), each value coloured by its source
rank, grey for a sum over ranks::

    fig = collectives_figure({"broadcast": [(before, after), ...], ...}, n_ranks=4)
"""

from __future__ import annotations

from typing import Sequence

Run = Sequence[tuple[Sequence[float] | None, Sequence[float] | None]]   # per rank: (before, after)


def source_colour(value: float, n_ranks: int) -> str:
    """Matplotlib colour for a value from rank r (values in [10r, 10r+10)); grey for a sum."""
    return f"C{int(value) // 10}" if 0 <= value < 10 * n_ranks else "0.75"


def draw_before_after(ax, title: str, per_rank: Run, n_ranks: int) -> None:
    """One panel: row r is rank r, its tensor before and after; ``None`` means undefined there."""
    from matplotlib.patches import Rectangle

    for r, (before, after) in enumerate(per_rank):
        ax.text(-0.7, -r, f"rank {r}", ha="right", va="center", fontsize=8)
        ax.text(4.6, -r, "→", ha="center", va="center")
        for x0, values in ((0, before), (5.5, after)):
            if values is None:
                ax.text(x0 + 1.5, -r, "undefined", ha="center", va="center", fontsize=8, color="0.5")
                continue
            for j, v in enumerate(values):
                ax.add_patch(Rectangle((x0 + j - 0.45, -r - 0.4), 0.9, 0.8, color=source_colour(v, n_ranks),
                                       alpha=0.45))
                ax.text(x0 + j, -r, f"{v:g}", ha="center", va="center", fontsize=8)
    ax.set(xlim=(-2.4, 9.1), ylim=(-len(per_rank) + 0.5, 0.9), title=title)
    ax.axis("off")


def collectives_figure(runs: dict[str, Run], n_ranks: int, columns: int = 3):
    """A grid of before/after panels, one per collective, in the order given."""
    import matplotlib.pyplot as plt

    rows = -(-len(runs) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.4 * columns, 2.5 * rows), squeeze=False)
    for ax, (name, per_rank) in zip(axes.flat, runs.items()):
        draw_before_after(ax, name, per_rank, n_ranks)
    for ax in list(axes.flat)[len(runs):]:
        ax.axis("off")
    fig.tight_layout()
    return fig
