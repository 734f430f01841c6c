"""Benchmark: what a parameter server costs and buys, measured on ``dtcourse.parameter_server``.

    python -m dtcourse.bench.parameter_server          # tables, and plots in bench-results/

It runs lesson 03's measurements at full size (``dtcourse.lab.parameter_server``): the busiest
link's traffic against the ring's (one server, two, and k = N beside the workers), straggler step
times and the median wait for a pull, convergence against the staleness bound with a stalled
worker, the RPC server against the message server (start-up, loop time, calls), and actors and a
learner for several pull periods.
"""

from __future__ import annotations

import argparse
import os
import statistics

from dtcourse.lab.parameter_server import (actor_learner_figure, actor_learner_runs, convergence_figure, final_loss,
                                           late_return, pull_waits, rpc_comparison, rpc_table, staleness_counts,
                                           staleness_sweep, step_times, straggler_runs, traffic, traffic_figure,
                                           traffic_table)
from dtcourse.parameter_server.actor_learner import greedy_return


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--repeats", type=int, default=5, help="runs per timing (medians are printed)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = traffic()
    print(traffic_table(rows))
    beside = traffic(worker_counts=(2, 3, 4, 6), colocated=True, ring=False)
    print("k = N servers beside the workers, bytes out of the busiest machine per iteration: "
          + ", ".join(f"N={r['workers']}: {r['ps']:,.0f} (2(N-1)/N·S = {r['ps_model']:,.0f})" for r in beside))
    traffic_figure(rows, traffic(num_servers=2, ring=False), beside).savefig(f"{args.out}/ps_traffic.png", dpi=120)

    for rotating in (False, True):
        print(f"\nms per iteration, ranks 1-4, {'each worker slow in turn' if rotating else 'rank 4 always slow'} "
              f"(median of {args.repeats} runs):")
        runs = [straggler_runs(rotating=rotating) for _ in range(args.repeats)]
        for name in runs[0]:
            times = [statistics.median(step_times({name: r[name]})[name][w] for r in runs) for w in range(4)]
            waits = statistics.median(pull_waits({name: r[name]})[name] for r in runs)
            print(f"  {name:>9}: " + " ".join(f"{1e3 * t:6.1f}" for t in times)
                  + f"   median wait per pull, ranks 1-3: {1e3 * waits:5.1f} ms")

    runs = staleness_sweep()
    print("\nrank 4 stalls once, after its first gradient, until the others can go no further (ps.Stall); "
          "SGD on a round quadratic, lr 0.25:")
    for name, run in runs.items():
        print(f"  {name:>9}: staleness histogram {staleness_counts(run)}, final loss {final_loss(run):.1e}, "
              f"{run.seconds:.2f} s")
    convergence_figure(runs).savefig(f"{args.out}/ps_staleness.png", dpi=120)

    pairs = [rpc_comparison() for _ in range(args.repeats)]
    print(f"\nRPC server against message server, 3 workers, 5 steps (median of {args.repeats}):")
    print(f"  rpc.init_rpc {statistics.median(r.startup_seconds for _, r in pairs):.2f} s; workers' loops: RPC "
          f"{statistics.median(r.seconds for _, r in pairs):.3f} s, messages {statistics.median(m.seconds for m, _ in pairs):.3f} s; "
          f"largest parameter difference {max((r.params - m.params).abs().max().item() for m, r in pairs):.1e}")
    print("  " + rpc_table(*pairs[0]).replace("\n", "\n  "))

    agents = actor_learner_runs(pulls=(10, 50, 250, 1000))
    print("\nactors and a learner, 3 actors x 1,000 steps, 542 updates:")
    for pull, run in agents.items():
        bound = run.config.staleness_bound
        print(f"  pull every {pull:>4}: staleness max {max(run.staleness())} (bound {bound}), "
              f"actors' return in the last third {late_return(run):5.1f}, learner's greedy return "
              f"{greedy_return(run.config, run.params, 10):5.1f}")
    actor_learner_figure(agents).savefig(f"{args.out}/ps_actors.png", dpi=120)
    print(f"\nplots saved in {args.out}/")


if __name__ == "__main__":
    main()
