"""Pipeline parallelism's formulas (lesson 08): the bubble, the idle share of a step, by schedule.

p stages (ranks), m micro-batches, v chunks per rank (interleaved); t_f and t_b a stage's forward and
backward time. ``simulate.py`` plays a schedule on those times and ``execute.py`` runs it on real ranks:
both are set beside this formula in the lesson.
"""

from __future__ import annotations

__all__ = ["bubble_formula"]


def bubble_formula(schedule_name: str, p: int, m: int, v: int = 1) -> float:
    """The idle share of a step from the papers, for t_b = 2 t_f (any ratio, but for ZB-H1).

    * naive, GPipe, 1F1B (arXiv 1811.06965, 2104.04473): each rank idles (p-1)(t_f + t_b) of a step of
      (m + p - 1)(t_f + t_b): ``(p-1)/(m+p-1)``; naive is m = 1: ``(p-1)/p``.
    * interleaved 1F1B (arXiv 2104.04473, section 2.2.2): the fill and drain go through chunks
      1/v as long, so the idle time is (p-1)(t_f + t_b)/v beside m(t_f + t_b) of work:
      ``(p-1)/(v·m + p-1)`` (m a multiple of p).
    * ZB-H1 (arXiv 2401.10241, section 3.1) with t_f = t_i = t_w as the paper assumes: the idle time
      falls to (p-1)(t_f + t_i - t_w) = (p-1)·t_f beside 3m·t_f of work: ``(p-1)/(3m+p-1)``, a
      third of 1F1B's relative to the work. For m < p the last rank has only m W's where the drain
      needs p, so it idles p - m more: ``(2p-1-m)/(2m+2p-1)`` (derived here, checked by the simulator).
    """
    if schedule_name == "naive":
        return (p - 1) / p
    if schedule_name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule_name == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if schedule_name == "zb_h1":
        idle = (p - 1) + max(0, p - m)                    # in units of t_f = t_i = t_w
        return idle / (3 * m + idle)
    raise ValueError(f"bubble_formula: unknown schedule {schedule_name!r}; "
                     "use naive, gpipe, 1f1b, interleaved_1f1b or zb_h1.")
