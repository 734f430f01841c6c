"""Tensor parallelism's formulas (lesson 09): bytes per layer, activations per layer by Korthikanti's terms,
and the alpha-beta time of a layer's all-reduces beside its compute, on NVLink and on InfiniBand.

Symbols as in Korthikanti et al. 2022 (arXiv 2205.05198): s sequence, b batch rows, h hidden size, a heads,
t the tensor-parallel size; e bytes per element. ``dtcourse.lab.tensor_parallel`` measures each of these on
real ranks and sets the measurement beside the formula; a planner (lesson 10) uses them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dtcourse.collectives.cost import predict_time
from dtcourse.memory import korthikanti_layer_bytes

__all__ = ["LAYOUTS", "Term", "TERMS", "GATHERED", "layer_bytes", "predicted_terms", "paper_layer_bytes", "Link",
           "NVLINK", "INFINIBAND", "H100_BF16", "MFU", "GPT3_LAYER", "NODE", "CostRow", "tp_cost", "crossover"]

LAYOUTS = ("TP", "TP+SP", "TP+SP, shards saved")              # at t = 1 all three are the serial layer


def layer_bytes(t: int, s: int, b: int, h: int, elt: int = 4) -> int:
    """Bytes one rank sends per layer and direction: 2 all-reduces of s·b·h elements, 2(t-1)/t of s·b·h·elt bytes
    each; under SP, 2 all-gathers and 2 reduce-scatters of s·b·h elements, (t-1)/t each: the same."""
    return 2 * 2 * (t - 1) * s * b * h * elt // t


@dataclass(frozen=True)
class Term:
    """One of Korthikanti's saved tensors: ``count`` times ``size`` elements of one ``kind`` (paper bytes:
    activation 2, mask 1, stats 0: neglected), divided by t under TP when ``split`` (inside a column-row pair)."""
    name: str
    count: int
    size: str          # "sbh", "as²b" or "sb"
    kind: str          # "activation", "mask" or "stats"
    split: bool


TERMS = (Term("LayerNorm inputs", 2, "sbh", "activation", False),
         Term("LayerNorm mean, 1/std", 4, "sb", "stats", False),
         Term("QKV input", 1, "sbh", "activation", False),
         Term("Q, K, V", 3, "sbh", "activation", True),
         Term("softmax output", 1, "as²b", "activation", True),
         Term("attention dropout mask", 1, "as²b", "mask", True),
         Term("attention dropout output", 1, "as²b", "activation", True),
         Term("projection input", 1, "sbh", "activation", True),
         Term("MLP input", 1, "sbh", "activation", False),
         Term("GELU input", 4, "sbh", "activation", True),
         Term("GELU output", 4, "sbh", "activation", True),
         Term("residual dropout masks", 2, "sbh", "mask", False))
GATHERED = ("QKV input", "MLP input")       # the column layers' inputs, all-gathered under sequence parallelism


def predicted_terms(s: int, b: int, h: int, a: int, t: int = 1, layout: str = "TP", dropout: bool = True,
                    elt: int = 4, mask: int = 4, stats: int = 4) -> dict[str, float]:
    """Bytes per term on one rank: Korthikanti's count with ``elt`` bytes per activation, ``mask`` per mask
    element and ``stats`` per LayerNorm statistic. Without dropout no masks, and the probabilities once."""
    sizes = {"sbh": s * b * h, "as²b": a * s * s * b, "sb": s * b}
    width = {"activation": elt, "mask": mask if dropout else 0, "stats": stats}
    out = {}
    for term in TERMS:
        divide = t if term.split or (layout != "TP" and term.name not in GATHERED) or layout == LAYOUTS[2] else 1
        kept = dropout or term.name != "attention dropout output"
        out[term.name] = term.count * sizes[term.size] * width[term.kind] * kept / divide
    return out


def paper_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, layout: str = "TP") -> float:
    """Korthikanti et al. 2022, table 2: sbh(34 + 5as/h); TP: sbh(10 + 24/t + 5as/(ht)); TP+SP: (sbh/t)(34 + 5as/h)."""
    if t == 1 or layout != "TP":
        return korthikanti_layer_bytes(s, b, h, a) / t
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


@dataclass(frozen=True)
class Link:
    """What one GPU's ring all-reduce runs over: ``bandwidth`` in bytes/s each way, ``latency`` (alpha) per step."""
    name: str
    bandwidth: float
    latency: float


# NVIDIA H100 Tensor Core GPU datasheet (SXM5): NVLink 900 GB/s, both directions together, so 450 GB/s each way;
# BF16 tensor cores 1,979 TFLOP/s with sparsity, 989 TFLOP/s dense. NVIDIA DGX H100 user guide: 8 GPUs per node
# on NVSwitch, and eight ConnectX-7 InfiniBand NDR ports of 400 Gb/s (50 GB/s), one per GPU, between nodes.
# The latencies are assumptions (a few µs per ring step, the order NCCL reaches), not datasheet figures; the
# crossover does not depend on them (the tests check it with alpha = 0).
NVLINK = Link("NVLink (inside a DGX H100 node)", 450e9, 2e-6)
INFINIBAND = Link("InfiniBand NDR 400 Gb/s (across nodes)", 50e9, 5e-6)
H100_BF16 = 989e12
MFU = 0.5                # share of peak a large model reaches: 52% on A100s in Narayanan et al., arXiv 2104.04473
GPT3_LAYER = dict(s=2048, b=1, h=12288)     # GPT-3 175B's layer (Brown et al., arXiv 2005.14165), 1 sequence
NODE = 8                                    # GPUs one NVLink domain holds in a DGX H100


@dataclass(frozen=True)
class CostRow:
    """Seconds per layer and training step on one rank at tensor-parallel size t: its share of the layer's
    compute, and the 4 all-reduces of s·b·h 16-bit elements over each link (nothing overlaps them)."""
    t: int
    compute: float
    nvlink: float
    infiniband: float

    @property
    def in_nodes(self) -> float:
        """A real cluster: NVLink while the group fits in a node of 8, InfiniBand beyond."""
        return self.nvlink if self.t <= NODE else self.infiniband


def tp_cost(ts: Sequence[int] = (1, 2, 4, 8, 16, 32), s: int = GPT3_LAYER["s"], b: int = GPT3_LAYER["b"],
            h: int = GPT3_LAYER["h"], elt: int = 2, flops: float = MFU * H100_BF16,
            links: tuple[Link, Link] = (NVLINK, INFINIBAND)) -> list[CostRow]:
    """Compute: 3 × (24sbh² + 4s²bh) FLOPs per layer (forward, and backward twice that), split t ways.
    Communication: 2 all-reduces forward (g) and 2 backward (f), each ``predict_time("ring", 2sbh, t)``."""
    step_flops = 3 * (24 * s * b * h * h + 4 * s * s * b * h)
    comm = lambda link, t: 4 * predict_time("ring", s * b * h * elt, t, link.latency, 1 / link.bandwidth)  # noqa: E731
    return [CostRow(t, step_flops / t / flops, comm(links[0], t), comm(links[1], t)) for t in ts]


def crossover(rows: Sequence[CostRow], link: str = "infiniband") -> int | None:
    """The smallest t whose all-reduces over ``link`` ("nvlink", "infiniband", "in_nodes") outlast its compute."""
    return next((r.t for r in rows if getattr(r, link) > r.compute), None)
