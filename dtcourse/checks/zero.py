"""Checks for exercise 06: a student's ZeRO stage-2 step, against one process and against the algorithm.

The student's class (``ZeroBase``'s subclass in the exercise) is built as
``cls(module, optimizer, units)`` on every rank, ``units`` the names of the submodules whose
parameters travel together, as ``dtcourse.zero.ZeRO`` takes them. ``ZeroBase`` lays each unit out
as the library does (``dtcourse.zero.build_units``): one ``FlatShard`` per unit, its parameters end to
end in one vector padded to N·s elements, s = ceil(Ψ_u / N), rank r owning elements [r·s, (r+1)·s).
The checks build the same layout on a copy of the model and hold the student's flats against it.
Four checks::

    check_zero_gradients(ZeroStage2, world_sizes=(2,), cases=("mlp",))

* ``check_zero_gradients``: after one ``backward()``, every ``flat.grad`` holds this rank's part of
  the mean gradient over all ranks (one process on the whole batch);
* ``check_zero_memory``: the technique in backward: each flat is reduce-scattered, once, in the hook
  that completes it, with an input of its padded bytes; its parameters' ``.grad`` are gone by then,
  and afterwards the wrapper holds no tensor the size of a whole flat's gradient;
* ``check_zero_parity``: after several steps of SGD (momentum) and of AdamW, the parameters equal
  one process's trained on the whole batch;
* ``check_zero_traffic``: what a rank sends in one step, (N-1)/N·Ψ·4 bytes in reduce-scatters during
  backward plus as much in all-gathers in ``step()``, flat by flat, and that the optimizer holds
  only this rank's parts and their states.

Every collective and message the student's code starts is recorded by ``dtcourse.runtime.observe``;
what it sends is what a bandwidth-optimal algorithm sends (``collectives.cost.ring_bytes_sent``),
since the backend's own messages are invisible from Python. While the student's code runs,
``dtcourse.zero.ZeRO`` and its stage-2 methods refuse to run (``guard.watching``), and passing one of
them to a check is refused too; ``FlatShard`` and the units are the exercise's scaffolding.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from dtcourse.checks.common import (_as_student, _check_names, _launch_check, _refuse_library_code,
                                     _stop_at_first_failure)
from dtcourse.checks.guard import Answers, watching
from dtcourse.collectives.cost import ring_bytes_sent
from dtcourse.runtime.observe import CommLog, Record, observe
from dtcourse.zero.flat import FlatShard
from dtcourse.zero.units import ROOT, build_units

__all__ = ["check_zero_gradients", "check_zero_memory", "check_zero_parity", "check_zero_traffic",
           "ZERO_CASES", "ZERO_TOL", "OPTIMIZERS"]

# What these checks switch off while the student's code runs (guard.watching), and refuse to be given:
# the course's ZeRO, and the methods of it the exercise asks for (callable unbound on another object)
ANSWERS = Answers("06", course=("dtcourse.zero.sharded.ZeRO", "dtcourse.zero.sharded.ZeRO._grad_ready",
                                "dtcourse.zero.sharded.ZeRO._reduce", "dtcourse.zero.sharded.ZeRO._complete",
                                "dtcourse.zero.sharded.ZeRO.step"))
ZERO_BATCH = 60               # global batch: every world size checked (1 to 6) divides it
# float32 throughout. The mean over N ranks of means over B/N rows adds the same terms as one mean
# over B rows in another order: gradients differ by a few ulps. AdamW's first steps move a parameter
# by about lr·g/|g|, so where a gradient nearly cancels, those ulps move it a little further.
# Measured with the solution over every case at N = 2 to 6: at most 6e-8 in a gradient and 4.3e-7
# in a parameter after 3 steps. 1e-5 is far above that, and far below any real mistake (a missing
# division by N is off by (N-1) times the gradient; a missing all-gather by a whole step).
ZERO_TOL = 1e-5
OPTIMIZERS = {      # name -> (description, factory); SGD keeps K = 1 state per element, AdamW K = 2
    "sgd": ("SGD (lr 0.1, momentum 0.9)", partial(torch.optim.SGD, lr=0.1, momentum=0.9)),
    "adamw": ("AdamW (lr 1e-3, weight decay 0.01)", partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)),
}
_STATES = {"sgd": 1, "adamw": 2}

_ADVICE = "Subclass ZeroBase, as the exercise's cell does, write _grad_ready and step yourself, and pass that."
_HINT = ("This is most likely a deadlock: a rank waits in a collective that another rank never started. "
         "Every rank must start the same collectives in the same order: one reduce-scatter per flat in "
         "backward, one all-gather per flat in step(). Raise timeout= only if your code is merely slow.")


# --------------------------------------------------------------------------- #
# The cases: a model, and its units (as ZeRO's units= takes them)
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class _ZeroCase:
    description: str
    model: str                                   # "mlp", "tiny" or "gpt", float32
    units: tuple[str, ...] | None                # None: default_units(model)


_MLP = (7, 13, 11, 5)       # numels 91, 13, 143, 11, 55, 5
_TINY = (3, 2, 1)           # numels 6, 2, 2, 1
ZERO_CASES = {
    "mlp": _ZeroCase("MLP (7, 13, 11, 5), a unit per layer: flats of 104, 154 and 60 elements", "mlp",
                     ("net.0", "net.2", "net.4")),
    "one_unit": _ZeroCase("the same MLP, no units: all 318 elements in the root's one flat", "mlp", ()),
    "mixed": _ZeroCase("the same MLP, one unit net.2: the root's flat holds the first and last layers (164 "
                       "elements) and completes only with the first layer's gradients", "mlp", ("net.2",)),
    "tiny": _ZeroCase("MLP (3, 2, 1), a unit per layer, flats of 8 and 3 elements: some ranks own only padding",
                      "tiny", None),
    "gpt": _ZeroCase("a 1-layer GPT, a unit per module, the tied embedding in the root", "gpt", None),
}


def _gpt_config():
    from dtcourse.models import GPTConfig
    return GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, d_model=16)


def _model(case: _ZeroCase) -> nn.Module:
    from dtcourse.models import GPT, MLP
    if case.model == "gpt":
        return GPT(_gpt_config(), seed=0)
    return MLP(_MLP if case.model == "mlp" else _TINY, seed=0)


def _batch(case: _ZeroCase, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from dtcourse.models import regression_batch, token_batch
    if case.model == "gpt":
        return token_batch(_gpt_config(), ZERO_BATCH, seed=seed)
    sizes = _MLP if case.model == "mlp" else _TINY
    return regression_batch(ZERO_BATCH, sizes[0], sizes[-1], seed=seed)


def _loss(case: _ZeroCase, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    from dtcourse.models import lm_loss
    return lm_loss(out, y) if case.model == "gpt" else nn.functional.mse_loss(out, y)


@dataclass(frozen=True)
class _Expected:
    """One trainable flat as ``build_units`` lays it out on a copy of the model: what the student's must match."""

    index: int
    unit: str
    flat: FlatShard

    def describe(self) -> str:
        names = self.flat.names
        listed = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
        pad = f" padded to {self.flat.padded}" if self.flat.padded != self.flat.numel else ""
        unit = "the root unit" if self.unit == ROOT else f"unit {self.unit!r}"
        return f"the flat of {unit} ({listed}: {self.flat.numel} elements{pad}, {self.flat.size} per rank)"

    def element(self, k: int) -> str:
        """The parameter element at position ``k`` of the flat vector, e.g. "net.2.bias[3]" or "padding"."""
        for name, (lo, hi) in zip(self.flat.names, self.flat.spans):
            if lo <= k < hi:
                return f"{name}[{k - lo}] (flat element {k})"
        return f"padding (flat element {k})"

    def flatten(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The (N·s,) vector of ``tensors`` (by name) laid out as this flat, zero in the padding."""
        out = torch.zeros(self.flat.padded, dtype=torch.float32)
        for name, (lo, hi) in zip(self.flat.names, self.flat.spans):
            out[lo:hi] = tensors[name].detach().reshape(-1)
        return out


def _expected(model: nn.Module, units: Sequence[str] | None, n: int, rank: int) -> list[_Expected]:
    from dtcourse.zero.units import default_units
    model = copy.deepcopy(model)
    names = default_units(model) if units is None else list(units)
    built = build_units(model, names, n, rank, torch.float32, keep_full=True)
    return [_Expected(k, unit, flat) for k, (unit, flat) in
            enumerate((u.name, f) for u in built for f in u.flats if f.trainable)]


# --------------------------------------------------------------------------- #
# What the student's code sends, in order, with its bytes (dtcourse.runtime.observe's records)
# --------------------------------------------------------------------------- #
_RING = ("all_reduce", "all_gather", "reduce_scatter")


def _full(record: Record) -> int:
    """The collective's whole tensor: a reduce-scatter's input, an all-gather's output, an all-reduce's tensor."""
    return record.nbytes * record.group_size if record.collective == "all_gather" else record.nbytes


def _sent(record: Record) -> int:
    """What this rank sends for it, as a bandwidth-optimal algorithm does."""
    if record.collective in _RING:
        return ring_bytes_sent(record.collective, _full(record), record.group_size)
    if record.collective in ("send", "recv", "barrier"):
        return record.nbytes if record.collective == "send" else 0
    return record.nbytes * (record.group_size - 1) // record.group_size


def _said(record: Record) -> str:
    return f"{record.collective.replace('_', '-')} of {_full(record)} B, {_sent(record)} B sent"


class _Optimizers:
    """The ``optimizer`` a check hands the student's class: builds the named one and keeps what it was given."""

    def __init__(self, name: str):
        self.name, self.made = name, []

    def __call__(self, params) -> torch.optim.Optimizer:
        params = list(params)
        optimizer = OPTIMIZERS[self.name][1](params)
        self.made.append((params, optimizer))
        return optimizer


def _warm_optimizers() -> None:
    """torch.optim's first step imports torch._dynamo (about a second): do it once here, not in every rank."""
    p = torch.zeros(1, requires_grad=True)
    p.grad = torch.zeros(1)
    for _, factory in OPTIMIZERS.values():
        factory([p]).step()


# --------------------------------------------------------------------------- #
# Running the student's class on the ranks
# --------------------------------------------------------------------------- #
class _Run:
    """One case on this rank: the model, its expected flats, the student's wrapper, what it sent."""

    def __init__(self, cls: Callable, name: str, optimizer: str, progress: str):
        self.rank, self.n = dist.get_rank(), dist.get_world_size()
        self.name, self.case = name, ZERO_CASES[name]
        self.label = f"case {name!r} ({self.case.description})"
        self.note = Path(progress, str(self.rank))
        self.model = _model(self.case)
        self.reference = copy.deepcopy(self.model)           # one process, the whole batch
        self.flats = _expected(self.model, self.case.units, self.n, self.rank)
        self.optimizers = _Optimizers(optimizer)
        self.log, self.marks = CommLog(), [(0, "construction")]
        self.cls, self.progress = cls, progress
        self.rows = slice(self.rank * ZERO_BATCH // self.n, (self.rank + 1) * ZERO_BATCH // self.n)

    def say(self, what: str, phase: str) -> None:
        self.note.write_text(f"{self.label}, {what}")
        self.marks.append((len(self.log.records), phase))

    def build(self) -> object:
        self.say("building the wrapper", "construction")
        units = None if self.case.units is None else list(self.case.units)
        return _as_student(self.progress, lambda: self.cls(self.model, self.optimizers, units))

    def forward_backward(self, wrapper: object, step: int) -> None:
        x, y = _batch(self.case, seed=step)
        self.say(f"step {step}: forward", "forward")
        loss = _as_student(self.progress, lambda: _loss(self.case, wrapper(x[self.rows]), y[self.rows]))
        self.say(f"step {step}: backward", "backward")
        _as_student(self.progress, lambda: loss.backward())

    def step(self, wrapper: object, step: int) -> None:
        self.say(f"step {step}: step()", "step")
        _as_student(self.progress, lambda: wrapper.step())

    def sent(self, start: int = 0, end: int | None = None) -> list[tuple[str, Record]]:
        """(phase, record) for the records ``start:end`` of the log: what the student's code started, and when."""
        return [([phase for at, phase in self.marks if at <= i][-1], record)
                for i, record in enumerate(self.log.records[start:end], start)]

    def full_gradients(self, step: int, rows: slice = slice(None)) -> dict[str, torch.Tensor]:
        """One process's gradients on rows ``rows`` of step ``step``'s batch, at the reference's parameters."""
        scratch = copy.deepcopy(self.reference)
        x, y = _batch(self.case, seed=step)
        _loss(self.case, scratch(x[rows]), y[rows]).backward()
        return {n: p.grad for n, p in scratch.named_parameters()}

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Inside ``watching(ANSWERS)``: everything the student's code sends, in ``self.log``.

        ``watching`` itself must be entered by the function that runs the student's code: the frame
        that enters it is where the check's own frames end (``dtcourse.runtime.refuse``).
        """
        with observe() as self.log:
            yield


def _flats_of(wrapper: object, run: _Run) -> tuple[list, str | None]:
    """The wrapper's trainable flats, or what is missing (the checks read ``flat.grad`` as ZeroBase lays it out)."""
    units = getattr(wrapper, "units", None)
    flats = [f for u in units for f in getattr(u, "flats", ()) if getattr(f, "trainable", False)] \
        if isinstance(units, (list, tuple)) else []
    if [getattr(f, "names", None) for f in flats] != [e.flat.names for e in run.flats]:
        return [], (f"the wrapper must keep ZeroBase's self.units, whose {len(run.flats)} trainable flat(s) hold "
                    f"{[e.flat.names for e in run.flats]}; subclass ZeroBase and leave its __init__ as it is")
    return flats, None


def _each(cls: Callable, names: tuple[str, ...], progress: str, run_case: Callable, **options) -> list:
    runs = [(f"case {name!r} ({ZERO_CASES[name].description})", partial(run_case, cls, name, progress, **options))
            for name in names]
    return _stop_at_first_failure(runs, progress)


def _validate(check: str, cls: Callable, world_sizes: Sequence[int], cases: Sequence[str], least: int) -> None:
    _check_names(check, cls, cases, ZERO_CASES)
    _refuse_library_code(check, cls, ANSWERS.exercise, _ADVICE)
    bad = [n for n in world_sizes if not isinstance(n, int) or n < least or ZERO_BATCH % n]
    if bad or not world_sizes:
        raise ValueError(f"{check}: world sizes must be at least {least} and divide the batch of {ZERO_BATCH}, "
                         f"got {list(world_sizes)}")
    _warm_optimizers()


def _launch_all(check: str, cls: Callable, world_sizes: Sequence[int], rank_fn: Callable, args: tuple,
                timeout: float | None) -> None:
    name = getattr(cls, "__name__", "your class")
    for world_size in world_sizes:
        _launch_check(name, world_size, rank_fn, args, timeout, where=f" at world size {world_size}", hint=_HINT)


# --------------------------------------------------------------------------- #
# check_zero_gradients: each rank's part of the mean gradient
# --------------------------------------------------------------------------- #
def check_zero_gradients(cls: Callable, world_sizes: Sequence[int] = (2,), cases: Sequence[str] = ("mlp",),
                         timeout: float | None = None) -> None:
    """After one ``backward()`` through ``cls(module, optimizer, units)``, each ``flat.grad`` must be this
    rank's part of the mean gradient.

    Every rank runs forward and backward on its B/N rows of a batch of 60. Rank r's ``flat.grad``
    must then hold elements [r·s, (r+1)·s) of the flat's padded gradient, averaged over the ranks
    (one process on the whole batch), within ``ZERO_TOL``; the padding is zero. A failure names
    the world size, case, rank, flat and element, with a hint when the values are N times the
    mean, this rank's own unreduced gradient, or another rank's part.
    """
    _validate("check_zero_gradients", cls, world_sizes, cases, 1)
    _launch_all("check_zero_gradients", cls, world_sizes, _gradients_rank, (cls, tuple(cases)), timeout)


def _gradients_rank(cls: Callable, names: tuple[str, ...], progress: str) -> list:
    return _each(cls, names, progress, _gradients_case)


def _gradients_case(cls: Callable, name: str, progress: str) -> str | None:
    run = _Run(cls, name, "sgd", progress)
    with watching(ANSWERS), run.recording():
        wrapper = run.build()
        run.forward_backward(wrapper, step=1)
    flats, problem = _flats_of(wrapper, run)
    if problem:
        return problem
    mean, own = run.full_gradients(1), run.full_gradients(1, run.rows)
    for expected, flat in zip(run.flats, flats):
        problem = _part_problem(expected, flat.grad, expected.flatten(mean), expected.flatten(own), run.rank, run.n)
        if problem:
            return problem
    return None


def _part_problem(expected: _Expected, got: object, mean: torch.Tensor, own: torch.Tensor, rank: int,
                  n: int) -> str | None:
    s, padded = expected.flat.size, expected.flat.padded
    lo, hi = rank * s, (rank + 1) * s
    where = f"{expected.describe()}: flat.grad"
    if not isinstance(got, torch.Tensor):
        return (f"{where} is {got!r} after backward(): reduce-scatter the flat's gradient into flat.grad and "
                "divide it by N")
    got = got.detach()
    if got.numel() == padded and padded != s:
        return (f"{where} has {got.numel()} elements, the whole padded flat: rank {rank} keeps only its part, "
                f"elements [{lo}, {hi}), {s} of them. Reduce-scatter the flat's gradient rather than all-reduce it")
    if got.numel() != s:
        return (f"{where} has {got.numel()} elements; this rank's part has s = ceil({expected.flat.numel}/{n}) = "
                f"{s}")
    got, want = got.reshape(-1).float(), mean[lo:hi]
    error = (got - want).abs()
    worst = int(error.argmax()) if error.numel() else 0
    if not error.numel() or error.max().item() <= ZERO_TOL:          # False for NaN too
        return None
    message = (f"{where} differs from this rank's part of the mean gradient (elements [{lo}, {hi}) of the padded "
               f"flat) by up to {error.max().item():.3g} at {expected.element(lo + worst)}: expected "
               f"{want[worst].item():.6g}, got {got[worst].item():.6g}")
    close = dict(rtol=1e-4, atol=ZERO_TOL)
    if n > 1 and torch.allclose(got, n * want, **close):
        message += (f". It is N = {n} times the mean: the reduce-scatter adds the ranks' gradients, so divide "
                    "by the world size")
    elif n > 1 and torch.allclose(got, own[lo:hi], **close):
        message += (". It is this rank's own gradient, not reduced over the ranks: reduce-scatter the flat's "
                    "gradient bucket into flat.grad")
    else:
        other = next((r for r in range(n) if r != rank and torch.allclose(got, mean[r * s:(r + 1) * s], **close)),
                     None)
        if other is not None:
            message += (f". It is rank {other}'s part: rank r keeps elements [r·s, (r+1)·s) of the padded "
                        "flat, and the reduce-scatter gives rank r exactly that part of its input")
        elif not got.any():
            message += ". It is all zeros"
    return message


# --------------------------------------------------------------------------- #
# check_zero_memory: reduce-scatter each flat when it completes, and free its gradients
# --------------------------------------------------------------------------- #
def check_zero_memory(cls: Callable, world_sizes: Sequence[int] = (2,), cases: Sequence[str] = ("mlp",),
                      timeout: float | None = None) -> None:
    """One ``backward()`` through ``cls(module, optimizer, units)`` must keep no full gradient.

    The check sees every gradient as autograd produces it (a hook that runs after the wrapper's)
    and every collective the wrapper starts. It wants, for every flat: one reduce-scatter of its
    padded gradient (N·s elements), started in the hook that completes the flat; none of its
    parameters' ``.grad`` left once that hook returns; no all-reduce. After backward, each
    ``flat.grad`` has s elements and is not a view of anything larger, and the wrapper holds no
    tensor the size of a whole flat's gradient. So the most gradient a rank ever holds is the
    flats still filling, plus one being reduced, plus its 1/N parts.
    """
    _validate("check_zero_memory", cls, world_sizes, cases, 2)
    _launch_all("check_zero_memory", cls, world_sizes, _memory_rank, (cls, tuple(cases)), timeout)


def _memory_rank(cls: Callable, names: tuple[str, ...], progress: str) -> list:
    return _each(cls, names, progress, _memory_case)


def _memory_case(cls: Callable, name: str, progress: str) -> str | None:
    run = _Run(cls, name, "sgd", progress)
    arrivals: list[tuple[str, int, dict[str, int]]] = []    # (parameter, collectives so far, .grad bytes alive)
    with watching(ANSWERS), run.recording():
        wrapper = run.build()
        named = [(n, p) for n, p in run.model.named_parameters() if p.requires_grad]

        def seen(param_name: str) -> None:     # after the wrapper's hook on the same parameter
            arrivals.append((param_name, len(run.log.records),
                             {n: p.grad.nbytes for n, p in named if p.grad is not None}))

        for param_name, p in named:
            p.register_post_accumulate_grad_hook(lambda p, param_name=param_name: seen(param_name))
        start = len(run.log.records)
        run.forward_backward(wrapper, step=1)
    flats, problem = _flats_of(wrapper, run)
    return problem or _memory_problem(run, arrivals, start, wrapper, flats)


def _memory_problem(run: _Run, arrivals: list, start: int, wrapper: object, flats: list) -> str | None:
    n, total = run.n, sum(e.flat.numel for e in run.flats) * 4
    largest = max((sum(alive.values()) for _, _, alive in arrivals), default=0)
    peak = f". The most .grad bytes alive at once were {largest} B; the whole model's gradient is {total} B"
    order = [name for name, _, _ in arrivals]
    backward = [r for phase, r in run.sent(start) if phase == "backward"]
    forward = [r for phase, r in run.sent(start) if phase == "forward"]
    if forward:
        return (f"forward made {', '.join(map(_said, forward))}: a stage-2 forward communicates nothing, every "
                "rank holds all the parameters")
    done: list[_Expected] = []
    for k, (param_name, count, alive) in enumerate(arrivals):
        completed = [e for e in run.flats if param_name in e.flat.names and e not in done
                     and all(name in order[:k + 1] for name in e.flat.names)]
        for expected in completed:
            done.append(expected)
            started = [r for phase, r in run.sent(start, count) if phase == "backward"]
            scattered = [r for r in started if r.collective == "reduce_scatter"]
            if len(scattered) < len(done):
                reduced = [r for r in started if r.collective == "all_reduce"]
                if reduced:
                    return (f"{expected.describe()} was all-reduced (an {_said(reduced[-1])}): that leaves the "
                            f"whole summed gradient on every rank and sends 2(N-1)/N·S, twice a reduce-scatter's "
                            f"(N-1)/N·S. Rank r needs only its part: reduce-scatter the flat's padded gradient")
                return (f"{expected.describe()} had all its gradients after {k + 1} of the {len(arrivals)} "
                        f"gradients, but by the end of that hook only {len(scattered)} reduce-scatter(s) had "
                        f"started for the {len(done)} flat(s) complete: start a flat's reduce-scatter in "
                        "_grad_ready, in the hook that completes it, not after backward (that is stage 1, which "
                        f"holds every gradient until backward ends){peak}")
            want, got = expected.flat.padded * 4, _full(scattered[len(done) - 1])
            if got != want:
                return (f"the reduce-scatter of {expected.describe()} had an input of {got} B; the flat's padded "
                        f"gradient is N·s = {n}·{expected.flat.size} = {expected.flat.padded} elements, {want} B "
                        f"({got - want:+d} B): reduce-scatter the whole (N·s,) gradient bucket, zero in the "
                        "padding (flat.gradient_bucket gives it)")
            kept = [(name, alive[name]) for name in expected.flat.names if name in alive]
            if kept:
                listed = ", ".join(f"{name!r} ({nbytes} B)" for name, nbytes in kept)
                return (f"after the hook that completed {expected.describe()}, its gradient(s) {listed} were "
                        f"still in .grad: once the flat's gradients are copied out, set each parameter's .grad to "
                        f"None (flat.gradient_bucket does both). Kept, they add up to the whole model's gradient "
                        f"on every rank, which stage 2 must never hold{peak}")
    if len(done) < len(run.flats):
        missing = [e.describe() for e in run.flats if e not in done]
        return f"backward() never completed {', '.join(missing)}: some gradient did not arrive"
    reductions = [r for r in backward if r.collective == "reduce_scatter"]
    if len(reductions) != len(run.flats) or len(backward) != len(reductions):
        return (f"backward made {', '.join(map(_said, backward))}; expected exactly one reduce-scatter per flat, "
                f"{len(run.flats)} of them")
    for expected, flat in zip(run.flats, flats):
        grad, s = flat.grad, expected.flat.size
        if not isinstance(grad, torch.Tensor):
            return f"{expected.describe()}: flat.grad is {grad!r} after backward(): the reduced part belongs there"
        storage = grad.untyped_storage().nbytes()
        if grad.numel() != s or storage > s * grad.element_size():
            return (f"{expected.describe()}: flat.grad has {grad.numel()} elements on a storage of {storage} B, "
                    f"but rank {run.rank} keeps only its part: {s} elements, {s * 4} B. A view into the whole "
                    "flat gradient keeps all of it alive; reduce-scatter into a tensor of s elements (flat.grad "
                    "as ZeroBase made it)")
    kept = _full_size_tensors(wrapper, run.flats, flats)
    if kept:
        where, tensor, expected = kept[0]
        return (f"after backward, the wrapper still holds a tensor of {tensor.numel()} elements ({tensor.nbytes} B) "
                f"at {where}: the size of {expected.describe()}'s whole gradient. Stage 2 keeps only this rank's "
                f"part of it ({expected.flat.size} elements, in flat.grad); keep the gradient bucket in a local "
                "variable of the hook, so that it is freed once the reduce-scatter has read it")
    return None


def _full_size_tensors(wrapper: object, expected: list[_Expected], flats: list) -> list:
    """(where, tensor, expected flat) for each tensor the wrapper keeps that is a whole flat's size.

    The parameters (``flat.full``), this rank's parts (``shard``, ``master``) and their gradients (checked before
    this, s elements each) are not counted, even where a part happens to be as long as another flat.
    """
    sizes = {}
    for e in expected:
        sizes.setdefault(e.flat.padded, e)
        sizes.setdefault(e.flat.numel, e)
    ours = {t.untyped_storage().data_ptr() for f in flats
            for t in (getattr(f, "full", None), getattr(f, "shard", None), getattr(f, "master", None),
                      getattr(f, "grad", None)) if isinstance(t, torch.Tensor)}
    module_keys = set(vars(nn.Module()))
    found, seen = [], set()

    def visit(obj: object, where: str, depth: int) -> None:
        if id(obj) in seen or depth > 5:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.numel() in sizes and obj.untyped_storage().data_ptr() not in ours:
                found.append((where, obj, sizes[obj.numel()]))
            if obj.grad is not None:
                visit(obj.grad, f"{where}.grad", depth + 1)
        elif isinstance(obj, (list, tuple)):
            for k, item in enumerate(obj):
                visit(item, f"{where}[{k}]", depth + 1)
        elif isinstance(obj, dict):
            for key, item in obj.items():
                visit(item, f"{where}[{key!r}]", depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, torch.optim.Optimizer, type)) \
                and not callable(obj):
            for key, item in vars(obj).items():
                visit(item, f"{where}.{key}", depth + 1)

    for key, item in vars(wrapper).items():
        if key not in module_keys and key != "module":
            visit(item, f"self.{key}", 1)
    return found


# --------------------------------------------------------------------------- #
# check_zero_parity: several steps, against one process on the whole batch
# --------------------------------------------------------------------------- #
def check_zero_parity(cls: Callable, world_sizes: Sequence[int] = (2,), cases: Sequence[str] = ("mlp",),
                      optimizers: Sequence[str] = ("sgd", "adamw"), steps: int = 3,
                      timeout: float | None = None) -> None:
    """``cls(module, optimizer, units)`` with ``backward()`` and ``step()`` must train as one process does.

    For each optimizer (keys of ``OPTIMIZERS``), every rank trains a fresh wrapper for ``steps``
    steps on its B/N rows of a batch of 60, beside one process training the same model on the
    whole batch with the same optimizer. After every step, the module's parameters must match
    within ``ZERO_TOL`` on every rank. A failure names the world size, case, optimizer, step,
    rank, parameter and element, with a hint when the parameters did not move, moved only in
    this rank's part (no all-gather), or moved as one process's do when its gradients are never
    cleared (step k stepped with the sum of steps 1 to k's gradients), in which case the hint says
    which gradients were left between steps: the parameters' ``.grad`` or the masters'.
    """
    unknown = [o for o in optimizers if o not in OPTIMIZERS]
    if unknown or not optimizers or steps < 1:
        raise ValueError(f"check_zero_parity: optimizers must be among {sorted(OPTIMIZERS)} (got {list(optimizers)}) "
                         f"and steps >= 1 (got {steps})")
    _validate("check_zero_parity", cls, world_sizes, cases, 1)
    _launch_all("check_zero_parity", cls, world_sizes, _parity_rank, (cls, tuple(cases), tuple(optimizers), steps),
                timeout)


def _parity_rank(cls: Callable, names: tuple[str, ...], optimizers: tuple[str, ...], steps: int, progress: str) -> list:
    return _each(cls, names, progress, _parity_case, optimizers=optimizers, steps=steps)


def _parity_case(cls: Callable, name: str, progress: str, optimizers: tuple[str, ...], steps: int) -> str | None:
    for optimizer in optimizers:
        problem = _parity_run(_Run(cls, name, optimizer, progress), optimizer, steps)
        if problem:
            return f"with {OPTIMIZERS[optimizer][0]}: {problem}"
    return None


def _parity_run(run: _Run, optimizer: str, steps: int) -> str | None:
    reference_optimizer = OPTIMIZERS[optimizer][1](run.reference.parameters())
    start = copy.deepcopy(run.reference)          # where both begin, for _never_cleared
    with watching(ANSWERS), run.recording():
        wrapper = run.build()
        for step in range(1, steps + 1):
            before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
            run.forward_backward(wrapper, step)
            run.step(wrapper, step)
            x, y = _batch(run.case, seed=step)
            _loss(run.case, run.reference(x), y).backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad(set_to_none=True)
            problem = _parameters_problem(run, before, step,
                                          lambda: _never_cleared(run, start, optimizer, step), wrapper)
            if problem:
                return problem
    return None


def _parameters_problem(run: _Run, before: dict[str, torch.Tensor], step: int,
                        never_cleared: Callable[[], dict[str, torch.Tensor]], wrapper: object) -> str | None:
    got = dict(run.model.named_parameters())
    want = dict(run.reference.named_parameters())
    for expected in run.flats:
        for name in expected.flat.names:
            error = (got[name].detach() - want[name].detach()).abs()
            if error.numel() and error.max().item() <= ZERO_TOL:
                continue
            worst = int(error.reshape(-1).argmax())
            message = (f"after step {step}, parameter {name!r} {tuple(got[name].shape)} differs from one process "
                       f"trained on the whole batch by up to {error.max().item():.3g} (tolerance {ZERO_TOL:g}), at "
                       f"element {worst}")
            # Step 1 has no earlier gradient to add; from step 2 on, accumulating moves the parameters its own way.
            if step > 1 and _same(got, never_cleared()):
                return message + _accumulation_hint(run, wrapper, step)
            return message + _parameters_hint(run, expected, got, want, before)
    return None


def _never_cleared(run: _Run, start: nn.Module, optimizer: str, steps: int) -> dict[str, torch.Tensor]:
    """The parameters of one process after ``steps`` steps on the whole batch whose gradients are never cleared.

    Autograd adds each backward's gradient to the ``.grad`` already there, so step k steps with the
    sum of the gradients of steps 1 to k (each at the parameters of its own step): what a ZeRO step
    does when the parameters' ``.grad``, or the parts', outlive the step.
    """
    model = copy.deepcopy(start)
    stepper = OPTIMIZERS[optimizer][1](model.parameters())
    for step in range(1, steps + 1):
        x, y = _batch(run.case, seed=step)
        _loss(run.case, model(x), y).backward()
        stepper.step()
    return dict(model.named_parameters())


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    """Every parameter of ``want`` within ``ZERO_TOL`` of ``got``'s."""
    return all(torch.allclose(got[name].detach(), p.detach(), rtol=0, atol=ZERO_TOL) for name, p in want.items())


def _accumulation_hint(run: _Run, wrapper: object, step: int) -> str:
    """Where the gradients of one step were left for the next, as seen after the student's ``step()``."""
    left = [name for name, p in run.model.named_parameters() if p.requires_grad and p.grad is not None]
    flats, _ = _flats_of(wrapper, run)
    masters = [str(k) for k, flat in enumerate(flats)
               if isinstance(getattr(flat, "master", None), torch.Tensor) and flat.master.grad is not None]
    message = (f". The parameters moved exactly as one process's do when its gradients are never cleared: step "
               f"{step} stepped with the sum of the gradients of steps 1 to {step}, not with step {step}'s alone. "
               "Your gradients accumulate across steps, since backward adds each new gradient to the .grad already "
               "there (and so does += on flat.grad)")
    # Both left, and the parameters would have moved as the sum of sums: the .grad alone explain a single sum.
    if left:
        listed = ", ".join(map(repr, left[:4])) + (f", ... ({len(left)} in all)" if len(left) > 4 else "")
        return (f"{message}. After step(), the parameters {listed} still had a .grad, which the next backward "
                "added to: in _grad_ready, move the flat's gradients out with flat.gradient_bucket, which sets each "
                ".grad to None, rather than reading them in place")
    if masters:
        return (f"{message}. After step(), flat.master.grad was still set for flat(s) {', '.join(masters)}: set it "
                "back to None once self.optimizer.step() has used it, and make flat.grad the reduce-scatter's "
                "output divided by N rather than adding that to the old one")
    return (f"{message}. Clear them between steps: write flat.grad anew from each backward's reduce-scatter (never "
            "+=), move the parameters' .grad out with flat.gradient_bucket, and set flat.master.grad back to None "
            "after self.optimizer.step(); keep no running sum of your own")


def _parameters_hint(run: _Run, expected: _Expected, got: dict, want: dict, before: dict) -> str:
    mine, wanted, old = expected.flatten(got), expected.flatten(want), expected.flatten(before)
    s, r = expected.flat.size, run.rank
    lo, hi = r * s, (r + 1) * s
    same = lambda a, b: torch.allclose(a, b, rtol=0, atol=ZERO_TOL)     # noqa: E731
    moved = not same(wanted, old)
    if moved and torch.equal(mine, old):
        return (f". No parameter of {expected.describe()} changed in this step: the optimizer steps flat.master "
                "(this rank's part of flat.full) with the gradient you put in flat.master.grad, and the other "
                "parts of flat.full change only when step() all-gathers every rank's updated part into it")
    if moved and same(mine[lo:hi], wanted[lo:hi]) and same(torch.cat([mine[:lo], mine[hi:]]),
                                                           torch.cat([old[:lo], old[hi:]])):
        return (f". Only this rank's part of {expected.describe()} (elements [{lo}, {hi})) was updated: all-gather "
                "every rank's updated flat.shard into flat.full, so that every rank gets every rank's part")
    return (f" ({expected.describe()}; if check_zero_gradients passes, look at step(): the masters' gradients, "
            "the optimizer and its states, the all-gather)")


# --------------------------------------------------------------------------- #
# check_zero_traffic: the bytes of one step, flat by flat, and the optimizer's share
# --------------------------------------------------------------------------- #
def check_zero_traffic(cls: Callable, world_sizes: Sequence[int] = (2,), cases: Sequence[str] = ("mlp",),
                       steps: int = 2, timeout: float | None = None) -> None:
    """One step of ``cls(module, optimizer, units)`` must send what ZeRO stage 2 sends, and step only the parts.

    With AdamW, for ``steps`` steps, the check records every collective and message (and its
    bytes) of forward, backward and ``step()``. It wants one reduce-scatter per flat in backward,
    of the flat's padded bytes, and one all-gather per flat in ``step()``, of the same bytes;
    nothing else. So each rank sends (N-1)/N·Ψ·4 bytes in each, Ψ the padded elements of all
    flats: 2(N-1)/N·Ψ·4 a step, as much as data parallelism's all-reduce. The optimizer must be
    given only this rank's parts (Σ s elements), and hold 2 states of that size after a step.
    """
    if steps < 1:
        raise ValueError(f"check_zero_traffic: steps must be >= 1, got {steps}")
    _validate("check_zero_traffic", cls, world_sizes, cases, 2)
    _launch_all("check_zero_traffic", cls, world_sizes, _traffic_rank, (cls, tuple(cases), steps), timeout)


def _traffic_rank(cls: Callable, names: tuple[str, ...], steps: int, progress: str) -> list:
    return _each(cls, names, progress, _traffic_case, steps=steps)


def _traffic_case(cls: Callable, name: str, progress: str, steps: int) -> str | None:
    run = _Run(cls, name, "adamw", progress)
    with watching(ANSWERS), run.recording():
        wrapper = run.build()
        problem = _optimizer_given(run)
        if problem:
            return problem
        for step in range(1, steps + 1):
            start = len(run.log.records)
            run.forward_backward(wrapper, step)
            run.step(wrapper, step)
            problem = _traffic_problem(run, run.sent(start), step) or _optimizer_states(run, step)
            if problem:
                return problem
    return None


def _optimizer_given(run: _Run) -> str | None:
    parts = sum(e.flat.size for e in run.flats)
    given = [p for params, _ in run.optimizers.made for p in params]
    if len(run.optimizers.made) != 1 or sum(p.numel() for p in given) != parts:
        sizes = ", ".join(str(p.numel()) for p in given[:8]) + (", ..." if len(given) > 8 else "")
        return (f"the optimizer was built {len(run.optimizers.made)} time(s), and given {len(given)} tensor(s) of "
                f"{sizes} elements ({sum(p.numel() for p in given)} in all); stage 2 builds one optimizer, on this "
                f"rank's parts only: {len(run.flats)} masters of {parts} elements in all (ZeroBase does this)")
    return None


def _optimizer_states(run: _Run, step: int) -> str | None:
    want = _STATES["adamw"] * sum(e.flat.size for e in run.flats) * 4
    _, optimizer = run.optimizers.made[0]
    held = sum(t.nbytes for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)
    if held != want:
        return (f"after step {step}, the optimizer holds {held} B of states; AdamW keeps 2 per element of this "
                f"rank's parts: 2 · {want // 8} elements · 4 B = {want} B (did step() call self.optimizer.step() "
                "once?)")
    return None


def _traffic_problem(run: _Run, sent: list[tuple[str, Record]], step: int) -> str | None:
    n = run.n
    padded = sum(e.flat.padded for e in run.flats) * 4
    one_way = padded * (n - 1) // n                       # (N-1)/N · Ψ · 4, Ψ padded
    total = sum(_sent(r) for _, r in sent)
    by_phase = {phase: [r for p, r in sent if p == phase] for phase in ("forward", "backward", "step")}
    listed = "; ".join(f"{phase}: {', '.join(map(_said, items))}" for phase, items in by_phase.items() if items)
    summary = (f"rank {run.rank} sent {total} B in step {step}; a stage-2 step sends 2 · (N-1)/N · Ψ · 4 = "
               f"2 · {n - 1}/{n} · {padded // 4} · 4 = {2 * one_way} B ({one_way} B in reduce-scatters during "
               f"backward, {one_way} B in all-gathers in step(); Ψ = {padded // 4} elements, padding included). "
               f"Yours: {listed or 'nothing'}")
    gathers = [r for r in by_phase["step"] if r.collective == "all_gather"]
    wanted = sorted(e.flat.padded * 4 for e in run.flats)
    if not by_phase["step"] and by_phase["backward"]:
        return (f"step() sent nothing: after self.optimizer.step() has updated this rank's parts, all-gather "
                f"each flat's shard into flat.full, or the other ranks never see this rank's part. {summary}")
    scatters = [r for r in by_phase["backward"] if r.collective == "reduce_scatter"]
    if sorted(map(_full, scatters)) != wanted or len(scatters) != len(by_phase["backward"]):
        return (f"backward should make one reduce-scatter per flat, of its padded gradient "
                f"({', '.join(f'{b} B' for b in wanted)}), and nothing else. {summary}")
    if any(r.collective == "all_reduce" for r in by_phase["step"]):
        return (f"step() all-reduced the parameters: only this rank's part of each flat changed, so an "
                f"all-gather (N-1)/N·S is enough, where an all-reduce sends 2(N-1)/N·S. {summary}")
    if sorted(map(_full, gathers)) != wanted or len(gathers) != len(by_phase["step"]):
        return (f"step() should make one all-gather per flat, of its padded parameters "
                f"({', '.join(f'{b} B' for b in wanted)}). {summary}")
    if total != 2 * one_way:
        return f"{total - 2 * one_way:+d} B off: {summary}"
    return None
