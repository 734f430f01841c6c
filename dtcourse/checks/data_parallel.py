"""Checks for exercise 02: a student's bucketed, overlapped DDP against dtcourse.data_parallel.

``check_bucket_assignment`` holds a student's ``assign_buckets`` to
``dtcourse.data_parallel.assign_buckets``; ``check_ddp_parity`` trains with a
student's DDP wrapper on N ranks next to one process on the whole batch;
``check_overlap`` checks the technique itself on one backward: one all-reduce per
bucket, of the bucket's bytes, in bucket index order, each started asynchronously in
the hook that completes its bucket and every bucket before it, and every handle
waited on before ``backward()`` returns. Like every check, they
raise one AssertionError that says what differs, and a deadlock becomes a failure
after the timeout::

    check_ddp_parity(OverlappedDDP, world_sizes=(2,), cases=("mlp",))

The exercise's scaffolding is ``DistributedDataParallel``'s set-up with the library's own
``Bucket``; the student writes ``assign_buckets`` and the wrapper's backward half
(``_grad_ready``, ``_launch_ready_buckets``, ``_launch``, ``_finish_backward``,
``_complete``). While the student's code runs, those answers of ``dtcourse.data_parallel``
and torch's ``DistributedDataParallel`` refuse to run (``guard.watching``), and passing one
of them to a check is refused too. Every all-reduce the student starts runs on a copy of its
tensor, and the sum reaches the student's tensor only when its handle's ``wait()`` is
called: the earliest a correct program may read it. A wrapper that forgets to wait
on a handle then gets the same wrong gradients on every run, instead of right ones
whenever the all-reduce happened to finish in time.
"""

from __future__ import annotations

import copy
import itertools
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

from dtcourse.checks.common import (_as_student, _check_names, _launch_check, _refuse_library_code,
                                     _stop_at_first_failure)
from dtcourse.checks.guard import Answers, watching

__all__ = ["check_bucket_assignment", "check_ddp_parity", "check_overlap", "DDP_CASES", "DDP_TOL"]

# What these checks switch off while the student's code runs (guard.watching), and refuse to be given
# (Bucket, the dataclass the scaffolding imports, is not an answer.)
ANSWERS = Answers("02", course=("dtcourse.data_parallel.ddp.DistributedDataParallel",
                                *(f"dtcourse.data_parallel.ddp.DistributedDataParallel.{method}" for method in (
                                    "_grad_ready", "_launch_ready_buckets", "_launch", "_finish_backward",
                                    "_complete")),
                                "dtcourse.data_parallel.buckets.assign_buckets"),
                  library={"torch.nn.parallel.DistributedDataParallel is switched off while exercise 02's checks run: "
                           "the exercise asks you to write the bucketing and the overlap yourself":
                           ("torch.nn.parallel.DistributedDataParallel.__init__",)})


_ADVICE = ("Subclass DDPBase, as the exercise's cell does, write _grad_ready, _launch_ready_buckets, _launch, "
           "_finish_backward and _complete (and assign_buckets) yourself, and pass that.")


# =========================================================================== #
# Exercise 02: gradient buckets that overlap with backward
# =========================================================================== #
# A student's bucketed DDP wrapper is held to dtcourse.data_parallel: the same
# buckets as its assign_buckets, the gradients and parameters of one process
# training on the whole batch, and one all-reduce per bucket, of its bytes, in
# index order, started while backward runs and waited on before backward() returns.

DDP_BATCH = 12   # global batch: every world size checked (1, 2, 3, 4, 6) divides it
DDP_LR = 0.1     # plain SGD by hand, so a wrong gradient moves the parameters visibly
# float64 throughout. The mean over N ranks of means over B/N rows adds the same
# terms as one mean over B rows, grouped differently, so the two differ by a few
# ulps: measured with the solution over every case at N = 2, 3, 4 and 6, at most
# 7e-17 in a gradient and 6e-17 in a parameter after 3 steps. 1e-10 is far above
# that and far below any real mistake: a missing division by N is off by (N-1)
# times the gradient itself.
DDP_TOL = 1e-10
_MLP_SIZES = (7, 13, 11, 5)   # numels 91, 13, 143, 11, 55, 5: none divisible by 2, 3 or 4
_DDP_DEADLOCK_HINT = (
    "This is most likely a deadlock: a rank waits for an all-reduce that another rank never "
    "started. Every rank must start the same buckets' all-reduces in the same order, once per "
    "backward, and wait on each handle once, after the last gradient. Raise timeout= only if "
    "your code is merely slow.")

_F32, _F64, _F16 = torch.float32, torch.float64, torch.float16
_MLP_SHAPES = [(13, 7), (13,), (11, 13), (11,), (5, 11), (5,)]


def _bucket_cases() -> dict[str, tuple[str, list[tuple[tuple[int, ...], torch.dtype]], tuple[int, ...]]]:
    """name -> (what it is, each parameter's (shape, dtype) in registration order, caps in bytes)."""
    from dtcourse.models import GPT
    gpt = [(tuple(p.shape), _F32) for p in GPT(_gpt_config(), seed=0).parameters()]
    tiny = [[(1,), (2,), (3, 1), (1, 1, 2)][i % 4] for i in range(40)]
    return {
        "mlp": ("the MLP (7, 13, 11, 5) in float32", [(s, _F32) for s in _MLP_SHAPES],
                (1, 200, 240, 300, 10**9)),
        "dtypes": ("six parameters in float32, float64 and float16",
                   [((6,), _F32), ((4,), _F32), ((3,), _F64), ((2,), _F64), ((8,), _F16), ((5,), _F32)],
                   (1, 30, 1000)),
        "tiny": ("40 parameters of 1 to 3 elements in float32", [(s, _F32) for s in tiny], (1, 8, 13, 30)),
        "gpt": ("a 1-layer GPT's 17 parameters in float32", gpt, (2048, 4096, 10**9)),
        "empty": ("no parameters at all", [], (1, 1000)),
    }


def _gpt_config():
    from dtcourse.models import GPTConfig
    return GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, d_model=16)


def check_bucket_assignment(fn: Callable, cases: Sequence[str] = ("mlp",),
                            timeout: float | None = None) -> None:
    """``fn(params, cap_bytes)`` must return the buckets of ``dtcourse.data_parallel.assign_buckets``.

    ``cases`` name parameter lists (see ``_bucket_cases``): ``"mlp"``, ``"dtypes"``, ``"tiny"``,
    ``"gpt"``, ``"empty"``; each is tried at several caps. The first difference is reported
    with the case, the cap, the bucket's position, its expected and actual indices, and a hint
    when the buckets match a common wrong rule. ``fn`` runs in a child process, so a loop
    that never ends fails after ``timeout`` seconds.
    """
    known = _bucket_cases()
    _check_names("check_bucket_assignment", fn, cases, known)
    _refuse_library_code("check_bucket_assignment", fn, ANSWERS.exercise, _ADVICE,
                         also=(torch.nn.parallel.DistributedDataParallel,))
    _launch_check(getattr(fn, "__name__", "your function"), 1, _buckets_rank, (fn, tuple(cases)), timeout,
                  where="", hint="Does a loop in it never end?")


def _buckets_rank(fn: Callable, cases: tuple[str, ...], progress: str) -> list:
    from dtcourse.data_parallel import assign_buckets as reference
    known = _bucket_cases()
    for name in cases:
        description, specs, caps = known[name]
        params = [torch.zeros(shape, dtype=dtype) for shape, dtype in specs]
        for cap in caps:
            Path(progress, "0").write_text(f"case {name!r} ({description}), cap_bytes={cap}")
            with watching(ANSWERS):
                got = _as_student(progress, lambda: fn(list(params), cap))
            problem = _bucket_problem(got, reference(params, cap), params, cap)
            if problem:
                return [f"case {name!r} ({description}), cap_bytes={cap}", problem]
    return []


def _sizes(params: list[torch.Tensor]) -> str:
    if not params:
        return "no parameters"
    shown = ", ".join(f"{i}: {p.numel() * p.element_size()} B"
                      + ("" if p.dtype == _F32 else f" {str(p.dtype).removeprefix('torch.')}")
                      for i, p in enumerate(params[:12]))
    return "bytes per parameter " + shown + (f", ... ({len(params)} in all)" if len(params) > 12 else "")


def _bucket_problem(got: object, want: list[list[int]], params: list[torch.Tensor], cap: int) -> str | None:
    """None if ``got`` equals ``want``, else the first differing bucket and, if one fits, a hint."""
    if not isinstance(got, (list, tuple)) or not all(
            isinstance(b, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in b)
            for b in got):
        return (f"it must return a list of buckets, each a list of parameter indices (ints); it returned "
                f"{str(got)[:80]!r}" + (" (did you forget the return?)" if got is None else ""))
    got = [list(b) for b in got]
    if got == want:
        return None
    k = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if k < len(want) and k < len(got):
        first = f"bucket {k} should be {want[k]} but yours is {got[k]}"
    elif k < len(want):
        first = f"your {len(got)} buckets stop early: bucket {k} should be {want[k]}"
    else:
        first = f"you made {len(got)} buckets, {len(want)} expected: bucket {k} {got[k]} is one too many"
    message = f"{first}\n    {_sizes(params)}\n    expected {want}\n    yours    {got}"
    flat = [i for b in got for i in b]
    hints = [(_rule(params, cap, backwards=False), "walk the parameters from the last to the first "
              "(reverse registration order), the order backward produces their gradients"),
             (_rule(params, cap, at_cap=False), "close a bucket as soon as its bytes reach cap_bytes "
              "(>=), not only when they exceed it"),
             (_rule(params, cap, before=True), "add the parameter first, then close the bucket if it "
              "has reached cap_bytes: a bucket may overshoot the cap by one parameter"),
             (_rule(params, cap, split_dtype=False), "start a new bucket when the dtype (or device) "
              "changes: a bucket is one flat tensor of one dtype"),
             ([sorted(b) for b in want], "list each bucket's indices in the order you visited them "
              "(descending)")]
    if sorted(flat) != list(range(len(params))):
        missing = sorted(set(range(len(params))) - set(flat))
        repeated = sorted({i for i in flat if flat.count(i) > 1})
        message += (f"\n    every index 0..{len(params) - 1} must be in exactly one bucket: "
                    f"missing {missing}, repeated {repeated}")
    else:
        message += "".join(f"\n    hint: {text}" for buckets, text in hints if buckets == got)
    return message


def _rule(params: list[torch.Tensor], cap: int, backwards: bool = True, at_cap: bool = True,
          before: bool = False, split_dtype: bool = True) -> list[list[int]]:
    """The bucket rule with one part changed: used only to recognise common mistakes."""
    buckets, current, size = [], [], 0
    for i in (reversed(range(len(params))) if backwards else range(len(params))):
        nbytes = params[i].numel() * params[i].element_size()
        if current and ((split_dtype and params[i].dtype != params[current[0]].dtype)
                        or (before and size + nbytes > cap)):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
        if not before and (size >= cap if at_cap else size > cap):
            buckets.append(current)
            current, size = [], 0
    return buckets + [current] if current else buckets


# --------------------------------------------------------------------------- #
# Parity of a student's DDP wrapper with one process, and overlap
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class _DDPCase:
    description: str
    model: str                      # "mlp", "reordered" or "gpt", always in float64
    bucket_cap_mb: float
    frozen: tuple[str, ...] = ()    # parameter names given requires_grad=False before wrapping


DDP_CASES = {
    "mlp": _DDPCase("MLP (7, 13, 11, 5), 400-byte buckets: 3 buckets", "mlp", 400 / 2**20),
    "frozen": _DDPCase("the same MLP with net.2.bias frozen, 400-byte buckets", "mlp", 400 / 2**20,
                       ("net.2.bias",)),
    "tiny": _DDPCase("the same MLP, 1-byte buckets: one per parameter", "mlp", 1 / 2**20),
    "one_bucket": _DDPCase("the same MLP, 25 MiB buckets: all in one", "mlp", 25.0),
    "reordered": _DDPCase("the same MLP with its layers registered last, first, middle, 400-byte buckets: the "
                          "last bucket is complete first", "reordered", 400 / 2**20),
    "gpt": _DDPCase("a 1-layer GPT, 4 KiB buckets", "gpt", 4 / 1024),
}


def check_ddp_parity(cls: Callable, world_sizes: Sequence[int] = (2,), cases: Sequence[str] = ("mlp",),
                     steps: int = 3, timeout: float | None = None) -> None:
    """``cls(module, bucket_cap_mb=...)`` must train as one process does on the whole batch.

    Every rank wraps the same float64 model, and for ``steps`` steps runs forward and
    ``backward()`` on its slice of a batch of 12, then an SGD step. When ``backward()``
    returns, each ``.grad`` must be the full-batch gradient at the current parameters
    (frozen ones stay ``None``); after the last step the parameters must match a single
    process's, both within ``DDP_TOL``. ``cases`` are keys of ``DDP_CASES``. A failure names
    the world size, case, rank, step, parameter and largest error, with a hint when the
    gradient is N times the mean or the rank's own, or when a handle was never waited on.
    """
    _check_names("check_ddp_parity", cls, cases, DDP_CASES)
    _refuse_library_code("check_ddp_parity", cls, ANSWERS.exercise, _ADVICE,
                         also=(torch.nn.parallel.DistributedDataParallel,))
    bad = [n for n in world_sizes if not isinstance(n, int) or n < 1 or DDP_BATCH % n]
    if bad or steps < 1:
        raise ValueError(f"check_ddp_parity: world sizes must divide the batch of {DDP_BATCH} "
                         f"(got {list(world_sizes)}) and steps must be >= 1 (got {steps})")
    name = getattr(cls, "__name__", "your class")
    for world_size in world_sizes:
        _launch_check(name, world_size, _parity_rank, (cls, tuple(cases), steps), timeout,
                      where=f" at world size {world_size}", hint=_DDP_DEADLOCK_HINT)


def check_overlap(cls: Callable, world_sizes: Sequence[int] = (2,), cases: Sequence[str] = ("mlp",),
                  timeout: float | None = None) -> None:
    """One ``backward()`` through ``cls(module, bucket_cap_mb=...)`` must communicate as a bucketed, overlapped DDP.

    The check sees every collective the wrapper makes (``guard.watching``), every handle's
    ``wait()``, and every gradient as autograd produces it. It wants:

    * one all-reduce per bucket (the wrapper's ``_buckets``, or the reference rule's), each of one
      bucket's bytes, together every trainable gradient once;
    * each started with ``async_op=True``, in bucket index order, in the gradient hook that completes
      its bucket and every bucket before it (``DistributedDataParallel._launch_ready_buckets``'s
      rule): not before, since its gradients are not all there, and not later, since that is
      overlap lost;
    * no handle waited on before the last gradient, and every handle waited on before
      ``backward()`` returns.
    """
    _check_names("check_overlap", cls, cases, DDP_CASES)
    _refuse_library_code("check_overlap", cls, ANSWERS.exercise, _ADVICE,
                         also=(torch.nn.parallel.DistributedDataParallel,))
    bad = [n for n in world_sizes if not isinstance(n, int) or n < 2 or DDP_BATCH % n]
    if bad or not world_sizes:
        raise ValueError(f"check_overlap: world sizes must be at least 2 and divide the batch of {DDP_BATCH}, "
                         f"got {list(world_sizes)}")
    for world_size in world_sizes:
        _launch_check(getattr(cls, "__name__", "your class"), world_size, _overlap_rank, (cls, tuple(cases)),
                      timeout, where=f" at world size {world_size}", hint=_DDP_DEADLOCK_HINT)


# --------------------------------------------------------------------------- #
# What the student's all-reduces do, seen from the process group
# --------------------------------------------------------------------------- #
class _Handle:
    """The handle of an all-reduce that the check runs on a copy: the sum reaches the student's tensor at ``wait()``.

    Until a handle is waited on, the all-reduce's result is not defined: it may already be in the
    tensor, or not yet, depending on the network. Delivering it exactly at ``wait()`` makes a
    forgotten wait fail every time. Anything else is the real handle's.
    """

    def __init__(self, work: object, tensors: list[torch.Tensor], copies: list[torch.Tensor], events: list,
                 index: int):
        self._work, self._tensors, self._copies = work, tensors, copies
        self._events, self._index = events, index

    def wait(self, *args, **kwargs) -> object:
        done = self._work.wait(*args, **kwargs)
        if self._copies is not None:
            with torch.no_grad():
                for tensor, summed in zip(self._tensors, self._copies):
                    tensor.copy_(summed)
            self._copies = None
        self._events.append(("wait", self._index))
        return done

    def is_completed(self) -> bool:
        if not self._work.is_completed():
            return False
        self.wait()          # polling until done is a way of waiting: the sum is there from now on
        return True

    def get_future(self) -> "_Future":
        return _Future(self)

    def __getattr__(self, name: str) -> object:
        return getattr(self._work, name)


class _Future:
    """``handle.get_future()``: its ``wait()`` and ``value()`` are the handle's ``wait()``, then the tensors."""

    def __init__(self, handle: _Handle):
        self._handle = handle

    def wait(self) -> list[torch.Tensor]:
        self._handle.wait()
        return self._handle._tensors

    value = wait

    def done(self) -> bool:
        return self._handle.is_completed()


@contextmanager
def _deferred_all_reduces(events: list) -> Iterator[None]:
    """Inside ``watching``: every all-reduce runs on copies, noted in ``events``; its handle is a ``_Handle``.

    Each all-reduce appends ``("all_reduce", index, nbytes, async_op)``, each ``wait()``
    ``("wait", index)``. A synchronous ``dist.all_reduce`` waits on the handle itself, so its sum is
    in the tensor when it returns, as usual.
    """
    raw = ProcessGroup.__dict__["allreduce"]      # watching's recorder, which calls the real one

    def allreduce(self, tensors, *args, **kwargs):
        single = isinstance(tensors, torch.Tensor)
        originals = [tensors] if single else list(tensors)
        copies = [t.detach().clone() for t in originals]
        opts = args[0] if args else kwargs.get("opts")
        index = sum(1 for e in events if e[0] == "all_reduce")
        events.append(("all_reduce", index, sum(t.nbytes for t in originals), bool(getattr(opts, "asyncOp", True))))
        work = raw(self, copies[0] if single else copies, *args, **kwargs)
        return _Handle(work, originals, copies, events, index)

    ProcessGroup.allreduce = allreduce
    try:
        yield
    finally:
        ProcessGroup.allreduce = raw


def _started(events: list, since: int = 0) -> int:
    """How many all-reduces ``events[since:]`` started."""
    return sum(1 for e in events[since:] if e[0] == "all_reduce")


def _unwaited(events: list, since: int = 0) -> list[int]:
    """Of the all-reduces started in ``events[since:]`` (numbered from 0 there), those never waited on."""
    started = [e[1] for e in events[since:] if e[0] == "all_reduce"]
    waited = {e[1] for e in events[since:] if e[0] == "wait"}
    return [position for position, k in enumerate(started) if k not in waited]


class _Reordered(torch.nn.Module):
    """The MLP's layers registered last, first, middle and run first, middle, last.

    Backward produces the last layer's gradients first, but they are registered first, so they sit in
    the last bucket: at 400 bytes the buckets are [middle], [first], [last], complete in the order 2, 0, 1.
    """

    def __init__(self, mlp: torch.nn.Module):
        super().__init__()
        self.last, self.first, self.middle = mlp.net[4], mlp.net[0], mlp.net[2]   # registered in this order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.middle(torch.relu(self.first(x)))))   # what MLP.forward computes


def _ddp_model(case: _DDPCase) -> torch.nn.Module:
    from dtcourse.models import GPT, MLP
    if case.model == "gpt":
        model = GPT(_gpt_config(), seed=0)
    else:
        model = MLP(_MLP_SIZES, seed=0)
        model = _Reordered(model) if case.model == "reordered" else model
    model = model.double()
    for name, p in model.named_parameters():
        p.requires_grad_(name not in case.frozen)
    return model


def _ddp_batch(case: _DDPCase, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from dtcourse.models import regression_batch, token_batch
    if case.model != "gpt":
        x, y = regression_batch(DDP_BATCH, _MLP_SIZES[0], _MLP_SIZES[-1], seed=seed)
        return x.double(), y.double()
    return token_batch(_gpt_config(), DDP_BATCH, seed=seed)


def _ddp_loss(case: _DDPCase, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    from dtcourse.models import lm_loss
    return torch.nn.functional.mse_loss(out, y) if case.model != "gpt" else lm_loss(out, y)


def _full_gradients(scratch: torch.nn.Module, model: torch.nn.Module, case: _DDPCase, x: torch.Tensor,
                    y: torch.Tensor) -> dict[str, torch.Tensor]:
    """One process's gradients on (x, y) at ``model``'s current parameters, computed on ``scratch``."""
    scratch.load_state_dict(model.state_dict())
    scratch.zero_grad(set_to_none=True)
    _ddp_loss(case, scratch(x), y).backward()
    return {name: p.grad.clone() for name, p in scratch.named_parameters() if p.requires_grad}


def _parity_rank(cls: Callable, names: tuple[str, ...], steps: int, progress: str) -> list:
    runs = [(f"case {name!r} ({DDP_CASES[name].description})", partial(_parity_case, cls, name, steps, progress))
            for name in names]
    return _stop_at_first_failure(runs, progress)


def _parity_case(cls: Callable, name: str, steps: int, progress: str) -> str | None:
    rank, n = dist.get_rank(), dist.get_world_size()
    case, note = DDP_CASES[name], Path(progress, str(dist.get_rank()))
    model = _ddp_model(case)
    reference, scratch = copy.deepcopy(model), copy.deepcopy(model)
    rows = DDP_BATCH // n
    problem, events = None, []
    with watching(ANSWERS), _deferred_all_reduces(events):
        note.write_text(f"case {name!r} ({case.description}), building the wrapper")
        ddp = _as_student(progress, lambda: cls(model, bucket_cap_mb=case.bucket_cap_mb))
        for step in range(1, steps + 1):
            x, y = _ddp_batch(case, seed=step)
            mine = slice(rank * rows, (rank + 1) * rows)   # this rank's contiguous B/N rows
            expected = _full_gradients(scratch, model, case, x, y)
            own = _full_gradients(scratch, model, case, x[mine], y[mine])
            model.zero_grad(set_to_none=True)
            note.write_text(f"case {name!r} ({case.description}), step {step}: forward and backward")
            since = len(events)
            _as_student(progress, lambda: _ddp_loss(case, ddp(x[mine]), y[mine]).backward())
            silent = (_started(events, since) == 0 < _started(events[:since]))   # none now, some before
            problem = problem or _gradient_problem(model, expected, own, n, step, _unwaited(events, since), silent)
            reference.zero_grad(set_to_none=True)
            _ddp_loss(case, reference(x), y).backward()     # one process, the whole batch
            _sgd_step(model)
            _sgd_step(reference)
    if problem is None:
        for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
            error = (p.detach() - q.detach()).abs().max().item()
            if not error <= DDP_TOL:
                return (f"after {steps} SGD steps, parameter {pname!r} differs from one process trained "
                        f"on the whole batch by up to {error:.3g} (tolerance {DDP_TOL:g})")
    return problem


def _sgd_step(model: torch.nn.Module) -> None:
    # By hand: torch.optim's first use imports torch._dynamo, seconds in every forked rank.
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= DDP_LR * p.grad


def _gradient_problem(model: torch.nn.Module, expected: dict[str, torch.Tensor], own: dict[str, torch.Tensor],
                      n: int, step: int, unwaited: list[int], silent: bool = False) -> str | None:
    """None if every .grad is the full-batch gradient, else the first parameter that is not.

    ``unwaited``: the all-reduces of this backward whose handle was never waited on; their sums
    never reached the student's tensors (``_Handle``), which the message then says. ``silent``: this
    backward started no all-reduce although an earlier one did, which the message says too.
    """
    for name, p in model.named_parameters():
        if name not in expected:
            if p.grad is not None:
                return (f"step {step}: the frozen parameter {name!r} has a .grad; frozen parameters "
                        "are in no bucket and must be left alone")
            continue
        if p.grad is None:
            return f"step {step}: parameter {name!r} has no .grad when backward() returns"
        want, got = expected[name], p.grad.detach()
        error = (got - want).abs().max().item()
        if error <= DDP_TOL:    # False for NaN too
            continue
        largest = want.abs().max().item()
        message = (f"step {step}, parameter {name!r} {tuple(p.shape)}: .grad differs from the mean gradient "
                   f"over all ranks by up to {error:.3g} (largest expected |value| {largest:.3g})")
        close = dict(rtol=1e-6, atol=DDP_TOL)
        if n > 1 and torch.allclose(got, n * want, **close):
            message += (f". It is N = {n} times the mean: all_reduce adds the ranks' gradients, so "
                        f"divide by the world size")
        elif n > 1 and torch.allclose(got, own[name], **close):
            message += (". It is still this rank's own gradient: the all-reduced bucket never reached "
                        ".grad before backward() returned")
            if silent:
                message += (f". The backward of step {step} started no all-reduce, though an earlier one did: does "
                            "_finish_backward end with self._reset(), so that the next backward finds _next, "
                            "_callback_queued and every bucket's pending as they were at the start?")
        elif not got.any():
            message += ". It is all zeros"
        if unwaited:
            message += (f". The handle(s) of all-reduce(s) {unwaited} of this backward (in the order they started) "
                        "were never waited on: an all-reduce's sum is in its tensor only once its handle's "
                        "wait() has returned, so call wait() on every bucket's handle in _complete(), before "
                        "reading the bucket")
        return message
    return None


def _overlap_rank(cls: Callable, names: tuple[str, ...], progress: str) -> list:
    runs = [(f"case {name!r} ({DDP_CASES[name].description})", partial(_overlap_case, cls, name, progress))
            for name in names]
    return _stop_at_first_failure(runs, progress)


def _overlap_case(cls: Callable, name: str, progress: str) -> str | None:
    from dtcourse.data_parallel import assign_buckets as reference
    rank, n = dist.get_rank(), dist.get_world_size()
    case, note = DDP_CASES[name], Path(progress, str(rank))
    model = _ddp_model(case)
    trainable = [(pname, p) for pname, p in model.named_parameters() if p.requires_grad]
    x, y = _ddp_batch(case, seed=1)
    mine = slice(rank * (DDP_BATCH // n), (rank + 1) * (DDP_BATCH // n))
    events: list[tuple] = []

    def backward_done() -> None:
        events.append(("backward done",))

    def start_of_backward(grad: torch.Tensor) -> None:
        # The loss's gradient comes first, so this callback is queued before any the wrapper queues
        # in its hooks, and runs first once the graph is done: it marks the end of backward proper.
        torch.autograd.Variable._execution_engine.queue_callback(backward_done)

    with watching(ANSWERS) as watch, _deferred_all_reduces(events):
        note.write_text(f"case {name!r} ({case.description}), building the wrapper")
        ddp = _as_student(progress, lambda: cls(model, bucket_cap_mb=case.bucket_cap_mb))
        for pname, p in trainable:    # a tensor hook runs before the gradient is accumulated and its hooks run
            p.register_hook(lambda grad, pname=pname: events.append(("grad", pname)))
        note.write_text(f"case {name!r} ({case.description}), forward and backward")
        loss = _as_student(progress, lambda: _ddp_loss(case, ddp(x[mine]), y[mine]))
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.register_hook(start_of_backward)
        first = len(watch.collectives)
        _as_student(progress, lambda: loss.backward())
        events.append(("backward returned",))
        collectives = [what for what, _ in watch.collectives[first:]]
    names = {id(p): pname for pname, p in trainable}
    buckets = getattr(ddp, "_buckets", None)
    if isinstance(buckets, (list, tuple)) and buckets and all(
            isinstance(getattr(b, "flat", None), torch.Tensor) and isinstance(getattr(b, "params", None), list)
            and all(id(p) in names for p in b.params) for b in buckets):
        sizes = [b.flat.nbytes for b in buckets]          # the wrapper's own buckets (DDPBase's), in index order
        members = [[names[id(p)] for p in b.params] for b in buckets]
    else:
        params = [p for _, p in trainable]
        planned = reference(params, int(case.bucket_cap_mb * 2**20))
        sizes = [sum(params[i].nbytes for i in ids) for ids in planned]
        members = [[trainable[i][0] for i in ids] for ids in planned]
    return _overlap_problem(events, collectives, sizes, members, [p.nbytes for _, p in trainable])


def _overlap_problem(events: list[tuple], collectives: list[str], sizes: list[int], members: list[list[str]],
                     param_sizes: list[int]) -> str | None:
    """What in one backward's ``events`` is not a bucketed, overlapped DDP's, or None.

    ``sizes`` and ``members``: each bucket's bytes and parameter names, in index order.
    """
    grads = [i for i, e in enumerate(events) if e[0] == "grad"]
    reductions = [(i, e) for i, e in enumerate(events) if e[0] == "all_reduce"]
    done = next((i for i, e in enumerate(events) if e[0] == "backward done"), len(events))
    returned = next(i for i, e in enumerate(events) if e[0] == "backward returned")
    others = sorted({what for what in collectives if what != "allreduce"})
    if not reductions:
        return ("backward() made no all-reduce" + (f" (only {', '.join(others)})" if others else "") + ": start "
                "each bucket's all-reduce, dist.all_reduce(bucket.flat, group=self.group, async_op=True), in "
                "_launch(bucket), which _launch_ready_buckets() calls from the hook that completes the bucket")
    ready = [sum(g < i for g in grads) for i, _ in reductions]   # gradients ready at each start
    timeline = (f"your all-reduces of {', '.join(f'{e[2]} B' for _, e in reductions)} started after "
                f"{', '.join(map(str, ready))} of the {len(grads)} gradients were ready")
    if sorted(e[2] for _, e in reductions) != sorted(sizes):
        listed = ", ".join(f"{b} B" for b in sizes)
        message = (f"expected one all-reduce per bucket, {len(sizes)} of them ({listed}), but backward() made "
                   f"{len(reductions)}: {timeline}")
        if sorted(e[2] for _, e in reductions) == sorted(param_sizes) and len(param_sizes) != len(sizes):
            message += (". That is one per parameter: copy each gradient into its bucket's flat buffer and "
                        "all-reduce the buffer, once, when the bucket is complete")
        elif sum(e[2] for _, e in reductions) != sum(param_sizes):
            message += f". Together they carry {sum(e[2] for _, e in reductions)} B, not the {sum(param_sizes)} B "
            message += "of the trainable gradients: each gradient must travel once"
        return message
    blocking = [e[1] for _, e in reductions if not e[3]]
    if blocking:
        return (f"all-reduce(s) {blocking} ran with async_op=False, so backward stopped until each finished: "
                "pass async_op=True, keep the handle in bucket.work, and wait on it in _complete()")
    after = [e[1] for i, e in reductions if i > done]
    if after:
        return (f"all-reduce(s) {after} started only after backward had produced every gradient (in "
                f"_finish_backward(), or later), so no communication overlapped with it: {timeline}. Start a "
                "bucket's all-reduce in the hook that completes the bucket, through _launch_ready_buckets()")
    # Gradients ready once bucket k is complete, and once it and every bucket before it are: when it may start.
    arrived = {events[i][1]: count for count, i in enumerate(grads, start=1)}
    complete = [max((arrived.get(name, len(grads)) for name in names), default=0) for names in members]
    due = list(itertools.accumulate(complete, max))
    carried = [e[2] for _, e in reductions]
    if carried != sizes:
        k = next(k for k, (got, want) in enumerate(zip(carried, sizes)) if got != want)
        order = sorted(range(len(sizes)), key=lambda j: (complete[j], j))
        return (f"all-reduce {k} carried {carried[k]} B, but bucket {k} holds {sizes[k]} B: {timeline}. The "
                f"buckets were complete in the order {order}, and every rank must start the same all-reduces in "
                "the same order, whatever order its own hooks fire in: start them in index order, bucket k only "
                "once buckets 0 to k-1 have started (_launch_ready_buckets(), from self._next on)")
    early = [k for k in range(len(sizes)) if ready[k] < due[k]]
    if early:
        k = early[0]
        which = f"bucket {k} and the buckets before it were" if k else "bucket 0 was"
        return (f"all-reduce {k} started after only {ready[k]} of the {len(grads)} gradients, but {which} complete "
                f"only after {due[k]}: {timeline}. Launch a bucket once its pending count, and every earlier "
                "bucket's, is 0")
    late = [k for k in range(len(sizes)) if ready[k] > due[k]]
    if late:
        could = ", ".join(str(due[k]) for k in late)
        head = ("started only once every gradient was ready, so they could not overlap with backward"
                if all(ready[k] >= len(grads) for k in late) else "started later than their buckets allowed")
        return (f"all-reduce(s) {late} {head}: {timeline}, but they could start after {could}, when their bucket "
                "and every bucket before it were complete. Launch in the hook that completes them: _grad_ready "
                "calls _launch_ready_buckets() after every gradient")
    early = [(e[1], sum(g < i for g in grads)) for i, e in enumerate(events)
             if e[0] == "wait" and sum(g < i for g in grads) < len(grads)]
    if early:
        k, seen = early[0]
        return (f"all-reduce {k}'s handle was waited on after only {seen} of the {len(grads)} gradients, so "
                "backward stalled there: wait on the handles only in _complete(), which _finish_backward() calls "
                "after the last gradient")
    unwaited = _unwaited(events[:returned])
    if unwaited:
        return (f"the handle(s) of all-reduce(s) {unwaited} (in the order they started) were never waited on "
                "before backward() returned: until wait() returns, the sum need not be in the bucket yet, "
                "whatever it happens to hold on one run. Call wait() on every bucket's handle in _complete()")
    return None
