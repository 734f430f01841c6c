"""The course's reference implementations switch themselves off while an exercise's checks run.

An exercise asks a student to write, say, a ring all-reduce; ``dtcourse.collectives`` has one.
So that importing it cannot pass the exercise, every reference the exercise asks for is marked
with a topic::

    @reference("collectives", "01")
    def ring_all_reduce(tensor, ...): ...

and while a check runs the student's code inside ``refusing({"collectives": "01"})``, a call that
comes from the student's code (any frame on the stack outside ``dtcourse`` and the installed
libraries) raises ``ReferenceRefused``. The check's own calls to the same function, made to
compute the expected answer, have no student frame on their stack and run as usual. Classes
refuse in ``__init__``, so a subclass of the reference refuses too.

Which topics are refused is one process-wide slot, pushed and popped by ``refusing`` (a thread
the student's code starts is refused too); a check never has to clean it up.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
from contextlib import contextmanager
from types import FrameType, MappingProxyType
from typing import Callable, Iterator, Mapping, TypeVar

__all__ = ["ReferenceRefused", "reference", "refusing", "refuse_if_student", "student_on_stack", "is_library_file",
           "is_student_class"]

T = TypeVar("T")

# (topic -> exercise, the frame of the check that entered refusing()). One slot for the whole
# process, not a ContextVar: a thread the student's code starts must be refused too, and a new
# thread would not inherit a ContextVar. Checks run in forked ranks, one check per process.
_REFUSED: list[tuple[Mapping[str, str], FrameType | None]] = [(MappingProxyType({}), None)]
_DTCOURSE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARIES = tuple(sorted({os.path.abspath(p) + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib")
                           if (p := sysconfig.get_paths().get(key))} | {_DTCOURSE}))


class ReferenceRefused(AssertionError):
    """The student's code called a course reference that an exercise's check has switched off."""


def is_library_file(filename: str) -> bool:
    """Is ``filename`` part of dtcourse, the standard library or an installed package (not a student's cell)?"""
    return filename.startswith("<frozen") or os.path.abspath(filename).startswith(_LIBRARIES)


def student_on_stack(boundary: FrameType | None = None) -> bool:
    """Is any frame between here and ``boundary`` (exclusive; the bottom if None) a student's?"""
    frame = sys._getframe(1)
    while frame is not None and frame is not boundary:
        if not is_library_file(frame.f_code.co_filename):
            return True
        frame = frame.f_back
    return False


def is_student_class(klass: type) -> bool:
    """Was ``klass`` written outside dtcourse and the libraries (a notebook's ``__main__`` has no file)?"""
    if klass.__module__ == "builtins":
        return False
    return not is_library_file(getattr(sys.modules.get(klass.__module__), "__file__", None) or "<notebook>")


def refuse_if_student(topic: str, what: str, why: str = "", instance: object = None) -> None:
    """Raise ``ReferenceRefused`` if ``topic`` is refused and student code, run by a check, is calling.

    ``instance``: a reference class's new object; a student's subclass of it is refused even when the
    check itself makes the object (the subclass is the student's code).
    """
    topics, boundary = _REFUSED[-1]
    exercise = topics.get(topic)
    if exercise is None:
        return
    subclass = instance is not None and any(is_student_class(k) for k in type(instance).__mro__)
    if subclass or student_on_stack(boundary):
        raise ReferenceRefused(why or
            f"{what} is the course's own answer to exercise {exercise}, and it refuses to run while that "
            "exercise's checks run" + (" (your class is a subclass of it)" if subclass else "")
            + ": the exercise asks you to do this part yourself.")


def reference(topic: str, exercise: str) -> Callable[[T], T]:
    """Mark a function or class as the course's answer to ``exercise`` (refused under ``refusing``)."""
    def mark(obj: T) -> T:
        what = f"{obj.__module__}.{obj.__qualname__}"
        if isinstance(obj, type):
            init = obj.__init__

            @functools.wraps(init)
            def __init__(self, *args, **kwargs):
                refuse_if_student(topic, what, instance=self)
                init(self, *args, **kwargs)

            obj.__init__ = __init__
            obj.__dtcourse_reference__ = (topic, exercise)
            return obj

        @functools.wraps(obj)
        def call(*args, **kwargs):
            refuse_if_student(topic, what)
            return obj(*args, **kwargs)

        call.__dtcourse_reference__ = (topic, exercise)
        return call
    return mark


@contextmanager
def refusing(topics: Mapping[str, str], boundary: FrameType | None = None) -> Iterator[None]:
    """Inside, references of each topic (topic -> exercise) refuse calls from student code run in the block.

    Only frames below the one that entered the block count: a check's ranks are forked from a
    notebook, so the cell that called the check is further up every rank's stack.
    """
    old, _ = _REFUSED[-1]
    _REFUSED.append((MappingProxyType({**old, **topics}), boundary or sys._getframe(2)))
    try:
        yield
    finally:
        _REFUSED.pop()
