"""While an exercise's checks run, the course's answers to it refuse calls from the student's code.

An exercise asks a student to write, say, a ring all-reduce; ``dtcourse.collectives`` has one. So
that importing it cannot pass the exercise, each check module lists the answers its checks switch
off (``ANSWERS`` in ``dtcourse/checks/<stem>.py``), and ``dtcourse.checks.guard.watching`` switches
them off with this module while a check runs the student's code, and on again when it ends:

* a function (a method too) is given, for the duration, a trampoline as its ``__code__``: every
  call, through whatever name was bound to it before the check (``from dtcourse.collectives import
  ring_all_reduce``), goes to a helper that raises ``ReferenceRefused`` if a student's frame is on
  the stack and otherwise calls a copy of the original;
* a class is given an ``__init__`` that does the same, and that refuses a student's subclass even
  when the check itself builds the object;
* an attribute that PyTorch's own answer looks up at every call (``switched_off``) is replaced by
  a function that does the same.

A student's frame is one outside ``dtcourse`` and the installed libraries, below the frame that
entered the check (the boundary: a check's ranks are forked from a notebook, whose cells are
further up every rank's stack). The check's own calls, made to compute the expected answer, have
none and run as usual; so does a thread the check starts, while one the student's code starts is
refused. The modules that hold the answers carry no trace of any of this.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
import sysconfig
from contextlib import ExitStack, contextmanager
from types import CodeType, FrameType, FunctionType
from typing import Callable, Iterable, Iterator

__all__ = ["ReferenceRefused", "refusing", "switched_off", "refuse_if_student", "student_on_stack",
           "is_library_file", "is_student_class", "original_code"]


_DTCOURSE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARIES = tuple(sorted({os.path.abspath(p) + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib")
                           if (p := sysconfig.get_paths().get(key))} | {_DTCOURSE}))
_SERIAL = itertools.count()         # names the helper each trampoline calls, unique in the process
_ORIGINALS: dict[int, CodeType] = {}  # id(function) -> its code, while a trampoline stands in for it


class ReferenceRefused(AssertionError):
    """The student's code called a course reference that an exercise's check has switched off."""


def is_library_file(filename: str) -> bool:
    """Is ``filename`` part of dtcourse, the standard library or an installed package (not a student's cell)?"""
    return filename.startswith("<frozen") or os.path.abspath(filename).startswith(_LIBRARIES)


def student_on_stack(boundary: FrameType | None = None, frame: FrameType | None = None) -> bool:
    """Is any frame from ``frame`` (the caller's if None) to ``boundary`` (exclusive; None: the bottom) a student's?"""
    frame = frame or sys._getframe(1)
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


def refuse_if_student(why: str, boundary: FrameType | None) -> None:
    """Raise ``ReferenceRefused(why)`` if a student's frame lies between the caller and ``boundary``."""
    if student_on_stack(boundary, sys._getframe(1)):
        raise ReferenceRefused(why)


def _own_answer(what: str, exercise: str, subclass: bool = False) -> str:
    return (f"{what} is the course's own answer to exercise {exercise}, and it refuses to run while that "
            "exercise's checks run" + (" (your class is a subclass of it)" if subclass else "")
            + ": the exercise asks you to do this part yourself.")


def _trampoline(f: FunctionType, helper: str) -> CodeType:
    """Code that only calls ``helper(args, kwargs)``, on one line: ``f``'s name, file, line and free variables.

    A function's ``__code__`` takes only code with as many free variables as its closure has cells,
    so the trampoline names the same ones (never reads them), inside a function that provides them.
    """
    code, free = f.__code__, f.__code__.co_freevars
    assert not {"args", "kwargs"} & set(free), f"{f.__qualname__}: a free variable named args or kwargs"
    source = f"def _(*args, **kwargs): return {helper}(args, kwargs)" + (f" if True else ({', '.join(free)},)"
                                                                        if free else "") + "\n"
    if free:
        source = f"def _outer():\n    {' = '.join(free)} = None\n    {source}    return _\n"
    namespace: dict = {}
    exec(compile(source, code.co_filename, "exec", dont_inherit=True), namespace)   # noqa: S102 - our own source
    made = namespace["_outer"]() if free else namespace["_"]
    return made.__code__.replace(co_name=code.co_name, co_qualname=code.co_qualname,
                                 co_firstlineno=code.co_firstlineno)


@contextmanager
def _function_off(f: FunctionType, exercise: str, boundary: FrameType | None) -> Iterator[None]:
    """Every call of ``f`` (by any name) refuses a student caller; the check's own calls run the original."""
    original = f.__code__
    copy = FunctionType(original, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = f.__kwdefaults__, f.__qualname__
    what = f"{f.__module__}.{f.__qualname__}"

    def refuse_then_call(args: tuple, kwargs: dict):
        if student_on_stack(boundary, sys._getframe(2)):         # from the trampoline's caller on
            raise ReferenceRefused(_own_answer(what, exercise))
        return copy(*args, **kwargs)

    helper = f"__dtcourse_refuse_then_call_{next(_SERIAL)}__"
    f.__globals__[helper] = refuse_then_call
    _ORIGINALS[id(f)] = original
    try:
        f.__code__ = _trampoline(f, helper)
        yield
    finally:
        f.__code__ = original
        f.__globals__.pop(helper, None)
        _ORIGINALS.pop(id(f), None)


def original_code(f: FunctionType) -> CodeType:
    """``f``'s own code, also while a check has swapped in its trampoline."""
    return _ORIGINALS.get(id(f), f.__code__)


@contextmanager
def _class_off(cls: type, exercise: str, boundary: FrameType | None) -> Iterator[None]:
    """``cls(...)`` and its subclasses refuse a student caller, and a student's subclass whoever builds it."""
    missing = object()
    raw = vars(cls).get("__init__", missing)      # what to put back; missing if the class inherits it
    init = cls.__init__
    what = f"{cls.__module__}.{cls.__qualname__}"

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        subclass = any(is_student_class(k) for k in type(self).__mro__)
        if subclass or student_on_stack(boundary):
            raise ReferenceRefused(_own_answer(what, exercise, subclass))
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    try:
        yield
    finally:
        if raw is missing:
            del cls.__init__
        else:
            cls.__init__ = raw


@contextmanager
def refusing(answers: Iterable[Callable], exercise: str, boundary: FrameType | None = None) -> Iterator[None]:
    """Inside, each of ``answers`` (functions, methods, classes) refuses calls from student code run in the block.

    Only frames below ``boundary`` count (by default the frame that entered the block).
    """
    boundary = boundary or sys._getframe(2)
    with ExitStack() as stack:
        for answer in answers:
            answer = getattr(answer, "__func__", answer)          # a classmethod or a bound method
            if isinstance(answer, type):
                stack.enter_context(_class_off(answer, exercise, boundary))
            elif isinstance(answer, FunctionType):
                stack.enter_context(_function_off(answer, exercise, boundary))
            else:
                raise TypeError(f"{answer!r}: only a function, a method or a class can be switched off")
        yield


@contextmanager
def switched_off(owner: object, name: str, why: str, boundary: FrameType | None = None) -> Iterator[None]:
    """``owner.name`` refuses calls from the student's code with ``why`` (the check's own calls run as usual).

    For an attribute that a library's answer looks up at every call (so a name the student bound before
    the check is caught too); by default only frames below the one that entered the block count.
    """
    boundary = boundary or sys._getframe(2)
    missing = object()
    raw = vars(owner).get(name, missing)      # what to put back; missing if a class inherits it
    target = getattr(owner, name)

    def call(*args, **kwargs):
        refuse_if_student(why, boundary)
        return target(*args, **kwargs)

    # a method defined on the class stays a method; a static, class or inherited one is already bound
    plain = not isinstance(owner, type) or isinstance(raw, FunctionType)
    setattr(owner, name, call if plain else staticmethod(call))
    try:
        yield
    finally:
        if raw is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, raw)
