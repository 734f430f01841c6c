"""Mixed-precision training: a 16-bit model copy, fp32 master weights, and loss scaling.

Micikevicius et al. 2017, "Mixed Precision Training" (arXiv 1710.03740), keep three things
apart that a plain fp32 step keeps together:

1. **The working copy.** The model's weights in fp16 (or bf16) run forward and backward, so
   activations and gradients take 2 bytes per number instead of 4.
2. **The fp32 master weights** (their section 3.1). The optimizer steps these. An update
   ``lr * grad`` more than about 2^11 times smaller than its weight falls below fp16's
   resolution and would vanish if it were added to the 16-bit copy; added to fp32 it survives.
   After the step the masters are rounded back into the working copy.
3. **Loss scaling** (section 3.2). fp16 has 5 exponent bits: nothing below 2^-24, its
   smallest subnormal, survives, so the smallest gradients become zero. Multiplying the loss
   by S before backward shifts every gradient up by the same factor, and dividing the fp32
   master gradients by S afterwards undoes it. ``DynamicLossScaler`` chooses S as
   ``torch.amp.GradScaler`` does: a step whose gradients hold an inf or NaN is skipped and S is
   multiplied by ``backoff_factor``; after ``growth_interval`` clean steps in a row S is
   multiplied by ``growth_factor``. ``StaticLossScaler`` keeps one S throughout.

bf16 (Kalamkar et al. 2019, arXiv 1905.12322) has fp32's 8 exponent bits, so it needs no loss
scaling; it trains with ``torch.autocast`` instead of a 16-bit copy (lesson 04's recipes, in
``dtcourse.lab.mixed_precision``, compare all four). Every fp16 and bf16 number here is real: nothing is emulated, on CPU or on CUDA.

Example::

    from dtcourse.mixed_precision import DynamicLossScaler, MasterWeights
    master = MasterWeights(model, torch.float16)           # model is now fp16; fp32 masters kept
    opt, scaler = torch.optim.Adam(master.parameters()), DynamicLossScaler()
    scaler.scale(loss_fn(model(x).float(), y)).backward()  # scaled fp16 gradients
    master.grads_to_master(); scaler.step(opt); scaler.update(); master.master_to_model()
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn


__all__ = ["MasterWeights", "LossScaler", "StaticLossScaler", "DynamicLossScaler", "to_fp32", "LOW_PRECISION"]

LOW_PRECISION = (torch.float16, torch.bfloat16)


def to_fp32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value: the scale is an fp32 number, as in GradScaler."""
    return torch.tensor(x, dtype=torch.float32).item()


# --------------------------------------------------------------------------- #
# The working copy and its fp32 master weights
# --------------------------------------------------------------------------- #
class MasterWeights:
    """fp32 master weights for ``model``, which is converted in place to ``dtype``.

    Give ``parameters()`` (the masters) to the optimizer. Each step: backward through the
    16-bit model, ``grads_to_master()``, step the optimizer, ``master_to_model()``.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.float16):
        if dtype not in LOW_PRECISION:
            raise ValueError(f"MasterWeights: dtype must be torch.float16 or torch.bfloat16, got {dtype}.")
        bad = [name for name, p in model.named_parameters() if p.dtype != torch.float32]
        if bad:
            raise ValueError(f"MasterWeights: the model must start in float32 (the masters are copied "
                             f"from it), but {bad[0]} is {model.get_parameter(bad[0]).dtype}.")
        self.model, self.dtype = model, dtype
        self.masters = [nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                        for p in model.parameters()]
        model.to(dtype)                                   # the working copy: 2 bytes per weight

    def parameters(self) -> list[nn.Parameter]:
        """The fp32 masters, in ``model.parameters()`` order: what the optimizer steps."""
        return self.masters

    def grads_to_master(self) -> None:
        """Move each 16-bit ``.grad`` into its master's fp32 ``.grad``.

        Exact: every fp16 and bf16 value is also an fp32 value.
        """
        for master, p in zip(self.masters, self.model.parameters()):
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        """Round the updated masters into the 16-bit working copy."""
        for master, p in zip(self.masters, self.model.parameters()):
            p.copy_(master)


# --------------------------------------------------------------------------- #
# Loss scaling
# --------------------------------------------------------------------------- #
class LossScaler:
    """What static and dynamic loss scaling share; GradScaler's methods, for fp32 (master) gradients.

    One iteration: ``scale(loss).backward()``; optionally ``unscale_(opt)`` (to clip, say);
    ``step(opt)``, which unscales if that wasn't done, and calls ``opt.step()`` only if no
    gradient is inf or NaN; then ``update()`` once. Subclasses choose the next scale.
    """

    def __init__(self, init_scale: float):
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"{type(self).__name__}: the scale must be a positive finite number, "
                             f"got {init_scale!r}.")
        self._scale = to_fp32(init_scale)
        self._found_inf: dict[int, bool] = {}   # id(optimizer) -> inf/NaN seen; present once unscaled
        self._stepped: set[int] = set()         # ids of the optimizers stepped (or skipped) this iteration

    def get_scale(self) -> float:
        return self._scale

    def scale(self, outputs: Any) -> Any:
        """``outputs`` (a tensor, or a list or tuple of them) times the scale, as an fp32 0-dim tensor."""
        if isinstance(outputs, torch.Tensor):
            # GradScaler multiplies by an fp32 tensor too: a 0-dim fp16 loss becomes fp32.
            return outputs * torch.tensor(self._scale, dtype=torch.float32, device=outputs.device)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"{type(self).__name__}.scale: expected a tensor or a list or tuple of tensors, "
                        f"got {type(outputs).__name__}.")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale, in place, noting whether any is inf or NaN."""
        name = type(self).__name__
        if id(optimizer) in self._stepped:
            raise RuntimeError(f"{name}.unscale_: this optimizer was already stepped this iteration; "
                               "unscale_ goes between backward() and step(), then call update().")
        if id(optimizer) in self._found_inf:
            raise RuntimeError(f"{name}.unscale_: called twice for this optimizer since the last update(); "
                               "its gradients are already unscaled, and dividing again would shrink them "
                               "by the scale a second time.")
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        for i, g in enumerate(grads):
            if g.dtype == torch.float16:
                raise ValueError(f"{name}.unscale_: gradient {i} is float16. Unscale fp32 gradients "
                                 "(MasterWeights.grads_to_master() makes them): divided in fp16, the "
                                 "small values the scaling saved would underflow again.")
        # As GradScaler: the reciprocal is taken in fp64 and rounded to fp32, and a gradient is
        # checked before it is multiplied (so a huge finite one is not mistaken for an overflow).
        inv_scale = to_fp32(1.0 / self._scale)
        found = False
        with torch.no_grad():
            for g in grads:
                found = found or not bool(torch.isfinite(g).all())
                g.mul_(inv_scale)
        self._found_inf[id(optimizer)] = found

    def step(self, optimizer: torch.optim.Optimizer, **kwargs) -> Any:
        """``optimizer.step(**kwargs)``, unless the unscaled gradients hold an inf or NaN (then ``None``)."""
        if "closure" in kwargs:
            raise RuntimeError(f"{type(self).__name__}.step: a closure is not supported; compute the loss "
                               "and call backward() before step().")
        if id(optimizer) in self._stepped:
            raise RuntimeError(f"{type(self).__name__}.step: step() was already called for this optimizer "
                               "since the last update(). Call update() once at the end of every iteration.")
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer)
        self._stepped.add(id(optimizer))
        if self._found_inf[id(optimizer)]:
            return None                 # skip: the weights keep their values, the scale will drop
        return optimizer.step(**kwargs)

    def update(self, new_scale: float | None = None) -> None:
        """End the iteration: set the next scale (``new_scale`` if given) and forget the inf checks."""
        if new_scale is not None:
            self._scale = to_fp32(float(new_scale))
        elif not self._found_inf:
            raise RuntimeError(f"{type(self).__name__}.update: no optimizer was stepped or unscaled since "
                               "the last update(); call step(optimizer) first.")
        else:
            self._next_scale(any(self._found_inf.values()))
        self._found_inf, self._stepped = {}, set()

    def _next_scale(self, found_inf: bool) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            raise RuntimeError(f"{type(self).__name__}.load_state_dict: the state dict is empty (a disabled "
                               "GradScaler saves {}).")
        self._scale = to_fp32(float(state_dict["scale"]))


class StaticLossScaler(LossScaler):
    """Loss scaling with one fixed scale S. Steps whose gradients overflow are still skipped."""

    def __init__(self, scale: float = 2.0 ** 10):
        super().__init__(scale)

    def _next_scale(self, found_inf: bool) -> None:
        pass                            # static: S never changes


class DynamicLossScaler(LossScaler):
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s rule and defaults (arXiv 1710.03740, 3.2).

    After each iteration: if a gradient was inf or NaN, S *= backoff_factor and the count of
    clean steps restarts; otherwise the count grows, and when it reaches growth_interval,
    S *= growth_factor (unless that is inf in fp32) and the count restarts.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        super().__init__(init_scale)
        if not growth_factor > 1.0:
            raise ValueError(f"DynamicLossScaler: growth_factor must be > 1, got {growth_factor!r}.")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"DynamicLossScaler: backoff_factor must be in (0, 1), got {backoff_factor!r}.")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"DynamicLossScaler: growth_interval must be a positive int, "
                             f"got {growth_interval!r}.")
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = growth_interval
        self._growth_tracker = 0        # clean steps in a row since the scale last changed

    def _next_scale(self, found_inf: bool) -> None:
        if found_inf:
            self._scale = to_fp32(self._scale * self.backoff_factor)
            self._growth_tracker = 0
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            grown = to_fp32(self._scale * self.growth_factor)
            if math.isfinite(grown):
                self._scale = grown
            self._growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        """The same five entries as ``GradScaler.state_dict()``: either can load the other's."""
        return {"scale": self._scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.growth_factor = float(state_dict["growth_factor"])
        self.backoff_factor = float(state_dict["backoff_factor"])
        self.growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])
