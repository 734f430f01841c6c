"""Exercises and their grading: ``exercises.py`` generates the student notebooks from
``solutions/`` (nbgrader markup, no nbgrader needed), ``grade.py`` runs a student's notebook and
scores it with the hidden checks. The checks themselves are in ``dtcourse.checks``.

Commands: ``dtcourse exercises [--check]`` (or ``python -m dtcourse.exercises``) and
``dtcourse grade NOTEBOOK`` (or ``python -m dtcourse.grade NOTEBOOK``).
"""
