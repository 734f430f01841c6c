"""Mixture of experts' formulas (lesson 11): tokens dropped by a balanced router, all-to-all bytes, and
parameters against compute.

Symbols: N tokens on a rank (rows x sequence), E experts, top-k routing, capacity factor cf, capacity
C = ceil(cf N k / E) (``dtcourse.models.moe.capacity``), d the model width, L the MoE layers, ep the
expert-parallel size. ``dtcourse.lab.moe`` measures each on real ranks beside its formula.
"""

from __future__ import annotations

from dtcourse.models import GPTConfig
from dtcourse.models.moe import capacity

__all__ = ["balanced_drop", "padded_all_to_all_bytes", "uniform_all_to_all_bytes", "parameters", "flops_per_token"]


def balanced_drop(n_tokens: int, n_expert: int, top_k: int, cf: float) -> float:
    """What a perfectly balanced router drops: N k / E choices per expert, C of them kept (max(0, 1 - cf))."""
    return 1 - min(capacity(n_tokens, n_expert, top_k, cf) * n_expert / (n_tokens * top_k), 1.0)


def padded_all_to_all_bytes(config: GPTConfig, rows: int, ep: int, element_bytes: int = 4) -> int:
    """Bytes one rank sends in a training step's padded exchanges: per MoE layer 2 all-to-alls each way (there
    and back, forward and backward), each sending (ep-1) of its ep parts of E/ep local experts x C rows of d."""
    n_tokens = rows * config.block_size
    slots = capacity(n_tokens, config.n_expert, config.top_k, config.capacity_factor)
    return config.n_layer * 2 * (ep - 1) * (config.n_expert // ep) * slots * config.d_model * element_bytes


def uniform_all_to_all_bytes(config: GPTConfig, rows: int, ep: int, element_bytes: int = 4) -> float:
    """The same for a router that spreads every token's k choices evenly and drops none: (ep-1)/ep of N k rows."""
    n_tokens = rows * config.block_size
    return config.n_layer * 2 * (ep - 1) / ep * n_tokens * config.top_k * config.d_model * element_bytes


def parameters(c: GPTConfig) -> int:
    """Embeddings and head (2 V d + T d), L blocks of 12 d^2 + 13 d (attention 4d^2 + 4d, MLP 8d^2 + 5d, two
    LayerNorms), ln_f (2d); with E experts, per layer E - 1 more MLPs and the router (d E)."""
    d, E = c.d_model, c.n_expert
    dense = 2 * c.vocab_size * d + c.block_size * d + c.n_layer * (12 * d * d + 13 * d) + 2 * d
    return dense + c.n_layer * ((E - 1) * (8 * d * d + 5 * d) + d * E) if E else dense


def flops_per_token(c: GPTConfig) -> int:
    """Forward matmul FLOPs per token: 2 x (attention 4d^2, k experts of 8d^2, router dE; scores 2 T d) per layer,
    and the head 2 d V. Dense: k = 1 and no router."""
    d, k, E = c.d_model, (c.top_k if c.n_expert else 1), c.n_expert
    return c.n_layer * 2 * (4 * d * d + k * 8 * d * d + d * E + 2 * c.block_size * d) + 2 * d * c.vocab_size
