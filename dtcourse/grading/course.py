"""Write a ready nbgrader course directory for the dtcourse exercises: ``dtcourse course DIR``.

Usage::

    dtcourse course ~/grading                      # every exercise in solutions/
    dtcourse course ~/grading --exercises 00 04    # some of them, by number or by name
    cd ~/grading && nbgrader generate_assignment 01_collectives_ring

``DIR`` gets ``source/<name>/<name>.ipynb`` (a byte-for-byte copy of ``solutions/<name>.ipynb``:
each exercise is one nbgrader assignment), ``nbgrader_config.py`` and ``README.md``, the
instructor's steps from generating the student version to exporting the grades.

nbgrader 0.9.6 takes one code stub per run, and every dtcourse exercise has its own, which names
it. The config written here replaces nbgrader's ClearSolutions with
``dtcourse.grading.nbgrader_stubs.ExerciseStubs``, which picks the stub from the assignment being
generated, so ``nbgrader generate_assignment NAME`` needs no stub on the command line and writes
exactly ``exercises/NAME.ipynb``. This module itself needs neither nbgrader nor torch.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from dtcourse.grading.exercises import ROOT

__all__ = ["write_course", "exercise_names", "main"]

SOLUTIONS = ROOT / "solutions"

# Every line of the config is explained where it stands: instructors read and edit this file.
CONFIG = '''\
"""nbgrader configuration for the dtcourse exercises, written by `dtcourse course`.

Run nbgrader from this folder, in the Python environment where dtcourse is installed:
the lines below import it. README.md, beside this file, gives the steps.
"""

from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor
from nbgrader.preprocessors import ClearHiddenTests, GetGrades

from dtcourse.grading.nbgrader_stubs import with_exercise_stubs

c = get_config()  # noqa: F821 (nbgrader defines get_config when it reads this file)

# 1. The stub. Each exercise's stub names it: raise NotImplementedError("Exercise 01:
#    collectives ring"). nbgrader holds one ClearSolutions.code_stub for a whole run, so this
#    puts dtcourse's ExerciseStubs in ClearSolutions' place among nbgrader's own steps; it takes
#    the stub from the assignment's name. `nbgrader generate_assignment NAME` then writes exactly
#    the dtcourse checkout's exercises/NAME.ipynb, with no stub on the command line.
c.GenerateAssignment.preprocessors = with_exercise_stubs()

# 2. Time a cell may run in `nbgrader autograde` before it is interrupted and scores 0, in
#    seconds. nbgrader's default, 30, is too short for a check that starts several groups of
#    ranks on a busy machine. 300 is what `dtcourse grade` allows; each check also stops itself
#    after $DTCOURSE_CHECK_TIMEOUT seconds (20 by default) if the student's ranks deadlock.
c.Execute.timeout = 300

# 3. Hidden tests in feedback. `nbgrader generate_feedback` renders the autograded notebook, in
#    which the hidden tests are back, so by default the feedback shows their source. Remove the
#    "# " below to strip the BEGIN/END HIDDEN TESTS regions from the feedback HTML. A hidden test
#    that fails still quotes its failing line in the traceback (README.md says more).
#    nbgrader then logs a harmless warning: "Config option `display_data_priority` not
#    recognized by `ClearHiddenTests`".
# c.GenerateFeedback.preprocessors = [GetGrades, ClearHiddenTests, CSSHTMLHeaderPreprocessor]
'''

README = '''\
# Grading the dtcourse exercises with nbgrader

`dtcourse course` wrote this folder from the checkout at `{root}`. Each exercise is one nbgrader
assignment holding one notebook of the same name:

{listing}

Run every command below from this folder, in the Python environment where dtcourse is installed
(the checkout's `.venv` after `make setup`): `nbgrader_config.py` imports `dtcourse`, and so do
the notebooks while they are graded.

## Files students must not get

- `solutions/` in the checkout and `source/` here: the answers and the hidden tests.
- `gradebook.db` (nbgrader keeps each test cell there, hidden tests included, to restore it
  when grading) and `autograded/` (the graded notebooks, with the hidden tests back in).

Students get the released notebook and, once graded, their feedback HTML.

## The steps, for one exercise

1. Generate the student version:

       nbgrader generate_assignment 01_collectives_ring

   This writes `release/01_collectives_ring/01_collectives_ring.ipynb`, the same bytes as
   `exercises/01_collectives_ring.ipynb` in the checkout, and records the exercise and its test
   cells in `gradebook.db`. No stub goes on the command line (see "How the stubs are set").
   `nbgrader generate_assignment '*'` does every exercise in one run.
2. Hand it out and collect it, in one of two ways.
   - With nbgrader's exchange (JupyterHub): add `c.CourseDirectory.course_id = "..."` to
     `nbgrader_config.py`, run `nbgrader release_assignment NAME`, let students fetch and
     submit, then run `nbgrader collect NAME`.
   - By hand: give students `release/NAME/NAME.ipynb`, and put each returned notebook at
     `submitted/<student id>/NAME/NAME.ipynb`.
3. Grade: `nbgrader autograde NAME`. Each submission runs in a fresh kernel, with the test
   cells and hidden tests put back from `gradebook.db`; the scores go into `gradebook.db` and
   the executed notebooks into `autograded/`. A warning that the checksum of a cell named
   `..._hidden` has changed is expected: the student's copy was checksummed without its hidden
   tests. (`dtcourse grade NOTEBOOK` scores the same way without a gradebook, for one notebook.)
4. Feedback: `nbgrader generate_feedback NAME` writes `feedback/<student id>/NAME/NAME.html`:
   the executed notebook with each test cell's score. Read "Hidden tests in feedback" before
   you return it (by hand, or with `nbgrader release_feedback NAME` on the exchange).
5. Export: `nbgrader export` writes `grades.csv`, one row per student and assignment, with
   `raw_score`, `score` and `max_score`.

## Hidden tests in feedback

By default the feedback HTML shows the hidden tests' source: nbgrader renders the autograded
notebook, in which they were put back to be run. To leave them out, remove the `# ` in front of
the `c.GenerateFeedback.preprocessors` line at the end of `nbgrader_config.py` (it adds
nbgrader's own ClearHiddenTests step to `generate_feedback`), then run
`nbgrader generate_feedback NAME --force` again. That removes the
`### BEGIN HIDDEN TESTS` ... `### END HIDDEN TESTS` regions from the cells, but not from the
outputs: when a hidden test fails, its traceback still quotes the failing line and the lines
around it. Only a passing hidden test stays out of sight completely.

In this course a hidden test calls a check from `dtcourse.checks` on more cases (other world
sizes, dtypes or models), such as
`check_model_states(..., cases=("more_optimizers", "fp16"))`. The cases themselves are defined
in `dtcourse/checks/`, which students have, since the lessons and `dtcourse grade` need the
package. What hiding keeps back is which cases count for the grade, not how they are checked.

## How the stubs are set

Each dtcourse exercise has its own stub, `raise NotImplementedError("Exercise 01: collectives
ring")`, so an error names the exercise. nbgrader 0.9.6 takes one `ClearSolutions.code_stub` per
run, which would mean passing the stub on the command line for each exercise. Instead,
`nbgrader_config.py` puts `dtcourse.grading.nbgrader_stubs.ExerciseStubs` in ClearSolutions'
place among `generate_assignment`'s steps. It is nbgrader's ClearSolutions with one change: it
reads the assignment's name from the information nbgrader passes to each step, and sets that
exercise's stub. The other steps, their order and ClearSolutions' other settings stay nbgrader's.

The notebooks in `source/` are copies. After a change to `solutions/`, `dtcourse course . --force`
(from this folder) copies them again and rewrites this file and `nbgrader_config.py` (redo any
edit you made to it); the gradebook and the submissions stay.
'''


def exercise_names(solutions: Path = SOLUTIONS) -> list[str]:
    """The exercises there are: the notebooks in ``solutions/``, by name, in order."""
    return sorted(path.stem for path in solutions.glob("*.ipynb"))


def _select(wanted: list[str] | None, available: list[str]) -> list[str]:
    """The exercises ``wanted`` names (``01`` or ``01_collectives_ring``), in order, each once."""
    if not available:
        raise ValueError(f"no source notebooks in {SOLUTIONS}: run dtcourse course from a course checkout")
    if not wanted:
        return available
    chosen = []
    for name in wanted:
        stem = name.removesuffix(".ipynb")
        found = [stem] if stem in available else [a for a in available if a.startswith(f"{stem}_")]
        if len(found) != 1:
            why = f"{len(found)} exercises start with {name!r}" if found else f"no exercise {name!r}"
            raise ValueError(f"{why}; give a number or a name of one of: {', '.join(available)}")
        if found[0] not in chosen:
            chosen.append(found[0])
    return sorted(chosen)


def write_course(directory: str | Path, names: list[str] | None = None, force: bool = False) -> Path:
    """Write the nbgrader course for exercises ``names`` (all if None) into ``directory``; return its path.

    A ``directory`` that exists and holds anything is refused (FileExistsError) unless ``force``:
    then the source notebooks, ``nbgrader_config.py`` and ``README.md`` are rewritten and
    everything else there (the gradebook, submissions, other assignments) is left alone. An
    unknown or ambiguous exercise name raises ValueError, before anything is written.
    """
    course = Path(directory).expanduser().resolve()
    chosen = _select(names, exercise_names())
    if course.exists() and not course.is_dir():
        raise FileExistsError(f"{course} is a file, not a folder")
    if course.is_dir() and any(course.iterdir()) and not force:
        raise FileExistsError(f"{course} is not empty; choose a new folder, or pass --force to rewrite "
                              "its source notebooks, nbgrader_config.py and README.md")
    for name in chosen:
        assignment = course / "source" / name
        assignment.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SOLUTIONS / f"{name}.ipynb", assignment / f"{name}.ipynb")
    (course / "nbgrader_config.py").write_text(CONFIG, encoding="utf-8", newline="\n")
    listing = "\n".join(f"- `{name}`: `source/{name}/{name}.ipynb`" for name in chosen)
    (course / "README.md").write_text(README.format(root=ROOT, listing=listing), encoding="utf-8", newline="\n")
    return course


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dtcourse course", description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path, metavar="DIR", help="the folder to write (new, or empty)")
    parser.add_argument("--exercises", nargs="+", metavar="NAME",
                        help="exercises by number or name, such as 00 01_collectives_ring (default: all)")
    parser.add_argument("--force", action="store_true",
                        help="write into a folder that is not empty: rewrites the source notebooks, "
                             "nbgrader_config.py and README.md, and leaves the rest")
    args = parser.parse_args(argv)
    try:
        course = write_course(args.directory, args.exercises, force=args.force)
    except (FileExistsError, ValueError) as error:
        print(f"dtcourse course: {error}", file=sys.stderr)
        return 2
    count = len(list((course / "source").glob("*/*.ipynb")))
    print(f"wrote {course}: {count} exercise(s) in source/, nbgrader_config.py, README.md. Next:\n"
          f"  cd {course} && nbgrader generate_assignment NAME    (README.md has every step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
