"""Generate the student notebooks in ``exercises/`` from the sources in ``solutions/``.

A source notebook carries nbgrader markup: cell metadata ``nbgrader`` (``grade``,
``solution``, ``locked``, ``grade_id``, ``points``, ``schema_version: 3``) and
markers inside cells. This module does what ``nbgrader generate_assignment``
(nbgrader 0.9.6) does to such a notebook, step for step, with the standard library
only, so ``make exercises`` needs neither nbgrader nor torch:

1. lock cells: solution cells become undeletable, grade and read-only cells also
   uneditable (``LockCells``);
2. replace each ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` region with the
   stub, indented like the marker; a solution cell without markers is replaced
   whole; markdown cells get ``YOUR ANSWER HERE`` (``ClearSolutions``);
3. clear outputs and execution counts (``ClearOutput``);
4. checksum the grade, solution and locked cells (``ComputeChecksums``): this is
   the version nbgrader stores in its gradebook, and the one
   ``python -m dtcourse.grade`` restores test cells from;
5. remove ``### BEGIN HIDDEN TESTS`` ... ``### END HIDDEN TESTS`` and
   ``### BEGIN MARK SCHEME`` ... ``### END MARK SCHEME`` regions, then checksum
   again (``ClearHiddenTests``, ``ClearMarkScheme``, ``ComputeChecksums``);
6. write JSON as nbformat does (one-space indent, sorted keys, lines split).

The stub names the exercise, as every dtcourse stub does. For
``solutions/01_collectives_ring.ipynb`` it is::

    # YOUR CODE HERE
    raise NotImplementedError("Exercise 01: ring collectives")

Real nbgrader writes the same files (``tests/test_grading_exercises.py`` checks it) when each
exercise is its own assignment (``source/01_collectives_ring/01_collectives_ring.ipynb``)
and the stub is given on the command line::

    nbgrader generate_assignment 01_collectives_ring \\
        --ClearSolutions.code_stub="$(python -m dtcourse.exercises --stub 01_collectives_ring)"

nbgrader 0.9.6 turns that string into ``{"python": ...}`` with a warning. The
warning-free form is a line in that run's ``nbgrader_config.py``::

    c.ClearSolutions.code_stub = {"python": '# YOUR CODE HERE\\nraise NotImplementedError("Exercise 01: ring collectives")'}

Usage::

    python -m dtcourse.exercises            # rewrite exercises/*.ipynb (make exercises)
    python -m dtcourse.exercises --check    # exit 1 if exercises/ is stale (make test)

Two deliberate differences: an ``END`` marker with no ``BEGIN`` before it is an
error here (nbgrader drops the line silently), and ``AUTOTEST`` cells, which
nbgrader expands by running a kernel, are refused.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]   # the course checkout: solutions/ and exercises/
TEXT_STUB = "YOUR ANSWER HERE"  # nbgrader's default ClearSolutions.text_stub
_NBGRADER_KEYS = {"schema_version", "grade", "locked", "solution", "task", "grade_id",
                  "points", "checksum", "cell_type"}


class MarkupError(ValueError):
    """A source notebook's nbgrader markup is malformed; the message says where."""


def code_stub(name: str) -> str:
    """The stub that replaces solution code in notebook ``name`` (e.g. ``01_collectives_ring``)."""
    match = re.fullmatch(r"(\d+)_(.+)", name)
    title = f"Exercise {match[1]}: {match[2].replace('_', ' ')}" if match else f"Exercise {name}"
    return f"# YOUR CODE HERE\nraise NotImplementedError({json.dumps(title, ensure_ascii=False)})"


# --------------------------------------------------------------------------- #
# Reading and writing, as nbformat does
# --------------------------------------------------------------------------- #
def _split_mimebundle(data: dict) -> None:
    for key, value in data.items():
        if isinstance(value, str) and (key.startswith("text/") or key in ("application/javascript",
                                                                          "image/svg+xml")):
            data[key] = value.splitlines(True)


def _join_mimebundle(data: dict) -> None:
    for key, value in data.items():
        is_json = key == "application/json" or (key.startswith("application/") and key.endswith("+json"))
        if not is_json and isinstance(value, list) and all(isinstance(v, str) for v in value):
            data[key] = "".join(value)


def loads(text: str) -> dict:
    """Parse a notebook, joining multi-line strings and dropping transient keys."""
    nb = json.loads(text)
    if nb.get("nbformat") != 4:
        raise MarkupError(f"nbformat {nb.get('nbformat')} notebook: save it with a current Jupyter (nbformat 4)")
    for key in ("orig_nbformat", "orig_nbformat_minor", "signature"):
        nb["metadata"].pop(key, None)
    for cell in nb["cells"]:
        cell["metadata"].pop("trusted", None)
        if isinstance(cell.get("source"), list):
            cell["source"] = "".join(cell["source"])
        for attachment in cell.get("attachments", {}).values():
            _join_mimebundle(attachment)
        for output in cell.get("outputs", []):
            if output.get("output_type") in ("execute_result", "display_data"):
                _join_mimebundle(output.get("data", {}))
            elif isinstance(output.get("text"), list):
                output["text"] = "".join(output["text"])
    return nb


def dumps(nb: dict) -> str:
    """Serialise a notebook byte for byte as ``nbformat.writes`` (and so nbgrader) does."""
    nb = copy.deepcopy(nb)
    for cell in nb["cells"]:
        if isinstance(cell.get("source"), str):
            cell["source"] = cell["source"].splitlines(True)
        for attachment in cell.get("attachments", {}).values():
            _split_mimebundle(attachment)
        for output in cell.get("outputs", []):
            if output.get("output_type") in ("execute_result", "display_data"):
                _split_mimebundle(output.get("data", {}))
            elif output.get("output_type") == "stream" and isinstance(output.get("text"), str):
                output["text"] = output["text"].splitlines(True)
    return json.dumps(nb, indent=1, sort_keys=True, separators=(",", ": "), ensure_ascii=False) + "\n"


# --------------------------------------------------------------------------- #
# The nbgrader steps
# --------------------------------------------------------------------------- #
def _meta(cell: dict) -> dict:
    return cell["metadata"].get("nbgrader", {})


def _here(where: str, index: int, cell: dict) -> str:
    return f"{where}, cell {index} ({_meta(cell).get('grade_id', 'no grade_id')})"


def is_locked(cell: dict) -> bool:
    """nbgrader's rule: grade cells and read-only cells are locked, solution cells never."""
    meta = _meta(cell)
    if not meta or meta.get("solution", False):
        return False
    return True if meta.get("grade", False) else meta.get("locked", False)


def checksum(cell: dict) -> str:
    """nbgrader's checksum of a cell: md5 of its source, type, flags, id and points."""
    meta = _meta(cell)
    parts = [cell["source"], cell["cell_type"], str(meta.get("grade", False)),
             str(meta.get("solution", False)), str(is_locked(cell)), meta["grade_id"]]
    if meta.get("grade", False):
        parts.append(str(float(meta["points"])))
    return hashlib.md5("".join(parts).encode("utf-8"), usedforsecurity=False).hexdigest()


def _check_metadata(nb: dict, where: str) -> None:
    """The checks of nbgrader's CheckCellMetadata, with messages that say which cell."""
    seen: set[str] = set()
    for index, cell in enumerate(nb["cells"]):
        meta = _meta(cell)
        if not meta:
            continue
        here = _here(where, index, cell)
        if meta.get("schema_version") != 3:
            raise MarkupError(f"{here}: nbgrader schema_version {meta.get('schema_version')}, expected 3")
        missing = {"grade", "locked", "solution"} - meta.keys()
        if missing or meta.keys() - _NBGRADER_KEYS:
            raise MarkupError(f"{here}: nbgrader metadata lacks {sorted(missing)} "
                              f"or has unknown keys {sorted(meta.keys() - _NBGRADER_KEYS)}")
        grade, solution, task = meta["grade"], meta["solution"], meta.get("task", False)
        if grade or solution or meta["locked"]:
            if not re.fullmatch(r"[a-zA-Z0-9_\-]+", meta.get("grade_id", "")):
                raise MarkupError(f"{here}: needs a grade_id of letters, digits, '_' or '-'")
            if meta["grade_id"] in seen:
                raise MarkupError(f"{here}: grade_id {meta['grade_id']!r} is used twice")
            seen.add(meta["grade_id"])
        if grade and not isinstance(meta.get("points"), (int, float)):
            raise MarkupError(f"{here}: a grade cell needs numeric points")
        if task and cell["cell_type"] != "markdown":
            raise MarkupError(f"{here}: task cells must be markdown")
        if not task and cell["cell_type"] == "markdown" and grade != solution:
            raise MarkupError(f"{here}: a markdown cell must be both grade and solution, or neither")


def _cut(source: str, begin: str, end: str, here: str, stub: str | None = None,
         forbid: str | None = None) -> tuple[str, bool]:
    """Remove the ``begin`` ... ``end`` regions of a cell (marker lines included).

    Each region becomes ``stub``, indented like its ``begin`` line, if one is given.
    A line inside a region that matches the regular expression ``forbid`` is an
    error. Returns the new source and whether a region was found.
    """
    lines, inside, found = [], False, False
    for number, line in enumerate(source.split("\n"), start=1):
        if begin in line:
            if inside:
                raise MarkupError(f"{here}: line {number} opens a second {begin!r} before {end!r}")
            inside = found = True
            if stub is not None:
                indent = re.match(r"\s*", line).group(0)
                lines.extend(indent + stub_line for stub_line in stub.split("\n"))
        elif end in line:
            if not inside:
                raise MarkupError(f"{here}: line {number} has {end!r} with no {begin!r} before it")
            inside = False
        elif not inside:
            lines.append(line)
        elif forbid and re.search(forbid, line):
            raise MarkupError(f"{here}: line {number} would leak into the student version")
    if inside:
        raise MarkupError(f"{here}: {begin!r} has no matching {end!r}")
    return "\n".join(lines), found


def _lock(cell: dict) -> None:  # nbgrader's LockCells with its defaults
    meta = _meta(cell)
    if meta.get("solution", False):
        cell["metadata"]["deletable"] = False
    elif meta.get("grade", False) or is_locked(cell):
        cell["metadata"]["deletable"] = False
        cell["metadata"]["editable"] = False


def _add_checksums(nb: dict) -> None:
    for cell in nb["cells"]:
        meta = _meta(cell)
        if meta.get("grade", False) or meta.get("solution", False) or is_locked(cell):
            meta["checksum"] = checksum(cell)
            meta["cell_type"] = cell["cell_type"]


def generate(nb: dict, name: str, keep_hidden_tests: bool = False, where: str = "") -> dict:
    """The student version of source notebook ``nb`` (parsed by ``loads``), named ``name``.

    ``keep_hidden_tests=True`` stops before the hidden tests are removed: that is
    the version nbgrader stores in its gradebook and restores test cells from.
    ``where`` names the source in error messages.
    """
    nb, where = copy.deepcopy(nb), where or f"{name}.ipynb"
    language = nb["metadata"].get("kernelspec", {}).get("language", "python")
    if language != "python":
        raise MarkupError(f"{where}: kernel language {language!r}; the stub is Python")
    _check_metadata(nb, where)
    stub = code_stub(name)
    for index, cell in enumerate(nb["cells"]):
        meta, here = _meta(cell), _here(where, index, cell)
        if cell["cell_type"] == "code" and "AUTOTEST" in cell["source"]:
            raise MarkupError(f"{here}: AUTOTEST cells need nbgrader's kernel; write the test out")
        _lock(cell)
        cell_stub = stub if cell["cell_type"] == "code" else TEXT_STUB
        cell["source"], found = _cut(cell["source"], "BEGIN SOLUTION", "END SOLUTION", here, cell_stub)
        if found and not meta.get("solution", False):
            raise MarkupError(f"{here}: a solution region in a cell not marked as a solution cell")
        if meta.get("solution", False) and not found:
            cell["source"] = cell_stub
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
            cell["metadata"].pop("collapsed", None)
            cell["metadata"].pop("scrolled", None)
    nb["metadata"].pop("celltoolbar", None)
    _add_checksums(nb)
    if keep_hidden_tests:
        return nb
    for index, cell in enumerate(nb["cells"]):
        meta, here = _meta(cell), _here(where, index, cell)
        cell["source"], found = _cut(cell["source"], "BEGIN HIDDEN TESTS", "END HIDDEN TESTS", here)
        if found and not meta.get("grade", False):
            raise MarkupError(f"{here}: hidden tests in a cell not marked as a grade cell")
        cell["source"], found = _cut(cell["source"], "BEGIN MARK SCHEME", "END MARK SCHEME", here,
                                     forbid=r"!\[.*\]\(attachment:.+?\)")  # as nbgrader checks
        if found and not meta.get("task", False):
            raise MarkupError(f"{here}: a mark scheme in a cell not marked as a task cell")
    _add_checksums(nb)
    return nb


# --------------------------------------------------------------------------- #
# The command line
# --------------------------------------------------------------------------- #
def build(solutions: Path, exercises: Path) -> dict[Path, str]:
    """The text of every exercise notebook, keyed by the path it belongs at."""
    texts = {}
    for src in sorted(solutions.glob("*.ipynb")):
        source = loads(src.read_text(encoding="utf-8"))
        texts[exercises / src.name] = dumps(generate(source, src.stem, where=str(src)))
    return texts


def stale(solutions: Path, exercises: Path) -> list[str]:
    """Problems that ``make exercises`` would fix (or that need a person): empty if up to date."""
    wanted = build(solutions, exercises)
    problems = [f"{path} is missing" if not path.exists() else f"{path} is out of date"
                for path, text in wanted.items()
                if not path.exists() or path.read_text(encoding="utf-8") != text]
    problems += [f"{path} has no source {solutions / path.name}"
                 for path in sorted(exercises.glob("*.ipynb")) if path not in wanted]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtcourse.exercises", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if exercises/ is stale")
    parser.add_argument("--stub", metavar="NAME", help="print the code stub of notebook NAME and exit")
    parser.add_argument("--solutions", type=Path, default=ROOT / "solutions")
    parser.add_argument("--exercises", type=Path, default=ROOT / "exercises")
    args = parser.parse_args(argv)
    if args.stub:
        print(code_stub(Path(args.stub).stem))
        return 0
    try:
        if args.check:
            problems = stale(args.solutions, args.exercises)
            for problem in problems:
                print(problem, file=sys.stderr)
            if problems:
                print("Run `make exercises` (python -m dtcourse.exercises) and commit the result.",
                      file=sys.stderr)
            return 1 if problems else 0
        args.exercises.mkdir(parents=True, exist_ok=True)
        wanted = build(args.solutions, args.exercises)
        for path, text in wanted.items():
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                path.write_text(text, encoding="utf-8", newline="\n")
                print(f"wrote {path}")
        for path in sorted(set(args.exercises.glob("*.ipynb")) - set(wanted)):
            print(f"warning: {path} has no source in {args.solutions}; delete it if it is obsolete",
                  file=sys.stderr)
    except MarkupError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
