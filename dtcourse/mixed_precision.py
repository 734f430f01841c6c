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

``torch.amp``'s recipe keeps the weights themselves in fp32 instead: ``torch.autocast`` casts
them to 16 bits op by op where that pays (matmuls), and runs the ops it lists as needing fp32's
range in fp32 (losses; on CUDA also softmax and LayerNorm). The gradients come out fp32, the
weights' dtype, and there is no separate master copy. bf16 (Kalamkar et al. 2019,
arXiv 1905.12322) has fp32's 8 exponent bits, so under autocast it needs no loss scaling.
``Recipe`` names one of these ways to train and ``Trainer`` runs its steps. Every fp16 and bf16
number here is real: nothing is emulated, on CPU or on CUDA.

Example::

    from dtcourse.mixed_precision import DynamicLossScaler, Recipe, Trainer
    trainer = Trainer(model, Recipe(torch.float16, scaler=DynamicLossScaler), loss_fn)
    loss = trainer.forward(x, y)        # model now fp16, fp32 masters kept; loss in fp32
    trainer.backward(loss)              # scaled fp16 gradients
    trainer.step()                      # to the masters, unscale, step or skip, update, round back
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

__all__ = ["MasterWeights", "LossScaler", "StaticLossScaler", "DynamicLossScaler", "Recipe", "Trainer", "to_fp32",
           "LOW_PRECISION"]

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
        # checked once rounded to fp32: 2.0**140 is finite in Python but inf as GradScaler's fp32 scale
        if not (math.isfinite(init_scale) and math.isfinite(to_fp32(init_scale)) and to_fp32(init_scale) > 0):
            raise ValueError(f"{type(self).__name__}: the scale must be a positive finite number in fp32 "
                             f"(at most about 3.4e38), got {init_scale!r}.")
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


# --------------------------------------------------------------------------- #
# A recipe, and the training step that follows it
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class Recipe:
    """How a training step treats number formats.

    ``compute`` is the dtype forward and backward run in. With ``autocast=False`` a 16-bit
    copy of the model runs them and the optimizer steps fp32 ``MasterWeights``; with
    ``autocast=True`` the weights stay fp32 and ``torch.autocast`` runs matmuls in ``compute``.
    ``scaler`` builds a loss scaler (``DynamicLossScaler``, ``partial(StaticLossScaler, 2.0**10)``,
    ``partial(torch.amp.GradScaler, "cpu")``: anything with GradScaler's methods) or is None.
    """

    compute: torch.dtype = torch.float32
    autocast: bool = False
    scaler: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        if self.compute not in (torch.float32, *LOW_PRECISION):
            raise ValueError(f"Recipe: compute must be float32, float16 or bfloat16, got {self.compute}.")
        if self.autocast and self.compute == torch.float32:
            raise ValueError("Recipe: autocast=True needs a 16-bit compute dtype (float16 or bfloat16).")

    @property
    def copies(self) -> bool:
        """True when a 16-bit copy of the model runs forward and backward (fp32 masters take the step)."""
        return self.compute != torch.float32 and not self.autocast


class Trainer:
    """``model`` trained under ``recipe``: ``loss = forward(x, y)``, ``backward(loss)``, ``step()``.

    ``loss_fn(outputs, targets)`` always sees fp32 outputs, so the softmax and the mean of the
    loss run in fp32 whatever the recipe. ``make_optimizer(params)`` builds the optimizer over
    the weights it steps: the model's own, or the fp32 masters of a 16-bit copy.
    """

    def __init__(self, model: nn.Module, recipe: Recipe,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = torch.optim.Adam):
        self.model, self.recipe, self.loss_fn = model, recipe, loss_fn
        self.device = next(model.parameters()).device
        self.master = MasterWeights(model, recipe.compute) if recipe.copies else None   # model now 16-bit
        self.optimizer = make_optimizer(model.parameters() if self.master is None else self.master.parameters())
        self.scaler = recipe.scaler() if recipe.scaler is not None else None
        self.steps_taken = 0                            # optimizer.step() calls: a skipped step adds none
        self.optimizer.register_step_post_hook(lambda *_: setattr(self, "steps_taken", self.steps_taken + 1))

    def scale(self) -> float:
        """The loss scale the next ``backward`` multiplies by (1 without a scaler)."""
        return 1.0 if self.scaler is None else self.scaler.get_scale()

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss, an fp32 scalar: the model runs in ``recipe.compute``, the loss in fp32."""
        if self.master is not None and inputs.is_floating_point():
            inputs = inputs.to(self.recipe.compute)     # a 16-bit model takes 16-bit inputs
        with torch.autocast(self.device.type, dtype=self.recipe.compute, enabled=self.recipe.autocast):
            outputs = self.model(inputs)
        return self.loss_fn(outputs.float(), targets)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward from ``loss``, multiplied by the loss scale if the recipe has a scaler."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self) -> bool:
        """Step the optimizer, or skip the step on an inf or NaN gradient; True if it stepped."""
        if self.master is not None:
            self.master.grads_to_master()               # 16-bit grads -> fp32, still scaled
        before = self.steps_taken
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)            # unscale, check, step or skip
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not None:
            self.master.master_to_model()               # round the masters into the 16-bit copy
        return self.steps_taken > before
