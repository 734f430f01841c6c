"""What a check watches and forbids while a student's code runs in a rank.

``watching`` wraps the student's call::

    with watching(ANSWERS, p2p_only=True) as watch:
        student_fn(tensor)
    watch.sent        # [(peer, nbytes), ...]: every message this rank sent, in order

Inside the block:

* the answers that the check module lists in ``ANSWERS`` (an ``Answers``) refuse calls from the
  student's code (``dtcourse.runtime.refuse``): the course's own, found by dotted name, and
  PyTorch's where it has one (``torch.utils.checkpoint`` in both forms, ``DistributedDataParallel``,
  ``torch.amp.GradScaler``), each switched off where it is looked up at every call;
* with ``p2p_only``, every collective of the process group raises when the student's code calls
  it. The guard listens to the course's one observer of communication
  (``dtcourse.runtime.observe.listening``), which sits on the ``ProcessGroup`` methods that
  ``torch.distributed``'s functions call, so a reference to ``dist.all_reduce`` saved before the
  check, or one taken through ``torch.distributed.distributed_c10d``, is caught as well;
* every point-to-point message (``send``/``recv`` on the process group, which ``isend``,
  ``irecv``, ``send``, ``recv`` and ``batch_isend_irecv`` all reach) and every collective is
  recorded, with its peer or name and its bytes, so a check can test who talks to whom and how
  much, not only the final numbers.

Everything is put back when the block ends, whatever happens in it.
"""

from __future__ import annotations

import functools
import inspect
import importlib
import os
import pkgutil
import sys
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from types import CodeType, FrameType, FunctionType
from typing import Callable, Iterator, Mapping

import torch
from torch._C._distributed_c10d import ProcessGroup

from dtcourse.runtime.observe import COLLECTIVE_METHODS, listening
from dtcourse.runtime.refuse import (ReferenceRefused, is_library_file, is_student_class, original_code,
                                     refuse_if_student, refusing, switched_off)

__all__ = ["copied_answer", "reached_functions", "code_objects", "Answers", "Watch", "watching", "course_answer", "COLLECTIVE_METHODS"]


@dataclass(frozen=True)
class Answers:
    """What one exercise's checks switch off while the student's code runs: its answers, ours and PyTorch's.

    ``course``: the course's own answers, by dotted name (or the objects): functions, methods and
    classes (a class refuses in ``__init__``, so a student's subclass refuses too); each refuses with
    "<name> is the course's own answer to exercise <exercise>". A function is refused by whatever
    name the student reaches it by, re-exports and names bound before the check included.
    ``library``: why -> the dotted names of attributes that another answer (PyTorch's, mostly) looks
    up at every call; each refuses with ``why``. A name ending in ``?`` may be missing (another torch).
    """

    exercise: str
    course: tuple[str | Callable, ...] = ()
    library: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def course_objects(self) -> list[Callable]:
        return [pkgutil.resolve_name(name) if isinstance(name, str) else name for name in self.course]

    def library_attributes(self) -> list[tuple[object, str, str]]:
        """``(owner, attribute, why)`` for each of ``library`` there is."""
        found = []
        for why, names in self.library.items():
            for name in names:
                owner, _, attribute = name.rstrip("?").rpartition(".")
                owner = pkgutil.resolve_name(owner)
                if hasattr(owner, attribute) or not name.endswith("?"):
                    found.append((owner, attribute, why))
        return found

    @contextmanager
    def switched_off(self, boundary: FrameType) -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(refusing(self.course_objects(), self.exercise, boundary))
            for owner, attribute, why in self.library_attributes():
                stack.enter_context(switched_off(owner, attribute, why, boundary))
            yield


def declared() -> dict[str, Answers]:
    """Every exercise's ``ANSWERS``, by the stem of its check module."""
    package = __name__.rpartition(".")[0]
    modules = (importlib.import_module(f"{package}.{found.name}")
               for found in pkgutil.iter_modules([os.path.dirname(__file__)]))
    return {module.__name__.rpartition(".")[2]: module.ANSWERS for module in modules if hasattr(module, "ANSWERS")}


def course_answer(obj: object) -> tuple[str, str] | None:
    """``(stem, exercise)`` of the check module that lists ``obj`` among the course's answers; None if none does."""
    obj = getattr(obj, "__func__", obj)
    found = _course_answers().get(id(obj))
    return found[1:] if found and found[0] is obj else None


@functools.lru_cache(maxsize=1)
def _course_answers() -> dict[int, tuple[object, str, str]]:
    return {id(obj): (obj, stem, answers.exercise)
            for stem, answers in declared().items() for obj in answers.course_objects()}


def _fingerprint(code: CodeType) -> tuple:
    """What a function's code does, whatever file or line it was compiled from: bytecode, names and constants
    (nested functions by their own fingerprints)."""
    consts = tuple(_fingerprint(c) if isinstance(c, CodeType) else (type(c).__name__, repr(c)) for c in code.co_consts)
    return code.co_code, code.co_names, code.co_varnames, code.co_freevars, consts


def _answer_fingerprints() -> dict[tuple, str]:
    """Every course answer's code (functions, and the methods of answer classes) -> its dotted name. Not cached:
    while a check runs, the answers' code is swapped (``original_code`` sees through it)."""
    found = {}
    for obj, _, _ in _course_answers().values():
        if isinstance(obj, type):
            members = [inspect.unwrap(_method(m)) for m in vars(obj).values() if callable(_method(m))]
        else:
            members = [obj]
        for member in members:
            if isinstance(member, FunctionType):
                found.setdefault(_fingerprint(original_code(member)), f"{member.__module__}.{member.__qualname__}")
    return found


def copied_answer(code: CodeType) -> str | None:
    """The dotted name of the course answer whose code ``code`` repeats (its source copied, or executed), or None."""
    return _answer_fingerprints().get(_fingerprint(code))


def _filled(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:              # a variable not yet assigned
        return False


def _method(member: object) -> object:
    """The function behind a class attribute: a method, a static or class method, or a property's getter."""
    return getattr(member, "__func__", getattr(member, "fget", member))


def code_objects(code: CodeType) -> list[CodeType]:
    """``code`` and the code of every function defined inside it."""
    found, todo = [], [code]
    while todo:
        found.append(todo.pop())
        todo += [c for c in found[-1].co_consts if isinstance(c, CodeType)]
    return found


def reached_functions(obj: object) -> list[FunctionType]:
    """``obj`` and every function it reaches: for a class, what the student's classes in its MRO define; for a
    function, the functions and classes its code (nested functions included) names as globals or holds in its
    closure, followed through the student's code only (a library function is listed, not entered)."""
    found: list[FunctionType] = []
    seen, todo = set(), [obj]
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, type):
            todo += [_method(m) for k in item.__mro__ if is_student_class(k) for m in vars(k).values()]
        elif isinstance(item, functools.partial) or inspect.ismethod(item):
            todo.append(item.func if isinstance(item, functools.partial) else item.__func__)
        elif isinstance(item, FunctionType):
            found.append(item)
            if not is_library_file(item.__code__.co_filename):
                todo += [item.__globals__.get(name) for code in code_objects(item.__code__) for name in code.co_names]
                todo += [cell.cell_contents for cell in item.__closure__ or () if _filled(cell)]
    return found


def _refuse_copies(check: str, obj: Callable, exercise: str, advice: str) -> None:
    """A course answer's code in a function that is not the answer: executed from a string (``exec`` of its
    source), or a copy of the function object made from its ``__code__``, handed to the check or reached from
    the student's code. Code typed in a cell is not compared: a short right answer may coincide with the
    course's, and a copy typed into a cell is the instructor's to judge."""
    for member in reached_functions(obj):
        filename = member.__code__.co_filename
        if course_answer(member) or not (filename.startswith("<") or is_library_file(filename)):
            continue
        source = copied_answer(member.__code__)
        if source:
            how = ("was executed from a string holding" if filename.startswith("<") else "is a copy, made from its "
                   "__code__, of")
            raise ReferenceRefused(f"{check} was given {getattr(obj, '__qualname__', obj)}, which reaches "
                                   f"{member.__name__}: it {how} the code of {source}, the course's own answer to "
                                   f"exercise {exercise}; the exercise asks you to write it yourself. {advice}")


@dataclass
class Watch:
    """What the student's code did on this rank's process group inside ``watching``."""

    sent: list[tuple[int, int]] = field(default_factory=list)       # (group rank of the peer, bytes)
    received: list[tuple[int, int]] = field(default_factory=list)
    collectives: list[tuple[str, int]] = field(default_factory=list)  # (ProcessGroup method, bytes)

    @property
    def bytes_sent(self) -> int:
        return sum(nbytes for _, nbytes in self.sent)


def _nbytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.nbytes
    if isinstance(tensors, (list, tuple)):
        return sum(_nbytes(t) for t in tensors)
    return 0


def _noter(watch: Watch, p2p_only: bool, boundary: FrameType) -> Callable[[str, ProcessGroup, tuple], None]:
    """What ``watching`` notes of each process-group call (through ``dtcourse.runtime.observe.listening``)."""
    def note(name: str, group: ProcessGroup, args: tuple) -> None:
        if name in ("send", "recv"):                       # (tensors, peer, ...)
            (watch.sent if name == "send" else watch.received).append((int(args[1]), _nbytes(args[0])))
            return
        if p2p_only:
            refuse_if_student(
                f"your code called a collective ({name} on the process group, which torch.distributed's "
                "collectives call); build it from point-to-point messages only (isend/irecv, send/recv or "
                "batch_isend_irecv)", boundary)
        watch.collectives.append((name, _nbytes(args[:2])))
    return note


@contextmanager
def watching(answers: Answers | None = None, p2p_only: bool = False) -> Iterator[Watch]:
    """Switch off ``answers`` (an exercise's ``ANSWERS``) for the student's code; record the process group's traffic."""
    watch = Watch()
    boundary = sys._getframe(2)    # the frame that entered `with watching(...)`: where the check's own frames end
    with ExitStack() as stack:
        if answers is not None:
            stack.enter_context(answers.switched_off(boundary))
        stack.enter_context(listening(_noter(watch, p2p_only, boundary)))
        yield watch
