"""Checks for exercise 05: a student's checkpointed sequential container against dtcourse.checkpointing.

``check_segment_bounds`` holds a student's ``segment_bounds`` to the course's rule;
``check_checkpoint_gradients`` runs a student's ``CheckpointedSequential`` next to the plain
``nn.Sequential`` of the same layers and wants the same outputs and gradients, bit for bit;
``check_checkpoint_memory`` checks the technique itself: what the container holds after its
forward, which layers backward runs again, the most it holds at once during backward, that each
recomputed tensor is let go once the backward ops that read it are done, and that the recomputed
tensors are gone when backward returns. Each runs the student's code in a child
process and raises one AssertionError that names the case, the segment count and what differs::

    check_checkpoint_gradients(CheckpointedSequential, cases=("mlp",))

Why exact equality: a recomputation runs the same ops on the same inputs with the same RNG
state, so on a CPU it reproduces every value to the bit, and the backward that reads them is
the plain run's own graph. Any difference at all is a bug, not rounding.

While the student's code runs (``guard.watching``), ``dtcourse.checkpointing``'s answers and
``torch.utils.checkpoint`` refuse to run; passing one of them to a check is refused too.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dtcourse.memory import new_storages
from dtcourse.checks.common import _as_student, _check_names, _launch_check, _refuse_library_code, _student_error
from dtcourse.checks.guard import Answers, watching

__all__ = ["check_segment_bounds", "check_checkpoint_gradients", "check_checkpoint_memory",
           "SEGMENT_CASES", "GRADIENT_CASES", "MEMORY_SLACK"]

# What these checks switch off while the student's code runs (guard.watching), and refuse to be given
ANSWERS = Answers("05", course=tuple(f"dtcourse.checkpointing.{name}" for name in (
    "checkpoint", "segment_bounds", "checkpoint_sequential", "CheckpointedSequential")),
    library={"torch.utils.checkpoint is switched off while exercise 05's checks run: the exercise asks you to write "
             "the checkpointing yourself": (      # what each form looks up at every call (torch 2.15: the _impl)
                 "torch.utils.checkpoint.CheckpointFunction.apply",
                 "torch.utils.checkpoint._checkpoint_without_reentrant_generator?",
                 "torch.utils.checkpoint._checkpoint_without_reentrant_generator_impl?")})

# (n_layers, segments) pairs, and the segment counts that must raise ValueError, per case.
SEGMENT_CASES = {
    "small": ("every segment count for 1 to 6 layers", [(n, k) for n in range(1, 7) for k in range(1, n + 1)],
              [(5, 0), (5, 6)]),
    "large": ("16, 31 and 100 layers", [(n, k) for n in (16, 31, 100) for k in (1, 2, 3, 7, 15, n - 1, n)],
              [(100, -1), (100, 101), (1, 2)]),
}


@dataclass(frozen=True)
class _GradientCase:
    description: str
    layers: str                  # "tanh", "dropout" or "gpt", always float64
    segments: tuple[int, ...]
    input_grad: bool = True      # does the stack's input require grad?
    steps: int = 1               # forward + backward on the same container, gradients accumulating


GRADIENT_CASES = {
    "mlp": _GradientCase("6 layers of Linear(8, 8) + Tanh", "tanh", (1, 2, 3, 4, 5, 6)),
    "dropout": _GradientCase("6 layers of Linear(8, 8) + Dropout(0.3) + Tanh", "dropout", (2, 3, 6)),
    "gpt": _GradientCase("the 3 layers of a GPT with dropout 0.1", "gpt", (1, 2, 3)),
    "no_grad_input": _GradientCase("the Tanh layers on an input that needs no gradient", "tanh", (3,),
                                   input_grad=False),
    "twice": _GradientCase("the dropout layers, two steps on one container", "dropout", (2,), steps=2),
}
_DROPOUT_HINT = ("The forward matched but the gradients did not, so backward saw other dropout masks: the "
                 "recomputation drew new random numbers. Record torch.get_rng_state() before the forward "
                 "runs and restore it with torch.set_rng_state(...) just before recomputing, inside "
                 "torch.random.fork_rng() so that the global RNG carries on undisturbed.")


_ADVICE = ("Write it yourself (the container on nn.Sequential, as the exercise's cell does) and pass that; "
           "torch.utils.checkpoint is switched off too.")


def check_segment_bounds(fn: Callable, cases: Sequence[str] = ("small",),
                         timeout: float | None = None) -> None:
    """``fn(n_layers, segments)`` must return the (start, end) pairs of ``checkpointing.segment_bounds``.

    ``cases`` are keys of ``SEGMENT_CASES``; each also names segment counts for which ``fn``
    must raise ValueError (fewer than 1, or more than the layers). The first difference is
    reported with the arguments, the expected and actual lists, and a hint for common rules.
    """
    _check_names("check_segment_bounds", fn, cases, SEGMENT_CASES)
    _refuse_library_code("check_segment_bounds", fn, ANSWERS.exercise, _ADVICE)
    _launch_check(getattr(fn, "__name__", "your function"), 1, _segments_rank, (fn, tuple(cases)), timeout,
                  where="", hint="Does a loop in it never end?")


def _segments_rank(fn: Callable, cases: tuple[str, ...], progress: str) -> list:
    with watching(ANSWERS):
        return _segments_cases(fn, cases, progress)


def _segments_cases(fn: Callable, cases: tuple[str, ...], progress: str) -> list:
    from dtcourse.checkpointing import segment_bounds as reference
    for name in cases:
        description, pairs, bad = SEGMENT_CASES[name]
        where = f"case {name!r} ({description})"
        for n, k in pairs:
            Path(progress, "0").write_text(f"{where}, segment_bounds({n}, {k})")
            got = _as_student(progress, lambda: fn(n, k))
            problem = _bounds_problem(got, reference(n, k), n, k)
            if problem:
                return [where, problem]
        for n, k in bad:
            Path(progress, "0").write_text(f"{where}, segment_bounds({n}, {k})")
            try:
                got = fn(n, k)
            except ValueError:
                continue
            except Exception as exc:            # the wrong kind of error
                return [where, f"segment_bounds({n}, {k}) raised {type(exc).__name__}: {exc}; it should "
                               f"raise ValueError, since {k} segments cannot be cut from {n} layers"]
            return [where, f"segment_bounds({n}, {k}) returned {got!r}; it should raise ValueError with a "
                           f"message that says segments must be between 1 and the number of layers ({n})"]
    Path(progress, "0").write_text("finished")
    return []


def _bounds_problem(got: object, want: list[tuple[int, int]], n: int, k: int) -> str | None:
    try:
        got = [tuple(pair) for pair in got]
    except TypeError:
        return (f"segment_bounds({n}, {k}) must return a list of (start, end) pairs; it returned {got!r}"
                + (" (did you forget the return?)" if got is None else ""))
    if got == want:
        return None
    message = f"segment_bounds({n}, {k}) should be {want} but yours is {got}"
    size = n // k
    torch_rule = [(i * size, (i + 1) * size) for i in range(k - 1)] + [((k - 1) * size, n)]
    sizes = [end - start for start, end in want]
    shorter_first = []
    start = 0
    for s in sorted(sizes):
        shorter_first.append((start, start + s))
        start += s
    if got == torch_rule:
        message += (". That is torch's rule, which gives the last segment all the left-over layers; here the "
                    "sizes differ by at most one and the longer segments come first")
    elif got == shorter_first:
        message += ". The sizes are right, but the longer segments come first"
    elif len(got) != k or not _covers(got, n):
        message += f". There must be {k} segments covering layers 0 to {n - 1}, in order, each used once"
    return message


def _covers(bounds: list[tuple], n: int) -> bool:
    """Do the (start, end) pairs tile 0..n, each starting where the one before ended?"""
    ends = [0] + [pair[1] for pair in bounds if len(pair) == 2]
    return len(ends) == len(bounds) + 1 and all(len(pair) == 2 and pair[0] == end and pair[1] > pair[0]
                                                for pair, end in zip(bounds, ends)) and ends[-1] == n


# --------------------------------------------------------------------------- #
# Gradients and memory of a student's container
# --------------------------------------------------------------------------- #
def check_checkpoint_gradients(cls: Callable, cases: Sequence[str] = ("mlp",),
                               timeout: float | None = None) -> None:
    """``cls(*layers, segments=k)`` must give the plain ``nn.Sequential(*layers)``'s outputs and gradients.

    Every case of ``GRADIENT_CASES`` (all float64) runs forward and ``backward()`` through the
    plain stack, then through ``cls`` with the same layers and the same seed, for each of its
    segment counts. The outputs, every parameter's ``.grad`` and the input's ``.grad`` must be
    equal to the bit, and the global RNG must end where the plain run left it.
    """
    _check_names("check_checkpoint_gradients", cls, cases, GRADIENT_CASES)
    _refuse_library_code("check_checkpoint_gradients", cls, ANSWERS.exercise, _ADVICE)
    _launch_check(getattr(cls, "__name__", "your class"), 1, _gradients_rank, (cls, tuple(cases)), timeout,
                  where="", hint="Does a recomputation call itself, or a loop never end?")


def _layers(kind: str) -> tuple[list[nn.Module], torch.Tensor]:
    from dtcourse.models import GPT, GPTConfig
    if kind == "gpt":
        config = GPTConfig(vocab_size=32, block_size=8, n_layer=3, n_head=2, d_model=16, dropout=0.1)
        g = torch.Generator().manual_seed(0)
        return list(GPT(config).double().blocks), torch.randn(2, 8, 16, dtype=torch.float64, generator=g)
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(6):
        linear = nn.Linear(8, 8).double()
        with torch.no_grad():
            linear.weight.copy_(torch.randn(8, 8, generator=g) / 3)
            linear.bias.copy_(torch.randn(8, generator=g) / 3)
        layers.append(nn.Sequential(linear, nn.Dropout(0.3), nn.Tanh()) if kind == "dropout"
                      else nn.Sequential(linear, nn.Tanh()))
    return layers, torch.randn(5, 8, dtype=torch.float64, generator=g)


def _forward(model: nn.Module, x: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return model(x)


def _backward(y: torch.Tensor) -> None:
    (y.square().sum() + y.sum()).backward()


class _Replays:
    """Pre-hooks on the stack's layers that note how each layer was run: in the forward, and in backward.

    A call is (layer index, gradients on?, does its input require grad?). Backward runs a layer
    only to recompute it, so the two lists show whether the recomputation ran the way the
    forward did, which decides which tensors its ops save.
    """

    def __init__(self, layers: Sequence[nn.Module]):
        self.phase: str | None = None          # "forward" or "backward" while the student's code runs
        self.calls: dict[str, list[tuple[int, bool, bool]]] = {"forward": [], "backward": []}
        self._handles = [layer.register_forward_pre_hook(self._noter(i)) for i, layer in enumerate(layers)]

    def _noter(self, i: int) -> Callable:
        def note(module: nn.Module, args: tuple) -> None:
            if self.phase is not None:
                x = args[0] if args else None
                self.calls[self.phase].append(
                    (i, torch.is_grad_enabled(), isinstance(x, torch.Tensor) and x.requires_grad))
        return note

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def hint(self) -> str:
        """'' if every recomputed layer ran as in the forward, else what differed and what to change."""
        off = sorted({i for i, grad_on, _ in self.calls["backward"] if not grad_on})
        if off:
            return (f"\n    hint: during backward your recomputation ran layer(s) {off} with gradients off "
                    "(backward runs under no_grad), so the replayed ops saved no tensors at all and the "
                    "positions your forward handed out have nothing behind them: recompute inside "
                    "torch.enable_grad()")
        forward: dict[int, bool] = {}
        for i, _, needs_grad in self.calls["forward"]:
            forward.setdefault(i, needs_grad)
        for i, _, needs_grad in self.calls["backward"]:
            if i in forward and forward[i] != needs_grad:
                return (f"\n    hint: during backward your recomputation ran layer {i} on an input with "
                        f"requires_grad={needs_grad}, where the forward's input had requires_grad={forward[i]}. "
                        "Which tensors an op saves depends on which of its inputs need a gradient (a Linear "
                        "saves its weight only to compute its input's gradient), so the recomputation saved "
                        f"{'fewer' if forward[i] else 'more'} tensors than the forward, at other positions: "
                        "recompute from x.detach().requires_grad_(x.requires_grad)")
        return ""


def _as_student_hinted(progress: str, call: Callable, hint: Callable[[], str]) -> object:
    """``_as_student``, with ``hint()`` added to the student's error when the check has found its cause."""
    try:
        return call()
    except Exception as exc:
        Path(progress, f"{dist.get_rank()}.error").write_text(_student_error(exc) + hint())
        raise


def _gradients_rank(cls: Callable, cases: tuple[str, ...], progress: str) -> list:
    with watching(ANSWERS):
        for name in cases:
            case = GRADIENT_CASES[name]
            for k in case.segments:
                where = f"case {name!r} ({case.description}), segments={k}"
                Path(progress, "0").write_text(where)
                problem = _gradients_case(cls, case, k, progress)
                if problem:
                    return [where, problem]
    Path(progress, "0").write_text("finished")
    return []


def _gradients_case(cls: Callable, case: _GradientCase, k: int, progress: str) -> str | None:
    layers, x = _layers(case.layers)
    plain = nn.Sequential(*layers)
    runs = {}
    replays = _Replays(layers)
    for label in ("plain", "yours"):
        model = plain if label == "plain" else _as_student(progress, lambda: cls(*layers, segments=k))
        plain.zero_grad(set_to_none=True)
        xin = x.clone().requires_grad_(case.input_grad)
        outputs = []
        for step in range(case.steps):
            if label == "plain":
                y = _forward(model, xin, seed=step)
                _backward(y)
            else:
                replays.phase = "forward"
                y = _as_student(progress, lambda: _forward(model, xin, seed=step))
                replays.phase = "backward"
                _as_student_hinted(progress, lambda: _backward(y), replays.hint)
                replays.phase = None
            outputs.append(y.detach() if isinstance(y, torch.Tensor) else y)
        grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in plain.named_parameters()}
        runs[label] = (outputs, grads, xin.grad, torch.get_rng_state())
    replays.remove()
    (want_out, want_grads, want_xgrad, want_rng), (out, grads, xgrad, rng) = runs["plain"], runs["yours"]
    for step, (a, b) in enumerate(zip(want_out, out), start=1):
        if not isinstance(b, torch.Tensor) or b.shape != a.shape or not torch.equal(a, b):
            return (f"step {step}: the forward's output differs from the plain stack's "
                    f"({_difference(a, b)}): run every layer once, in order, and return the last one's "
                    "output")
    for pname, want in want_grads.items():
        got = grads[pname]
        if got is None:
            return (f"parameter {pname!r} has no .grad after backward(): the recomputation must run with "
                    "gradients on (backward runs under no_grad: use torch.enable_grad()), from an input "
                    "with the original's requires_grad" + replays.hint())
        if not torch.equal(want, got):
            message = (f"the .grad of parameter {pname!r} {tuple(want.shape)} differs from the plain run's "
                       f"({_difference(want, got)})")
            if replays.hint():
                message += replays.hint()
            elif case.layers != "tanh":
                message += ". " + _DROPOUT_HINT
            if case.steps > 1:
                message += " Each call of checkpoint starts afresh: keep nothing from one step to the next."
            return message
    if case.input_grad and (xgrad is None or not torch.equal(want_xgrad, xgrad)):
        return f"the input's .grad differs from the plain run's ({_difference(want_xgrad, xgrad)})" + replays.hint()
    if not torch.equal(want_rng, rng):
        return ("the gradients are right, but the global RNG did not end where the plain run left it: "
                "replay the RNG state inside torch.random.fork_rng(), which puts the state back afterwards")
    return None


def _difference(want: torch.Tensor, got: object) -> str:
    if not isinstance(got, torch.Tensor):
        return f"got {type(got).__name__}"
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} instead of {tuple(want.shape)}"
    return f"by up to {(got - want).abs().max().item():.3g}"


# --------------------------------------------------------------------------- #
# Memory: what the container holds, recomputes, and lets go of
# --------------------------------------------------------------------------- #
# Twelve layers of width 64 on a batch of 16, float32: one activation (a "unit") is 4 KiB.
_MEMORY_LAYERS, _MEMORY_WIDTH, _MEMORY_BATCH = 12, 64, 16
# How far above the course's checkpoint a student's peak during backward may go, in units. A correct
# container written differently peaks within two units of it (measured: a torch.autograd.Function
# that recomputes and runs backward itself, -1 to +2 as it is written); holding a second segment's
# recomputed tensors adds 4 at segments=3. The peak cannot see a checkpoint that hands its recomputed
# tensors out without forgetting them (+1): what outlives its use catches that one (_LINGER_SLACK).
MEMORY_SLACK = 2
# How many recomputed activations more than the course's checkpoint may stay alive after the backward
# ops that read them are done, in units. The course's holds none: each tensor goes with the node that
# used it. A torch.autograd.Function that recomputes and runs backward itself keeps the recomputation's
# output until that backward returns (1); a checkpoint that keeps what it hands out keeps its whole
# segment until backward leaves it: 2 to 6 units at 6 to 2 segments.
_LINGER_SLACK = 1


@dataclass(frozen=True)
class _Held:
    """Bytes alive (``memory.HeldBytes``: storages allocated since the stack was built) in one step."""

    after_forward: int
    peak_in_backward: int          # the most alive at once, after any op of backward
    after_backward: int
    freed_by_gc: int               # of after_backward, what the cycle collector then freed
    kept_with_graph: int           # tensors made in the step, alive after backward, with a grad_fn (not the output)
    recomputed: tuple[int, ...]    # per layer, the times backward ran it
    lingering: int = 0             # the most recomputed bytes alive at once after the backward node that read them
    lingering_layers: tuple[int, ...] = ()   # the layers whose recomputation made those bytes


@dataclass(eq=False)
class _Life:
    """One storage an op allocated: the op that made it, the last op that read it, the op before which it was freed."""

    made: int
    nbytes: int
    layer: int | None              # the layer whose recomputation (a forward during backward) made it, if any
    last_read: int = -1
    freed: int | None = None
    ref: object = field(default=None, repr=False)    # the weakref whose callback notes the free


def _node_key() -> tuple | None:
    """The autograd node running now (None outside backward), as a key that no other node of the step shares."""
    node = torch._C._current_autograd_node()
    if node is None:
        return None
    name = node.name()
    if name.endswith("AccumulateGrad"):        # all share one sequence number: their leaf tells them apart
        return name, node.variable.untyped_storage().data_ptr()
    return name, node._sequence_nr()


class _Lifetimes(TorchDispatchMode):
    """Within ``with _Lifetimes() as lives:``, every storage an op allocates and the ops that read it.

    Ops are numbered from 0 (``lives.ops`` counts them); ``lives.nodes[j]`` is the autograd node
    that ran op j (``_node_key``), and each ``_Life`` in ``lives.made`` says when its storage was
    made, last read, and freed. ``lives.layer`` is the layer whose forward runs during backward (a
    recomputation), set by hooks on the layers: storages made meanwhile are that layer's.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.layer = 0, None
        self.nodes: list[tuple | None] = []
        self.made: list[_Life] = []
        self._alive: dict[int, _Life] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        j = self.ops
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        for t in tensors:
            life = self._alive.get(id(t.untyped_storage()))
            if life is not None:
                life.last_read = j
        out = func(*args, **(kwargs or {}))
        for storage in new_storages(tensors, out, self._alive):      # what the op allocated, as HeldBytes counts
            life = _Life(j, storage.nbytes(), self.layer, last_read=j)
            life.ref = weakref.ref(storage, partial(self._freed, id(storage)))
            self._alive[id(storage)] = life
            self.made.append(life)
        self.nodes.append(_node_key())
        self.ops += 1
        return out

    def _freed(self, key: int, _: object) -> None:
        life = self._alive.pop(key, None)
        if life is not None:
            life.freed = self.ops


def _lingering(lives: _Lifetimes, start: int, end: int) -> tuple[int, tuple[int, ...]]:
    """The most bytes of recomputed tensors alive at once, during ops [start, end), after the node that last read them.

    A recomputed tensor is one made while a layer ran again in backward. It lingers at op j if it is
    still alive after op j, was last read before j, and op j belongs to another node than that last
    read: the node that needed it is done, and nothing reads it again. Tensors still alive when
    backward returns are left out: what stays after backward is measured on its own.
    Returns the bytes and the layers that made them, at the op where they are most.
    """
    by_op: dict[int, list[_Life]] = {}
    for life in lives.made:
        if life.layer is None or life.made < start or life.freed is None or life.freed > end:
            continue
        read_by = lives.nodes[life.last_read]
        for j in range(life.last_read + 1, life.freed):
            if lives.nodes[j] != read_by:
                by_op.setdefault(j, []).append(life)
    most, worst = 0, []
    for j in sorted(by_op):                    # the first op where they are most
        if sum(life.nbytes for life in by_op[j]) > most:
            most, worst = sum(life.nbytes for life in by_op[j]), by_op[j]
    return most, tuple(sorted({life.layer for life in worst}))


def check_checkpoint_memory(cls: Callable, segments: int | Sequence[int] = 3, timeout: float | None = None) -> None:
    """With ``cls(*layers, segments=k)`` a step must hold and recompute what a checkpointed stack does.

    Twelve layers of width 64 (eleven of Linear + ReLU, then a Linear) on a batch of 16, for each
    segment count in ``segments``; bytes are those of the tensors alive (``memory.HeldBytes``):

    * after the forward, at most the checkpointed segments' inputs plus the last segment's
      layer outputs;
    * backward runs each layer of a checkpointed segment exactly once more, the last segment's never;
    * during backward, at most ``MEMORY_SLACK`` activations more at once than the course's own
      checkpoint (``dtcourse.checkpointing``) holds on the same stack: one segment's recomputed
      tensors at a time;
    * each recomputed tensor let go as backward goes: once the backward node (op of autograd's
      graph) that last reads it is done, it is freed, as with the course's checkpoint; at most
      one activation may outlive its use (``_Lifetimes``, ``_lingering``);
    * when backward returns, no more than the course's checkpoint still holds: every
      recomputed tensor let go.

    Python's cycle collector is off while a step is measured, so what is freed, and when, is
    decided by references alone: every run gives the same bytes.
    """
    counts = (segments,) if isinstance(segments, int) else tuple(segments)
    if not counts or any(not isinstance(k, int) or not 1 <= k <= _MEMORY_LAYERS for k in counts):
        raise ValueError(f"check_checkpoint_memory: segments must be between 1 and {_MEMORY_LAYERS}, "
                         f"got {segments!r}")
    if not callable(cls):
        raise TypeError(f"check_checkpoint_memory: pass your class itself, not {type(cls).__name__}")
    _refuse_library_code("check_checkpoint_memory", cls, ANSWERS.exercise, _ADVICE)
    _launch_check(getattr(cls, "__name__", "your class"), 1, _memory_rank, (cls, counts), timeout,
                  where="", hint="Does a recomputation call itself, or a loop never end?")


def _memory_rank(cls: Callable, counts: tuple[int, ...], progress: str) -> list:
    from dtcourse.checkpointing import CheckpointedSequential as Reference
    n, width, batch = _MEMORY_LAYERS, _MEMORY_WIDTH, _MEMORY_BATCH

    def reference(layers: list[nn.Module], k: int) -> nn.Module:
        return Reference(*layers, segments=k)

    # The first ops under HeldBytes import torch._dynamo, whose import leaves garbage holding tensors:
    # a throwaway step first, so that neither measurement pays for it.
    _measure(reference, counts[0], progress)
    for k in counts:
        where = f"{n} layers of width {width} (11 of Linear + ReLU, then a Linear), batch {batch}, segments={k}"
        Path(progress, "0").write_text(where)
        want = _measure(reference, k, progress)
        with watching(ANSWERS):
            got = _measure(lambda layers, k: cls(*layers, segments=k), k, progress, student=True)
        problem = _memory_problem(got, want, k)
        if problem:
            return [where, problem]
    Path(progress, "0").write_text("finished")
    return []


def _measure(build: Callable[[list[nn.Module], int], nn.Module], k: int, progress: str,
             student: bool = False) -> _Held:
    """One forward and backward of a fresh ``lab.checkpointing.mlp_layers`` stack built by ``build``."""
    from dtcourse.lab.checkpointing import mlp_layers
    from dtcourse.memory import HeldBytes
    layers = list(mlp_layers(_MEMORY_LAYERS, _MEMORY_WIDTH))
    x = torch.randn(_MEMORY_BATCH, _MEMORY_WIDTH, generator=torch.Generator().manual_seed(0))
    for p in nn.ModuleList(layers).parameters():
        p.grad = torch.zeros_like(p)          # allocated now, so that backward's gradients are not counted
    runs = [0] * len(layers)
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    replays = _Replays(layers)
    lives = _Lifetimes()

    def recomputing(i: int | None) -> None:      # which layer runs again in backward, for what it allocates
        lives.layer = i if replays.phase == "backward" else None

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda *_, i=i: recomputing(i))
        layer.register_forward_hook(lambda *_: recomputing(None))

    def call(fn: Callable, hint: Callable[[], str] = lambda: "") -> object:
        return _as_student_hinted(progress, fn, hint) if student else fn()

    model = call(lambda: build(layers, k))
    # The cycle collector stays off while the step runs: what is freed, and when, is then decided by
    # references alone, the same on every run. Objects made from here on stay in its youngest
    # generation, so looking at that generation alone finds what the step left behind, cheaply.
    gc.collect(0)
    gc.disable()
    try:
        with HeldBytes() as held, lives:
            replays.phase = "forward"
            y = call(lambda: model(x))
            after, forward_ops, before, backward_from = held.now, held.mark(), list(runs), lives.ops
            replays.phase = "backward"
            call(lambda: y.sum().backward(), replays.hint)
            replays.phase = None
            end = held.now
            lingering, lingering_layers = _lingering(lives, backward_from, lives.ops)    # before any collection
            peak = max(held.trace[forward_ops:], default=end)
            # type(), not isinstance: some objects' __class__ is a property that warns when read
            young = gc.get_objects(generation=0)
            kept = sum(1 for obj in young if issubclass(type(obj), torch.Tensor) and obj is not y
                       and obj.grad_fn is not None)
            del young
            gc.collect(0)
            freed = end - held.now
    finally:
        gc.enable()
    return _Held(after, peak, end, freed, kept, tuple(r - b for r, b in zip(runs, before)), lingering,
                 lingering_layers)


def _memory_problem(got: _Held, want: _Held, k: int) -> str | None:
    from dtcourse.checkpointing import segment_bounds
    from dtcourse.lab.checkpointing import predicted_segment_units
    n, batch, width = _MEMORY_LAYERS, _MEMORY_BATCH, _MEMORY_WIDTH
    unit = batch * width * 4

    def units(nbytes: int) -> str:
        return f"{nbytes:,} bytes ({nbytes / unit:.1f} activations of ({batch}, {width}))"

    held = predicted_segment_units(n, k) * unit
    start, _ = segment_bounds(n, k)[-1]
    if got.after_forward > held + unit // 2:          # half a unit of slack for small bookkeeping tensors
        message = (f"when the forward returned, the stack held {got.after_forward:,} bytes "
                   f"({got.after_forward / unit:.1f} activations of ({batch}, {width})); a checkpointed stack "
                   f"holds {held:,} ({held // unit}: the inputs of the {k - 1} checkpointed segments and the "
                   f"{n - start} layer outputs of the last)")
        if got.after_forward >= n * unit:
            message += (". That is everything the plain stack holds: either no segment was checkpointed, or "
                        "the pack hook kept the tensors it was given. It must return a position, not the "
                        "tensor, and keep no reference to it; backward gets the tensors back by recomputing")
        return message
    expected = (1,) * start + (0,) * (n - start)
    if got.recomputed != expected:
        message = (f"during backward the layers ran {list(got.recomputed)} more times; expected {list(expected)}: "
                   f"each layer of a checkpointed segment once, the last segment's layers (from {start} on) never")
        if any(r > 1 for r in got.recomputed):
            message += (". Recompute a segment once, on its first unpack, and hand out the kept tensors "
                        "to the later unpacks")
        return message
    problems = []
    if got.peak_in_backward > want.peak_in_backward + MEMORY_SLACK * unit:
        problems.append(
            f"during backward up to {units(got.peak_in_backward)} were alive at once; the course's checkpoint "
            f"peaks at {units(want.peak_in_backward)} on the same stack (what the forward kept, one segment's "
            f"recomputed activations and the gradients in flight), and {MEMORY_SLACK} activations more is the "
            "most allowed. Hold one segment's recomputed tensors at a time, without copies (backward needs only "
            "their values: t.detach() shares the storage), and let each go once backward has used it")
    if got.lingering > want.lingering + _LINGER_SLACK * unit + unit // 2:
        problems.append(_lingering_problem(got, want, k, units))
    if got.after_backward > want.after_backward + unit // 2:
        left = got.after_backward - want.after_backward
        message = (f"when backward() returned, {units(got.after_backward)} were still alive, where the course's "
                   f"checkpoint leaves {units(want.after_backward)}, the output: {left:,} bytes that backward "
                   "allocated, recomputed activations or copies of them, were never let go")
        if got.kept_with_graph > want.kept_with_graph:
            message += (f". {got.kept_with_graph - want.kept_with_graph} of the tensors made in this step and still "
                        "alive carry a grad_fn: a recomputed tensor kept with its grad_fn holds the recomputation's "
                        "graph, and with it your saved-tensor hooks and all they hold (when that includes the list "
                        "the tensor is in, a cycle through autograd that Python's collector cannot free). Keep "
                        "t.detach() in the recomputation's pack")
        elif got.freed_by_gc >= left - unit // 2:
            message += (". Python's cycle collector (gc.collect()) did free them afterwards, so only a reference "
                        "cycle held them: memory that stays taken until the collector happens to run")
        problems.append(message)
    return ";\n    and ".join(problems) or None


def _lingering_problem(got: _Held, want: _Held, k: int, units: Callable[[int], str]) -> str:
    from dtcourse.checkpointing import segment_bounds
    bounds = segment_bounds(_MEMORY_LAYERS, k)
    segments = sorted({next(s for s, (lo, hi) in enumerate(bounds) if lo <= layer < hi)
                       for layer in got.lingering_layers})
    where = " and ".join(f"segment {s + 1} of {k} (layers {bounds[s][0]} to {bounds[s][1] - 1})" for s in segments)
    layers = ", ".join(map(str, got.lingering_layers))
    course = f"holds {units(want.lingering)} that way" if want.lingering else "holds none that way"
    return (f"during backward, {units(got.lingering)}, recomputed by layer(s) {layers} for {where}, were still "
            f"alive after the backward ops that read them were done, while backward went on; the course's "
            f"checkpoint {course}: it lets each recomputed tensor go as soon as the op that needs it is done. "
            "Your unpack hands the recomputed tensors out but keeps a reference to them (in a list or dict on "
            "the checkpoint or the container, a cache, a slot never cleared), so they are freed only when "
            "backward is past the whole segment, not as it goes: hand each one out once and forget it (pop it "
            "from the dict, or set its slot to None), and keep it nowhere else")
