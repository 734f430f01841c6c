"""Benchmark: step time of the course's tensor-parallel GPT (TP and TP+SP) against the DTensor plan, in one run.

    python -m dtcourse.bench.tensor_parallel              # t = 2 and 4, 75-85 s on 2 cores; plot in bench-results/
    python -m dtcourse.bench.tensor_parallel --quick      # t = 2 and 4, a few steps: a smoke test, too few to quote
    python -m dtcourse.bench.tensor_parallel --world-sizes 2 --steps 60

Model: ``TP_GPT``, a GPT of 4 blocks with d_model 256, 8 heads and 1024 tokens (3.7M parameters; t = 4
splits the heads, the 1024-wide MLP and the vocabulary evenly), on one batch of 8 sequences of 64
tokens that every rank sees whole (tensor parallelism splits the model, not the data), fp32, AdamW, one
intra-op thread per rank. A step is zero_grad, forward, the vocab-parallel loss, backward and the optimizer
step. Per layout (``TP``: Megatron's; ``TP+SP``: with sequence parallelism) it runs twice, each time on its
own ``GPT(TP_GPT, seed=0)``:

* ``dtcourse``: ``dtcourse.tensor_parallel.TensorParallel``'s model and optimizer, driven as its
  ``forward_backward`` does (``vocab_parallel_lm_loss``; under SP its hook sums the replicated gradients)
  but without gathering the full logits, which it does for the parity check only.
* ``DTensor``: ``dtcourse.parity.DTensorPlan`` (``parallelize_module`` with ``ColwiseParallel`` /
  ``RowwiseParallel``, ``SequenceParallel`` on the LayerNorms under SP, and ``loss_parallel``), likewise
  without its ``full_tensor()`` of the logits.

Per world size, one launch builds the four variants and they take turns step by step, starting one place
later each round, so a burst of load from elsewhere on the machine lands on all of them alike. A step lasts
as long as its slowest rank (an all-reduce MAX of the ranks' times, made after the round). "vs DTensor" is
the median of the round-by-round ratios of the course's step to the DTensor plan's in the same layout
(paired), with their quartiles. "sent" is what one rank of the course's model sent in one more step, untimed, as
``dtcourse.runtime.observe`` records it (bytes of bandwidth-optimal algorithms, ``lab.tensor_parallel.traffic_of``).

With more ranks than CPU cores (t = 4 on a 2-core machine) the ranks take turns on the cores: the step
times then include the operating system's scheduling, and the ratio is a comparison under oversubscription.
On a machine with a GPU per rank, ``launch`` picks nccl and each rank runs on its GPU (``dtcourse.device()``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from dtcourse.bench import (bars, finish, paired_ratio, ratio_cell, step_times, text_table, times_cell,
                            turns, world_panels)
from dtcourse.models import GPT, GPTConfig, lm_loss, token_batch
from dtcourse.runtime.device import device
from dtcourse.runtime.launch import launch

# t = 4 divides the 8 heads, the 4 x 256 MLP width and the vocabulary; a step is tens of milliseconds
TP_GPT = GPTConfig(vocab_size=1024, block_size=64, n_layer=4, n_head=8, d_model=256)
LAYOUTS = ("TP", "TP+SP")
ENGINES = ("dtcourse", "DTensor")
LR = 1e-3
Step = Callable[[torch.Tensor, torch.Tensor], None]     # (idx, targets): one training step


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def _ours(model: GPT, sp: bool) -> tuple[Step, Callable[[torch.Tensor, torch.Tensor], int]]:
    from dtcourse.tensor_parallel import TensorParallel, vocab_parallel_lm_loss

    from dtcourse.lab.tensor_parallel import traffic_of
    from dtcourse.runtime.observe import observe

    tp = TensorParallel(model, None, _adamw, sequence_parallel=sp)

    def step(idx: torch.Tensor, targets: torch.Tensor) -> None:
        tp.zero_grad()
        logits = tp.model(idx)                          # (B, T, V/t): no gather of the full logits
        vocab_parallel_lm_loss(logits, targets, tp.group).backward()   # SP's grads summed by a hook
        tp.step()

    def sent(idx: torch.Tensor, targets: torch.Tensor) -> int:
        with observe() as log:                          # one more step, untimed, its collectives recorded
            step(idx, targets)
        return traffic_of(log).total("sent")
    return step, sent


def _dtensor(model: GPT, sp: bool) -> tuple[Step, None]:
    from torch.distributed.tensor.parallel import loss_parallel

    from dtcourse.parity import DTensorPlan

    plan = DTensorPlan(model, None, _adamw, sequence_parallel=sp)

    def step(idx: torch.Tensor, targets: torch.Tensor) -> None:
        plan.zero_grad()
        logits = plan.model(idx)                        # DTensor (B, T, V), Shard(-1): no full_tensor()
        with loss_parallel():
            lm_loss(logits, targets).backward()
        plan.step()
    return step, None


BUILDERS = {"dtcourse": _ours, "DTensor": _dtensor}


def _time_rank(config: GPTConfig, batch_size: int, seq_len: int, warmup: int, steps: int) -> dict:
    """Inside every rank: the four variants take turns for warmup + steps rounds; rank 0's answer is used."""
    dev = device()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    idx, targets = (t.to(dev) for t in token_batch(config, batch_size, seq_len, seed=0))   # the same on every rank
    variants = [(layout, engine) for layout in LAYOUTS for engine in ENGINES]
    runs = {var: BUILDERS[var[1]](GPT(config, seed=0).to(dev), var[0] == "TP+SP") for var in variants}
    times: dict[tuple[str, str], list[float]] = {var: [] for var in variants}
    for i in range(warmup + steps):
        order = turns(variants, i)                          # who goes first rotates
        elapsed = torch.zeros(len(variants), dtype=torch.float64, device=dev)
        for var in order:
            step, _ = runs[var]
            sync()
            dist.barrier()                               # every rank starts the step together
            start = time.perf_counter()
            step(idx, targets)
            sync()
            elapsed[variants.index(var)] = time.perf_counter() - start
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)   # a step ends when the slowest rank's does
        if i >= warmup:
            for var, t in zip(variants, elapsed.tolist()):
                times[var].append(t)
    sent = {layout: runs[(layout, "dtcourse")][1](idx, targets) for layout in LAYOUTS}
    return {"times": times, "sent": sent, "device": str(dev), "backend": dist.get_backend()}


def measure(world_size: int, config: GPTConfig = TP_GPT, batch_size: int = 8, seq_len: int = 64,
            warmup: int = 3, steps: int = 30) -> list[dict]:
    """One launch at ``world_size`` = t: a row per layout, with both engines' step times and the paired ratio."""
    out = launch(_time_rank, world_size, config, batch_size, seq_len, warmup, steps, timeout=900)[0]
    rows = []
    for layout in LAYOUTS:
        row = {"world_size": world_size, "layout": layout, "sent": out["sent"][layout],
               "device": out["device"], "backend": out["backend"]}
        for engine in ENGINES:
            row[engine] = step_times(out["times"][(layout, engine)])
        ours, theirs = row["dtcourse"]["times"], row["DTensor"]["times"]
        ratios = [a / b for a, b in zip(ours, theirs)]
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        row.update(ratio=paired_ratio(ours, theirs), ratio_q1=q1, ratio_q3=q3)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'t':>2}  {'layout':<7}{'dtcourse ms':>12}{'IQR':>14}{'DTensor ms':>12}{'IQR':>14}"
            f"{'vs DTensor':>12}{'IQR':>14}{'sent KiB':>10}")
    lines = []
    for r in rows:
        cells = "".join(times_cell(r[e], 12, 7) for e in ENGINES)
        lines.append(f"{r['world_size']:>2}  {r['layout']:<7}{cells}{ratio_cell(r['ratio'], 12)}"
                     f"{r['ratio_q1']:>7.2f} - {r['ratio_q3']:<5.2f}{r['sent'] / 1024:>10.0f}")
    return text_table(head, lines)


def plot(rows: list[dict], title: str = ""):
    """Per world size: median step time of each engine per layout (IQR as error bars)."""
    fig, axes, panels = world_panels(rows, 3.6, 3.4)
    for ax, (t, mine) in zip(axes[0], panels):
        bars(ax, [r["layout"] for r in mine], [(engine, [r[engine] for r in mine], color) for engine, color
                                               in (("dtcourse", "tab:blue"), ("DTensor", "tab:gray"))], fontsize=8)
        for x, r in enumerate(mine):
            ax.annotate(f"{r['ratio']:.2f}x", (x, max(r[e]["q3_ms"] for e in ENGINES)), ha="center",
                        va="bottom", fontsize=7)
        ax.set_title(f"t = {t}: median step (bars: IQR)", fontsize=9)
    axes[0][0].legend(fontsize=7)
    return finish(fig, title)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], help="tensor-parallel sizes t")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences, the same on every rank")
    parser.add_argument("--seq-len", type=int, default=64, help="a multiple of every t (sequence parallelism)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: 2 x 32 tokens, 1 + 3 steps (too few to quote)")
    parser.add_argument("--out", default="bench-results/tensor_parallel.png")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_size, args.seq_len, args.warmup, args.steps = 2, 32, 1, 3
    bad = [t for t in args.world_sizes if args.seq_len % t]
    if bad:
        parser.error(f"sequence parallelism splits the {args.seq_len} tokens of a sequence over t ranks; "
                     f"t = {bad[0]} does not divide them: pick --seq-len among multiples of {bad[0]}.")
    params = sum(q.numel() for q in GPT(TP_GPT).parameters())
    load_before, start = os.getloadavg(), time.perf_counter()
    rows = [row for t in args.world_sizes for row in measure(t, TP_GPT, args.batch_size, args.seq_len,
                                                               args.warmup, args.steps)]
    load_after = os.getloadavg()
    cpus = os.cpu_count() or 1
    backends = ", ".join(sorted({f"{r['backend']} on {r['device']}" for r in rows}))
    print(f"machine: {cpus} CPUs, torch {torch.__version__}, {backends}, 1 thread per rank; "
          f"load average (1/5/15 min) {'/'.join(f'{x:.2f}' for x in load_before)} before, "
          f"{'/'.join(f'{x:.2f}' for x in load_after)} after; {time.perf_counter() - start:.0f} s")
    print(f"model: GPT {params / 1e6:.1f}M parameters, {TP_GPT.n_layer} blocks, d_model {TP_GPT.d_model}, "
          f"{TP_GPT.n_head} heads, vocabulary {TP_GPT.vocab_size}; {args.batch_size} x {args.seq_len} tokens "
          f"on every rank, AdamW; {args.steps} timed rounds after {args.warmup} warm-up")
    over = [t for t in args.world_sizes if t > cpus and all(r["device"] == "cpu" for r in rows)]
    if over:
        print(f"oversubscribed: t = {', '.join(map(str, over))} runs more ranks than the {cpus} CPUs, which the "
              f"ranks share: those times include the scheduler's turns")
    print("\nvs DTensor: median (and quartiles) of the round-by-round ratios dtcourse / DTensor (paired), same "
          "layout. sent: one rank of the course's model, one step, as the observer records it\n")
    print(table(rows))
    for t in args.world_sizes:
        mine = [r for r in rows if r["world_size"] == t]
        print(f"\nt = {t}: dtcourse / DTensor = " + ", ".join(f"{r['layout']} {r['ratio']:.2f}x" for r in mine)
              + " (paired; target <= 1.2x)", end="")
    print()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    plot(rows, f"GPT {params / 1e6:.1f}M params, {args.batch_size} x {args.seq_len} tokens, {backends}, "
               f"{cpus} CPUs").savefig(args.out, dpi=120)
    print(f"\nplot saved to {args.out}")


if __name__ == "__main__":
    main()
