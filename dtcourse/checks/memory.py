"""Checks for exercise 00: a student's bytes of a training step, kind by kind, against ``dtcourse.memory``.

``check_model_states(fn, kind, cases)`` calls ``fn(sizes, optimizer, mixed)``, the student's
prediction of an MLP's model states as a dict, and compares its ``kind`` entry with that field of
the ``memory.StepMemory`` that ``memory.measure_step`` counts on a real step of ``models.MLP(sizes)``
("optimizer_states" is ZeRO's K, the fp32 master weights included; "master_weights" is that part).
``check_activations(fn, cases)`` does the same for ``fn(sizes, batch_size, activation, mixed)``, the
bytes autograd saves in the forward of an MLP with that activation. Each check runs the student's code
in a child process and raises one AssertionError that names the case, the kind, the prediction, the
measurement and the difference (per parameter or per tensor where it is a whole number of them)::

    check_model_states(model_state_bytes, "optimizer_states", cases=("fp32",))

A wrong number that is exactly what a known mistake gives (16-bit weights counted as fp32, the
master weights left out of the optimizer states, Adam's ``step`` or the biases left out, ...) gets that
mistake named. ``fn`` runs inside ``watching(ANSWERS)``, where the course's measurements
and predictions (``measure_step``, ``SavedTensors``, ...) refuse to run for it.

Why exact equality: on the CPU the measurement is the sum of real tensors' sizes, to the byte,
and every kind of the exercise has an exact formula.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtcourse.checks.common import _as_student, _check_names, _launch_check
from dtcourse.checks.guard import Answers, watching

__all__ = ["check_model_states", "check_activations", "MODEL_STATE_CASES", "ACTIVATION_CASES", "OPTIMIZERS",
           "ACTIVATIONS"]

# The recipes the exercise names, as the check builds them.
OPTIMIZERS: dict[str, Callable] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params),
    "adamw": lambda params: torch.optim.AdamW(params),
    "adagrad": lambda params: torch.optim.Adagrad(params),
}
ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh,
                                                   "silu": nn.SiLU}
MODEL_KINDS = ("params", "grads", "master_weights", "optimizer_states")
_BF16, _FP16 = torch.bfloat16, torch.float16
_RECIPES = ("sgd", "sgd_momentum", "adam")
# What these checks switch off while the student's code runs (guard.watching), and refuse to be given
ANSWERS = Answers("00", course=tuple(f"dtcourse.memory.{name}" for name in (
    "SavedTensors", "measure_step", "predict_step", "mlp_activation_bytes")))

# name -> (description, [(sizes, optimizer, mixed dtype or None), ...])
MODEL_STATE_CASES = {
    "fp32": ("fp32 with SGD, SGD with momentum and Adam",
             [(sizes, opt, None) for sizes in ((12, 24, 20, 5), (64, 128, 10)) for opt in _RECIPES]),
    "mixed": ("bf16 mixed precision with SGD, SGD with momentum and Adam",
              [(sizes, opt, _BF16) for sizes in ((12, 24, 20, 5), (64, 128, 10)) for opt in _RECIPES]),
    "more_optimizers": ("AdamW and Adagrad, fp32 and bf16 mixed precision",
                        [(sizes, opt, dtype) for sizes in ((12, 24, 20, 5), (7, 3))
                         for opt in ("adamw", "adagrad") for dtype in (None, _BF16)]),
    "fp16": ("fp16 mixed precision, one to four layers",
             [(sizes, opt, _FP16) for sizes in ((7, 3), (16, 32, 32, 32, 8)) for opt in _RECIPES]),
}
# name -> (description, [(sizes, batch size, activation, mixed dtype or None), ...])
ACTIVATION_CASES = {
    "relu": ("ReLU between the Linear layers, fp32",
             [((12, 24, 20, 5), 9, "relu", None), ((64, 128, 10), 32, "relu", None)]),
    "gelu": ("GELU between the Linear layers, fp32",
             [((12, 24, 20, 5), 9, "gelu", None), ((64, 128, 10), 32, "gelu", None)]),
    "tanh_silu": ("Tanh and SiLU, fp32", [((12, 24, 20, 5), 9, act, None) for act in ("tanh", "silu")]),
    "relu_gelu_mixed": ("ReLU and GELU, bf16 mixed precision",
                        [((12, 24, 20, 5), 9, act, _BF16) for act in ("relu", "gelu")]),
    "mixed": ("bf16 and fp16 mixed precision, every activation",
              [((16, 48, 48, 4), 6, act, dtype) for act in ACTIVATIONS for dtype in (_BF16, _FP16)]),
    "one_layer": ("a single Linear layer, no activation in between",
                  [((7, 3), 4, act, dtype) for act in ("relu", "gelu") for dtype in (None, _BF16)]),
}
_HINTS = {
    "params": "parameters are the working copy that runs forward and backward: 4 bytes each in fp32, 2 in a "
              "16-bit mixed-precision copy",
    "grads": "backward writes one gradient per parameter, in the working copy's dtype",
    "master_weights": "only mixed precision keeps master weights: an fp32 copy of every parameter, which the "
                      "optimizer steps",
    "optimizer_states": "count what optimizer.state holds after the first step() (fp32, as the weights it steps), "
                        "and in mixed precision the fp32 master weights too: ZeRO's K, as memory.StepMemory has it",
}


def check_model_states(fn: Callable, kind: str, cases: Sequence[str] = ("fp32",),
                       timeout: float | None = None) -> None:
    """``fn(sizes, optimizer, mixed)[kind]`` must equal the measured bytes of that kind, in every case.

    ``kind`` is one of "params", "grads", "master_weights", "optimizer_states"; ``cases`` are keys
    of ``MODEL_STATE_CASES``. Each case steps ``models.MLP(sizes)`` once with
    ``memory.measure_step`` under the optimizer of ``OPTIMIZERS[optimizer]``, in fp32 or in
    mixed precision, and compares. The first difference is reported with the case, the
    prediction, the measurement, and a hint for the kind.
    """
    if kind not in MODEL_KINDS:
        raise ValueError(f"check_model_states: kind must be one of {list(MODEL_KINDS)}, got {kind!r}")
    _check_names("check_model_states", fn, cases, MODEL_STATE_CASES)
    _launch_check(getattr(fn, "__name__", "your function"), 1, _model_states_rank, (fn, kind, tuple(cases)),
                  timeout, where="", hint="Does a loop in it never end?")


def check_activations(fn: Callable, cases: Sequence[str] = ("relu",), timeout: float | None = None) -> None:
    """``fn(sizes, batch_size, activation, mixed)`` must equal the bytes autograd saves, in every case.

    ``cases`` are keys of ``ACTIVATION_CASES``. Each case runs one step of an MLP with
    ``ACTIVATIONS[activation]`` between its Linear layers and an MSE loss, through
    ``memory.measure_step``. A wrong answer is reported with the tensors autograd saved and
    which layer saved each.
    """
    _check_names("check_activations", fn, cases, ACTIVATION_CASES)
    _launch_check(getattr(fn, "__name__", "your function"), 1, _activations_rank, (fn, tuple(cases)), timeout,
                  where="", hint="Does a loop in it never end?")


def _mlp(sizes: tuple[int, ...], activation: str) -> nn.Sequential:
    from dtcourse.models import seeded
    layers: list[nn.Module] = []
    with seeded(0):
        for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(d_in, d_out))
            if i < len(sizes) - 2:
                layers.append(ACTIVATIONS[activation]())
    return nn.Sequential(*layers)


def _recipe(sizes: tuple, dtype: torch.dtype | None) -> str:
    return f"sizes {sizes}, " + ("fp32" if dtype is None else f"{str(dtype).removeprefix('torch.')} mixed precision")


def _as_bytes(got: object, what: str) -> int | str:
    """``got`` as a whole number of bytes, or what is wrong with it."""
    if isinstance(got, bool) or not isinstance(got, (int, float)) or (isinstance(got, float) and not got.is_integer()):
        return f"{what} should be a whole number of bytes, but yours is {got!r}"
    return int(got)


def _per_unit(diff: int, n_params: int, n_tensors: int) -> str:
    """The difference as bytes per parameter and per parameter tensor, when it is a small whole number of them."""
    fits = [(abs(p) + abs(t), p, t) for p in range(-24, 25) for t in range(-16, 17)
            if p * n_params + t * n_tensors == diff]
    if not fits:
        return ""
    _, p, t = min(fits)
    parts = [f"{abs(p)} bytes per parameter" if p else "", f"{abs(t)} bytes per parameter tensor" if t else ""]
    return ", which is " + " and ".join(part for part in parts if part)


def _optimizer_state(sizes: tuple[int, ...], optimizer: str) -> tuple[int, int, list[str]]:
    """(bytes of the states shaped like a parameter, bytes of the 0-dim ones, the state's names) after one step."""
    from dtcourse.models import MLP
    model = MLP(sizes)
    opt = OPTIMIZERS[optimizer](model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    tensors = [(name, t) for state in opt.state.values() for name, t in state.items() if isinstance(t, torch.Tensor)]
    return (sum(t.nbytes for _, t in tensors if t.dim()), sum(t.nbytes for _, t in tensors if not t.dim()),
            list(dict.fromkeys(name for name, _ in tensors)))


def _listed(names: list[str]) -> str:
    return " and ".join(f"`{n}`" for n in names) if names else "nothing"


def _model_state_mistakes(kind: str, sizes: tuple[int, ...], optimizer: str, mixed: bool,
                          measured: int) -> list[tuple[int, str]]:
    """``(value, what that value means)`` for the mistakes a prediction of ``kind`` plausibly makes."""
    N = sum(d_in * d_out + d_out for d_in, d_out in zip(sizes[:-1], sizes[1:]))      # parameters
    T, w, no_bias = 2 * (len(sizes) - 1), 2 if mixed else 4, N - sum(sizes[1:])     # tensors, bytes, weights
    biases = ("you left out the biases: each nn.Linear(d_in, d_out) also holds a bias of d_out parameters, a "
              "tensor of its own")
    if kind in ("params", "grads"):
        mistakes = [(w * no_bias, biases)]
        if mixed:
            mistakes.append((4 * N, (
                "you counted the 16-bit working copy at fp32's 4 bytes a parameter: in mixed precision a bf16 or "
                "fp16 copy of the model runs forward and backward, 2 bytes a parameter") if kind == "params" else (
                "you counted the gradients in fp32: backward writes them in the working copy's dtype, 16 bits, 2 "
                "bytes a parameter (the fp32 copies made for the step are freed after it and do not count here)")))
        else:
            mistakes.append((2 * N, "you counted 2 bytes a parameter in fp32, where every parameter takes 4 bytes, "
                                    "and so does its gradient"))
        if kind == "grads":
            mistakes.append((0, "you counted no gradients: backward writes one for every parameter"))
        return mistakes
    if kind == "master_weights":
        if not mixed:
            return [(v, "you counted master weights in fp32, where the optimizer steps the model's own parameters: "
                        "there is no master copy, 0 bytes") for v in (4 * N, 2 * N)]
        return [(0, "you counted no master weights: mixed precision keeps an fp32 master copy of every "
                    "parameter, 4 bytes each, for the optimizer to step"),
                (2 * N, "you counted the master copy at 2 bytes a parameter: it is fp32, 4 bytes, not the 16-bit "
                        "working copy's 2"),
                (4 * no_bias, biases)]
    shaped, zero_dim, names = _optimizer_state(sizes, optimizer)
    master = 4 * N if mixed else 0              # optimizer_states holds the fp32 master weights too (ZeRO's K)
    mistakes = []
    if zero_dim:
        mistakes += [(master + shaped, f"you left out `step`: {optimizer!r} keeps a step count per parameter "
                                       "tensor, a 0-dim float32 tensor, 4 bytes"),
                     (master + shaped + 4 * N, "you counted `step` once per parameter: it is one 0-dim float32 "
                                               f"tensor per parameter *tensor*, {T} here")]
    if mixed:
        mistakes.append((measured - 4 * N, "you left out the master weights: in mixed precision the optimizer steps "
                                           "an fp32 master copy of every parameter, and optimizer_states is ZeRO's "
                                           "K, which holds it (master_weights is that part of it)"))
        if shaped:
            mistakes += [(master + shaped // 2 + z, "you counted the states at 2 bytes, the working copy's 16 bits: "
                                                    "the optimizer steps the fp32 master weights, so its states are "
                                                    "fp32 too") for z in {zero_dim, zero_dim // 2}]
    if shaped % N == 0 and zero_dim % T == 0:
        per_param, per_tensor = shaped // N, zero_dim // T
        mistakes += [((4 if mixed else 0) * no_bias + per_param * no_bias + per_tensor * t, biases)
                     for t in {T, T // 2}]
    for other in (o for o in OPTIMIZERS if o != optimizer):
        o_shaped, o_zero, o_names = _optimizer_state(sizes, other)
        mistakes.append((master + o_shaped + o_zero, f"you counted what {other!r} keeps ({_listed(o_names)}), "
                                                     f"but {optimizer!r} keeps {_listed(names)}"))
    return mistakes


def _named(value: int, measured: int, mistakes: list[tuple[int, str]]) -> str:
    """What the mistakes that give exactly ``value`` say (joined by 'or'), or ''."""
    return "; or ".join(dict.fromkeys(what for wrong, what in mistakes if value == wrong != measured))


def _model_states_rank(fn: Callable, kind: str, cases: tuple[str, ...], progress: str) -> list:
    from dtcourse.memory import measure_step
    from dtcourse.models import MLP, regression_batch
    for name in cases:
        description, runs = MODEL_STATE_CASES[name]
        where = f"case {name!r} ({description})"
        for sizes, optimizer, dtype in runs:
            mixed = dtype is not None
            call = f"{getattr(fn, '__name__', 'fn')}({sizes}, {optimizer!r}, mixed={mixed})"
            Path(progress, "0").write_text(f"{where}, {call}")
            model = MLP(sizes)
            step = measure_step(model, regression_batch(4, sizes[0], sizes[-1]), F.mse_loss, OPTIMIZERS[optimizer],
                                mixed_dtype=dtype)
            measured = getattr(step, kind)     # StepMemory's optimizer_states holds the master weights too
            with watching(ANSWERS):            # the course's measurements refuse to run for fn
                got = _as_student(progress, lambda: fn(sizes, optimizer, mixed))
            if not isinstance(got, dict):
                return [where, f"{call} returned {got!r}; it must return a dict with the keys {list(MODEL_KINDS)}"]
            if kind not in got:
                return [where, f"{call} returned a dict with no {kind!r} key (its keys: {sorted(got)}); it must "
                               f"have {list(MODEL_KINDS)}"]
            value = _as_bytes(got[kind], f"{call}[{kind!r}]")
            if isinstance(value, str):
                return [where, value]
            if value != measured:
                n_params = sum(p.numel() for p in model.parameters())
                n_tensors = len(list(model.parameters()))
                diff = value - measured
                named = _named(value, measured, _model_state_mistakes(kind, sizes, optimizer, mixed, measured))
                message = (f"{kind} for {_recipe(sizes, dtype)} ({n_params:,} parameters in {n_tensors} tensors), "
                           f"optimizer {optimizer!r}: you predicted {value:,} bytes, the measured step holds "
                           f"{measured:,}; yours is {abs(diff):,} too {'high' if diff > 0 else 'low'}"
                           f"{_per_unit(diff, n_params, n_tensors)}. "
                           + (f"That is exactly what you get when {named}." if named else f"Hint: {_HINTS[kind]}"))
                return [where, message]
    Path(progress, "0").write_text("finished")
    return []


def _saved_by_layer(model: nn.Sequential, batch: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype | None) -> str:
    """Which layer saved which tensor for backward, one storage each, as lines for a message."""
    model, (x, y) = model.to(dtype=dtype), (t.to(dtype) if dtype else t for t in batch)
    state = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current, lines, seen = ["the loss"], [], set()
    for i, layer in enumerate(model):
        layer.register_forward_pre_hook(lambda *_, i=i, layer=layer: current.__setitem__(0, f"layer {i} "
                                                                                          f"({type(layer).__name__})"))
        layer.register_forward_hook(lambda *_: current.__setitem__(0, "the loss"))

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in state and key not in seen:
            seen.add(key)
            lines.append(f"{current[0]} saved a {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} tensor "
                         f"({t.untyped_storage().nbytes():,} bytes)")
        elif key not in state:
            lines.append(f"{current[0]} saved a {tuple(t.shape)} tensor already counted (the same storage)")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.mse_loss(model(x), y)
    return "\n      ".join(lines)


def _activation_mistakes(sizes: tuple[int, ...], batch_size: int, activation: str, mixed: bool,
                         measured: int) -> list[tuple[int, str]]:
    """``(value, what that value means)`` for the mistakes an activation count plausibly makes."""
    element = 2 if mixed else 4
    unit, hidden, first, out = batch_size * element, sum(sizes[1:-1]), sizes[0], sizes[-1]
    name = type(ACTIVATIONS[activation]()).__name__
    mistakes = [(measured - unit * first, "you leave out the input x, which the first Linear saves for its "
                                          "weight's gradient"),
                (measured - unit * out, "you leave out the target (or the MLP's output): the MSE loss saves both"),
                (measured - 2 * unit * out, "you leave out what the MSE loss saves: the MLP's output and the target"),
                *[(measured + unit * out * k, f"you count a {name} after the last Linear: the MLP has none there")
                  for k in (1, 2)]]
    mistakes.append((2 * measured, "you count 4 bytes an element: in mixed precision every saved tensor is 16-bit, "
                                   "2 bytes, the input and the target included") if mixed else
                    (measured // 2, "you count 2 bytes an element: in fp32 every saved tensor takes 4"))
    if hidden and activation in ("relu", "tanh"):
        mistakes.append((measured + unit * hidden, f"you count two tensors per hidden width, but {name} computes "
                                                   "its gradient from its output, and the next Linear saves that "
                                                   "same tensor: one storage, counted once"))
    elif hidden:
        mistakes.append((measured - unit * hidden, f"you count one tensor per hidden width, as for ReLU, but {name} "
                                                   "computes its gradient from its input, so it saves its input, and "
                                                   f"the next Linear saves {name}'s output: two tensors"))
    return mistakes


def _activations_rank(fn: Callable, cases: tuple[str, ...], progress: str) -> list:
    from dtcourse.memory import measure_step
    from dtcourse.models import regression_batch
    for name in cases:
        description, runs = ACTIVATION_CASES[name]
        where = f"case {name!r} ({description})"
        for sizes, batch_size, activation, dtype in runs:
            mixed = dtype is not None
            call = f"{getattr(fn, '__name__', 'fn')}({sizes}, {batch_size}, {activation!r}, mixed={mixed})"
            Path(progress, "0").write_text(f"{where}, {call}")
            model, batch = _mlp(sizes, activation), regression_batch(batch_size, sizes[0], sizes[-1])
            measured = measure_step(model, batch, F.mse_loss, OPTIMIZERS["sgd"], mixed_dtype=dtype).activations
            with watching(ANSWERS):            # the course's measurements refuse to run for fn
                got = _as_student(progress, lambda: fn(sizes, batch_size, activation, mixed))
            value = _as_bytes(got, call)
            if isinstance(value, str):
                return [where, value]
            if value != measured:
                diff = value - measured
                named = _named(value, measured, _activation_mistakes(sizes, batch_size, activation, mixed, measured))
                return [where, f"activations for {_recipe(sizes, dtype)}, batch {batch_size}, {activation!r}: you "
                               f"predicted {value:,} bytes, autograd saved {measured:,}; yours is {abs(diff):,} too "
                               f"{'high' if diff > 0 else 'low'}."
                               + (f" That is exactly what you get when {named}." if named else "")
                               + "\n    In order, the forward saved:\n      " + _saved_by_layer(model, batch, dtype)]
    Path(progress, "0").write_text("finished")
    return []
