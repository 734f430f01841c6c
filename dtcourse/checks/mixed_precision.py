"""Checks for exercise 04: a student's dynamic loss scaler, decision by decision against GradScaler.

``check_loss_scaler`` feeds a student's scaler and ``torch.amp.GradScaler("cpu")`` the same
stream of gradients (two copies of one model, the same batches, the same infs and NaNs
planted), and after every iteration compares what each decided: whether ``optimizer.step()``
ran, the parameters, and the scale after ``update()``. The first difference is reported with
its case and step, the expected and actual values, and, where the record shows it, the mistake:
a sequence of scales that is exactly what a known wrong rule gives (the count of clean steps not
restarted at a back-off, growth one step late, no back-off, ...), or an optimizer stepped on
gradients still multiplied by the scale, or divided by it twice::

    check_loss_scaler(DynamicLossScaler, cases=("growth", "nan"))

The student's scaler runs inside ``watching(ANSWERS)``: there the course's own
scalers (``dtcourse.mixed_precision.LossScaler`` and ``DynamicLossScaler``, their ``step``,
``update`` and ``_next_scale``) and ``torch.amp.GradScaler``, the check's reference, refuse to run
for the student's code; a class that is or subclasses the course's scaler is refused at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from dtcourse.checks.common import _as_student, _check_names, _launch_check
from dtcourse.checks.guard import Answers, watching
from dtcourse.mixed_precision import LossScaler, to_fp32
from dtcourse.runtime.refuse import ReferenceRefused

__all__ = ["check_loss_scaler", "SCALER_CASES"]

INF, NAN = math.inf, math.nan
# What these checks switch off while the student's code runs (guard.watching), and refuse to be given
ANSWERS = Answers("04", course=tuple(f"dtcourse.mixed_precision.{name}" for name in (
    "LossScaler", "LossScaler.step", "LossScaler.update", "DynamicLossScaler", "DynamicLossScaler._next_scale")),
    library={"torch.amp.GradScaler is what your scaler is compared with, so it refuses to run for your code while "
             "exercise 04's checks run: write step(), update() and _next_scale() yourself":
             (*(f"torch.amp.GradScaler.{name}" for name in ("__init__", "scale", "unscale_", "step", "update")),
              "torch._amp_update_scale_")})


@dataclass(frozen=True)
class _ScalerCase:
    description: str
    kwargs: dict = field(default_factory=dict)     # for the scaler and for GradScaler alike
    steps: int = 10
    planted: dict = field(default_factory=dict)    # step -> value written into one gradient
    loss_mult: float = 1.0                         # 0 makes every gradient 0 (and finite)
    optimizers: int = 1                            # 2: two models, two optimizers, one scaler
    unscale_first: bool = False                    # call unscale_ before step, as gradient clipping does


SCALER_CASES = {
    "growth": _ScalerCase("growth_interval=3, finite gradients: the scale doubles every 3 steps",
                          dict(growth_interval=3), steps=10),
    "nan": _ScalerCase("growth_interval=3, a NaN planted in the gradients at step 4",
                       dict(growth_interval=3), steps=12, planted={4: NAN}),
    "misuse": _ScalerCase("step() twice before update(), and update() with no step()"),
    "inf": _ScalerCase("growth_interval=3, inf at step 2, -inf at steps 6 and 7 in a row, inf at step 11",
                       dict(growth_interval=3), steps=16, planted={2: INF, 6: -INF, 7: INF, 11: INF}),
    "defaults": _ScalerCase("GradScaler's defaults (2^16, x2, x0.5, 2000 steps), inf at step 3",
                            {}, steps=6, planted={3: INF}),
    "unscale_first": _ScalerCase("unscale_() called before step() every iteration, inf at step 3",
                                 dict(growth_interval=2), steps=8, planted={3: INF}, unscale_first=True),
    "two_optimizers": _ScalerCase("two optimizers, inf in the first one's gradients at step 2",
                                  dict(growth_interval=2), steps=6, planted={2: INF}, optimizers=2),
    "fp32_rounding": _ScalerCase("init_scale=1000, growth_factor=3.3, backoff_factor=0.3, growth_interval=2, "
                                 "NaN at steps 5 and 6", dict(init_scale=1000.0, growth_factor=3.3,
                                                              backoff_factor=0.3, growth_interval=2),
                                 steps=10, planted={5: NAN, 6: NAN}),
    "growth_overflow": _ScalerCase("init_scale=2^127, growth_interval=1, zero gradients: growing would give "
                                   "inf in fp32", dict(init_scale=2.0 ** 127, growth_interval=1), steps=3,
                                   loss_mult=0.0),
}


def check_loss_scaler(cls: Callable, cases: Sequence[str] = ("growth",), timeout: float | None = None) -> None:
    """``cls(**kwargs)`` must make ``torch.amp.GradScaler``'s decisions on every case's gradient stream.

    ``cases`` are keys of ``SCALER_CASES``. In each case a 4-8-3 MLP is trained with SGD, once
    under ``cls`` and once under ``GradScaler("cpu")``, and after every iteration the check
    compares whether ``optimizer.step()`` ran, the parameters (bit for bit: both divide by
    the same fp32 scale) and ``get_scale()`` after ``update()``. Case ``"misuse"`` wants a
    ``RuntimeError`` from ``step()`` called twice before ``update()``, and from ``update()``
    with no ``step()`` since the last one. The code runs in a child process, so a loop that
    never ends fails after ``timeout`` seconds.
    """
    _check_names("check_loss_scaler", cls, cases, SCALER_CASES)
    _refuse_the_course_scaler(cls)
    _launch_check(getattr(cls, "__name__", "your scaler"), 1, _scaler_rank, (cls, tuple(cases)), timeout,
                  where="", hint="Does a loop in step() or update() never end?")


def _refuse_the_course_scaler(cls: Callable) -> None:
    """The course's scalers (``LossScaler`` and its subclasses) are exercise 04's answer."""
    if isinstance(cls, type) and issubclass(cls, LossScaler):
        course = next(k for k in cls.__mro__ if k.__module__ == LossScaler.__module__)
        which = "is" if cls is course else "subclasses"
        raise ReferenceRefused(
            f"{cls.__name__} {which} dtcourse.mixed_precision.{course.__name__}, the course's own answer to exercise "
            "04, which refuses to run while the exercise's checks run: subclass the LossScaler that the exercise's "
            "scaffold cell defines (not the library's), and write step(), update() and _next_scale() yourself.")


def _scaler_rank(cls: Callable, cases: tuple[str, ...], progress: str) -> list:
    with watching(ANSWERS):
        for name in cases:
            case = SCALER_CASES[name]
            label = f"case {name!r} ({case.description})"
            problem = (_misuse_problem if name == "misuse" else _stream_problem)(cls, case, label, progress)
            if problem:
                return [label, problem]
    Path(progress, "0").write_text("finished")
    return []


class _Side:
    """One scaler with its own copies of the models and optimizers, counting optimizer.step() calls."""

    def __init__(self, scaler, optimizers: int):
        from dtcourse.models import MLP
        self.scaler = scaler
        self.models = [MLP((4, 8, 3), seed=i) for i in range(optimizers)]
        self.optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in self.models]
        self.calls = [0] * optimizers
        self.stepped_on: list[list[torch.Tensor] | None] = [None] * optimizers    # the gradients step() saw
        for i, opt in enumerate(self.optimizers):
            opt.register_step_post_hook(lambda *_, i=i: self.calls.__setitem__(i, self.calls[i] + 1))
            opt.register_step_pre_hook(lambda opt, *_, i=i: self.stepped_on.__setitem__(
                i, [p.grad.detach().clone() for p in self.models[i].parameters()]))

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for m in self.models for p in m.parameters()]


def _stream_problem(cls: Callable, case: _ScalerCase, label: str, progress: str) -> str | None:
    from dtcourse.models import regression_batch
    note = Path(progress, "0")
    note.write_text(f"{label}, building your scaler")
    ref = _Side(torch.amp.GradScaler("cpu", **case.kwargs), case.optimizers)
    yours = _Side(_as_student(progress, lambda: cls(**case.kwargs)), case.optimizers)
    expected_scales, your_scales, history = [], [], []
    for step in range(case.steps):
        x, y = regression_batch(8, 4, 3, seed=step)
        before = list(ref.calls), list(yours.calls)
        ref.stepped_on, yours.stepped_on = [None] * case.optimizers, [None] * case.optimizers
        for side, student in ((ref, False), (yours, True)):
            note.write_text(f"{label}, step {step}")
            loss = sum(F.mse_loss(m(x), y) for m in side.models) * case.loss_mult
            scaled = _as_student(progress, lambda: side.scaler.scale(loss)) if student else side.scaler.scale(loss)
            scaled.backward()
            if step in case.planted:
                side.models[0].net[0].weight.grad[0, 0] = case.planted[step]
            for opt in side.optimizers:
                call = (lambda opt=opt: side.scaler.unscale_(opt)) if case.unscale_first else None
                if call:
                    _as_student(progress, call) if student else call()
                _as_student(progress, lambda opt=opt: side.scaler.step(opt)) if student else side.scaler.step(opt)
        for i in range(case.optimizers):
            ran, got = ref.calls[i] - before[0][i], yours.calls[i] - before[1][i]
            if ran != got:
                which = f"optimizer {i}'s step()" if case.optimizers > 1 else "optimizer.step()"
                why = (f"(a gradient was {_bad(case.planted[step])})" if step in case.planted
                       else "(the gradients overflowed)") if not ran else "(every gradient was finite)"
                yours_did = {0: "yours skipped it", 1: "yours called it"}.get(got, f"yours called it {got} times")
                return (f"step {step}: GradScaler {'called' if ran else 'skipped'} {which} {why}, but "
                        f"{yours_did}.")
        history.append([ref.calls[i] == before[0][i] for i in range(case.optimizers)])    # skipped: an overflow
        diff = max((a - b).abs().max().item() for a, b in zip(ref.params(), yours.params()))
        if not diff == 0:
            return (f"step {step}: after step() your parameters differ from GradScaler's by up to {diff:.3g}. "
                    + _unscale_mistake(ref, yours, ref.scaler.get_scale()))
        previous = ref.scaler.get_scale()
        ref.scaler.update()
        _as_student(progress, lambda: yours.scaler.update())
        want, got = ref.scaler.get_scale(), _as_student(progress, lambda: yours.scaler.get_scale())
        expected_scales.append(want)
        your_scales.append(got)
        if got != want:
            return _scale_message(step, case, previous, want, got, ref.scaler._get_growth_tracker(),
                                  expected_scales, your_scales, history)
        for opt in ref.optimizers + yours.optimizers:
            opt.zero_grad(set_to_none=True)
    return None


def _unscale_mistake(ref: _Side, yours: _Side, scale: float) -> str:
    """Why the parameters differ, when the gradients each optimizer.step() saw show it."""
    for want, got in zip(ref.stepped_on, yours.stepped_on):
        if want is None or got is None:
            continue

        def close(factor: float) -> bool:
            return all(torch.allclose(g, w * factor, rtol=1e-6, atol=0) for g, w in zip(got, want))

        if close(scale):
            return (f"optimizer.step() ran on gradients still multiplied by the scale ({scale:g}): step() must "
                    "unscale them first, by calling unscale_(optimizer) unless it was called this iteration.")
        if close(1 / scale):
            return (f"optimizer.step() ran on gradients divided by the scale ({scale:g}) twice: each gradient must be "
                    "unscaled exactly once (step() calls unscale_() only if it has not been called this iteration).")
    return ("Each gradient must be unscaled exactly once (step() calls unscale_() only if it has not been called "
            "this iteration).")


@dataclass(frozen=True)
class _Rule:
    """A way to choose the next scale: GradScaler's with the defaults, and known mistakes otherwise."""

    backoff: str = "multiply"          # "multiply" by backoff_factor, "divide" by it, or "none"
    reset_on_backoff: bool = True      # the count of clean steps restarts at a back-off
    count_overflow: bool = False       # an overflowing step adds to the count of clean steps
    grow_at: str = "=="                # "==" growth_interval, ">" (one late), "early" (one early), ">=" (every step)
    reset_on_growth: bool = True
    any_optimizer: bool = True         # an inf in any optimizer's gradients counts (False: only the last's)

    def scales(self, kwargs: dict, history: list[list[bool]]) -> list[float]:
        """The scale after each update(), for the skipped-or-not flags of each optimizer in ``history``."""
        scale, tracker, out = to_fp32(kwargs.get("init_scale", 2.0 ** 16)), 0, []
        growth, backoff = kwargs.get("growth_factor", 2.0), kwargs.get("backoff_factor", 0.5)
        interval = kwargs.get("growth_interval", 2000)
        for flags in history:
            if any(flags) if self.any_optimizer else flags[-1]:
                scale = {"multiply": to_fp32(scale * backoff), "divide": to_fp32(scale / backoff),
                         "none": scale}[self.backoff]
                tracker = tracker + 1 if self.count_overflow else 0 if self.reset_on_backoff else tracker
            else:
                tracker += 1
                grows = {"==": tracker == interval, ">": tracker == interval + 1, "early": tracker == interval - 1,
                         ">=": tracker >= interval}[self.grow_at]
                if grows:
                    grown = to_fp32(scale * growth)
                    scale = grown if math.isfinite(grown) else scale
                    tracker = 0 if self.reset_on_growth else tracker
            out.append(scale)
        return out


_MISTAKES = [   # the first one differs from GradScaler only with two optimizers or more
    (_Rule(any_optimizer=False), "looks only at the last optimizer's gradients: it must back off when any "
                                 "optimizer's gradients held an inf or NaN"),
    (_Rule(reset_on_backoff=False), "does not restart its count of clean steps at a back-off (after an inf or NaN "
                                    "the count starts again from 0)"),
    (_Rule(count_overflow=True), "counts a step that overflowed as a clean one (it backs off, and the count of "
                                 "clean steps starts again from 0)"),
    (_Rule(grow_at=">=", reset_on_growth=False), "does not restart its count after growing, and so grows after "
                                                 "every clean step from then on"),
    (_Rule(reset_on_growth=False), "does not restart its count after growing, and so never grows again"),
    (_Rule(grow_at=">"), "grows one step late, after growth_interval + 1 clean steps instead of growth_interval"),
    (_Rule(grow_at="early"), "grows one step early, after growth_interval - 1 clean steps instead of "
                             "growth_interval"),
    (_Rule(backoff="none"), "keeps the scale when a step overflows, instead of multiplying it by backoff_factor"),
    (_Rule(backoff="none", reset_on_backoff=False), "ignores overflows in update(): it keeps the scale and the "
                                                    "count of clean steps"),
    (_Rule(backoff="divide"), "divides the scale by backoff_factor at a back-off instead of multiplying by it"),
]


def _bad(value: float) -> str:
    return "NaN" if math.isnan(value) else "-inf" if value < 0 else "inf"


def _scale_message(step: int, case: _ScalerCase, previous: float, want: float, got: object, tracker: int,
                   expected: list[float], yours: list[object], history: list[list[bool]]) -> str:
    interval = case.kwargs.get("growth_interval", 2000)
    if want < previous:
        reason = "backed off: this iteration's gradients held an inf or NaN"
    elif want > previous:
        reason = f"grown: {interval} clean steps in a row"
    elif tracker == 0:
        reason = (f"unchanged: the count of clean steps reached growth_interval ({interval}), but the grown "
                  "scale would be inf in fp32, so it is not applied")
    else:
        reason = f"unchanged: {tracker} of {interval} clean steps in a row"
    shown = slice(max(0, len(expected) - 6), len(expected))
    message = (f"step {step}: after update() the scale should be {want!r} ({reason}), yours is {got!r}.\n"
               f"    scales after each update, from step {shown.start}:\n"
               f"      GradScaler {expected[shown]}\n"
               f"      yours      {yours[shown]}")
    if isinstance(got, float) and not math.isnan(got) and to_fp32(got) != got:     # a float64 scale, not fp32
        how = "differs only in rounding" if to_fp32(got) == want else "is not a float32 value"
        message += (f"\n    hint: yours {how}: GradScaler keeps its scale in fp32. Store a new scale as "
                    "self._scale = to_fp32(...), and test a grown one with math.isfinite(to_fp32(...)).")
    named = [what for rule, what in _MISTAKES if rule.scales(case.kwargs, history) == yours]
    if named:
        message += ("\n    Every scale of yours so far is exactly what a scaler gets that "
                    + "; or that ".join(named) + ".")
    return message


def _misuse_problem(cls: Callable, case: _ScalerCase, label: str, progress: str) -> str | None:
    from dtcourse.models import regression_batch
    note = Path(progress, "0")
    note.write_text(f"{label}, building your scaler")
    side = _Side(_as_student(progress, lambda: cls()), 1)
    opt = side.optimizers[0]
    note.write_text(f"{label}: update() before any step()")
    problem = _expect_runtime_error(progress, lambda: side.scaler.update(),
                                    "update() with no step() since the last update()")
    if problem:
        return problem
    x, y = regression_batch(8, 4, 3)
    _as_student(progress, lambda: side.scaler.scale(F.mse_loss(side.models[0](x), y))).backward()
    note.write_text(f"{label}: the first step()")
    _as_student(progress, lambda: side.scaler.step(opt))
    note.write_text(f"{label}: a second step() before update()")
    return _expect_runtime_error(progress, lambda: side.scaler.step(opt), "step() called twice before update()")


def _expect_runtime_error(progress: str, call: Callable, what: str) -> str | None:
    try:
        call()
    except NotImplementedError:                # a RuntimeError too, but it is the stub:
        return _as_student(progress, call)     # report it as the student's error
    except RuntimeError:
        return None
    except Exception as exc:                   # noqa: BLE001 - any other type is the student's mistake
        return f"{what} should raise RuntimeError, but yours raised {type(exc).__name__}: {exc}"
    return f"{what} should raise RuntimeError, but yours returned normally."
