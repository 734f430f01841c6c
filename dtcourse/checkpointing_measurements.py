"""Lesson 05's measurements: what activation checkpointing keeps and what it costs, beside its models.

Each measurement comes with the prediction it is checked against; ``checkpointing_figures``
draws them and ``python -m dtcourse.bench.checkpointing`` prints them as tables::

    from dtcourse.checkpointing_measurements import measure_segments
    points = measure_segments(n_layers=16)   # one SegmentPoint per segment count k

**Memory** is measured by ``HeldBytes``, a ``TorchDispatchMode`` that sees every op, notes
each storage an op allocates, and notes again, through a weak reference, when that storage
is freed. ``memory.SavedTensors`` counts what autograd saves, but a checkpoint hides its
region from it by design (it pushes its own saved-tensor hooks) and holds its inputs itself;
only a count of live storages sees everything a checkpointed step holds, the tensors
recomputed during backward included. Storages that existed before (parameters, the batch,
``.grad`` buffers allocated beforehand) are not counted.

**Segment sweep** (Chen et al. 2016, arXiv 1604.06174): a stack of n equal layers
(Linear + ReLU, from ``models.MLP``) under ``checkpoint_sequential`` with k segments. Each
layer keeps one (B, width) tensor, so after the forward the stack holds the k - 1 inputs of
the checkpointed segments plus the m layers of the last one: k - 1 + m units, m = n // k,
least near k = sqrt(n). Backward re-runs the n - m layers of the checkpointed segments:
step(k) ≈ step(1) + forward(1)·(n - m)/n, at most one extra forward pass.

**Recomputation policies** (Korthikanti et al. 2022, arXiv 2205.05198) for the layers of a
``models.GPT``: none, selective (attention core only) and full (every layer). Per layer, in
fp32 with dropout 0, with L = ``memory.gpt_layer_activation_bytes`` = 4(16sbh + as²b + 4sb):

* none keeps L;
* selective keeps L - 4as²b: the scores go, and the (B, T, 3C) projection that the core
  starts from takes the place of the copies of q, k and v that the matmuls kept;
* full keeps 4sbh, the layer's input.

Times are medians over interleaved repeats: every variant runs once per round, so a burst of
load from elsewhere lands on all of them alike. They are printed and drawn, never asserted.
"""

from __future__ import annotations

import statistics
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dtcourse.checkpointing import (apply_full_recomputation, apply_selective_recomputation,
                                    checkpoint_sequential, segment_bounds)
from dtcourse.memory import gpt_layer_activation_bytes
from dtcourse.models import GPT, MLP, GPTConfig, lm_loss, token_batch

__all__ = ["HeldBytes", "mlp_layers", "SegmentPoint", "predicted_segment_units", "measure_segments",
           "predicted_step_ms", "PolicyPoint", "POLICIES", "RECOMPUTE_GPT", "predicted_policy_bytes",
           "recompute_flops", "measure_policies"]

POLICIES = ("none", "selective", "full")
# a·s/h = 8 (GPT-3's is 16): the scores are a third of what a layer keeps.
RECOMPUTE_GPT = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=8, d_model=128)


class HeldBytes(TorchDispatchMode):
    """Within ``with HeldBytes() as held:``, the bytes of the storages that ops allocated and that are alive.

    ``held.now`` is the current total, ``held.peak`` its largest value, ``held.trace`` the
    total after every op, in order, and ``held.mark()`` the trace's length so far (to find
    the end of the forward in it later).
    """

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self.trace: list[int] = []
        self._live: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            # A view or an in-place op returns an input's storage: nothing new was allocated.
            if storage.data_ptr() in inputs or id(storage) in self._live or storage.nbytes() == 0:
                continue
            self._live[id(storage)] = weakref.ref(storage, self._on_free(id(storage), storage.nbytes()))
            self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        self.trace.append(self.now)
        return out

    def _on_free(self, key: int, nbytes: int) -> Callable[[Any], None]:
        def freed(_: Any) -> None:
            self._live.pop(key, None)
            self.now -= nbytes
        return freed

    def mark(self) -> int:
        return len(self.trace)


def _zero_grads(model: nn.Module) -> None:
    # Allocated before measuring, so backward accumulates into them in place: the
    # gradients (the same for every variant) stay out of the activation counts.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


# --------------------------------------------------------------------------- #
# Segment sweep
# --------------------------------------------------------------------------- #
def mlp_layers(n_layers: int, width: int, seed: int = 0) -> nn.Sequential:
    """``models.MLP((width,) * (n_layers + 1))`` regrouped as n layers: (Linear, ReLU), ..., Linear."""
    net = MLP((width,) * (n_layers + 1), seed=seed).net
    return nn.Sequential(*(nn.Sequential(net[i], net[i + 1]) for i in range(0, len(net) - 1, 2)), net[-1])


def predicted_segment_units(n_layers: int, segments: int) -> int:
    """Layer outputs held after the forward: k - 1 checkpointed segments' inputs + the last segment's m."""
    start, end = segment_bounds(n_layers, segments)[-1]
    return segments - 1 + (end - start)


@dataclass(frozen=True)
class SegmentPoint:
    """One segment count k of the sweep: measured bytes and times, and the recorded memory trace."""

    n_layers: int
    segments: int
    unit: int                  # bytes of one (B, width) fp32 activation
    held_after_forward: int    # bytes alive when the forward returns
    peak: int                  # bytes, the most alive at once over forward and backward
    recomputed_layers: int     # layer forwards run during backward (counted by forward hooks)
    forward_ms: float
    step_ms: float             # forward + backward
    trace: tuple[int, ...]     # bytes alive after each op
    forward_ops: int           # how many of those ops were the forward's

    @property
    def predicted_held(self) -> int:
        return self.unit * predicted_segment_units(self.n_layers, self.segments)


def measure_segments(n_layers: int = 16, width: int = 256, batch: int = 64,
                     segments: Sequence[int] | None = None, repeats: int = 5,
                     seed: int = 0) -> list[SegmentPoint]:
    """Run ``checkpoint_sequential(mlp_layers(n_layers, width), k, x)`` and backward for each k.

    One pass per k under ``HeldBytes`` measures the memory; then ``repeats`` timed rounds
    (after one warm-up round) run every k in turn, without the tracker.
    """
    layers = mlp_layers(n_layers, width, seed)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(seed))
    ks = list(segments) if segments is not None else list(range(1, n_layers + 1))
    for k in ks:
        segment_bounds(n_layers, k)                       # a bad k fails before anything runs
    _zero_grads(layers)
    calls = [0]
    count = lambda *_: calls.__setitem__(0, calls[0] + 1)          # noqa: E731
    hooks = [layer.register_forward_pre_hook(count) for layer in layers]
    memory = {}
    try:
        for k in ks:
            calls[0] = 0
            with HeldBytes() as held:
                y = checkpoint_sequential(layers, k, x)
                after, forward_ops = held.now, held.mark()
                y.sum().backward()
                del y
            memory[k] = (after, held.peak, calls[0] - n_layers, tuple(held.trace), forward_ops)
    finally:
        for hook in hooks:
            hook.remove()
    times: dict[int, list[tuple[float, float]]] = {k: [] for k in ks}
    for round_ in range(repeats + 1):
        for k in ks:
            start = time.perf_counter()
            y = checkpoint_sequential(layers, k, x)
            forward = time.perf_counter()
            y.sum().backward()
            if round_:                                    # round 0 warms up
                times[k].append((forward - start, time.perf_counter() - start))
            del y
    unit = batch * width * 4
    return [SegmentPoint(n_layers, k, unit, *memory[k][:3], _median_ms([f for f, _ in times[k]]),
                         _median_ms([s for _, s in times[k]]), *memory[k][3:]) for k in ks]


def _median_ms(seconds: Sequence[float]) -> float:
    return 1e3 * statistics.median(seconds)


def predicted_step_ms(points: Sequence[SegmentPoint]) -> dict[int, float]:
    """Chen et al.'s cost: the plain step (k = 1) plus the forward of every recomputed layer."""
    plain = next(p for p in points if p.segments == 1)
    return {p.segments: plain.step_ms + plain.forward_ms * p.recomputed_layers / p.n_layers for p in points}


# --------------------------------------------------------------------------- #
# Recomputation policies for a GPT
# --------------------------------------------------------------------------- #
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


@dataclass(frozen=True)
class PolicyPoint:
    policy: str
    held_after_forward: int    # bytes the layers hold when their forward returns, measured
    predicted_held: int
    peak: int                  # bytes, the most alive at once over the layers' forward and backward
    step_ms: float             # a whole training step: forward, loss, backward
    predicted_overhead: float  # recomputed FLOPs / plain step FLOPs


def _gpt(config: GPTConfig, policy: str, seed: int) -> GPT:
    model = GPT(config, seed=seed)
    if policy == "full":
        apply_full_recomputation(model)
    elif policy == "selective":
        apply_selective_recomputation(model)
    elif policy != "none":
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}.")
    return model


def measure_policies(config: GPTConfig = RECOMPUTE_GPT, batch: int = 4, repeats: int = 5,
                     policies: Sequence[str] = POLICIES, seed: int = 0) -> list[PolicyPoint]:
    """Memory of the layers alone (the embeddings' output is the input), time of whole steps."""
    idx, targets = token_batch(config, batch, seed=seed)
    s = idx.shape[1]
    models = {policy: _gpt(config, policy, seed) for policy in policies}
    memory = {}
    for policy, model in models.items():
        _zero_grads(model)
        x = (model.wte(idx) + model.wpe(torch.arange(s))).detach().requires_grad_()   # (B, T, C)
        with HeldBytes() as held:
            h = x
            for block in model.blocks:
                h = block(h)                                                       # (B, T, C)
            after = held.now
            h.sum().backward()
            del h
        memory[policy] = (after, held.peak)
    times: dict[str, list[float]] = {p: [] for p in policies}
    for round_ in range(repeats + 1):
        for policy, model in models.items():
            start = time.perf_counter()
            lm_loss(model(idx), targets).backward()
            if round_:
                times[policy].append(time.perf_counter() - start)
    points = []
    for policy in policies:
        extra, step = recompute_flops(config, batch, s, policy)
        points.append(PolicyPoint(policy, memory[policy][0], predicted_policy_bytes(config, batch, s, policy),
                                  memory[policy][1], _median_ms(times[policy]), extra / step))
    return points
