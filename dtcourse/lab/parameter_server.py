"""What lesson 03 runs and draws: a parameter server's traffic, stragglers and staleness.

Three measurements on ``dtcourse.parameter_server``, each with the functions that draw it:

* ``traffic``: bytes per iteration through the busiest link against the number of workers N,
  counted by the parameter server's and the ring all-reduce's ``ByteCounter`` s, beside the
  analytic lines N·S/k (a server's link, k servers) and 2(N-1)/N·S (every ring rank's link).
* ``straggler_runs``: the same job in sync, ssp and async with slow workers; ``step_times``
  gives each worker's time per iteration and ``recording`` its timeline for
  ``dtcourse.lab.timeline``.
* ``staleness_sweep``: the held-out loss against gradients applied for several bounds s, and
  the histogram of the staleness each run recorded (``convergence_figure``).

``python -m dtcourse.bench.parameter_server`` runs all three and saves the plots.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from dtcourse.collectives import ByteCounter, ring_all_reduce
from dtcourse.runtime.launch import launch
from dtcourse.parameter_server import Problem, PSConfig, PSRun, train
from dtcourse.runtime.timeline import Recording, Span

__all__ = ["traffic", "traffic_table", "traffic_figure", "straggler_runs", "step_times", "recording",
           "staleness_sweep", "loss_curve", "staleness_counts", "convergence_figure", "label"]


def label(config: PSConfig) -> str:
    """'sync', 'ssp s=2' or 'async'."""
    return f"ssp s={config.bound:g}" if config.mode == "ssp" else config.mode


# --------------------------------------------------------------------------- #
# Traffic through the busiest link
# --------------------------------------------------------------------------- #
def _ring_rank(numel: int) -> tuple[int, int]:
    counter = ByteCounter()
    ring_all_reduce(torch.ones(numel), counter=counter)
    return counter.sent, counter.received


def traffic(worker_counts: tuple[int, ...] = (1, 2, 3, 4, 5, 6), num_servers: int = 1, steps: int = 2,
            problem: Problem = Problem()) -> list[dict]:
    """Per N: measured bytes per iteration through the busiest link for the parameter server
    (sync, ``num_servers`` servers) and for a ring all-reduce of the same gradients, and the formulas."""
    numel = sum(p.numel() for p in problem.model().parameters())
    nbytes = numel * torch.finfo(problem.dtype).bits // 8                     # S: one gradient
    rows = []
    for n in worker_counts:
        run = train(PSConfig(world_size=n + num_servers, num_servers=num_servers, steps=steps), problem)
        busiest_rank, ps_bytes = run.busiest_link()
        ring = launch(_ring_rank, n, numel)
        rows.append({"workers": n, "S": nbytes, "ps": ps_bytes, "ps_rank": busiest_rank,
                     # a server's link: N pushes in, N pulls out, of S/k each; a worker's: S each way
                     "ps_model": max(n / num_servers, 1) * nbytes,
                     "ring": max(max(sent, received) for sent, received in ring),
                     "ring_model": 2 * (n - 1) / n * nbytes})           # lesson 01: every rank's link
    return rows


def traffic_table(rows: list[dict]) -> str:
    lines = [f"{'N':>3} {'server link':>12} {'N*S/k':>10} {'ring link':>10} {'2(N-1)/N*S':>11}   (bytes per iteration)"]
    for r in rows:
        lines.append(f"{r['workers']:>3} {r['ps']:>12,.0f} {r['ps_model']:>10,.0f} {r['ring']:>10,.0f} "
                     f"{r['ring_model']:>11,.0f}")
    return "\n".join(lines)


def traffic_figure(rows: list[dict], sharded: list[dict] | None = None):
    """Measured points and analytic lines, bytes per iteration in units of S, against N."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    n = [r["workers"] for r in rows]
    s = rows[0]["S"]
    series = [("parameter server, 1 server", rows, "ps", "C3")]
    if sharded:
        k = round(sharded[-1]["workers"] * sharded[-1]["S"] / sharded[-1]["ps_model"])
        series.append((f"parameter server, {k} servers", sharded, "ps", "C1"))
    series.append(("ring all-reduce", rows, "ring", "C0"))
    for name, data, key, colour in series:
        x = [r["workers"] for r in data]
        ax.plot(x, [r[key + "_model"] / s for r in data], "--", color=colour, alpha=0.7)
        ax.plot(x, [r[key] / s for r in data], "o", color=colour, label=f"{name} (measured)")
    ax.plot([], [], "k--", alpha=0.7, label="formula: max(N/k, 1)·S and 2(N-1)/N·S")
    ax.set(xlabel="workers N", ylabel="bytes per iteration, busiest link (× S)", xticks=n,
           title=f"One direction of the busiest link; S = {s:,} bytes of gradient")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


# --------------------------------------------------------------------------- #
# Stragglers
# --------------------------------------------------------------------------- #
def straggler_runs(world_size: int = 5, delay: float = 0.03, steps: int = 12, bound: int = 2,
                   rotating: bool = False, problem: Problem = Problem()) -> dict[str, PSRun]:
    """sync, ssp (``bound``) and async with slow workers: the last worker slow in every iteration,
    or (``rotating``) each worker slow in every N-th iteration, in turn."""
    n = world_size - 1
    delays = (delay,) * n if rotating else (0.0,) * (n - 1) + (delay,)
    base = PSConfig(world_size=world_size, steps=steps, delays=delays, delay_period=n if rotating else 1)
    configs = [base, replace(base, mode="ssp", bound=bound), replace(base, mode="async")]
    return {label(c): train(c, problem) for c in configs}


def step_times(runs: dict[str, PSRun]) -> dict[str, list[float]]:
    """Each worker's mean seconds per iteration, per run."""
    return {name: run.seconds_per_iteration() for name, run in runs.items()}


def recording(run: PSRun) -> Recording:
    """The workers' spans (wait for the pull, injected delay, compute) on one time axis, by rank."""
    origin = run.origin
    return {t.rank: [Span(kind, name, start - origin, end - origin) for kind, name, start, end in t.spans]
            for t in run.workers}


# --------------------------------------------------------------------------- #
# Convergence against staleness
# --------------------------------------------------------------------------- #
def staleness_sweep(bounds: tuple[float, ...] = (0, 1, 3, math.inf), world_size: int = 7, steps: int = 24,
                    lr: float = 1.0, delay: float = 0.04, problem: Problem = Problem()) -> dict[str, PSRun]:
    """One run per bound, each worker slow (``delay``) in every N-th iteration, in turn."""
    n = world_size - 1
    runs = {}
    for s in bounds:
        mode = "async" if s == math.inf else "ssp"
        config = PSConfig(world_size=world_size, mode=mode, bound=None if mode == "async" else s, steps=steps,
                          lr=lr, delays=(delay,) * n, delay_period=n)
        runs[label(config)] = train(config, problem)
    return runs


def loss_curve(run: PSRun, x: str = "applied") -> tuple[list[float], list[float]]:
    """Held-out loss at every read of every worker, against gradients applied (``x="applied"``) or
    seconds since the run started (``x="seconds"``), in increasing x."""
    origin = run.origin
    points = sorted((a if x == "applied" else read - origin, loss) for t in run.workers
                    for a, loss, read in zip(t.applied, t.eval_losses, [s[3] for s in t.spans if s[0] == "wait"]))
    return [p for p, _ in points], [loss for _, loss in points]


def staleness_counts(run: PSRun) -> list[int]:
    """How many of server 0's updates had staleness 0, 1, 2, ..."""
    late = [u.staleness for u in run.servers[0].updates]
    return [late.count(v) for v in range(max(late) + 1)]


def convergence_figure(runs: dict[str, PSRun]):
    """Held-out loss against gradients applied and against time; how often each staleness occurred."""
    import matplotlib.pyplot as plt

    fig, (by_update, by_time, hist) = plt.subplots(1, 3, figsize=(12.0, 3.5))
    width, longest = 0.8 / len(runs), 0
    for i, (name, run) in enumerate(runs.items()):
        by_update.plot(*loss_curve(run), ".-", markersize=3, linewidth=0.8, label=name)
        by_time.plot(*loss_curve(run, "seconds"), ".-", markersize=3, linewidth=0.8, label=name)
        counts = staleness_counts(run)
        longest = max(longest, len(counts))
        hist.bar([v + (i - (len(runs) - 1) / 2) * width for v in range(len(counts))], counts, width, label=name)
    by_update.set(yscale="log", xlabel="worker gradients applied by the server", ylabel="held-out loss")
    by_time.set(yscale="log", xlabel="seconds since the start")
    hist.set(xlabel="staleness (iterations)", ylabel="pushes", xticks=range(longest))
    by_update.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig
