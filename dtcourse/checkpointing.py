"""Activation checkpointing: keep fewer activations in the forward, recompute them in backward.

A checkpointed region of the forward keeps only its inputs. Every tensor that the ops
inside it would save for backward is dropped and replaced by a number; when backward
first asks for one, the region runs again from its inputs, and this time its saved
tensors are kept, just long enough for backward to use them.

* ``checkpoint(fn, *args)`` does this for one call, with
  ``torch.autograd.graph.saved_tensors_hooks`` (the same mechanism as
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``). The RNG state and
  the autocast state of the forward are replayed, so dropout draws the same mask twice.
* ``checkpoint_sequential(layers, segments, x)`` cuts a stack of n layers into
  ``segments`` runs of consecutive layers and checkpoints all but the last. With k
  segments the forward keeps about k segment inputs plus the n/k layers of the last
  segment, least at k = sqrt(n); backward re-runs every layer but the last segment's,
  about one extra forward pass (Chen et al. 2016, "Training Deep Nets with Sublinear
  Memory Cost", arXiv 1604.06174).
* ``apply_full_recomputation`` checkpoints every layer of a ``models.GPT``;
  ``apply_selective_recomputation`` checkpoints only each attention's core (scores,
  softmax, weighted sum of values), which holds the a·s²·b-sized tensors but little of
  the arithmetic (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", arXiv 2205.05198).

Example::

    from dtcourse.checkpointing import checkpoint_sequential
    y = checkpoint_sequential(model.net, segments=2, x=x)   # then y.sum().backward() as usual

``dtcourse.checkpointing_cost`` holds the formulas for what each choice holds and recomputes;
``dtcourse.lab.checkpointing`` measures what each choice holds and costs, and
``python -m dtcourse.bench.checkpointing`` prints it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn

from dtcourse.models import CausalSelfAttention

__all__ = ["checkpoint", "segment_bounds", "checkpoint_sequential", "CheckpointedSequential",
           "Checkpointed", "SelectiveAttention", "apply_full_recomputation",
           "apply_selective_recomputation"]

# Reading autocast flags touches no GPU; asking torch.cuda.is_available() here would initialise
# CUDA at import, and then no rank that launch forks could use it.
_AUTOCAST_DEVICES = ("cpu", "cuda") if torch.backends.cuda.is_built() else ("cpu",)


class _Recomputation:
    """One checkpointed call: what it keeps (its inputs, RNG and autocast state) and what it recomputes.

    ``pack`` and ``unpack`` are the saved-tensor hooks of the region's forward. ``pack`` keeps
    only the position of a saved tensor in the order the forward saved them. The first
    ``unpack`` runs the region again from its inputs with hooks that keep everything, in the
    same order, and each ``unpack`` then hands back (and lets go of) the tensor at its position.
    """

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, preserve_rng_state: bool):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.versions = [a._version if isinstance(a, torch.Tensor) else None for a in args]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.cuda_devices = sorted({t.device.index for t in tensors if t.is_cuda})
        self.rng: tuple | None = None
        if preserve_rng_state:
            self.rng = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in self.cuda_devices])
        self.autocast = {device: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                         for device in _AUTOCAST_DEVICES}
        self.dropped: list[tuple[torch.Size, torch.dtype]] = []     # what the forward declined to keep
        self.recomputed: dict[int, torch.Tensor] = {}

    def pack(self, t: torch.Tensor) -> int:
        self.dropped.append((t.shape, t.dtype))
        return len(self.dropped) - 1

    def unpack(self, position: int) -> torch.Tensor:
        if position not in self.recomputed:      # the first unpack of this backward
            self.recompute()
        return self.recomputed.pop(position)

    def recompute(self) -> None:
        changed = [i for i, (a, v) in enumerate(zip(self.args, self.versions))
                   if v is not None and a._version != v]
        if changed:
            raise RuntimeError(f"checkpoint: input(s) {changed} of {_name(self.fn)} were modified in place "
                               "during or after the forward, so recomputing would start from other values. "
                               "Pass a copy, or modify a copy.")
        # Fresh leaves with the same requires_grad: the ops save the same tensors as before,
        # and the throwaway graph of the recomputation ends here instead of reaching back.
        inputs = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                  for a in self.args]
        kept: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> None:
            kept.append(t.detach())              # values only; backward uses the forward's graph

        with contextlib.ExitStack() as stack:
            # fork_rng puts the global RNG back afterwards: backward's recomputation draws no numbers
            # that the training loop would otherwise have drawn.
            replay = self.rng is not None
            stack.enter_context(torch.random.fork_rng(devices=self.cuda_devices, enabled=replay))
            if replay:
                torch.set_rng_state(self.rng[0])
                for device, state in zip(self.cuda_devices, self.rng[1]):
                    torch.cuda.set_rng_state(state, device)
            for device, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.enable_grad())   # backward runs with grad mode off
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(keep, _never_unpacked))
            self.fn(*inputs, **self.kwargs)
        got = [(t.shape, t.dtype) for t in kept]
        if got != self.dropped:
            first = next((i for i, (a, b) in enumerate(zip(got, self.dropped)) if a != b),
                         min(len(got), len(self.dropped)))
            raise RuntimeError(
                f"checkpoint: recomputing {_name(self.fn)} saved {len(got)} tensors for backward where the "
                f"forward saved {len(self.dropped)}, first differing at tensor {first} "
                f"({_describe(got, first)} against {_describe(self.dropped, first)}). The function must run "
                "the same operations on the same shapes every time it is called.")
        self.recomputed = dict(enumerate(kept))


def _never_unpacked(_: None) -> torch.Tensor:
    raise RuntimeError("checkpoint: the recomputed graph is only read for its saved tensors; "
                       "it cannot be differentiated itself.")


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _describe(metas: list[tuple[torch.Size, torch.dtype]], i: int) -> str:
    if i >= len(metas):
        return "nothing"
    shape, dtype = metas[i]
    return f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"


def checkpoint(fn: Callable[..., Any], *args: Any, preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, keeping none of the tensors it saves for backward: backward recomputes them.

    Only ``args`` (and ``kwargs``) are kept. Gradients are those of the plain call, bit for
    bit when ``fn`` is deterministic: the recomputation replays the forward's CPU RNG state
    (and that of the CUDA devices of the tensor arguments) and its autocast settings. With
    ``preserve_rng_state=False`` it does not, and a dropout inside ``fn`` draws a new mask.
    Under ``torch.no_grad()`` nothing is saved anyway, and ``fn`` simply runs.
    """
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    region = _Recomputation(fn, args, kwargs, preserve_rng_state)
    with torch.autograd.graph.saved_tensors_hooks(region.pack, region.unpack):
        return fn(*args, **kwargs)


# --------------------------------------------------------------------------- #
# Segments of a stack of layers
# --------------------------------------------------------------------------- #
def segment_bounds(n_layers: int, segments: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: ``segments`` runs of consecutive layers, sizes differing by at most one.

    The longer segments come first, so the last one, which ``checkpoint_sequential`` keeps
    whole, is a shortest one. (``torch.utils.checkpoint.checkpoint_sequential`` instead gives
    the last segment all the layers left over; the two agree whenever ``segments`` divides
    ``n_layers``.) ``segment_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]``.
    """
    for name, value in (("n_layers", n_layers), ("segments", segments)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"segment_bounds: {name} must be an int, got {type(value).__name__} {value!r}.")
    if n_layers < 1:
        raise ValueError(f"segment_bounds: there must be at least one layer to checkpoint, got {n_layers}.")
    if not 1 <= segments <= n_layers:
        raise ValueError(f"segment_bounds: segments must be between 1 and the number of layers ({n_layers}), "
                         f"got {segments}: each segment needs at least one layer.")
    size, longer = divmod(n_layers, segments)
    bounds, start = [], 0
    for i in range(segments):
        end = start + size + (i < longer)
        bounds.append((start, end))
        start = end
    return bounds


def _run_layers(layers: Sequence[Callable], x: Any) -> Any:
    for layer in layers:
        x = layer(x)
    return x


def checkpoint_sequential(layers: Iterable[Callable], segments: int, x: Any, *,
                          preserve_rng_state: bool = True) -> Any:
    """Run ``x`` through ``layers`` in ``segments`` segments, all but the last checkpointed.

    The last segment runs plainly: backward needs its activations at once, so recomputing
    them would only cost time. ``segments=1`` is the plain run; ``segments=len(layers)``
    keeps only each layer's input (and the last layer's activations).
    """
    layers = list(layers)
    bounds = segment_bounds(len(layers), segments)
    for start, end in bounds[:-1]:
        x = checkpoint(_run_layers, layers[start:end], x, preserve_rng_state=preserve_rng_state)
    start, end = bounds[-1]
    return _run_layers(layers[start:end], x)


class CheckpointedSequential(nn.Sequential):
    """``nn.Sequential`` whose forward is ``checkpoint_sequential(self, segments, x)``.

    Its state dict has the keys of the plain ``nn.Sequential(*layers)``, so weights move
    between the two freely.
    """

    def __init__(self, *layers: nn.Module, segments: int):
        super().__init__(*layers)
        segment_bounds(len(self), segments)           # bad counts fail here, not at the first forward
        self.segments = segments

    def forward(self, x: Any) -> Any:
        return checkpoint_sequential(self, self.segments, x)

    def __getitem__(self, index: int | slice) -> nn.Module:
        if isinstance(index, slice):   # nn.Sequential would build a CheckpointedSequential with no segments
            return nn.Sequential(*list(self)[index])
        return super().__getitem__(index)

    def extra_repr(self) -> str:
        return f"segments={self.segments}"


# --------------------------------------------------------------------------- #
# Full and selective recomputation of a GPT
# --------------------------------------------------------------------------- #
class Checkpointed(nn.Module):
    """Wraps a module so that every call of it is checkpointed (its parameters' names gain ``module.``)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.module, *args, **kwargs)


class SelectiveAttention(nn.Module):
    """A ``models.CausalSelfAttention`` whose core is recomputed in backward; the projections are not.

    Korthikanti et al. recompute only the part of attention between the input projection
    and the output projection: q·kᵀ, the mask, softmax, its dropout and the product with v.
    Its saved tensors are large (the a·s²·b-sized scores) but its arithmetic is small next to
    the linear layers'. The forward keeps the projection's output (q, k and v side by side);
    backward recomputes the rest from it.

    It takes over the attention's own submodules, under the same names, so the state dict
    is unchanged, and runs the attention's own ``core`` under ``checkpoint``. (A core written
    with ``F.scaled_dot_product_attention`` saves no s x s tensor in the first place: the fused
    kernel recomputes the scores in backward itself, Dao et al. 2022, arXiv 2205.14135.)
    """

    def __init__(self, attn: CausalSelfAttention):
        super().__init__()
        if not isinstance(attn, CausalSelfAttention):
            raise TypeError(f"SelectiveAttention wraps a models.CausalSelfAttention, "
                            f"got {type(attn).__name__}.")
        self.n_head = attn.n_head
        self.c_attn, self.c_proj = attn.c_attn, attn.c_proj
        self.attn_drop, self.resid_drop = attn.attn_drop, attn.resid_drop
        self.register_buffer("future_mask", attn.future_mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)                                      # (B, T, 3C): kept for the recomputation
        y = checkpoint(self.core, qkv)                            # (B, T, C)
        return self.resid_drop(self.c_proj(y))

    # The same core as models.CausalSelfAttention, borrowed rather than restated: it reads
    # only n_head, attn_drop and future_mask, which this module has under the same names.
    core = CausalSelfAttention.core


def _blocks(model: nn.Module) -> nn.ModuleList:
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"expected a models.GPT (a module with a ModuleList `blocks`), "
                        f"got {type(model).__name__}.")
    return blocks


def apply_full_recomputation(model: nn.Module) -> nn.Module:
    """Checkpoint every transformer layer of ``model`` (a ``models.GPT``), in place; returns ``model``.

    The forward then keeps one (B, T, C) tensor per layer, its input; backward runs every
    layer's forward again.
    """
    blocks = _blocks(model)
    for i, block in enumerate(blocks):
        if isinstance(block, Checkpointed):
            raise ValueError(f"layer {i} is already checkpointed: apply_full_recomputation was applied "
                             "twice.")
        blocks[i] = Checkpointed(block)
    return model


def apply_selective_recomputation(model: nn.Module) -> nn.Module:
    """Recompute only each layer's attention core (``SelectiveAttention``), in place; returns ``model``."""
    for i, block in enumerate(_blocks(model)):
        if isinstance(block, Checkpointed) or isinstance(getattr(block, "attn", None), SelectiveAttention):
            raise ValueError(f"layer {i} is already checkpointed; apply one recomputation policy per model.")
        block.attn = SelectiveAttention(block.attn)
    return model
