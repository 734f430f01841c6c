"""Play a schedule with given times and predict its timeline and bubble, before running it.

Every action starts as soon as its rank is free and its inputs have arrived: the previous stage's
forward, the next stage's input gradient, plus ``t_comm`` when they come from another rank (sends
overlap compute, as with asynchronous p2p). SEND/RECV actions take no time of their own::

    pred = simulate(one_f_one_b(4, 8), p=4, m=8)      # t_f = 1, t_b = 2
    pred.bubble                                       # 0.2727... == bubble_formula("1f1b", 4, 8)
    pred.timeline[0][0]                               # Span(kind='F', name='0F0', start=0.0, end=1.0)

The bubble is the idle share of the step, the step being the time the last rank finishes:
1 - busy / (p · step) overall, 1 - busy_r / step on rank r. ``cost.bubble_formula`` gives the papers'
closed forms for it; the tests check the simulator against every one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtcourse.pipeline.actions import COMMUNICATION, STEP, Action, Schedule
from dtcourse.pipeline.validate import validate
from dtcourse.runtime.timeline import Recording, Span

__all__ = ["Prediction", "simulate", "peak_activations"]


@dataclass(frozen=True)
class Prediction:
    """``timeline``: rank -> compute spans (kind F/B/I/W, or STEP if timed; name like "2B0"); ``step``: when
    the last rank ends."""

    timeline: Recording
    step: float
    bubble_per_rank: dict[int, float]
    bubble: float


def simulate(schedule: Schedule, p: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float = 2.0,
             t_w: float | None = None, t_comm: float = 0.0, t_step: float = 0.0) -> Prediction:
    """Predict when each action of ``schedule`` runs, with times per stage (one chunk of one rank).

    ``t_b`` is the whole backward; a split one takes I = t_b - t_w and W = t_w (t_w = t_b / 2 unless
    given); a ``STEP`` takes ``t_step`` (0: the papers' bubble formulas leave the step out, and then
    it draws no span). Raises the ``validate`` error for a schedule that cannot run.
    """
    validate(schedule, p, m, v)
    n = p * v
    t_w = t_b / 2 if t_w is None else t_w
    if not 0 <= t_w <= t_b:
        raise ValueError(f"simulate: t_w = {t_w} must lie between 0 and t_b = {t_b} (I = t_b - t_w).")
    duration = {"F": t_f, "B": t_b, "I": t_b - t_w, "W": t_w, STEP: t_step}
    end: dict[Action, float] = {}
    compute = {r: [a for a in schedule[r] if a.kind not in COMMUNICATION] for r in range(p)}

    def inputs(a: Action) -> list[Action]:                   # what ``a`` waits for (see validate.needs)
        s, j = a.stage, a.microbatch
        if a.kind == STEP:                                   # its own stage's gradients, earlier on its rank
            return []
        if a.kind == "F":
            return [Action(s - 1, "F", j)] if s > 0 else []
        if a.kind == "W":
            return [Action(s, "I", j)]
        later = [Action(s + 1, "B", j), Action(s + 1, "I", j)] if s < n - 1 else []
        return [Action(s, "F", j)] + [x for x in later if x in present]

    present = {a for r in range(p) for a in compute[r]}
    timeline: Recording = {r: [] for r in range(p)}
    free = {r: 0.0 for r in range(p)}
    pos = {r: 0 for r in range(p)}
    while any(pos[r] < len(compute[r]) for r in range(p)):
        for r in range(p):                                   # validate() ruled out a stall
            while pos[r] < len(compute[r]) and all(d in end for d in inputs(compute[r][pos[r]])):
                a = compute[r][pos[r]]
                ready = [end[d] + (t_comm if d.stage % p != r else 0.0) for d in inputs(a)]
                start = max([free[r]] + ready)
                end[a] = free[r] = start + duration[a.kind]
                if end[a] > start or a.kind != STEP:
                    timeline[r].append(Span(a.kind, str(a), start, end[a]))
                pos[r] += 1
    step = max(free.values())
    busy = {r: sum(s.duration for s in timeline[r]) for r in range(p)}
    return Prediction(timeline, step, {r: 1 - busy[r] / step for r in range(p)},
                      1 - sum(busy.values()) / (p * step))


def peak_activations(schedule: Schedule, p: int) -> dict[int, int]:
    """Per rank, the most micro-batch-stages whose activations are held at once (F run, last backward not).

    ``peak_activations(gpipe(4, 8), 4)[0] == 8`` but ``peak_activations(one_f_one_b(4, 8), 4)[0] == 4``.
    Activations are freed by B, or by W when the backward is split (W still needs the layer inputs).
    """
    peak = {}
    for r in range(p):
        split = {(a.stage, a.microbatch) for a in schedule[r] if a.kind == "W"}
        held = most = 0
        for a in schedule[r]:
            if a.kind == "F":
                held += 1
                most = max(most, held)
            elif a.kind == "W" or (a.kind == "B" and (a.stage, a.microbatch) not in split):
                held -= 1
        peak[r] = most
    return peak
