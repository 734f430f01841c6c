"""Benchmark: step time of the course's pipeline executor against ``torch.distributed.pipelining``, per schedule.

    python -m dtcourse.bench.pipeline                # p = 2 and 4, about 1-2 minutes on 2 cores
    python -m dtcourse.bench.pipeline --quick        # p = 2, a few steps: a smoke test, too few to quote
    python -m dtcourse.bench.pipeline --world-sizes 4 --steps 40 --schedules 1f1b zb_h1

Model: ``PIPE_GPT``, a GPT of 8 blocks (so p = 4 ranks with v = 2 chunks each still give every stage
one block), on a global batch of 16 sequences of 64 tokens cut into m = 8 micro-batches, fp32, AdamW,
one intra-op thread per rank. A step is zero_grad, the schedule (forwards, backwards, the messages
between stages) and the optimizer step. Every schedule runs twice, on the same ``split_gpt`` stages:

* ``dtcourse``: ``dtcourse.pipeline.run_schedule`` with the course's ``PipelineExecutor`` and the
  schedule of ``dtcourse.pipeline.schedules`` (``gpipe``, ``one_f_one_b``, ``interleaved_1f1b`` with
  v = 2, ``zb_h1``), lowered by ``with_communication`` as ``run_schedule`` does at every step.
* ``torch``: ``PipelineStage`` and the schedule of the same order (tests/test_pipeline_schedules.py
  checks it action by action): ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``
  (v = 2) and ``ScheduleInterleavedZeroBubble`` with one stage per rank, which is ZB-H1.

Per world size, one launch builds every variant (its own model copy and optimizer) and they take
turns step by step, starting one place later each round, so a burst of load from elsewhere on the
machine lands on all of them alike. A step lasts as long as its slowest rank (an all-reduce MAX of
the ranks' times, made after the round). "vs torch" is the median of the round-by-round ratios of
the course's step to torch's for the same schedule (paired).

Bubble: the course's executor records every action as a span of its ``Timeline``. Per step, the
window runs from the first compute span to the last on any rank; rank r idles 1 - busy_r / window
of it, where busy_r sums r's F, B, I and W spans (sends, receives and waits count as idle); the
bubble is 1 - sum busy_r / (p · window), as ``dtcourse.pipeline.simulate`` defines it, beside
``bubble_formula`` (which assumes t_b = 2 t_f, and for ZB-H1 t_f = t_i = t_w) and ``simulate`` fed with
the measured mean F, B, I and W times ("sim"). "wait" and "post" split the idle time: the shares of the
p · window rank-time spent waiting for a message (the schedule's own bubble included) and posting
``batch_isend_irecv``; the rest is time between spans (Python between actions, descheduling).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from dtcourse.bench import bars, finish, paired_ratio, ratio_cell, step_times, text_table, turns, world_panels
from dtcourse.models import GPT, GPTConfig, lm_loss, token_batch
from dtcourse.pipeline import schedules
from dtcourse.pipeline.execute import PipelineExecutor, run_schedule
from dtcourse.pipeline.partition import gpt_boundary_shape, split_gpt, stages_of_rank
from dtcourse.pipeline.cost import bubble_formula
from dtcourse.pipeline.simulate import simulate
from dtcourse.runtime.launch import launch
from dtcourse.runtime.timeline import Timeline

# 8 blocks: p·v = 8 stages at p = 4, v = 2, one block each (the first with the embeddings, the last with the head)
PIPE_GPT = GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=4, d_model=64)
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
TORCH_SCHEDULE = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                  "interleaved_1f1b": "ScheduleInterleaved1F1B", "zb_h1": "ScheduleInterleavedZeroBubble"}
CHUNKS = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1}     # v, stages per rank
ENGINES = ("dtcourse", "torch")
COMPUTE_SPANS = ("forward", "backward", "backward_input", "backward_weight")
LR = 1e-3
Step = Callable[[torch.Tensor, torch.Tensor], None]     # (idx, targets): one training step


def _ours(name: str, model: GPT, m: int) -> tuple[Step, Timeline]:
    rank, p, v = dist.get_rank(), dist.get_world_size(), CHUNKS[name]
    stages = split_gpt(model, p * v)
    mine = {s: stages[s] for s in stages_of_rank(rank, p, v)}
    timeline = Timeline(origin=0.0)                      # absolute perf_counter seconds: one clock for all ranks
    executor = PipelineExecutor(mine, p * v, gpt_boundary_shape(model), timeline=timeline)
    optimizer = torch.optim.AdamW([q for st in mine.values() for q in st.parameters()], lr=LR)
    schedule = schedules.build(name, p, m, CHUNKS[name])

    def step(idx: torch.Tensor, targets: torch.Tensor) -> None:
        timeline.restart(0.0)                            # keep this step's spans only
        run_schedule(executor, schedule, idx, targets, lm_loss, m, optimizer)
    return step, timeline


def _torch(name: str, model: GPT, m: int) -> tuple[Step, None]:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules

    rank, p, v = dist.get_rank(), dist.get_world_size(), CHUNKS[name]
    stages = split_gpt(model, p * v)
    mine = [stages[s] for s in stages_of_rank(rank, p, v)]
    torch_stages = [PipelineStage(stages[s], s, p * v, torch.device("cpu")) for s in stages_of_rank(rank, p, v)]
    cls = getattr(torch_schedules, TORCH_SCHEDULE[name])
    multi = issubclass(cls, torch_schedules.PipelineScheduleMulti)   # takes a list of stages, even of one
    schedule = cls(torch_stages if multi else torch_stages[0], m, loss_fn=lm_loss)
    optimizer = torch.optim.AdamW([q for st in mine for q in st.parameters()], lr=LR)
    first, last = rank == 0, rank == (p * v - 1) % p      # stage 0 and stage p·v - 1 live there

    def step(idx: torch.Tensor, targets: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        schedule.step(*([idx] if first else []), target=targets if last else None)
        optimizer.step()
    return step, None


BUILDERS = {"dtcourse": _ours, "torch": _torch}


def _step_summary(timeline: Timeline) -> dict:
    """This rank's last step, from its spans: compute start/end, seconds per span kind and counts."""
    compute = [s for s in timeline.spans if s.kind in COMPUTE_SPANS]
    seconds: dict[str, float] = {}
    counts: dict[str, int] = {}
    for s in timeline.spans:
        seconds[s.kind] = seconds.get(s.kind, 0.0) + s.duration
        counts[s.kind] = counts.get(s.kind, 0) + 1
    posted = {(s.start, s.end) for s in timeline.spans if s.kind in ("send", "recv")}   # a batch: one post
    return {"first": min(s.start for s in compute), "last": max(s.end for s in compute),
            "busy": sum(s.duration for s in compute), "wait": seconds.get("wait", 0.0),
            "post": sum(end - start for start, end in posted), "seconds": seconds, "counts": counts}


def _time_rank(names: list[str], config: GPTConfig, batch_size: int, seq_len: int, m: int,
               warmup: int, steps: int) -> dict:
    """Inside every rank: the variants take turns for warmup + steps rounds; rank 0's answer is used."""
    p = dist.get_world_size()
    idx, targets = token_batch(config, batch_size, seq_len, seed=0)   # the global batch, the same on every rank
    variants = [(name, engine) for name in names for engine in ENGINES]
    runs = {var: BUILDERS[var[1]](var[0], GPT(config, seed=0), m) for var in variants}
    times: dict[tuple[str, str], list[float]] = {var: [] for var in variants}
    steps_of: dict[str, list[dict]] = {name: [] for name in names}     # per timed step: every rank's summary
    for i in range(warmup + steps):
        order = turns(variants, i)                          # who goes first rotates
        elapsed = torch.zeros(len(variants), dtype=torch.float64)
        for var in order:
            step, _ = runs[var]
            dist.barrier()                               # every rank starts the step together
            start = time.perf_counter()
            step(idx, targets)
            elapsed[variants.index(var)] = time.perf_counter() - start
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)   # a step ends when the slowest rank's does
        mine = {name: _step_summary(runs[(name, "dtcourse")][1]) for name in names}
        everyone: list = [None] * p
        dist.all_gather_object(everyone, mine)           # a few hundred pickled bytes per rank
        if i < warmup:
            continue
        for var, t in zip(variants, elapsed.tolist()):
            times[var].append(t)
        for name in names:
            ranks = [e[name] for e in everyone]
            window = max(r["last"] for r in ranks) - min(r["first"] for r in ranks)
            steps_of[name].append({"window": window, "ranks": ranks})
    return {"times": times, "steps": steps_of}


def _bubbles(steps: list[dict], p: int) -> dict:
    """Medians over the timed steps: the bubble, each rank's idle share, its parts, and each action's mean time."""
    def median_of(share) -> float:
        return statistics.median(share(step) for step in steps)

    def rank_time(step: dict) -> float:                  # p ranks, each for the whole window
        return p * step["window"]
    kinds = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}
    mean_ms = {}
    for kind, letter in kinds.items():
        n = sum(r["counts"].get(kind, 0) for step in steps for r in step["ranks"])
        if n:
            mean_ms[letter] = 1e3 * sum(r["seconds"].get(kind, 0.0) for step in steps for r in step["ranks"]) / n
    return {"bubble": median_of(lambda st: 1 - sum(r["busy"] for r in st["ranks"]) / rank_time(st)),
            "bubble_per_rank": [median_of(lambda st: 1 - st["ranks"][r]["busy"] / st["window"]) for r in range(p)],
            "wait": median_of(lambda st: sum(r["wait"] for r in st["ranks"]) / rank_time(st)),
            "post": median_of(lambda st: sum(r["post"] for r in st["ranks"]) / rank_time(st)),
            "window_ms": 1e3 * median_of(lambda st: st["window"]), "mean_ms": mean_ms}


def measure(world_size: int, names: list[str] = list(SCHEDULE_NAMES), config: GPTConfig = PIPE_GPT,
            batch_size: int = 16, seq_len: int = 64, microbatches: int = 8, warmup: int = 3,
            steps: int = 30) -> list[dict]:
    """One launch at ``world_size``: a row per schedule, with both engines' step times and the measured bubble."""
    out = launch(_time_rank, world_size, list(names), config, batch_size, seq_len, microbatches, warmup, steps,
                 timeout=900)[0]
    rows = []
    for name in names:
        row = {"world_size": world_size, "schedule": name, "torch_class": TORCH_SCHEDULE[name],
               "chunks": CHUNKS[name], "microbatches": microbatches}
        for engine in ENGINES:
            row[engine] = step_times(out["times"][(name, engine)])
        row["ratio"] = paired_ratio(row["dtcourse"]["times"], row["torch"]["times"])
        row.update(_bubbles(out["steps"][name], world_size))
        row["formula"] = bubble_formula(name, world_size, microbatches, CHUNKS[name])
        mean = row["mean_ms"]
        if "F" in mean and ("B" in mean or "I" in mean):
            t_b = mean["B"] if "B" in mean else mean["I"] + mean["W"]
            row["simulated"] = simulate(schedules.build(name, world_size, microbatches, CHUNKS[name]), world_size, microbatches,
                                        CHUNKS[name], mean["F"], t_b, mean.get("W")).bubble
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'p':>2}  {'schedule':<22}{'torch schedule':<31}{'dtcourse ms':>12}{'torch ms':>9}{'vs torch':>9}"
            f"{'bubble':>7}{'formula':>8}{'sim':>6}{'wait':>6}{'post':>6}  {'F/B/I/W ms':<20} per rank")
    lines = []
    for r in rows:
        name = r["schedule"] + (f" v={r['chunks']}" if r["chunks"] > 1 else "")
        per_rank = " ".join(f"{b:.2f}" for b in r["bubble_per_rank"])
        times = "/".join(f"{r['mean_ms'][k]:.1f}" if k in r["mean_ms"] else "-" for k in "FBIW")
        sim = f"{r['simulated']:>6.3f}" if "simulated" in r else f"{'-':>6}"
        lines.append(f"{r['world_size']:>2}  {name:<22}{r['torch_class']:<31}{r['dtcourse']['median_ms']:>12.1f}"
                     f"{r['torch']['median_ms']:>9.1f}{ratio_cell(r['ratio'], 9)}{r['bubble']:>7.3f}"
                     f"{r['formula']:>8.3f}{sim}{r['wait']:>6.3f}{r['post']:>6.3f}  {times:<20} {per_rank}")
    return text_table(head, lines)


def plot(rows: list[dict], title: str = ""):
    """Per world size: median step time of each engine per schedule (IQR as error bars); bubble vs formula."""
    fig, axes, panels = world_panels(rows, 4.2, 6.0, nrows=2)
    for col, (p, mine) in enumerate(panels):
        names, ticks = [r["schedule"] for r in mine], {"rotation": 30, "ha": "right", "fontsize": 7}
        bars(axes[0][col], names, [(engine, [r[engine] for r in mine], color) for engine, color
                                   in (("dtcourse", "tab:blue"), ("torch", "tab:gray"))], **ticks)
        bars(axes[1][col], names, [("measured", [r["bubble"] for r in mine], "tab:blue"),
                                   ("formula", [r["formula"] for r in mine], "tab:orange")], **ticks)
        axes[0][col].set_title(f"p = {p}: median step (bars: IQR)", fontsize=9)
        axes[1][col].set_title(f"p = {p}: bubble (idle share)", fontsize=9)
    axes[1][0].set_ylabel("idle fraction")
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=7)
    return finish(fig, title)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULE_NAMES), choices=SCHEDULE_NAMES)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences in the global batch")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8, help="m, a multiple of every world size")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: p = 2, 8 x 32 tokens in 4 micro-batches, 1 + 3 steps (too few to quote)")
    parser.add_argument("--out", default="bench-results/pipeline.png")
    args = parser.parse_args(argv)
    if args.quick:
        args.world_sizes, args.batch_size, args.seq_len, args.microbatches = [2], 8, 32, 4
        args.warmup, args.steps = 1, 3
    params = sum(q.numel() for q in GPT(PIPE_GPT).parameters())
    load_before, start = os.getloadavg(), time.perf_counter()
    rows = [row for p in args.world_sizes for row in measure(p, args.schedules, PIPE_GPT, args.batch_size,
                                                               args.seq_len, args.microbatches, args.warmup,
                                                               args.steps)]
    load_after = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, gloo, 1 thread per rank; "
          f"load average (1/5/15 min) {'/'.join(f'{x:.2f}' for x in load_before)} before, "
          f"{'/'.join(f'{x:.2f}' for x in load_after)} after; {time.perf_counter() - start:.0f} s")
    print(f"model: GPT {params / 1e3:.0f}k parameters, {PIPE_GPT.n_layer} blocks; global batch "
          f"{args.batch_size} x {args.seq_len} tokens in m = {args.microbatches} micro-batches, AdamW; "
          f"{args.steps} timed rounds after {args.warmup} warm-up\n")
    print("vs torch: median of the round-by-round ratios (paired), same schedule. bubble: the course's executor,\n"
          "median over steps of 1 - busy / (p x window) from its Timeline spans (window: first to last compute span\n"
          "on any rank); formula: bubble_formula (t_b = 2 t_f); sim: simulate() with the measured mean F/B/I/W\n"
          "times; wait, post: shares of the p x window rank-time spent waiting for a message and posting them;\n"
          "per rank: 1 - busy_r / window\n")
    print(table(rows))
    for p in args.world_sizes:
        mine = [r for r in rows if r["world_size"] == p]
        print(f"\np = {p}: dtcourse / torch = " + ", ".join(f"{r['schedule']} {r['ratio']:.2f}x" for r in mine)
              + " (paired; target <= 1.2x)", end="")
    print()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    plot(rows, f"GPT {params / 1e3:.0f}k params, m = {args.microbatches}, gloo on {os.cpu_count()} CPUs"
         ).savefig(args.out, dpi=120)
    print(f"\nplot saved to {args.out}")


if __name__ == "__main__":
    main()
