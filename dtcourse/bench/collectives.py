"""Benchmark: naive, tree and ring all-reduce against the backend's own, in one run.

    python -m dtcourse.bench.collectives                      # 2 and 4 ranks, 4 KB .. 64 MB
    python -m dtcourse.bench.collectives --world-sizes 4 --sizes 16M 64M

For every world size and message size it times each algorithm (the median of
several iterations; each iteration's time is the slowest rank's), prints
algbw and busbw as nccl-tests defines them, the ratio of ring's busbw to the
backend's, and saves a plot with the alpha-beta model fitted from a ping-pong
between two ranks drawn beside the measurements.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from dtcourse.collectives import ALGORITHMS, busbw, fit_alpha_beta, predict_time
from dtcourse.launcher import launch

BACKEND = "backend"   # the process group's own dist.all_reduce (gloo here, nccl on GPUs)
DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _iterations(nbytes: int) -> int:
    return 20 if nbytes <= (1 << 20) else 8 if nbytes <= (16 << 20) else 5


def _time_rank(sizes: list[int], algorithms: list[str]) -> list[dict]:
    """Inside every rank: time each algorithm at each size; rank 0's list is the answer."""
    world = dist.get_world_size()
    rows = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        for name in algorithms:
            run = (lambda t: dist.all_reduce(t)) if name == BACKEND else ALGORITHMS[name]
            times = []
            for i in range(_iterations(nbytes) + 2):            # the first 2 are warm-up
                x.fill_(1.0)                                    # repeated sums would overflow to inf
                dist.barrier()
                start = time.perf_counter()
                run(x)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # an iteration lasts as long as its slowest rank
                if i >= 2:
                    times.append(elapsed.item())
            seconds = statistics.median(times)
            rows.append({"algorithm": name, "world_size": world, "nbytes": nbytes, "seconds": seconds,
                         "algbw": nbytes / seconds, "busbw": busbw("all_reduce", nbytes, seconds, world)})
    return rows


def measure(world_size: int, sizes: list[int] | None = None,
            algorithms: tuple[str, ...] = ("naive", "tree", "ring", BACKEND), timeout: float = 600) -> list[dict]:
    """Time all-reduce algorithms at one world size; one dict per (algorithm, size)."""
    return launch(_time_rank, world_size, list(sizes or DEFAULT_SIZES), list(algorithms), timeout=timeout)[0]


def _ping_pong_rank(sizes: list[int], repeats: int) -> list[tuple[int, float]]:
    rank = dist.get_rank()
    out = []
    for nbytes in sizes:
        buf = torch.ones(max(nbytes // 4, 1))
        times = []
        for _ in range(repeats + 2):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - start) / 2)      # one way = half a round trip
        out.append((buf.nbytes, statistics.median(times[2:])))
    return out


def ping_pong(sizes: list[int] | None = None, repeats: int = 10) -> list[tuple[int, float]]:
    """One-way message time between two ranks, for fitting alpha (latency) and beta (s/byte)."""
    sizes = sizes or [4, 4 << 10, 64 << 10, 1 << 20, 4 << 20]
    return launch(_ping_pong_rank, 2, sizes, repeats)[0]


def fitted_model(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """alpha (s) and beta (s/byte) from ping-pong samples."""
    return fit_alpha_beta([s for s, _ in samples], [t for _, t in samples])


def table(rows: list[dict]) -> str:
    """Text table: one line per (world size, size), busbw per algorithm and ring/backend ratio."""
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    head = f"{'N':>3} {'size':>8} " + " ".join(f"{a + ' GB/s':>13}" for a in algorithms) + "  ring/backend"
    lines = [head, "-" * len(head)]
    keys = sorted({(r["world_size"], r["nbytes"]) for r in rows})
    for n, nbytes in keys:
        by_alg = {r["algorithm"]: r for r in rows if (r["world_size"], r["nbytes"]) == (n, nbytes)}
        cells = " ".join(f"{by_alg[a]['busbw'] / 1e9:13.3f}" for a in algorithms)
        ratio = (by_alg["ring"]["busbw"] / by_alg[BACKEND]["busbw"]) if {"ring", BACKEND} <= by_alg.keys() else float("nan")
        lines.append(f"{n:>3} {_human(nbytes):>8} {cells}  {ratio:12.2f}")
    return "\n".join(lines)


def plot(rows: list[dict], alpha: float | None = None, beta: float | None = None):
    """busbw against message size, one panel per world size, with the alpha-beta predictions dashed."""
    import matplotlib.pyplot as plt

    worlds = sorted({r["world_size"] for r in rows})
    fig, axes = plt.subplots(1, len(worlds), figsize=(5 * len(worlds), 3.8), squeeze=False, sharey=True)
    for ax, n in zip(axes[0], worlds):
        for name in dict.fromkeys(r["algorithm"] for r in rows):
            mine = sorted((r for r in rows if r["world_size"] == n and r["algorithm"] == name),
                          key=lambda r: r["nbytes"])
            sizes = [r["nbytes"] for r in mine]
            line, = ax.plot(sizes, [r["busbw"] / 1e9 for r in mine], "o-", label=f"{name} (measured)")
            if alpha is not None and name in ALGORITHMS:
                predicted = [busbw("all_reduce", s, predict_time(name, s, n, alpha, beta), n) / 1e9 for s in sizes]
                ax.plot(sizes, predicted, "--", color=line.get_color(), alpha=0.7, label=f"{name} (model)")
        ax.set_xscale("log")
        ax.set_yscale("log")                     # small messages are latency-bound: keep them visible
        ax.set_title(f"all-reduce, N = {n}")
        ax.set_xlabel("message size (bytes)")
    axes[0][0].set_ylabel("bus bandwidth (GB/s)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    return fig


def _human(nbytes: int) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def _parse_size(text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=_parse_size, nargs="+", default=DEFAULT_SIZES)
    parser.add_argument("--out", default="bench-results/collectives.png")
    args = parser.parse_args(argv)
    rows = [row for n in args.world_sizes for row in measure(n, args.sizes)]
    alpha, beta = fitted_model(ping_pong())
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, backend gloo")
    print(f"ping-pong fit: alpha = {alpha * 1e6:.1f} us, 1/beta = {1 / beta / 1e9:.2f} GB/s\n")
    print(table(rows))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    plot(rows, alpha, beta).savefig(args.out, dpi=120)
    print(f"\nplot saved to {args.out}")


if __name__ == "__main__":
    main()
