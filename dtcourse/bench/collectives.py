"""Benchmark: our all-reduces, ring reduce-scatter and ring all-gather against the backend's own, in one run.

    python -m dtcourse.bench.collectives                       # about 90 s on 2 cores
    python -m dtcourse.bench.collectives --world-sizes 4 --sizes 16M 64M --repeats 15

Every algorithm and the backend take turns, iteration by iteration, so each ring/backend
ratio is a median of paired ratios (t_backend / t_ring = busbw_ring / busbw_backend): a
burst of load from another program slows both sides of a pair. In its turn each runs once
untimed before its timed call, since a call that follows a different algorithm runs slower
(``lab.collectives.LEAD_IN``). Each iteration counts as long as its slowest rank. The table
gives busbw as nccl-tests defines it; the plot draws it beside the alpha-beta-gamma model
fitted on the same machine (``dtcourse.lab.collectives.fit_link``).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from dtcourse.lab.collectives import (AGAIN, BACKEND, BLOCKS, DEFAULT_SIZES, SLICES, fit_link, measure, paired_ratio,
                                      plot, table)

RING = f"ring/{SLICES}"
# Rounds rotate the order (``bench.turns``): with a round count that is a multiple of the variants, each is first,
# second, ... equally often. With 5 variants in 11 rounds, gloo timed against itself read 0.83-1.20x at 16 MB over
# nine runs; these 4 in 20 rounds read 0.92-1.03x over ten (BENCHMARKS.md). ring/2 is in the full table.
HEADLINE = ("ring", BLOCKS, BACKEND, AGAIN)


def _parse_size(text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=_parse_size, nargs="+", default=DEFAULT_SIZES)
    parser.add_argument("--repeats", type=int, default=None,
                        help="paired iterations per size (default: 20 up to 1 MB, 8 up to 16 MB, 5 above)")
    parser.add_argument("--headline-repeats", type=int, default=20,
                        help="paired iterations of ring vs backend at 16 and 64 MB on 4 ranks (rounded up to a "
                             "multiple of the headline's variants, so that each is first as often as the others)")
    parser.add_argument("--out", default="bench-results/collectives.png")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    load = os.getloadavg()[0]
    rows = []
    for n in args.world_sizes:
        rows += measure(n, args.sizes, ("naive", "tree", "ring", RING, BLOCKS, BACKEND), iterations=args.repeats)
        for collective in ("reduce_scatter", "all_gather"):
            rows += measure(n, args.sizes, ("ring", BACKEND), collective=collective, iterations=args.repeats)
    models = {n: fit_link(n) for n in args.world_sizes}
    # the headline: ring against gloo at 16 and 64 MB on 4 ranks, with more paired repeats
    # with the backend timed twice per round: its ratio to itself shows how far identical calls wander
    repeats = -(-args.headline_repeats // len(HEADLINE)) * len(HEADLINE)   # every variant in every place equally often
    headline = measure(4, [16 << 20, 64 << 20], HEADLINE, iterations=repeats)

    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, backend gloo, "
          f"load average {load:.2f} before and {os.getloadavg()[0]:.2f} after")
    for n, m in models.items():
        print(f"fit on {n} ranks: alpha = {m.alpha * 1e6:.1f} us, 1/beta = {1 / m.beta / 1e9:.2f} GB/s, "
              f"1/gamma = {1 / m.gamma / 1e9:.2f} GB/s")
    print("\n" + table(rows))
    print(f"\nheadline, N = 4, {repeats} paired iterations (busbw ratio against {BACKEND}):")
    for nbytes in (16 << 20, 64 << 20):
        ratios = "  ".join(f"{a}: {paired_ratio(headline, a, 'all_reduce', 4, nbytes):.2f}x"
                           for a in HEADLINE if a != BACKEND)
        print(f"  {nbytes >> 20:>3} MB  {ratios}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    plot(rows, models).savefig(args.out, dpi=100)
    print(f"\nplot saved to {args.out}; {time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
