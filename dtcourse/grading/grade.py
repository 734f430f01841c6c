"""Grade an exercise notebook as ``nbgrader autograde`` would, without a gradebook.

Two commands, for two people::

    dtcourse check 01                          # a student: the visible checks, no answers needed
    dtcourse grade 01                          # an instructor: every check, hidden ones included
    dtcourse grade ~/work/my_copy.ipynb --source solutions/01_collectives_ring.ipynb

``01`` means ``exercises/01_collectives_ring.ipynb`` from any folder (a name or a path works too).
``python -m dtcourse.grade`` is ``dtcourse grade``.

``dtcourse check`` restores the test cells from the student notebook in ``exercises/``, which
holds only the visible checks: it needs no ``solutions/``, so a class can be given the course
without the answers. The hidden checks show as HIDDEN, worth points only at grading.
``dtcourse grade`` restores them from the instructor's source notebook (``solutions/`` of the
same name unless ``--source`` says otherwise), which holds the answers and the hidden tests.

The steps follow nbgrader's (its preprocessor names in brackets):

1. Read the student's notebook and its source.
2. Sanitize (ClearOutput, DeduplicateIds, OverwriteCells): clear the outputs;
   a ``grade_id`` that appears twice is graded once, in its first cell; every
   locked cell (the test cells, the read-only setup) gets back its text as
   nbgrader keeps it in the gradebook, solutions cleared and hidden tests in;
   points and flags come from the source. Solution cells keep the student's
   code. A test cell the student deleted is put back.
3. Execute (Execute) in a ``python3`` kernel of this environment. A cell that
   runs past ``--cell-timeout`` is interrupted and fails, and grading goes on.
   ``--check-timeout`` bounds each ``dtcourse.checks`` launch (a deadlock).
4. Score each test cell as nbgrader does (``determine_grade``): an error, or
   anything written to stderr, scores 0; otherwise the cell's points, or the
   partial score it evaluates to.
5. Audit the student's cells (``dtcourse.grading.audit``): code that rebinds a
   check or patches the modules the checks rely on is listed under "Flagged".
6. Report (``dtcourse.grading.report``): when the notebook file was last saved, since
   that file is what ran, and each failure once.

Exit status: 0 full marks, 1 some check failed (or something was flagged), 2 the notebook
could not be graded.
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from dtcourse.grading import RECEIPTS, audit, exercises, uses
from dtcourse.grading.report import Check, Report

DEFAULT_CELL_TIMEOUT = 300.0  # seconds; each check bounds itself far below this
# A kernel that dies before its first cell begins is started again, up to this many starts in all. Kernels started at
# once (a class graded in parallel) can race for a port: jupyter_client picks free ports and the kernel binds them
# later, so another may take one in between ("Address already in use"; seen with 14 graders on 16 cores).
KERNEL_STARTS = 3


def grade_notebook(path: str | os.PathLike, source: str | os.PathLike | None = None,
                   cell_timeout: float = DEFAULT_CELL_TIMEOUT, check_timeout: float | None = None,
                   kernel_name: str = "python3", self_check: bool = False) -> Report:
    """Restore the tests into the notebook at ``path``, run it, and score every test cell.

    ``self_check``: restore them from the released notebook (``exercises/``, visible checks only)
    rather than the instructor's source, and report the hidden cells as HIDDEN.
    """
    path = Path(path)
    folder = "exercises" if self_check else "solutions"
    source = Path(source) if source else exercises.ROOT / folder / path.name
    report = Report(path, source)
    try:
        report.saved = path.stat().st_mtime     # before reading: a save in between shows as the older time
        nb = nbformat.read(path, as_version=4)
    except Exception as err:  # a missing file, broken JSON, not a notebook
        report.error = f"cannot read {path}: {err}"
        return report
    if not source.exists():
        report.error = (f"no source notebook {source}. " + (
            "Pass --source with the released notebook (exercises/<name>.ipynb)." if self_check else
            "Grading needs the instructor's source notebook, which holds the hidden tests (pass --source "
            f"solutions/<name>.ipynb). To check your own work against the visible checks, run: "
            f"dtcourse check {path.stem.split('_')[0]}"))
        return report
    try:
        text = source.read_text(encoding="utf-8")
        stored = (exercises.loads(text) if self_check else
                  exercises.generate(exercises.loads(text), source.stem, keep_hidden_tests=True, where=str(source)))
    except exercises.MarkupError as err:
        report.error = str(err)
        return report
    report.notes += _restore(nb, nbformat.from_dict(stored))
    report.flagged = [str(f) for f in audit.audit_notebook(nb)]
    report.flagged += [str(f) for f in uses.answer_uses(nb, source.stem.split("_")[0])]

    executed: set[int] = set()
    started: set[int] = set()          # cells the kernel began; none: it died while starting (KERNEL_STARTS)
    with tempfile.TemporaryDirectory(prefix="dtcourse-receipts-") as folder:      # gone on every return
        receipts = Path(folder, "receipts")
        receipts.touch()
        begun: dict[int, int] = {}         # cell -> the receipts file's size when it started
        left: dict[int, list[str]] = {}    # cell -> the checks that passed while it ran

        def on_cell_start(cell_index: int, **_) -> None:
            started.add(cell_index)
            begun[cell_index] = receipts.stat().st_size

        def on_cell_executed(cell: nbformat.NotebookNode, cell_index: int, execute_reply: dict, **_) -> None:
            # As nbgrader's Execute: an error only the reply knows of (a timeout) becomes an output.
            executed.add(cell_index)
            with open(receipts, encoding="utf-8") as f:
                f.seek(begun.get(cell_index, 0))
                left[cell_index] = f.read().split()
            reply = (execute_reply or {}).get("content", {})
            if reply.get("status") == "error" and not any(
                    o.output_type == "error" and o.ename == reply.get("ename") for o in cell.outputs):
                cell.outputs.insert(0, nbformat.v4.new_output("error", ename=reply.get("ename", "Error"),
                                                              evalue=reply.get("evalue", ""), traceback=[]))

        env = dict(os.environ, **{RECEIPTS: str(receipts)})
        if check_timeout:
            env["DTCOURSE_CHECK_TIMEOUT"] = str(check_timeout)
        stopped = ""
        for start in range(1, KERNEL_STARTS + 1):
            client = NotebookClient(
                nb, timeout=max(1, round(cell_timeout)), kernel_name=kernel_name, allow_errors=True,
                interrupt_on_timeout=True, resources={"metadata": {"path": str(path.parent.resolve())}},
                error_on_timeout={"ename": "CellTimeoutError", "traceback": [],
                                  "evalue": f"the cell ran longer than {cell_timeout:g} s and was interrupted"},
                on_cell_executed=on_cell_executed, on_cell_start=on_cell_start,
                # The kernel's own warnings (ipykernel's "running over TCP without encryption" on every
                # start) would be the first line a student reads; errors still show.
                extra_arguments=["--IPKernelApp.log_level=ERROR"])
            try:
                client.execute(env=env)
            except Exception as err:  # the kernel died, or never started
                stopped = f"{type(err).__name__}: {_first_line(str(err))}"
                if not started and start < KERNEL_STARTS:
                    continue            # died before its first cell: started again (see KERNEL_STARTS)
                if not executed:
                    tries = f" after {start} starts" if start > 1 else ""
                    report.error = f"the kernel {kernel_name!r} did not run the notebook{tries} ({stopped})"
                    return report
            break
        _score(nb, executed, stopped, report, self_check, left)
    return report


def _restore(nb: nbformat.NotebookNode, stored: nbformat.NotebookNode) -> list[str]:
    """Put the gradebook's locked cells and metadata back into the student's notebook."""
    notes, kept = [], {}
    wanted = {c.metadata.nbgrader["grade_id"]: c for c in stored.cells if "nbgrader" in c.metadata
              and "grade_id" in c.metadata.nbgrader}
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id is None:
            continue
        if grade_id in kept or grade_id not in wanted:
            if grade_id in kept:
                notes.append(f"cell {index} repeats {grade_id!r}; only the first copy is graded")
            del cell.metadata["nbgrader"]  # run it, but do not grade it
            continue
        original = wanted[grade_id]
        if exercises.is_locked(original):
            nb.cells[index] = copy.deepcopy(original)
        else:
            cell.metadata["nbgrader"] = copy.deepcopy(original.metadata.nbgrader)
        kept[grade_id] = nb.cells[index]
    after = None  # put back deleted grade and locked cells, after the cell before them in the source
    for cell in stored.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id is None:
            continue
        if grade_id not in kept:
            notes.append(f"cell {grade_id!r} was missing; graded with the original")
            position = next((i + 1 for i, c in enumerate(nb.cells) if c is after), len(nb.cells))
            nb.cells.insert(position, copy.deepcopy(cell))
            kept[grade_id] = nb.cells[position]
        after = kept[grade_id]
    return notes


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    return lines[0] + (f" ... {lines[-1]}" if lines[0].endswith(":") and len(lines) > 1 else "")


def _is_placeholder(code: str) -> bool:
    """A released notebook's hidden-test cell: comments only, its checks cut out for the instructor."""
    try:
        return not ast.parse(code).body
    except SyntaxError:
        return False


def _checks_called(code: str) -> set[str]:
    """The course's checks a cell's code calls by name."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    called = {ast.unparse(node.func).rpartition(".")[2] for node in ast.walk(tree) if isinstance(node, ast.Call)}
    return called & audit.check_names()


def _score(nb: nbformat.NotebookNode, executed: set[int], stopped: str, report: Report, self_check: bool,
           left: dict[int, list[str]]) -> None:
    """Score every graded cell; ``left``: the receipts each cell's checks left while it ran."""
    failed_before = False
    for index, cell in enumerate(nb.cells):
        meta = cell.metadata.get("nbgrader", {})
        errors = [o for o in cell.get("outputs", []) if o.output_type == "error"]
        if not meta.get("grade", False):
            if errors:
                failed_before = True
                report.notes.append(f"cell {index} ({meta.get('grade_id', 'no grade_id')}) raised "
                                    f"{errors[0].ename}: {_first_line(errors[0].evalue)}")
            continue
        check = Check(meta["grade_id"], None, float(meta["points"]))
        report.checks.append(check)
        if meta.get("solution", False) or cell.cell_type != "code":
            check.message = "needs manual grading"
        elif self_check and _is_placeholder(cell.source):
            check.hidden, check.message = True, "hidden checks: your instructor's grading runs them"
        elif index not in executed:
            check.points, check.message = 0.0, f"not run: {stopped or 'execution stopped before it'}"
        else:
            check.points, check.message = _determine_grade(cell, check.max_points)
            if check.points < check.max_points and failed_before and "NameError" in check.message:
                check.message += "\n(probably because a cell above failed: see Notes)"
            missing = sorted(_checks_called(cell.source) - set(left.get(index, ())))
            if check.points and missing:
                check.points = 0.0
                check.message = (f"{', '.join(missing)} left no receipt: the cell finished, but the check did not run "
                                 "as written (something in the notebook changed or skipped it)")
                report.flagged.append(f"cell {index}{audit.begins(audit.first_line(cell.source))}: "
                                      f"{', '.join(missing)} did not run, though the cell finished")


def _determine_grade(cell: nbformat.NotebookNode, max_points: float) -> tuple[float, str]:
    """nbgrader's rule for a test cell: the first error or stderr output scores 0."""
    for output in cell.outputs:
        if output.output_type == "error":
            return 0.0, f"{output.ename}: {output.evalue}".strip()
        if output.output_type == "stream" and output.name == "stderr":
            return 0.0, ("the cell wrote to stderr, which nbgrader scores as a failure:\n"
                         + "\n".join(output.text.strip().splitlines()[:5]))
        if output.output_type == "execute_result":
            try:  # a cell that evaluates to a number earns that many points
                points = min(max_points, max(0.0, float(output.data.get("text/plain", ""))))
                return points, "" if points == max_points else "partial credit"
            except ValueError:
                return max_points, ""
    return max_points, ""


def find_notebook(name: str | os.PathLike) -> Path:
    """The notebook ``name`` means: a path that exists, else an exercise of the course by name or number.

    ``dtcourse grade 01`` and ``dtcourse grade 01_collectives_ring`` both mean
    ``<course>/exercises/01_collectives_ring.ipynb``, so the command works from any folder
    (JupyterLab's terminal starts in the course root, a notebook's ``!`` in ``lessons/``).
    """
    path = Path(name).expanduser()
    if path.exists():
        return path
    folder = exercises.ROOT / "exercises"
    stem = path.name.removesuffix(".ipynb")
    if (folder / f"{stem}.ipynb").exists() and not path.parent.parts:
        return folder / f"{stem}.ipynb"
    found = sorted(folder.glob(f"{stem}_*.ipynb")) if stem and not path.parent.parts else []
    if len(found) == 1:
        return found[0]
    available = ", ".join(p.stem for p in sorted(folder.glob("*.ipynb"))) or "none"
    why = f"{len(found)} exercises start with {stem!r}" if found else f"no file {path}"
    raise FileNotFoundError(f"{why}. Give a notebook's path, or an exercise's name or number "
                            f"(the course's exercises: {available}).")


def main(argv: list[str] | None = None, self_check: bool = False) -> int:
    prog = "dtcourse check" if self_check else "dtcourse grade"
    what = ("Check an exercise notebook against its visible checks (needs no solutions/)" if self_check else
            "Grade an exercise notebook with every check, hidden ones included (needs the instructor's source)")
    parser = argparse.ArgumentParser(prog=prog, description=what)
    parser.add_argument("notebook", help="the student's notebook: a path, or an exercise's name or "
                                         "number (`01` means exercises/01_collectives_ring.ipynb)")
    parser.add_argument("--source", type=Path, help="the source notebook (default: "
                        + ("exercises/" if self_check else "solutions/") + "<same name>)")
    parser.add_argument("--cell-timeout", type=float, default=DEFAULT_CELL_TIMEOUT,
                        help="seconds a cell may run before it is interrupted (default %(default)g)")
    parser.add_argument("--check-timeout", type=float,
                        help="seconds each check waits for its ranks before calling it a deadlock (default 20)")
    parser.add_argument("--kernel", default="python3", help="Jupyter kernel name (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        notebook = find_notebook(args.notebook)
    except FileNotFoundError as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    report = grade_notebook(notebook, args.source, args.cell_timeout, args.check_timeout, args.kernel, self_check)
    print(report)
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
