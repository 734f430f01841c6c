"""Benchmark: step time of 3D plans on 8 ranks (data × pipeline × tensor, ZeRO over dp), paired against pure data
parallelism in the same run.

    python -m dtcourse.bench.parallel_3d              # the issue's six factorisations of 8 ranks, 2 + 10 rounds
    python -m dtcourse.bench.parallel_3d --quick      # 1 + 2 rounds: a smoke test, too few to quote

Model: ``BENCH_GPT``, a GPT of 4 blocks, d_model 64, 4 heads, vocabulary 256 (0.3M parameters), on a global
batch of 32 sequences of 32 tokens, fp32, AdamW, one intra-op thread per rank. Each plan is built by
``dtcourse.parallel_3d.parallelize`` on its own ``GPT(BENCH_GPT, seed=0)`` and mesh; one step is
``train_step`` on the rank's replica's rows (m = 4 micro-batches, the optimizer at the schedule's STEPs).
The plans take turns round by round, each round starting one place later; a step lasts as long as its slowest
rank (an all-reduce MAX of the ranks' times). "vs DP" is the median of the round-by-round ratios of a plan's
step to the pure data-parallel plan's (8, 1, 1) in the same round, with quartiles. "sent" is what rank 0 sends
in one step over tp, pp and dp, from ``parallel_3d.cost.step_bytes`` (tests check it against the counted bytes).

On a 2-core machine 8 ranks take turns on the cores: the times then measure CPU work and the scheduler more
than links, so the ranking says which plan does least work per core, not which would win on a cluster (lesson
10's planner models links). On a machine with a GPU per rank, ``launch`` picks nccl.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch
import torch.distributed as dist

from dtcourse.bench import paired_ratio, ratio_cell, step_times, text_table, times_cell, turns
from dtcourse.mesh import build_groups
from dtcourse.models import GPT, GPTConfig, token_batch
from dtcourse.parallel_3d import Plan, parallelize
from dtcourse.parallel_3d.cost import step_bytes
from dtcourse.runtime.launch import launch

BENCH_GPT = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, d_model=64)
ROWS, M = 32, 4
# (dp, pp, tp, ZeRO stage, schedule, v): the factorisations of 8 ranks that issue 32 names, pure DP first
PLANS = [(8, 1, 1, 1, "1f1b", 1), (2, 2, 2, 1, "1f1b", 1), (1, 2, 4, 1, "interleaved_1f1b", 2),
         (2, 1, 4, 3, "1f1b", 1), (4, 2, 1, 3, "1f1b", 1), (1, 4, 2, 1, "1f1b", 1)]
adamw = functools.partial(torch.optim.AdamW, lr=1e-3)


def _name(plan: tuple) -> str:
    dp, pp, tp, stage, schedule, v = plan
    return f"({dp},{pp},{tp}) ZeRO-{stage} {schedule}" + (f" v={v}" if v > 1 else "")


def _time_rank(plans: list[tuple], warmup: int, steps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    built = {}
    for p in plans:
        dp, pp, tp, stage, schedule, v = p
        plan = Plan(dp=dp, pp=pp, tp=tp, zero_stage=stage, schedule=schedule, microbatches=M, v=v)
        built[p] = (plan, parallelize(GPT(BENCH_GPT, seed=0), build_groups(plan.dims), plan, adamw))
    x, y = token_batch(BENCH_GPT, ROWS, seed=0)
    times: dict[tuple, list[float]] = {p: [] for p in plans}
    for i in range(warmup + steps):
        elapsed = torch.zeros(len(plans), dtype=torch.float64)
        for p in turns(plans, i):
            plan, model = built[p]
            xs, ys = plan.split(x, rank, world), plan.split(y, rank, world)
            model.zero_grad()
            dist.barrier()                                # every rank starts the step together
            start = time.perf_counter()
            model.train_step(xs, ys)
            elapsed[plans.index(p)] = time.perf_counter() - start
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)    # a step ends when the slowest rank's does
        if i >= warmup:
            for p, t in zip(plans, elapsed.tolist()):
                times[p].append(t)
    sent = {}
    for p, (plan, model) in built.items():                # this rank's bytes per group, by the formulas
        sent[p] = step_bytes(model.held_stages(), plan.microbatch_rows(ROWS), BENCH_GPT.block_size, BENCH_GPT.d_model,
                             plan.tp, plan.dp, plan.zero_stage)
    return {"times": times, "sent": sent}


def measure(plans: list[tuple] = PLANS, warmup: int = 2, steps: int = 10) -> list[dict]:
    """One launch of every plan's ranks (all plans must use the same number); a row per plan, the first the
    reference of the paired ratios."""
    world = {p[0] * p[1] * p[2] for p in plans}
    if len(world) != 1:
        raise ValueError(f"measure: every plan must use the same number of ranks, got {sorted(world)}.")
    out = launch(_time_rank, world.pop(), plans, warmup, steps, timeout=900)[0]
    reference = out["times"][plans[0]]
    rows = []
    for p in plans:
        ratios = [a / b for a, b in zip(out["times"][p], reference)]
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        rows.append({"plan": _name(p), "step": step_times(out["times"][p]), "ratio": paired_ratio(out["times"][p],
                     reference), "ratio_q1": q1, "ratio_q3": q3, "sent": out["sent"][p]})
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'plan (dp,pp,tp)':<34}{'step ms':>10}{'IQR':>14}{'vs DP':>8}{'IQR':>14}"
            f"{'tp KiB':>8}{'pp KiB':>8}{'dp KiB':>8}")
    lines = [f"{r['plan']:<34}{times_cell(r['step'], 10, 7)}{ratio_cell(r['ratio'], 8)}"
             f"{r['ratio_q1']:>7.2f} - {r['ratio_q3']:<5.2f}"
             + "".join(f"{r['sent'][k] / 1024:>8.0f}" for k in ("tp", "pp", "dp")) for r in rows]
    return text_table(head, lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="1 + 2 rounds: a smoke test, too few to quote")
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.steps = 1, 2
    load_before, start = os.getloadavg(), time.perf_counter()
    rows = measure(PLANS, args.warmup, args.steps)
    load_after = os.getloadavg()
    params = sum(q.numel() for q in GPT(BENCH_GPT).parameters())
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, 8 ranks, 1 thread per rank; load average "
          f"(1/5/15 min) {'/'.join(f'{x:.2f}' for x in load_before)} before, "
          f"{'/'.join(f'{x:.2f}' for x in load_after)} after; {time.perf_counter() - start:.0f} s")
    print(f"model: GPT {params / 1e6:.2f}M parameters, {BENCH_GPT.n_layer} blocks, d_model {BENCH_GPT.d_model}; "
          f"{ROWS} x {BENCH_GPT.block_size} tokens a step, m = {M}, AdamW; {args.steps} rounds after {args.warmup}")
    print("\nvs DP: median (and quartiles) of the round-by-round ratios to (8,1,1) ZeRO-1 (paired). KiB: what rank 0 "
          "sends per step over each group (parallel_3d.cost.step_bytes)\n")
    print(table(rows))


if __name__ == "__main__":
    main()
