"""Exercises and their grading.

* ``exercises.py`` generates the student notebooks from ``solutions/`` (nbgrader markup, no
  nbgrader needed);
* ``grade.py`` runs a student's notebook and scores it: ``dtcourse check`` with the visible
  checks only (a student's self-check, no ``solutions/`` needed), ``dtcourse grade`` with the
  hidden ones too (the instructor's); ``report.py`` is what they print (when the notebook was
  last saved, each failure once);
* ``audit.py`` finds code in a submission that reaches into the grading (``dtcourse audit``);
* ``course.py`` writes a ready nbgrader course (``dtcourse course DIR``), and
  ``nbgrader_stubs.py`` gives each exercise its own stub there.

The checks themselves are in ``dtcourse.checks``.
"""

# The file each check that passed writes its name to, named by the grader in the kernel's environment
# (dtcourse.checks leaves the receipts, grade.py reads them): a graded cell whose checks left none earns nothing.
RECEIPTS = "DTCOURSE_RECEIPTS"
