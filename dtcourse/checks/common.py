"""What every exercise check shares: running a check on ranks, and reporting what went wrong.

A check runs the student's code with ``dtcourse.launch`` and turns a hang, an
exception or a wrong answer into one ``AssertionError`` whose message the
autograder prints: which rank, which case, what was expected and what came back.
``_launch_check`` does that in the notebook's process; inside the ranks,
``_stop_at_first_failure`` runs the cases one by one and stops every rank at the
first case any rank got wrong, and ``_as_student`` keeps the student's error.
The checks of a parallel layer (tensor and expert parallelism) run groups side by
side: ``_SideBySide`` is such a case, and ``_GroupPlace`` one rank in it, with its
group and a log of the collectives the student's code starts.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import tempfile
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FunctionType
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

from dtcourse.checks.guard import _refuse_copies, course_answer
from dtcourse.checks.messages import Hint, hints_once
from dtcourse.runtime.refuse import ReferenceRefused, is_library_file
from dtcourse.runtime.launch import LaunchError, LaunchTimeout, RankError, launch
from dtcourse.runtime.observe import listening
from dtcourse.runtime.processes import frames


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _notes(progress: str, world_size: int) -> dict[int, str]:
    """The case each rank last started ('finished' when done), from its progress file."""
    return {rank: _read(Path(progress, str(rank))) for rank in range(world_size)}


def _tail(remote_traceback: str, lines: int = 3) -> str:
    return "\n".join(remote_traceback.strip().splitlines()[-lines:])


def _student_error(exc: BaseException) -> str:
    """'ValueError: msg' plus the innermost frames of the student's code."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)[1:] if not is_library_file(f.filename)]
    where = "".join(f"\n    in {f.name}, line {f.lineno}: {(f.line or '').strip()}" for f in frames[-3:])
    stub = ("\n(the exercise stub is still there: replace the `raise NotImplementedError` line "
            "with your code)") if isinstance(exc, NotImplementedError) else ""
    return f"{type(exc).__name__}: {exc}{where}{stub}"


def _refuse_library_code(check: str, obj: Callable, exercise: str, advice: str,
                         also: tuple[type, ...] = ()) -> None:
    """The course's answer (or a library's) handed to a check is not the student's: refuse it before it runs.

    The course's answers refuse calls that come from a student's frame; one handed to the check itself
    would be called from the check's own frames, so it is caught here: a function that a check module
    lists among the course's answers (``ANSWERS``; seen through partials, bound methods and
    ``functools.wraps``), library code, a class built on one of the course's answers, or one built on
    any class in ``also`` (PyTorch's DDP, say). ``advice`` says what to pass instead.
    """
    if isinstance(obj, type):
        theirs = [k for k in obj.__mro__ if course_answer(k) or (also and issubclass(k, also))]
        if theirs:
            which = "is" if theirs[0] is obj else f"is built on {theirs[0].__module__}.{theirs[0].__qualname__},"
            whose = "the course's own answer" if course_answer(theirs[0]) else "PyTorch's answer"
            raise ReferenceRefused(f"{check} was given {obj.__qualname__}, which {which} {whose} to exercise "
                                   f"{exercise}; it refuses to run while that exercise's checks run. {advice}")
        _refuse_copies(check, obj, exercise, advice)
        return
    inner = obj
    while isinstance(inner, functools.partial) or inspect.ismethod(inner):
        inner = inner.func if isinstance(inner, functools.partial) else inner.__func__
    inner = inspect.unwrap(inner, stop=lambda f: course_answer(f) is not None)
    if not isinstance(inner, FunctionType) and callable(inner) and not inspect.isbuiltin(inner):
        inner = getattr(type(inner), "__call__", inner)       # an object called like a function
    what = f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', repr(inner))}"
    if course_answer(inner):
        raise ReferenceRefused(f"{check} was given {what}, the course's own answer to exercise {exercise}; it "
                               f"refuses to run while that exercise's checks run. {advice}")
    if inspect.isbuiltin(inner) or (isinstance(inner, FunctionType) and is_library_file(inner.__code__.co_filename)):
        raise AssertionError(f"{check} was given {what}, which is library code, not yours. {advice}")
    _refuse_copies(check, obj, exercise, advice)


def _check_names(check: str, fn: Callable, names: Sequence[str], known: dict) -> None:
    if not callable(fn):
        raise TypeError(f"{check}: pass your function or class itself, not {type(fn).__name__}")
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"{check}: cases must be among {sorted(known)}, got {list(names)}")


def _where_stuck(err: LaunchTimeout, name: Callable[[int], str] = lambda rank: f"rank {rank}", ranks: int = 2,
                 depth: int = 3) -> str:
    """Where the first ``ranks`` stuck ranks were, ``depth`` calls each, innermost first ('' if unknown)."""
    lines = [f"  {name(rank)} was at " + "\n      called from ".join(frames(err.stacks.get(rank, ""))[:depth])
             for rank in err.stuck if frames(err.stacks.get(rank, ""))][:ranks]
    return "\nWhere the stuck ranks were (innermost call first):\n" + "\n".join(lines) if lines else ""


def _stderr_to_stdout(rank_fn: Callable, *args) -> object:
    """Inside a rank: run ``rank_fn`` with warnings and all stderr output sent to stdout, labelled.

    nbgrader scores a test cell that wrote anything to stderr as 0, so one harmless torch
    ``UserWarning`` in a rank would cost a correct answer its points. The rank's errors still
    reach the check, which reports them.
    """
    os.dup2(1, 2)                       # C++ output (gloo, c10d) too
    sys.stderr = sys.stdout

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"[rank {dist.get_rank()}] a warning (printed on stdout, so it costs no points): "
              f"{warnings.formatwarning(message, category, filename, lineno, line).strip()}", flush=True)

    warnings.showwarning = show
    return rank_fn(*args)


def _deadlock(message: str) -> AssertionError:
    error = AssertionError(message)
    error.deadlock = True               # dtcourse.checks fails the later checks of the same code at once
    return error


def _launch_check(label: str, world_size: int, rank_fn: Callable, args: tuple, timeout: float | None,
                  where: str, hint: str, inline: Sequence[Hint] = (), pointers: Sequence[str] = ()) -> None:
    """Run ``rank_fn(*args, progress)`` on every rank; turn whatever went wrong into an AssertionError.

    ``rank_fn`` returns ``[]``, or ``[case, message]`` for a wrong answer, and notes the case it is in
    in the file ``progress/<rank>`` (``"finished"`` at the end), so a hang names the case. The ranks
    print warnings and stderr on stdout (``_stderr_to_stdout``). A hint that several ranks' messages repeat
    is printed once (``messages.hints_once``; ``inline`` and ``pointers`` as there).
    """
    if timeout is None:
        timeout = float(os.environ.get("DTCOURSE_CHECK_TIMEOUT", "20"))
    with tempfile.TemporaryDirectory(prefix="dtcourse-check-") as progress:
        try:
            results = launch(_stderr_to_stdout, world_size, rank_fn, *args, progress, timeout=timeout,
                             backend="gloo")      # the checks build CPU tensors, GPUs or not
        except LaunchTimeout as err:
            notes = _notes(progress, world_size)
            busy: dict[str, list[int]] = {}
            for rank in err.stuck:
                busy.setdefault(notes.get(rank) or "before the first case", []).append(rank)
            stuck = "; ".join(f"rank(s) {ranks} in {note}" for note, ranks in busy.items())
            raise _deadlock(f"{label} did not finish{where} within {timeout:g} s: {stuck} were "
                            f"still running. {hint}{_where_stuck(err)}") from None
        except RankError as err:
            note = _notes(progress, world_size).get(err.rank, "")
            text = _read(Path(progress, f"{err.rank}.error")) or _tail(err.remote_traceback)
            if world_size > 1 and ("timed out" in text.lower() or "timeout" in text.lower()):
                # The student's own wait(timeout=...) gave up: a deadlock seen from inside the rank.
                raise _deadlock(f"{label} did not finish{where}: rank {err.rank} gave up waiting in "
                                f"{note}. {hint}\n{text}") from None
            who = f"rank {err.rank} raised" if world_size > 1 else "it raised"
            raise AssertionError(f"{label} failed{where} in {note}: {who} {text}") from None
        except LaunchError as err:
            raise AssertionError(f"{label} crashed a rank{where}: {err}") from None
    failures = [(rank, result) for rank, result in enumerate(results) if result]
    if failures:
        same: dict[str, list[int]] = {}       # ranks that found exactly the same: one line for them
        for rank, (_, message) in failures:
            same.setdefault(message, []).append(rank)
        rows = [(ranks, message) for message, ranks in same.items() if len(ranks) >= 2]
        rows += [([rank], message) for rank, (_, message) in failures if len(same[message]) < 2]
        rows.sort(key=lambda row: row[0][0])
        lines = [f"{_ranks(ranks)}: {message}" for ranks, message in rows[:4]]
        if world_size == 1:
            lines = [message for _, (_, message) in failures]
        shown = sum(len(ranks) for ranks, _ in rows[:4])
        more = f"\n  ... and {len(failures) - shown} more ranks" if len(failures) > shown else ""
        raise AssertionError(hints_once(f"{label} is wrong{where} in {failures[0][1][0]}:\n  "
                                        + "\n  ".join(lines) + more, inline, pointers))   # a repeated hint: once


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0, 1 and 2``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def _stop_at_first_failure(cases: Iterable[tuple[str, Callable[[], str | None]]], progress: str) -> list:
    """Inside every rank: run ``(case, run)`` pairs in order, noting each case in ``progress``.

    ``run()`` returns None or what this rank found wrong. After each case the ranks agree (an
    all-reduce MAX of a flag) whether any rank found something, and if so all stop there, so
    none waits alone in the next case. Returns ``[]`` or ``[case, message]``, as
    ``_launch_check`` expects.
    """
    rank, problem = dist.get_rank(), None
    for case, run in cases:
        Path(progress, str(rank)).write_text(case)
        problem = run()
        flag = torch.tensor([problem is not None], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)                 # sends 4 bytes per rank
        if flag.item():
            break
    Path(progress, str(rank)).write_text("finished")
    return [case, problem] if problem else []


def _as_student(progress: str, call: Callable) -> object:
    """Run the student's code; if it raises, leave its error where the parent will find it."""
    try:
        return call()
    except Exception as exc:
        Path(progress, f"{dist.get_rank()}.error").write_text(_student_error(exc))
        raise


# --------------------------------------------------------------------------- #
# Groups side by side: a case, and this rank in it with every collective its code starts
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class _SideBySide:
    """``world`` ranks launched, in groups of ``size`` side by side; a subclass names the size (``symbol``)."""

    world: int        # ranks launched
    size: int         # one group's ranks: world // size groups side by side
    symbol = "size"   # what the exercise calls the size ("t", "ep"): not a field

    def groups(self) -> list[list[int]]:
        return [list(range(i, i + self.size)) for i in range(0, self.world, self.size)]

    def __str__(self) -> str:
        if self.size == self.world:
            return f"{self.symbol} = {self.size} on {self.world} ranks"
        groups = " and ".join(str(ranks) for ranks in self.groups())
        return f"two groups of {self.symbol} = {self.size} side by side on {self.world} ranks, {groups}"


class _GroupPlace:
    """This rank in a ``_SideBySide`` case: its group, its rank r in it, and a log of what its code starts.

    A subclass turns one process-group call into its log entry (``_call``, with an ``on`` attribute that
    ``_on`` gives) and says how to keep a collective on the group passed in (``advice``). Nothing is logged
    while ``phase`` is None. ``at`` notes the case, ``label`` (the sub-case, if any) and the phase for a hang.
    """

    advice = ""

    def __init__(self, case: _SideBySide, progress: str, phase: str | None):
        self.case, self.rank = case, dist.get_rank()
        members = case.groups()
        groups = [dist.new_group(ranks) for ranks in members]    # every rank makes every group, in order
        self.index, self.r = divmod(self.rank, case.size)
        self.members, self.group = members[self.index], groups[self.index]
        self.seed = 1000 * self.index        # one set of inputs on a group's ranks, another on the next group's
        self.note, self.phase, self.calls, self.label = Path(progress, str(self.rank)), phase, [], ""

    def at(self, phase: str) -> None:
        self.phase = phase
        self.note.write_text(", ".join(part for part in (str(self.case), self.label, phase) if part))

    def who(self) -> str:
        return f"(group {self.members}, its rank {self.r}) " if self.case.size != self.case.world else ""

    def _on(self, pg: ProcessGroup) -> str:
        return ("the group" if pg is self.group else f"the default group (all {self.case.world} ranks)"
                if pg is dist.group.WORLD else "another group")

    def _call(self, method: str, pg: ProcessGroup, args: tuple) -> object:
        raise NotImplementedError

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Inside ``watching``: every collective and send of the process groups, logged by ``_call``."""
        def note(method: str, pg: ProcessGroup, args: tuple) -> None:
            if self.phase is not None and method != "recv":
                self.calls.append(self._call(method, pg, args))
        with listening(note):
            yield

    def group_hint(self) -> str:
        if any(c.on != "the group" for c in self.calls):
            return (f"\n    hint: a collective ran on another process group than the one passed in (ranks "
                    f"{self.members}): {self.advice}")
        return ""
