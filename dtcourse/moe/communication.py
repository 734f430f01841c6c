"""The all-to-all of expert parallelism, as an autograd function that takes its group.

Dispatch sends each token to the rank that owns its expert; combine sends the expert's output back. Both are
one ``all_to_all_single``: rank r sends ``input_splits[q]`` rows to rank q and receives ``output_splits[q]``
rows from it. Its backward is the same exchange reversed (the splits swapped): the gradient of a row goes
back to the rank it came from (GShard, Lepikhin et al., arXiv 2006.16668, section 2.2). Equal splits are the
capacity-padded mode; uneven ones the dropless mode, which first exchanges the counts (``exchange_counts``).
The padded mode exchanges counts too, after its dispatch, only to learn which of its experts no token reached.
On gloo, ``all_to_all_single`` takes uneven splits; the list form ``dist.all_to_all`` with unequal sizes does
not, so it is not used. Nothing here logs: ``dtcourse.runtime.observe`` records each exchange, with the
bytes it sends to every rank. Example::

    received = all_to_all(rows, [3, 5], [4, 4], group)     # 4 rows to each of 2 ranks; 3 and 5 come back
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["all_to_all", "exchange_counts"]


def _exchange(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))                  # (rows received, C)
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out                                   # sends sum(input_splits) - own rows, times a row's bytes


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
               group: dist.ProcessGroup | None) -> torch.Tensor:
    """Rows ``x`` (n, ...) cut by ``input_splits`` to the ranks of ``group``; the rows received, by ``output_splits``."""
    return _AllToAll.apply(x, [int(s) for s in output_splits], [int(s) for s in input_splits], group)


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``counts`` (ep, k): what this rank will send to each rank; returns (ep, k): what each rank will send it."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)     # sends (ep-1) k integers per rank
    return received
