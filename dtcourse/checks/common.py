"""What every exercise check shares: running a check on ranks, and reporting what went wrong.

A check runs the student's code with ``dtcourse.launch`` and turns a hang, an
exception or a wrong answer into one ``AssertionError`` whose message the
autograder prints: which rank, which case, what was expected and what came back.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from pathlib import Path
from typing import Callable, Sequence

import torch.distributed as dist

from dtcourse.runtime.launch import LaunchError, RankError, launch


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _notes(progress: str, world_size: int) -> dict[int, str]:
    """The case each rank last started ('finished' when done), from its progress file."""
    return {rank: _read(Path(progress, str(rank))) for rank in range(world_size)}


def _tail(remote_traceback: str, lines: int = 3) -> str:
    return "\n".join(remote_traceback.strip().splitlines()[-lines:])


def _student_error(exc: BaseException) -> str:
    """'ValueError: msg' plus the innermost frames of the student's code."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)[1:]
              if "torch" + os.sep not in f.filename
              and os.path.dirname(f.filename) != os.path.dirname(__file__)]
    where = "".join(f"\n    in {f.name}, line {f.lineno}: {(f.line or '').strip()}" for f in frames[-3:])
    stub = ("\n(the exercise stub is still there: replace the `raise NotImplementedError` line "
            "with your code)") if isinstance(exc, NotImplementedError) else ""
    return f"{type(exc).__name__}: {exc}{where}{stub}"


def _check_names(check: str, fn: Callable, names: Sequence[str], known: dict) -> None:
    if not callable(fn):
        raise TypeError(f"{check}: pass your function or class itself, not {type(fn).__name__}")
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"{check}: cases must be among {sorted(known)}, got {list(names)}")


def _launch_check(label: str, world_size: int, rank_fn: Callable, args: tuple, timeout: float | None,
                  where: str, hint: str) -> None:
    """Run ``rank_fn(*args, progress)`` on every rank; turn whatever went wrong into an AssertionError."""
    if timeout is None:
        timeout = float(os.environ.get("DTCOURSE_CHECK_TIMEOUT", "20"))
    with tempfile.TemporaryDirectory(prefix="dtcourse-check-") as progress:
        try:
            results = launch(rank_fn, world_size, *args, progress, timeout=timeout)
        except TimeoutError as err:
            busy: dict[str, list[int]] = {}
            for rank, note in _notes(progress, world_size).items():
                if note != "finished":
                    busy.setdefault(note or "before the first case", []).append(rank)
            stuck = "; ".join(f"rank(s) {ranks} in {note}" for note, ranks in busy.items())
            _, marker, stacks = str(err).partition("\nWhere the stuck ranks were")
            stacks = "\n" + "\n".join((marker.strip() + stacks).splitlines()[:7]) if marker else ""
            raise AssertionError(f"{label} did not finish{where} within {timeout:g} s: {stuck} were "
                                 f"still running. {hint}{stacks}") from None
        except RankError as err:
            note = _notes(progress, world_size).get(err.rank, "")
            text = _read(Path(progress, f"{err.rank}.error")) or _tail(err.remote_traceback)
            who = f"rank {err.rank} raised" if world_size > 1 else "it raised"
            raise AssertionError(f"{label} failed{where} in {note}: {who} {text}") from None
        except LaunchError as err:
            raise AssertionError(f"{label} crashed a rank{where}: {err}") from None
    failures = [(rank, result) for rank, result in enumerate(results) if result]
    if failures:
        lines = [f"rank {rank}: {message}" for rank, (_, message) in failures[:4]]
        if world_size == 1:
            lines = [message for _, (_, message) in failures]
        more = f"\n  ... and {len(failures) - 4} more ranks" if len(failures) > 4 else ""
        raise AssertionError(f"{label} is wrong{where} in {failures[0][1][0]}:\n  "
                             + "\n  ".join(lines) + more)


def _as_student(progress: str, call: Callable) -> object:
    """Run the student's code; if it raises, leave its error where the parent will find it."""
    try:
        return call()
    except Exception as exc:
        Path(progress, f"{dist.get_rank()}.error").write_text(_student_error(exc))
        raise
