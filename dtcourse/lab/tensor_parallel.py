"""What lesson 09 runs and draws: tensor and sequence parallelism measured on real ranks, beside the formulas.

Megatron's layers (Shoeybi et al., arXiv 1909.08053) and sequence parallelism (Korthikanti et al., arXiv
2205.05198), as ``dtcourse.tensor_parallel`` builds them, run on forked gloo ranks::

    from dtcourse.lab import tensor_parallel as lab
    traffic = lab.measure_traffic(ts=(2, 4))        # {(t, layout): Traffic} of one training step
    lab.bytes_table(traffic)                        # per layer and phase, against 2·2(t-1)/t·sbh·4 bytes
    saves = lab.measure_activations(ts=(1, 2, 4))   # one block's saved tensors per rank, by Korthikanti's terms
    lab.activation_table(saves[2, "TP", 0.1])       # each term measured, predicted, and the paper's 16-bit count
    lab.cost_figure(lab.tp_cost())                  # the alpha-beta model: NVLink inside a node, InfiniBand across
    lab.split_figure(lab.gather_split(t=2))         # the real shards of one attention and one MLP

**Activations, term by term.** Korthikanti et al. count 16-bit activations (2 bytes) and 1-byte dropout
masks. Our block saves the same tensors, with e = 4 bytes per activation (float32) and masks of m = 4 bytes
(on the CPU ``F.dropout`` multiplies by a float noise tensor and saves it; CUDA's fused kernel saves a bool,
1 byte). It also saves each LayerNorm's mean and 1/std (fp32, 2 per token), which the paper neglects. With
dropout 0 there are no masks, and the softmax output is saved once (the paper stores it, and its dropped-out
copy, apart). Under sequence parallelism ``dtcourse.tensor_parallel`` keeps the all-gathered inputs of the
two column layers in full; Megatron keeps the sequence shard and all-gathers it again in backward, the
``SavedByTerm(keep_shards=True)`` layout here, which divides every term by t.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from dtcourse.collectives.cost import ring_bytes_sent
from dtcourse.lab.problems import Answer
from dtcourse.lab.widgets import COLUMN_IN, FigureView, figure_widget
from dtcourse.memory import storage_bytes
from dtcourse.models import GPT, GPTConfig, token_batch
from dtcourse.runtime.launch import launch
from dtcourse.runtime.observe import CommLog, Records, label, labelled, observe
from dtcourse.tensor_parallel import cost
from dtcourse.tensor_parallel.cost import (GATHERED, GPT3_LAYER, H100_BF16, INFINIBAND, LAYOUTS, MFU, NODE, NVLINK, TERMS,
                                           CostRow, Link, Term, crossover, paper_layer_bytes, predicted_terms, tp_cost)
from dtcourse.tensor_parallel import (ColumnParallelLinear, TensorParallel, gather_from_sequence_parallel,
                                      gather_shards, parallelize, vocab_parallel_lm_loss)

if TYPE_CHECKING:
    import ipywidgets
    from matplotlib.figure import Figure

__all__ = ["TP_GPT", "SPLIT_GPT", "ROWS", "LAYOUTS", "Term", "TERMS", "GATHERED", "NODE", "SPLITS",
           "Sent", "Traffic", "traffic_of", "step_traffic", "measure_traffic", "layer_bytes",
           "bytes_table", "SavedByTerm", "LayerSaves", "measure_activations",
           "predicted_terms", "paper_layer_bytes", "activation_table", "Link", "NVLINK", "INFINIBAND", "H100_BF16",
           "MFU", "GPT3_LAYER", "CostRow", "tp_cost", "crossover", "cost_figure", "Split", "gather_split",
           "placement", "assemble", "split_figure", "TensorParallelView", "tp_widget", "problem_layer_bytes",
           "problem_tp_activations", "problem_sp_share", "problem_loss_bytes", "problem_inter_node"]

# Every size divides by t = 1, 2, 3 and 4: 12 heads of 4, 4·d_model = 192, vocabulary 48, sequence 24.
# Head size 4 differs from the sequence 24, so a saved (…, T, T) tensor is always attention probabilities.
TP_GPT = GPTConfig(vocab_size=48, block_size=24, n_layer=2, n_head=12, d_model=48)
SPLIT_GPT = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=4, d_model=16)   # small enough to see
ROWS = 2                                                       # b, the batch's rows
# One layer's bytes per rank and direction (cost.layer_bytes) for the lesson's model, by default.
layer_bytes = functools.partial(cost.layer_bytes, s=TP_GPT.block_size, b=ROWS, h=TP_GPT.d_model)
RANK_CMAPS = ("Blues", "Oranges", "Greens", "Reds")          # rank r's slice of a weight, drawn in its own hue


# --------------------------------------------------------------------------- #
# 1. Bytes per layer, from the Traffic log of one training step
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class Sent:
    """One collective as tensor parallelism issued it on this rank. ``numel``: elements of the full tensor (the
    all-reduced one, the all-gather's output, the reduce-scatter's input); ``sent``: the bytes this rank sends
    with a bandwidth-optimal algorithm (``collectives.cost.ring_bytes_sent``)."""

    op: str          # "all_reduce", "all_gather" or "reduce_scatter"
    where: str       # the layer's label: "wte", "blocks.0", "lm_head", "loss", "sequence_parallel_grads"
    phase: str       # "forward" or "backward"
    numel: int
    sent: int


@dataclass
class Traffic(Records):
    """The collectives of one tensor-parallel step (``Sent``), with sums by op, layer and phase
    (``total("sent", where="blocks.0")``; ``numel`` when no field is named)."""

    summed: ClassVar[str] = "numel"

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.records + other.records)


def traffic_of(log: CommLog) -> Traffic:
    """The observer's records (``dtcourse.runtime.observe``) as tensor parallelism's collectives: an all-gather's
    record holds its input, one shard, so the full tensor is t of them."""
    out = Traffic()
    for r in log.records:
        op = r.collective
        if op not in ("all_reduce", "all_gather", "reduce_scatter"):
            raise ValueError(f"traffic_of: tensor parallelism issues no {r.op!r}; was something else observed?")
        full = r.group_size if op == "all_gather" else 1
        out.records.append(Sent(op, r.label, "backward" if r.backward else "forward", r.numel * full,
                                ring_bytes_sent(op, r.nbytes * full, r.group_size)))
    return out


def step_traffic(tp: TensorParallel, idx: torch.Tensor, targets: torch.Tensor) -> Traffic:
    """One forward and backward of ``tp``'s model with every collective recorded under its layer: ``"wte"``,
    ``"blocks.i"``, ``"lm_head"``, ``"loss"``, and ``"sequence_parallel_grads"`` for SP's sum at the end of
    backward (backward's other calls carry the label of the layer whose forward made their node)."""
    layers = ["wte", *(f"blocks.{i}" for i in range(len(tp.model.blocks))), "lm_head"]
    with observe() as log:
        with labelled(tp.model, {name: name for name in layers}):
            logits = tp.model(idx)                                                 # (B, T, V/t)
        with label("loss"):
            loss = vocab_parallel_lm_loss(logits, targets, tp.group)
        with label("sequence_parallel_grads"):
            loss.backward()
    return traffic_of(log)


def _traffic_rank(config: GPTConfig, rows: int) -> dict[str, Traffic]:
    idx, targets = token_batch(config, rows, seed=0)
    logs = {}
    for layout in LAYOUTS[:2]:
        tp = TensorParallel(GPT(config, seed=0), None, lambda ps: torch.optim.SGD(ps, lr=0.1),
                            sequence_parallel=layout == "TP+SP")
        logs[layout] = step_traffic(tp, idx, targets)
    return logs


def measure_traffic(ts: Sequence[int] = (2, 4), config: GPTConfig = TP_GPT, rows: int = ROWS
                    ) -> dict[tuple[int, str], Traffic]:
    """Every collective of one training step (forward, backward, SP's gradient sum), TP and TP+SP, for each t."""
    found = {}
    for t in ts:
        logs = launch(_traffic_rank, t, config, rows, timeout=120)[0]
        found.update({(t, layout): log for layout, log in logs.items()})
    return found


def bytes_table(traffic: dict[tuple[int, str], Traffic], config: GPTConfig = TP_GPT, rows: int = ROWS) -> list[tuple]:
    """Rows ``(t, layout, where, phase, collectives, elements, bytes sent per rank, formula or None)``."""
    out = []
    for (t, layout), log in traffic.items():
        groups: dict[tuple[str, str], list] = {}
        for r in log.records:
            groups.setdefault((r.where, r.phase), []).append(r)
        for (where, phase), records in groups.items():
            ops = " + ".join(f"{sum(r.op == op for r in records)} {op}" for op in dict.fromkeys(r.op for r in records))
            formula = cost.layer_bytes(t, config.block_size, rows, config.d_model) if where.startswith("blocks.") else None
            numel, sent = sum(r.numel for r in records), sum(r.sent for r in records)
            out.append((t, layout, where, phase, ops, numel, sent, formula))
    return out


# --------------------------------------------------------------------------- #
# 2. Activation memory per layer, by Korthikanti's terms
# --------------------------------------------------------------------------- #
_BY_MODULE = {"attn.c_attn": "QKV input", "attn.attn_drop": "attention dropout mask", "attn.c_proj": "projection input",
              "attn.resid_drop": "residual dropout masks", "mlp.c_fc": "MLP input", "mlp.gelu": "GELU input",
              "mlp.c_proj": "GELU output", "mlp.drop": "residual dropout masks"}


class SavedByTerm(torch.autograd.graph.saved_tensors_hooks):
    """Within ``with SavedByTerm(block) as saved:``, the bytes autograd saves, by Korthikanti's term.

    Lesson 00's ``SavedTensors`` with the module that saved each tensor (forward hooks keep the stack): each
    storage counts once, under the first term that saved it; parameters and buffers are left out. With
    ``keep_shards`` a sequence-parallel column layer keeps its input's shard instead of the all-gathered input,
    and all-gathers it again when backward asks for it (Korthikanti §4.2.2); ``regathered`` counts the bytes
    those all-gathers send (``collectives.cost.ring_bytes_sent``).
    """

    def __init__(self, block: nn.Module, keep_shards: bool = False, group: dist.ProcessGroup | None = None):
        self.block, self.keep_shards, self.group, self.regathered = block, keep_shards, group, 0
        self._state = {p.untyped_storage().data_ptr() for p in [*block.parameters(), *block.buffers()]}
        self._kept: dict[int, tuple[str, torch.Tensor]] = {}
        self._stack, self._inputs, self._hooks = ["block"], {}, []
        self.by_term: dict[str, int] = {}
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> SavedByTerm:
        for name, module in self.block.named_modules():
            if name:
                self._hooks.append(module.register_forward_pre_hook(functools.partial(self._enter, name)))
                self._hooks.append(module.register_forward_hook(lambda *_: self._stack.pop() and None))
        super().__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        super().__exit__(*exc_info)
        for hook in self._hooks:
            hook.remove()
        for term in dict.fromkeys(term for term, _ in self._kept.values()):
            self.by_term[term] = storage_bytes(t for k, t in self._kept.values() if k == term)
        self._kept.clear()          # the storages stay alive through backward, held by autograd
        self._inputs.clear()

    @property
    def nbytes(self) -> int:
        return sum(self.by_term.values())

    def _enter(self, name: str, module: nn.Module, args: tuple) -> None:
        self._stack.append(name)
        self._inputs[name] = args[0]

    def _term(self, t: torch.Tensor) -> str:
        where = self._stack[-1]
        if where in _BY_MODULE:
            return _BY_MODULE[where]
        if where in ("ln_1", "ln_2"):
            return "LayerNorm mean, 1/std" if t.shape[-1] == 1 else "LayerNorm inputs"
        if where == "attn" and t.shape[-1] == t.shape[-2]:                    # (…, T, T): probabilities
            seen = any(k == "softmax output" for k, _ in self._kept.values())
            return "attention dropout output" if seen else "softmax output"
        return "Q, K, V" if where == "attn" else f"other ({where})"

    def _pack(self, t: torch.Tensor):
        where, key = self._stack[-1], t.untyped_storage().data_ptr()
        if key in self._state:
            return t
        term = self._term(t)
        module = self.block.get_submodule(where) if where != "block" else self.block
        if self.keep_shards and isinstance(module, ColumnParallelLinear) and module.sequence_parallel:
            shard = self._inputs[where]                                        # (B, T/t, C): what came in
            self._kept.setdefault(shard.untyped_storage().data_ptr(), (term, shard))
            return shard, t.shape, where
        self._kept.setdefault(key, (term, t))
        return t

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        shard, shape, where = packed
        with torch.no_grad():
            full = gather_from_sequence_parallel(shard, self.group)            # (B, T, C), sends (t-1)/t of it
        self.regathered += ring_bytes_sent("all_gather", full.nbytes, dist.get_world_size(self.group))
        return full.reshape(shape)                                             # as F.linear saved it: (B·T, C)


@dataclass(frozen=True)
class LayerSaves:
    """One block's saved bytes on one rank, by term, with the shapes they come from."""
    t: int
    layout: str
    dropout: float
    s: int
    b: int
    h: int
    a: int
    by_term: dict[str, int]
    regathered: int = 0                                    # bytes sent per rank by keep_shards' re-gathers
    grads: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(self.by_term.values())


def _activations_rank(configs: list[GPTConfig], layouts: Sequence[str], rows: int) -> list[LayerSaves]:
    t, rank, out = dist.get_world_size(), dist.get_rank(), []
    for config in configs:
        s, h = config.block_size, config.d_model
        x_full = torch.randn(rows, s, h, generator=torch.Generator().manual_seed(1))     # (B, T, C)
        for layout in layouts:
            gpt = GPT(config, seed=0)
            if t > 1:
                parallelize(gpt, None, sequence_parallel=layout != "TP")
            block = gpt.blocks[0].train()
            x = (x_full.chunk(t, dim=1)[rank] if layout != "TP" else x_full).clone().requires_grad_()
            torch.manual_seed(2)                                                # the same dropout masks each time
            with SavedByTerm(block, keep_shards=layout == "TP+SP, shards saved") as saved:
                y = block(x)
            y.backward(torch.ones_like(y))
            grads = {"x": x.grad, **{n: p.grad for n, p in block.named_parameters()}}
            out.append(LayerSaves(t, layout, config.dropout, s, rows, h, config.n_head, saved.by_term,
                                  saved.regathered, grads))
    return out


def measure_activations(ts: Sequence[int] = (1, 2, 4), dropouts: Sequence[float] = (0.1, 0.0),
                        config: GPTConfig = TP_GPT, rows: int = ROWS) -> dict[tuple[int, str, float], LayerSaves]:
    """Block 0's saved bytes on rank 0, by term, for each t, layout and dropout: ``{(t, layout, dropout): ...}``.
    At t = 1 the plain, serial block runs, under the key ``(1, "TP", dropout)``."""
    if config.head_dim == config.block_size:
        raise ValueError(f"measure_activations tells attention probabilities (…, T, T) from q, k, v (…, T, head "
                         f"size) by shape: use a head size other than the sequence, {config.block_size}.")
    configs = [dataclasses.replace(config, dropout=p) for p in dropouts]
    found = {}
    for t in ts:
        saves = launch(_activations_rank, t, configs, ["TP"] if t == 1 else LAYOUTS, rows, timeout=120)[0]
        found.update({(r.t, r.layout, r.dropout): r for r in saves})
    return found


def activation_table(saves: LayerSaves) -> list[tuple[str, float, float, int]]:
    """Rows ``(term, paper's 16-bit bytes, predicted for this run, measured)``, then a total row."""
    r, drop = saves, saves.dropout > 0
    layout = "TP" if r.layout == "TP" else LAYOUTS[2]           # the paper's SP keeps the shards
    paper = predicted_terms(r.s, r.b, r.h, r.a, r.t, layout, True, elt=2, mask=1, stats=0)
    ours = predicted_terms(r.s, r.b, r.h, r.a, r.t, r.layout, drop)
    rows = [(term.name, paper[term.name], ours[term.name], r.by_term.get(term.name, 0)) for term in TERMS]
    return rows + [("total", sum(paper.values()), sum(ours.values()), r.nbytes)]


# --------------------------------------------------------------------------- #
# 3. Why tensor parallelism stays inside a node: lesson 01's alpha-beta model
# --------------------------------------------------------------------------- #
def cost_figure(rows: Sequence[CostRow]) -> Figure:
    """Milliseconds per layer and step against t: compute per rank, and the all-reduces over each link."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(COLUMN_IN, 3.4), layout="constrained")
    ax = figure.subplots()
    ts, comm = [r.t for r in rows], [r for r in rows if r.t > 1]          # t = 1 sends nothing
    ax.axvspan(min(ts), NODE, color="tab:green", alpha=0.07, label=f"one DGX H100 node ({NODE} GPUs)")
    ax.plot(ts, [1e3 * r.compute for r in rows], "o-", color="black", label="compute per rank (falls as 1/t)")
    inside = [r for r in comm if r.t <= NODE]
    ax.plot([r.t for r in inside], [1e3 * r.nvlink for r in inside], "s-", color="tab:green", label=NVLINK.name)
    ax.plot([r.t for r in comm], [1e3 * r.nvlink for r in comm], ":", color="tab:green",
            label="NVLink, if one domain held t GPUs")
    ax.plot([r.t for r in comm], [1e3 * r.infiniband for r in comm], "^-", color="tab:red", label=INFINIBAND.name)
    if (t := crossover(rows)) is not None:
        row = next(r for r in rows if r.t == t)
        ax.annotate(f"across nodes the all-reduces\noutlast compute from t = {t}", (t, 1e3 * row.infiniband),
                    xytext=(-150, -40), textcoords="offset points", fontsize=7, color="tab:red",
                    arrowprops=dict(arrowstyle="->", color="tab:red"))
    ax.set(xscale="log", yscale="log", xlabel="tensor-parallel size t",
           ylabel="ms per layer per step", title="GPT-3's layer (h = 12288, s = 2048, b = 1), bf16, H100 at 50% "
           "of peak")
    ax.set_xticks(ts, [str(t) for t in ts])
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7, loc="upper right")
    return figure


# --------------------------------------------------------------------------- #
# 4. The column and row split, drawn from the real shards
# --------------------------------------------------------------------------- #
# name -> (dimension of nn.Linear.weight split, parts side by side): c_attn's rows are q, k, v, each by heads
SPLITS = {"attn.c_attn": (0, 3), "attn.c_proj": (1, 1), "mlp.c_fc": (0, 1), "mlp.c_proj": (1, 1)}


@dataclass(frozen=True)
class Split:
    """Block 0's four weights: ``full`` (the serial model's), ``shards[name][rank]`` and rank 0's ``gathered``."""
    t: int
    full: dict[str, torch.Tensor]
    shards: dict[str, list[torch.Tensor]]
    gathered: dict[str, torch.Tensor]


def _split_rank(config: GPTConfig) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    block = parallelize(GPT(config, seed=0), None).blocks[0]
    weights = {name: block.get_submodule(name).weight for name in SPLITS}
    return ({n: w.detach().clone() for n, w in weights.items()},
            {n: gather_shards(w, w.tp_dim, w.tp_parts, None) for n, w in weights.items()})


def gather_split(t: int = 2, config: GPTConfig = SPLIT_GPT) -> Split:
    """Each rank's slice of block 0's weights after ``parallelize``, and what ``gather_shards`` rebuilds."""
    per_rank = launch(_split_rank, t, config, timeout=60)
    block = GPT(config, seed=0).blocks[0]
    return Split(t, {n: block.get_submodule(n).weight.detach() for n in SPLITS},
                 {n: [shards[n] for shards, _ in per_rank] for n in SPLITS}, per_rank[0][1])


def placement(split: Split, name: str, rank: int, part: int) -> tuple[slice, slice]:
    """Where rank's block of ``part`` sits in A = weightᵀ (Y = XA, as the paper writes it): (rows, columns)."""
    n_out, n_in = split.full[name].shape                 # nn.Linear's weight is (out, in)
    dim, parts = SPLITS[name]
    if dim == 0:                                         # column-parallel: A's columns, in each of the parts
        start, width = part * n_out // parts, n_out // parts // split.t
        return slice(0, n_in), slice(start + rank * width, start + (rank + 1) * width)
    height = n_in // split.t                             # row-parallel: A's rows
    return slice(rank * height, (rank + 1) * height), slice(0, n_out)


def assemble(split: Split, name: str) -> torch.Tensor:
    """A = weightᵀ rebuilt by putting every rank's shard where ``placement`` (and the figure) says it sits."""
    parts = SPLITS[name][1]
    a = torch.full_like(split.full[name].T, float("nan"))
    for rank, shard in enumerate(split.shards[name]):
        for part, block in enumerate(shard.T.chunk(parts, dim=1)):
            rows, cols = placement(split, name, rank, part)
            a[rows, cols] = block
    return a


def split_figure(split: Split) -> Figure:
    """A = weightᵀ of block 0's four matrices, each rank's slice a heat map in its own hue, where it sits in A."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    figure = Figure(figsize=(COLUMN_IN, 5.0), layout="constrained")
    axes = figure.subplots(2, 2, width_ratios=(3, 1.6))
    titles = {"attn.c_attn": "attention c_attn: column-parallel, q, k and v each by heads",
              "attn.c_proj": "attention c_proj: row-parallel", "mlp.c_fc": "MLP c_fc: column-parallel",
              "mlp.c_proj": "MLP c_proj: row-parallel"}
    limit = max(w.abs().max().item() for w in split.full.values())
    for ax, name in zip(axes.flat, ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")):
        a, parts = assemble(split, name), SPLITS[name][1]
        for rank in range(split.t):
            cmap = RANK_CMAPS[rank % len(RANK_CMAPS)]
            for part in range(parts):
                rows, cols = placement(split, name, rank, part)
                ax.imshow(a[rows, cols].numpy(), cmap=cmap, vmin=-2 * limit, vmax=limit, interpolation="nearest",
                          extent=(cols.start - 0.5, cols.stop - 0.5, rows.stop - 0.5, rows.start - 0.5))
                ax.add_patch(Rectangle((cols.start - 0.5, rows.start - 0.5), cols.stop - cols.start,
                                       rows.stop - rows.start, fill=False, edgecolor="black", lw=0.8))
                label = f"{'qkv'[part]} r{rank}" if parts == 3 else f"rank {rank}"
                ax.text((cols.start + cols.stop - 1) / 2, (rows.start + rows.stop - 1) / 2, label, ha="center",
                        va="center", fontsize=7, bbox=dict(facecolor="white", alpha=0.8, lw=0, pad=1))
        ax.set_xlim(-0.5, a.shape[1] - 0.5)
        ax.set_ylim(a.shape[0] - 0.5, -0.5)
        ax.set_aspect("auto")
        ax.set_title(titles[name], fontsize=8)
        ax.set_xlabel("output feature (column of A)", fontsize=7)
        ax.set_ylabel("input feature (row of A)", fontsize=7)
        ax.tick_params(labelsize=6)
    return figure


# --------------------------------------------------------------------------- #
# 5. The widget: choose t, the layout and dropout; see one layer's bytes and activations
# --------------------------------------------------------------------------- #
OP_COLOURS = {"all_reduce": "tab:blue", "all_gather": "tab:green", "reduce_scatter": "tab:orange",
              "re-gather": "tab:olive"}
# The right panel stacks Korthikanti's terms in the groups of his formula sbh(10 + 24/t + 5as/(ht)), bottom to top:
# (label inside the serial bar, legend entry, colour, terms). Twelve terms in twelve colours could not be told apart.
TERM_GROUPS = (
    ("10 sbh", "10sbh, whole under TP: LayerNorm, c_attn, c_fc inputs, residual masks", "tab:blue",
     ("LayerNorm inputs", "QKV input", "MLP input", "residual dropout masks")),
    ("stats", "LayerNorm mean, 1/std (the paper neglects them)", "lightsteelblue", ("LayerNorm mean, 1/std",)),
    ("24 sbh", "24sbh/t, split by TP: q, k, v, c_proj input, GELU in and out", "tab:orange",
     ("Q, K, V", "projection input", "GELU input", "GELU output")),
    ("5 as²b", "5as²b/t, split by heads: softmax, its dropout mask and output", "tab:red",
     ("softmax output", "attention dropout mask", "attention dropout output")),
)
assert sorted(n for *_, names in TERM_GROUPS for n in names) == sorted(term.name for term in TERMS)


class TensorParallelView(FigureView):
    """Left: the bytes one rank sends for block 0, forward and backward, by collective, against the formula (at
    t = 1 a note: nothing is split, nothing sent). Right: block 0's saved bytes per rank in ``TERM_GROUPS``, serial
    beside the chosen layout, against both formulas; ``groups[(x, label)]`` is each bar drawn (x: 0 serial, 1 the
    layout)."""

    def __init__(self, traffic: dict[tuple[int, str], Traffic], saves: dict[tuple[int, str, float], LayerSaves]):
        from matplotlib.figure import Figure

        self.traffic, self.saves = traffic, saves
        self.figure = Figure(figsize=(COLUMN_IN, 3.6), layout="constrained")
        self.ax_bytes, self.ax_memory = self.figure.subplots(1, 2, width_ratios=(2, 3))
        self.bytes_measured: dict[str, int] | None = None
        self.bytes_formula: dict[str, int] = {}
        self.activations: dict[str, float] = {}

    def show(self, t: int, layout: str, dropout: bool) -> None:
        p = max(r.dropout for r in self.saves.values()) if dropout else 0.0
        saves, serial = self.saves[t, layout if t > 1 else "TP", p], self.saves[1, "TP", p]
        self._bytes(t, layout, saves)
        ax, self.groups = self.ax_memory, {}
        ax.clear()
        predicted = sum(predicted_terms(saves.s, saves.b, saves.h, saves.a, t, layout, dropout).values())
        paper = paper_layer_bytes(saves.s, saves.b, saves.h, saves.a, t, layout)
        self.activations = {"serial": serial.nbytes, "measured": saves.nbytes, "predicted": predicted, "paper": paper}
        top = 1.75 * serial.nbytes / 1024                      # room for the legend above the bars
        for x, run in enumerate((serial, saves)):
            bottom = 0
            for short, label, colour, names in TERM_GROUPS:
                value = sum(run.by_term.get(name, 0) for name in names) / 1024
                self.groups[x, label] = ax.bar(x, value, 0.7, bottom=bottom, color=colour, edgecolor="white",
                                               linewidth=0.5)[0]
                if x == 0 and value > 0.06 * top:             # the group's name on the serial bar, where it fits
                    ax.text(x, bottom + value / 2, short, ha="center", va="center", fontsize=7, color="white")
                bottom += value
        lines = [ax.plot([0.6, 1.4], [predicted / 1024] * 2, "k--", label="predicted (fp32, CPU masks)")[0],
                 ax.plot([0.6, 1.4], [paper / 1024] * 2, "k:", label="Korthikanti (16-bit)")[0]]
        ax.set_xticks([0, 1], ["serial", f"t = {t}, {layout}" if t > 1 else "t = 1: the serial block"], fontsize=7)
        ax.set_ylabel("KiB saved per rank, block 0", fontsize=8)
        labels = [label for _, label, *_ in reversed(TERM_GROUPS)]                # top of the stack first
        ax.legend([*(self.groups[0, label] for label in labels), *lines], [*labels, *(h.get_label() for h in lines)],
                  fontsize=6, loc="upper left")
        ax.set_ylim(0, top)

    def _bytes(self, t: int, layout: str, saves: LayerSaves) -> None:
        ax = self.ax_bytes
        ax.clear()
        one = cost.layer_bytes(t, saves.s, saves.b, saves.h)      # Megatron's re-gathers: 2 all-gathers more, half of it
        regather = {"forward": 0, "backward": saves.regathered}
        self.bytes_formula = {"forward": one, "backward": one + (one // 2 if layout == LAYOUTS[2] else 0)}
        log = self.traffic.get((t, "TP" if layout == "TP" else "TP+SP"), Traffic() if t == 1 else None)
        self.bytes_measured = None if log is None else {}
        if log is None:
            ax.text(0.5, 0.5, f"no measured run at t = {t}", ha="center", transform=ax.transAxes, fontsize=8)
        if t == 1:                  # one rank holds every weight whole: no collective, no bar to draw
            self.bytes_measured = {"forward": 0, "backward": 0}
            ax.text(0.5, 0.5, "t = 1: nothing is split,\nso no rank sends anything\nfor block 0 (0 bytes, as\n"
                    "the formula says)", ha="center", va="center", transform=ax.transAxes, fontsize=8)
        for x, phase in enumerate(("forward", "backward") if log is not None and t > 1 else ()):
            by_op = {op: log.total("sent", where="blocks.0", phase=phase, op=op) for op in OP_COLOURS}
            by_op["re-gather"] = regather[phase]
            self.bytes_measured[phase] = sum(by_op.values())
            bottom = 0
            for op, value in by_op.items():
                ax.bar(x, value / 1024, bottom=bottom / 1024, color=OP_COLOURS[op], label=None if x else op)
                bottom += value
            ax.plot([x - 0.4, x + 0.4], [self.bytes_formula[phase] / 1024] * 2, "k--", label=None if x else "formula")
        ax.set_xticks([0, 1], ["forward", "backward"], fontsize=8)
        ax.set_xlim(-0.6, 1.6)
        ax.set_ylabel("KiB sent per rank, block 0", fontsize=8)
        ax.set_ylim(0, 1.6 * cost.layer_bytes(max(k[0] for k in self.saves), saves.s, saves.b, saves.h) / 1024)
        if log is not None and t > 1:
            ax.legend(fontsize=6, loc="upper left")


def tp_widget(traffic: dict[tuple[int, str], Traffic], saves: dict[tuple[int, str, float], LayerSaves], t: int = 2,
              layout: str = "TP", dropout: bool = True) -> ipywidgets.VBox:
    """Choose t (among the measured), the layout and dropout; nothing runs, the measurements are looked up."""
    import ipywidgets as widgets

    view = TensorParallelView(traffic, saves)
    view.show(t, layout, dropout)
    controls = {"t": widgets.Dropdown(options=sorted({k[0] for k in saves}), value=t, description="t"),
                "scheme": widgets.Dropdown(options=list(LAYOUTS), value=layout, description="layout"),
                "dropout": widgets.Checkbox(value=dropout, description="dropout")}
    return figure_widget(controls, view.show, view.figure, view=view)


# --------------------------------------------------------------------------- #
# 6. Problems
# --------------------------------------------------------------------------- #
_COUNTED = "the observer sees every collective as issued: exact"


def problem_layer_bytes(t: int = 4, traffic: dict[tuple[int, str], Traffic] | None = None) -> Answer:
    """Bytes one rank sends for one layer in one TP training step (forward and backward), from the Traffic log."""
    log = (traffic or measure_traffic((t,)))[t, "TP"]
    return Answer(log.total("sent", where="blocks.0"), 2 * layer_bytes(t), "B", 0.0, _COUNTED)


def problem_loss_bytes(t: int = 2, traffic: dict[tuple[int, str], Traffic] | None = None) -> Answer:
    """Bytes one rank sends for the vocab-parallel loss in one step: 3 all-reduces of one number per token."""
    log = (traffic or measure_traffic((t,)))[t, "TP"]
    s, b = TP_GPT.block_size, ROWS
    return Answer(log.total("sent", where="loss"), 3 * 2 * (t - 1) * s * b * 4 // t, "B", 0.0, _COUNTED)


def problem_tp_activations(t: int = 2, saves: dict[tuple[int, str, float], LayerSaves] | None = None) -> Answer:
    """Bytes block 0 saves on one rank under TP, dropout 0, against e(4sbh + 12sbh/t + as²b/t + 4sb)."""
    r = (saves or measure_activations((t,), (0.0,)))[t, "TP", 0.0]
    sbh, formula = r.s * r.b * r.h, 4 * (4 * r.s * r.b * r.h + 12 * r.s * r.b * r.h // t + r.a * r.s ** 2 * r.b // t
                                         + 4 * r.s * r.b)
    return Answer(r.nbytes, formula, "B", 0.0, f"saved storages counted to the byte (sbh = {sbh})")


def problem_sp_share(t: int = 4, saves: dict[tuple[int, str, float], LayerSaves] | None = None) -> Answer:
    """Per-rank saved bytes of block 0 with sequence parallelism and shards saved, as a share of the serial block's."""
    saves = saves or measure_activations((1, t), (0.1,))
    return Answer(saves[t, LAYOUTS[2], 0.1].nbytes / saves[1, "TP", 0.1].nbytes, 1 / t, "", 1e-12,
                  "every saved tensor holds 1/t of the sequence or 1/t of the heads: exact")


def problem_inter_node(t: int = 8) -> Answer:
    """Across nodes, the 4 all-reduces' time over the layer's compute time on one rank, for GPT-3's layer."""
    row = tp_cost((t,))[0]
    s, h, flops = GPT3_LAYER["s"], GPT3_LAYER["h"], MFU * H100_BF16
    formula = 2 * (t - 1) * flops / (9 * h * INFINIBAND.bandwidth * (1 + s / (6 * h)))
    return Answer(row.infiniband / row.compute, formula, "", 0.05,
                  "the formula leaves out the latency, 2(t-1)·alpha per all-reduce: 4% of the time here")
