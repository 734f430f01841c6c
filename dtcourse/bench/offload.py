"""Benchmark: what offloading the optimizer costs and frees, against ZeRO without it, in one run.

    python -m dtcourse.bench.offload                  # 2 ranks, about 30 s on 2 cores
    python -m dtcourse.bench.offload --quick          # a smoke test, too few steps to quote
    python -m dtcourse.bench.offload --world-size 4 --stage 3

ZeRO (stage 2 by default) trains an MLP of 8.4 M parameters (34 MB in fp32) with AdamW three
ways, each in its own launch so that its resident memory is its own (``dtcourse.lab.offload``): the
optimizer on the device, on the host (``OffloadedOptimizer(tier="host")``) and on disk
(``tier="disk"``, ZeRO-Infinity's slower tier; on a CPU-only machine the one where the transfers
are real). The reference is the first: the same ZeRO with its optimizer where the model is.
Per rank and step: bytes down and up, bytes read and written, the median seconds of each part
(compute, transfer, disk, optimizer with ZeRO's all-gather), the step's total against the
reference's, the optimizer state the device keeps, and the resident memory against the
reference's. Times are medians over the steps, measured while nothing else should run.
"""

from __future__ import annotations

import argparse
import os

import torch

from dtcourse.lab.offload import PARTS, VARIANTS, measure_offload

__all__ = ["main", "BENCH_SIZES"]

BENCH_SIZES = (1024, 2048, 2048, 1024)     # 8.4 M parameters; Adam's m and v: 67 MB in fp32


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rows", type=int, default=64, help="rows of the batch per rank")
    parser.add_argument("--quick", action="store_true", help="a small model and 2 steps: a smoke test")
    args = parser.parse_args(argv)
    sizes = (64, 128, 64) if args.quick else BENCH_SIZES
    steps = 2 if args.quick else args.steps
    load = os.getloadavg()
    runs = measure_offload(args.world_size, VARIANTS, sizes=sizes, stage=args.stage, steps=steps, rows=args.rows)
    psi = sum(a * b + b for a, b in zip(sizes, sizes[1:]))
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, gloo, 1 thread per rank; load average "
          f"{'/'.join(f'{x:.2f}' for x in load)} before")
    print(f"ZeRO stage {args.stage}, N = {args.world_size}, MLP {sizes} (Ψ = {psi:,}), {args.rows} rows per rank, "
          f"AdamW; medians of {steps} steps after one warm-up; rank 0\n")
    head = (f"{'optimizer on':<14}{'down MiB':>9}{'up MiB':>8}{'read MiB':>9}{'written':>9}"
            + "".join(f"{p + ' ms':>14}" for p in PARTS) + f"{'step':>8}{'vs device':>10}{'states MiB':>11}"
            f"{'resident':>10}")
    print(head + "\n" + "-" * len(head))
    base = runs["device"]
    base_ms = 1e3 * sum(base.seconds.values())
    for name, r in runs.items():
        ms = 1e3 * sum(r.seconds.values())
        print(f"{name:<14}{r.down / 2**20:>9.1f}{r.up / 2**20:>8.1f}{r.read / 2**20:>9.1f}{r.written / 2**20:>9.1f}"
              + "".join(f"{1e3 * r.seconds[p]:>14.1f}" for p in PARTS)
              + f"{ms:>8.1f}{ms / base_ms:>9.2f}x{r.device_states / 2**20:>11.1f}"
              f"{(r.resident - base.resident) / 2**20:>+10.1f}")
    print("\nresident: VmRSS between steps, MiB above (+) or below (-) the run with the optimizer on the device")


if __name__ == "__main__":
    main()
