"""Cut a model into pipeline stages: contiguous runs of layers, as even as the count allows.

GPipe (Huang et al., arXiv 1811.06965) splits a sequence of layers into ``S`` contiguous *stages*, one
after the other on the ranks. With ``p`` ranks and ``v`` chunks per rank (the interleaved schedule of
Megatron-LM's PTD-P paper, Narayanan et al., arXiv 2104.04473) there are ``S = p·v`` stages, and rank
``r`` holds stages ``r, r + p, ..., r + (v-1)p`` (``stages_of_rank``). Example::

    stages = split_gpt(GPT(GPTConfig(n_layer=5)), 2)   # stage 0: embeddings + blocks 0-2; stage 1: blocks 3-4 + head

The GPT itself (``dtcourse.models``) knows nothing about stages: ``GPTStage`` holds *references* to its
modules (the same parameters, not copies) and is the only place that knows where the pipeline cuts.
The first stage takes token ids (B, T) and owns the embeddings; the last owns ``ln_f`` and ``lm_head``
and returns logits (B, T, vocab); every stage in between maps activations (B, T, d_model) to the same.
A stage's parameters keep the GPT's names (``blocks.3.attn.c_attn.weight``), so gradients and
parameters gathered from every stage line up with the one-process model's, name by name.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from dtcourse.models import GPT

__all__ = ["balanced_partition", "stages_of_rank", "rank_of_stage", "GPTStage", "split_gpt", "gpt_boundary_shape"]


def balanced_partition(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` layer ranges, one per stage, whose sizes differ by at most one layer.

    The first ``n_layers % n_stages`` stages take the extra layer: ``balanced_partition(5, 2) ==
    [(0, 3), (3, 5)]``. A stage with no layer would be a pipeline step that only forwards its input, so
    more stages than layers is refused.
    """
    if not isinstance(n_stages, int) or n_stages < 1 or not isinstance(n_layers, int) or n_layers < 0:
        raise ValueError(f"balanced_partition: n_layers must be an integer >= 0 and n_stages >= 1, "
                         f"got n_layers={n_layers!r}, n_stages={n_stages!r}.")
    if n_stages > n_layers:
        raise ValueError(f"balanced_partition: {n_stages} stages cannot each hold one of {n_layers} layers; "
                         f"use at most {n_layers} stages (fewer ranks or fewer chunks per rank, since stages = "
                         f"ranks x chunks), or a model with at least {n_stages} layers.")
    size, extra = divmod(n_layers, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + size + (s < extra))
    return list(zip(bounds[:-1], bounds[1:]))


def stages_of_rank(rank: int, n_ranks: int, chunks: int = 1) -> list[int]:
    """The stages rank ``rank`` holds when ``n_ranks`` ranks hold ``chunks`` stages each: r, r + p, ..."""
    return [rank + c * n_ranks for c in range(chunks)]


def rank_of_stage(stage: int, n_ranks: int) -> int:
    """Which rank holds ``stage``: the inverse of ``stages_of_rank``."""
    return stage % n_ranks


class GPTStage(nn.Module):
    """Blocks ``[start, end)`` of a GPT, with the embeddings if ``first`` and ``ln_f`` + ``lm_head`` if ``last``.

    ``forward`` maps token ids (B, T) (first stage) or activations (B, T, d_model) to activations
    (B, T, d_model), or to logits (B, T, vocab_size) on the last stage. The modules are the GPT's own.
    """

    def __init__(self, model: GPT, start: int, end: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last, self.layers = first, last, (start, end)
        self.block_size = model.config.block_size        # (read here: a tensor-parallel wpe is a PositionShard)
        if first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        # keyed by the GPT's block index, so parameter names stay the GPT's: "blocks.3...."
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(start, end)})
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:                                               # x: token ids (B, T)
            if x.shape[1] > self.block_size:
                raise ValueError(f"GPTStage: sequence length {x.shape[1]} exceeds block_size "
                                 f"{self.block_size}; use shorter sequences or a larger block_size.")
            pos = torch.arange(x.shape[1], device=x.device)          # (T,)
            x = self.drop(self.wte(x) + self.wpe(pos))               # (B, T, C)
        for block in self.blocks.values():
            x = block(x)                                             # (B, T, C)
        return self.lm_head(self.ln_f(x)) if self.last else x        # (B, T, vocab) or (B, T, C)

    def extra_repr(self) -> str:
        parts = ["embeddings"] * self.first + [f"blocks {self.layers[0]}-{self.layers[1] - 1}"] * bool(self.blocks)
        return ", ".join(parts + ["ln_f, lm_head"] * self.last)


def split_gpt(model: GPT, n_stages: int) -> list[GPTStage]:
    """All ``n_stages`` stages of ``model``, its blocks cut by ``balanced_partition``; a rank keeps its own.

    ``split_gpt(model, p * v)[s]`` for ``s in stages_of_rank(rank, p, v)`` are rank ``rank``'s stages.
    """
    ranges = balanced_partition(len(model.blocks), n_stages)
    return [GPTStage(model, start, end, s == 0, s == n_stages - 1) for s, (start, end) in enumerate(ranges)]


def gpt_boundary_shape(model: GPT):
    """``(stage, token ids of a micro-batch) -> shape`` of what that stage (not the first) takes: (B, T, d_model).

    The executor sizes its receive buffers with it and checks every sent activation against it.
    """
    d_model = model.config.d_model
    return lambda stage, idx: (*idx.shape, d_model)                  # (B, T) -> (B, T, C)
