"""What lesson 02 runs and draws: shards, the price of the all-reduce, timelines of real DDP steps, problems.

The lesson's one-liners record real DDP steps on forked ranks, price the gradient all-reduce on
a fitted (or stated) link, and put it beside the step's compute::

    from dtcourse.lab.data_parallel import ddp_timeline_widget, fitted_link, GPU_CASE
    ddp_timeline_widget(world_size=2)           # a dropdown over the three strategies
    link = fitted_link()                        # alpha, beta from a ping-pong, or stated figures
    GPU_CASE.hiding_batch                       # sequences per GPU whose compute covers the all-reduce

DDP's hiding of gradient all-reduces behind backward is Li et al., "PyTorch Distributed",
arXiv 2006.15704; the 6 FLOPs per parameter per token of a training step is Kaplan et al.,
"Scaling Laws for Neural Language Models", arXiv 2001.08361.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from dtcourse.collectives import predict_time
from dtcourse.data_parallel import STRATEGIES, DistributedDataParallel, assign_buckets
from dtcourse.data_parallel.cost import best_bucket_count, exposed_comm, hiding_batch, step_flops
from dtcourse.data_parallel.sampling import padding_mask, torch_shards
from dtcourse.lab import collectives as lab_collectives
from dtcourse.lab.problems import Answer, pretty
from dtcourse.lab.timeline import timeline_widget
from dtcourse.lab.widgets import COLUMN_IN
from dtcourse.models import DDP_GPT, GPT, GPTConfig, lm_loss, token_batch
from dtcourse.runtime.launch import launch
from dtcourse.runtime.observe import observe
from dtcourse.runtime.timeline import Recording, Span, Timeline, in_order, merge, shared_origin

if TYPE_CHECKING:
    import ipywidgets

__all__ = ["DDPRecorder", "ddp_spans", "OverlapSummary", "overlap_summary", "record_ddp_runs", "record_ddp_steps",
           "describe",
           "ddp_timeline_widget", "plot_shards", "Link", "LOOPBACK", "fitted_link", "forward_collectives",
           "counted_step_flops", "Throughput", "measure_flops_per_s", "OverlapCase", "GPU_CASE", "plot_bucket_model",
           "problem_sampler_repeats", "problem_ring_bytes", "problem_bucket_latency", "problem_step_flops",
           "problem_hiding_tokens"]


def ddp_spans(recording: Recording) -> Recording:
    """Split DDP's ``backward`` span where autograd's work ends, from measured times.

    DDP's ``backward`` lasts until ``backward()`` returns, which includes the engine callback
    that launches the remaining all-reduces and waits for them. It is cut at its last ``grad``
    point: autograd's work before it stays ``backward``, the rest becomes ``sync``.
    """
    out: Recording = {}
    for rank, spans in recording.items():
        grads = [s.start for s in spans if s.kind == "grad"]
        result = []
        for s in spans:
            last = max((g for g in grads if s.start <= g <= s.end), default=s.end)
            if s.kind == "backward" and last < s.end:
                result += [replace(s, end=last), Span("sync", "after the last gradient", last, s.end)]
            else:
                result.append(s)
        out[rank] = in_order(result)
    return out


@dataclass(frozen=True)
class OverlapSummary:
    """How one rank's all-reduces sat against its backward computation, in milliseconds.

    Only asynchronous all-reduces (those DDP waited on) can hide: a synchronous one stops backward
    while it runs, even inside the backward span. An all-reduce's span ends when the backend
    completed its work (the observer's record), which gloo signals from its own thread.
    """

    step_ms: float             # first span start to last span end
    backward_ms: float         # backward start to the last gradient
    comm_ms: float             # time covered by at least one all_reduce span
    hidden_ms: float           # the async part of comm_ms inside the backward computation
    all_reduces: int
    launched_during_backward: int   # all_reduce spans that start before the last gradient

    @property
    def hidden_fraction(self) -> float:
        return self.hidden_ms / self.comm_ms if self.comm_ms else 0.0


def overlap_summary(spans: Sequence[Span]) -> OverlapSummary:
    """Summarise one rank's DDP step (raw or ``ddp_spans`` spans: the grad points decide)."""
    backward = [s for s in spans if s.kind == "backward"]
    if len(backward) != 1:
        raise ValueError(f"overlap_summary needs exactly one backward span (one step), got {len(backward)}.")
    start = backward[0].start
    end = max((s.start for s in spans if s.kind == "grad" and s.start >= start), default=backward[0].end)
    waited = {s.name for s in spans if s.kind == "wait"}
    comm = sorted((s.start, s.end, s.name in waited) for s in spans if s.kind == "all_reduce")
    covered = hidden = 0.0
    reach = float("-inf")                         # how far the all-reduces seen so far cover
    for lo, hi, is_async in comm:
        lo = max(lo, reach)                       # count time covered by two all-reduces once
        if hi > lo:
            covered += hi - lo
            hidden += max(0.0, min(hi, end) - max(lo, start)) if is_async else 0.0
        reach = max(reach, hi)
    return OverlapSummary(1e3 * (max(s.end for s in spans) - min(s.start for s in spans)), 1e3 * (end - start),
                          1e3 * covered, 1e3 * hidden, len(comm), sum(c[0] < end for c in comm))



class DDPRecorder:
    """What a timeline shows of ``DistributedDataParallel``, seen from outside it: hooks on the wrapper and on
    its parameters, and ``dtcourse.runtime.observe``'s records of its all-reduces. The wrapper itself logs nothing.

    Spans (``time.perf_counter`` seconds, into ``timeline``): ``forward``; ``grad`` (a point: one gradient
    computed, just before it is accumulated and the wrapper's hook sees it); ``backward`` (from when backward
    reaches the output to when ``backward()`` returns); ``all_reduce`` per bucket (from the call to the completion of its work: the
    wrapper launches buckets strictly in index order, so the k-th all-reduce of a backward is bucket k's); and,
    for asynchronous all-reduces (``"overlapped"``), ``wait``: the time after the last gradient spent waiting for
    each bucket in turn, the communication that compute did not hide. Run each backward inside ``backward()``::

        rec = DDPRecorder(ddp, timeline)
        loss = F.mse_loss(ddp(x), y)
        with rec.backward():
            loss.backward()
    """

    def __init__(self, ddp: DistributedDataParallel, timeline: Timeline):
        if ddp.comm != "backend":
            raise ValueError("DDPRecorder draws the backend's all-reduces, one record each; lesson 01's ring "
                             "(comm='ring') sends point-to-point messages: count them with observe() instead.")
        self.ddp, self.timeline = ddp, timeline
        self.forward_start = self.backward_start = self.last_grad = None
        self.hooks = [ddp.register_forward_pre_hook(self._pre), ddp.register_forward_hook(self._post)]
        for name, p in ddp.module.named_parameters():
            if p.requires_grad:
                self.hooks.append(p.register_hook(lambda g, n=name: self._grad(n)))   # before it is accumulated

    def _pre(self, module: nn.Module, args: Any) -> None:
        self.forward_start = time.perf_counter()

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        self.timeline.record("forward", "forward", self.forward_start, time.perf_counter())
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._reached)              # runs when backward reaches the output

    def _reached(self, grad: torch.Tensor) -> None:
        if self.backward_start is None:
            self.backward_start = time.perf_counter()

    def _grad(self, name: str) -> None:           # returns None: the gradient passes unchanged
        self.last_grad = now = time.perf_counter()
        self.timeline.record("grad", name, now, now)

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Record the backward run inside, with its all-reduces and waits."""
        self.backward_start = self.last_grad = None
        with observe() as log:
            yield
        end = time.perf_counter()
        start = self.backward_start if self.backward_start is not None else self.last_grad
        if start is not None:
            self.timeline.record("backward", "backward", start, end)
        reduces = [r for r in log.records if r.collective == "all_reduce" and r.dtype.is_floating_point]
        waiting = self.last_grad if self.last_grad is not None else end
        for k, r in enumerate(reduces):
            done = r.end if r.end is not None else end
            self.timeline.record("all_reduce", f"bucket {k}", r.start, max(r.start, done))
            if self.ddp.strategy == "overlapped":         # waited on in the engine's callback, in bucket order
                self.timeline.record("wait", f"bucket {k}", waiting, max(waiting, done))
                waiting = max(waiting, done)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def _record_rank(runs: dict[str, dict], config: GPTConfig, batch_size: int, seq_len: int,
                 steps: int) -> dict[str, Timeline]:
    idx, targets = token_batch(config, batch_size, seq_len, seed=dist.get_rank())   # this rank's data
    out = {}
    for label, ddp_kwargs in runs.items():
        timeline = Timeline()
        model = GPT(config, seed=0)
        ddp = DistributedDataParallel(model, **ddp_kwargs)
        recorder = DDPRecorder(ddp, timeline)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(steps):                 # each step starts a fresh timeline: the last one is kept
            timeline.restart(shared_origin())
            opt.zero_grad()
            logits = ddp(idx)
            with timeline.span("forward", "loss"):
                loss = lm_loss(logits, targets)
            with recorder.backward():
                loss.backward()
            with timeline.span("optimizer", "AdamW step"):
                opt.step()
        recorder.remove()
        out[label] = timeline
    return out


def record_ddp_runs(world_size: int, runs: Mapping[str, Mapping[str, Any]], steps: int = 3,
                    config: GPTConfig = DDP_GPT, batch_size: int = 4, seq_len: int = 32,
                    timeout: float = 120) -> dict[str, Recording]:
    """Train the GPT for ``steps`` AdamW steps per run, in one launch; return each run's last step.

    ``runs`` maps a label to ``DistributedDataParallel`` keyword arguments, for example
    ``{"1 MiB": {"strategy": "overlapped", "bucket_cap_mb": 1}}``. The steps before the last
    warm up the allocator and gloo's connections. Each rank trains on its own ``batch_size`` x
    ``seq_len`` tokens. The spans come back merged and passed through ``ddp_spans``.
    """
    if steps < 1:
        raise ValueError(f"record_ddp_runs: steps must be at least 1 (the last one is kept), got {steps}.")
    per_rank = launch(_record_rank, world_size, {k: dict(v) for k, v in runs.items()}, config, batch_size,
                      seq_len, steps, timeout=timeout)
    return {label: ddp_spans(merge([r[label] for r in per_rank])) for label in runs}


def record_ddp_steps(world_size: int = 2, strategy: str = "overlapped", bucket_cap_mb: float = 1.0,
                     comm: str = "backend", **kwargs: Any) -> Recording:
    """The last of a few real DDP steps of one strategy (other arguments as ``record_ddp_runs``).

    The default 1 MiB cap cuts ``DDP_GPT``'s 3.3 MiB of gradients into 4 buckets; at 25 MiB
    there would be one, which fills only with the last gradient, so nothing could overlap.
    """
    run = {"strategy": strategy, "bucket_cap_mb": bucket_cap_mb, "comm": comm}
    return record_ddp_runs(world_size, {strategy: run}, **kwargs)[strategy]


def describe(label: str, recording: Recording, sep: str = "; ") -> str:
    """A figure title: step time, then how much all-reduce time backward hid (rank 0), joined by ``sep``.

    ``sep="\n"`` makes two lines, which fit a figure as wide as the notebook column.
    """
    s = overlap_summary(recording[min(recording)])
    return (f"{label}: step {s.step_ms:.1f} ms on rank 0{sep}{s.launched_during_backward} of {s.all_reduces} "
            f"all-reduces launched during backward; {100 * s.hidden_fraction:.0f}% of all-reduce time hidden")


def ddp_timeline_widget(world_size: int = 2, bucket_cap_mb: float = 1.0, comm: str = "backend",
                        **kwargs: Any) -> ipywidgets.VBox:
    """Record one step of each strategy on ``world_size`` ranks; a dropdown picks the timeline shown."""
    runs = record_ddp_runs(world_size, {s: {"strategy": s, "bucket_cap_mb": bucket_cap_mb, "comm": comm}
                                        for s in STRATEGIES}, **kwargs)
    return timeline_widget(runs, {label: describe(label, rec, "\n") for label, rec in runs.items()})


def plot_shards(panels: dict[str, Sequence[Sequence[int]]], dataset_len: int, *, drop_last: bool = False):
    """Draw each panel's per-rank index lists as a grid: one row per rank, the index in each cell.

    Cells are coloured by rank; padded repeats are hatched and marked with a star. Returns the
    figure; each axis's texts are the indices, so a test can read them back.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    width = min(COLUMN_IN, 3.2 * len(panels) + 0.6)           # the notebook column at most
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 2.4), squeeze=False)
    for ax, (title, shards) in zip(axes[0], panels.items()):
        mask = padding_mask(dataset_len, len(shards), drop_last=drop_last)
        for r, (indices, pads) in enumerate(zip(shards, mask)):
            for j, (index, pad) in enumerate(zip(indices, pads)):
                ax.add_patch(Rectangle((j, r), 0.94, 0.9, facecolor=f"C{r}", alpha=0.35 if pad else 0.8,
                                       hatch="///" if pad else None, edgecolor="k" if pad else "none"))
                ax.text(j + 0.47, r + 0.45, f"{index}*" if pad else str(index), ha="center", va="center")
        positions = max((len(s) for s in shards), default=0)
        ax.set(xlim=(0, max(positions, 1)), ylim=(len(shards), 0), title=title, xlabel="position in the rank's epoch",
               yticks=[r + 0.45 for r in range(len(shards))], yticklabels=[f"rank {r}" for r in range(len(shards))])
        ax.set_xticks([])
        ax.tick_params(left=False)
        for side in ax.spines.values():
            side.set_visible(False)
    ranks = len(next(iter(panels.values()), []))
    fig.suptitle(f"DistributedSampler: {dataset_len} samples on {ranks} ranks; * = padded repeat", fontsize=10)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- #
# Section 3: the link the all-reduce is priced on, fitted here or stated
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class Link:
    """An alpha-beta link: ``alpha`` seconds per message, ``beta`` seconds per byte, and their source.

    Both are positive by construction, so ``bandwidth`` (1/beta) never divides by zero.
    """

    alpha: float
    beta: float
    source: str
    measured: bool = False

    def __post_init__(self) -> None:
        if not (self.alpha > 0 and self.beta > 0 and math.isfinite(self.alpha) and math.isfinite(self.beta)):
            raise ValueError(f"a link needs alpha > 0 and beta > 0, got alpha={self.alpha!r}, beta={self.beta!r}")

    @property
    def bandwidth(self) -> float:
        """1/beta, bytes per second."""
        return 1.0 / self.beta

    def __str__(self) -> str:
        return f"α = {pretty(self.alpha, 's')}, 1/β = {pretty(self.bandwidth, 'B/s')} ({self.source})"


# Loopback TCP between two processes of one laptop: the order of magnitude the ping-pong finds on
# the course's 2-core machine when it is quiet (tens of µs, a few GB/s). Used when the fit fails.
LOOPBACK = Link(50e-6, 1 / 2e9, "stated, illustrative figures for loopback TCP on a laptop, not measured")
PING_PONG_SIZES = (4, 4 << 10, 64 << 10, 256 << 10)


def fitted_link(sizes: Sequence[int] = PING_PONG_SIZES, repeats: int = 10, fallback: Link = LOOPBACK) -> Link:
    """alpha and beta fitted to a two-rank ping-pong (lesson 01), or ``fallback`` when that fails.

    On a busy machine the medians can be too noisy to fit: ``fitted_model`` then raises a
    ``ValueError`` (and a fit that found no positive alpha or beta is refused here too). The
    lesson goes on with the stated figures, and ``source`` says why.
    """
    try:
        alpha, beta = lab_collectives.fitted_model(lab_collectives.ping_pong(list(sizes), repeats=repeats))
        return Link(alpha, beta, f"fitted on this machine: ping-pong medians of {repeats} round trips", True)
    except ValueError as err:
        return replace(fallback, source=f"{fallback.source}: the ping-pong was too noisy to fit ({err})")


def _forward_collectives_rank(wrappers: list[str], config: GPTConfig) -> dict[str, list[tuple[str, int]]]:
    # kineto, the profiler's engine, writes a "USDT" line at every start and stop unless its log level
    # is above 5; it reads the level once, at its first use in the process (here: this rank)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    from torch.profiler import ProfilerActivity, profile

    idx, targets = token_batch(config, 2, min(16, config.block_size), seed=dist.get_rank())
    takes = inspect.signature(nn.parallel.DistributedDataParallel).parameters
    # torch 2.13 renamed broadcast_buffers to forward_sync_buffers; both mean the same
    sync = "forward_sync_buffers" if "forward_sync_buffers" in takes else "broadcast_buffers"
    out = {}
    for name in wrappers:
        model = GPT(config)
        if name == "dtcourse":
            wrapped = DistributedDataParallel(model)
        else:
            wrapped = nn.parallel.DistributedDataParallel(model, **{sync: name == "torch"})
        for _ in range(2):   # torch re-buckets in the second step's forward: count a steady step
            lm_loss(wrapped(idx), targets).backward()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            wrapped(idx)
        # the backend's own events ("gloo:broadcast", "nccl:all_reduce", ...) carry the tensor shapes
        out[name] = [(e.name.split(":", 1)[1], math.prod(e.input_shapes[0]) if e.input_shapes else 0)
                     for e in prof.events() if e.name.startswith(("gloo:", "nccl:"))]
    return out


def forward_collectives(world_size: int = 2, config: GPTConfig = DDP_GPT) -> dict[str, list[tuple[str, int]]]:
    """The collectives that one forward (after two warm-up steps) issues on rank 0, found by torch's profiler.

    Keys: ``"dtcourse"`` (our wrapper), ``"torch"`` (torch DDP's defaults) and ``"torch, no buffer
    sync"``; values: ``(collective, elements)`` per call. By default torch broadcasts every buffer
    from rank 0 at the start of every forward; the course GPT's buffers are its causal masks.
    """
    return launch(_forward_collectives_rank, world_size, ["dtcourse", "torch", "torch, no buffer sync"],
                  config, timeout=120)[0]


# --------------------------------------------------------------------------- #
# Compute beside communication
# --------------------------------------------------------------------------- #
def counted_step_flops(config: GPTConfig = DDP_GPT, batch_size: int = 4, seq_len: int = 32,
                       device: str = "cpu") -> int:
    """FLOPs of one forward and backward of the course GPT, counted op by op by torch's FlopCounterMode.

    On ``device="meta"`` no arithmetic runs, so a model of any size is counted in a moment.
    """
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device(device):
        model = GPT(config)
    idx, targets = (t.to(device) for t in token_batch(config, batch_size, seq_len))
    with FlopCounterMode(display=False) as counter:
        lm_loss(model(idx), targets).backward()
    return counter.get_total_flops()


@dataclass(frozen=True)
class Throughput:
    """FLOP/s of one rank, measured here or stated, and where the figure came from."""

    flops_per_s: float
    source: str
    measured: bool = False


# One laptop core in float32 on small matmuls: the order of magnitude measured on the course's
# 2-core machine (a few GFLOP/s). Used when the timing cannot be trusted.
ONE_CORE = Throughput(5e9, "stated, illustrative figure for one laptop core, not measured")


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_flops_per_s(config: GPTConfig = DDP_GPT, batch_size: int = 4, seq_len: int = 32, repeats: int = 7,
                        fallback: Throughput = ONE_CORE) -> Throughput:
    """Counted FLOPs of a forward and backward over the median of ``repeats`` timed ones, on one thread
    (as a launched rank runs). A median that is not positive falls back to ``fallback``."""
    flops = counted_step_flops(config, batch_size, seq_len)
    model = GPT(config)
    idx, targets = token_batch(config, batch_size, seq_len)
    times = []
    with _threads(1):
        for _ in range(repeats + 1):                 # the first one warms up the allocator
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            lm_loss(model(idx), targets).backward()
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times[1:])
    if not seconds > 0:                              # a clock that did not move: never divide by it
        return replace(fallback, source=f"{fallback.source}: the timing read {seconds} s")
    return Throughput(flops / seconds, f"measured here: {pretty(flops, 'FLOP')} counted by FlopCounterMode, "
                                       f"median of {repeats} passes {1e3 * seconds:.1f} ms, one thread", True)


@dataclass(frozen=True)
class OverlapCase:
    """A model trained on ``world_size`` ranks: one step's compute per sequence beside its all-reduce."""

    name: str
    params: float
    seq_len: int
    world_size: int
    grad_bytes: int            # per parameter: 4 for float32 gradients, 2 for bf16
    link: Link
    flops_per_s: float

    @property
    def comm_s(self) -> float:
        """One ring all-reduce of every gradient: 2(N-1)α + 2(N-1)/N·S·β (one bucket's latency)."""
        return predict_time("ring", self.grad_bytes * self.params, self.world_size, self.link.alpha, self.link.beta)

    @property
    def compute_per_sequence_s(self) -> float:
        return step_flops(self.params, self.seq_len) / self.flops_per_s

    @property
    def hiding_batch(self) -> float:
        return hiding_batch(self.params, self.seq_len, self.flops_per_s, self.comm_s)

    def row(self) -> str:
        b = self.hiding_batch
        return (f"{self.name}: all-reduce {pretty(self.comm_s, 's')}, compute "
                f"{pretty(self.compute_per_sequence_s, 's')} per sequence of {self.seq_len} -> "
                f"compute covers it from {b:.2f} sequences per rank "
                f"({math.ceil(b)}, {math.ceil(b) * self.seq_len:,} tokens)")


# A GPT-2 XL-sized model (1.5B parameters, Radford et al. 2019) on 64 GPUs in 8 nodes, bf16
# gradients. All figures stated, for illustration: 400 TFLOP/s achieved per GPU (about 40% of
# an H100's 989 TFLOP/s dense bf16 peak), one 400 Gb/s (50 GB/s) InfiniBand link per GPU.
GPU_CASE = OverlapCase("GPT-2 XL size, 64 GPUs", 1.5e9, 1024, 64, 2,
                       Link(10e-6, 1 / 50e9, "stated: 400 Gb/s InfiniBand per GPU"), 400e12)


# --------------------------------------------------------------------------- #
# How many buckets: dtcourse.data_parallel.cost's overlap model, drawn
# --------------------------------------------------------------------------- #
def plot_bucket_model(case: OverlapCase = GPU_CASE, sequences: int = 16, counts: Sequence[int] | None = None):
    """Communication per step against the bucket count for ``case``: all after backward, and overlapped.

    Backward is two thirds of the step's 6·P·tokens FLOPs. Returns the figure; the best count is
    marked, and ``fig.best`` holds it.
    """
    import matplotlib.pyplot as plt

    counts = list(counts or sorted({round(10 ** (x / 20)) for x in range(0, 55)}))   # 1 to 500
    nbytes = case.grad_bytes * case.params
    backward_s = 4 * case.params * sequences * case.seq_len / case.flops_per_s
    after = [k * predict_time("ring", nbytes / k, case.world_size, case.link.alpha, case.link.beta) for k in counts]
    model = (case.world_size, case.link.alpha, case.link.beta, backward_s)
    exposed = [exposed_comm(k, nbytes, *model) for k in counts]
    best = best_bucket_count(nbytes, *model, most=max(counts))
    fig, ax = plt.subplots(figsize=(COLUMN_IN, 3.2))
    ax.plot(counts, [1e3 * t for t in after], label="bucketed: all-reduces after backward")
    ax.plot(counts, [1e3 * t for t in exposed], label="overlapped: left after backward")
    ax.axhline(1e3 * backward_s, color="gray", linestyle=":", linewidth=1, label="backward")
    t_best = exposed_comm(best, nbytes, *model)
    ax.plot([best], [1e3 * t_best], "o", color="C1")
    ax.annotate(f"best: {best} buckets of {pretty(nbytes / best, 'B')}", (best, 1e3 * t_best),
                xytext=(-10, 30), textcoords="offset points", ha="right", fontsize=8,
                arrowprops={"arrowstyle": "-", "color": "C1", "linewidth": 0.8})
    top = 1e3 * max(1.6 * after[0], 1.2 * backward_s)              # many tiny buckets climb off the top
    ax.set(xscale="log", xlabel="buckets per step", ylabel="communication (ms)", ylim=(0, top),
           title=f"{case.name}, {sequences} x {case.seq_len} tokens per GPU: bucket count (α-β model)")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.best = best
    return fig


# --------------------------------------------------------------------------- #
# Problems: every answer is counted (samples, bytes, messages, FLOPs), never timed
# --------------------------------------------------------------------------- #
def problem_sampler_repeats(dataset_len: int = 1003, world_size: int = 8) -> Answer:
    """Samples read twice in one epoch: torch's DistributedSampler, asked once per rank, counted."""
    shards = torch_shards(dataset_len, world_size)
    reads = sum(len(s) for s in shards)
    measured = reads - len({i for s in shards for i in s})
    formula = math.ceil(dataset_len / world_size) * world_size - dataset_len
    return Answer(measured, formula, "samples", rtol=0.0,
                  why="exact: both sides count whole samples, and padding is the only way one repeats")


def _ring_ddp_rank(strategies: list[str], bucket_cap_mb: float, config: GPTConfig) -> dict[str, tuple[int, int]]:
    idx, targets = token_batch(config, 2, min(16, config.block_size), seed=dist.get_rank())
    out = {}
    for strategy in strategies:
        ddp = DistributedDataParallel(GPT(config), strategy=strategy, bucket_cap_mb=bucket_cap_mb, comm="ring")
        loss = lm_loss(ddp(idx), targets)
        with observe() as log:
            loss.backward()                               # one step's gradient all-reduces, message by message
        out[strategy] = (log.total("nbytes", op="send"), len(log.select(op="send")))
    return out


def _ring_counts(world_size: int, strategies: list[str], bucket_cap_mb: float,
                 config: GPTConfig) -> dict[str, tuple[int, int]]:
    """Bytes and messages rank 0 sent in one backward of the GPT, per strategy, through our ring."""
    return launch(_ring_ddp_rank, world_size, strategies, bucket_cap_mb, config, timeout=120)[0]


def problem_ring_bytes(world_size: int = 4, bucket_cap_mb: float = 1.0, config: GPTConfig = DDP_GPT) -> Answer:
    """Bytes one rank sends to all-reduce one step's float32 gradients of the course GPT, counted."""
    sent, _ = _ring_counts(world_size, ["overlapped"], bucket_cap_mb, config)["overlapped"]
    params = sum(p.numel() for p in GPT(config).parameters())
    n = world_size
    return Answer(sent, 2 * (n - 1) / n * 4 * params, "B", rtol=1e-3,
                  why="exact when N divides each bucket's length; otherwise the ring's chunks differ by one "
                      "element, a few bytes per bucket")


def problem_bucket_latency(world_size: int = 4, alpha: float = 5e-6, beta: float = 1 / 25e9,
                           bucket_cap_mb: float = 1.0, config: GPTConfig = DDP_GPT) -> Answer:
    """Extra communication time of one all-reduce per tensor over buckets, priced from counted messages and bytes."""
    counts = _ring_counts(world_size, ["per_parameter", "bucketed"], bucket_cap_mb, config)
    (bytes_pp, msgs_pp), (bytes_b, msgs_b) = counts["per_parameter"], counts["bucketed"]
    measured = (msgs_pp - msgs_b) * alpha + (bytes_pp - bytes_b) * beta
    params = list(GPT(config).parameters())
    tensors, buckets = len(params), len(assign_buckets(params, int(bucket_cap_mb * 2**20)))
    formula = (tensors - buckets) * 2 * (world_size - 1) * alpha
    return Answer(measured, formula, "s", rtol=0.01,
                  why="messages are counted exactly; the bytes differ only by the ring's uneven chunks, "
                      "far under 1% of the latency difference")


def problem_step_flops(batch_size: int = 4, seq_len: int = 32) -> Answer:
    """FLOPs of one forward and backward of the course GPT, counted by FlopCounterMode, against 6·P·tokens."""
    params = sum(p.numel() for p in GPT(DDP_GPT).parameters())
    return Answer(counted_step_flops(DDP_GPT, batch_size, seq_len), step_flops(params, batch_size * seq_len),
                  "FLOP", rtol=0.1,
                  why="6·P counts every parameter; the embeddings (5% of P) are lookups that do no FLOPs, the "
                      "biases and LayerNorms (1%) additions the counter leaves out, and attention's scores and "
                      "mix (QKᵀ, AV) add 12·L·T·d per token, 4% at T = 32")


def problem_hiding_tokens(world_size: int = 8, alpha: float = 5e-6, beta: float = 1 / 25e9,
                          flops_per_s: float = 100e12, seq_len: int = 64) -> Answer:
    """Tokens per rank whose compute lasts as long as the all-reduce of the course GPT's float32 gradients.

    The all-reduce time is the α-β model on the stated link, on both sides; what is measured is
    the compute per token, counted by FlopCounterMode on the real model.
    """
    params = sum(p.numel() for p in GPT(DDP_GPT).parameters())
    comm_s = predict_time("ring", 4 * params, world_size, alpha, beta)
    batch = 4
    per_token = counted_step_flops(DDP_GPT, batch, seq_len) / (batch * seq_len)
    return Answer(comm_s * flops_per_s / per_token, comm_s * flops_per_s / step_flops(params, 1), "tokens",
                  rtol=0.1, why="the counted FLOPs per token differ from 6·P by the embeddings (fewer) and "
                                "attention (more, 8% at T = 64), as in the problem before")
