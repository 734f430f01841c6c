"""What lesson 12 runs and draws: a worker killed and the run resumed, under launch, torchrun and elastic agents;
what a failure costs, and how often to checkpoint.

The scripts are the lesson's own (``train.py``, ``elastic.py``, written by its ``%%writefile`` cells). They run
three ways: ``train.py``'s ``main`` on forked ranks under ``dtcourse.launch`` (``run_script``), the file under
torchrun (``torchrun``), and ``elastic.py`` under two torchrun agents sharing one c10d rendezvous (``elastic``).
Every process started here carries a tag in its environment and is killed before the function returns, whatever
happened: torchrun starts each worker in a session of its own, so killing the agent's process group is not
enough, and an agent killed with SIGKILL leaves its workers running. The checkpoint interval follows Young 1974
("A first order approximation to the optimum checkpoint interval", CACM 17(9)) and Daly 2006 ("A higher order
estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3)), checked by simulation. Example::

    from dtcourse.lab import fault_tolerance as lab
    never = lab.run_script("work/train.py", "work/never")
    killed = lab.run_script("work/train.py", "work/killed", max_restarts=2, kill_at=11)
    lab.kill_figure(killed, never)                  # the same losses, bit for bit, and the time the kill cost
"""

from __future__ import annotations

import json
import math
import os
import runpy
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import psutil
import torch
import torch.distributed as dist

from dtcourse.fault_tolerance import Snapshots, sharded
from dtcourse.fault_tolerance.cost import daly_interval, expected_overhead, young_interval
from dtcourse.lab.problems import Answer
from dtcourse.lab.widgets import COLUMN_IN
from dtcourse.models import DDP_GPT, GPT, GPTConfig, lm_loss, token_batch
from dtcourse.runtime.launch import launch

__all__ = ["TAG", "Run", "run_script", "time_lost", "Finished", "torchrun", "tagged", "kill_tagged", "leftovers",
           "free_port", "elastic_args", "Elastic", "elastic", "save_times", "young_interval", "daly_interval",
           "expected_overhead", "simulate_overhead", "interval_sweep", "kill_figure", "interval_figure",
           "problem_recomputed", "problem_snapshot_bytes", "problem_first_drift", "problem_young", "problem_waste"]

TAG = "DTCOURSE_TAG"            # the environment variable every process started here carries


# --------------------------------------------------------------------------- #
# A run of train.py, read back from its log
# --------------------------------------------------------------------------- #
def read_log(directory: str | os.PathLike) -> list[dict]:
    """The events the script appended to ``log.jsonl``, in order; a line cut short by a kill is skipped."""
    path, events = Path(directory) / "log.jsonl", []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return events


@dataclass(frozen=True)
class Run:
    """A finished run of ``train.py``: every event of every attempt, the final parameters (from ``final.pt``)."""

    directory: Path
    events: list[dict]
    params: dict[str, torch.Tensor] | None

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Run:
        final = Path(directory) / "final.pt"
        return cls(Path(directory), read_log(directory), torch.load(final) if final.exists() else None)

    def losses(self, attempt: int | None = None) -> dict[int, float]:
        """step -> loss of one attempt, or (None) of the run as it ended (a recomputed step keeps its last loss)."""
        return {e["step"]: e["loss"] for e in self.events if e["event"] == "step" and attempt in (None, e["attempt"])}

    def first(self, event: str, attempt: int | None = None, rank: int | None = 0) -> dict | None:
        return next((e for e in self.events if e["event"] == event and attempt in (None, e["attempt"])
                     and rank in (None, e["rank"])), None)

    @property
    def attempts(self) -> int:
        return 1 + max(e["attempt"] for e in self.events)

    @property
    def origin(self) -> float:
        """When training began: attempt 0's rank 0 had built its model and found (or not) a snapshot."""
        return self.first("resumed", 0)["t"]

    @property
    def seconds(self) -> float:
        """From ``origin`` to the last step's end, restarts included."""
        return max(e["t"] for e in self.events if e["event"] == "step") - self.origin


def _without_rng(main, *args, **kwargs):
    from dtcourse.fault_tolerance import snapshot
    snapshot.set_rng_state = lambda state: None          # in this rank's process only: restore skips the generators
    return main(*args, **kwargs)


def run_script(script: str | os.PathLike, directory: str | os.PathLike, world: int = 2, max_restarts: int = 0,
               restore_rng: bool = True, timeout: float = 120.0, **options) -> Run:
    """``main(directory, **options)`` of ``script`` on ``world`` forked gloo ranks (the script trains on CPUs),
    restarted up to ``max_restarts`` times as torchrun would; ``restore_rng=False`` resumes without the
    generators' states."""
    main = runpy.run_path(str(script))["main"]
    Path(directory).mkdir(parents=True, exist_ok=True)
    fn, args = (main, ()) if restore_rng else (_without_rng, (main,))
    launch(fn, world, *args, str(directory), timeout=timeout, max_restarts=max_restarts, backend="gloo", **options)
    return Run.load(directory)


def time_lost(run: Run) -> dict[str, float]:
    """Where the seconds went, from the kill on attempt 0 to attempt 1's redoing the last step before it."""
    killed = run.first("killed", attempt=0, rank=None)
    start, resumed = run.first("start", 1), run.first("resumed", 1)
    again = [e for e in run.events if e["event"] == "step" and e["attempt"] == 1 and e["step"] < killed["step"]]
    return {"detect and restart": start["t"] - killed["t"], "rebuild and reload": resumed["t"] - start["t"],
            f"recompute {len(again)} steps": (again[-1]["t"] - resumed["t"]) if again else 0.0}


# --------------------------------------------------------------------------- #
# Processes started from here, and how none is left behind
# --------------------------------------------------------------------------- #
def tagged(tag: str) -> list[psutil.Process]:
    """Every process whose environment's ``DTCOURSE_TAG`` starts with ``tag`` (a worker inherits its agent's)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(TAG, "").startswith(tag):
                found.append(proc)
        except (psutil.Error, OSError):                  # gone, a zombie, or another user's
            pass
    return found


def kill_tagged(tag: str) -> None:
    """SIGKILL every process tagged ``tag``; sweep again, in case a dying agent started one more worker."""
    for _ in range(5):
        procs = tagged(tag)
        if not procs:
            return
        for proc in procs:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=5)
    raise RuntimeError(f"processes tagged {tag} survived SIGKILL: {[p.pid for p in tagged(tag)]}")


def leftovers(text: str) -> list[psutil.Process]:
    """Processes (not this one) whose command line mentions ``text``, a work folder: what a run left behind."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.pid != os.getpid() and text in " ".join(proc.info["cmdline"] or []) \
                    and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:                             # it ended meanwhile
            pass
    return found


def _start(args: Sequence[str], tag: str, output) -> subprocess.Popen:
    env = {**os.environ, TAG: tag, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *map(str, args)], stdout=output,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


@dataclass(frozen=True)
class Finished:
    """What a torchrun command printed, how it ended (None: killed at its time limit) and how long it took."""

    command: str
    returncode: int | None
    output: str
    seconds: float

    def lines(self, *starts: str) -> list[str]:
        return [line for line in self.output.splitlines() if line.startswith(starts)]


def torchrun(args: Sequence[str], timeout: float = 120.0) -> Finished:
    """``python -m torch.distributed.run *args``; at ``timeout`` seconds the agent and its workers are killed."""
    tag, start, timed_out = uuid.uuid4().hex, time.perf_counter(), False
    proc = _start(args, tag, subprocess.PIPE)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_tagged(tag)                                 # the workers too: their pipes then close
        output, _ = proc.communicate()
    finally:
        kill_tagged(tag)
    return Finished(shlex.join(["python", "-m", "torch.distributed.run", *map(str, args)]),
                    None if timed_out else proc.returncode, output, time.perf_counter() - start)


# --------------------------------------------------------------------------- #
# Elastic membership: two agents ("nodes") on one c10d rendezvous
# --------------------------------------------------------------------------- #
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def elastic_args(port: int, host: bool) -> list[str]:
    """One agent's torchrun options: 1 to 2 nodes of one worker each, meeting at ``localhost:port``."""
    return ["--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "lesson12",
            # the first agent hosts the store; a node is dead after 3 missed 1 s heartbeats; then 1 s more to join
            "--rdzv-conf", f"is_host={str(host).lower()},keep_alive_interval=1,keep_alive_max_attempt=3,"
                           "last_call_timeout=1"]


@dataclass(frozen=True)
class Elastic:
    """An elastic run: its log, each agent's output, when node B was killed (or started), how A ended."""

    events: list[dict]
    outputs: dict[str, str]
    changed_at: float
    returncode: int | None

    def phases(self) -> list[tuple[int, int, int, int]]:
        """``(attempt, world size, first step, last step)`` for each stretch of steps the log holds."""
        out: list[list[int]] = []
        for e in (e for e in self.events if e["event"] == "step"):
            if out and out[-1][:2] == [e["attempt"], e["world"]] and e["step"] == out[-1][3] + 1:
                out[-1][3] = e["step"]
            else:
                out.append([e["attempt"], e["world"], e["step"], e["step"]])
        return [tuple(p) for p in out]


def elastic(script: str | os.PathLike, directory: str | os.PathLike, change: str = "shrink", at_step: int = 8,
            steps: int = 24, timeout: float = 60.0, watch: float | None = None) -> Elastic:
    """Agents A and B run ``script``; at ``at_step``, node B (agent and worker) is killed (``"shrink"``), or, for
    ``"grow"``, A starts alone and B joins then. Both are killed by ``timeout`` seconds, whatever happened, or
    ``watch`` seconds after the change if that comes first (a loaded machine may take long to reach the change)."""
    directory, tag, port = Path(directory), uuid.uuid4().hex, free_port()
    directory.mkdir(parents=True, exist_ok=True)
    command = lambda host: [*elastic_args(port, host), script, "--dir", directory, "--steps", steps]
    files = {n: open(directory / f"agent-{n}.out", "w") for n in "AB"}
    deadline, agents = time.time() + timeout, {"A": _start(command(True), f"{tag}-A", files["A"])}
    try:
        if change == "shrink":
            agents["B"] = _start(command(False), f"{tag}-B", files["B"])
        while not any(e["event"] == "step" and e["step"] >= at_step for e in read_log(directory)):
            if time.time() > deadline or agents["A"].poll() is not None:
                break
            time.sleep(0.05)
        changed_at = time.time()
        if change == "shrink":
            kill_tagged(f"{tag}-B")                      # a node lost: its agent and its worker at once
        else:
            agents["B"] = _start(command(False), f"{tag}-B", files["B"])
        if watch is not None:
            deadline = min(deadline, changed_at + watch)
        agents["A"].wait(max(0.1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        kill_tagged(tag)
        for f in files.values():
            f.close()
    return Elastic(read_log(directory), {n: (directory / f"agent-{n}.out").read_text() for n in "AB"}, changed_at,
                   agents["A"].returncode)


# --------------------------------------------------------------------------- #
# What a checkpoint costs, and how often to take one
# --------------------------------------------------------------------------- #
def _save_rank(directory: str, config: GPTConfig, repeats: int) -> dict[str, list[float]]:
    model = torch.nn.parallel.DistributedDataParallel(GPT(config, seed=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx, targets = token_batch(config, 4)
    snaps, times = Snapshots(Path(directory) / "snaps", keep=1), {}
    saver = dist.new_group(backend="gloo")              # async_save's collectives get a group of their own

    def timed(name, fn, barrier=True):
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - start)
    for i in range(repeats + 1):                         # the first round warms up (files, DCP's planner)
        timed("step", lambda: (optimizer.zero_grad(), lm_loss(model(idx), targets).backward(), optimizer.step()))
        timed("snapshot", lambda: snaps.save(i, model, optimizer))
        timed("dcp", lambda: sharded.save(Path(directory) / f"dcp-{i}", model, optimizer, step=i))
        future = []
        timed("dcp async, until it returns", lambda: future.append(
            sharded.save(Path(directory) / f"async-{i}", model, optimizer, step=i, blocking=False, group=saver)))
        timed("dcp async, until written", lambda: future[0].result(), barrier=False)   # the rest of the write
    times["snapshot bytes"] = [(snaps.directory / f"step-{repeats:06d}" / f"rank-{dist.get_rank()}.pt").stat().st_size]
    return times


def save_times(config: GPTConfig = DDP_GPT, repeats: int = 5, world: int = 2) -> dict[str, float]:
    """Median seconds of a training step and of each way to save (rank 0, between barriers), and the snapshot's
    bytes per rank, for ``config`` with AdamW under DDP on ``world`` CPU ranks."""
    with tempfile.TemporaryDirectory() as directory:
        times = launch(_save_rank, world, directory, config, repeats, timeout=120, backend="gloo")[0]
    out = {k: statistics.median(v[1:] if len(v) > 1 else v) for k, v in times.items()}
    out["dcp async, until written"] += out["dcp async, until it returns"]
    out["parameters"] = sum(p.numel() for p in GPT(config).parameters())
    return out


def simulate_overhead(interval: float, save: float, mtbf: float, restart: float, work: float,
                      seed: int = 0) -> float:
    """The same, by playing a job of ``work`` seconds with failures drawn from an exponential distribution."""
    rng = np.random.default_rng(seed)
    segments = max(1, round(work / interval))
    need = np.full(segments, interval + save)           # what each segment needs without a failure
    spent = np.zeros(segments)
    todo = np.arange(segments)
    while todo.size:
        gap = rng.exponential(mtbf, todo.size)          # time until the next failure
        ok = gap >= need[todo]
        spent[todo] += np.where(ok, need[todo], gap)
        need[todo[~ok]] = restart + interval + save     # restart, then the segment from its start
        todo = todo[~ok]
    return spent.sum() / (segments * interval) - 1


def interval_sweep(save: float, mtbf: float, restart: float,
                   factors: Sequence[float] = tuple(np.geomspace(0.2, 5, 15)), jobs: float = 2000.0,
                   seed: int = 0) -> dict[str, np.ndarray | float]:
    """Overhead against the interval, ``factors`` times Young's: simulated (a job of ``jobs`` MTBFs each) and exact."""
    young = young_interval(save, mtbf)
    intervals = young * np.asarray(factors)
    simulated = np.array([simulate_overhead(t, save, mtbf, restart, jobs * mtbf, seed + i)
                          for i, t in enumerate(intervals)])
    # the simulated minimum: a parabola through the lowest point and its neighbours, in log(interval)
    i = int(np.clip(simulated.argmin(), 1, len(intervals) - 2))
    a, b, _ = np.polyfit(np.log(intervals[i - 1:i + 2]), simulated[i - 1:i + 2], 2)
    return {"save": save, "mtbf": mtbf, "restart": restart, "young": young, "daly": daly_interval(save, mtbf),
            "intervals": intervals, "simulated": simulated, "exact": expected_overhead(intervals, save, mtbf, restart),
            "best": float(np.exp(-b / (2 * a))) if a > 0 else float(intervals[simulated.argmin()])}


# --------------------------------------------------------------------------- #
# Figures
# --------------------------------------------------------------------------- #
def kill_figure(killed: Run, never: Run):
    """Left: the killed run's losses, attempt by attempt, on the run that never stopped. Right: steps done
    against seconds, where the time the failure cost shows as the gap between the two."""
    import matplotlib.pyplot as plt

    figure, (ax, ax_time) = plt.subplots(1, 2, figsize=(COLUMN_IN, 3.2))
    plt.close(figure)
    kill, resumed = killed.first("killed", 0, rank=None)["step"], killed.first("resumed", 1)["step"]
    ax.plot(*zip(*sorted(never.losses().items())), "-", color="0.6", lw=3, label="never killed")
    for attempt, (marker, colour) in zip(range(killed.attempts), [("o", "tab:blue"), ("x", "tab:orange")]):
        ax.plot(*zip(*sorted(killed.losses(attempt).items())), marker, color=colour, ms=4, label=f"attempt {attempt}")
    ax.axvspan(resumed - 0.5, kill - 0.5, color="tab:orange", alpha=0.15, label="done twice")
    ax.axvline(kill - 0.5, color="tab:red", ls="--", label=f"rank 1 killed (step {kill})")
    worst = max(abs(killed.losses()[step] - loss) for step, loss in never.losses().items())
    ax.set_title(f"max |loss difference| = {worst:g}", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=7)
    for run, label, colour in ((never, "never killed", "0.6"), (killed, "killed, resumed", "tab:orange")):
        for attempt in range(run.attempts):                  # steps done against time, attempt by attempt
            steps = [(e["t"] - run.origin, e["step"] + 1) for e in run.events if e["event"] == "step"
                     and e["attempt"] == attempt]
            ax_time.plot(*zip(*steps), ".-", color=colour, ms=3, label=None if attempt else f"{label}: "
                         f"{run.seconds:.2f} s")
    for event, attempt, colour in (("killed", 0, "tab:red"), ("start", 1, "tab:purple"), ("resumed", 1, "tab:green")):
        t = killed.first(event, attempt, rank=None)["t"] - killed.origin
        ax_time.axvline(t, color=colour, ls=":", label=f"{event}{' (attempt 1)' if attempt else ''} at {t:.2f} s")
    ax_time.set_xlabel("seconds since training began")
    ax_time.set_ylabel("steps done")
    ax_time.legend(fontsize=7)
    figure.tight_layout()
    return figure


def interval_figure(sweep: dict):
    """Overhead (extra time per unit of work) against the checkpoint interval: simulated, exact, Young, Daly."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    figure, ax = plt.subplots(figsize=(COLUMN_IN, 3.4))
    plt.close(figure)
    tau, save, mtbf, restart = sweep["intervals"], sweep["save"], sweep["mtbf"], sweep["restart"]
    ax.plot(tau, 100 * sweep["exact"], "-", color="0.5", label="expected (Daly's exact formula)")
    ax.plot(tau, 100 * (save / tau + (tau / 2 + restart) / mtbf), ":", color="0.3",
            label="first order: C/τ + (τ/2 + R)/M")
    ax.plot(tau, 100 * sweep["simulated"], "o", color="tab:blue", ms=4, label="simulated job")
    for key, colour, name in (("young", "tab:red", "Young √(2CM)"), ("daly", "tab:green", "Daly"),
                              ("best", "tab:blue", "simulated minimum")):
        ax.axvline(sweep[key], color=colour, ls="--" if key != "best" else ":", label=f"{name}: {sweep[key]:.3g} s")
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())
    ticks = sweep["young"] * np.array([0.2, 0.5, 1, 2, 5])
    ax.set_xticks(ticks, [f"{t:.3g}" for t in ticks])
    ax.set_xlabel("checkpoint interval τ (seconds of work)")
    ax.set_ylabel("time lost (% of the work)")
    ax.set_title(f"C = {sweep['save']:.3g} s, MTBF = {sweep['mtbf']:.3g} s, restart R = {sweep['restart']:.3g} s",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))   # beside the axes: inside, it hid the
    figure.tight_layout()                                                 # tops of the three interval lines
    return figure


# --------------------------------------------------------------------------- #
# Problems
# --------------------------------------------------------------------------- #
def problem_recomputed(script: str | os.PathLike, directory: str | os.PathLike, kill_at: int = 14,
                       every: int = 5) -> Answer:
    """Steps run twice when rank 1 dies at the top of step s with snapshots every k: s - k * floor(s / k)."""
    killed = run_script(script, directory, max_restarts=1, kill_at=kill_at, every=every)
    twice = set(killed.losses(0)) & set(killed.losses(1))
    return Answer(len(twice), kill_at - every * (kill_at // every), "steps", 0.0, "steps counted in the log: exact")


def problem_snapshot_bytes(times: dict[str, float]) -> Answer:
    """One rank's snapshot file under AdamW in float32: the parameters and two moments, 12 bytes per parameter."""
    return Answer(times["snapshot bytes"], 12 * times["parameters"], "B", 0.02,
                  "the file also holds the generators' states, AdamW's step counts, the names and the zip "
                  "container's headers, a few hundred bytes per tensor: 75 kB here")


def problem_first_drift(script: str | os.PathLike, directory: str | os.PathLike, never: Run, kill_at: int = 11,
                        every: int = 4) -> Answer:
    """The first step whose loss differs from the run that never stopped, when the resume skips the generators."""
    drift = run_script(script, directory, max_restarts=1, restore_rng=False, kill_at=kill_at, every=every)
    first = min(s for s, loss in drift.losses().items() if loss != never.losses()[s])
    return Answer(first, every * (kill_at // every), "", 0.0, "the first step after the resume draws other dropout "
                  "masks: exact")


def problem_young(save: float = 30.0, mtbf: float = 6 * 3600.0, restart: float = 120.0) -> Answer:
    """The simulated best interval for C = 30 s and a failure every 6 h on average, against sqrt(2 C M)."""
    sweep = interval_sweep(save, mtbf, restart)
    return Answer(sweep["best"], young_interval(save, mtbf), "s", 0.15, "the overhead is flat near its minimum, "
                  "so the simulated one wanders; Daly's higher-order optimum sits 2% below Young's")


def problem_waste(save: float = 30.0, mtbf: float = 6 * 3600.0, restart: float = 120.0) -> Answer:
    """Time lost at Young's interval, simulated, against the first-order sqrt(2C/M) + R/M."""
    young = young_interval(save, mtbf)
    measured = simulate_overhead(young, save, mtbf, restart, 2000 * mtbf)
    return Answer(measured, math.sqrt(2 * save / mtbf) + restart / mtbf, "", 0.1,
                  "first order in tau/M: the exact expectation is 4% higher here")
