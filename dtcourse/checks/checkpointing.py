"""Checks for exercise 05: a student's checkpointed sequential container against dtcourse.checkpointing.

``check_segment_bounds`` holds a student's ``segment_bounds`` to the course's rule;
``check_checkpoint_gradients`` runs a student's ``CheckpointedSequential`` next to the plain
``nn.Sequential`` of the same layers and wants the same outputs and gradients, bit for bit;
``check_checkpoint_memory`` measures what the container holds after its forward and which
layers backward runs again. Each runs the student's code in a child process and raises one
AssertionError that names the case, the segment count and what differs::

    check_checkpoint_gradients(CheckpointedSequential, cases=("mlp",))

Why exact equality: a recomputation runs the same ops on the same inputs with the same RNG
state, so on a CPU it reproduces every value to the bit, and the backward that reads them is
the plain run's own graph. Any difference at all is a bug, not rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn as nn

from dtcourse.checks.common import _as_student, _check_names, _launch_check

__all__ = ["check_segment_bounds", "check_checkpoint_gradients", "check_checkpoint_memory",
           "SEGMENT_CASES", "GRADIENT_CASES"]

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


def check_segment_bounds(fn: Callable, cases: Sequence[str] = ("small",),
                         timeout: float | None = None) -> None:
    """``fn(n_layers, segments)`` must return the (start, end) pairs of ``checkpointing.segment_bounds``.

    ``cases`` are keys of ``SEGMENT_CASES``; each also names segment counts for which ``fn``
    must raise ValueError (fewer than 1, or more than the layers). The first difference is
    reported with the arguments, the expected and actual lists, and a hint for common rules.
    """
    _check_names("check_segment_bounds", fn, cases, SEGMENT_CASES)
    _launch_check(getattr(fn, "__name__", "your function"), 1, _segments_rank, (fn, tuple(cases)), timeout,
                  where="", hint="Does a loop in it never end?")


def _segments_rank(fn: Callable, cases: tuple[str, ...], progress: str) -> list:
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


def _step(model: nn.Module, x: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    y = model(x)
    (y.square().sum() + y.sum()).backward()
    return y.detach()


def _gradients_rank(cls: Callable, cases: tuple[str, ...], progress: str) -> list:
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
    for label in ("plain", "yours"):
        model = plain if label == "plain" else _as_student(progress, lambda: cls(*layers, segments=k))
        plain.zero_grad(set_to_none=True)
        xin = x.clone().requires_grad_(case.input_grad)
        outputs = [_as_student(progress, lambda: _step(model, xin, seed=step)) if label == "yours"
                   else _step(model, xin, seed=step) for step in range(case.steps)]
        grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in plain.named_parameters()}
        runs[label] = (outputs, grads, xin.grad, torch.get_rng_state())
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
                    "with the original's requires_grad")
        if not torch.equal(want, got):
            message = (f"the .grad of parameter {pname!r} {tuple(want.shape)} differs from the plain run's "
                       f"({_difference(want, got)})")
            if case.layers != "tanh":
                message += ". " + _DROPOUT_HINT
            if case.steps > 1:
                message += " Each call of checkpoint starts afresh: keep nothing from one step to the next."
            return message
    if case.input_grad and (xgrad is None or not torch.equal(want_xgrad, xgrad)):
        return f"the input's .grad differs from the plain run's ({_difference(want_xgrad, xgrad)})"
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


def check_checkpoint_memory(cls: Callable, segments: int = 3, timeout: float | None = None) -> None:
    """With ``cls(*layers, segments=...)`` the stack must hold only what a checkpointed stack holds.

    Twelve layers of width 64 (eleven of Linear + ReLU, then a Linear) on a batch of 16: after the forward, the bytes of
    tensors still alive (``memory.HeldBytes``) must be those of the
    checkpointed segments' inputs plus the last segment's layer outputs, and backward must
    run each layer of a checkpointed segment exactly once more, and the last segment's none.
    """
    if not callable(cls):
        raise TypeError(f"check_checkpoint_memory: pass your class itself, not {type(cls).__name__}")
    _launch_check(getattr(cls, "__name__", "your class"), 1, _memory_rank, (cls, segments), timeout,
                  where="", hint="Does a recomputation call itself, or a loop never end?")


def _memory_rank(cls: Callable, k: int, progress: str) -> list:
    from dtcourse.lab.checkpointing import mlp_layers, predicted_segment_units
    from dtcourse.memory import HeldBytes
    from dtcourse.checkpointing import segment_bounds
    n, width, batch = 12, 64, 16
    where = f"12 layers of width {width} (11 of Linear + ReLU, then a Linear), batch {batch}, segments={k}"
    Path(progress, "0").write_text(where)
    layers, x = mlp_layers(n, width), torch.randn(batch, width)
    for p in layers.parameters():
        p.grad = torch.zeros_like(p)          # allocated now, so that backward's gradients are not counted
    runs = [0] * n
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    model = _as_student(progress, lambda: cls(*layers, segments=k))
    with HeldBytes() as held:
        y = _as_student(progress, lambda: model(x))
        after = held.now
        _as_student(progress, lambda: y.sum().backward())
    unit = batch * width * 4
    want = predicted_segment_units(n, k) * unit
    start, _ = segment_bounds(n, k)[-1]
    recomputed = [r - 1 for r in runs]
    expected = [1] * start + [0] * (n - start)
    Path(progress, "0").write_text("finished")
    if after > want + unit // 2:          # half a unit of slack for small bookkeeping tensors
        message = (f"when the forward returned, the stack held {after:,} bytes ({after / unit:.1f} "
                   f"activations of ({batch}, {width})); a checkpointed stack holds {want:,} "
                   f"({want // unit}: the inputs of the {k - 1} checkpointed segments and the {n - start} "
                   "layer outputs of the last)")
        if after >= n * unit:
            message += (". That is everything the plain stack holds: either no segment was checkpointed, or "
                        "the pack hook kept the tensors it was given. It must return a position, not the "
                        "tensor, and keep no reference to it; backward gets the tensors back by recomputing")
        return [where, message]
    if recomputed != expected:
        message = (f"during backward the layers ran {recomputed} more times; expected {expected}: each "
                   f"layer of a checkpointed segment once, the last segment's layers (from {start} on) never")
        if any(r > 1 for r in recomputed):
            message += (". Recompute a segment once, on its first unpack, and hand out the kept tensors "
                        "to the later unpacks")
        return [where, message]
    return []
