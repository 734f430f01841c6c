"""ZeRO's formulas (lesson 06): model-state bytes per rank by stage, bytes sent per step, activations.

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

``paper_bytes`` is that table (``memory.ModelStateBytes`` is what a ``ZeRO`` rank really holds:
with padding, Ψ is the padded count, a multiple of N per unit). In fp32 (no separate master) the same
table holds with 4-byte parameters and gradients and K = 8. Example::

    paper_bytes(stage=3, psi=7.5e9, world=64)     # 1.875e9: the paper's 7.5B model on 64 GPUs
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["STAGES", "OPTIMIZER_STATE_BYTES", "paper_bytes", "optimizer_k", "Predicted", "predicted_memory",
           "activation_bytes", "traffic_formula"]

STAGES = (0, 1, 2, 3)
# fp32 bytes of optimizer state per parameter: Adam's m and v, SGD's momentum buffer, plain SGD nothing
OPTIMIZER_STATE_BYTES = {"adam": 8, "sgd_momentum": 4, "sgd": 0}


def paper_bytes(stage: int, psi: float, world: int, k: float = 12, param_bytes: float = 2,
                grad_bytes: float = 2) -> float:
    """Bytes of model states per rank at ``stage`` for ``psi`` parameters on ``world`` ranks (table above)."""
    if stage not in STAGES:
        raise ValueError(f"paper_bytes: stage must be one of {STAGES}, got {stage!r}.")
    shards = {0: (1, 1, 1), 1: (1, 1, world), 2: (1, world, world), 3: (world, world, world)}[stage]
    return psi * (param_bytes / shards[0] + grad_bytes / shards[1] + k / shards[2])


def optimizer_k(optimizer: str, mixed: bool) -> int:
    """K: optimizer-state bytes per parameter, the fp32 master included when parameters are 16-bit."""
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZER_STATE_BYTES)}, got {optimizer!r}.")
    return OPTIMIZER_STATE_BYTES[optimizer] + (4 if mixed else 0)


@dataclass(frozen=True)
class Predicted:
    """The paper's per-rank bytes by kind; ``host`` holds what offloading moved off the device."""

    parameters: float
    gradients: float
    optimizer_states: float
    host: float = 0.0

    @property
    def device(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states


def predicted_memory(psi: float, world: int, stage: int, optimizer: str = "adam", mixed: bool = True,
                     offload: bool = False) -> Predicted:
    """Per-rank model-state bytes of ``psi`` parameters at ``stage`` on ``world`` ranks (the module docstring's K)."""
    e, k = (2 if mixed else 4), optimizer_k(optimizer, mixed)
    params = paper_bytes(stage, psi, world, k=0, param_bytes=e, grad_bytes=0)
    grads = paper_bytes(stage, psi, world, k=0, param_bytes=0, grad_bytes=e)
    states = paper_bytes(stage, psi, world, k=k, param_bytes=0, grad_bytes=0)
    return Predicted(params, grads, 0.0, states) if offload else Predicted(params, grads, states)


def activation_bytes(sizes: Sequence[int], rows: int, mixed: bool) -> int:
    """What autograd saves in one rank's forward of ``MLP(sizes)`` under ZeRO (the loss not included):
    the first Linear's input and each ReLU's output, in the compute dtype (2 or 4 bytes). ZeRO does not
    shard them: every rank keeps those of its own rows, at every stage."""
    return rows * (2 if mixed else 4) * sum(sizes[:-1])


def traffic_formula(stage: int, padded: int, world: int, param_bytes: int = 2, grad_bytes: int = 2) -> float:
    """Bytes one rank sends in one step: the gradients travel twice' worth (all-reduce, or reduce-scatter
    and all-gather), stage 3's parameters once more (gathered for forward and again for backward)."""
    passes = param_bytes + grad_bytes + (param_bytes if stage == 3 else 0)
    return passes * padded * (world - 1) / world
