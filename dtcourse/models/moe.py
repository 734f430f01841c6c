"""A mixture-of-experts MLP: a router picks k of E expert MLPs for each token (an architecture, not a parallelism).

Shazeer et al. 2017 (arXiv 1701.06538) gated the experts; GShard (Lepikhin et al. 2020, arXiv 2006.16668) added
top-2 gating, a capacity per expert and groups of tokens; Switch (Fedus et al. 2021, arXiv 2101.03961) routes each
token to one expert and balances the load with one auxiliary loss; ST-MoE (Zoph et al. 2022, arXiv 2202.08906)
adds the router z-loss. For each token x (one row of ``(N, C)``) the layer computes::

    p = softmax(x W_r)                        # (E,) router probabilities
    experts, gates = top-k of p               # k = 1: the gate is p_e (Switch); k > 1: the k gates renormalised
    y = sum_j gates_j * expert_{e_j}(x)       # over the choices that fit their expert's capacity

**Capacity.** An expert takes at most C = ceil(N k / E * capacity_factor) of a group's N tokens (GShard,
Switch). A token's position in its expert is a cumulative sum over the one-hot choices, first choices of
every token before any second choice; a choice at position >= C is dropped: it adds nothing, and the
block's residual connection carries the token past the layer unchanged. ``capacity_factor=None`` is
dropless (no capacity, as torchtitan and MegaBlocks).

**Groups.** GShard cuts the tokens into G groups and applies the capacity in each. Expert parallelism
routes each rank's own tokens, so a one-process layer with ``groups`` = the number of ranks makes exactly
the same choices and drops: that is how the parity test forces one process to the parallel routing.

**Auxiliary losses**, per group, averaged over the groups: the Switch load-balancing loss
``alpha * E * sum_i f_i P_i`` (f_i: the share of the N k choices that picked expert i; P_i: the mean
router probability of expert i), which is alpha exactly when the probabilities are uniform, and the
z-loss ``beta * mean(logsumexp(x W_r)^2)``, which keeps router logits small. Their gradient reaches the
router through ``_AttachAux`` at the layer's output (Megatron's auto-scaler idea): a plain
``lm_loss(model(x), y).backward()`` trains the balance, with no change to the training loop.
``aux_loss`` holds the last value; ``stats`` the last routing (tokens per expert, dropped share).

Example::

    moe = MoE(d_model=64, n_expert=4, top_k=2, capacity_factor=1.25)
    y = moe(torch.randn(8, 16, 64))           # (B, T, C); moe.stats["dropped"] is the share of choices dropped
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MoE", "Routing", "route", "capacity", "positions_in_expert", "load_balancing_loss", "z_loss",
           "check_moe"]


def check_moe(n_expert: int, top_k: int, capacity_factor: float | None) -> None:
    """Raise a ValueError saying what to change for an impossible MoE configuration."""
    if not isinstance(n_expert, int) or n_expert < 1:
        raise ValueError(f"MoE: n_expert must be a positive integer, got {n_expert!r}.")
    if not isinstance(top_k, int) or not 1 <= top_k <= n_expert:
        raise ValueError(f"MoE: top_k = {top_k} must be between 1 and n_expert = {n_expert}: a token picks "
                         f"k of the E experts; use top_k <= {n_expert} (1 as Switch, 2 as GShard).")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"MoE: capacity_factor = {capacity_factor} must be > 0 (1.0 fits a perfectly balanced "
                         "load, 1.25 is Switch's default), or None for dropless routing.")


def capacity(n_tokens: int, n_expert: int, top_k: int, capacity_factor: float | None) -> int | None:
    """Choices one expert takes from a group: ceil(N k / E * capacity_factor); None when dropless."""
    if capacity_factor is None:
        return None
    return math.ceil(n_tokens * top_k / n_expert * capacity_factor)


def positions_in_expert(experts: torch.Tensor, n_expert: int) -> torch.Tensor:
    """Each choice's 0-based arrival order in its expert, first choices of all tokens before second ones.

    ``experts``: (N, k) expert ids. The one-hot choices, laid out choice-major (k·N, E), are summed
    cumulatively down the tokens: at a choice's own expert the running count, less one, is its position.
    ``positions_in_expert(torch.tensor([[1], [0], [1]]), 2) == [[0], [0], [1]]``.
    """
    N, k = experts.shape
    one_hot = F.one_hot(experts.t().reshape(-1), n_expert)                 # (k·N, E), choice-major
    position = (one_hot.cumsum(dim=0) - 1) * one_hot                      # (k·N, E), the count so far where chosen
    return position.sum(dim=1).view(k, N).t()                              # (N, k)


@dataclass(frozen=True)
class Routing:
    """One group's routing: ``experts``, ``gates``, ``positions``, ``kept`` are (N, k); ``probs`` (N, E)."""

    experts: torch.Tensor       # long: the expert of each choice
    gates: torch.Tensor         # the weight of each choice's output (differentiable)
    positions: torch.Tensor     # long: the choice's slot in its expert
    kept: torch.Tensor          # bool: the choice fits its expert's capacity
    probs: torch.Tensor         # router probabilities (differentiable)
    logits: torch.Tensor        # router logits (differentiable)
    capacity: int | None


def route(logits: torch.Tensor, top_k: int, capacity_factor: float | None) -> Routing:
    """Top-k gating of one group's router logits (N, E), with the capacity applied."""
    N, E = logits.shape
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)                 # (N, E)
    top, experts = probs.topk(top_k, dim=-1)                               # (N, k) each
    gates = top if top_k == 1 else top / top.sum(dim=-1, keepdim=True)     # Switch: p_e; GShard: renormalised
    positions = positions_in_expert(experts, E)                            # (N, k)
    cap = capacity(N, E, top_k, capacity_factor)
    kept = torch.ones_like(positions, dtype=torch.bool) if cap is None else positions < cap
    return Routing(experts, gates, positions, kept, probs, logits, cap)


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """Switch's E * sum_i f_i P_i (Fedus et al., eq. 4): 1 when probabilities or choices are uniform."""
    N, E = routing.probs.shape
    f = torch.bincount(routing.experts.reshape(-1), minlength=E).to(routing.probs.dtype) / routing.experts.numel()
    P = routing.probs.mean(dim=0)                                          # (E,)
    return E * (f * P).sum()


def z_loss(routing: Routing) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al., eq. 5): the mean squared log-partition of the router logits."""
    return torch.logsumexp(routing.logits.float(), dim=-1).square().mean()


class _AttachAux(torch.autograd.Function):
    """Identity on ``y``; in backward it also gives ``aux`` the gradient 1, as if added to the loss."""

    @staticmethod
    def forward(ctx, y, aux):
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


def expert_mlp(d_model: int) -> nn.Sequential:
    """One expert: the dense block's MLP, d -> 4d -> d with GELU (same parameter names)."""
    return nn.Sequential(OrderedDict(c_fc=nn.Linear(d_model, 4 * d_model), gelu=nn.GELU(),
                                     c_proj=nn.Linear(4 * d_model, d_model)))


class MoE(nn.Module):
    """Router, E experts, capacity and the auxiliary losses; ``forward`` maps (B, T, C) to (B, T, C)."""

    def __init__(self, d_model: int, n_expert: int, top_k: int = 1, capacity_factor: float | None = 1.25,
                 aux_loss_coef: float = 0.01, z_loss_coef: float = 1e-3, groups: int = 1):
        super().__init__()
        check_moe(n_expert, top_k, capacity_factor)
        self.n_expert, self.top_k, self.capacity_factor, self.groups = n_expert, top_k, capacity_factor, groups
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.router = nn.Linear(d_model, n_expert, bias=False)
        self.experts = nn.ModuleList(expert_mlp(d_model) for _ in range(n_expert))
        self.aux_loss = torch.zeros(())
        self.stats: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        if B % self.groups:
            raise ValueError(f"MoE: {B} sequences do not cut into groups = {self.groups} equal groups; use a "
                             f"batch that is a multiple of {self.groups}.")
        tokens = x.reshape(self.groups, -1, C)                             # (G, N, C): N = B T / G tokens a group
        out, aux, routings = torch.zeros_like(tokens), [], []
        for g in range(self.groups):
            routing = route(self.router(tokens[g]), self.top_k, self.capacity_factor)
            out[g] = self.combine(tokens[g], routing)
            aux.append(self.aux_loss_coef * load_balancing_loss(routing) + self.z_loss_coef * z_loss(routing))
            routings.append(routing)
        aux_loss = torch.stack(aux).mean()
        self._record(routings, aux_loss)
        return _AttachAux.apply(out.view(B, T, C), aux_loss) if self.training else out.view(B, T, C)

    def combine(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """sum_j gate_j * expert_{e_j}(x) over each token's kept choices (N, C); choice by choice, in order."""
        out = torch.zeros_like(tokens)                                     # (N, C)
        for j in range(self.top_k):
            for e in range(self.n_expert):
                rows = ((routing.experts[:, j] == e) & routing.kept[:, j]).nonzero().squeeze(1)   # (n_e,)
                if rows.numel():
                    y = self.experts[e](tokens[rows])                      # (n_e, C)
                    out = out.index_add(0, rows, y * routing.gates[rows, j, None].to(y.dtype))
        return out

    def _record(self, routings: list[Routing], aux_loss: torch.Tensor) -> None:
        """Keep the last forward's auxiliary loss (a number: the graph is not kept) and its routing."""
        experts = torch.cat([r.experts.reshape(-1) for r in routings])
        kept = torch.cat([r.kept.reshape(-1) for r in routings])
        self.aux_loss = aux_loss.detach()
        self.stats = {"tokens_per_expert": torch.bincount(experts, minlength=self.n_expert),
                      "kept_per_expert": torch.bincount(experts[kept], minlength=self.n_expert),
                      "dropped": 1 - kept.float().mean()}
