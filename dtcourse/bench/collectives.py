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

import torch

from dtcourse.lab.collectives import DEFAULT_SIZES, fitted_model, measure, ping_pong, plot, table


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
