"""What one rank holds, by kind, and the ZeRO paper's formula for it.

Rajbhandari et al. (arXiv 1910.02054, Figure 1) count the model states of Ψ parameters on each of
N ranks, with 2-byte (fp16 or bf16) parameters and gradients and K bytes of optimizer state per
parameter (K = 12 for mixed-precision Adam: the fp32 master, m and v):

=======  ==========================  =========================
stage    what is sharded             bytes per rank
=======  ==========================  =========================
0        nothing (data parallel)     (2 + 2 + K) Ψ
1        optimizer states (P_os)     2Ψ + 2Ψ + KΨ/N
2        + gradients (P_os+g)        2Ψ + (2 + K)Ψ/N
3        + parameters (P_os+g+p)     (2 + 2 + K)Ψ/N
=======  ==========================  =========================

``paper_bytes`` is that table. ``ModelStateBytes`` is what a ``ZeRO`` rank really holds, read from
its tensors (``ZeRO.memory()``), padding included: Ψ is then the padded count, a multiple of N per
unit. In fp32 (no separate master) the same table holds with 4-byte parameters and gradients and
K = 8. Example::

    paper_bytes(stage=3, psi=7.5e9, world=64)     # 1.875e9: the paper's 7.5B model on 64 GPUs
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dtcourse.zero.flat import FlatShard

__all__ = ["ModelStateBytes", "paper_bytes", "held_bytes", "STAGES"]

STAGES = (0, 1, 2, 3)


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


def paper_bytes(stage: int, psi: float, world: int, k: float = 12, param_bytes: float = 2,
                grad_bytes: float = 2) -> float:
    """Bytes of model states per rank at ``stage`` for ``psi`` parameters on ``world`` ranks (table above)."""
    if stage not in STAGES:
        raise ValueError(f"paper_bytes: stage must be one of {STAGES}, got {stage!r}.")
    shards = {0: (1, 1, 1), 1: (1, 1, world), 2: (1, world, world), 3: (world, world, world)}[stage]
    return psi * (param_bytes / shards[0] + grad_bytes / shards[1] + k / shards[2])


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
