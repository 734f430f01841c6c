"""The four communication operators of tensor and sequence parallelism, as autograd functions.

Megatron's tensor parallelism (Shoeybi et al., arXiv 1909.08053, section 3, figure 3) needs two
conjugate operators around each pair of column- and row-parallel layers:

* ``f`` (``copy_to_tensor_parallel``): identity forward, all-reduce backward. It stands before a
  column-parallel layer, whose input every rank uses in full.
* ``g`` (``reduce_from_tensor_parallel``): all-reduce forward, identity backward. It stands after a
  row-parallel layer, whose output each rank holds a partial sum of.

Sequence parallelism (Korthikanti et al., arXiv 2205.05198, section 4.2.2) splits the sequence
dimension between those pairs, and replaces ``f`` and ``g`` by a conjugate pair:

* ``g-bar`` (``gather_from_sequence_parallel``): all-gather along the sequence forward,
  reduce-scatter backward; it replaces ``f``.
* ``g``-with-scatter (``reduce_scatter_to_sequence_parallel``): reduce-scatter along the sequence
  forward, all-gather backward; it replaces ``g``.

An all-reduce is a reduce-scatter followed by an all-gather, so both schemes send the same bytes.
The process group is an explicit argument of every function (``backward`` returns ``None`` for it).
Nothing here logs: a lesson counts the bytes per layer with ``dtcourse.runtime.observe``, which sees every
collective at the process group. Activations are ``(B, T, C)``: the sequence dimension is 1. Example::

    y = reduce_from_tensor_parallel(partial, group)      # (B, T, C): the sum of every rank's partial sum
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtcourse.runtime.compat import all_gather_single, reduce_scatter_single

__all__ = ["copy_to_tensor_parallel", "reduce_from_tensor_parallel",
           "gather_from_sequence_parallel", "reduce_scatter_to_sequence_parallel"]

SEQ = 1   # the sequence dimension of (B, T, C) activations


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous().clone()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(x, group=group)               # sends 2(t-1)/t * x.nbytes per rank
    return x


def _all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    t = dist.get_world_size(group)
    part = x.transpose(0, SEQ).contiguous()           # (T/t, B, C): the sequence first, so parts are contiguous
    full = part.new_empty((t * part.shape[0], *part.shape[1:]))   # (T, B, C)
    if t > 1:
        all_gather_single(full, part, group=group)    # sends (t-1)/t * full.nbytes per rank
    else:
        full.copy_(part)
    return full.transpose(0, SEQ)                     # (B, T, C)


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    t = dist.get_world_size(group)
    if x.shape[SEQ] % t:
        raise ValueError(f"sequence parallelism splits the sequence of length {x.shape[SEQ]} over {t} ranks; "
                         f"use a sequence length divisible by {t}, such as {x.shape[SEQ] + t - x.shape[SEQ] % t}.")
    full = x.transpose(0, SEQ).contiguous()           # (T, B, C)
    part = full.new_empty((full.shape[0] // t, *full.shape[1:]))  # (T/t, B, C)
    if t > 1:
        reduce_scatter_single(part, full, group=group)   # sends (t-1)/t * full.nbytes per rank
    else:
        part.copy_(full)
    return part.transpose(0, SEQ)                     # (B, T/t, C)


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input's gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: all-reduce of the partial sums forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequenceParallel(torch.autograd.Function):
    """Sequence parallelism's g-bar: all-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Sequence parallelism's g: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


def copy_to_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Megatron's f (before a column-parallel layer)."""
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Megatron's g (after a row-parallel layer)."""
    return _ReduceFromTensorParallel.apply(x, group)


def gather_from_sequence_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(B, T/t, C) -> (B, T, C): sequence parallelism's g-bar (before a column-parallel layer)."""
    return _GatherFromSequenceParallel.apply(x, group)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(B, T, C) partial sums -> (B, T/t, C) summed: sequence parallelism's g (after a row-parallel layer)."""
    return _ReduceScatterToSequenceParallel.apply(x, group)
