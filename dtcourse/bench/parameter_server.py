"""Benchmark: what a parameter server costs and buys, measured on ``dtcourse.parameter_server``.

    python -m dtcourse.bench.parameter_server          # tables, and plots in bench-results/

It runs lesson 03's three measurements at full size (``dtcourse.lab.parameter_server``): the
busiest link's traffic against the ring's, straggler step times, and convergence against the
staleness bound.
"""

from __future__ import annotations

import argparse
import os

from dtcourse.lab.parameter_server import (convergence_figure, staleness_counts, staleness_sweep, step_times,
                                           straggler_runs, traffic, traffic_figure, traffic_table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench-results")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = traffic()
    print(traffic_table(rows))
    traffic_figure(rows, traffic(num_servers=2)).savefig(f"{args.out}/ps_traffic.png", dpi=120)
    for rotating in (False, True):
        print(f"\nms per iteration, {'each worker slow in turn' if rotating else 'one slow worker'}:")
        for name, times in step_times(straggler_runs(rotating=rotating)).items():
            print(f"  {name:>9}: " + " ".join(f"{1e3 * t:6.1f}" for t in times))
    runs = staleness_sweep()
    for name, run in runs.items():
        print(f"{name:>9}: staleness histogram {staleness_counts(run)}, {run.seconds:.2f} s")
    convergence_figure(runs).savefig(f"{args.out}/ps_staleness.png", dpi=120)
    print(f"\nplots saved in {args.out}/")


if __name__ == "__main__":
    main()
