"""Checks for exercise 08: a student's 1F1B schedule generator, ``one_f_one_b(p, m)``, as data.

The student's function returns ``{rank: [Action, ...]}`` for p ranks and m micro-batches
(``dtcourse.pipeline.actions``): forwards and backwards, and last on each rank its optimizer step,
``Action(r, "STEP")``; no messages. Three checks, from the data to the ranks::

    check_1f1b_valid(one_f_one_b, cases=("small",))

* ``check_1f1b_valid``: every schedule can run, by the course's validator (``pipeline.validate``):
  each stage's F and B once, each B after its F and after the next stage's B, no deadlock between
  the ranks, and still none once ``with_communication`` has added the sends and receives;
* ``check_1f1b_order``: every rank's list is 1F1B's, action by action: p-1-r warm-up forwards
  (capped at m), then one forward and one backward in turn, then the cool-down backwards, then the step. The first
  difference is named by rank, step and phase, with the actions expected and found, what the
  student's order costs (micro-batches held, ``peak_activations``; simulated bubble, ``simulate``)
  and, for the usual mistakes, which one it is;
* ``check_1f1b_run``: the schedule runs on p real ranks (``PipelineExecutor`` on a GPT cut into p
  stages): it finishes, every stage's gradients equal one process's on the whole batch, its optimizer
  step ran once, after them, and rank r measured at most min(p - r, m) micro-batches of activations
  held at once: 1F1B's memory bound, where GPipe holds m.

The student's code runs in child processes, so a loop that never ends fails after the timeout. While
it runs, the course's ``one_f_one_b`` and torch's ``Schedule1F1B`` order refuse to run
(``guard.watching``); passing the course's to a check is refused too.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from dtcourse.checks.common import (_as_student, _check_names, _launch_check, _refuse_library_code,
                                     _stop_at_first_failure, _student_error)
from dtcourse.checks.guard import Answers, watching
from dtcourse.pipeline.actions import COMMUNICATION, STEP, Action, Schedule

__all__ = ["check_1f1b_valid", "check_1f1b_order", "check_1f1b_run", "SCHEDULE_CASES", "RUN_CASES", "RUN_TOL"]

# What these checks switch off while the student's code runs (guard.watching), and refuse to be given
ANSWERS = Answers("08", course=("dtcourse.pipeline.schedules.one_f_one_b",),
                  library={"torch's Schedule1F1B order is switched off while exercise 08's checks run: the exercise "
                           "asks you to write the 1F1B order yourself":
                           ("torch.distributed.pipelining.schedules.Schedule1F1B._get_pipeline_order",)})

# (p, m) pairs per case: every m below p (the warm-up cap), m not a multiple of p, m = 1, m = p. The most
# ranks and micro-batches come first: there every phase is long, and no two usual mistakes look alike.
SCHEDULE_CASES = {
    "small": ("p = 4 down to 1 ranks, m = 8 down to 1 micro-batches",
              [(p, m) for p in (4, 3, 2, 1) for m in range(8, 0, -1)]),
    "large": ("p = 8, 6 and 5 ranks, m from 24 down to 1, and 6 pairs drawn as the check runs",
              [(p, m) for p in (8, 6, 5) for m in (24, 13, 8, 7, 5, 3, 2, 1)]),
}
DRAWN = {"large": 6}   # pairs (p in 2-12, m in 1-40) drawn afresh each time the case runs: no table can hold them


def _pairs(name: str) -> list[tuple[int, int]]:
    """The case's (p, m) pairs, then those drawn now (from the operating system's entropy, not a seed a
    notebook could set); a failure names its p and m, so a drawn one can be rerun by hand."""
    listed = SCHEDULE_CASES[name][1]
    draw = random.SystemRandom()
    drawn: list[tuple[int, int]] = []
    while len(drawn) < DRAWN.get(name, 0):
        pair = (draw.randint(2, 12), draw.randint(1, 40))
        if pair not in listed and pair not in drawn:
            drawn.append(pair)
    return listed + drawn
# world size p -> the m run on p ranks, per case
RUN_CASES = {
    "small": ("2 and 3 ranks", {2: (4, 1), 3: (5, 1)}),
    "large": ("3 and 4 ranks", {3: (3, 7, 2), 4: (8, 6, 2)}),
}
_BATCH = 8           # rows of the global batch: every m run divides it into 1 or more rows each
# float32. Each micro-batch's loss is scaled by rows_j / B and the m weight gradients add up, where
# one process takes one mean over B*T tokens: the same terms summed in another order, a few ulps.
# Measured with the solution over every case: at most 4.5e-8. A real mistake (a micro-batch run twice,
# or missing) is off by a whole micro-batch's gradient, around 1e-2.
RUN_TOL = 1e-5

_ADVICE = "Write one_f_one_b yourself, in the exercise's cell, and pass that."
_HINT = ("This is most likely a deadlock: a rank waits for an activation or a gradient that the rank next to it "
         "never sends. Raise timeout= only if your code is merely slow.")


# --------------------------------------------------------------------------- #
# 1F1B and the usual mistakes, as the check builds them to name what it finds
# --------------------------------------------------------------------------- #
def _reference(p: int, m: int) -> Schedule:
    from dtcourse.pipeline.schedules import one_f_one_b
    return one_f_one_b(p, m)        # the check's own call: no student frame on its stack


def _variant(p: int, m: int, warmup: Callable[[int], int], steady: str = "FB", cooldown: bool = True,
             step: bool = True) -> Schedule:
    """1F1B with another warm-up count per rank, the steady pair in another order, no cool-down or no step."""
    out = {}
    for r in range(p):
        w = max(0, min(warmup(r), m))
        ops = [Action(r, "F", j) for j in range(w)]
        for j in range(m - w):
            pair = {"F": Action(r, "F", w + j), "B": Action(r, "B", j)}
            ops += [pair[steady[0]], pair[steady[1]]]
        ops += [Action(r, "B", j) for j in range(m - w, m)] if cooldown else []
        out[r] = ops + [Action(r, STEP)] * step
    return out


def _mistakes(p: int, m: int) -> list[tuple[str, Schedule]]:
    """(what went wrong, the schedule it makes) for the mistakes students make, in the order tried."""
    from dtcourse.pipeline.schedules import gpipe
    return [
        ("that is GPipe's order (every forward, then every backward): it holds all m micro-batches on every "
         "rank. 1F1B starts backwards after only p-1-r warm-up forwards, then alternates one forward and one "
         "backward", gpipe(p, m)),
        ("your warm-up runs p-r forwards on rank r, one too many: rank r needs only p-1-r, since the "
         "gradient of its first micro-batch is back after the p-1-r ranks behind it have run their forwards; "
         "the extra forward holds one more micro-batch of activations", _variant(p, m, lambda r: p - r)),
        ("your warm-up runs p-1 forwards on every rank: rank r needs only p-1-r (rank 0 is the first stage "
         "and warms up most, the last rank not at all)", _variant(p, m, lambda r: p - 1)),
        ("your schedule has no warm-up: every rank alternates one forward and one backward from the start, so "
         "each micro-batch must come back through every rank before the next one starts, and the ranks take "
         "turns (the bubble of one micro-batch at a time). Rank r first runs p-1-r forwards, to keep the "
         "stages after it busy while its first gradient travels back", _variant(p, m, lambda r: 0)),
        ("your warm-up runs r forwards on rank r, the wrong way round: rank 0, the first stage, must warm up "
         "most, p-1-r = p-1, and the last rank not at all", _variant(p, m, lambda r: r)),
        ("in your steady state the backward comes before the forward: each step is one forward of a new "
         "micro-batch, then the backward of the oldest (on the last rank that is the one just run forward)",
         _variant(p, m, lambda r: p - 1 - r, steady="BF")),
        ("your schedule has no cool-down: after the steady state, rank r still owes the backwards of the "
         "min(p-1-r, m) micro-batches it warmed up with", _variant(p, m, lambda r: p - 1 - r, cooldown=False)),
        ("your lists end without the optimizer step: once the cool-down has flushed every micro-batch, rank r "
         "updates its stage's weights, Action(r, 'STEP'), last", _variant(p, m, lambda r: p - 1 - r, step=False)),
    ]


def _which_mistake(got: Schedule, p: int, m: int, rank: int | None = None) -> str:
    """A hint naming the mistake ``got`` matches (on every rank, else on ``rank``), or ''."""
    mistakes, right = _mistakes(p, m), _reference(p, m)

    def strip(actions: Sequence[Action], k: int) -> list[Action]:    # the step matters to the last mistake only
        return list(actions) if k == len(mistakes) - 1 else [a for a in actions if a.kind != STEP]

    for k, (what, wrong) in enumerate(mistakes):
        if all(strip(wrong[r], k) == strip(got.get(r, []), k) for r in range(p)):
            return f"\n    hint: {what}."
    for k, (what, wrong) in enumerate(mistakes):
        if rank is not None and strip(wrong[rank], k) != strip(right[rank], k) \
                and strip(wrong[rank], k) == strip(got.get(rank, []), k):
            return f"\n    hint: {what}."
    return ""


def _cap_hint(p: int, m: int) -> str:
    if m >= p:
        return ""
    over = [r for r in range(p) if p - 1 - r > m]
    if not over:
        return ""
    return (f"\n    hint: with m = {m} micro-batches and p = {p} ranks, rank {over[0]}'s warm-up p-1-r = "
            f"{p - 1 - over[0]} is more than the m = {m} micro-batches there are: cap it, min(p-1-r, m), and "
            "then that rank has no steady state, only the backwards of its cool-down.")


def _phases(r: int, p: int, m: int) -> str:
    w = min(p - 1 - r, m)
    steady = 2 * (m - w)
    parts = [f"warm-up steps 0-{w - 1} (min(p-1-r, m) = {w} forwards)" if w else "no warm-up (p-1-r = 0)"]
    parts.append(f"steady state steps {w}-{w + steady - 1} (F then B, {m - w} pairs)" if steady
                 else "no steady state")
    parts.append(f"cool-down steps {w + steady}-{w + steady + w - 1} ({w} backwards)" if w else "no cool-down")
    parts.append(f"the optimizer step at step {2 * m}")
    return ", ".join(parts)


def _phase_of(step: int, r: int, p: int, m: int) -> str:
    w = min(p - 1 - r, m)
    if step < w:
        return "warm-up"
    if step < w + 2 * (m - w):
        return "steady state"
    return "cool-down" if step < 2 * m else "the optimizer step"


def _show(actions: Sequence[Action], limit: int = 18) -> str:
    text = ", ".join(map(str, actions[:limit]))
    return f"[{text}{', ...' if len(actions) > limit else ''}]"


# --------------------------------------------------------------------------- #
# The student's output, read as a schedule
# --------------------------------------------------------------------------- #
def _as_schedule(got: object, p: int, m: int) -> tuple[Schedule | None, str | None]:
    """``got`` as a compute-only 1F1B-shaped schedule, or what is wrong with its form."""
    call = f"one_f_one_b({p}, {m})"
    if not isinstance(got, dict):
        return None, (f"{call} returned {type(got).__name__} {got!r:.80}; it must return a dict rank -> list "
                      "of Action" + (" (did you forget the return?)" if got is None else ""))
    if set(got) != set(range(p)):
        return None, f"{call} has the keys {sorted(got, key=repr)}; a schedule for p = {p} ranks has the keys 0..{p - 1}"
    schedule: Schedule = {}
    for r in range(p):
        if not isinstance(got[r], list):
            return None, f"{call}[{r}] is a {type(got[r]).__name__}; each rank's actions must be a list, in order"
        for i, a in enumerate(got[r]):
            if not isinstance(a, Action):
                return None, (f"{call}[{r}][{i}] is {a!r} ({type(a).__name__}), not an Action: build each one "
                              f"with Action(stage, kind, micro-batch), for example Action({r}, 'F', 0)")
            if a.kind in COMMUNICATION:
                return None, (f"rank {r}, step {i}: {a} is a message; one_f_one_b returns F, B and STEP only, "
                              "and with_communication adds the sends and receives")
            if a.kind in ("I", "W"):
                return None, (f"rank {r}, step {i}: {a} is half of a split backward (zero-bubble's); 1F1B runs "
                              f"each backward whole: Action({a.stage}, 'B', {a.microbatch})")
        schedule[r] = list(got[r])
    return schedule, None


def _call(fn: Callable, p: int, m: int, progress: str) -> object:
    with watching(ANSWERS):
        return _as_student(progress, lambda: fn(p, m))


def _student(fn: Callable, p: int, m: int, progress: str, catch: bool = True) -> tuple[Schedule | None, str | None]:
    """The student's schedule for (p, m), or what is wrong: its form, or (``catch``) its error with the cap hint.

    Uncaught, the student's error ends the rank and ``_launch_check`` reports it once, from one rank.
    """
    try:
        got = _call(fn, p, m, progress)
    except AssertionError:
        raise
    except Exception as exc:
        if not catch:           # the error file _as_student wrote is what the parent reports
            with Path(progress, f"{dist.get_rank()}.error").open("a") as error:
                error.write(_cap_hint(p, m))
            raise
        Path(progress, f"{dist.get_rank()}.error").unlink(missing_ok=True)
        return None, f"one_f_one_b({p}, {m}) raised {_student_error(exc)}{_cap_hint(p, m)}"
    return _as_schedule(got, p, m)


def _invalid(schedule: Schedule, p: int, m: int) -> str | None:
    """The validator's complaint about ``schedule``, compute only and with its messages, or None."""
    from dtcourse.pipeline.schedules import with_communication
    from dtcourse.pipeline.validate import validate
    try:
        validate(schedule, p, m)
        validate(with_communication(schedule, p), p, m)
    except ValueError as error:
        out_of_range = any((a.microbatch or 0) >= m for acts in schedule.values() for a in acts)
        hint = _cap_hint(p, m) if out_of_range else _which_mistake(schedule, p, m)
        return f"one_f_one_b({p}, {m}) cannot run: {error}{hint}"
    return None


# --------------------------------------------------------------------------- #
# Checks 1 and 2: valid, and 1F1B's order
# --------------------------------------------------------------------------- #
def check_1f1b_valid(fn: Callable, cases: Sequence[str] = ("small",), timeout: float | None = None) -> None:
    """``fn(p, m)`` must return a schedule that ``pipeline.validate`` accepts, for every (p, m) of ``cases``.

    ``cases`` are keys of ``SCHEDULE_CASES``. The first failure names p and m and gives the validator's
    message: the rank, the step, the action and what it is missing (or which ranks wait on each other).
    """
    _check_names("check_1f1b_valid", fn, cases, SCHEDULE_CASES)
    _refuse_library_code("check_1f1b_valid", fn, ANSWERS.exercise, _ADVICE)
    _launch_check(getattr(fn, "__name__", "your function"), 1, _schedules_rank, (fn, tuple(cases), False),
                  timeout, where="", hint="Does a loop in it never end?")


def check_1f1b_order(fn: Callable, cases: Sequence[str] = ("small",), timeout: float | None = None) -> None:
    """``fn(p, m)`` must equal 1F1B action by action on every rank, for every (p, m) of ``cases``.

    The first difference is named by its rank, step and phase (warm-up, steady state, cool-down),
    with the action expected and the one found, the micro-batches the student's order holds and its
    simulated bubble beside 1F1B's, and which usual mistake it is when it is one.
    """
    _check_names("check_1f1b_order", fn, cases, SCHEDULE_CASES)
    _refuse_library_code("check_1f1b_order", fn, ANSWERS.exercise, _ADVICE)
    _launch_check(getattr(fn, "__name__", "your function"), 1, _schedules_rank, (fn, tuple(cases), True),
                  timeout, where="", hint="Does a loop in it never end?")


def _schedules_rank(fn: Callable, cases: tuple[str, ...], order: bool, progress: str) -> list:
    for name in cases:
        description, pairs = SCHEDULE_CASES[name][0], _pairs(name)
        where = f"case {name!r} ({description})"
        for p, m in pairs:
            Path(progress, "0").write_text(f"{where}, one_f_one_b({p}, {m})")
            schedule, problem = _student(fn, p, m, progress)
            if problem is None:
                problem = _invalid(schedule, p, m)
            if problem is None and order:
                problem = _order_problem(schedule, p, m)
            if problem:
                return [where, problem]
    Path(progress, "0").write_text("finished")
    return []


def _order_problem(got: Schedule, p: int, m: int) -> str | None:
    from dtcourse.pipeline.cost import bubble_formula
    from dtcourse.pipeline.simulate import peak_activations, simulate
    want = _reference(p, m)
    if got == want:
        return None
    r = next(r for r in range(p) if got[r] != want[r])
    i = next((i for i, (a, b) in enumerate(zip(got[r], want[r])) if a != b), min(len(got[r]), len(want[r])))
    expected = str(want[r][i]) if i < len(want[r]) else "the end of the list"
    found = str(got[r][i]) if i < len(got[r]) else "the end of the list"
    peak, ideal = peak_activations(got, p), min(p - r, m)
    bubble, formula = simulate(got, p, m).bubble, bubble_formula("1f1b", p, m)
    return (f"one_f_one_b({p}, {m}), rank {r}, step {i} ({_phase_of(i, r, p, m)}): expected {expected}, found "
            f"{found}.\n    1F1B on rank {r}: {_phases(r, p, m)}."
            f"\n    expected: {_show(want[r])}\n    yours:    {_show(got[r])}"
            f"\n    Yours holds up to {peak[r]} micro-batches of activations on rank {r} (1F1B: min(p-r, m) = "
            f"{ideal}) and its simulated bubble is {bubble:.3f} (1F1B: (p-1)/(m+p-1) = {formula:.3f})."
            + _which_mistake(got, p, m, r))


# --------------------------------------------------------------------------- #
# Check 3: on p real ranks
# --------------------------------------------------------------------------- #
def check_1f1b_run(fn: Callable, cases: Sequence[str] = ("small",), timeout: float | None = None) -> None:
    """Run ``fn(p, m)``'s schedule on p gloo ranks, one GPT stage each, for every (p, m) of ``cases``.

    Every rank computes the whole schedule and runs its own list (``run_schedule``, which adds the
    messages). It must finish, each stage's gradients must equal one process's on the whole batch
    within ``RUN_TOL``, rank r's executor must have held at most min(p - r, m) micro-batches'
    activations at once (``PipelineExecutor.peak_held_rank``), and its simulated bubble must be 1F1B's.
    """
    _check_names("check_1f1b_run", fn, cases, RUN_CASES)
    _refuse_library_code("check_1f1b_run", fn, ANSWERS.exercise, _ADVICE)
    runs: dict[int, list[int]] = {}
    for name in cases:
        for p, ms in RUN_CASES[name][1].items():
            runs.setdefault(p, []).extend(m for m in ms if m not in runs.get(p, []))
    for p, ms in sorted(runs.items()):
        _launch_check(getattr(fn, "__name__", "your function"), p, _run_rank, (fn, tuple(ms)), timeout,
                      where=f" on {p} ranks", hint=_HINT)


@dataclass(frozen=True)
class _Model:
    """A GPT of 4 blocks cut into p stages, and its copy that one process runs on the whole batch."""

    stages: dict
    reference: torch.nn.Module
    boundary: Callable


def _model(p: int, rank: int) -> _Model:
    from dtcourse.models import GPT, GPTConfig
    from dtcourse.pipeline.partition import gpt_boundary_shape, split_gpt
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, d_model=16), seed=0)
    reference = copy.deepcopy(model)
    return _Model({rank: split_gpt(model, p)[rank]}, reference, gpt_boundary_shape(model))


def _run_rank(fn: Callable, ms: tuple[int, ...], progress: str) -> list:
    rank, p = dist.get_rank(), dist.get_world_size()
    return _stop_at_first_failure(((f"one_f_one_b({p}, {m})", lambda m=m: _run_case(fn, p, m, rank, progress))
                                   for m in ms), progress)


def _run_case(fn: Callable, p: int, m: int, rank: int, progress: str) -> str | None:
    from dtcourse.models import lm_loss, token_batch
    from dtcourse.pipeline.execute import PipelineExecutor, rank_actions
    schedule, problem = _student(fn, p, m, progress, catch=False)
    if problem is None:
        problem = _invalid(schedule, p, m)
    if problem:             # every rank found it; rank 0 reports it, and every rank stops here
        return f"{problem}\n    (not run on the ranks)" if rank == 0 else ""
    built = _model(p, rank)
    x, y = token_batch(built.reference.config, _BATCH, seq_len=4, seed=m)
    executor = PipelineExecutor(built.stages, p, built.boundary)
    stepped: list[int] = []           # the stages whose optimizer step ran (the executor refuses one before a B)
    executor.run(rank_actions(schedule, rank, p, p), x, y, lm_loss, m, step=stepped.append)
    lm_loss(built.reference(x), y).backward()                  # one process, the whole batch
    want = dict(built.reference.named_parameters())
    worst, where = 0.0, ""
    for name, param in built.stages[rank].named_parameters():
        if param.grad is None:
            return (f"stage {rank}'s parameter {name!r} has no gradient after your schedule ran: some micro-batch "
                    "never went back through this stage")
        diff = (param.grad - want[name].grad).abs().max().item()
        if diff > worst:
            worst, where = diff, name
    if worst > RUN_TOL:
        return (f"stage {rank}'s gradients differ from one process's on the whole batch by up to {worst:.3g} "
                f"(at {where!r}; tolerance {RUN_TOL:g}): each micro-batch must go forward and back once")
    if stepped != [rank]:
        return (f"stage {rank}'s optimizer step ran {len(stepped)} times: end rank {rank}'s list with "
                f"Action({rank}, 'STEP'), once, after its last backward" + _which_mistake(schedule, p, m, rank))
    ideal = min(p - rank, m)
    if executor.peak_held_rank > ideal:
        return (f"stage {rank} held the activations of {executor.peak_held_rank} micro-batches at once (measured by "
                f"the executor); 1F1B holds at most min(p-r, m) = min({p - rank}, {m}) = {ideal} on rank {rank}: "
                f"start the backwards after p-1-r = {p - 1 - rank} warm-up forwards, then alternate one forward "
                "and one backward" + _which_mistake(schedule, p, m, rank))
    problem = _bubble_problem(schedule, p, m)           # the same on every rank: rank 0 reports it
    return problem if not problem or rank == 0 else ""


def _bubble_problem(schedule: Schedule, p: int, m: int) -> str | None:
    """1F1B's bubble is GPipe's, (p-1)/(m+p-1): a schedule that holds less by idling more is not 1F1B. Simulated
    (t_b = 2 t_f, free messages), so the verdict is the same on any machine."""
    from dtcourse.pipeline.cost import bubble_formula
    from dtcourse.pipeline.simulate import simulate
    bubble, formula = simulate(schedule, p, m).bubble, bubble_formula("1f1b", p, m)
    if bubble <= formula + 1e-9:
        return None
    return (f"your schedule runs and holds little, but its ranks idle {bubble:.3f} of the step in simulation, "
            f"where 1F1B idles (p-1)/(m+p-1) = {formula:.3f} (one_f_one_b({p}, {m})): the warm-up forwards are "
            "what keep the later stages busy" + _which_mistake(schedule, p, m))
