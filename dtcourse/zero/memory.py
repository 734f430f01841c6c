"""What one rank holds, by kind: ``ModelStateBytes``, read from a ``ZeRO`` rank's tensors
(``ZeRO.memory()``, ``held_bytes``), padding included. The ZeRO paper's formula for the same bytes,
``paper_bytes``, is in ``cost.py`` (imported here too); with padding, Ψ there is the padded count, a
multiple of N per unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dtcourse.zero.cost import STAGES, paper_bytes

if TYPE_CHECKING:
    from dtcourse.zero.flat import FlatShard

__all__ = ["ModelStateBytes", "paper_bytes", "held_bytes", "STAGES"]



@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes one rank holds, by kind (``ZeRO.memory()``).

    parameters: the parameters kept for the whole run, in the compute dtype (full in stages 0-2,
        this rank's part in stage 3).
    gradients: the gradients kept for the whole run (full in stages 0-1, this rank's part after).
    optimizer_states: the optimizer's tensors (Adam's m, v and step) and, when parameters are
        16-bit, the fp32 master of this rank's part: ZeRO's K.
    gathered: the most bytes of gathered units held at once since ``reset_peaks`` (stage 3 only;
        the all-gather buffers a unit lives in while it computes).
    buckets: the most bytes of full-size gradient buckets held at once since ``reset_peaks``
        (stages 2-3: one unit's gradients between backward and their reduce-scatter).
    padding: how many of the bytes in ``parameters``, ``gradients`` and ``optimizer_states`` are padding.
    """

    parameters: int
    gradients: int
    optimizer_states: int
    gathered: int
    buckets: int
    padding: int

    @property
    def model_states(self) -> int:
        """What the paper's table counts: parameters + gradients + optimizer states."""
        return self.parameters + self.gradients + self.optimizer_states


def held_bytes(flats: list[FlatShard], stage: int, optimizer: torch.optim.Optimizer,
               peaks: dict[str, int]) -> ModelStateBytes:
    """Read a rank's ``ModelStateBytes`` from its flat shards and optimizer, with the peaks ZeRO counted."""
    params = grads = states = padding = 0
    for flat in flats:
        pad_full, pad_own = flat.padded - flat.numel, flat.padding_in(*flat.owned)   # elements
        kept, pad = (flat.full.numel(), pad_full) if stage < 3 else (flat.shard.numel(), pad_own)
        params += kept * flat.shard.element_size()
        padding += pad * flat.shard.element_size()
        if not flat.trainable:
            continue
        in_full = flat.grad_full is not None and flat.grad._base is flat.grad_full   # a view: counted once
        for t, pad in [(flat.grad_full, pad_full), (None if in_full else flat.grad, pad_own)]:
            if t is not None:
                grads, padding = grads + t.nbytes, padding + pad * t.element_size()
        separate = [] if flat.master.data_ptr() == flat.shard.data_ptr() else [flat.master]   # 16-bit params
        for t in separate + [t for t in optimizer.state[flat.master].values() if isinstance(t, torch.Tensor)]:
            states += t.nbytes
            padding += (pad_own if t.numel() == flat.master.numel() else 0) * t.element_size()
    return ModelStateBytes(params, grads, states, peaks["gathered"], peaks["buckets"], padding)
