"""The checks ZeRO makes before it changes anything; each error says what to change.

Arguments first (they need no process group, so a wrong stage is caught even outside a launch),
then the module, then that every rank holds the same model, which ZeRO, unlike DDP, cannot repair
by copying rank 0's parameters: each rank keeps only its part of them. Example::

    check_arguments(stage=4, ...)   # ValueError: stage must be 0 (plain data parallelism), 1 (...) ...
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from dtcourse.mixed_precision import LOW_PRECISION, Recipe
from dtcourse.zero.memory import STAGES

__all__ = ["check_arguments", "check_module", "check_same_model", "build_optimizer", "MARK"]

MARK = "_dtcourse_zero_wrapped"   # set on a wrapped module, so wrapping it twice is caught
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def check_arguments(stage: Any, optimizer: Any, precision: Any, reduce_dtype: Any) -> None:
    """ZeRO's arguments, before anything needs a process group."""
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"ZeRO: stage must be 0 (plain data parallelism), 1 (shard the optimizer states), "
                         f"2 (and the gradients) or 3 (and the parameters); got {stage!r}.")
    if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
        what = f"an optimizer already built ({type(optimizer).__name__})" \
            if isinstance(optimizer, torch.optim.Optimizer) else repr(optimizer)
        raise TypeError(f"ZeRO: optimizer must be an optimizer class or a factory that builds one from a list of "
                        f"parameters, such as functools.partial(torch.optim.AdamW, lr=1e-3); got {what}. ZeRO "
                        "builds the optimizer itself, over this rank's part of the parameters only.")
    if not isinstance(precision, Recipe) or precision.autocast or precision.scaler is not None:
        raise ValueError(f"ZeRO: precision must be a dtcourse.mixed_precision.Recipe with a compute dtype and no "
                         f"autocast or loss scaler, e.g. Recipe(torch.bfloat16); got {precision!r}. ZeRO runs "
                         "lesson 04's copy recipe (16-bit parameters, fp32 masters); loss scaling would need "
                         "the inf check agreed across ranks, which is not built yet: use bfloat16.")
    if reduce_dtype is not None and reduce_dtype not in (torch.float32, *LOW_PRECISION):
        raise ValueError(f"ZeRO: reduce_dtype must be None, float32, float16 or bfloat16; got {reduce_dtype!r}.")


def check_module(module: nn.Module, wrapper: type) -> None:
    """A process group exists, and ``module`` is plain (not a ``wrapper`` already), trainable, fp32, on one device."""
    if not dist.is_initialized():
        raise RuntimeError("ZeRO needs a process group: build it inside a function run by dtcourse.launch(fn, N), "
                           "or call dtcourse.init_from_env() first under torchrun.")
    if isinstance(module, wrapper) or getattr(module, MARK, False):
        raise ValueError("ZeRO: this module is already wrapped (its parameters are already flat views). Wrap the "
                         "plain model once and keep using that wrapper.")
    params = list(module.parameters())
    if not any(p.requires_grad for p in params):
        raise ValueError("ZeRO: the module has no parameter that requires a gradient: nothing to train.")
    bad = [n for n, p in module.named_parameters() if p.dtype != torch.float32]
    if bad:
        raise ValueError(f"ZeRO: parameters must start in float32 (the fp32 masters are copied from them), but "
                         f"{bad[0]!r} is {module.get_parameter(bad[0]).dtype}; pass precision=Recipe(...) for "
                         "16-bit compute instead of converting the model.")
    if len({p.device for p in params}) > 1:
        raise ValueError("ZeRO: all parameters must be on one device; move the model with .to(device) first.")


def build_optimizer(factory: OptimizerFactory, masters: list[nn.Parameter]) -> torch.optim.Optimizer:
    """``factory(masters)``: the optimizer over this rank's fp32 parts, one per trainable flat."""
    built = factory(masters)
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(f"ZeRO: optimizer(params) returned {type(built).__name__}, not a torch.optim.Optimizer; "
                        "pass a class or a factory such as functools.partial(torch.optim.AdamW, lr=1e-3).")
    return built


def check_same_model(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Every rank must hold the same parameters: names, shapes, dtypes, frozen or not, and values.

    A rank keeps only its part of each parameter, so ZeRO cannot copy rank 0's model to the
    others afterwards, as DDP does: a difference now would be a different model on every rank.
    Each rank sends a digest of each parameter's bytes (a few dozen bytes per tensor).
    """
    mine = [(n, tuple(p.shape), str(p.dtype), p.requires_grad, _digest(p)) for n, p in module.named_parameters()]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)

    def show(entry: tuple | None) -> str:
        return "nothing" if entry is None else \
            f"parameter {entry[0]!r} (shape {entry[1]}, {entry[2]}, requires_grad={entry[3]})"

    for rank, theirs in enumerate(everyone):
        for a, b in itertools.zip_longest(everyone[0], theirs):
            if a is None or b is None or a[:4] != b[:4]:
                raise ValueError(f"ZeRO: rank 0 has {show(a)} where rank {rank} has {show(b)}. Every rank "
                                 "must build the same model (same sizes and config) and freeze the same "
                                 "parameters before wrapping.")
            if a[4] != b[4]:
                raise ValueError(f"ZeRO: parameter {a[0]!r} has other values on rank {rank} than on rank 0. "
                                 "Build the model from the same seed on every rank (e.g. MLP(sizes, seed=0)) "
                                 "before wrapping: each rank keeps only its part of the parameters, so ZeRO "
                                 "cannot copy rank 0's values to the others.")


def _digest(t: torch.Tensor) -> str:
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)   # (nbytes,) the exact bits
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()
