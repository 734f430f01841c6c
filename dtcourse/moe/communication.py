"""The all-to-all of expert parallelism, as an autograd function that takes its group and logs its bytes.

Dispatch sends each token to the rank that owns its expert; combine sends the expert's output back. Both are
one ``all_to_all_single``: rank r sends ``input_splits[q]`` rows to rank q and receives ``output_splits[q]``
rows from it. Its backward is the same exchange reversed (the splits swapped): the gradient of a row goes
back to the rank it came from (GShard, Lepikhin et al., arXiv 2006.16668, section 2.2). Equal splits are the
capacity-padded mode; uneven ones the dropless mode, which first exchanges the counts (``exchange_counts``).
The padded mode exchanges counts too, after its dispatch, only to learn which of its experts no token reached.
On gloo, ``all_to_all_single`` takes uneven splits; the list form ``dist.all_to_all`` with unequal sizes does
not, so it is not used. Example::

    log = AllToAllLog(); received = all_to_all(rows, [3, 5], [4, 4], group, log, "blocks.0", "dispatch")
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["all_to_all", "exchange_counts", "AllToAllLog", "Exchange"]


@dataclass(frozen=True)
class Exchange:
    """One all-to-all as this rank ran it: rows and bytes sent to other ranks and received from them."""

    where: str       # the layer, e.g. "blocks.0"
    what: str        # "dispatch" or "combine"
    phase: str       # "forward" or "backward"
    sent: int        # bytes this rank sent to the other ranks (its own share stays put)
    received: int    # bytes it received from them
    rows: int        # rows it sent in all, its own share included


@dataclass
class AllToAllLog:
    """The all-to-alls an expert-parallel model ran, with sums by field (``total("sent", phase="forward")``)."""

    records: list[Exchange] = field(default_factory=list)

    def total(self, key: str = "sent", **match: str) -> int:
        """Sum of ``key`` ("sent", "received" or "rows") over the records whose fields equal ``match``."""
        return sum(getattr(r, key) for r in self.records if all(getattr(r, k) == v for k, v in match.items()))

    def clear(self) -> None:
        self.records.clear()


def _exchange(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))                  # (rows received, C)
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out                                   # sends sum(input_splits) - own rows, times a row's bytes


def _log(log: AllToAllLog | None, where: str, what: str, phase: str, x: torch.Tensor,
         output_splits: list[int], input_splits: list[int], group) -> None:
    if log is None:
        return
    me, row = dist.get_rank(group), x[0].nbytes if x.shape[0] else 0
    log.records.append(Exchange(where, what, phase, (sum(input_splits) - input_splits[me]) * row,
                                (sum(output_splits) - output_splits[me]) * row, sum(input_splits)))


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, log, where, what):
        ctx.splits, ctx.group, ctx.log, ctx.where, ctx.what = (output_splits, input_splits), group, log, where, what
        _log(log, where, what, "forward", x, output_splits, input_splits, group)
        return _exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        _log(ctx.log, ctx.where, ctx.what, "backward", grad, input_splits, output_splits, ctx.group)
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None, None, None, None


def all_to_all(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
               group: dist.ProcessGroup | None, log: AllToAllLog | None = None, where: str = "",
               what: str = "") -> torch.Tensor:
    """Rows ``x`` (n, ...) cut by ``input_splits`` to the ranks of ``group``; the rows received, by ``output_splits``."""
    return _AllToAll.apply(x, [int(s) for s in output_splits], [int(s) for s in input_splits], group, log, where,
                           what)


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup | None, log: AllToAllLog | None = None,
                    where: str = "") -> torch.Tensor:
    """``counts`` (ep, k): what this rank will send to each rank; returns (ep, k): what each rank will send it."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)     # sends (ep-1) k integers per rank
    _log(log, where, "counts", "forward", counts, [1] * counts.shape[0], [1] * counts.shape[0], group)
    return received
