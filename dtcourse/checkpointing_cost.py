"""Activation checkpointing's formulas (lesson 05): what is held after the forward, and what is recomputed.

Chen et al. ("Training deep nets with sublinear memory cost", arXiv 1604.06174) for k segments of a
chain of n layers; Korthikanti et al. (arXiv 2205.05198) for a GPT layer's selective and full
recomputation, with L = ``memory.gpt_layer_activation_bytes`` the bytes one layer saves (fp32, dropout 0).
``dtcourse.lab.checkpointing`` measures each beside its formula.
"""

from __future__ import annotations

from dtcourse.checkpointing import segment_bounds
from dtcourse.memory import gpt_layer_activation_bytes
from dtcourse.models import GPTConfig

__all__ = ["POLICIES", "predicted_segment_units", "predicted_policy_bytes", "recompute_flops"]

POLICIES = ("none", "selective", "full")


def predicted_segment_units(n_layers: int, segments: int) -> int:
    """Units held after the forward: the inputs of segments 2..k (k - 1), then m - 1 ReLU outputs and
    the output in the last segment of m layers."""
    start, end = segment_bounds(n_layers, segments)[-1]
    return segments - 1 + (end - start)


def predicted_policy_bytes(config: GPTConfig, batch: int, seq_len: int, policy: str) -> int:
    """Bytes the GPT's layers hold after the forward under ``policy`` (fp32, dropout 0); see the docstring."""
    s, b, h, a = seq_len, batch, config.d_model, config.n_head
    layer = gpt_layer_activation_bytes(config, b, s)
    per_layer = {"none": layer, "selective": layer - 4 * a * s * s * b, "full": 4 * s * b * h}
    if policy not in per_layer:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}.")
    return config.n_layer * per_layer[policy]


def recompute_flops(config: GPTConfig, batch: int, seq_len: int, policy: str) -> tuple[int, int]:
    """(FLOPs recomputed in backward, FLOPs of a plain training step), counting matmuls at 2 per multiply-add.

    A layer's forward is 24bsh² (the four linear layers) + 4bs²h (q·kᵀ and the product with v);
    the LM head adds 2bshV; a step is three forwards' worth (backward is two).
    """
    s, b, h, n = seq_len, batch, config.d_model, config.n_layer
    layer = 24 * b * s * h * h + 4 * b * s * s * h
    step = 3 * (n * layer + 2 * b * s * h * config.vocab_size)
    extra = {"none": 0, "selective": n * 4 * b * s * s * h, "full": n * layer}
    if policy not in extra:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}.")
    return extra[policy], step
