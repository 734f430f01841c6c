"""Benchmark: step time of ZeRO stages 0-3 against DDP and FSDP2's ``fully_shard``, in one run.

    python -m dtcourse.bench.zero                    # 2 and 4 ranks, about 1.5-2 minutes on 2 cores
    python -m dtcourse.bench.zero --quick            # 2 ranks, a few steps: a smoke test, too few to quote
    python -m dtcourse.bench.zero --world-sizes 4 --steps 60

Model: a GPT (``dtcourse.models.DDP_GPT``, 867k parameters) on 8 sequences of 64 tokens per
rank, fp32, AdamW, one intra-op thread per rank. A step is forward, loss, backward, the optimizer
step and zero_grad. Per world size, one launch builds every variant (its own model copy and
optimizer) and the variants take turns step by step, starting one place later each round, so a
burst of load from elsewhere on the machine lands on all of them alike. A step lasts as long as
its slowest rank (an all-reduce MAX of the ranks' times, made after the round). The table gives
the median over the timed steps after warm-up, the interquartile range, and two paired ratios:
the median of the round-by-round ratios against FSDP2 and against torch DDP.

Variants:

* ``torch DDP``: ``torch.nn.parallel.DistributedDataParallel`` with ``forward_sync_buffers=False``
  (ZeRO and FSDP2 do not re-send the GPT's causal masks every forward either).
* ``dtcourse DDP``: ``dtcourse.data_parallel.DistributedDataParallel``, overlapped, same 25 MiB cap.
* ``ZeRO-0`` ... ``ZeRO-3``: ``dtcourse.zero.ZeRO`` with ``comm="backend"`` (gloo, asynchronous),
  its default units (``wte``, ``wpe``, each block, ``ln_f``, ``lm_head``); stage 3 with prefetch
  (the default), without (``ZeRO-3 no prefetch``) and with ``reshard_after_forward=False``
  (``ZeRO-3 keep``); and ``ZeRO-3 units=blocks``, stage 3 with FSDP2's grouping: the blocks are
  the units and everything else is the root, gathered once for the whole step.
* ``FSDP2``: ``torch.distributed.fsdp.fully_shard`` on each block, then on the root, with plain
  ``torch.optim.AdamW``: the reference of the target. ``FSDP2 fused AdamW`` is the same with
  ``fused=True``: plain AdamW loops over FSDP2's 50 DTensor parameters one by one in Python, where
  ZeRO steps one flat fp32 part per unit, so the fused one compares the rest of the step alike.

"sent" is what one rank sent in one more step's collectives, untimed, as ``dtcourse.runtime.observe``
records them (``lab.zero.collectives_of``: a bandwidth-optimal algorithm's bytes, padding included), beside the
formula: 2Ψ(N-1)/N for DDP, stages 0-2 and ``ZeRO-3 keep``, 3Ψ(N-1)/N for stage 3 and FSDP2, in
fp32 bytes, less Ψ_root(N-1)/N where the root unit stays gathered (marked ``*``). FSDP2's and DDP's
bytes are not counted, only the formula given.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from dtcourse.bench import (bars, find, finish, paired, ratio_cell, step_times, text_table, times_cell, turns,
                            world_panels)
from dtcourse.lab.zero import collectives_of
from dtcourse.models import DDP_GPT, GPT, GPTConfig, lm_loss, token_batch
from dtcourse.runtime.launch import launch
from dtcourse.runtime.observe import observe

FSDP2, FSDP2_FUSED, TORCH_DDP, ZERO3_BLOCKS = "FSDP2", "FSDP2 fused AdamW", "torch DDP", "ZeRO-3 units=blocks"
VARIANTS = (TORCH_DDP, "dtcourse DDP", "ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-3 no prefetch",
            "ZeRO-3 keep", ZERO3_BLOCKS, FSDP2, FSDP2_FUSED)
# the multiple of Ψ(N-1)/N elements each variant sends per step, as the formula gives it
SENT_FACTOR = {TORCH_DDP: 2, "dtcourse DDP": 2, "ZeRO-0": 2, "ZeRO-1": 2, "ZeRO-2": 2, "ZeRO-3": 3,
               "ZeRO-3 no prefetch": 3, "ZeRO-3 keep": 2, ZERO3_BLOCKS: 3, FSDP2: 3, FSDP2_FUSED: 3}
# sharded per block only: the rest (embeddings, ln_f, lm_head: Ψ_root) is the root unit, gathered
# once before forward and kept until backward ends, so it sends Ψ_root(N-1)/N less than 3Ψ(N-1)/N
KEEPS_ROOT = (ZERO3_BLOCKS, FSDP2, FSDP2_FUSED)
LR = 1e-3
Step = Callable[[torch.Tensor, torch.Tensor], None]     # (idx, targets): one training step


def _zero(stage: int, **options) -> Callable[[nn.Module], tuple[Step, bool]]:
    def build(model: nn.Module) -> tuple[Step, bool]:
        from dtcourse.zero import ZeRO
        wrapped = ZeRO(model, stage=stage, optimizer=functools.partial(torch.optim.AdamW, lr=LR), **options)

        def step(idx: torch.Tensor, targets: torch.Tensor) -> None:
            lm_loss(wrapped(idx), targets).backward()
            wrapped.step()
            wrapped.zero_grad()
        return step, True                               # its collectives are counted after the timing
    return build


def _replicated(wrap: Callable[[nn.Module], nn.Module], **adamw) -> Callable[[nn.Module], tuple[Step, bool]]:
    def build(model: nn.Module) -> tuple[Step, bool]:
        wrapped, optimizer = wrap(model), torch.optim.AdamW(model.parameters(), lr=LR, **adamw)

        def step(idx: torch.Tensor, targets: torch.Tensor) -> None:
            lm_loss(wrapped(idx), targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return step, False
    return build


def _fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _dtcourse_ddp(model: nn.Module) -> nn.Module:
    from dtcourse.data_parallel import DistributedDataParallel
    return DistributedDataParallel(model, strategy="overlapped", bucket_cap_mb=25, comm="backend")


BUILDERS = {
    TORCH_DDP: _replicated(lambda m: nn.parallel.DistributedDataParallel(m, forward_sync_buffers=False)),
    "dtcourse DDP": _replicated(_dtcourse_ddp),
    "ZeRO-0": _zero(0), "ZeRO-1": _zero(1), "ZeRO-2": _zero(2), "ZeRO-3": _zero(3),
    "ZeRO-3 no prefetch": _zero(3, prefetch=False),
    "ZeRO-3 keep": _zero(3, reshard_after_forward=False),
    ZERO3_BLOCKS: lambda m: _zero(3, units=[f"blocks.{i}" for i in range(len(m.blocks))])(m),
    FSDP2: _replicated(_fsdp2),
    FSDP2_FUSED: _replicated(_fsdp2, fused=True),
}


def _time_rank(variants: list[str], config: GPTConfig, batch_size: int, seq_len: int,
               warmup: int, steps: int) -> dict[str, dict]:
    """Inside every rank: the variants take turns for warmup + steps rounds; rank 0's answer is used."""
    idx, targets = token_batch(config, batch_size, seq_len, seed=dist.get_rank())   # this rank's data
    runs = {v: BUILDERS[v](GPT(config, seed=0)) for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(warmup + steps):
        order = turns(variants, i)                          # who goes first rotates
        elapsed = torch.zeros(len(variants), dtype=torch.float64)
        for v in order:
            step, _ = runs[v]
            dist.barrier()                               # every rank starts the step together
            start = time.perf_counter()
            step(idx, targets)
            elapsed[variants.index(v)] = time.perf_counter() - start
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)   # a step ends when the slowest rank's does
        if i >= warmup:
            for v, t in zip(variants, elapsed.tolist()):
                times[v].append(t)
    sent: dict[str, tuple[int, int]] = {}
    for v in variants:
        step, counted = runs[v]
        if counted:
            with observe() as log:                       # one more step, untimed, its collectives recorded
                step(idx, targets)
            mine = collectives_of(log)
            sent[v] = (sum(c.sent for c in mine), len(mine))
    return {v: {"times": times[v], "sent": sent.get(v, (None, None))} for v in variants}


def measure(world_size: int, variants: list[str] = list(VARIANTS), config: GPTConfig = DDP_GPT,
            batch_size: int = 8, seq_len: int = 64, warmup: int = 3, steps: int = 25) -> list[dict]:
    """One launch at ``world_size``: a row per variant with its step times, median, IQR and bytes sent."""
    out = launch(_time_rank, world_size, list(variants), config, batch_size, seq_len, warmup, steps,
                 timeout=900)[0]
    model = GPT(config)
    psi = sum(p.numel() for p in model.parameters())
    psi_root = psi - sum(p.numel() for p in model.blocks.parameters())
    rows = []
    for v, result in out.items():
        sent, collectives = result["sent"]
        rows.append({"world_size": world_size, "variant": v, **step_times(result["times"]), "sent": sent,
                     "collectives": collectives,
                     "formula": 4 * (SENT_FACTOR[v] * psi - (psi_root if v in KEEPS_ROOT else 0))
                                * (world_size - 1) / world_size})
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'N':>2}  {'variant':<20}{'median ms':>10}{'IQR ms':>16}{'vs FSDP2':>10}{'vs DDP':>8}"
            f"{'sent KiB':>10}{'formula':>9} {'colls':>6}")
    lines = []
    for r in rows:
        ratio_text = ratio_cell(paired(r, rows, FSDP2), 10) + ratio_cell(paired(r, rows, TORCH_DDP), 8)
        sent = f"{r['sent'] / 1024:>10.0f}" if r["sent"] is not None else f"{'-':>10}"
        mark = "*" if r["variant"] in KEEPS_ROOT else " "
        count = f"{r['collectives']:>6}" if r["collectives"] is not None else f"{'-':>6}"
        lines.append(f"{r['world_size']:>2}  {r['variant']:<20}{times_cell(r)}{ratio_text}"
                     f"{sent}{r['formula'] / 1024:>9.0f}{mark}{count}")
    return text_table(head, lines)


def plot(rows: list[dict], title: str = ""):
    """Median step time per variant (bars, IQR as error bars), one group per world size."""
    fig, axes, panels = world_panels(rows, 4.2, 3.6)
    for ax, (n, mine) in zip(axes[0], panels):
        colors = ["tab:gray" if r["variant"] in (FSDP2, FSDP2_FUSED, TORCH_DDP) else "tab:blue" for r in mine]
        bars(ax, [r["variant"] for r in mine], [(None, mine, colors)], rotation=60, ha="right", fontsize=7)
        ax.set_title(f"N = {n}: median step (bars: IQR)", fontsize=9)
    return finish(fig, title)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, metavar="VARIANT",
                        help=f"among: {', '.join(VARIANTS)}")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: 2 ranks, 4 x 32 tokens, 1 + 3 steps (too few to quote)")
    parser.add_argument("--out", default="bench-results/zero.png")
    args = parser.parse_args(argv)
    if args.quick:
        args.world_sizes, args.batch_size, args.seq_len, args.warmup, args.steps = [2], 4, 32, 1, 3
    params = sum(p.numel() for p in GPT(DDP_GPT).parameters())
    load_before, start = os.getloadavg(), time.perf_counter()
    rows = [row for n in args.world_sizes for row in measure(n, args.variants, DDP_GPT, args.batch_size,
                                                               args.seq_len, args.warmup, args.steps)]
    load_after = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, gloo, 1 thread per rank; "
          f"load average (1/5/15 min) {'/'.join(f'{x:.2f}' for x in load_before)} before, "
          f"{'/'.join(f'{x:.2f}' for x in load_after)} after; {time.perf_counter() - start:.0f} s")
    print(f"model: GPT {params / 1e3:.0f}k parameters (Ψ; {4 * params / 2**20:.2f} MiB in fp32), "
          f"{args.batch_size} x {args.seq_len} tokens per rank, AdamW; {args.steps} timed rounds after "
          f"{args.warmup} warm-up\n")
    print("vs FSDP2, vs DDP: median of the round-by-round ratios (paired). sent: one rank, one step, "
          "observed; formula: 2 or 3 Ψ(N-1)/N x 4 bytes (*: less Ψ_root(N-1)/N, the root stays "
          "gathered); colls: collectives per step\n")
    print(table(rows))
    for n in args.world_sizes:
        ours = find(rows, world_size=n, variant="ZeRO-3")
        ratios = [(ref, paired(ours, rows, ref) if ours else None) for ref in (FSDP2, FSDP2_FUSED)]
        if ratios[0][1] is not None:
            print(f"\nN = {n}: ZeRO-3 (prefetch) / FSDP2 = {ratios[0][1]:.2f}x paired (target <= 1.2x)"
                  + (f"; / {FSDP2_FUSED} = {ratios[1][1]:.2f}x" if ratios[1][1] is not None else ""), end="")
    print()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    plot(rows, f"GPT {params / 1e3:.0f}k params, gloo on {os.cpu_count()} CPUs").savefig(args.out, dpi=120)
    print(f"\nplot saved to {args.out}")


if __name__ == "__main__":
    main()
