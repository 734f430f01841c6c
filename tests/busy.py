"""Run a command while other processes keep every core busy, as on a student's working laptop.

    python tests/busy.py -- python -m pytest --nbval-lax lessons

``make test`` runs the lessons this way, so that every live measurement in them (a timing, a
fit, a ratio) keeps working when the machine is loaded. The load is one busy-looping process
per core at normal priority. At the end it prints how much CPU the load really took, so a run
where the load did not happen cannot pass for one where it did. The exit status is the command's.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

SPIN = "import os, signal\nsignal.signal(signal.SIGTERM, lambda *a: os._exit(0))\nwhile True: pass\n"


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used so far (from /proc; 0.0 where there is none)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--procs", type=int, default=os.cpu_count() or 1,
                        help="busy processes to run beside the command (default: one per core, %(default)s)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if args.procs < 1:
        parser.error(f"--procs must be at least 1, got {args.procs}")
    load = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.procs)]
    start = time.monotonic()
    try:
        status = subprocess.call(command)
    finally:
        used = sum(cpu_seconds(p.pid) for p in load)
        for p in load:
            p.send_signal(signal.SIGTERM)
        for p in load:
            p.wait()
    wall = time.monotonic() - start
    print(f"busy.py: {args.procs} busy processes took {used:.0f} CPU-s beside the command's {wall:.0f} s "
          f"(on {os.cpu_count()} cores: about {used / max(wall, 1e-9) / (os.cpu_count() or 1):.0%} of the machine)")
    return status


if __name__ == "__main__":
    sys.exit(main())
