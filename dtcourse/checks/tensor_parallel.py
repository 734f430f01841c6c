"""Checks for exercise 09: a student's Megatron f and g, ``ColumnParallelLinear`` and ``RowParallelLinear``.

The student writes Megatron's ``f`` (identity forward, all-reduce backward) and ``g`` (all-reduce forward,
identity backward) as autograd functions, applied by ``copy_to_tensor_parallel(x, group)`` and
``reduce_from_tensor_parallel(x, group)`` as in ``dtcourse.tensor_parallel``, and two layers cut from
the full serial ``nn.Linear`` (Shoeybi et al., arXiv 1909.08053, section 3):
``ColumnParallelLinear(full, group)`` keeps rows [r·out/t, (r+1)·out/t) of ``full.weight`` and of its bias
and calls f on its input;
``RowParallelLinear(full, group)`` keeps columns [r·in/t, (r+1)·in/t) of ``full.weight`` and the whole
bias, and calls g on its partial sum before adding the bias once. Four checks::

    check_column_parallel(ColumnParallelLinear, cases=("small",))

* ``check_f_and_g``: f and g alone: their outputs and gradients, and the collectives each starts in
  forward and in backward (one all-reduce where the operator has one, on the group, of the tensor's bytes);
* ``check_column_parallel``: what each rank holds (its rows, as a copy: no more bytes than its slice),
  its slice of the serial output, the whole input gradient on every rank (f's all-reduce), its slice of the
  weight and bias gradients, one all-reduce in backward and none forward, and a ValueError when t does not
  divide the output features;
* ``check_row_parallel``: the same for the row layer: its columns and the whole bias, the whole serial
  output on every rank (g's all-reduce, the bias once), its slice of the input gradient, one all-reduce
  forward and none backward, a ValueError when t does not divide the input features;
* ``check_parallel_mlp``: column, GELU, row against the serial MLP on every rank, with exactly one
  all-reduce of B·T·C floats forward and one backward per rank, and nothing else sent.

A failure names the rank (and its place in its group), the tensor (output, input gradient, weight or bias
gradient) and how far it is, with a hint for the usual mistakes: f's backward without its all-reduce,
g's backward with one, a split along the wrong dimension, the row layer's bias added on every rank, a
collective on the default group instead of the one passed in. The ranks of a group mostly make the same
mistake: each distinct hint is printed once in a message, on the first rank that shows it, and a later rank
that repeats it says what its tensor is and points to that rank's line. Every rank builds the serial layer from
the same seed, so each computes what it expects with no communication. While the student's code runs,
``dtcourse.tensor_parallel``'s layers and operators refuse to run (``guard.watching``).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._C._distributed_c10d import ProcessGroup

from dtcourse.checks.common import (_as_student, _check_names, _GroupPlace, _launch_check,
                                     _refuse_library_code, _SideBySide, _stop_at_first_failure, _student_error)
from dtcourse.checks.guard import Answers, _nbytes, watching
from dtcourse.checks.messages import Hint

__all__ = ["check_f_and_g", "check_column_parallel", "check_row_parallel", "check_parallel_mlp", "TP_CASES",
           "TP_TOL"]

# What these checks switch off while the student's code runs (guard.watching), and refuse to be given
ANSWERS = Answers("09", course=("dtcourse.tensor_parallel.layers.ColumnParallelLinear",
                                "dtcourse.tensor_parallel.layers.RowParallelLinear",
                                "dtcourse.tensor_parallel.communications.copy_to_tensor_parallel",
                                "dtcourse.tensor_parallel.communications.reduce_from_tensor_parallel"),
                  library={"dtcourse.tensor_parallel's f and g are switched off while exercise 09's checks run: the "
                           "exercise asks you to write them yourself":   # the autograd functions behind f and g
                           ("dtcourse.tensor_parallel.communications._CopyToTensorParallel.apply",
                            "dtcourse.tensor_parallel.communications._ReduceFromTensorParallel.apply")})


class _Case(_SideBySide):
    """``_Case(world, t)``: groups of t ranks side by side."""

    symbol = "t"

    @property
    def t(self) -> int:       # tensor-parallel size
        return self.size


TP_CASES = {
    "small": ("t = 2 and t = 3", (_Case(2, 2), _Case(3, 3))),
    "large": ("two groups of t = 2 on 4 ranks, and t = 4", (_Case(4, 2), _Case(4, 4))),
}
B, T, C, H = 2, 3, 6, 24      # activations (B, T, C); the MLP's hidden size H = 4C divides by t = 2, 3, 4
# float32. The column layer's matmul on a slice of the weight, and the all-reduce of t partial products
# where one process takes one matmul: the same terms summed in another order, a few ulps. Measured with
# the solution over every case: at most 4.8e-7. A real mistake is off by a whole partial sum, around 0.1.
TP_TOL = 1e-5

_ADVICE = "Write it yourself, in the exercise's cell, and pass that."
_HINT = ("This is most likely a deadlock: a rank waits in an all-reduce that another rank of its group never "
         "started. Every rank of the group must run the same collectives, in the same order, on the same group. "
         "Raise timeout= only if your code is merely slow.")


_F_OWN = Hint("it is this rank's own gradient, not the sum over the group",
               "f's backward must all-reduce it (every rank used the whole input, so each holds one part of its "
               "gradient)")
_F_BACKWARD = Hint("it is this rank's own partial gradient, through its slice of the layer only",
                    "f's backward must all-reduce the input's gradient over the group (every rank used the whole "
                    "input, so each holds one part of its gradient)")
_F_FORWARD = Hint("it is what t times the input gives",
                   "f's forward all-reduced the input, but every rank already holds the whole input. f's forward is "
                   "the identity")
_G_FORWARD = Hint("it is this rank's partial sum X_r A_r, not the sum over the group",
                   "g's forward must all-reduce the partial sums over the group")
_G_BACKWARD = Hint("it is t times the serial layer's",
                    "g's backward all-reduced a gradient that every rank of the group already holds whole (everything "
                    "after g is replicated), so the sum counts it t times. g's backward is the identity")
_BIAS = Hint("it is the serial output plus (t-1) times the bias",
              "each rank added the bias before the all-reduce, so the sum holds it t times. Add it once, after g")
_WHOLE_OUTPUT = Hint("the whole output", "the column layer's output stays split, each rank its out/t features")
_WHOLE_WEIGHT = Hint("that is the whole weight", "keep only this rank's slice", "; ")
_TRANSPOSE = Hint("that is the transpose", "keep nn.Linear's layout (out, in) and use F.linear", "; ")
_WHOLE_BIAS = Hint("the output is whole on every rank after g",
                    "so every rank keeps the whole bias and adds it once, after the all-reduce", ", ")
# the hints that read the same on every rank: printed once (common.hints_once)
_HINTS = (_F_OWN, _F_BACKWARD, _F_FORWARD, _G_FORWARD, _G_BACKWARD, _BIAS, _WHOLE_OUTPUT, _WHOLE_WEIGHT, _TRANSPOSE,
          _WHOLE_BIAS)
# --------------------------------------------------------------------------- #
# One case on this rank: its group, and every collective its code starts
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class _Call:
    op: str          # "all-reduce", "all-gather", "reduce-scatter", "send", or the process group's method
    nbytes: int      # the whole tensor: the all-reduced one, the all-gather's output, the message
    on: str          # "the group", "the default group (all N ranks)" or "another group"
    phase: str

    def __str__(self) -> str:
        return f"{'an' if self.op[0] in 'aeiou' else 'a'} {self.op} of {self.nbytes} B on {self.on}"


def _op(method: str) -> str:
    if "allreduce" in method:
        return "all-reduce"
    if "allgather" in method or "all_gather" in method:
        return "all-gather"
    return "reduce-scatter" if "reduce_scatter" in method else method


class _Place(_GroupPlace):
    """This rank in a case: its tensor-parallel group, its rank r in it, and a log of what it sends."""

    advice = ("give group=group to dist.all_reduce, and dist.get_rank(group), dist.get_world_size(group) for r "
              "and t")

    def __init__(self, case: _Case, progress: str):
        super().__init__(case, progress, phase="construction")
        self.t = case.t

    def slice(self, size: int) -> slice:
        n = size // self.t
        return slice(self.r * n, (self.r + 1) * n)

    def _call(self, method: str, pg: ProcessGroup, args: tuple) -> _Call:
        return _Call(_op(method), max([_nbytes(a) for a in args[:2]] + [0]), self._on(pg), self.phase)

    def traffic(self, what: str, want: torch.Tensor | None, why: str) -> str | None:
        """None if ``phase`` started exactly one all-reduce of ``want``'s bytes on the group (nothing if None)."""
        found = [c for c in self.calls if c.phase == self.phase]
        if want is None and not found:
            return None
        if want is not None and [(c.op, c.nbytes, c.on) for c in found] == [("all-reduce", want.nbytes, "the group")]:
            return None
        expected = "nothing" if want is None else (
            f"one all-reduce of {want.nbytes} B ({tuple(want.shape)} float32) on the group, each rank sending "
            f"2(t-1)/t of it, {2 * (self.t - 1) * want.nbytes // self.t} B, with a ring")
        listed = ", ".join(map(str, found))
        listed = f"{len(found)} collectives ({listed})" if len(found) > 1 else listed or "no collective"
        return f"{what} started {listed}; expected {expected}: {why}"


def _randn(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _linear(n_in: int, n_out: int, seed: int) -> nn.Linear:
    torch.manual_seed(seed)           # the same full layer on every rank
    return nn.Linear(n_in, n_out)


# --------------------------------------------------------------------------- #
# What a rank holds, and how a tensor differs from the serial layer's
# --------------------------------------------------------------------------- #
def _mismatch(name: str, got: object, want: torch.Tensor, hints: Sequence[tuple[torch.Tensor, _Hint]] = (),
              than: str = "the serial layer's") -> str | None:
    if not isinstance(got, torch.Tensor):
        return (f"{name} is {type(got).__name__}, not a tensor" + (": did something return None, or did autograd "
                "never reach it (a .detach() on the way)?" if got is None else ""))
    if tuple(got.shape) != tuple(want.shape):
        return f"{name} has shape {tuple(got.shape)}; expected {tuple(want.shape)}"
    diff = (got.detach().float() - want).abs().max().item()
    if diff <= TP_TOL:                                    # False for NaN too
        return None
    close = [hint for other, hint in hints if torch.allclose(got.detach().float(), other, rtol=1e-4, atol=TP_TOL)]
    found = close[0] if close else None
    return (f"{name} differs from {than} by up to {diff:.3g} (tolerance {TP_TOL:g})"
            + (f": {found}" if found else ""))


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _held(layer: nn.Module) -> int:
    """Bytes of every storage the layer keeps: its parameters, buffers and tensor attributes, views counted whole."""
    tensors = [*layer.parameters(), *layer.buffers()]
    tensors += [v for m in layer.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
    return sum(dict(_storage(t) for t in tensors).values())


def _held_problem(layer: object, name: str, full: nn.Linear, dim: int, place: _Place) -> str | None:
    """``layer`` must hold, as nn.Parameters, a copy of this rank's slice of ``full`` along ``dim``, and no more."""
    if not isinstance(layer, nn.Module):
        return f"{name}(full, group) built a {type(layer).__name__}; it must be an nn.Module (subclass nn.Module)"
    cut = place.slice(full.weight.shape[dim])
    weight = full.weight.detach()
    want = {"weight": weight.narrow(dim, cut.start, cut.stop - cut.start),
            "bias": full.bias.detach()[cut] if dim == 0 else full.bias.detach()}
    what = {0: f"rows [{cut.start}, {cut.stop}) of the full weight (out, in): the output features",
            1: f"columns [{cut.start}, {cut.stop}) of the full weight (out, in): the input features"}[dim]
    params = list(layer.parameters())
    for attr, expected in want.items():
        got = getattr(layer, attr, None)
        if not isinstance(got, torch.Tensor) or not any(got is p for p in params):
            return (f"{name}.{attr} is {type(got).__name__}; it must be an nn.Parameter of the layer, "
                    f"{tuple(expected.shape)}, so that an optimizer finds it in parameters()")
        if got.shape != expected.shape:
            hint = ""
            if attr == "weight" and tuple(got.shape) == tuple(full.weight.shape):
                hint = f": {_WHOLE_WEIGHT}"
            elif attr == "weight" and got.dim() == 2 and got.shape[dim] == full.weight.shape[dim]:
                other = ("RowParallelLinear", "ColumnParallelLinear")[dim]
                hint = (f": you split dimension {1 - dim} of nn.Linear's weight (out, in), the "
                        f"{('input', 'output')[dim]} features, which is {other}'s split. {name} keeps {what}")
            elif attr == "weight" and tuple(got.shape) == tuple(expected.shape[::-1]):
                hint = f": {_TRANSPOSE}"
            elif place.rank != place.r and got.shape[dim] < expected.shape[dim]:
                hint = (f": this is rank {place.rank} of the world but rank {place.r} of its group: r is "
                        "dist.get_rank(group), the rank within the tensor-parallel group")
            elif attr == "bias" and dim == 1:
                hint = f": {_WHOLE_BIAS}"
            return f"{name}.{attr} has shape {tuple(got.shape)}; expected {tuple(expected.shape)}{hint}"
        if not torch.equal(got.detach(), expected):
            n = got.shape[dim] if attr == "weight" else 0
            other = next((k for k in range(place.t) if n and k != place.r
                          and torch.equal(got.detach(), weight.narrow(dim, k * n, n))), None)
            where = (f": it is rank {other}'s slice; this rank is rank {place.r} of its group (dist.get_rank(group))"
                     if other is not None else "")
            return (f"{name}.{attr} holds other values than this rank's slice of the full layer's "
                    f"({what if attr == 'weight' else 'the bias'}){where}")
        if _storage(got)[1] > got.nbytes:
            return (f"{name}.{attr} is a view into a storage of {_storage(got)[1]} B, the full layer's, not a copy of "
                    f"its {got.nbytes} B slice: the full {attr} stays in memory on every rank. Clone the slice")
    held, mine = _held(layer), sum(t.nbytes for t in want.values())
    if held > mine:
        return (f"{name} keeps {held} B of tensors; this rank's weight and bias are {mine} B: keep only them, not the "
                "full layer or a copy of its weight (each rank holds 1/t of the weight, that is the point)")
    return None


def _divides_problem(cls: Callable, name: str, full: nn.Linear, features: str, place: _Place) -> str | None:
    """``cls(full, group)`` must raise a ValueError: t does not divide ``full``'s split dimension."""
    call = f"{name}(nn.Linear({full.in_features}, {full.out_features}), group) with t = {place.t}"
    try:
        cls(full, place.group)
    except ValueError:
        return None
    except Exception as exc:
        return f"{call} raised {_student_error(exc)}; expected a ValueError naming the sizes"
    return (f"{call} built a layer, but t = {place.t} does not divide its {features}: the ranks' slices "
            "cannot be equal. Raise a ValueError that names the sizes")


# --------------------------------------------------------------------------- #
# The checks
# --------------------------------------------------------------------------- #
def _launch(check: str, label: str, rank_case: Callable, students: tuple, cases: Sequence[str],
            timeout: float | None) -> None:
    for student in students:
        _check_names(check, student, cases, TP_CASES)
        _refuse_library_code(check, student, ANSWERS.exercise, _ADVICE)
    chosen = [case for name in cases for case in TP_CASES[name][1]]
    for world in sorted({case.world for case in chosen}):
        mine = tuple(case for case in chosen if case.world == world)
        _launch_check(label, world, _rank, (rank_case, students, mine), timeout, where=f" on {world} ranks",
                           hint=_HINT, inline=_HINTS)


def _rank(rank_case: Callable, students: tuple, cases: tuple[_Case, ...], progress: str) -> list:
    def run(case: _Case) -> str | None:
        place = _Place(case, progress)
        problem = rank_case(*students, place, progress)
        return f"{place.who()}{problem}{place.group_hint()}" if problem else None
    return _stop_at_first_failure(((str(case), partial(run, case)) for case in cases), progress)


def check_f_and_g(f: Callable, g: Callable, cases: Sequence[str] = ("small",), timeout: float | None = None) -> None:
    """``f(x, group)`` and ``g(x, group)``: Megatron's two operators, alone, on every group of ``cases``.

    The exercise calls them ``copy_to_tensor_parallel`` and ``reduce_from_tensor_parallel``, the library's
    names; messages name each call by the function's own name.

    f's input is the same on the group's ranks, and each rank's upstream gradient its own: f must return
    x, start nothing forward, and backward give x the sum of the ranks' gradients with one all-reduce of
    x's bytes on ``group``. g's input differs per rank (partial sums) and its upstream gradient is the same on
    the group's ranks: g must return the sum with one all-reduce forward, and backward pass the gradient
    through, starting nothing.
    """
    _launch("check_f_and_g", "the pair f, g", _f_and_g_case, (f, g), cases, timeout)


def _f_and_g_case(f: Callable, g: Callable, place: _Place, progress: str) -> str | None:
    x = _randn((B, T, C), place.seed + 1).requires_grad_()                    # the whole input, on every rank
    ups = [_randn((B, T, C), place.seed + 10 + k) for k in range(place.t)]     # f's upstream gradient, per rank
    parts = [_randn((B, T, C), place.seed + 20 + k) for k in range(place.t)]   # g's input: partial sums
    grad = _randn((B, T, C), place.seed + 30)                                   # g's upstream gradient, replicated
    mine = parts[place.r].clone().requires_grad_()
    f_call, g_call = (f"{getattr(fn, '__name__', name)}(x, group)" for fn, name in ((f, "f"), (g, "g")))
    cut = "autograd never reaches {0}'s backward: return what your autograd.Function's apply returns"
    with watching(ANSWERS), place.recording():
        place.at("f's forward")
        y = _as_student(progress, lambda: f(x, place.group))
        problem = (_mismatch(f_call, y, x.detach(), [(place.t * x.detach(), _F_FORWARD)], than="x")
                   or place.traffic("f's forward", None, "f is the identity forward"))
        if problem or not y.requires_grad:
            return problem or f"{f_call} (f) returned a tensor that does not require grad: {cut.format('f')}"
        place.at("f's backward")
        _as_student(progress, lambda: y.backward(ups[place.r]))
        problem = (_mismatch("x.grad after f's backward", x.grad, sum(ups), [(ups[place.r], _F_OWN)],
                             than="the sum of the group's gradients")
                   or place.traffic("f's backward", x, "f's backward sums the ranks' gradients of the input"))
        if problem:
            return problem
        place.at("g's forward")
        z = _as_student(progress, lambda: g(mine, place.group))
        problem = (_mismatch(g_call, z, sum(parts), [(parts[place.r], _G_FORWARD)],
                             than="the sum of the group's inputs")
                   or place.traffic("g's forward", mine, "g sums the ranks' partial sums"))
        if problem or not z.requires_grad:
            return problem or f"{g_call} (g) returned a tensor that does not require grad: {cut.format('g')}"
        if not torch.equal(mine.detach(), parts[place.r]):
            return (f"{g_call} (g) changed its input x: dist.all_reduce works in place, so all-reduce a copy "
                    "(x.clone()); the caller's partial sum may still be needed")
        place.at("g's backward")
        _as_student(progress, lambda: z.backward(grad))
        return (_mismatch("x.grad after g's backward", mine.grad, grad, [(place.t * grad, _G_BACKWARD)],
                          than="the gradient of g's output")
                or place.traffic("g's backward", None, "g's backward is the identity"))


def check_column_parallel(cls: Callable, cases: Sequence[str] = ("small",), timeout: float | None = None) -> None:
    """``cls(full, group)`` for ``full = nn.Linear(6, 24)``, against ``full`` itself on every rank.

    Rank r of the group must hold rows [r·24/t, (r+1)·24/t) of the weight and bias, copied; its output must be
    those columns of the serial output; after backward (each rank given its columns of the output's gradient),
    x.grad must be the serial layer's whole input gradient and weight.grad, bias.grad its rows of the serial
    ones. Forward sends nothing, backward one all-reduce of x's bytes on the group. With 25 output features,
    which no t divides, ``cls`` must raise a ValueError.
    """
    _launch("check_column_parallel", getattr(cls, "__name__", "your class"), _column_case, (cls,), cases, timeout)


def _column_case(cls: Callable, place: _Place, progress: str) -> str | None:
    name, full, rows = "ColumnParallelLinear", _linear(C, H, seed=1), place.slice(H)
    serial, x, up = copy.deepcopy(full), _randn((B, T, C), place.seed + 1), _randn((B, T, H), place.seed + 2)
    xs = x.clone().requires_grad_()
    out = serial(xs)
    out.backward(up)
    partial_grad = up[..., rows] @ full.weight.detach()[rows]               # (B, T, C): through this slice only
    xin = x.clone().requires_grad_()
    with watching(ANSWERS), place.recording():
        layer = _as_student(progress, lambda: cls(full, place.group))
        problem = (place.traffic(f"{name}(full, group)", None, "every rank cuts its slice from the same full layer")
                   or _held_problem(layer, name, serial, 0, place))
        if problem:
            return problem
        place.at("forward")
        y = _as_student(progress, lambda: layer(xin))
        summed = F.linear(place.t * x, serial.weight.detach()[rows], serial.bias.detach()[rows])   # f summed x
        problem = _mismatch("the output", y, out.detach()[..., rows], [(summed, _F_FORWARD)])
        if problem and isinstance(y, torch.Tensor) and tuple(y.shape) == tuple(out.shape):
            problem += f", {_WHOLE_OUTPUT}"
        problem = problem or place.traffic("the forward", None, "f's forward is the identity")
        if problem:
            return problem
        place.at("backward")
        _as_student(progress, lambda: y.backward(up[..., rows]))
        problem = (_mismatch("the input gradient x.grad", xin.grad, xs.grad, [(partial_grad, _F_BACKWARD)])
                   or _mismatch("the weight gradient weight.grad", layer.weight.grad, serial.weight.grad[rows])
                   or _mismatch("the bias gradient bias.grad", layer.bias.grad, serial.bias.grad[rows])
                   or place.traffic("the backward", xin, "f's backward sums the ranks' parts of x's gradient"))
        if problem:
            return problem
        place.at("a size t does not divide")
        return _divides_problem(cls, name, nn.Linear(C, H + 1), f"{H + 1} output features", place)


def check_row_parallel(cls: Callable, cases: Sequence[str] = ("small",), timeout: float | None = None) -> None:
    """``cls(full, group)`` for ``full = nn.Linear(24, 6)``, against ``full`` itself on every rank.

    Rank r of the group must hold columns [r·24/t, (r+1)·24/t) of the weight, copied, and the whole bias; given
    its columns of the input, its output must be the serial output, whole; after backward (the output's gradient
    the same on the group's ranks), x.grad must be its columns of the serial input gradient, weight.grad its
    columns of the serial one and bias.grad the serial one. Forward sends one all-reduce of the output's bytes
    on the group, backward nothing. With 25 input features, ``cls`` must raise a ValueError.
    """
    _launch("check_row_parallel", getattr(cls, "__name__", "your class"), _row_case, (cls,), cases, timeout)


def _row_case(cls: Callable, place: _Place, progress: str) -> str | None:
    name, full, cols = "RowParallelLinear", _linear(H, C, seed=2), place.slice(H)
    serial, x, up = copy.deepcopy(full), _randn((B, T, H), place.seed + 1), _randn((B, T, C), place.seed + 2)
    xs = x.clone().requires_grad_()
    out = serial(xs)
    out.backward(up)
    xin = x[..., cols].clone().requires_grad_()
    partial_out = F.linear(x[..., cols], full.weight.detach()[:, cols])       # this rank's partial sum
    with watching(ANSWERS), place.recording():
        layer = _as_student(progress, lambda: cls(full, place.group))
        problem = (place.traffic(f"{name}(full, group)", None, "every rank cuts its slice from the same full layer")
                   or _held_problem(layer, name, serial, 1, place))
        if problem:
            return problem
        place.at("forward")
        y = _as_student(progress, lambda: layer(xin))
        bias = full.bias.detach()
        hints = [(partial_out + bias, _G_FORWARD), (partial_out, _G_FORWARD),
                 (out.detach() + (place.t - 1) * bias, _BIAS)]
        problem = (_mismatch("the output", y, out.detach(), hints)
                   or place.traffic("the forward", out, "g sums the ranks' partial sums"))
        if problem:
            return problem
        place.at("backward")
        _as_student(progress, lambda: y.backward(up))
        want = xs.grad[..., cols], serial.weight.grad[:, cols], serial.bias.grad
        problem = (_mismatch("the input gradient x.grad", xin.grad, want[0], [(place.t * want[0], _G_BACKWARD)])
                   or _mismatch("the weight gradient weight.grad", layer.weight.grad, want[1],
                                [(place.t * want[1], _G_BACKWARD)])
                   or _mismatch("the bias gradient bias.grad", layer.bias.grad, want[2])
                   or place.traffic("the backward", None, "g's backward is the identity"))
        if problem:
            return problem
        place.at("a size t does not divide")
        return _divides_problem(cls, name, nn.Linear(H + 1, C), f"{H + 1} input features", place)


def check_parallel_mlp(column: Callable, row: Callable, cases: Sequence[str] = ("small",),
                       timeout: float | None = None) -> None:
    """``row(F.gelu(column(x)))`` for an MLP C -> 4C -> C, against the serial MLP on every rank.

    Each rank holds its slices only; the output is the serial MLP's and x.grad its input gradient, whole, on
    every rank; every weight and bias gradient is this rank's slice of the serial one. A rank sends exactly one
    all-reduce of B·T·C floats forward (g) and one backward (f), and nothing else: no all-gather of the
    weights or of the hidden activations (B, T, 4C/t).
    """
    label = f"the MLP of {getattr(column, '__name__', 'your class')}, GELU, {getattr(row, '__name__', 'your class')}"
    _launch("check_parallel_mlp", label, _mlp_case, (column, row), cases, timeout)


def _mlp_case(column: Callable, row: Callable, place: _Place, progress: str) -> str | None:
    fc, proj, cut = _linear(C, H, seed=3), _linear(H, C, seed=4), place.slice(H)
    serial = nn.Sequential(copy.deepcopy(fc), nn.GELU(), copy.deepcopy(proj))
    x, up = _randn((B, T, C), place.seed + 1), _randn((B, T, C), place.seed + 2)
    xs = x.clone().requires_grad_()
    out = serial(xs)
    out.backward(up)
    xp = x.clone().requires_grad_()                                            # the gradient through this slice only
    (F.linear(F.gelu(F.linear(xp, fc.weight.detach()[cut], fc.bias.detach()[cut])), proj.weight.detach()[:, cut])
     * up).sum().backward()
    xin = x.clone().requires_grad_()
    with watching(ANSWERS), place.recording():
        layers = _as_student(progress, lambda: (column(fc, place.group), row(proj, place.group)))
        problem = (place.traffic("building the layers", None, "every rank cuts its slices from the same full layers")
                   or _held_problem(layers[0], "ColumnParallelLinear", serial[0], 0, place)
                   or _held_problem(layers[1], "RowParallelLinear", serial[2], 1, place))
        if problem:
            return problem
        place.at("forward")
        y = _as_student(progress, lambda: layers[1](F.gelu(layers[0](xin))))
        twice = out.detach() + (place.t - 1) * proj.bias.detach()
        problem = (_mismatch("the MLP's output", y, out.detach(), [(twice, _BIAS)])
                   or place.traffic("the forward", out, "one all-reduce per column-row pair, g's, of B·T·C floats"))
        if problem:
            return problem
        place.at("backward")
        _as_student(progress, lambda: y.backward(up))
        wants = [("the input gradient x.grad", xin.grad, xs.grad, [(xp.grad, _F_BACKWARD)])]
        for i, layer, what, rows in ((0, layers[0], "ColumnParallelLinear's", (cut,)),
                                     (2, layers[1], "RowParallelLinear's", (slice(None), cut))):
            w = serial[i].weight.grad[rows]
            b = serial[i].bias.grad[cut] if i == 0 else serial[i].bias.grad
            wants += [(f"{what} weight gradient", layer.weight.grad, w, []),
                      (f"{what} bias gradient", layer.bias.grad, b, [])]
        for what, got, want, hints in wants:
            problem = _mismatch(what, got, want, [*hints, (place.t * want, _G_BACKWARD)])
            if problem:
                return problem
        return place.traffic("the backward", xin, "one all-reduce per column-row pair, f's, of B·T·C floats")
