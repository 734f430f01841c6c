"""Megatron's tensor-parallel layers, each cut from an already-initialised full layer.

Shoeybi et al., arXiv 1909.08053, section 3: a ``ColumnParallelLinear`` splits ``Y = X A`` by
columns of ``A`` (rows of ``nn.Linear.weight``), so each rank computes its slice of ``Y`` from the
whole ``X``; a ``RowParallelLinear`` splits ``A`` by rows, so each rank computes a partial sum of
``Y`` from its slice of ``X``. A column layer followed by a row layer (the MLP, or attention with
its heads split) needs one all-reduce forward (``g``) and one backward (``f``). The embedding and
the LM head are split along the vocabulary, and so is the loss (``vocab_parallel_cross_entropy``):
the full logits never exist on one rank.

Every layer is built from the full serial layer (``ColumnParallelLinear(full_linear, group)``), so
the parallel model starts where the serial one does. A parameter that is split carries
``tp_dim`` and ``tp_parts`` (see ``gather_shards``); one that is replicated but sees only a
sequence shard under sequence parallelism carries ``sequence_parallel = True``. Example::

    fc = ColumnParallelLinear(mlp.c_fc, group); proj = RowParallelLinear(mlp.c_proj, group)
    y = proj(F.gelu(fc(x)))          # == mlp.c_proj(F.gelu(mlp.c_fc(x))), on every rank
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtcourse.tensor_parallel.communications import (
    copy_to_tensor_parallel, gather_from_sequence_parallel, reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel)

__all__ = ["check_divides", "check_ids", "shard_of", "gather_shards", "full_of", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]


def check_divides(t: int, size: int, what: str) -> None:
    """Raise a ValueError naming the sizes that would fit unless ``t`` divides ``size``."""
    if size % t:
        sizes = [d for d in range(1, size + 1) if size % d == 0 and d <= 16]
        raise ValueError(f"tensor-parallel size {t} does not divide {what} {size}; use a tensor-parallel "
                         f"size among {sizes}, or a {what} that is a multiple of {t}.")


def shard_of(full: torch.Tensor, dim: int, rank: int, t: int, parts: int = 1) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` along ``dim``; with ``parts`` > 1 (q, k, v side by side), the
    rank's slice of each part, kept side by side."""
    split = full.unflatten(dim, (parts, -1))                     # (..., parts, n/parts, ...)
    return split.chunk(t, dim=dim + 1)[rank].flatten(dim, dim + 1).clone()   # (..., n/t, ...)


def gather_shards(shard: torch.Tensor, dim: int, parts: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The full tensor from every rank's ``shard_of``: the inverse of ``shard_of``."""
    shards = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, shard.detach().contiguous(), group=group)   # sends (t-1)/t of the full tensor
    split = [s.unflatten(dim, (parts, -1)) for s in shards]      # t x (..., parts, n/(t parts), ...)
    return torch.cat(split, dim=dim + 1).flatten(dim, dim + 1)


def full_of(p: nn.Parameter, value: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The full tensor of ``value`` (the parameter ``p`` itself, or its gradient): gathered over ``group`` if ``p``
    is a shard of a split layer (``p.tp_dim``), else as it is."""
    if hasattr(p, "tp_dim"):
        return gather_shards(value, p.tp_dim, p.tp_parts, group)
    return value.detach()


def _split_parameter(full: torch.Tensor, dim: int, rank: int, t: int, parts: int = 1) -> nn.Parameter:
    p = nn.Parameter(shard_of(full.detach(), dim, rank, t, parts))
    p.tp_dim, p.tp_parts = dim, parts
    return p


def _replicated(full: torch.Tensor, sequence_parallel: bool) -> nn.Parameter:
    p = nn.Parameter(full.detach().clone())
    p.sequence_parallel = sequence_parallel        # its gradient is partial: all-reduce it (Korthikanti 4.2.2)
    return p


class ColumnParallelLinear(nn.Module):
    """``Y_i = X A_i``: this rank's ``out_features / t`` outputs from the whole input.

    ``parts``: the output is ``parts`` blocks side by side (``c_attn``'s q, k, v), each split by heads.
    Before the matmul: ``f`` (identity forward, all-reduce backward), or under sequence parallelism an
    all-gather of the sequence shards (reduce-scatter backward). The output stays split.
    """

    def __init__(self, full: nn.Linear, group: dist.ProcessGroup | None, *, parts: int = 1,
                 sequence_parallel: bool = False):
        super().__init__()
        t, rank = dist.get_world_size(group), dist.get_rank(group)
        check_divides(t, full.out_features // parts, "hidden size")   # each of the parts is split t ways
        self.group, self.sequence_parallel = group, sequence_parallel
        self.in_features, self.out_features = full.in_features, full.out_features // t
        self.weight = _split_parameter(full.weight, 0, rank, t, parts)                       # (out/t, in)
        self.bias = None if full.bias is None else _split_parameter(full.bias, 0, rank, t, parts)  # (out/t,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel(x, self.group)   # (B, T/t, C) -> (B, T, C)
        else:
            x = copy_to_tensor_parallel(x, self.group)
        return F.linear(x, self.weight, self.bias)                # (B, T, out/t)


class RowParallelLinear(nn.Module):
    """``Y = sum_i X_i A_i``: this rank's ``in_features / t`` inputs give a partial sum of every output.

    After the matmul: ``g`` (all-reduce forward, identity backward), or under sequence parallelism a
    reduce-scatter to sequence shards (all-gather backward). The bias is added once, after the sum.
    """

    def __init__(self, full: nn.Linear, group: dist.ProcessGroup | None, *, sequence_parallel: bool = False):
        super().__init__()
        t, rank = dist.get_world_size(group), dist.get_rank(group)
        check_divides(t, full.in_features, "hidden size")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.in_features, self.out_features = full.in_features // t, full.out_features
        self.weight = _split_parameter(full.weight, 1, rank, t)                 # (out, in/t)
        self.bias = None if full.bias is None else _replicated(full.bias, sequence_parallel)   # (out,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)                              # (B, T, out): a partial sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel(y, self.group)   # (B, T/t, out)
        else:
            y = reduce_from_tensor_parallel(y, self.group)           # (B, T, out)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows ``[rank V/t, (rank+1) V/t)`` of the embedding: ids outside them look up zeros, and the sum over
    ranks (``g``, or a reduce-scatter to sequence shards under sequence parallelism) is the full lookup.
    An id outside ``[0, V)`` raises an IndexError, as ``nn.Embedding`` does."""

    def __init__(self, full: nn.Embedding, group: dist.ProcessGroup | None, *, sequence_parallel: bool = False):
        super().__init__()
        t, rank = dist.get_world_size(group), dist.get_rank(group)
        check_divides(t, full.num_embeddings, "vocabulary size")
        self.group, self.sequence_parallel = group, sequence_parallel
        per_rank = full.num_embeddings // t
        self.num_embeddings = full.num_embeddings
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        self.weight = _split_parameter(full.weight, 0, rank, t)      # (V/t, C)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # An id outside [0, V) would look up zeros on every rank and sum to a zero vector: raise as nn.Embedding
        # does. Every rank holds the same ids, so every rank raises, before any collective.
        check_ids(idx, self.num_embeddings, "token id", "the embedding")
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)             # (B, T)
        local = (idx - self.vocab_start).masked_fill(outside, 0)                 # (B, T), in [0, V/t)
        x = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)   # (B, T, C), zero outside
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(x, self.group)   # (B, T/t, C)
        return reduce_from_tensor_parallel(x, self.group)               # (B, T, C)


class _AllReduceMax(torch.autograd.Function):
    """The largest logit over every rank's vocabulary slice; no gradient flows through it (the loss does
    not depend on it: it is subtracted from every logit and added back)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)      # sends 2(t-1)/t * x.nbytes per rank
        return x

    @staticmethod
    def backward(ctx, grad):
        return None, None


def check_ids(ids: torch.Tensor, V: int, what: str, where: str, ignore_index: int | None = None) -> None:
    """Raise an IndexError, as ``nn.Embedding`` and ``F.cross_entropy`` do, if an id (other than
    ``ignore_index``) is outside ``[0, V)``; the message names the first such id and what to change."""
    bad = (ids < 0) | (ids >= V)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if bad.any():
        first = ids[bad][0].item()
        skip = "" if ignore_index is None else f" (or {ignore_index}, the ignore_index, to leave a position out)"
        raise IndexError(f"{what} {first} is out of range for {where} of vocabulary size {V}: every {what} must "
                         f"be in [0, {V - 1}]{skip}; check the tokenizer's vocabulary against GPTConfig.vocab_size.")


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 group: dist.ProcessGroup | None, ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy from this rank's logits ``(..., V/t)`` over ids ``[vocab_start, vocab_start + V/t)``.

    Three all-reduces of one number per token (Shoeybi et al., section 3): the max (for stability), the sum
    of exponentials, and the target's logit (zero on every rank but the one that holds it). ``g``'s identity
    backward is right for the two sums: every rank computes the same loss from them. A target equal to
    ``ignore_index`` (padding; -100 as in ``F.cross_entropy``) has loss 0 and no gradient; any other target
    outside ``[0, V)`` raises an IndexError, on every rank alike, before any collective.
    """
    V_t = logits.shape[-1]
    check_ids(targets, V_t * dist.get_world_size(group), "target", "the loss", ignore_index)
    ignored = targets == ignore_index                                                # (...,)
    m = _AllReduceMax.apply(logits.detach().amax(dim=-1), group)       # (...,)
    shifted = logits - m.unsqueeze(-1)                                                # (..., V/t)
    sum_exp = reduce_from_tensor_parallel(shifted.exp().sum(dim=-1), group)   # (...,)
    outside = (targets < vocab_start) | (targets >= vocab_start + V_t)                # (...,): ignored ones too
    local = (targets - vocab_start).masked_fill(outside, 0)
    mine = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)   # (...,)
    target_logit = reduce_from_tensor_parallel(mine, group)           # (...,)
    return (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)                   # (...,): 0 where ignored
