"""Expert parallelism: each rank keeps E/ep of an MoE layer's experts and exchanges tokens with all-to-all.

GShard (Lepikhin et al., arXiv 2006.16668) and Switch (Fedus et al., arXiv 2101.03961): the router and
everything outside the MoE layers are replicated and trained with data parallelism; the experts are
split over the ranks of an expert-parallel group. Each rank routes its own tokens (one GShard group), sends
each choice to the rank of its expert (``dispatch``), runs its experts on what arrives, and sends the
outputs back (``combine``). An expert's gradient collects every rank's tokens through the all-to-all's
backward, so it needs no all-reduce when each expert lives on one rank; with dp > ep each expert has
dp/ep replicas, summed over their own group.

``expert_parallelize(gpt, group)`` swaps every ``MoE`` of a ``dtcourse.models.GPT`` for an
``ExpertParallelMoE`` in place (the model knows nothing of it); ``ExpertParallel`` is the parity harness's
adapter, with the data-parallel averaging. The layer is capacity-padded when the model has a
``capacity_factor`` and dropless when it is None. An expert that no token reached does not run, in either
mode, so its gradient stays None as in one process (the padded mode learns which experts those are from a
small exchange of counts). Example, on every rank::

    ep = ExpertParallel(GPT(GPTConfig(n_expert=4), seed=0), group, lambda ps: torch.optim.AdamW(ps))
    out = ep.forward_backward(x_mine, y_mine, lm_loss); ep.step()
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from dtcourse.mesh import Mesh
from dtcourse.models import GPT
from dtcourse.models.moe import MoE, _AttachAux, load_balancing_loss, route, z_loss
from dtcourse.moe.communication import exchange_counts
from dtcourse.moe.dispatch import combine_padded, dispatch_dropless, dispatch_padded

__all__ = ["ExpertParallelMoE", "expert_parallelize", "ExpertParallel", "check_expert_parallel"]


def check_expert_parallel(n_expert: int, ep: int) -> None:
    if n_expert % ep:
        fits = [d for d in range(1, n_expert + 1) if n_expert % d == 0]
        raise ValueError(f"expert-parallel size {ep} does not divide n_expert = {n_expert}: every rank keeps "
                         f"E/ep experts; use ep among {fits}, or a multiple of {ep} experts.")


class ExpertParallelMoE(nn.Module):
    """This rank's experts of ``moe`` (``experts["e"]``, global ids), its router, and the all-to-alls."""

    def __init__(self, moe: MoE, group: dist.ProcessGroup | None):
        super().__init__()
        ep, rank = dist.get_world_size(group), dist.get_rank(group)
        check_expert_parallel(moe.n_expert, ep)
        self.group = group
        self.n_expert, self.top_k, self.capacity_factor = moe.n_expert, moe.top_k, moe.capacity_factor
        self.aux_loss_coef, self.z_loss_coef = moe.aux_loss_coef, moe.z_loss_coef
        self.mode = "dropless" if moe.capacity_factor is None else "padded"
        self.router = moe.router                                           # replicated: data parallel
        local = moe.n_expert // ep
        self.mine = list(range(rank * local, (rank + 1) * local))
        self.experts = nn.ModuleDict({str(e): moe.experts[e] for e in self.mine})   # names as in the full layer
        self.aux_loss, self.stats = torch.zeros(()), {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        tokens = x.reshape(B * T, C)                                       # (N, C): this rank's tokens, one group
        routing = route(self.router(tokens), self.top_k, self.capacity_factor)
        dispatch = dispatch_padded if self.mode == "padded" else dispatch_dropless
        received, plan = dispatch(tokens, routing, self.n_expert, self.group)
        outputs = received.new_zeros(received.shape)                       # (rows received, C), as received
        for e, rows, n in zip(self.mine, plan.rows_of, self._arrived(routing, plan)):
            if n:                  # an expert no token reached does not run: its gradient stays None, as in one process
                outputs = outputs.index_copy(0, rows, self.experts[str(e)](received[rows]))
        out = combine_padded(outputs, plan, routing, self.group)   # (N, C)
        aux = self.aux_loss_coef * load_balancing_loss(routing) + self.z_loss_coef * z_loss(routing)
        self.aux_loss = aux.detach()
        kept = routing.kept.reshape(-1)
        flat = routing.experts.reshape(-1)
        self.stats = {"tokens_per_expert": torch.bincount(flat, minlength=self.n_expert),
                      "kept_per_expert": torch.bincount(flat[kept], minlength=self.n_expert),
                      "dropped": 1 - kept.float().mean()}
        out = out.view(B, T, C)
        return _AttachAux.apply(out, aux) if self.training else out

    def _arrived(self, routing, plan) -> list[int]:
        """The kept choices each local expert received from all ranks. Dropless: its rows. Padded: every expert
        receives C slots from each rank, padding or not, so the ranks exchange how many were filled (E/ep
        integers to each rank). An expert run on padding alone would get a zero gradient, not None, and AdamW
        would step it (weight decay, moments) where one process leaves it alone."""
        if self.mode == "dropless":
            return [rows.numel() for rows in plan.rows_of]
        ep = dist.get_world_size(self.group)
        filled = torch.bincount(routing.experts[routing.kept], minlength=self.n_expert).view(ep, -1)  # (ep, E/ep)
        return exchange_counts(filled, self.group).sum(0).tolist()             # (E/ep,)


def expert_parallelize(gpt: GPT, group: dist.ProcessGroup | None = None) -> GPT:
    """Replace every ``MoE`` block MLP of ``gpt`` by its ``ExpertParallelMoE`` over ``group`` (in place)."""
    if not gpt.config.n_expert:
        raise ValueError("expert_parallelize: this GPT has no experts; build it with GPTConfig(n_expert=E).")
    for i, block in enumerate(gpt.blocks):
        block.mlp = ExpertParallelMoE(block.mlp, group)
    return gpt


def _is_expert(name: str) -> bool:
    return ".experts." in name


class ExpertParallel:
    """``dtcourse.parity.Parallel`` for expert parallelism: this rank's experts, data parallelism for the rest.

    Each rank trains on its own part of the batch. After backward: every non-expert gradient is averaged
    over the data-parallel group (``dp_group``, default ``group``); an expert's gradient already holds every
    rank's tokens of its ep group, so it is summed over the expert's replicas (dp > ep) and divided by dp.
    ``mesh``: take ``group`` and ``dp_group`` from its ep and dp dimensions.
    """

    def __init__(self, model: GPT, group: dist.ProcessGroup | None,
                 optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                 mesh: Mesh | None = None, dp_group: dist.ProcessGroup | None = None):
        if mesh is not None:
            group, dp_group = mesh.group("ep"), mesh.group("dp")
        self.group, self.dp_group = group, group if dp_group is None else dp_group
        self.replicas = _replica_group(mesh) if mesh is not None and mesh.dims.dp > mesh.dims.ep else None
        self.model = expert_parallelize(model, group)
        self.optimizer = optimizer(self.model.parameters())

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn) -> torch.Tensor:
        out = self.model(x)
        loss_fn(out, y).backward()                                   # the MoE's auxiliary losses included
        dp = dist.get_world_size(self.dp_group)
        shared = [p.grad for n, p in self.model.named_parameters() if not _is_expert(n) and p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in shared])
        dist.all_reduce(flat, group=self.dp_group)                   # sends 2(dp-1)/dp * flat.nbytes per rank
        for g, summed in zip(shared, flat.div_(dp).split([g.numel() for g in shared])):
            g.copy_(summed.view_as(g))
        experts = [p for n, p in self.model.named_parameters() if _is_expert(n)]
        if self.replicas is not None:
            self._sum_replicas(experts)
        for p in experts:
            if p.grad is not None:
                p.grad.div_(dp)
        return out.detach()

    def _sum_replicas(self, experts: list[nn.Parameter]) -> None:
        """Sum each expert's gradient over its replicas, one flat all-reduce. A replica that no token reached
        has None: it sends zeros, and one flag per parameter says whether any replica had a gradient, so an
        expert idle on every replica stays None, as in one process."""
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in experts]
        had = torch.tensor([p.grad is not None for p in experts], dtype=grads[0].dtype)
        flat = torch.cat([g.reshape(-1) for g in grads] + [had])
        dist.all_reduce(flat, group=self.replicas)     # sends 2(r-1)/r * flat.nbytes per rank, r = dp/ep replicas
        summed, any_had = flat[:-len(experts)].split([g.numel() for g in grads]), flat[-len(experts):]
        for p, g, flag in zip(experts, summed, any_had.tolist()):
            p.grad = g.view_as(p).clone() if flag else None

    def _named(self, grads: bool) -> dict[str, torch.Tensor]:
        mine = {n: (p.grad if grads else p).detach() for n, p in self.model.named_parameters()
                if not grads or p.grad is not None}
        experts: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(experts, {n: t for n, t in mine.items() if _is_expert(n)}, group=self.group)
        return {**{n: t for n, t in mine.items() if not _is_expert(n)}, **{n: t for part in experts for n, t in part.items()}}

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return self._named(grads=True)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self._named(grads=False)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


def _replica_group(mesh: Mesh) -> dist.ProcessGroup:
    """The ranks holding the same experts: one per ep group of a dp group (every rank makes every group)."""
    mine = None
    for dp_ranks in mesh.dims.groups("dp"):
        for q in range(mesh.dims.ep):
            ranks = dp_ranks[q::mesh.dims.ep]
            group = dist.new_group(ranks)
            if mesh.rank in ranks:
                mine = group
    return mine
