"""``parallelize``: a plain ``dtcourse.models.GPT`` turned into its tensor-parallel form, in place.

Megatron's layout (Shoeybi et al., arXiv 1909.08053, section 3), applied in a fixed order:

1. embeddings: ``wte`` vocab-parallel (``g`` sums the ranks' lookups); ``wpe`` replicated;
2. every block: attention's ``c_attn`` column-parallel with q, k and v each split by heads (rank r keeps
   heads ``[r nh/t, (r+1) nh/t)``, so attention needs no communication), ``c_proj`` row-parallel; the MLP's
   ``c_fc`` column-parallel, ``c_proj`` row-parallel: one all-reduce forward and one backward each;
3. the LM head column-parallel along the vocabulary, its logits left split for
   ``vocab_parallel_lm_loss``: the full (B, T, V) logits never exist on one rank.

With ``sequence_parallel=True`` (Korthikanti et al., arXiv 2205.05198, section 4.2.2) the LayerNorms, the
dropouts and the residual stream hold ``T/t`` positions per rank: an all-gather before each column layer,
a reduce-scatter after each row layer and after the embedding, the same bytes as the all-reduces. The
LayerNorm weights, the row layers' biases and ``wpe`` are replicated but each rank sees only its positions,
so their gradients are partial sums. The model ``parallelize`` returns sums them over the group at the end of
every backward by itself (``SequenceParallelGrads``, a hook; Megatron's training loop does the same for its
users); ``all_reduce_sequence_parallel_grads`` does it once, for layers assembled by hand.

**Dropout.** A dropout on a replicated tensor must drop the same elements on every rank, and one on a
shard (attention's heads; under SP the sequence) must drop that shard's part of one mask. ``ShardedDropout``
draws the full layer's mask from the generator, which every rank keeps in the same state, and keeps its
slice: the masks are the serial model's, bit for bit (on the CPU, where ``F.dropout`` draws with
``bernoulli_``), at the cost of t times the random numbers. Megatron instead draws a shard's mask from a
per-rank stream (its ``model-parallel-rng`` tracker): cheaper, equal only in distribution.

``mesh``: a ``dtcourse.mesh.Mesh`` whose ``tp`` group to use, for TP inside a DP × PP × TP grid.

Example, on every rank of ``group``::

    tp = TensorParallel(GPT(cfg, seed=0), group, lambda ps: torch.optim.AdamW(ps), sequence_parallel=True)
    logits = tp.forward_backward(idx, targets, lm_loss); tp.step()
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtcourse.mesh import Mesh
from dtcourse.models import GPT, lm_loss
from dtcourse.tensor_parallel.layers import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, _replicated, check_divides, full_of,
    gather_shards, vocab_parallel_cross_entropy)

__all__ = ["parallelize", "vocab_parallel_lm_loss", "all_reduce_sequence_parallel_grads", "TensorParallel",
           "SequenceParallelGrads", "sequence_parallel_parameters", "PositionShard", "ShardedDropout",
           "tensor_parallel_group"]


class PositionShard(nn.Module):
    """Sequence parallelism's position embedding: this rank's ``T/t`` rows of the full, replicated table."""

    def __init__(self, full: nn.Embedding, group: dist.ProcessGroup | None):
        super().__init__()
        self.group = group
        self.weight = _replicated(full.weight, sequence_parallel=True)     # (block_size, C)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        t, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if pos.shape[0] % t:
            raise ValueError(f"sequence parallelism splits the sequence of length {pos.shape[0]} over {t} ranks; "
                             f"use a sequence length divisible by {t}.")
        return F.embedding(pos.chunk(t)[rank], self.weight)               # (T/t, C)


class ShardedDropout(nn.Module):
    """Dropout on this rank's slice (along ``dim``) of a tensor t times larger: the full mask, then the slice.

    Every rank draws the same full mask, since every rank's generator is in the same state, so the ranks'
    slices tile the serial layer's mask. Example: attention's (B, nh/t, T, T) probabilities, ``dim=1``.
    """

    def __init__(self, p: float, dim: int, group: dist.ProcessGroup | None):
        super().__init__()
        self.p, self.dim, self.group = p, dim, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        t, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        full = list(x.shape)
        full[self.dim] *= t
        noise = torch.empty(full, dtype=x.dtype, device=x.device).bernoulli_(1 - self.p)   # as F.dropout draws
        noise.div_(1 - self.p)
        mine = noise.chunk(t, dim=self.dim)[rank].clone()        # a copy: keep 1/t of the mask, not all of it
        return x * mine

    def extra_repr(self) -> str:
        return f"p={self.p}, dim={self.dim}"


def _shard_dropout(parent: nn.Module, name: str, dim: int, group: dist.ProcessGroup | None) -> None:
    drop = getattr(parent, name)
    if isinstance(drop, nn.Dropout):                      # GPTConfig(dropout=0) builds an Identity: nothing to do
        setattr(parent, name, ShardedDropout(drop.p, dim, group))


def tensor_parallel_group(group: dist.ProcessGroup | None = None, mesh: Mesh | None = None) -> dist.ProcessGroup | None:
    """``group``, or ``mesh``'s tensor-parallel group; both given, they must be the same ranks."""
    if mesh is None:
        return group
    if group is not None:
        given, want = dist.get_process_group_ranks(group), mesh.ranks["tp"]
        if given != want:
            raise ValueError(f"group holds ranks {given}, but this rank's tensor-parallel group in the mesh "
                             f"({mesh.dims}) is {want}: pass group=mesh.group('tp'), or only mesh=.")
    return mesh.group("tp")


def parallelize(gpt: GPT, group: dist.ProcessGroup | None = None, sequence_parallel: bool = False,
                mesh: Mesh | None = None) -> GPT:
    """Replace ``gpt``'s layers by their tensor-parallel shards (in place; returns ``gpt``).

    Every rank of ``group`` (or of ``mesh``'s tp group) must call it on the same full model (built from one
    seed).
    """
    group = tensor_parallel_group(group, mesh)
    cfg, t = gpt.config, dist.get_world_size(group)
    check_divides(t, cfg.n_head, "number of heads")
    check_divides(t, 4 * cfg.d_model, "hidden size")
    check_divides(t, cfg.vocab_size, "vocabulary size")
    sp = dict(sequence_parallel=sequence_parallel)
    # 1. embeddings
    gpt.wte = VocabParallelEmbedding(gpt.wte, group, **sp)
    if sequence_parallel:
        gpt.wpe = PositionShard(gpt.wpe, group)
        _shard_dropout(gpt, "drop", 1, group)                # (B, T/t, C): this rank's positions
    # 2. blocks: heads split, MLP column then row
    for i, block in enumerate(gpt.blocks):
        attn, mlp = block.attn, block.mlp
        attn.c_attn = ColumnParallelLinear(attn.c_attn, group, parts=3, **sp)   # q, k, v by heads
        attn.c_proj = RowParallelLinear(attn.c_proj, group, **sp)
        attn.n_head = cfg.n_head // t                      # core() sees this rank's heads only
        _shard_dropout(attn, "attn_drop", 1, group)         # (B, nh/t, T, T): this rank's heads
        if sequence_parallel:                               # the residual stream's dropouts: (B, T/t, C)
            _shard_dropout(attn, "resid_drop", 1, group)
            _shard_dropout(mlp, "drop", 1, group)
        mlp.c_fc = ColumnParallelLinear(mlp.c_fc, group, **sp)
        mlp.c_proj = RowParallelLinear(mlp.c_proj, group, **sp)
        for ln in (block.ln_1, block.ln_2):
            _mark_sequence_parallel(ln, sequence_parallel)
    # 3. the head, split along the vocabulary
    _mark_sequence_parallel(gpt.ln_f, sequence_parallel)
    gpt.lm_head = ColumnParallelLinear(gpt.lm_head, group, **sp)
    # 4. under SP: the replicated parameters' partial gradients summed at the end of every backward
    if sequence_parallel:
        gpt.sequence_parallel_grads = SequenceParallelGrads(gpt, group)
    return gpt


def _mark_sequence_parallel(module: nn.Module, sequence_parallel: bool) -> None:
    for p in module.parameters():
        p.sequence_parallel = sequence_parallel


def vocab_parallel_lm_loss(logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None,
                           ignore_index: int = -100) -> torch.Tensor:
    """``lm_loss`` from this rank's logits (B, T, V/t): ``vocab_parallel_cross_entropy`` averaged over the
    targets that are not ``ignore_index``, as ``F.cross_entropy`` averages (NaN when every target is ignored)."""
    vocab_start = dist.get_rank(group) * logits.shape[-1]
    losses = vocab_parallel_cross_entropy(logits, targets, vocab_start, group, ignore_index=ignore_index)
    return losses.sum() / (targets != ignore_index).sum().to(losses.dtype)


def sequence_parallel_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The replicated parameters that see only this rank's positions under SP (``p.sequence_parallel``)."""
    return [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]


def _sum_over_group(grads: list[torch.Tensor], group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """One all-reduce of the flattened ``grads``; the sums, shaped as ``grads``."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)                  # sends 2(t-1)/t * flat.nbytes per rank
    return [summed.view_as(g) for g, summed in zip(grads, flat.split([g.numel() for g in grads]))]


def all_reduce_sequence_parallel_grads(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Sum, over the group, the gradients of the replicated parameters that saw only a sequence shard.

    Megatron's ``allreduce_layernorm_grads``, for layers assembled by hand: forgetting it leaves each rank
    with its own LayerNorm weights, a silent divergence. One all-reduce of the flattened gradients. A model
    from ``parallelize(..., sequence_parallel=True)`` does this itself after every backward: summing again
    would multiply the gradients by t, so it is refused.
    """
    if isinstance(getattr(model, "sequence_parallel_grads", None), SequenceParallelGrads):
        raise ValueError("this model comes from parallelize(..., sequence_parallel=True), which already sums the "
                         "sequence-parallel gradients at the end of every backward; calling "
                         "all_reduce_sequence_parallel_grads again would add every rank's sum t times. Drop the call.")
    grads = [p.grad for p in sequence_parallel_parameters(model) if p.grad is not None]
    if grads:
        for g, summed in zip(grads, _sum_over_group(grads, group)):
            g.copy_(summed)


class SequenceParallelGrads:
    """Sums the sequence-parallel parameters' partial gradients over ``group`` at the end of every backward.

    A hook on each such parameter takes the gradient this backward brings before it is accumulated, keeps it
    and lets a zero through instead; the first hook of a backward queues ``_sum`` to run when the backward
    ends (as DDP and FSDP queue their last reduction). ``_sum`` all-reduces what was kept, in one flat
    tensor, and adds the sums to ``p.grad``. Adding only this backward's share keeps gradient accumulation
    right: several backwards before a step sum each micro-batch's partial gradients once (one all-reduce per
    backward; Megatron instead sums once per step, after the last micro-batch).
    """

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None):
        self.group = group
        self.params = sequence_parallel_parameters(model)
        self.pending: dict[int, torch.Tensor] = {}           # index in params -> this backward's partial gradient
        for i, p in enumerate(self.params):
            p.register_hook(partial(self._keep, i))

    def _keep(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        if not self.pending:
            torch.autograd.Variable._execution_engine.queue_callback(self._sum)
        self.pending[i] = grad
        return torch.zeros_like(grad)                        # accumulated now; the sum is added in _sum

    def _sum(self) -> None:
        # every rank runs the same graph, so every rank keeps the same parameters' gradients: one all-reduce
        mine = [self.pending.get(i, torch.zeros_like(p)) for i, p in enumerate(self.params)]
        for i, summed in enumerate(_sum_over_group(mine, self.group)):
            if i in self.pending:
                self.params[i].grad.add_(summed)
        self.pending.clear()


class TensorParallel:
    """``dtcourse.parity.Parallel`` for ``parallelize``: every rank trains on the whole batch.

    ``forward_backward`` replaces ``lm_loss`` by ``vocab_parallel_lm_loss``; it returns the full logits,
    gathered (detached) only so the parity harness can compare them.
    """

    def __init__(self, model: GPT, group: dist.ProcessGroup | None,
                 optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                 sequence_parallel: bool = False, mesh: Mesh | None = None):
        self.group = tensor_parallel_group(group, mesh)
        self.model = parallelize(model, self.group, sequence_parallel)
        self.optimizer = optimizer(self.model.parameters())   # this rank's shards: AdamW is elementwise

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn=lm_loss) -> torch.Tensor:
        if loss_fn is not lm_loss:
            raise ValueError("TensorParallel trains with lm_loss (computed vocab-parallel); got another loss_fn.")
        logits = self.model(x)                                                  # (B, T, V/t)
        vocab_parallel_lm_loss(logits, y, self.group).backward()   # under SP, sums its partial grads
        return gather_shards(logits.detach(), logits.dim() - 1, 1, self.group)  # (B, T, V), for the check only

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return {n: full_of(p, p.grad, self.group) for n, p in self.model.named_parameters() if p.grad is not None}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: full_of(p, p, self.group) for n, p in self.model.named_parameters()}

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
