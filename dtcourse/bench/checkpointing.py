"""Benchmark: what activation checkpointing keeps and what it costs, measured beside its models.

    python -m dtcourse.bench.checkpointing                 # segment sweep and GPT policies
    python -m dtcourse.bench.checkpointing --quick         # fewer repeats (too few to quote)
    python -m dtcourse.bench.checkpointing --out bench-results/checkpointing.png

The measurements and the predictions they are printed beside come from
``dtcourse.lab.checkpointing`` (its docstring explains both), with the figures; lesson 05 draws
the same ones. This script adds
``torch.utils.checkpoint.checkpoint_sequential`` timed on the same stack in the same run as the
reference. Times are medians over interleaved repeats, printed and drawn, never asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Sequence

import torch

from dtcourse.lab.checkpointing import (attention_saved, measure_policies, measure_save_on_cpu, measure_segments,
                                       mlp_layers, plot_policies, plot_segments, predicted_step_ms)
from dtcourse.models import RECOMPUTE_GPT

__all__ = ["main"]


def _torch_step_ms(n_layers: int, width: int, batch: int, ks: Sequence[int],
                   repeats: int) -> dict[int, float]:
    """torch.utils.checkpoint.checkpoint_sequential (non-reentrant) on the same stack: the reference."""
    from torch.utils.checkpoint import checkpoint_sequential as torch_sequential

    layers, x = mlp_layers(n_layers, width), torch.randn(batch, width)
    times: dict[int, list[float]] = {k: [] for k in ks}
    for round_ in range(repeats + 1):
        for k in ks:
            start = time.perf_counter()
            torch_sequential(layers, k, x, use_reentrant=False).sum().backward()
            if round_:
                times[k].append(time.perf_counter() - start)
    return {k: 1e3 * statistics.median(t) for k, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="3 repeats: a smoke test, too few to quote")
    parser.add_argument("--out", help="save the segment figure here, the policy one as *_policies.png")
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else args.repeats
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    points = measure_segments(args.layers, args.width, args.batch, repeats=repeats)
    divisors = [p.segments for p in points if args.layers % p.segments == 0]
    reference = _torch_step_ms(args.layers, args.width, args.batch, divisors, repeats)
    predicted = predicted_step_ms(points)
    print(f"\nSegment sweep: {args.layers} layers of width {args.width} ({args.layers - 1} of Linear + ReLU, "
          f"then a Linear), batch {args.batch}; "
          f"unit = {points[0].unit / 1024:g} KiB; torch = torch.utils.checkpoint.checkpoint_sequential "
          "(timed where k divides n, where both cut the same segments)")
    head = (f"{'k':>3}{'held KiB':>10}{'predicted':>10}{'peak KiB':>10}{'recomputed':>11}{'step ms':>9}"
            f"{'predicted':>10}{'torch ms':>9}{'vs torch':>9}")
    print(head + "\n" + "-" * len(head))
    for p in points:
        ref = reference.get(p.segments)
        tail = f"{ref:>9.2f}{p.step_ms / ref:>8.2f}x" if ref else ""
        print(f"{p.segments:>3}{p.held_after_forward / 1024:>10,.0f}{p.predicted_held / 1024:>10,.0f}"
              f"{p.peak / 1024:>10,.0f}{p.recomputed_layers:>11}{p.step_ms:>9.2f}"
              f"{predicted[p.segments]:>10.2f}{tail}")
    policies = measure_policies(repeats=repeats)
    c = RECOMPUTE_GPT
    print(f"\nRecomputation policies: GPT n_layer={c.n_layer}, d_model={c.d_model}, n_head={c.n_head}, "
          f"seq {c.block_size}, batch 4")
    head = (f"{'policy':<10}{'held MiB':>10}{'predicted':>10}{'peak MiB':>10}{'step ms':>9}{'vs none':>9}"
            f"{'FLOPs':>8}")
    print(head + "\n" + "-" * len(head))
    plain = policies[0].step_ms
    for p in policies:
        print(f"{p.policy:<10}{p.held_after_forward / 2**20:>10.2f}{p.predicted_held / 2**20:>10.2f}"
              f"{p.peak / 2**20:>10.2f}{p.step_ms:>9.1f}{p.step_ms / plain - 1:>+9.0%}"
              f"{p.predicted_overhead:>+8.0%}")
    print("\nWhat the attention core saves for backward (same GPT, batch 4; bytes handed to a pack hook)")
    for name, tensors in attention_saved(c, batch=4).items():
        print(f"{name:<10}{sum(n for _, n in tensors) / 1024:>8,.0f} KiB in all, the largest "
              f"{max(tensors, key=lambda t: t[1])[0]}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    off = measure_save_on_cpu(4, args.width, args.batch, device=device)
    print(f"\nsave_on_cpu on {device}, 4 layers of width {args.width}, batch {args.batch}: the forward leaves "
          f"{off.held_plain / 1024:,.0f} KiB plain, {off.held_offloaded / 1024:,.0f} KiB offloaded; "
          f"pack handed {off.packed / 1024:,.0f} KiB, copied {off.copied / 1024:,.0f} KiB")
    if args.out:
        policies_out = os.path.splitext(args.out)[0] + "_policies.png"
        plot_segments(points).savefig(args.out, dpi=100)
        plot_policies(policies).savefig(policies_out, dpi=100)
        print(f"\nsaved {args.out} and {policies_out}")


if __name__ == "__main__":
    main()
