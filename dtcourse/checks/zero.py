"""Checks for exercise 06: a student's ZeRO stage-2 step, against one process and against the algorithm.

The student's class (``ZeroBase``'s subclass in the exercise) is built as
``cls(module, optimizer, buckets)`` on every rank, ``buckets`` a list of lists of parameter names;
each bucket is laid out end to end in one flat vector padded to N·s elements, s = ceil(Ψ_b / N),
and rank r owns elements [r·s, (r+1)·s) of it (``bucket.shard``). Four checks::

    check_zero_gradients(ZeroStage2, world_sizes=(2,), cases=("mlp",))

* ``check_zero_gradients``: after one ``backward()``, every ``bucket.shard.grad`` holds this
  rank's part of the mean gradient over all ranks (one process on the whole batch);
* ``check_zero_memory``: the technique in backward: each bucket is reduce-scattered, once, in the
  hook that completes it, with an input of its padded bytes; its parameters' ``.grad`` are gone
  by then, and afterwards the wrapper holds no tensor the size of a whole bucket's gradient;
* ``check_zero_parity``: after several steps of SGD (momentum) and of AdamW, the parameters
  equal one process's trained on the whole batch;
* ``check_zero_traffic``: what a rank sends in one step, (N-1)/N·Ψ·4 bytes in reduce-scatters
  during backward plus as much in all-gathers in ``step()``, bucket by bucket, and that the
  optimizer holds only this rank's shards and their states.

Every collective and point-to-point message the student's code starts is recorded with its bytes
(``_recording``); what it sends is what a bandwidth-optimal algorithm sends (the ring of
lesson 01), since the backend's own messages are invisible from Python: a reduce-scatter or an
all-gather of a flat tensor of S bytes sends (N-1)/N·S, an all-reduce 2(N-1)/N·S. While the
student's code runs, ``dtcourse.zero``'s answers refuse to run (``guard.watching``), and passing
one of them to a check is refused too.
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

from dtcourse.checks.common import (_as_student, _check_names, _launch_check, _noting_calls, _refuse_library_code,
                                     _stop_at_first_failure)
from dtcourse.checks.guard import Answers, _nbytes, watching

__all__ = ["check_zero_gradients", "check_zero_memory", "check_zero_parity", "check_zero_traffic",
           "ZERO_CASES", "ZERO_TOL", "OPTIMIZERS"]

# What these checks switch off while the student's code runs (guard.watching), and refuse to be given
ANSWERS = Answers("06", course=("dtcourse.zero.flat.FlatShard", "dtcourse.zero.sharded.ZeRO"))
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

_ADVICE = ("Subclass ZeroBase, as the exercise's cell does, write grad_ready and step yourself, and pass that.")
_HINT = ("This is most likely a deadlock: a rank waits in a collective that another rank never started. "
         "Every rank must start the same collectives in the same order: one reduce-scatter per bucket in "
         "backward, one all-gather per bucket in step(). Raise timeout= only if your code is merely slow.")


# --------------------------------------------------------------------------- #
# The cases: a model, and its bucket plan (parameter names, in the order backward completes them)
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class _ZeroCase:
    description: str
    model: str                                   # "mlp", "tiny" or "gpt", float32
    plan: str                                    # "mlp", "per_parameter", "one", "scattered" or "per_module"


_MLP = (7, 13, 11, 5)       # numels 91, 13, 143, 11, 55, 5
_TINY = (3, 2, 1)           # numels 6, 2, 2, 1
ZERO_CASES = {
    "mlp": _ZeroCase("MLP (7, 13, 11, 5), 3 buckets of 71, 143 and 104 elements", "mlp", "mlp"),
    "per_parameter": _ZeroCase("the same MLP, a bucket per parameter (5 to 143 elements)", "mlp", "per_parameter"),
    "one_bucket": _ZeroCase("the same MLP, all 318 elements in one bucket", "mlp", "one"),
    "scattered": _ZeroCase("the same MLP, 2 buckets that mix the layers (239 and 79 elements), both complete "
                           "only with the first layer's gradients", "mlp", "scattered"),
    "tiny": _ZeroCase("MLP (3, 2, 1), a bucket per parameter of 1 to 6 elements: some ranks own only padding",
                      "tiny", "per_parameter"),
    "gpt": _ZeroCase("a 1-layer GPT, a bucket per module (10 buckets)", "gpt", "per_module"),
}


def _gpt_config():
    from dtcourse.models import GPTConfig
    return GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, d_model=16)


def _model(case: _ZeroCase) -> nn.Module:
    from dtcourse.models import GPT, MLP
    if case.model == "gpt":
        return GPT(_gpt_config(), seed=0)
    return MLP(_MLP if case.model == "mlp" else _TINY, seed=0)


def _plan(case: _ZeroCase, model: nn.Module) -> list[list[str]]:
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if case.plan == "mlp":
        return [["net.4.bias", "net.4.weight", "net.2.bias"], ["net.2.weight"], ["net.0.bias", "net.0.weight"]]
    if case.plan == "scattered":
        return [["net.0.weight", "net.4.bias", "net.2.weight"], ["net.2.bias", "net.0.bias", "net.4.weight"]]
    if case.plan == "one":
        return [names[::-1]]
    if case.plan == "per_parameter":
        return [[n] for n in reversed(names)]
    modules: dict[str, list[str]] = {}        # per_module: each module's parameters, last module first
    for n in names:
        modules.setdefault(n.rpartition(".")[0], []).append(n)
    return list(modules.values())[::-1]


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
class _Layout:
    """One bucket as the exercise lays it out: its parameters end to end, padded to N·s elements."""

    index: int
    names: list[str]
    spans: dict[str, tuple[int, int]]
    numel: int          # Ψ_b
    size: int           # s = ceil(Ψ_b / N)
    padded: int         # N·s

    def describe(self) -> str:
        names = ", ".join(self.names[:4]) + (f", ... ({len(self.names)} in all)" if len(self.names) > 4 else "")
        pad = f" padded to {self.padded}" if self.padded != self.numel else ""
        return f"bucket {self.index} ({names}: {self.numel} elements{pad}, {self.size} per rank)"

    def element(self, k: int) -> str:
        """The parameter element at position ``k`` of the flat vector, e.g. "net.2.bias[3]" or "padding"."""
        for name, (lo, hi) in self.spans.items():
            if lo <= k < hi:
                return f"{name}[{k - lo}] (flat element {k})"
        return f"padding (flat element {k})"


def _layouts(plan: list[list[str]], model: nn.Module, n: int) -> list[_Layout]:
    numels = dict((name, p.numel()) for name, p in model.named_parameters())
    found = []
    for index, names in enumerate(plan):
        spans, lo = {}, 0
        for name in names:
            spans[name] = (lo, lo + numels[name])
            lo += numels[name]
        size = -(-lo // n)
        found.append(_Layout(index, list(names), spans, lo, size, n * size))
    return found


def _flat(layout: _Layout, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The bucket's padded (N·s,) vector of ``tensors`` (by name), zero in the padding."""
    flat = torch.zeros(layout.padded, dtype=torch.float32)
    for name, (lo, hi) in layout.spans.items():
        flat[lo:hi] = tensors[name].detach().reshape(-1)
    return flat


# --------------------------------------------------------------------------- #
# What the student's code sends, in order, with its bytes
# --------------------------------------------------------------------------- #
_REDUCE_SCATTERS = ("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
                    "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced")
_ALL_GATHERS = ("allgather", "_allgather_base", "all_gather_single", "allgather_coalesced",
                "allgather_into_tensor_coalesced", "all_gather_single_coalesced")
_ALL_REDUCES = ("allreduce", "allreduce_coalesced")
_OTHERS = ("broadcast", "reduce", "alltoall", "alltoall_base", "scatter", "gather", "barrier")


@dataclass(frozen=True)
class _Sent:
    """One collective or message this rank started: ``nbytes`` of the whole tensor, ``sent`` by this rank."""

    op: str          # "reduce-scatter", "all-gather", "all-reduce", "send", or the process group's method
    nbytes: int      # reduce-scatter: its input; all-gather: its output; all-reduce: the tensor; send: the message
    sent: int
    phase: str       # "forward", "backward" or "step"

    def __str__(self) -> str:
        return f"{self.op} of {self.nbytes} B, {self.sent} B sent"


def _describe(method: str, args: tuple, world: int, phase: str) -> _Sent:
    if method in _REDUCE_SCATTERS:               # sends (N-1)/N of its input
        full = _nbytes(args[1]) if len(args) > 1 else 0
        return _Sent("reduce-scatter", full, full * (world - 1) // world, phase)
    if method in _ALL_GATHERS:                   # sends (N-1)/N of its output
        full = _nbytes(args[0])
        return _Sent("all-gather", full, full * (world - 1) // world, phase)
    if method in _ALL_REDUCES:                   # sends 2(N-1)/N of the tensor
        full = _nbytes(args[0])
        return _Sent("all-reduce", full, 2 * full * (world - 1) // world, phase)
    if method == "send":
        return _Sent("send", _nbytes(args[0]), _nbytes(args[0]), phase)
    full = _nbytes(args[0]) if args else 0
    return _Sent(method, full, 0 if method == "barrier" else full * (world - 1) // world, phase)


@contextmanager
def _recording(log: list[_Sent], phase: list[str], world: int) -> Iterator[None]:
    """Inside ``watching``: append a ``_Sent`` to ``log`` for every collective and send, in ``phase[0]``."""
    methods = (*_REDUCE_SCATTERS, *_ALL_GATHERS, *_ALL_REDUCES, *_OTHERS, "send")
    with _noting_calls(methods, lambda method, pg, args: log.append(_describe(method, args, world, phase[0]))):
        yield


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
    """One case on this rank: the model, its plan and layout, the student's wrapper, what it sent."""

    def __init__(self, cls: Callable, name: str, optimizer: str, progress: str):
        self.rank, self.n = dist.get_rank(), dist.get_world_size()
        self.name, self.case = name, ZERO_CASES[name]
        self.label = f"case {name!r} ({self.case.description})"
        self.note = Path(progress, str(self.rank))
        self.model = _model(self.case)
        self.reference = copy.deepcopy(self.model)           # one process, the whole batch
        self.plan = _plan(self.case, self.model)
        self.layouts = _layouts(self.plan, self.model, self.n)
        self.optimizers = _Optimizers(optimizer)
        self.log: list[_Sent] = []
        self.phase = ["construction"]
        self.cls, self.progress = cls, progress
        self.rows = slice(self.rank * ZERO_BATCH // self.n, (self.rank + 1) * ZERO_BATCH // self.n)

    def say(self, what: str) -> None:
        self.note.write_text(f"{self.label}, {what}")

    def build(self) -> object:
        self.say("building the wrapper")
        return _as_student(self.progress, lambda: self.cls(self.model, self.optimizers, [list(b) for b in self.plan]))

    def forward_backward(self, wrapper: object, step: int) -> None:
        x, y = _batch(self.case, seed=step)
        self.say(f"step {step}: forward")
        self.phase[0] = "forward"
        loss = _as_student(self.progress, lambda: _loss(self.case, wrapper(x[self.rows]), y[self.rows]))
        self.say(f"step {step}: backward")
        self.phase[0] = "backward"
        _as_student(self.progress, lambda: loss.backward())

    def step(self, wrapper: object, step: int) -> None:
        self.say(f"step {step}: step()")
        self.phase[0] = "step"
        _as_student(self.progress, lambda: wrapper.step())

    def full_gradients(self, step: int, rows: slice = slice(None)) -> dict[str, torch.Tensor]:
        """One process's gradients on rows ``rows`` of step ``step``'s batch, at the reference's parameters."""
        scratch = copy.deepcopy(self.reference)
        x, y = _batch(self.case, seed=step)
        _loss(self.case, scratch(x[rows]), y[rows]).backward()
        return {n: p.grad for n, p in scratch.named_parameters()}

    def recording(self):
        """Inside ``watching(ANSWERS)``: everything the student's code sends, recorded in ``self.log``.

        ``watching`` itself must be entered by the function that runs the student's code: the frame
        that enters it is where the check's own frames end (``dtcourse.runtime.refuse``).
        """
        return _recording(self.log, self.phase, self.n)


def _buckets_of(wrapper: object, layouts: list[_Layout]) -> tuple[list, str | None]:
    """The wrapper's buckets, or what is missing (the checks read ``bucket.shard`` as ZeroBase makes it)."""
    buckets = getattr(wrapper, "buckets", None)
    if not isinstance(buckets, (list, tuple)) or len(buckets) != len(layouts) or not all(
            isinstance(getattr(b, "shard", None), torch.Tensor) for b in buckets):
        return [], (f"the wrapper must keep ZeroBase's self.buckets, {len(layouts)} of them, each with its "
                    "bucket.shard; subclass ZeroBase and leave its __init__ as it is")
    return list(buckets), None


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
# check_zero_gradients: each rank's shard of the mean gradient
# --------------------------------------------------------------------------- #
def check_zero_gradients(cls: Callable, world_sizes: Sequence[int] = (2,), cases: Sequence[str] = ("mlp",),
                         timeout: float | None = None) -> None:
    """After one ``backward()`` through ``cls(module, optimizer, buckets)``, each ``bucket.shard.grad`` must
    be this rank's part of the mean gradient.

    Every rank runs forward and backward on its B/N rows of a batch of 60. Rank r's
    ``bucket.shard.grad`` must then hold elements [r·s, (r+1)·s) of the bucket's padded flat gradient,
    averaged over the ranks (one process on the whole batch), within ``ZERO_TOL``; the padding is
    zero. A failure names the world size, case, rank, bucket and element, with a hint when the
    values are N times the mean, this rank's own unreduced gradient, or another rank's part.
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
    buckets, problem = _buckets_of(wrapper, run.layouts)
    if problem:
        return problem
    mean, own = run.full_gradients(1), run.full_gradients(1, run.rows)
    for layout, bucket in zip(run.layouts, buckets):
        problem = _shard_problem(layout, bucket.shard.grad, _flat(layout, mean), _flat(layout, own), run.rank, run.n)
        if problem:
            return problem
    return None


def _shard_problem(layout: _Layout, got: object, mean: torch.Tensor, own: torch.Tensor, rank: int,
                   n: int) -> str | None:
    s = layout.size
    lo, hi = rank * s, (rank + 1) * s
    where = f"{layout.describe()}: shard.grad"
    if got is None:
        return (f"{where} is None after backward(): put the reduce-scatter's output, divided by N, in "
                "bucket.shard.grad")
    got = got.detach()
    if got.numel() == layout.padded and layout.padded != s:
        return (f"{where} has {got.numel()} elements, the whole padded bucket: rank {rank} keeps only its part, "
                f"elements [{lo}, {hi}), {s} of them. Reduce-scatter the bucket rather than all-reduce it")
    if got.numel() != s:
        return f"{where} has {got.numel()} elements; this rank's part has s = ceil({layout.numel}/{n}) = {s}"
    got, want = got.reshape(-1).float(), mean[lo:hi]
    error = (got - want).abs()
    worst = int(error.argmax()) if error.numel() else 0
    if not error.numel() or error.max().item() <= ZERO_TOL:          # False for NaN too
        return None
    message = (f"{where} differs from this rank's part of the mean gradient (elements [{lo}, {hi}) of the padded "
               f"bucket) by up to {error.max().item():.3g} at {layout.element(lo + worst)}: expected "
               f"{want[worst].item():.6g}, got {got[worst].item():.6g}")
    close = dict(rtol=1e-4, atol=ZERO_TOL)
    if n > 1 and torch.allclose(got, n * want, **close):
        message += (f". It is N = {n} times the mean: the reduce-scatter adds the ranks' gradients, so divide "
                    "by the world size")
    elif n > 1 and torch.allclose(got, own[lo:hi], **close):
        message += (". It is this rank's own gradient, not reduced over the ranks: reduce-scatter the bucket's "
                    "flat gradient into shard.grad")
    else:
        other = next((r for r in range(n) if r != rank and torch.allclose(got, mean[r * s:(r + 1) * s], **close)),
                     None)
        if other is not None:
            message += (f". It is rank {other}'s part: rank r keeps elements [r·s, (r+1)·s) of the padded "
                        "bucket, and the reduce-scatter gives rank r exactly that part of its input")
        elif not got.any():
            message += ". It is all zeros"
    return message


# --------------------------------------------------------------------------- #
# check_zero_memory: reduce-scatter each bucket when it completes, and free its gradients
# --------------------------------------------------------------------------- #
def check_zero_memory(cls: Callable, world_sizes: Sequence[int] = (2,), cases: Sequence[str] = ("mlp",),
                      timeout: float | None = None) -> None:
    """One ``backward()`` through ``cls(module, optimizer, buckets)`` must keep no full gradient.

    The check sees every gradient as autograd produces it (a hook that runs after the wrapper's)
    and every collective the wrapper starts. It wants, for every bucket: one reduce-scatter of its
    padded flat gradient (N·s elements), started in the hook that completes the bucket; none of its
    parameters' ``.grad`` left once that hook returns; no all-reduce. After backward, each
    ``bucket.shard.grad`` has s elements and is not a view of anything larger, and the wrapper
    holds no tensor the size of a whole bucket's gradient. So the most gradient a rank ever holds
    is the buckets still filling, plus one bucket being reduced, plus its 1/N shards.
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
            arrivals.append((param_name, len(run.log),
                             {n: p.grad.nbytes for n, p in named if p.grad is not None}))

        for param_name, p in named:
            p.register_post_accumulate_grad_hook(lambda p, param_name=param_name: seen(param_name))
        start = len(run.log)
        run.forward_backward(wrapper, step=1)
    buckets, problem = _buckets_of(wrapper, run.layouts)
    return problem or _memory_problem(run, arrivals, start, wrapper, buckets)


def _memory_problem(run: _Run, arrivals: list, start: int, wrapper: object, buckets: list) -> str | None:
    n, total = run.n, sum(layout.numel for layout in run.layouts) * 4
    largest = max((sum(alive.values()) for _, _, alive in arrivals), default=0)
    peak = f". The most .grad bytes alive at once were {largest} B; the whole model's gradient is {total} B"
    order = [name for name, _, _ in arrivals]
    backward = [s for s in run.log[start:] if s.phase == "backward"]
    forward = [s for s in run.log[start:] if s.phase == "forward"]
    if forward:
        return (f"forward made {', '.join(map(str, forward))}: a stage-2 forward communicates nothing, every "
                "rank holds all the parameters")
    reductions = [s for s in backward if s.op == "reduce-scatter"]
    done: list[_Layout] = []
    for k, (param_name, count, alive) in enumerate(arrivals):
        completed = [layout for layout in run.layouts if param_name in layout.names and layout not in done
                     and all(name in order[:k + 1] for name in layout.names)]
        for layout in completed:
            done.append(layout)
            started = [s for s in run.log[start:count] if s.phase == "backward"]
            scattered = [s for s in started if s.op == "reduce-scatter"]
            if len(scattered) < len(done):
                reduced = [s for s in started if s.op == "all-reduce"]
                if reduced:
                    return (f"{layout.describe()} was all-reduced (an {reduced[-1]}): that leaves the whole summed "
                            f"gradient on every rank and sends 2(N-1)/N·S, twice a reduce-scatter's (N-1)/N·S. "
                            f"Rank r needs only its part: reduce-scatter the bucket's padded flat gradient")
                return (f"{layout.describe()} had all its gradients after {k + 1} of the {len(arrivals)} gradients, "
                        f"but by the end of that hook only {len(scattered)} reduce-scatter(s) had started for the "
                        f"{len(done)} bucket(s) complete: start a bucket's reduce-scatter in grad_ready, in the hook "
                        "that completes it, not after backward (that is stage 1, which holds every gradient until "
                        f"backward ends){peak}")
            want = layout.padded * 4
            if scattered[len(done) - 1].nbytes != want:
                got = scattered[len(done) - 1].nbytes
                return (f"the reduce-scatter of {layout.describe()} had an input of {got} B; the bucket's padded "
                        f"flat gradient is N·s = {n}·{layout.size} = {layout.padded} elements, {want} B "
                        f"({got - want:+d} B): copy every gradient of the bucket into one (N·s,) vector, zero "
                        "in the padding, and reduce-scatter that")
            kept = [(name, alive[name]) for name in layout.names if name in alive]
            if kept:
                listed = ", ".join(f"{name!r} ({nbytes} B)" for name, nbytes in kept)
                return (f"after the hook that completed {layout.describe()}, its gradient(s) {listed} were still "
                        f"in .grad: once the bucket is copied out, set each of its parameters' .grad to None. "
                        f"Kept, they add up to the whole model's gradient on every rank, which stage 2 must "
                        f"never hold{peak}")
    if len(done) < len(run.layouts):
        missing = [layout.describe() for layout in run.layouts if layout not in done]
        return f"backward() never completed {', '.join(missing)}: some gradient did not arrive"
    extra = [s for s in backward if s.op != "reduce-scatter"]
    if len(reductions) != len(run.layouts) or extra:
        listed = ", ".join(map(str, backward))
        return (f"backward made {listed}; expected exactly one reduce-scatter per bucket, {len(run.layouts)} "
                f"of them")
    for layout, bucket in zip(run.layouts, buckets):
        grad = bucket.shard.grad
        if grad is None:
            return f"{layout.describe()}: shard.grad is None after backward(): the reduced part belongs there"
        storage = grad.untyped_storage().nbytes()
        if grad.numel() != layout.size or storage > layout.size * grad.element_size():
            return (f"{layout.describe()}: shard.grad has {grad.numel()} elements on a storage of {storage} B, "
                    f"but rank {run.rank} keeps only its part: {layout.size} elements, {layout.size * 4} B. A view "
                    "into the whole bucket keeps the whole bucket alive; reduce-scatter into a tensor of s "
                    "elements")
    kept = _full_size_tensors(wrapper, run.layouts, buckets)
    if kept:
        where, tensor, layout = kept[0]
        return (f"after backward, the wrapper still holds a tensor of {tensor.numel()} elements ({tensor.nbytes} B) "
                f"at {where}: the size of {layout.describe()}'s whole gradient. Stage 2 keeps only this rank's "
                f"part of it ({layout.size} elements, in shard.grad); make the flat gradient a local variable "
                "of the hook, so that it is freed once the reduce-scatter has read it")
    return None


def _full_size_tensors(wrapper: object, layouts: list[_Layout], buckets: list) -> list:
    """(where, tensor, bucket) for each tensor the wrapper keeps that is a whole bucket's size.

    The parameters (``flat``), the shards and their gradients (checked before this, s elements each) are not
    counted, even where a shard happens to be as long as another bucket.
    """
    sizes = {}
    for layout in layouts:
        sizes.setdefault(layout.padded, layout)
        sizes.setdefault(layout.numel, layout)
    ours = {b.flat.untyped_storage().data_ptr() for b in buckets if isinstance(getattr(b, "flat", None), torch.Tensor)}
    ours |= {t.untyped_storage().data_ptr() for b in buckets for t in (b.shard, b.shard.grad) if t is not None}
    module_keys = set(vars(nn.Module()))
    found, seen = [], set()

    def visit(obj: object, where: str, depth: int) -> None:
        if id(obj) in seen or depth > 4:
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
    """``cls(module, optimizer, buckets)`` with ``backward()`` and ``step()`` must train as one process does.

    For each optimizer (keys of ``OPTIMIZERS``), every rank trains a fresh wrapper for ``steps``
    steps on its B/N rows of a batch of 60, beside one process training the same model on the
    whole batch with the same optimizer. After every step, the module's parameters must match
    within ``ZERO_TOL`` on every rank. A failure names the world size, case, optimizer, step,
    rank, parameter and element, with a hint when the parameters did not move, moved only in
    this rank's part (no all-gather), or moved as one process's do when its gradients are never
    cleared (step k stepped with the sum of steps 1 to k's gradients), in which case the hint says
    which gradients were left between steps: the parameters' ``.grad`` or the shards'.
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
    for layout in run.layouts:
        for name in layout.names:
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
            return message + _parameters_hint(run, layout, got, want, before)
    return None


def _never_cleared(run: _Run, start: nn.Module, optimizer: str, steps: int) -> dict[str, torch.Tensor]:
    """The parameters of one process after ``steps`` steps on the whole batch whose gradients are never cleared.

    Autograd adds each backward's gradient to the ``.grad`` already there, so step k steps with the
    sum of the gradients of steps 1 to k (each at the parameters of its own step): what a ZeRO step
    does when the parameters' ``.grad``, or the shards', outlive the step.
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
    buckets, _ = _buckets_of(wrapper, run.layouts)
    shards = [str(k) for k, bucket in enumerate(buckets) if bucket.shard.grad is not None]
    message = (f". The parameters moved exactly as one process's do when its gradients are never cleared: step "
               f"{step} stepped with the sum of the gradients of steps 1 to {step}, not with step {step}'s alone. "
               "Your gradients accumulate across steps, since backward adds each new gradient to the .grad already "
               "there (and so does += on shard.grad)")
    # Both left, and the parameters would have moved as the sum of sums: the .grad alone explain a single sum.
    if left:
        listed = ", ".join(map(repr, left[:4])) + (f", ... ({len(left)} in all)" if len(left) > 4 else "")
        return (f"{message}. After step(), the parameters {listed} still had a .grad, which the next backward "
                "added to: in grad_ready, set each parameter's .grad to None once it is copied into its bucket's "
                "flat gradient for the reduce-scatter")
    if shards:
        return (f"{message}. After step(), bucket.shard.grad was still set for bucket(s) {', '.join(shards)}: clear "
                "the shards' gradients once self.optimizer.step() has used them (self.optimizer.zero_grad()), so "
                "that the next backward starts from nothing, and make shard.grad the reduce-scatter's output "
                "divided by N rather than adding that to the old one")
    return (f"{message}. Clear them between steps: each parameter's .grad in grad_ready, once it is copied into its "
            "bucket's flat gradient for the reduce-scatter, and the shards' gradients after self.optimizer.step() "
            "(self.optimizer.zero_grad()); keep no running sum of your own")


def _parameters_hint(run: _Run, layout: _Layout, got: dict, want: dict, before: dict) -> str:
    mine, wanted, old = _flat(layout, got), _flat(layout, want), _flat(layout, before)
    s, r = layout.size, run.rank
    lo, hi = r * s, (r + 1) * s
    same = lambda a, b: torch.allclose(a, b, rtol=0, atol=ZERO_TOL)     # noqa: E731
    moved = not same(wanted, old)
    if moved and torch.equal(mine, old):
        return (f". No parameter of {layout.describe()} changed in this step: the optimizer steps bucket.shard, "
                "and the model's parameters (views of bucket.flat) change only when step() all-gathers every "
                "rank's updated shard into bucket.flat")
    if moved and same(mine[lo:hi], wanted[lo:hi]) and same(torch.cat([mine[:lo], mine[hi:]]),
                                                           torch.cat([old[:lo], old[hi:]])):
        return (f". Only this rank's part of {layout.describe()} (elements [{lo}, {hi})) was updated: all-gather "
                "the updated shards into bucket.flat, so that every rank gets every rank's part")
    return f" ({layout.describe()}; if check_zero_gradients passes, look at step())"


# --------------------------------------------------------------------------- #
# check_zero_traffic: the bytes of one step, bucket by bucket, and the optimizer's share
# --------------------------------------------------------------------------- #
def check_zero_traffic(cls: Callable, world_sizes: Sequence[int] = (2,), cases: Sequence[str] = ("mlp",),
                       steps: int = 2, timeout: float | None = None) -> None:
    """One step of ``cls(module, optimizer, buckets)`` must send what ZeRO stage 2 sends, and step only the shards.

    With AdamW, for ``steps`` steps, the check records every collective and message (and its
    bytes) of forward, backward and ``step()``. It wants one reduce-scatter per bucket in backward,
    of the bucket's padded bytes, and one all-gather per bucket in ``step()``, of the same bytes;
    nothing else. So each rank sends (N-1)/N·Ψ·4 bytes in each, Ψ the padded elements of all
    buckets: 2(N-1)/N·Ψ·4 a step, as much as data parallelism's all-reduce. The optimizer must be
    given only this rank's shards (Σ s elements), and hold 2 states of that size after a step.
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
            start = len(run.log)
            run.forward_backward(wrapper, step)
            run.step(wrapper, step)
            problem = _traffic_problem(run, run.log[start:], step) or _optimizer_states(run, step)
            if problem:
                return problem
    return None


def _optimizer_given(run: _Run) -> str | None:
    shards = sum(layout.size for layout in run.layouts)
    given = [p for params, _ in run.optimizers.made for p in params]
    if len(run.optimizers.made) != 1 or sum(p.numel() for p in given) != shards:
        sizes = ", ".join(str(p.numel()) for p in given[:8]) + (", ..." if len(given) > 8 else "")
        return (f"the optimizer was built {len(run.optimizers.made)} time(s), and given {len(given)} tensor(s) of "
                f"{sizes} elements ({sum(p.numel() for p in given)} in all); stage 2 builds one optimizer, on this "
                f"rank's shards only: {len(run.layouts)} tensors of {shards} elements in all (ZeroBase does this)")
    return None


def _optimizer_states(run: _Run, step: int) -> str | None:
    want = _STATES["adamw"] * sum(layout.size for layout in run.layouts) * 4
    _, optimizer = run.optimizers.made[0]
    held = sum(t.nbytes for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)
    if held != want:
        return (f"after step {step}, the optimizer holds {held} B of states; AdamW keeps 2 per element of this "
                f"rank's shards: 2 · {want // 8} elements · 4 B = {want} B (did step() call self.optimizer.step() "
                "once?)")
    return None


def _traffic_problem(run: _Run, log: list[_Sent], step: int) -> str | None:
    n = run.n
    padded = sum(layout.padded for layout in run.layouts) * 4
    one_way = padded * (n - 1) // n                       # (N-1)/N · Ψ · 4, Ψ padded
    sent = sum(s.sent for s in log)
    by_phase = {phase: [s for s in log if s.phase == phase] for phase in ("forward", "backward", "step")}
    listed = "; ".join(f"{phase}: {', '.join(map(str, items))}" for phase, items in by_phase.items() if items)
    summary = (f"rank {run.rank} sent {sent} B in step {step}; a stage-2 step sends 2 · (N-1)/N · Ψ · 4 = "
               f"2 · {n - 1}/{n} · {padded // 4} · 4 = {2 * one_way} B ({one_way} B in reduce-scatters during "
               f"backward, {one_way} B in all-gathers in step(); Ψ = {padded // 4} elements, padding included). "
               f"Yours: {listed or 'nothing'}")
    gathers = [s for s in by_phase["step"] if s.op == "all-gather"]
    wanted = [layout.padded * 4 for layout in run.layouts]
    if not by_phase["step"] and by_phase["backward"]:
        return (f"step() sent nothing: after self.optimizer.step() has updated this rank's shards, all-gather "
                f"each bucket's shard into bucket.flat, or the other ranks never see this rank's part. {summary}")
    scatters = [s for s in by_phase["backward"] if s.op == "reduce-scatter"]
    if sorted(s.nbytes for s in scatters) != sorted(wanted) or len(scatters) != len(by_phase["backward"]):
        return (f"backward should make one reduce-scatter per bucket, of its padded flat gradient "
                f"({', '.join(f'{b} B' for b in wanted)}), and nothing else. {summary}")
    if any(s.op == "all-reduce" for s in by_phase["step"]):
        return (f"step() all-reduced the parameters: only this rank's part of each bucket changed, so an "
                f"all-gather (N-1)/N·S is enough, where an all-reduce sends 2(N-1)/N·S. {summary}")
    if sorted(s.nbytes for s in gathers) != sorted(wanted) or len(gathers) != len(by_phase["step"]):
        return (f"step() should make one all-gather per bucket, of its padded flat parameters "
                f"({', '.join(f'{b} B' for b in wanted)}). {summary}")
    if sent != 2 * one_way:
        return f"{sent - 2 * one_way:+d} B off: {summary}"
    return None
