"""Benchmark: training-step time of the from-scratch DDP strategies against torch's DDP, in one run.

    python -m dtcourse.bench.data_parallel                  # 2 and 4 ranks, strategies and a bucket sweep
    python -m dtcourse.bench.data_parallel --quick          # 2 ranks, 3 bucket sizes, a few steps
    python -m dtcourse.bench.data_parallel --out assets/bench_data_parallel.png

Model: ``dtcourse.models.DDP_GPT`` (867k parameters, 3.3 MiB of float32 gradients); each
rank trains on its own 4 sequences of 32 tokens with AdamW. A step is zero_grad, forward,
loss, backward and the optimizer step. Per world size, one launch builds every variant (its
own model copy and optimizer) and the variants take turns step by step, starting one place later
each round, so a burst of load from elsewhere on the machine lands on all of them alike. A step
lasts as long as its slowest rank (an all-reduce MAX of the ranks' times); tables show the median
over the timed steps after warm-up, with the interquartile range, and the ratio to torch DDP at the
same ``bucket_cap_mb``: of the medians, and "paired", the median of the step-by-step ratios between
steps of one round, which a slow drift in the machine's load moves less.

Variants: ``per_parameter``, ``bucketed`` and ``overlapped`` are
``dtcourse.data_parallel.DistributedDataParallel`` with ``comm="backend"`` (gloo's all-reduce);
``torch`` is ``torch.nn.parallel.DistributedDataParallel`` with its defaults except the cap, the
reference of every ratio. By default torch also re-sends the model's buffers (the GPT's causal
masks) from rank 0 at every forward, one more collective per step that dtcourse's wrapper never
makes; ``torch_nosync`` (``forward_sync_buffers=False``) is torch without it, like for like.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from dtcourse.bench import (find, finish, paired_ratio, ratio_cell, step_times, text_table, times_cell, turns,
                            world_panels)
from dtcourse.data_parallel import DistributedDataParallel
from dtcourse.runtime.launch import launch
from dtcourse.models import GPT, GPTConfig, lm_loss, token_batch
from dtcourse.models import DDP_GPT

TORCH, TORCH_NOSYNC = "torch", "torch_nosync"
STRATEGY_ORDER = ("per_parameter", "bucketed", "overlapped", TORCH, TORCH_NOSYNC)
DEFAULT_CAPS = (0.01, 0.05, 0.25, 1.0, 5.0, 25.0)   # MiB
Variant = tuple[str, float]                          # (strategy or "torch", bucket_cap_mb)


def _wrap(strategy: str, cap: float, model: nn.Module) -> nn.Module:
    if strategy in (TORCH, TORCH_NOSYNC):
        return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap,
                                                   forward_sync_buffers=strategy == TORCH)
    return DistributedDataParallel(model, strategy=strategy, bucket_cap_mb=cap, comm="backend")


def _buckets(wrapped: nn.Module) -> int:
    if isinstance(wrapped, DistributedDataParallel):
        return len(wrapped.buckets)
    # torch re-buckets after the first step by the order gradients arrived; its logging data
    # (a private API) says how many buckets the last step reduced
    return int(wrapped._get_ddp_logging_data().get("num_buckets_reduced", -1))


def _time_rank(variants: list[Variant], config: GPTConfig, batch_size: int, seq_len: int,
               warmup: int, steps: int) -> dict[Variant, dict]:
    """Inside every rank: round-robin the variants for warmup + steps steps; rank 0's answer is used."""
    idx, targets = token_batch(config, batch_size, seq_len, seed=dist.get_rank())   # this rank's data
    runs = {}
    for strategy, cap in variants:
        model = GPT(config, seed=0)
        runs[strategy, cap] = (_wrap(strategy, cap, model), torch.optim.AdamW(model.parameters(), lr=1e-3))
    times: dict[Variant, list[float]] = {v: [] for v in variants}
    for i in range(warmup + steps):
        for variant in turns(list(runs), i):                 # who goes first rotates
            wrapped, opt = runs[variant]
            dist.barrier()                                   # every rank starts the step together
            start = time.perf_counter()
            opt.zero_grad()
            lm_loss(wrapped(idx), targets).backward()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)   # the step ends when the slowest rank's does
            if i >= warmup:
                times[variant].append(elapsed.item())
    return {v: {"times": times[v], "buckets": _buckets(runs[v][0])} for v in variants}


def measure(world_size: int, variants: list[Variant], config: GPTConfig = DDP_GPT, batch_size: int = 4,
            seq_len: int = 32, warmup: int = 5, steps: int = 30) -> list[dict]:
    """One launch at ``world_size``: a row per variant with the median step time and its spread."""
    out = launch(_time_rank, world_size, variants, config, batch_size, seq_len, warmup, steps, timeout=900)[0]
    rows = []
    for (strategy, cap), result in out.items():
        rows.append({"world_size": world_size, "strategy": strategy, "cap": cap, "buckets": result["buckets"],
                     **step_times(result["times"])})
    return rows


def _find(rows: list[dict], n: int, strategy: str, cap: float) -> dict | None:
    return find(rows, world_size=n, strategy=strategy, cap=cap)


def _ratios(row: dict, rows: list[dict], reference: str = TORCH) -> tuple[float, float]:
    """Against ``reference`` at the same world size and cap: the ratio of the medians, and the median
    of the step-by-step ratios (the two steps of a pair ran back to back, so they saw the same load)."""
    ref = _find(rows, row["world_size"], reference, row["cap"])
    return row["median_ms"] / ref["median_ms"], paired_ratio(row["times"], ref["times"])


def strategy_table(rows: list[dict], cap: float) -> str:
    """Every strategy at one bucket cap (per_parameter ignores the cap), per world size."""
    head = (f"{'N':>2}  {'variant':<14}{'buckets':>8}{'median ms':>11}{'IQR ms':>16}{'vs torch':>10}"
            f"{'paired':>8}")
    lines = []
    for n in sorted({r["world_size"] for r in rows}):
        for r in filter(None, (_find(rows, n, strategy, cap) for strategy in STRATEGY_ORDER)):
            ratio, paired = _ratios(r, rows)
            lines.append(f"{n:>2}  {r['strategy']:<14}{r['buckets']:>8}{times_cell(r, 11)}"
                         f"{ratio_cell(ratio, 10)}{ratio_cell(paired, 8)}")
        ours = _find(rows, n, "overlapped", cap)
        if ours and _find(rows, n, TORCH_NOSYNC, cap):
            lines.append("    overlapped vs torch_nosync (like for like): %.2fx, paired %.2fx"
                         % _ratios(ours, rows, TORCH_NOSYNC))
    return text_table(head, lines)


def sweep_table(rows: list[dict]) -> str:
    """Overlapped against torch at every bucket cap."""
    head = (f"{'N':>2} {'cap MiB':>8} {'ours buckets':>13} {'overlapped ms':>14} {'torch buckets':>14} "
            f"{'torch ms':>9} {'ratio':>7} {'paired':>7}")
    lines = []
    for n in sorted({r["world_size"] for r in rows}):
        for cap in sorted({r["cap"] for r in rows if r["world_size"] == n and r["strategy"] == "overlapped"}):
            ours, ref = _find(rows, n, "overlapped", cap), _find(rows, n, TORCH, cap)
            ratio, paired = _ratios(ours, rows)
            lines.append(f"{n:>2} {cap:>8g} {ours['buckets']:>13} {ours['median_ms']:>14.1f} "
                         f"{ref['buckets']:>14} {ref['median_ms']:>9.1f} {ratio_cell(ratio, 7)} "
                         f"{ratio_cell(paired, 7)}")
    return text_table(head, lines)


def plot(rows: list[dict], title: str = ""):
    """Median step time against bucket cap, overlapped and torch, one panel per world size."""
    fig, axes, panels = world_panels(rows, 3.8, 3.4)
    for ax, (n, _) in zip(axes[0], panels):
        for strategy, label in (("overlapped", "overlapped (dtcourse)"), (TORCH, "torch DDP")):
            mine = sorted((r for r in rows if (r["world_size"], r["strategy"]) == (n, strategy)),
                          key=lambda r: r["cap"])
            caps = [r["cap"] for r in mine]
            line, = ax.plot(caps, [r["median_ms"] for r in mine], "o-", label=label)
            ax.fill_between(caps, [r["q1_ms"] for r in mine], [r["q3_ms"] for r in mine],
                            color=line.get_color(), alpha=0.2)
        # bucketed was timed at one cap: a level line. per_parameter is off the scale: in the title.
        others = {r["strategy"]: r for r in rows if r["world_size"] == n}
        if "bucketed" in others:
            ax.axhline(others["bucketed"]["median_ms"], color="gray", linestyle="--", linewidth=1,
                       label=f"bucketed ({others['bucketed']['cap']:g} MiB)")
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("bucket_cap_mb (MiB)")
        slow = others.get("per_parameter")
        note = f"; per_parameter {slow['median_ms']:.0f} ms" if slow else ""
        ax.set_title(f"N = {n}: median step (band: IQR){note}", fontsize=9)
    axes[0][-1].legend(fontsize=8)
    return finish(fig, title)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--caps", type=float, nargs="+", default=list(DEFAULT_CAPS),
                        help="bucket caps (MiB) swept for overlapped and torch")
    parser.add_argument("--cap", type=float, default=1.0, help="bucket cap (MiB) of the strategy table")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: 2 ranks, caps 0.05 1 25, 2 + 6 steps (too few to quote)")
    parser.add_argument("--out", default="bench-results/ddp_buckets.png")
    args = parser.parse_args(argv)
    if args.quick:
        args.world_sizes, args.caps, args.warmup, args.steps = [2], [0.05, 1.0, 25.0], 2, 6
    caps = sorted(set(args.caps) | {args.cap})
    # the variants compared in a ratio follow each other in the round, so their steps run back to back
    variants = []
    for c in caps:
        table = c == args.cap
        variants += [(s, c) for s in STRATEGY_ORDER if table or s in ("overlapped", TORCH)]
    params = sum(p.numel() for p in GPT(DDP_GPT).parameters())
    load_before, start = os.getloadavg(), time.perf_counter()
    rows = [row for n in args.world_sizes for row in measure(n, variants, warmup=args.warmup, steps=args.steps)]
    load_after = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, gloo, 1 thread per rank; "
          f"load average (1/5/15 min) {'/'.join(f'{x:.2f}' for x in load_before)} before, "
          f"{'/'.join(f'{x:.2f}' for x in load_after)} after; {time.perf_counter() - start:.0f} s")
    print(f"model: GPT {params / 1e3:.0f}k parameters ({4 * params / 2**20:.1f} MiB of gradients), "
          f"4 x 32 tokens per rank, AdamW; {args.steps} timed steps after {args.warmup} warm-up\n")
    print(f"Strategies at bucket_cap_mb = {args.cap:g}:\n{strategy_table(rows, args.cap)}\n")
    print(f"Bucket sweep:\n{sweep_table(rows)}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    plot(rows, f"GPT {params / 1e3:.0f}k params, gloo on {os.cpu_count()} CPUs").savefig(args.out, dpi=120)
    print(f"\nplot saved to {args.out}")


if __name__ == "__main__":
    main()
