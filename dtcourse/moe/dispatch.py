"""Dispatch and combine: the tokens of one rank to the ranks that own their experts, and the outputs back.

E experts over ep ranks, E/ep each: rank q owns experts [q E/ep, (q+1) E/ep), so the tokens bound for one
rank are one contiguous run once they are laid out by expert. Two ways to lay them out (GShard, arXiv
2006.16668; Switch, arXiv 2101.03961; Megatron's and torchtitan's dispatchers):

* **capacity-padded**: a buffer of E x C rows, a choice in row ``expert * C + position`` (its slot, from the
  router's ``positions_in_expert``), empty slots zero. Every rank sends every other rank the same E/ep x C
  rows: equal splits, no counts to exchange, but the experts also run on the padding.
* **dropless**: the choices sorted by expert, nothing padded, nothing dropped. The ranks first exchange how
  many rows each expert gets from each rank (``exchange_counts``), then the rows, with uneven splits.

In both, ``dispatch_*`` returns what this rank's experts receive, laid out ``(source rank, local expert,
rows)``, and a ``Plan`` that ``combine_*`` uses to send the outputs back and add each one, times its gate,
to its token: for each token, choice 0 first, then choice 1, as the one-process ``MoE.combine`` adds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtcourse.models.moe import Routing
from dtcourse.moe.communication import all_to_all, exchange_counts

__all__ = ["Plan", "dispatch_padded", "combine_padded", "dispatch_dropless", "combine_dropless"]


@dataclass(frozen=True)
class Plan:
    """What combine needs from dispatch: the splits to reverse and where each returned row belongs."""

    send_splits: list[int]        # rows this rank sent to each rank
    recv_splits: list[int]        # rows it received from each rank
    rows_of: list[torch.Tensor]   # per local expert: the received rows it runs on (indices into the received)
    slot: torch.Tensor            # (N, k): for each choice, the row of the returned buffer holding its output


def dispatch_padded(tokens: torch.Tensor, routing: Routing, n_expert: int, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, Plan]:
    """Tokens (N, C) into E x C slots, then all-to-all: (ep x E/ep x C, C) rows for this rank's experts."""
    ep, (N, C), cap = dist.get_world_size(group), tokens.shape, routing.capacity
    local = n_expert // ep
    slot = routing.experts * cap + routing.positions                         # (N, k): row in the E x C buffer
    kept = routing.kept.t().reshape(-1)                                       # (k N,), choice-major
    token = torch.arange(N).repeat(routing.experts.shape[1])                 # (k N,): the token of each choice
    buffer = tokens.new_zeros(n_expert * cap, C).index_copy(
        0, slot.t().reshape(-1)[kept], tokens[token[kept]])                  # (E C, C): zeros where empty
    splits = [local * cap] * ep
    received = all_to_all(buffer, splits, splits, group)   # (ep E/ep C, C)
    rows = torch.arange(ep * local * cap).view(ep, local, cap)               # [source][local expert][slot]
    return received, Plan(splits, splits, [rows[:, e].reshape(-1) for e in range(local)], slot)


def dispatch_dropless(tokens: torch.Tensor, routing: Routing, n_expert: int, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, Plan]:
    """Every choice's token, sorted by expert, to its expert's rank: counts first, then uneven splits."""
    ep, (N, k) = dist.get_world_size(group), routing.experts.shape
    local = n_expert // ep
    flat = routing.experts.t().reshape(-1)                                   # (k N,), choice-major
    order = flat.argsort(stable=True)                                        # choices grouped by expert
    counts = torch.bincount(flat, minlength=n_expert).view(ep, local)        # (ep, E/ep): rows to send
    incoming = exchange_counts(counts, group)                    # (ep, E/ep): rows to receive
    send, recv = counts.sum(1).tolist(), incoming.sum(1).tolist()
    received = all_to_all(tokens[order % N], recv, send, group)   # (sum recv, C)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), incoming.reshape(-1).cumsum(0)])   # [source][expert]
    rows_of = []
    for e in range(local):                   # expert e's rows: one run from each source rank, in rank order
        runs = [torch.arange(starts[s * local + e], starts[s * local + e + 1]) for s in range(ep)]
        rows_of.append(torch.cat(runs))
    slot = torch.empty_like(flat)
    slot[order] = torch.arange(flat.numel())                                 # choice -> its row, sent and returned
    return received, Plan(send, recv, rows_of, slot.view(k, N).t())


def _send_back(outputs: torch.Tensor, plan: Plan, group) -> torch.Tensor:
    return all_to_all(outputs, plan.send_splits, plan.recv_splits, group)


def _add_up(returned: torch.Tensor, routing: Routing, slot: torch.Tensor, N: int) -> torch.Tensor:
    """out[i] = sum_j gate_ij * returned[slot_ij] over token i's kept choices, choice 0 first."""
    out = returned.new_zeros(N, returned.shape[1])                           # (N, C)
    for j in range(routing.experts.shape[1]):
        rows = routing.kept[:, j].nonzero().squeeze(1)                       # tokens whose choice j was kept
        out = out.index_add(0, rows, returned[slot[rows, j]] * routing.gates[rows, j, None].to(returned.dtype))
    return out


def combine_padded(outputs: torch.Tensor, plan: Plan, routing: Routing, group) -> torch.Tensor:
    """The experts' outputs (laid out as received) back to their ranks, each added to its token: (N, C)."""
    return _add_up(_send_back(outputs, plan, group), routing, plan.slot, routing.experts.shape[0])


combine_dropless = combine_padded      # the same reverse exchange; only the plan's splits and slots differ
