"""What lesson 03 runs and draws: a parameter server's traffic, stragglers, staleness, its RPC form,
actors and a learner, and the lesson's predict-then-check problems.

* ``traffic``: bytes per iteration through the busiest link against the number of workers N, counted
  by the servers' and the ring all-reduce's ``ByteCounter`` s, beside N·S/k and 2(N-1)/N·S; with
  ``colocated=True`` each of k = N servers shares a machine with a worker and the busiest *machine*
  link is counted (``PSRun.machine_bytes``).
* ``straggler_runs``: sync, ssp and async with slow workers; ``recording`` their timelines.
* ``staleness_sweep``: the held-out loss against gradients applied for several bounds s, on an
  ill-conditioned quadratic where stale gradients overshoot (``convergence_figure``).
* ``rpc_comparison``: the same sync job on the message server and on ``torch.distributed.rpc``.
* ``actor_learner_runs``: Ape-X-style runs with several pull periods (``actor_learner_figure``).
* ``problem_*``: each measures one quantity and returns it beside the lesson's formula.

``python -m dtcourse.bench.parameter_server`` runs the measurements at full size and saves plots.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

import torch

from dtcourse.collectives import ByteCounter, ring_all_reduce
from dtcourse.lab.problems import Answer
from dtcourse.lab.widgets import COLUMN_IN
from dtcourse.parameter_server import Problem, PSConfig, PSRun, Quadratic, Stall, train
from dtcourse.parameter_server.cost import colocated_machine_bytes, ring_link_bytes, server_link_bytes
from dtcourse.parameter_server.actor_learner import ActorLearnerConfig, ActorLearnerRun, act_and_learn, greedy_return
from dtcourse.parameter_server.rpc import RPCRun, rpc_train
from dtcourse.runtime.launch import launch
from dtcourse.runtime.timeline import Recording, Span

__all__ = ["traffic", "traffic_table", "traffic_figure", "straggler_runs", "step_times", "recording",
           "answered_after_delays", "staleness_sweep", "loss_curve", "final_loss", "staleness_counts",
           "convergence_figure", "label",
           "rpc_comparison", "rpc_table", "actor_learner_runs", "late_return", "pull_waits", "actor_learner_figure", "SWEEP_PROBLEM",
           "problem_sharded_link", "problem_colocated_machine", "problem_ssp_staleness",
           "problem_actor_staleness", "problem_pull_bytes"]

SWEEP_PROBLEM = Quadratic(dtype=torch.float64)   # a round bowl: sync with lr 0.25 halves the error per step


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


def traffic(worker_counts: tuple[int, ...] = (1, 2, 3, 4, 6), num_servers: int = 1, steps: int = 2,
            colocated: bool = False, ring: bool = True, problem: Problem = Problem()) -> list[dict]:
    """Per N: measured bytes per iteration through the busiest link for the parameter server (sync,
    ``num_servers`` servers, or k = N servers each beside a worker), for a ring all-reduce of the same
    gradients (unless ``ring=False``), and the formulas."""
    numel = sum(p.numel() for p in problem.model().parameters())
    nbytes = numel * torch.finfo(problem.dtype).bits // 8                     # S: one gradient
    rows = []
    for n in worker_counts:
        k = n if colocated else num_servers
        run = train(PSConfig(world_size=n + k, num_servers=k, steps=steps), problem)
        busiest, ps_bytes = (None, max(max(pair) for pair in run.machine_bytes())) if colocated else run.busiest_link()
        by_rank = launch(_ring_rank, n, numel) if ring else [(0, 0)]
        rows.append({"workers": n, "S": nbytes, "ps": ps_bytes, "ps_rank": busiest, "k": k, "colocated": colocated,
                     # a separate server's link: N pushes in, N pulls out, of S/k each; a worker's: S each way.
                     # Co-located: every range but the machine's own goes out once and comes in once.
                     "ps_model": colocated_machine_bytes(n, nbytes) if colocated else server_link_bytes(n, k, nbytes),
                     "ring": max(max(sent, received) for sent, received in by_rank),
                     "ring_model": ring_link_bytes(n, nbytes)})           # lesson 01: every rank's link
    return rows


def traffic_table(rows: list[dict]) -> str:
    lines = [f"{'N':>3} {'server link':>12} {'N*S/k':>10} {'ring link':>10} {'2(N-1)/N*S':>11}   (bytes per iteration)"]
    for r in rows:
        lines.append(f"{r['workers']:>3} {r['ps']:>12,.0f} {r['ps_model']:>10,.0f} {r['ring']:>10,.0f} "
                     f"{r['ring_model']:>11,.0f}")
    return "\n".join(lines)


def traffic_figure(*series: list[dict]):
    """Measured points and formula lines, bytes per iteration in units of S, against N, for each
    ``traffic`` result given, and the ring of the first."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(COLUMN_IN, 3.8))
    s = series[0][0]["S"]
    for i, rows in enumerate(series):
        k = "N" if rows[0]["colocated"] else rows[0]["k"]
        name = ("server beside each worker (k = N), per machine" if rows[0]["colocated"]
                else f"{k} separate server{'s' if k != 1 else ''}, server link")
        x = [r["workers"] for r in rows]
        ax.plot(x, [r["ps_model"] / s for r in rows], "--", color=f"C{i + 1}", alpha=0.7)
        ax.plot(x, [r["ps"] / s for r in rows], "o", color=f"C{i + 1}", label=name)
    x = [r["workers"] for r in series[0]]
    ax.plot(x, [r["ring_model"] / s for r in series[0]], "--", color="C0", alpha=0.7)
    ax.plot(x, [r["ring"] / s for r in series[0]], "s", color="C0", mfc="none", markersize=9, label="ring all-reduce, any rank")
    ax.plot([], [], "k--", alpha=0.7, label="formulas: max(N/k, 1)·S and 2(N-1)/N·S")
    ax.set(xlabel="workers N", ylabel="bytes per iteration (× S)", xticks=x,
           title=f"Busiest link, one direction (S = {s:,} bytes of gradient)")
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


def answered_after_delays(run: PSRun, lag: int) -> bool:
    """True when every pull of iteration c >= ``lag``, by every worker, was answered after every injected
    delay of iteration c - ``lag`` had ended: who waited for whom, read from the recorded spans.

    The protocol guarantees it with lag = s + 1 (sync: s = 0): the server answers a pull of iteration
    c only once every worker's push of iteration c - s - 1 is in, and a push follows its worker's delay.
    ``time.perf_counter`` is one clock for all the processes of a machine (Linux: CLOCK_MONOTONIC)."""
    slept: dict[int, float] = {}
    for t in run.workers:
        for kind, name, _, end in t.spans:
            if kind == "delay":
                c = int(name.split()[-1])
                slept[c] = max(slept.get(c, end), end)
    return all(end >= slept[int(name.split()[-1]) - lag]
               for t in run.workers for kind, name, _, end in t.spans
               if kind == "wait" and int(name.split()[-1]) - lag in slept)


def step_times(runs: dict[str, PSRun]) -> dict[str, list[float]]:
    """Each worker's mean seconds per iteration, per run."""
    return {name: run.seconds_per_iteration() for name, run in runs.items()}


# A worker's wait for its pull is communication (the "recv" lane); its delay and compute are not.
_KINDS = {"wait": "recv", "delay": "delay", "compute": "compute"}


def recording(run: PSRun) -> Recording:
    """The workers' spans on one time axis, by rank: the pull (waiting for the server's answer, in the
    communication lane), the injected delay and the compute."""
    origin = run.origin
    return {t.rank: [Span(_KINDS[kind], name, start - origin, end - origin) for kind, name, start, end in t.spans]
            for t in run.workers}


def pull_waits(runs: dict[str, PSRun]) -> dict[str, float]:
    """Per run, the median seconds a fast worker (all but the last) waited for a pull's answer."""
    return {name: statistics.median(end - start for t in run.workers[:-1]
                                    for kind, _, start, end in t.spans if kind == "wait")
            for name, run in runs.items()}


# --------------------------------------------------------------------------- #
# Convergence against staleness
# --------------------------------------------------------------------------- #
def staleness_sweep(bounds: tuple[float, ...] = (0, 1, 3, math.inf), world_size: int = 5, steps: int = 20,
                    lr: float = 0.25, problem: Problem = SWEEP_PROBLEM) -> dict[str, PSRun]:
    """One run per bound. The last worker stalls once, right after computing its first gradient, for as
    long as the others can go on without it (``Stall``): a garbage-collection pause or a preempted
    machine, whose length the protocol sets rather than the scheduler. Its stalled push was computed
    on version 0, the one every worker's first pull gets, so its staleness is fixed too: s under
    SSP, steps - 1 in async (applied after every other push)."""
    n = world_size - 1
    runs = {}
    for s in bounds:
        mode = "async" if s == math.inf else "ssp"
        config = PSConfig(world_size=world_size, mode=mode, bound=None if mode == "async" else s, steps=steps,
                          lr=lr, stall=Stall(worker=n - 1, step=0))
        runs[label(config)] = train(config, problem)
    return runs


def loss_curve(run: PSRun, x: str = "applied") -> tuple[list[float], list[float]]:
    """Held-out loss at every read of every worker, against gradients applied (``x="applied"``) or
    seconds since the run started (``x="seconds"``), in increasing x."""
    origin = run.origin
    points = sorted((a if x == "applied" else read - origin, loss) for t in run.workers
                    for a, loss, read in zip(t.applied, t.eval_losses, [s[3] for s in t.spans if s[0] == "wait"]))
    return [p for p, _ in points], [loss for _, loss in points]


def final_loss(run: PSRun, problem: Problem = SWEEP_PROBLEM) -> float:
    """Held-out loss of the run's final parameters."""
    from torch.nn.utils import vector_to_parameters

    model = problem.model()
    vector_to_parameters(run.params, model.parameters())
    with torch.no_grad():
        return problem.loss(model, *problem.eval_batch()).item()


def staleness_counts(run: PSRun) -> list[int]:
    """How many of server 0's updates had staleness 0, 1, 2, ..."""
    late = [u.staleness for u in run.servers[0].updates]
    return [late.count(v) for v in range(max(late) + 1)]


def convergence_figure(runs: dict[str, PSRun]):
    """Held-out loss against gradients applied and against time (top); how often each staleness occurred."""
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(COLUMN_IN, 5.4))
    grid = fig.add_gridspec(2, 2)
    by_update, by_time, hist = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])
    width, longest = 0.8 / len(runs), 0
    for i, (name, run) in enumerate(runs.items()):
        by_update.plot(*loss_curve(run), ".-", markersize=3, linewidth=0.8, label=name)
        by_time.plot(*loss_curve(run, "seconds"), ".-", markersize=3, linewidth=0.8, label=name)
        counts = staleness_counts(run)
        longest = max(longest, len(counts))
        hist.bar([v + (i - (len(runs) - 1) / 2) * width for v in range(len(counts))], counts, width, label=name)
    by_update.set(yscale="log", xlabel="worker gradients applied", ylabel="held-out loss",
                  title="Loss per gradient applied")
    by_time.set(yscale="log", xlabel="seconds since the start", title="Loss per second")
    hist.set(xlabel="staleness (iterations)", ylabel="pushes", xticks=range(longest), yscale="log",
             title="How stale each push was, per bound s")
    for ax in (by_update, by_time, hist):
        ax.title.set_fontsize(9)
    by_update.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


# --------------------------------------------------------------------------- #
# The RPC form, beside the message form
# --------------------------------------------------------------------------- #
def rpc_comparison(world_size: int = 4, steps: int = 5, lr: float = 0.2) -> tuple[PSRun, RPCRun]:
    """The same sync job on the message server (``train``) and on the RPC server (``rpc_train``)."""
    config = PSConfig(world_size=world_size, steps=steps, lr=lr)
    return train(config), rpc_train(config)


def rpc_table(messages: PSRun, rpc: RPCRun) -> str:
    """Per worker iteration and server: messages (or calls) and tensor bytes each way, for both forms."""
    cfg = messages.config
    per = cfg.num_workers * cfg.steps * cfg.num_servers
    into = [m for t in messages.workers for m in t.counter.messages]             # pushes: header, gradient
    out = [m for s in messages.servers for m in s.counter.messages]              # replies: header, parameters
    calls = rpc.calls_per_iteration()
    rows = [("messages / calls", f"{(len(into) + len(out)) / per:g} messages",
             f"{sum(calls.values()):g} calls: " + ", ".join(calls)),
            ("tensor bytes in (gradient)", f"{sum(m.nbytes for m in into if m.phase == 'push') / per:,.0f}",
             f"{sum(s.bytes_in for s in rpc.servers) / per:,.0f}"),
            ("tensor bytes out (parameters)", f"{sum(m.nbytes for m in out if m.phase == 'pull') / per:,.0f}",
             f"{sum(s.bytes_out for s in rpc.servers) / per:,.0f}")]
    lines = [f"{'per worker iteration and server':<31} {'message server':<16} RPC server"]
    lines += [f"{a:<31} {b:<16} {c}" for a, b, c in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- #
# Actors and a learner
# --------------------------------------------------------------------------- #
def actor_learner_runs(pulls: tuple[int, ...] = (10, 500), **kwargs) -> dict[int, ActorLearnerRun]:
    """One run per pull period (steps between an actor's pulls); other settings from ``kwargs``."""
    return {p: act_and_learn(ActorLearnerConfig(pull_every=p, **kwargs)) for p in pulls}


def late_return(run: ActorLearnerRun, fraction: float = 1 / 3) -> float:
    """Mean return of the actors' episodes that ended in the last ``fraction`` of the transitions."""
    total = run.config.num_actors * run.config.steps
    late = [r for n, r in run.returns() if n > (1 - fraction) * total]
    return sum(late) / max(len(late), 1)


def _smoothed(points: list[tuple[int, float]], window: int) -> tuple[list[int], list[float]]:
    xs, ys = [x for x, _ in points], [y for _, y in points]
    means = [sum(ys[max(0, i - window + 1):i + 1]) / len(ys[max(0, i - window + 1):i + 1]) for i in range(len(ys))]
    return xs, means


def actor_learner_figure(runs: dict[int, ActorLearnerRun], episodes: int = 5):
    """Actors' returns and the learner's greedy return against transitions, and staleness, per pull period."""
    import matplotlib.pyplot as plt

    fig, (acting, greedy, late) = plt.subplots(1, 3, figsize=(COLUMN_IN, 2.9))
    top = max(run.config.staleness_bound for run in runs.values()) + 1
    bins = [top * b / 30 for b in range(31)]                  # the same bins for every run
    for i, (pull, run) in enumerate(runs.items()):
        name = f"pull every {pull}"
        acting.plot(*_smoothed(run.returns(), 10), color=f"C{i}", linewidth=1, label=name)
        snaps = run.learner.snapshots
        greedy.plot([n for n, _, _ in snaps], [greedy_return(run.config, p, episodes) for _, _, p in snaps],
                    ".-", color=f"C{i}", linewidth=1, label=name)
        late.hist(run.staleness(), bins=bins, color=f"C{i}", alpha=0.6, label=name)
        late.axvline(run.config.staleness_bound, color=f"C{i}", linestyle="--", linewidth=1)
    acting.set(xlabel="transitions collected", ylabel="episode return", title="Actors' returns (mean of 10)")
    greedy.set(xlabel="transitions collected", title="Learner's greedy policy")
    late.set(xlabel="staleness (updates)", ylabel="transitions", yscale="log", title="Staleness; dashes: bound")
    for ax in (acting, greedy, late):
        ax.title.set_fontsize(9)
        ax.tick_params(labelsize=8)
        ax.xaxis.label.set_fontsize(8)
        ax.yaxis.label.set_fontsize(8)
    acting.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


# --------------------------------------------------------------------------- #
# Problems: each measures one quantity and gives the lesson's formula beside it
# --------------------------------------------------------------------------- #
def _gradient_bytes(problem: Problem = Problem()) -> int:
    return sum(p.numel() for p in problem.model().parameters()) * torch.finfo(problem.dtype).bits // 8


def problem_sharded_link(workers: int = 4, servers: int = 2) -> Answer:
    """Bytes per iteration through the busiest link, N workers and k separate servers (sync)."""
    run = train(PSConfig(world_size=workers + servers, num_servers=servers, steps=2))
    return Answer(measured=run.busiest_link()[1], formula=server_link_bytes(workers, servers, _gradient_bytes()), unit="B",
                  rtol=0.01, why="k ranges differ by at most one parameter when k does not divide P")


def problem_colocated_machine(workers: int = 4) -> Answer:
    """Bytes per iteration out of one machine when k = N servers each share a machine with a worker."""
    run = train(PSConfig(world_size=2 * workers, num_servers=workers, steps=2))
    return Answer(measured=max(out for out, _ in run.machine_bytes()),
                  formula=colocated_machine_bytes(workers, _gradient_bytes()), unit="B", rtol=0.01,
                  why="ranges differ by at most one parameter")


def problem_ssp_staleness(bound: int = 2) -> Answer:
    """The largest staleness recorded with SSP bound s when the last worker stalls after its first gradient."""
    run = train(PSConfig(world_size=4, mode="ssp", bound=bound, steps=bound + 2, stall=Stall(worker=2, step=0)))
    return Answer(measured=max(u.staleness for u in run.updates), formula=bound, unit="iterations", rtol=0,
                  why="counted exactly; the stall lasts until the others reach the bound, whatever the machine's load")


def problem_actor_staleness(actors: int = 3, pull_every: int = 40, push_every: int = 10, updates: int = 2) -> Answer:
    """The largest staleness of an actor's experience, counted by the learner on arrival."""
    cfg = ActorLearnerConfig(num_actors=actors, steps=4 * pull_every, push_every=push_every, pull_every=pull_every,
                             updates_per_push=updates, warmup=0, batch=16)
    run = act_and_learn(cfg)
    return Answer(measured=max(run.staleness()), formula=(actors * pull_every / push_every - 1) * updates,
                  unit="updates", rtol=0, why="the learner takes pushes in a fixed order: an exact count")


def problem_pull_bytes(actors: int = 3, pull_every: int = 50, hidden: int = 64) -> Answer:
    """Parameter bytes the learner sends per environment step of all actors."""
    cfg = ActorLearnerConfig(num_actors=actors, steps=4 * pull_every, pull_every=pull_every, hidden=hidden,
                             warmup=10**9)
    run = act_and_learn(cfg)
    sent = sum(b for (src, _), b in run.link_bytes(("params",)).items() if src == 0)
    params = 4 * hidden + hidden + hidden * hidden + hidden + hidden * 2 + 2
    return Answer(measured=sent / (actors * cfg.steps), formula=4 * params / pull_every, unit="B", rtol=0,
                  why="counted exactly: one pull per pull_every steps, the first at step 0")
