"""nbgrader's ClearSolutions, with each exercise's own stub: one ``nbgrader_config.py`` for them all.

Every dtcourse stub names its exercise (``raise NotImplementedError("Exercise 01: collectives
ring")``, from ``dtcourse.grading.exercises.code_stub``), but nbgrader 0.9.6 holds a single
``ClearSolutions.code_stub`` per run. ``ExerciseStubs`` takes ClearSolutions' place in
``nbgrader generate_assignment`` and sets the stub from the assignment being generated. The
course directory that ``dtcourse course DIR`` writes registers it in its ``nbgrader_config.py``::

    from dtcourse.grading.nbgrader_stubs import with_exercise_stubs
    c.GenerateAssignment.preprocessors = with_exercise_stubs()

Then ``nbgrader generate_assignment 01_collectives_ring`` writes exactly
``exercises/01_collectives_ring.ipynb``, with no stub on the command line
(``tests/test_nbgrader_course.py`` checks every exercise). This module imports nbgrader; the
rest of ``dtcourse.grading`` does not.
"""

from __future__ import annotations

from typing import Any

from nbgrader.converters import GenerateAssignment
from nbgrader.preprocessors import ClearSolutions

from dtcourse.grading.exercises import code_stub

__all__ = ["ExerciseStubs", "with_exercise_stubs"]


class ExerciseStubs(ClearSolutions):
    """ClearSolutions whose Python stub is ``code_stub(assignment)`` for the assignment being generated.

    Every other setting (``ClearSolutions.text_stub``, the delimiters, ``enforce_metadata``) is
    read from the ``ClearSolutions`` section of the config, as for nbgrader's own class. An
    exercise is one assignment holding one notebook of the same name; a second notebook in the
    same assignment gets that assignment's stub, as ``dtcourse exercises`` gives it.
    """

    def preprocess(self, nb: Any, resources: dict) -> tuple[Any, dict]:
        # nbgrader's converter fills resources["nbgrader"] with the ids it parsed from the path
        # source/<assignment>/<notebook>.ipynb (BaseConverter.init_single_notebook_resources).
        assignment = resources["nbgrader"]["assignment"]
        self.code_stub = {**self.code_stub, "python": code_stub(assignment)}
        return super().preprocess(nb, resources)


def with_exercise_stubs() -> list[type]:
    """nbgrader's ``GenerateAssignment.preprocessors``, in its order, with ExerciseStubs for ClearSolutions."""
    default = GenerateAssignment.class_traits()["preprocessors"].default()
    if ClearSolutions not in default:  # a later nbgrader that renamed or split the step
        raise RuntimeError("nbgrader's GenerateAssignment no longer runs ClearSolutions; "
                           "dtcourse.grading.nbgrader_stubs needs updating")
    return [ExerciseStubs if step is ClearSolutions else step for step in default]
