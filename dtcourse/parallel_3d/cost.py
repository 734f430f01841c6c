"""3D parallelism's formulas: the bytes each rank sends per step over tp, pp and dp, and the model states it holds.

Per micro-batch of b rows (sequence s, hidden h, e bytes per element; t, p, d the tp, pp and dp sizes):

* **tp** (Shoeybi et al., arXiv 1909.08053; ``dtcourse.tensor_parallel.cost.layer_bytes``): 4 all-reduces of
  b·s·h per block, two in forward (g after attention and after the MLP) and two in backward (f before them); one
  more after the first stage's vocabulary-parallel embedding (forward), one before the last stage's head
  (backward), and the vocabulary-parallel loss's 3 all-reduces of b·s numbers (max, sum of exponentials, target
  logit). A ring all-reduce of S bytes sends 2(t-1)/t·S. (Sequence parallelism turns each all-reduce into an
  all-gather and a reduce-scatter of the same bytes, but its embedding sends half and its LayerNorm gradients
  add an all-reduce per backward: not in these formulas yet.)
* **pp**: a stage that is not the last sends each micro-batch's activation b·s·h·e to the next; one that is not
  the first sends the activation's gradient, as many bytes, back.
* **dp** (ZeRO over d ranks, ``dtcourse.zero.cost``): each stage's micro-batch gradients add up and are reduced
  once, at its STEP: a reduce-scatter of its padded Ψ_s·e, (d-1)/d of it sent; stages 1-2 then all-gather the
  updated parts, as much again; stage 3 all-gathers every unit before each micro-batch's forward and again
  before its backward, 2m times, and nothing after the step; stage 0 all-reduces, 2(d-1)/d.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dtcourse.collectives.cost import ring_bytes_sent
from dtcourse.zero.cost import paper_bytes

__all__ = ["HeldStage", "step_bytes", "model_state_bytes"]


@dataclass(frozen=True)
class HeldStage:
    """A pipeline stage as the formulas see it: first or last, its blocks, and its padded parameters over dp."""

    first: bool
    last: bool
    blocks: int
    padded: int          # Ψ_s: the elements ZeRO's flats hold, each padded to a multiple of d


def step_bytes(stages: Sequence[HeldStage], rows: Sequence[int], seq: int, hidden: int, t: int, d: int,
               zero_stage: int, elt: int = 4) -> dict[str, int]:
    """Bytes one rank sends in one step over each dimension (``{"tp", "pp", "dp"}``), for its ``stages`` and
    micro-batches of ``rows`` rows each, without sequence parallelism."""
    m = len(rows)
    tp = pp = dp = 0
    for st in stages:
        for b in rows:
            wide = b * seq * hidden * elt                                   # one activation, whole
            if t > 1:
                calls = 4 * st.blocks + st.first + st.last                  # all-reduces of b·s·h
                tp += calls * ring_bytes_sent("all_reduce", wide, t)
                tp += 3 * st.last * ring_bytes_sent("all_reduce", b * seq * elt, t)   # the loss's numbers
            pp += wide * (not st.last) + wide * (not st.first)
        grads = st.padded * elt
        if zero_stage == 0:
            dp += ring_bytes_sent("all_reduce", grads, d)
        else:
            gathers = 2 * m if zero_stage == 3 else 1
            dp += ring_bytes_sent("reduce_scatter", grads, d) + gathers * ring_bytes_sent("all_gather", grads, d)
    return {"tp": tp, "pp": pp, "dp": dp}


def model_state_bytes(stages: Sequence[HeldStage], d: int, zero_stage: int, k: int = 8, param_bytes: int = 4,
                      grad_bytes: int = 4) -> int:
    """Parameters, gradients and optimizer states one rank holds: ZeRO's formula (Rajbhandari et al., arXiv
    1910.02054, figure 1; ``zero.cost.paper_bytes``) on each of its stages' padded Ψ_s (already 1/t of the
    layers' under tensor parallelism), summed. fp32 AdamW: 4 + 4 + K = 8 bytes per parameter (m and v)."""
    return sum(int(paper_bytes(zero_stage, st.padded, d, k, param_bytes, grad_bytes)) for st in stages)
