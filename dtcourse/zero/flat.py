"""One unit's parameters as one flat vector, padded and cut into N equal parts: ZeRO's partition.

ZeRO (Rajbhandari et al., arXiv 1910.02054) gives rank r one N-th of every model state. The layout
that makes this simple is FSDP's flat parameter (Zhao et al., arXiv 2304.11277): the parameters
of a unit lie end to end in one vector of Ψ_u elements, padded with zeros up to the next multiple
of N, so that rank r owns elements [r·s, (r+1)·s), s = ceil(Ψ_u / N)::

    full  (N·s,)   | weight (10×6) | bias (10) |pad|     every parameter is a view into full
                   |<-- rank 0 -->|<-- rank 1 -->|<-- rank 2 -->|
    shard (s,)     this rank's part: the parameters it keeps (stage 3) and the ones it steps

Each ``nn.Parameter`` keeps its identity (its name, its hooks, the model's code are untouched);
only its ``.data`` changes: a view into ``full`` while the unit is gathered, an empty tensor
while it is not. Freeing ``full`` resizes its storage to 0 bytes instead of dropping it: autograd
may have saved a view of a weight for backward (``Linear`` saves ``weight.t()``), and that view
keeps the storage object alive. Resized to 0 it holds no memory; the next all-gather fills the
same storage again, and the saved view reads the gathered values.

``FlatShard`` is the same in every stage; the stage decides which of its tensors stay allocated
(``keep_full``) and which collectives fill them. Example::

    flat = FlatShard(["net.0.weight", "net.0.bias"], params, parts=3, rank=1, dtype=torch.float32,
                     keep_full=False)          # stage 3: only shard (s,) is kept; full is 0 bytes
"""

from __future__ import annotations

import torch
import torch.nn as nn


__all__ = ["FlatShard"]


class FlatShard:
    """The flat, padded vector of some parameters (all trainable or all frozen) and this rank's part of it.

    names, params: the parameters, in order; each ``params[i]`` is ``names[i]`` in the plain model.
    parts, rank: the vector is padded to a multiple of ``parts`` (N) and this rank owns part ``rank``;
        ``rank=None`` owns the whole vector (stage 0: nothing is sharded).
    dtype: the dtype forward and backward run in (``full`` and ``shard``); fp32 masters are kept apart.
    keep_full: keep ``full`` allocated for the whole run (stages 0-2) or only while gathered (stage 3).
    """

    def __init__(self, names: list[str], params: list[nn.Parameter], parts: int, rank: int | None,
                 dtype: torch.dtype, keep_full: bool):
        self.names, self.params = names, params
        self.shapes = [p.shape for p in params]
        self.spans, lo = [], 0
        for p in params:
            self.spans.append((lo, lo + p.numel()))
            lo += p.numel()
        self.numel = lo                                           # Ψ_u, without padding
        self.size = -(-self.numel // parts)                       # s = ceil(Ψ_u / N)
        self.padded = parts * self.size                           # N·s
        self.owned = (0, self.padded) if rank is None else (rank * self.size, (rank + 1) * self.size)
        self.trainable = params[0].requires_grad
        self.keep_full = keep_full
        device = params[0].device
        exact = torch.zeros(self.padded, dtype=params[0].dtype, device=device)   # (N·s,) original dtype
        for p, (lo, hi) in zip(params, self.spans):
            exact[lo:hi].copy_(p.detach().reshape(-1))
        self.full = exact.to(dtype, copy=True)                    # (N·s,) compute dtype
        lo, hi = self.owned
        # this rank's part: a view of full when full stays, else a tensor of its own
        self.shard = self.full[lo:hi] if keep_full else self.full[lo:hi].clone()
        # fp32 master of this rank's part, for the optimizer; the part itself when it is already fp32
        self.master: nn.Parameter | None = None
        if self.trainable:
            self.master = nn.Parameter(self.shard if dtype == exact.dtype else exact[lo:hi].clone())
        self.grad: torch.Tensor | None = None                     # the reduced gradient of the part (set by ZeRO)
        self.grad_full: torch.Tensor | None = None                # stages 0-1: autograd accumulates into it
        self.unreduced: torch.Tensor | None = None                # stages 2-3 under no_sync(): (N·s,) summed
        self.ready = 0                                            # parameters whose gradient arrived this backward
        self._empty = torch.empty(0, dtype=dtype, device=device)
        if keep_full:
            self.use_views()
        else:
            self.free()

    @property
    def gathered(self) -> bool:
        """Does ``full`` hold memory now (always, in stages 0-2)?"""
        return self.full.untyped_storage().nbytes() > 0

    def allocate(self) -> None:
        """Give ``full``'s storage its memory back (unfilled): an all-gather writes it next."""
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())

    def use_views(self) -> None:
        """Point every parameter at its slice of ``full`` (which must be filled)."""
        for p, shape, (lo, hi) in zip(self.params, self.shapes, self.spans):
            p.data = self.full[lo:hi].view(shape)

    def free(self) -> None:
        """Release ``full``'s memory; the parameters become empty tensors until the next gather."""
        for p in self.params:
            p.data = self._empty
        self.full.untyped_storage().resize_(0)

    def attach_grad_views(self) -> None:
        """Stages 0-1: each ``p.grad`` is a view into ``grad_full``, so autograd adds straight into it."""
        for p, shape, (lo, hi) in zip(self.params, self.shapes, self.spans):
            view = self.grad_full[lo:hi].view(shape)
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view

    def gradient_bucket(self, dtype: torch.dtype) -> torch.Tensor:
        """Stages 2-3: a new (N·s,) vector of this rank's gradients in ``dtype``, zero in the padding.

        Moves each ``p.grad`` into it and drops the ``p.grad``: after this, the unit's gradients
        exist only here, until the reduce-scatter has read them.
        """
        bucket = torch.zeros(self.padded, dtype=dtype, device=self._empty.device)   # (N·s,)
        for p, (lo, hi) in zip(self.params, self.spans):
            if p.grad is not None:
                bucket[lo:hi].copy_(p.grad.reshape(-1))
            p.grad = None
        return bucket

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parameters' tensors, by name, as views of a whole (N·s,) vector laid out like ``full``."""
        return {n: flat[lo:hi].view(shape) for n, shape, (lo, hi) in zip(self.names, self.shapes, self.spans)}

    def padding_in(self, lo: int, hi: int) -> int:
        """How many of the elements [lo, hi) of the padded vector are padding."""
        return max(0, hi - max(lo, self.numel))
