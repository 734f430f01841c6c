"""Where a submission names one of its exercise's answers: listed for the instructor, not refused.

The checks switch the exercise's answers off while they run (``dtcourse.checks.guard.watching``), so an answer
called from inside a check fails it. An answer run before the checks start is not switched off: a table of
1F1B orders built by the course's ``one_f_one_b`` over every (p, m) the hidden checks could draw would answer
them all. Telling that from a student who reads the course's version after finishing needs a person, so the
grader lists each place (``answer_uses``) under "Flagged", with its cell, and leaves the points as they are::

    answer_uses(notebook, "08")   # [Finding(cell=6, line=2, what="uses dtcourse.pipeline.schedules.build, ...")]
"""

from __future__ import annotations

import ast
import inspect
import pkgutil
import sys

from dtcourse.grading.audit import Finding, _Visitor, audit_notebook

__all__ = ["answer_uses"]


def answer_uses(notebook, exercise: str) -> list[Finding]:
    """Where a submission (a path, or a notebook already read) names one of exercise ``exercise``'s answers
    (``ANSWERS`` of its check module).

    Not a fault by itself, and not refused: a student may look at the course's version once the exercise is done.
    But an answer run *before* a check starts is not switched off (``guard.watching`` works only while a check
    runs), so an order, a table or a result computed by it could stand in for the student's own. Each place is
    listed for the instructor, with its cell: the course's answer, PyTorch's, or a function of the answer's
    module that reaches it (``dtcourse.pipeline.schedules.build`` dispatching to ``one_f_one_b``).
    """
    suspects = _answers_of(exercise)
    found = []
    for named in audit_notebook(notebook, _Named):      # the audit's walk, imports spelled out across cells
        what = _resolve(named.what, suspects)
        if what:
            found.append(Finding(named.cell, named.line, f"uses {named.what}, {what}; an answer run outside the "
                                 "checks is not switched off, so its result may stand in for the student's",
                                 named.begins))
    return list(dict.fromkeys(found))


class _Named(_Visitor):
    """The audit's walk of a cell, keeping every module member the cell names (``_path`` spells out its imports)
    instead of the audit's findings."""

    def _flag(self, node: ast.AST, what: str) -> None:
        pass

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        super().visit_ImportFrom(node)
        self.found += [(node.lineno, self.modules[alias.asname or alias.name]) for alias in node.names]

    def visit_Attribute(self, node: ast.Attribute) -> None:
        path = self._path(node)
        if path:
            self.found.append((node.lineno, path))
        super().visit_Attribute(node)


def _answers_of(exercise: str) -> dict[int, str]:
    """id(object) -> why it is listed: the exercise's answers, the classes that hold them, PyTorch's attributes'
    owners, and the functions of an answer's module that call it."""
    from dtcourse.checks.guard import code_objects, declared

    suspects: dict[int, str] = {}
    for answers in declared().values():
        if answers.exercise != exercise:
            continue
        for name, obj in zip(answers.course, answers.course_objects()):
            name = name if isinstance(name, str) else f"{obj.__module__}.{obj.__qualname__}"
            own = f"the course's own answer to exercise {exercise}"
            suspects[id(obj)] = own
            module = sys.modules.get(getattr(obj, "__module__", ""))
            owner = getattr(obj, "__qualname__", "").split(".")[0]
            if module is not None and owner in vars(module):
                suspects.setdefault(id(vars(module)[owner]), f"which holds {name}, {own}")
            reaching, grown = {obj.__name__}, module is not None
            while grown:          # the module's functions that name it, the tables that hold it, and so on
                grown = False
                for key, value in vars(module).items():
                    if key in reaching:
                        continue
                    values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) \
                        else ()
                    names = {n for c in code_objects(value.__code__) for n in c.co_names} \
                        if inspect.isfunction(value) and value.__module__ == module.__name__ else set()
                    if names & reaching or any(v is obj for v in values):
                        reaching.add(key)
                        suspects.setdefault(id(value), f"which reaches {name}, {own}")
                        grown = True
        for names in answers.library.values():
            for name in names:
                owner = name.rstrip("?").rpartition(".")[0]
                try:
                    suspects.setdefault(id(pkgutil.resolve_name(owner)), f"PyTorch's answer to exercise {exercise}")
                except (ImportError, AttributeError, ValueError):
                    pass
    return suspects


def _resolve(path: str, suspects: dict[int, str]) -> str | None:
    if not path.startswith(("dtcourse", "torch")):
        return None
    try:
        return suspects.get(id(pkgutil.resolve_name(path)))
    except Exception:          # not an importable path (a local attribute, a method of an instance)
        return None
