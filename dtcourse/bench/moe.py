"""Benchmark: step time of the expert-parallel MoE GPT, padded against dropless, and against all experts on every rank.

    python -m dtcourse.bench.moe                 # 2 and 4 ranks, about a minute on 2 cores
    python -m dtcourse.bench.moe --quick         # 2 ranks, a few steps: a smoke test, too few to quote

Model: an MoE GPT (``MOE_GPT``: 2 layers, d_model 64, E = 8 experts, top-2) on 8 sequences of 64 tokens per
rank, fp32, AdamW, one intra-op thread per rank. A step is zero_grad, forward, loss (the auxiliary losses
train through the output), backward, the gradient synchronisation and the optimizer step. Per world size,
one launch builds every variant and they take turns step by step, the first place rotating, so a burst of
load elsewhere lands on all alike; a step lasts as long as its slowest rank (all-reduce MAX).

Variants (each rank routes its own tokens, one GShard group):

* ``EP padded`` / ``EP dropless``: ``dtcourse.moe.ExpertParallel``, E/N experts per rank, tokens moved by
  all-to-all; capacity factor 1.25 with E x C padded slots, or dropless with the counts exchanged first.
  The non-expert gradients are all-reduced over the N ranks.
* ``all experts padded`` / ``all experts dropless``: every rank holds every expert (plain data
  parallelism of the MoE GPT): no all-to-all, but every expert's gradient is all-reduced, and every rank
  keeps E experts' weights and optimizer states.

Both run each token through its k experts, so the FLOPs are the same: the table shows what the exchange
costs. "a2a KiB" is what one rank sent in one more step's all-to-alls (observed, untimed), beside the formula for
the padded mode: 4 exchanges per MoE layer (dispatch and combine, forward and backward) of (N-1)/N x E x C
rows of d_model float32s, plus one exchange per layer of (N-1)/N x E int64 counts of filled slots (so that an
expert no token reached does not run). "all-reduce KiB" is the formula 2(N-1)/N x bytes of the all-reduced gradients.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch
import torch.distributed as dist

from dtcourse.bench import bars, finish, paired, ratio_cell, step_times, text_table, times_cell, turns, world_panels
from dtcourse.models import GPT, GPTConfig, lm_loss, token_batch
from dtcourse.models.moe import capacity
from dtcourse.lab.moe import exchanges_of
from dtcourse.moe import ExpertParallel
from dtcourse.runtime.observe import observe
from dtcourse.runtime.launch import launch

MOE_GPT = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, d_model=64, n_expert=8, top_k=2)
CAPACITY_FACTOR = 1.25
VARIANTS = ("EP padded", "EP dropless", "all experts padded", "all experts dropless")
adamw = functools.partial(torch.optim.AdamW, lr=1e-3)


def _config(variant: str, config: GPTConfig) -> GPTConfig:
    cf = CAPACITY_FACTOR if variant.endswith("padded") else None
    return GPTConfig(**{**config.__dict__, "capacity_factor": cf, "moe_groups": 1})


def _expert_parallel(model: GPT):
    ep = ExpertParallel(model, None, adamw)

    def step(idx, targets):
        ep.zero_grad()
        ep.forward_backward(idx, targets, lm_loss)
        ep.step()

    def sent(idx, targets) -> int:
        with observe() as log:                          # one more step, untimed, its exchanges recorded
            step(idx, targets)
        return exchanges_of(log).total("sent")
    return step, sent


def _all_experts(model: GPT):
    optimizer, n = adamw(model.parameters()), dist.get_world_size()

    def step(idx, targets):
        optimizer.zero_grad(set_to_none=True)
        lm_loss(model(idx), targets).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)                                  # sends 2(N-1)/N * flat.nbytes per rank
        for g, summed in zip(grads, flat.div_(n).split([g.numel() for g in grads])):
            g.copy_(summed.view_as(g))
        optimizer.step()
    return step, None


def _time_rank(variants: list[str], config: GPTConfig, batch_size: int, seq_len: int, warmup: int,
               steps: int) -> dict[str, dict]:
    """Inside every rank: the variants take turns for warmup + steps rounds; rank 0's answer is used."""
    runs = {v: (_expert_parallel if v.startswith("EP") else _all_experts)(GPT(_config(v, config), seed=0))
            for v in variants}
    idx, targets = token_batch(config, batch_size, seq_len, seed=dist.get_rank())   # this rank's data
    times: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(warmup + steps):
        order = turns(variants, i)                          # who goes first rotates
        elapsed = torch.zeros(len(variants), dtype=torch.float64)
        for v in order:
            step, _ = runs[v]
            dist.barrier()
            start = time.perf_counter()
            step(idx, targets)
            elapsed[variants.index(v)] = time.perf_counter() - start
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)         # a step ends when the slowest rank's does
        if i >= warmup:
            for v, t in zip(variants, elapsed.tolist()):
                times[v].append(t)
    sent = {v: None if runs[v][1] is None else runs[v][1](idx, targets) for v in variants}
    return {v: {"times": times[v], "sent": sent[v]} for v in variants}


def measure(world_size: int, variants: list[str] = list(VARIANTS), config: GPTConfig = MOE_GPT,
            batch_size: int = 8, seq_len: int = 64, warmup: int = 3, steps: int = 20) -> list[dict]:
    """One launch at ``world_size``: a row per variant with its step times, bytes sent and their formulas."""
    if config.n_expert % world_size:
        raise ValueError(f"bench.moe: {config.n_expert} experts do not spread over {world_size} ranks; "
                         f"use world sizes that divide {config.n_expert}.")
    out = launch(_time_rank, world_size, list(variants), config, batch_size, seq_len, warmup, steps, timeout=900)[0]
    model, share = GPT(config), (world_size - 1) / world_size
    psi = sum(p.numel() for p in model.parameters())
    psi_experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    C = capacity(batch_size * seq_len, config.n_expert, config.top_k, CAPACITY_FACTOR)
    rows = []
    for v, result in out.items():
        ep = v.startswith("EP")
        rows_sent = 4 * config.n_layer * share * config.n_expert * C * config.d_model * 4
        counts_sent = config.n_layer * share * config.n_expert * 8        # the filled slots' counts, int64
        a2a = rows_sent + counts_sent if v == "EP padded" else None
        rows.append({"world_size": world_size, "variant": v, **step_times(result["times"]), "a2a_sent": result["sent"],
                     "a2a_formula": a2a, "all_reduce": 2 * share * 4 * (psi - psi_experts if ep else psi),
                     "experts_per_rank": config.n_expert // world_size if ep else config.n_expert})
    return rows


REFERENCE = {"EP padded": "all experts padded", "EP dropless": "all experts dropless"}


def table(rows: list[dict]) -> str:
    head = (f"{'N':>2}  {'variant':<22}{'experts':>8}{'median ms':>10}{'IQR ms':>16}{'vs all':>8}{'vs padded':>10}"
            f"{'a2a KiB':>9}{'formula':>9}{'all-reduce KiB':>15}")
    lines = []
    for r in rows:
        vs_all = paired(r, rows, REFERENCE[r["variant"]]) if r["variant"] in REFERENCE else None
        vs_padded = paired(r, rows, "EP padded") if r["variant"] == "EP dropless" else None
        a2a = "".join(f"{x / 1024:>9.1f}" if x is not None else f"{'-':>9}" for x in (r["a2a_sent"], r["a2a_formula"]))
        lines.append(f"{r['world_size']:>2}  {r['variant']:<22}{r['experts_per_rank']:>8}{times_cell(r)}"
                     f"{ratio_cell(vs_all, 8)}{ratio_cell(vs_padded, 10)}{a2a}{r['all_reduce'] / 1024:>15.1f}")
    return text_table(head, lines)


def plot(rows: list[dict], title: str = ""):
    """Median step time per variant (bars, IQR as error bars), one panel per world size."""
    fig, axes, panels = world_panels(rows, 3.6, 3.2)
    for ax, (n, mine) in zip(axes[0], panels):
        colors = ["tab:blue" if r["variant"].startswith("EP") else "tab:gray" for r in mine]
        bars(ax, [r["variant"] for r in mine], [(None, mine, colors)], rotation=40, ha="right", fontsize=7)
        ax.set_title(f"N = {n}: median step (bars: IQR)", fontsize=9)
    return finish(fig, title)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a smoke test: 2 ranks, 4 x 32 tokens, 1 + 3 steps")
    parser.add_argument("--out", default="bench-results/moe.png")
    args = parser.parse_args(argv)
    if args.quick:
        args.world_sizes, args.batch_size, args.seq_len, args.warmup, args.steps = [2], 4, 32, 1, 3
    params = sum(p.numel() for p in GPT(MOE_GPT).parameters())
    load_before, start = os.getloadavg(), time.perf_counter()
    rows = [row for n in args.world_sizes
            for row in measure(n, list(VARIANTS), MOE_GPT, args.batch_size, args.seq_len, args.warmup, args.steps)]
    load_after = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, gloo, 1 thread per rank; load average "
          f"(1/5/15 min) {'/'.join(f'{x:.2f}' for x in load_before)} before, "
          f"{'/'.join(f'{x:.2f}' for x in load_after)} after; {time.perf_counter() - start:.0f} s")
    print(f"model: MoE GPT {params / 1e3:.0f}k parameters, E = {MOE_GPT.n_expert}, top-{MOE_GPT.top_k}, "
          f"capacity factor {CAPACITY_FACTOR} (padded); {args.batch_size} x {args.seq_len} tokens per rank, AdamW; "
          f"{args.steps} timed rounds after {args.warmup} warm-up\n")
    print("vs all: paired ratio to all experts on every rank in the same mode; vs padded: dropless / padded. "
          "a2a: one rank's all-to-all bytes per step; all-reduce: the formula, 2(N-1)/N x gradient bytes\n")
    print(table(rows))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    plot(rows, f"MoE GPT {params / 1e3:.0f}k params, gloo on {os.cpu_count()} CPUs").savefig(args.out, dpi=120)
    print(f"\nplot saved to {args.out}")


if __name__ == "__main__":
    main()
