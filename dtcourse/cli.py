"""The ``dtcourse`` command: ``check``, ``grade``, ``audit``, ``exercises``, ``course`` and ``bench``.

    dtcourse check 01                                    # a student: the visible checks, PASS/FAIL and points
    dtcourse grade exercises/01_collectives_ring.ipynb   # an instructor: hidden checks too (needs solutions/)
    dtcourse audit submitted/*/01_*/*.ipynb              # code that reaches into the grading
    dtcourse exercises --check                           # is exercises/ current with solutions/?
    dtcourse course ~/grading                            # an nbgrader course folder, for instructors
    dtcourse bench collectives --world-sizes 4           # a benchmark script, by its stem
    dtcourse bench --list                                # the benchmarks there are

Each sub-command passes the rest of its arguments to the module that does the work
(``dtcourse.grading.grade``, ``dtcourse.grading.audit``, ``dtcourse.grading.exercises``, ``dtcourse.grading.course``,
``dtcourse.bench.<stem>``).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

__all__ = ["main", "benchmarks"]

USAGE = ("usage: dtcourse {check NOTEBOOK | grade NOTEBOOK | audit NOTEBOOK... | exercises [--check] | course DIR | "
         "bench STEM [ARGS] | bench --list} [...]")


def benchmarks() -> list[str]:
    """The stems that have a benchmark script in ``dtcourse.bench``."""
    import dtcourse.bench

    return sorted(m.name for m in pkgutil.iter_modules(dtcourse.bench.__path__))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() if argv else USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in ("grade", "check"):
        from dtcourse.grading.grade import main as run
        return run(rest, self_check=command == "check")
    if command == "audit":
        from dtcourse.grading.audit import main as run
        return run(rest)
    if command == "exercises":
        from dtcourse.grading.exercises import main as run
        return run(rest)
    if command == "course":
        from dtcourse.grading.course import main as run
        return run(rest)
    if command == "bench":
        stems = benchmarks()
        if not rest or rest[0] in ("--list", "-h", "--help"):
            print("benchmarks: " + ", ".join(stems))
            return 0 if rest else 2
        if rest[0] not in stems:
            print(f"dtcourse bench: no benchmark named {rest[0]!r}; choose one of {', '.join(stems)}.",
                  file=sys.stderr)
            return 2
        module = importlib.import_module(f"dtcourse.bench.{rest[0]}")
        result = module.main(rest[1:])
        return result if isinstance(result, int) else 0
    print(f"dtcourse: unknown command {command!r}.\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
