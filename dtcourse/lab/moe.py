"""What lesson 11 runs and draws: the routing of a mixture-of-experts GPT, measured while it trains and on real ranks.

Shazeer et al. 2017 (arXiv 1701.06538), GShard (arXiv 2006.16668), Switch (arXiv 2101.03961), ST-MoE (arXiv
2202.08906); the layer is ``dtcourse.models.moe.MoE``, expert parallelism ``dtcourse.moe``. Nothing timed is
asserted (the one-process layer loops over its experts in Python: its step times price that loop). Example::

    from dtcourse.lab import moe as lab
    runs = {a: lab.train(a) for a in (0.0, 0.01)}   # tokens per expert and drops at every step
    lab.measure_bytes(eps=(2, 4))                    # all-to-all bytes per rank against the formulas
    lab.routing_widget(lab.routers())                # E, k and the capacity factor on a real batch
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, Sequence

import torch
import torch.distributed as dist

from dtcourse.lab.problems import Answer
from dtcourse.lab.widgets import COLUMN_IN, FigureView, figure_widget
from dtcourse.models import GPT, GPTConfig, MoE, lm_loss, token_batch
from dtcourse.models.moe import capacity, load_balancing_loss, route, z_loss
from dtcourse.moe import ExpertParallel, expert_parallelize
from dtcourse.moe.cost import (balanced_drop, flops_per_token, padded_all_to_all_bytes, parameters,
                               uniform_all_to_all_bytes)
from dtcourse.parity import ParityReport, Tolerance, check_parity
from dtcourse.runtime.launch import launch
from dtcourse.runtime.observe import CommLog, Records, labelled, observe

if TYPE_CHECKING:
    import ipywidgets

__all__ = ["LAB_GPT", "EP_GPT", "COMPUTE_GPT", "ROWS", "EP_ROWS", "CFS", "SWEEP_SEEDS", "Training", "train",
           "balance_table", "training_figure", "router_logits", "drop_sweep", "balanced_drop", "drop_figure",
           "Exchange", "AllToAllLog", "exchanges_of", "layer_labels", "measure_bytes", "parameters",
           "flops_per_token", "compute_table", "routers", "RoutingView", "routing_widget", "parity",
           "problem_capacity", "problem_uniform_loss", "problem_skewed_drops", "problem_all_to_all_bytes",
           "problem_parameters"]

# Switch's layer (top-1, capacity factor 1.25) in a tiny GPT: 200 AdamW steps of 256 tokens take about two seconds.
LAB_GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32, n_expert=8, capacity_factor=1.25)
EP_GPT = replace(LAB_GPT, top_k=2)           # GShard's top-2 for the ranks: E = 8 splits over ep = 2 and 4
COMPUTE_GPT = GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=4, d_model=128)   # for the step times
ROWS, EP_ROWS = 16, 2                        # sequences: a batch of 256 tokens per MoE layer; 32 tokens per rank
CFS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)


# ---- Tokens per expert while training, with and without the balancing loss -------------------------------------------
@dataclass(frozen=True)
class Training:
    """Per step and MoE layer: ``tokens`` and ``kept`` (steps, layers, E) choices per expert, ``dropped`` (steps,
    layers) their dropped share; ``loss`` (steps,) the LM loss; ``model`` the trained GPT."""

    alpha: float
    tokens: torch.Tensor
    kept: torch.Tensor
    dropped: torch.Tensor
    loss: torch.Tensor
    model: GPT

    def imbalance(self) -> torch.Tensor:
        """(steps, layers): the busiest expert's choices over the mean N k / E (1: perfectly balanced)."""
        return self.tokens.float().amax(-1) / self.tokens.float().mean(-1)


def train(alpha: float, config: GPTConfig = LAB_GPT, steps: int = 200, rows: int = ROWS, seed: int = 0) -> Training:
    """AdamW (lr 3e-3) on ``token_batch`` data, a new batch each step, the Switch loss's coefficient ``alpha``: every
    step's routing kept."""
    model = GPT(replace(config, moe_aux_loss=alpha), seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stats, losses = [], []
    for step in range(steps):
        idx, targets = token_batch(model.config, rows, seed=1000 * seed + step)
        loss = lm_loss(model(idx), targets)          # the auxiliary losses train through the output
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        stats.append([b.mlp.stats for b in model.blocks])   # each forward makes a new dict: nothing is overwritten
        losses.append(loss.detach())
    per_step = lambda key: torch.stack([torch.stack([layer[key] for layer in step]) for step in stats])
    return Training(alpha, per_step("tokens_per_expert"), per_step("kept_per_expert"), per_step("dropped"),
                    torch.stack(losses), model)


def balance_table(runs: dict[float, Training], first: int = 10) -> list[tuple]:
    """Rows ``(alpha, window, max/mean, dropped, lm loss)``, means over both layers of the first ``first`` steps
    and of the second half of training."""
    windows = lambda n: ((f"steps 0-{first - 1}", slice(0, first)), (f"steps {n // 2}-{n - 1}", slice(n // 2, n)))
    return [(alpha, window, run.imbalance()[part].mean().item(), run.dropped[part].mean().item(),
             run.loss[part].mean().item()) for alpha, run in runs.items() for window, part in windows(len(run.loss))]


def training_figure(runs: dict[float, Training], layer: int = 0):
    """Top: each run's share of choices per expert at every step (layer ``layer``). Bottom: max/mean choices per
    expert and the dropped share, both layers averaged, trailing means of 10 steps over the raw values (faint)."""
    from matplotlib.figure import Figure
    figure = Figure(figsize=(COLUMN_IN, 5.0), layout="constrained")
    top, bottom = figure.subfigures(2, 1)
    for ax, (alpha, run) in zip(top.subplots(1, len(runs), sharey=True, squeeze=False)[0], runs.items()):
        share = run.tokens[:, layer].float() / run.tokens[0, layer].sum()   # (steps, E)
        image = ax.imshow(share.T.numpy(), aspect="auto", vmin=0, vmax=4 / share.shape[1], interpolation="nearest")
        ax.set(title=f"alpha = {alpha:g}", xlabel="step")
    top.axes[0].set_ylabel(f"expert (layer {layer})")
    top.colorbar(image, ax=top.axes, label=f"share of choices\n(1/E = {1 / share.shape[1]:g} balanced)")
    for ax, (name, values_of) in zip(bottom.subplots(1, 2), (("max / mean choices per expert", Training.imbalance),
                                                             ("dropped share of choices", lambda r: r.dropped))):
        for colour, (alpha, run) in enumerate(runs.items()):
            values = values_of(run).mean(-1).numpy()
            ax.plot(values, color=f"C{colour}", alpha=0.25, linewidth=0.8)
            trailing = [values[max(0, i - 9):i + 1].mean() for i in range(len(values))]   # over 10 steps
            ax.plot(trailing, color=f"C{colour}", label=f"alpha = {alpha:g}")
        ax.set(title=name, xlabel="step")
    bottom.legend(handles=ax.lines[1::2], loc="outside lower center", ncols=len(runs), fontsize=7)   # the means
    return figure


# ---- Drops against the capacity factor -------------------------------------------------------------------------------
def router_logits(model: GPT, idx: torch.Tensor) -> list[torch.Tensor]:
    """Each MoE layer's router logits (N, E) for the batch ``idx``, from the layer's real input (a forward hook)."""
    inputs = []
    hooks = [b.mlp.register_forward_pre_hook(lambda _, args: inputs.append(args[0])) for b in model.blocks]
    try:
        with torch.no_grad():
            model(idx)
            return [b.mlp.router(x.reshape(-1, x.shape[-1])) for b, x in zip(model.blocks, inputs)]   # (B T, E)
    finally:
        for hook in hooks:
            hook.remove()


SWEEP_SEEDS = range(99, 115)                 # the fixed batches drop_sweep averages over


def drop_sweep(model: GPT, cfs: Sequence[float] = CFS, ks: Sequence[int] = (1, 2),
               seeds: Sequence[int] = SWEEP_SEEDS) -> dict[tuple[int, float], float]:
    """``{(k, cf): dropped share}`` of the choices of every layer, over fixed batches (one per seed, each routed as
    one group of ROWS sequences, as the layer does), their router logits ``route``d. One batch of 256 tokens alone
    moves the share by a few points either way: the mean over 16 is what tells two routers apart."""
    logits = [lg for seed in seeds for lg in router_logits(model, token_batch(model.config, ROWS, seed=seed)[0])]
    return {(k, cf): 1 - torch.cat([route(lg, k, cf).kept.reshape(-1) for lg in logits]).float().mean().item()
            for k in ks for cf in cfs}


def drop_figure(sweeps: dict[str, dict[tuple[int, float], float]]):
    """One panel per k: each router's measured dropped share against cf, and the perfectly balanced router's."""
    from matplotlib.figure import Figure
    n_tokens, n_expert = ROWS * LAB_GPT.block_size, LAB_GPT.n_expert
    ks = sorted({k for sweep in sweeps.values() for k, _ in sweep})
    figure = Figure(figsize=(COLUMN_IN, 2.8), layout="constrained")
    for ax, k in zip(figure.subplots(1, len(ks), sharey=True, squeeze=False)[0], ks):
        for name, sweep in sweeps.items():
            cfs = sorted(cf for kk, cf in sweep if kk == k)
            ax.plot(cfs, [sweep[k, cf] for cf in cfs], "o-", label=name)
        grid = [c / 20 for c in range(8, 41)]
        ax.plot(grid, [balanced_drop(n_tokens, n_expert, k, c) for c in grid], "k--", label="perfectly balanced")
        ax.set(title=f"top-{k}, E = {n_expert}, N = {n_tokens} tokens", xlabel="capacity factor")
        ax.legend(fontsize=7)
    figure.axes[0].set_ylabel("dropped share of choices")
    return figure


# ---- All-to-all bytes on real ranks ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Exchange:
    """One all-to-all as this rank ran it: rows and bytes sent to other ranks and received from them."""

    where: str       # the layer's label, e.g. "blocks.0"
    what: str        # "dispatch", "combine" or "counts"
    phase: str       # "forward" or "backward"
    sent: int        # bytes this rank sent to the other ranks (its own share stays put)
    received: int    # bytes it received from them
    rows: int        # rows it sent in all, its own share included


@dataclass
class AllToAllLog(Records):
    """The all-to-alls of expert parallelism (``Exchange``), with sums by field (``total("sent", phase="forward")``;
    ``sent`` when no field is named)."""

    summed: ClassVar[str] = "sent"


def exchanges_of(log: CommLog) -> AllToAllLog:
    """The observer's all-to-alls (``dtcourse.runtime.observe``), named. Integer ones exchange counts
    (``exchange_counts``). Of a layer's others, its forward runs dispatch, then combine; its backward runs them
    in reverse: combine's backward first, then dispatch's. Other collectives (data parallelism's) are skipped."""
    out, seen = AllToAllLog(), {}
    for r in log.records:
        if r.collective != "all_to_all":
            continue
        phase = "backward" if r.backward else "forward"
        if r.dtype is not None and not r.dtype.is_floating_point:
            what = "counts"
        else:
            n = seen[r.label, phase] = seen.get((r.label, phase), -1) + 1
            what = ("dispatch", "combine")[n % 2] if phase == "forward" else ("combine", "dispatch")[n % 2]
        me = r.group_rank
        out.records.append(Exchange(r.label, what, phase, sum(r.sent_to) - r.sent_to[me],
                                    sum(r.received_from) - r.received_from[me], r.shape[0]))
    return out


def layer_labels(model: GPT) -> dict[str, str]:
    """Each MoE layer labelled by its block: ``{"blocks.0.mlp": "blocks.0", ...}``, for ``observe.labelled``."""
    return {f"blocks.{i}.mlp": f"blocks.{i}" for i in range(len(model.blocks))}


def _bytes_rank(config: GPTConfig, rows: int) -> dict[str, dict]:
    out = {}
    for mode, cf in (("padded", config.capacity_factor), ("dropless", None)):
        model = expert_parallelize(GPT(replace(config, capacity_factor=cf), seed=0), None)
        idx, targets = token_batch(config, rows, seed=dist.get_rank())
        with observe() as seen, labelled(model, layer_labels(model)):
            lm_loss(model(idx), targets).backward()   # one training step's four exchanges per MoE layer
        log = exchanges_of(seen)
        sent = {ph: log.total(phase=ph) - log.total(phase=ph, what="counts") for ph in ("forward", "backward")}
        out[mode] = {**sent, "counts": log.total("sent", what="counts"),    # dropless sends the counts first
                     "tokens": torch.stack([b.mlp.stats["tokens_per_expert"] for b in model.blocks])}   # (layers, E)
    return out


def measure_bytes(eps: Sequence[int] = (2, 4), config: GPTConfig = EP_GPT, rows: int = EP_ROWS) -> list[tuple]:
    """A training step on ep real ranks, padded and dropless: rows ``(ep, mode, rank, forward sent, backward sent,
    formula per direction, uniform routing's)`` in bytes. padded: 2 exchanges per layer each way of (ep-1)/ep E C
    rows; dropless: the rows sent to other ranks plus those received from them, from every rank's routing."""
    E, d = config.n_expert, config.d_model
    out = []
    for ep in eps:
        ranks = launch(_bytes_rank, ep, config, rows, timeout=120)
        local = E // ep
        padded, uniform = padded_all_to_all_bytes(config, rows, ep), uniform_all_to_all_bytes(config, rows, ep)
        tokens = [q["dropless"]["tokens"] for q in ranks]                  # (layers, E) per rank
        for r, got in enumerate(ranks):
            mine = slice(r * local, (r + 1) * local)
            away = tokens[r].sum() - tokens[r][:, mine].sum()
            back = sum(tokens[q][:, mine].sum() for q in range(ep) if q != r)
            for mode, formula in (("padded", padded), ("dropless", int(away + back) * d * 4)):
                out.append((ep, mode, r, got[mode]["forward"], got[mode]["backward"], formula, uniform))
    return out


# ---- Parameters against compute --------------------------------------------------------------------------------------
def compute_table(n_experts: Sequence[int] = (2, 4, 8), config: GPTConfig = COMPUTE_GPT, rows: int = 8,
                  steps: int = 5) -> list[dict]:
    """The dense GPT and top-1 dropless MoE GPTs: parameters, forward FLOPs per token (formula, and counted by
    torch's FlopCounterMode), and the median, fastest and slowest of ``steps`` timed forward + backward passes
    and AdamW steps, the models taking turns so that a busy moment of the machine hits all of them."""
    from torch.utils.flop_counter import FlopCounterMode
    idx, targets = token_batch(config, rows, seed=0)
    out, runs = [], []                                # a row per model, and what times it
    for E in (0, *n_experts):
        cfg = replace(config, n_expert=E, top_k=1, capacity_factor=None) if E else config
        model = GPT(cfg, seed=0)
        with FlopCounterMode(display=False) as counter:
            model(idx)
        out.append({"E": E, "parameters": sum(p.numel() for p in model.parameters()),
                    "flops formula": flops_per_token(cfg), "flops counted": counter.get_total_flops() / idx.numel()})
        runs.append((model, torch.optim.AdamW(model.parameters(), lr=1e-3), []))
    for _ in range(1 + steps):                        # the first round warms up
        for model, optimizer, times in runs:
            start = time.perf_counter()
            lm_loss(model(idx), targets).backward()
            middle = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append((middle - start, time.perf_counter() - middle))
    for row, (_, _, times) in zip(out, runs):
        backward, step = zip(*times[1:])
        row.update({"fwd+bwd ms": 1e3 * statistics.median(backward), "AdamW ms": 1e3 * statistics.median(step),
                    "fwd+bwd range ms": (1e3 * min(backward), 1e3 * max(backward)),
                    "AdamW range ms": (1e3 * min(step), 1e3 * max(step))})
    return out


# ---- The routing widget: E, k and the capacity factor on a real batch ------------------------------------------------
def routers(n_experts: Sequence[int] = (2, 4, 8), steps: int = 40, alpha: float = 0.01) -> dict[int, torch.Tensor]:
    """``{E: layer 0's router logits (N, E)}`` for a fixed batch, from an MoE GPT with E experts trained ``steps``."""
    idx = token_batch(LAB_GPT, ROWS, seed=99)[0]
    return {E: router_logits(train(alpha, replace(LAB_GPT, n_expert=E), steps).model, idx)[0] for E in n_experts}


class RoutingView(FigureView):
    """Left: the last ``shown`` tokens' gates, expert x token (x: dropped), with their ``colorbar``. Right: choices
    per expert, kept and dropped, with C. ``show`` sets ``routing``, ``capacity``, ``dropped`` (share of choices),
    ``balance`` (E sum f_i P_i: the Switch loss over alpha), ``z`` (the z-loss), ``tokens_per_expert`` and
    ``kept_per_expert``."""

    def __init__(self, logits: dict[int, torch.Tensor], shown: int = 32):
        from matplotlib.figure import Figure
        self.logits, self.shown = logits, shown
        self.figure = Figure(figsize=(COLUMN_IN, 3.0), layout="constrained")
        self.grid, self.bars = self.figure.subplots(1, 2, width_ratios=(3, 2))
        # made once, beside the grid; each show points it at the new image (clear() removes the old one)
        self.colorbar = self.figure.colorbar(self.grid.imshow([[0.0]]), ax=self.grid, pad=0.01, aspect=15)
        self.colorbar.set_label("gate", fontsize=8)
        self.colorbar.ax.tick_params(labelsize=7)

    def show(self, n_expert: int, top_k: int, capacity_factor: float | str | None) -> None:
        cf = None if capacity_factor in (None, "dropless") else capacity_factor
        N, k = self.logits[n_expert].shape[0], min(top_k, n_expert)
        r = self.routing = route(self.logits[n_expert], k, cf)
        self.capacity, self.dropped = r.capacity, 1 - r.kept.float().mean().item()
        self.balance, self.z = load_balancing_loss(r).item(), z_loss(r).item()
        self.tokens_per_expert = torch.bincount(r.experts.reshape(-1), minlength=n_expert)
        self.kept_per_expert = torch.bincount(r.experts[r.kept], minlength=n_expert)
        last = slice(N - self.shown, N)
        experts, kept, gates = r.experts[last], r.kept[last], r.gates[last]      # (shown, k) each
        grid = torch.full((n_expert, self.shown), float("nan"))                 # (E, shown): empty where not chosen
        token, j = kept.nonzero().unbind(1)
        grid[experts[token, j], token] = gates[token, j]
        self.grid.clear()
        image = self.grid.imshow(grid.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=float(gates.max()))
        self.colorbar.update_normal(image)
        token, j = (~kept).nonzero().unbind(1)
        self.grid.plot(token.tolist(), experts[token, j].tolist(), "rx", markersize=5)
        self.grid.set(xlabel=f"token (the last {self.shown} of {N})", ylabel="expert", yticks=range(n_expert))
        self.grid.set_title("gate of each kept choice (x: dropped)", fontsize=9)
        self.bars.clear()
        self.bars.bar(range(n_expert), self.kept_per_expert.tolist(), label="kept")
        self.bars.bar(range(n_expert), (self.tokens_per_expert - self.kept_per_expert).tolist(),
                      bottom=self.kept_per_expert.tolist(), color="tab:red", label="dropped")
        if r.capacity is not None:
            self.bars.axhline(r.capacity, color="black", linestyle="--", label=f"capacity C = {r.capacity}")
        self.bars.axhline(N * k / n_expert, color="grey", linestyle=":", label="balanced N k / E")
        top = max(self.tokens_per_expert.max().item(), r.capacity or 0)
        self.bars.set(xlabel="expert", ylabel=f"choices (of N k = {N * k})", xticks=range(n_expert),
                      ylim=(0, 1.45 * top))                           # room for the legend above the bars
        self.bars.set_title("choices per expert", fontsize=9)
        self.bars.legend(fontsize=6, ncols=2, loc="upper center")
        self.figure.suptitle(f"E = {n_expert}, k = {k}, {'dropless' if cf is None else f'cf = {cf:g}'}: dropped "
                             f"{self.dropped:.1%} of the choices; E·Σ f·P = {self.balance:.3f}", fontsize=9)


def routing_widget(logits: dict[int, torch.Tensor], n_expert: int = 8, top_k: int = 1,
                   capacity_factor: float | str | None = 1.0) -> ipywidgets.VBox:
    """Choose E (among ``logits``), k and the capacity factor; see the routing, the drops and the balance."""
    import ipywidgets as widgets
    view = RoutingView(logits)
    view.show(n_expert, top_k, capacity_factor)
    options = [(f"{c:g}", c) for c in (0.25, *CFS, 3.0)] + [("dropless", "dropless")]
    controls = {"E": widgets.Dropdown(options=sorted(logits), value=n_expert, description="experts E"),
                "k": widgets.IntSlider(value=top_k, min=1, max=2, description="top-k"),
                "cf": widgets.Dropdown(options=options, value=capacity_factor or "dropless", description="capacity f.")}
    return figure_widget(controls, view.show, view.figure, view=view)


# ---- Parity, and the problems ----------------------------------------------------------------------------------------
def parity(ep: int = 2, config: GPTConfig = EP_GPT, steps: int = 3) -> ParityReport:
    """Expert parallelism on ``ep`` ranks against one process forced to the same routing (``moe_groups`` = ep)."""
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3)
    cfg = replace(config, moe_groups=ep)              # one process routes each rank's tokens apart, as the ranks do
    batches = [token_batch(cfg, EP_ROWS * ep, seed=s) for s in range(steps)]
    why = "the same sums in another order (experts, averaged gradients): ulps, which AdamW magnifies near its eps"
    return launch(lambda: check_parity(lambda: GPT(cfg, seed=0), lambda m, g: ExpertParallel(m, g, adamw), batches,
                                       lm_loss, adamw, tolerance=Tolerance(1e-5, 0, why)), ep, timeout=120)[0]


def problem_capacity(n_tokens: int = 128, n_expert: int = 8, top_k: int = 2, cf: float = 1.25) -> Answer:
    """Every token wants expert 0, then expert 1 (``route``, the layer's gating): the most choices an expert keeps."""
    r = route(torch.tensor([2.0, 1.0] + [0.0] * (n_expert - 2)).repeat(n_tokens, 1), top_k, cf)   # (N, E) logits
    return Answer(torch.bincount(r.experts[r.kept]).max().item(), math.ceil(n_tokens * top_k / n_expert * cf),
                  "choices", 0.0, "a count: exact")


def problem_uniform_loss(n_expert: int = 8, alpha: float = 0.01, beta: float = 1e-3) -> Answer:
    """A real MoE layer with a zero router (every probability 1/E): its auxiliary loss, alpha E sum f P + beta z."""
    moe = MoE(16, n_expert, aux_loss_coef=alpha, z_loss_coef=beta)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe(torch.randn(1, 64, 16))
    return Answer(moe.aux_loss.item(), alpha + beta * math.log(n_expert) ** 2, "", 1e-6,
                  "float32 softmax and logsumexp of zeros: a few ulps")


def problem_skewed_drops(counts: Sequence[int] = (32, 16, 8, 8), cf: float = 1.0) -> Answer:
    """``counts[e]`` tokens sent to expert e by a one-hot router, top-1 (``route``): the dropped share of choices."""
    wanted = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))     # (N,): each token's expert
    dropped = 1 - route(5.0 * torch.eye(len(counts))[wanted], 1, cf).kept.float().mean().item()
    C = math.ceil(len(wanted) / len(counts) * cf)
    return Answer(dropped, sum(max(0, n - C) for n in counts) / len(wanted), "", 1e-6, "a share of counts, in float32")


def problem_all_to_all_bytes(table: list[tuple] | None = None, ep: int = 4) -> Answer:
    """Bytes rank 0 sends in one step's all-to-alls, padded, on ``ep`` real ranks (observed), ``EP_GPT``."""
    forward, backward = next(row[3:5] for row in table or measure_bytes((ep,)) if row[:3] == (ep, "padded", 0))
    c, C = EP_GPT, capacity(EP_ROWS * EP_GPT.block_size, EP_GPT.n_expert, EP_GPT.top_k, EP_GPT.capacity_factor)
    return Answer(forward + backward, c.n_layer * 4 * (ep - 1) / ep * c.n_expert * C * c.d_model * 4, "B", 0.0,
                  "counted by the observer: exact")


def problem_parameters(config: GPTConfig = LAB_GPT) -> Answer:
    """Parameters of the MoE GPT, counted, against the dense count plus (E - 1) MLPs and a router per layer."""
    return Answer(sum(p.numel() for p in GPT(config).parameters()), parameters(config), "", 0.0, "a count: exact")
