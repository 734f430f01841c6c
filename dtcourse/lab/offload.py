"""What lesson 07 runs and draws: offloading's traffic, its time, and the memory it frees.

``measure_offload`` trains ``ZeRO`` (stage 2 by default) on N ranks three ways, one launch each:
the optimizer on the device (no offloading), on the host (``tier="host"``) and on disk
(``tier="disk"``, the CPU-only stand-in for ZeRO-Infinity's NVMe). For each it reports, per rank and
per step: the bytes moved down (gradients) and up (parameters), the bytes read from and written to
disk, the seconds split into compute (forward and backward), transfer, disk and optimizer, the
bytes of optimizer state the device keeps (``ZeRO.memory()``), and the process's resident memory
(``VmRSS``) between steps. ``plot_offload`` draws the time split, the device's optimizer states and
the resident memory, one panel each. ``linear_run``, ``delayed_lag`` and ``lag_in_steps`` compare the
delayed parameter update with a normal run, step by step.

The resident memory is read after glibc is told to return freed blocks (``malloc_trim``) and to
serve large blocks from ``mmap`` (a fixed ``M_MMAP_THRESHOLD``), so that memory the disk tier
releases really leaves the process; without that, glibc may keep it for reuse.
"""

from __future__ import annotations

import ctypes
import functools
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from dtcourse.lab.problems import Answer
from dtcourse.lab.widgets import COLUMN_IN
from dtcourse.models import MLP, regression_batch
from dtcourse.offload import OffloadedOptimizer
from dtcourse.offload_cost import bytes_each_way, device_optimizer_bytes, disk_bytes_each_way
from dtcourse.runtime.launch import launch
from dtcourse.zero import ZeRO

__all__ = ["OffloadRun", "measure_offload", "plot_offload", "VARIANTS", "linear_run", "delayed_lag", "lag_in_steps",
           "problem_bytes_each_way", "problem_disk_bytes", "problem_device_states", "problem_delayed_lag"]

VARIANTS = ("device", "host", "disk")
SIZES = (512, 1024, 1024, 512)            # 1.6 M parameters: Adam's m and v are 12.6 MB in fp32
PARTS = ("compute", "transfer", "disk", "optimizer")


@dataclass(frozen=True)
class OffloadRun:
    """One variant's step, per rank (rank 0's figures; every rank moves the same amounts)."""

    variant: str
    world: int
    shard_bytes: int           # this rank's fp32 part of the parameters (padded): 4Ψ/N
    down: int                  # bytes per step, device -> host
    up: int                    # bytes per step, host -> device
    read: int                  # bytes per step read from disk
    written: int               # bytes per step written to disk
    seconds: dict[str, float]  # median seconds per step, by part of PARTS
    device_states: int         # bytes of optimizer state the device keeps (ZeRO.memory())
    resident: int              # VmRSS between steps, bytes


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:             # not glibc: resident figures are then what the allocator keeps
        return None


def _resident() -> int:
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _rank(variant: str, sizes: tuple[int, ...], stage: int, steps: int, rows: int) -> OffloadRun:
    libc = _libc()
    if libc is not None:
        libc.mallopt(-3, 128 * 1024)      # M_MMAP_THRESHOLD: large blocks from mmap, returned when freed
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
    optimizer = adamw if variant == "device" else functools.partial(OffloadedOptimizer, inner=adamw, tier=variant)
    model = ZeRO(MLP(sizes, seed=0), stage, optimizer)
    world, rank = dist.get_world_size(), dist.get_rank()
    times: dict[str, list[float]] = {p: [] for p in PARTS}
    per_step: list[tuple[int, int, int, int]] = []
    for step in range(steps + 1):                          # step 0 warms up (first states, first files)
        x, y = regression_batch(rows, sizes[0], sizes[-1], seed=step * world + rank)
        start = time.perf_counter()
        F.mse_loss(model(x), y).backward()
        compute = time.perf_counter() - start
        stats = getattr(model.optimizer, "stats", None)
        before = dict(stats.seconds) if stats else {}
        moved = (stats.down, stats.up, stats.read, stats.written) if stats else (0, 0, 0, 0)
        start = time.perf_counter()
        model.step()
        whole = time.perf_counter() - start
        model.zero_grad()
        if step == 0:
            continue
        times["compute"].append(compute)
        if stats:
            spent = {k: stats.seconds[k] - before[k] for k in before}
            for k, v in spent.items():
                times[k].append(v)
            # the all-gather after the step counts as the optimizer's: it is ZeRO's, not offloading's
            times["optimizer"][-1] += whole - sum(spent.values())
            per_step.append(tuple(now - was for now, was in zip((stats.down, stats.up, stats.read, stats.written),
                                                                 moved)))
        else:
            for k in ("transfer", "disk"):
                times[k].append(0.0)
            times["optimizer"].append(whole)
            per_step.append((0, 0, 0, 0))
    shard = sum(f.master.numel() for f in model._flats(trainable=True)) * 4
    down, up, read, written = per_step[-1]
    return OffloadRun(variant, world, shard, down, up, read, written,
                      {k: statistics.median(v) for k, v in times.items()}, model.memory().optimizer_states,
                      _resident())


def measure_offload(world_size: int = 2, variants: tuple[str, ...] = VARIANTS, *, sizes: tuple[int, ...] = SIZES,
                    stage: int = 2, steps: int = 5, rows: int = 32) -> dict[str, OffloadRun]:
    """Each variant in its own launch (so resident memory is its own); rank 0's ``OffloadRun`` by variant."""
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"measure_offload: variants must come from {VARIANTS}, got {sorted(unknown)}.")
    return {v: launch(_rank, world_size, v, tuple(sizes), stage, steps, rows, timeout=300)[0] for v in variants}


def plot_offload(runs: dict[str, OffloadRun]) -> Figure:
    """Three panels, one quantity each, every bar labelled with its value (so that a zero shows):
    the time per step by part, stacked; the bytes of optimizer state the device keeps
    (``ZeRO.memory()``); and the resident memory (VmRSS) above or below the first run's (the
    process's own few hundred MiB cancel out)."""
    fig = Figure(figsize=(COLUMN_IN, 3.2), layout="constrained")
    times, states, resident = fig.subplots(1, 3, width_ratios=(1.3, 1, 1))
    names = list(runs)
    bottom = [0.0] * len(names)
    for part, colour in zip(PARTS, ("tab:blue", "tab:orange", "tab:red", "tab:green")):
        ms = [1e3 * runs[n].seconds[part] for n in names]
        times.bar(names, ms, bottom=bottom, label=part, color=colour)
        bottom = [b + m for b, m in zip(bottom, ms)]
    times.set_ylabel("ms per step (median, rank 0)")
    times.set_title("Where a step's time goes", fontsize=9)
    times.set_ylim(0, 1.3 * max(bottom))          # room above the bars for the legend
    times.legend(fontsize=7, ncols=2, loc="upper center")
    mib = [runs[n].device_states / 2**20 for n in names]
    _labelled(states, names, mib, "tab:purple", "{:.1f}")
    states.set_ylabel("MiB, rank 0")
    states.set_title("Optimizer states\nkept on the device", fontsize=9)
    base = runs[names[0]].resident
    _labelled(resident, names, [(runs[n].resident - base) / 2**20 for n in names], "tab:gray", "{:+.1f}")
    resident.axhline(0, color="black", linewidth=0.8)
    resident.set_ylabel("MiB, rank 0")
    resident.set_title(f"Resident memory between\nsteps, change from {names[0]!r}", fontsize=9)
    return fig


def _labelled(ax: Axes, names: list[str], values: list[float], colour: str, number: str) -> None:
    """Bars with their value written at the end, ``0`` for a bar of zero height (otherwise invisible)."""
    bars = ax.bar(names, values, color=colour)
    ax.bar_label(bars, labels=["0" if v == 0 else number.format(v) for v in values], fontsize=8, padding=2)
    ax.margins(y=0.18)              # room for the labels above (and below) the tallest bars


def linear_run(delayed: bool, steps: int = 5, numel: int = 64) -> list[torch.Tensor]:
    """The weights after each of ``steps`` AdamW steps on a loss linear in them, offloaded (``delayed`` or not).

    Each step's gradient is a fixed random vector, whatever the weights are, so a delayed and a
    normal run see the same gradients; only the moment each update lands differs.
    """
    w = torch.nn.Parameter(torch.randn(numel, generator=torch.Generator().manual_seed(0)))
    opt = OffloadedOptimizer([w], functools.partial(torch.optim.AdamW, lr=1e-2), delayed=delayed)
    seen = []
    for step in range(steps):
        (w * torch.randn(numel, generator=torch.Generator().manual_seed(step + 1))).sum().backward()
        opt.step()
        w.grad = None
        seen.append(w.detach().clone())           # seen[t]: the weights after step t + 1
    opt.flush()
    return seen


def delayed_lag(steps: int = 5, numel: int = 64) -> list[bool]:
    """For t = 1..steps-1: are the delayed run's weights after step t+1 exactly the normal run's after step t?"""
    normal, delayed = linear_run(False, steps, numel), linear_run(True, steps, numel)
    return [torch.equal(delayed[t], normal[t - 1]) for t in range(1, steps)]


def lag_in_steps(steps: int = 6, numel: int = 64) -> float:
    """The k for which the delayed run's weights after step t + k are the normal run's after step t,
    bit for bit, for every t (nan if no k is)."""
    normal, delayed = linear_run(False, steps, numel), linear_run(True, steps, numel)
    for k in range(steps - 1):
        if all(torch.equal(delayed[t + k], normal[t]) for t in range(steps - k)):
            return k
    return math.nan


# --------------------------------------------------------------------------- #
# Predict-then-check problems
# --------------------------------------------------------------------------- #
def _psi(sizes: tuple[int, ...]) -> int:
    return sum(a * b + b for a, b in zip(sizes, sizes[1:]))


def problem_bytes_each_way(world_size: int = 2, sizes: tuple[int, ...] = SIZES) -> Answer:
    """Bytes a rank sends down (gradients) per step with the optimizer on the host, at stage 2."""
    run = measure_offload(world_size, ("host",), sizes=sizes, steps=2)["host"]
    return Answer(measured=run.down, formula=bytes_each_way(_psi(sizes), world_size), unit="B", rtol=0.01,
                  why="each unit's flat part is padded to a multiple of N elements: a few bytes more than 4Ψ/N")


def problem_disk_bytes(world_size: int = 2, sizes: tuple[int, ...] = SIZES) -> Answer:
    """Bytes a rank reads from disk per step with AdamW's states on disk: the fp32 part, m and v."""
    run = measure_offload(world_size, ("disk",), sizes=sizes, steps=2)["disk"]
    return Answer(measured=run.read, formula=disk_bytes_each_way(_psi(sizes), world_size), unit="B", rtol=0.01,
                  why="padding, as for the transfers; the step counts stay in memory (one scalar per part)")


def problem_device_states(world_size: int = 2, sizes: tuple[int, ...] = SIZES) -> Answer:
    """Bytes of optimizer state a rank's device keeps without offloading (with it: none)."""
    run = measure_offload(world_size, ("device",), sizes=sizes, steps=1)["device"]
    return Answer(measured=run.device_states, formula=device_optimizer_bytes(_psi(sizes), world_size), unit="B", rtol=0.01,
                  why="Adam's m and v of the padded part, plus a 4-byte step count per part")


def problem_delayed_lag() -> Answer:
    """How many steps the delayed run's weights trail the normal run's (k in: after step t + k, the normal's after t)."""
    return Answer(measured=lag_in_steps(), formula=1, unit="step", rtol=0.0,
                  why="update t is copied up when step t + 1 calls step(), after that step's backward: exact")
