"""What lesson 02 runs and draws: DistributedSampler's shards, and timelines of real DDP steps.

The lesson's one-liner records real DDP steps on forked ranks and shows them::

    from dtcourse.lab.data_parallel import ddp_timeline_widget
    ddp_timeline_widget(world_size=2)           # a dropdown over the three strategies

DDP's hiding of gradient all-reduces behind backward is Li et al., "PyTorch Distributed",
arXiv 2006.15704.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
import torch.distributed as dist

from dtcourse.data_parallel import STRATEGIES, DistributedDataParallel
from dtcourse.data_parallel.sampling import padding_mask
from dtcourse.lab.timeline import timeline_widget
from dtcourse.models import DDP_GPT, GPT, GPTConfig, lm_loss, token_batch
from dtcourse.runtime.launch import launch
from dtcourse.runtime.timeline import Recording, Span, Timeline, in_order, merge, shared_origin

if TYPE_CHECKING:
    import ipywidgets

__all__ = ["ddp_spans", "OverlapSummary", "overlap_summary", "record_ddp_runs", "record_ddp_steps", "describe",
           "ddp_timeline_widget", "plot_shards"]


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

    Only asynchronous all-reduces (those DDP waited on) can hide: a synchronous one
    (``comm="ring"``) stops backward while it runs, even inside the backward span. An async
    all-reduce's span ends when ``wait()`` returned, an upper bound on when the data arrived,
    so ``comm_ms`` is an upper bound and ``hidden_fraction`` a lower bound.
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



def _record_rank(runs: dict[str, dict], config: GPTConfig, batch_size: int, seq_len: int,
                 steps: int) -> dict[str, Timeline]:
    idx, targets = token_batch(config, batch_size, seq_len, seed=dist.get_rank())   # this rank's data
    out = {}
    for label, ddp_kwargs in runs.items():
        timeline = Timeline()
        model = GPT(config, seed=0)
        ddp = DistributedDataParallel(model, on_event=timeline.record, **ddp_kwargs)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(steps):                 # each step starts a fresh timeline: the last one is kept
            timeline.restart(shared_origin())
            opt.zero_grad()
            logits = ddp(idx)
            with timeline.span("forward", "loss"):
                loss = lm_loss(logits, targets)
            loss.backward()
            with timeline.span("optimizer", "AdamW step"):
                opt.step()
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


def describe(label: str, recording: Recording) -> str:
    """One line for a figure title: step time and how much all-reduce time backward hid (rank 0)."""
    s = overlap_summary(recording[min(recording)])
    return (f"{label}: step {s.step_ms:.1f} ms on rank 0; {s.launched_during_backward} of {s.all_reduces} "
            f"all-reduces launched during backward; {100 * s.hidden_fraction:.0f}% of all-reduce time hidden")


def ddp_timeline_widget(world_size: int = 2, bucket_cap_mb: float = 1.0, comm: str = "backend",
                        **kwargs: Any) -> ipywidgets.VBox:
    """Record one step of each strategy on ``world_size`` ranks; a dropdown picks the timeline shown."""
    runs = record_ddp_runs(world_size, {s: {"strategy": s, "bucket_cap_mb": bucket_cap_mb, "comm": comm}
                                        for s in STRATEGIES}, **kwargs)
    return timeline_widget(runs, {label: describe(label, rec) for label, rec in runs.items()})


def plot_shards(panels: dict[str, Sequence[Sequence[int]]], dataset_len: int, *, drop_last: bool = False):
    """Draw each panel's per-rank index lists as a grid: one row per rank, the index in each cell.

    Cells are coloured by rank; padded repeats are hatched and marked with a star. Returns the
    figure; each axis's texts are the indices, so a test can read them back.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels) + 0.6, 2.4), squeeze=False)
    for ax, (title, shards) in zip(axes[0], panels.items()):
        mask = padding_mask(dataset_len, len(shards), drop_last=drop_last)
        for r, (indices, pads) in enumerate(zip(shards, mask)):
            for j, (index, pad) in enumerate(zip(indices, pads)):
                ax.add_patch(Rectangle((j, r), 0.94, 0.9, facecolor=f"C{r}", alpha=0.35 if pad else 0.8,
                                       hatch="///" if pad else None, edgecolor="k" if pad else "none"))
                ax.text(j + 0.47, r + 0.45, f"{index}*" if pad else str(index), ha="center", va="center")
        width = max((len(s) for s in shards), default=0)
        ax.set(xlim=(0, max(width, 1)), ylim=(len(shards), 0), title=title, xlabel="position in the rank's epoch",
               yticks=[r + 0.45 for r in range(len(shards))], yticklabels=[f"rank {r}" for r in range(len(shards))])
        ax.set_xticks([])
        ax.tick_params(left=False)
        for side in ax.spines.values():
            side.set_visible(False)
    fig.suptitle(f"{dataset_len} samples; * = padded repeat", fontsize=10)
    fig.tight_layout()
    return fig
