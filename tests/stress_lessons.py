"""Run every lesson several times under extra load and count, per lesson, the runs where a cell failed.

    python tests/stress_lessons.py --runs 10 --procs 4          # make stress

``make test`` runs the lessons once beside one busy process per core (``tests/busy.py``). This
runs them ``--runs`` times beside ``--procs`` busy processes (4 on the 2-core box: twice the load)
and prints one line per lesson: runs, failures, and each failing cell with its first error line.
A lesson's assertions must state what its algorithm guarantees, so the count to expect is 0
everywhere. It takes about ``runs`` times as long as the lessons take in ``make test``.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADER = re.compile(r"^_+ (lessons/\S+\.ipynb)::Cell (\d+) _+$")
ERROR = re.compile(r"^[A-Za-z_.]*(Error|Exception|Timeout|Interrupt)\w*\b")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def failing_cells(output: str) -> dict[str, list[str]]:
    """pytest/nbval output -> {lesson: ["cell N: its last error line", ...]}."""
    failed: dict[str, list[str]] = collections.defaultdict(list)
    lesson = cell = None
    error = ""
    for line in ANSI.sub("", output).splitlines() + ["____ lessons/end.ipynb::Cell 0 ____"]:
        m = HEADER.match(line)
        if m:
            if lesson:
                failed[lesson].append(f"cell {cell}: {error[:110] or 'no error line found'}")
            lesson, cell, error = m.group(1), m.group(2), ""
        elif lesson and ERROR.match(line):
            error = line.strip()
    failed.pop("lessons/end.ipynb", None)
    return failed


def one_pass(procs: int, lessons: list[str], log: Path) -> dict[str, list[str]]:
    """Run ``lessons`` once under ``procs`` busy processes; the failing cells by lesson."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"      # torchrun, as in make test
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=path)
    command = [sys.executable, str(ROOT / "tests" / "busy.py"), "--procs", str(procs), "--",
               sys.executable, "-m", "pytest", "-q", "--nbval-lax", "--nbval-current-env",
               "--nbval-cell-timeout=300", "-p", "no:randomly", *lessons]
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    log.write_text(out.stdout + out.stderr)
    failed = failing_cells(out.stdout)
    if out.returncode and not failed:
        failed["(the run itself)"].append(f"exit {out.returncode}; see {log}")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--procs", type=int, default=2 * (os.cpu_count() or 1),
                        help="busy processes beside each run (default: two per core, %(default)s)")
    parser.add_argument("--logs", default="/tmp/dtcourse-stress", help="folder for each run's pytest output")
    parser.add_argument("lessons", nargs="*", help="notebooks (default: every lesson)")
    args = parser.parse_args(argv)
    lessons = args.lessons or sorted(str(p.relative_to(ROOT)) for p in (ROOT / "lessons").glob("*.ipynb"))
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    failures: dict[str, list[str]] = collections.defaultdict(list)
    start = time.monotonic()
    for run in range(1, args.runs + 1):
        failed = one_pass(args.procs, lessons, logs / f"run{run:02d}.log")
        for lesson, cells in failed.items():
            failures[lesson].append(f"run {run}: " + "; ".join(cells))
        print(f"run {run}/{args.runs}: {sum(map(len, failed.values()))} failing cells "
              f"({time.monotonic() - start:.0f} s so far)", flush=True)
    print(f"\n{args.runs} runs of each lesson beside {args.procs} busy processes on {os.cpu_count()} cores, "
          f"{time.monotonic() - start:.0f} s:")
    for lesson in lessons + [k for k in failures if k not in lessons]:
        print(f"  {lesson}: {args.runs} runs, {len(failures.get(lesson, []))} with a failure")
        for line in failures.get(lesson, []):
            print(f"      {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
