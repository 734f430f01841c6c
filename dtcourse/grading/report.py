"""What a grading found, as ``dtcourse check`` and ``dtcourse grade`` print it.

``Report`` holds one ``Check`` per test cell, the notes and the flagged code; ``str(report)`` is the
printed report. Two things in it are for the student reading it:

* **When the notebook was last saved.** What runs is the file on disk, not the edits in the browser
  that JupyterLab has not saved yet (it autosaves every two minutes). The time is printed rather than
  compared with JupyterLab's checkpoint (``.ipynb_checkpoints/<name>-checkpoint.ipynb``): the checkpoint
  is written by a manual save (Ctrl+S) right after the notebook, and autosave writes the notebook
  alone, so the notebook is never older than its checkpoint and a warning built on them would not fire
  when it matters; the unsaved edits are in the browser, which no file shows.
* **Each failure once.** An untouched exercise fails every check on the same stub; ``_said_once``
  shows the whole error and the advice the first time, and a one-line pointer after that.

Example::

    print(Report(Path("mine.ipynb"), None, checks=[Check("check_ring", 0.0, 2, "AssertionError: ...")]))
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Check:
    """One test (grade) cell: its points, and why it failed ('' if it passed)."""

    grade_id: str
    points: float | None  # None: needs a person (a manually graded answer), or hidden in a self-check
    max_points: float
    message: str = ""
    hidden: bool = False  # a self-check: the instructor's grading runs this cell's checks

    @property
    def passed(self) -> bool:
        return self.points is not None and self.points >= self.max_points


@dataclass
class Report:
    """What ``grade_notebook`` found; ``str(report)`` is the printed report.

    The report says when the notebook was last saved (what runs is the file, not the browser's
    unsaved edits), and says each failure once (``_said_once``).
    """

    notebook: Path
    source: Path | None
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # other cells that failed, restored cells
    flagged: list[str] = field(default_factory=list)  # code that reaches into the grading (audit)
    error: str = ""  # set when the notebook could not be graded at all
    saved: float | None = None  # the notebook file's modification time: what runs is what was last saved

    @property
    def score(self) -> float:
        return sum(c.points or 0.0 for c in self.checks)

    @property
    def max_score(self) -> float:
        return sum(c.max_points for c in self.checks if c.points is not None)

    @property
    def exit_code(self) -> int:
        if self.error:
            return 2
        return 0 if all(c.passed for c in self.checks if c.points is not None) and not self.flagged else 1

    def __str__(self) -> str:
        lines = [f"Grading {self.notebook}", f"  against {self.source}"]
        if self.saved is not None:
            lines.append(f"  last saved {_when(self.saved)}: what runs is the file, not edits made since, so "
                         "save the notebook first (Ctrl+S)")
        lines.append("")
        if self.error:
            return "\n".join(lines + [f"Could not grade: {self.error}"])
        width = max([len(c.grade_id) for c in self.checks] + [10])
        for c, message in zip(self.checks, _said_once(self.checks)):
            status = ("HIDDEN" if c.hidden else "MANUAL") if c.points is None else "PASS" if c.passed else "FAIL"
            earned = "?" if c.points is None else f"{c.points:g}"
            lines.append(f"  {status:<6} {c.grade_id:<{width}}  {earned} / {c.max_points:g}")
            lines += [f"         {line}" for line in message.splitlines()]
        if self.notes:
            lines += ["", "Notes:"] + [f"  {note}" for note in self.notes]
        if self.flagged:
            lines += ["", "Flagged for the instructor (code that reaches into the grading):"]
            lines += [f"  {finding}" for finding in self.flagged]
        hidden = sum(c.max_points for c in self.checks if c.hidden)
        lines += ["", f"Total: {self.score:g} / {self.max_score:g}"
                  + (f" (and {hidden:g} points of hidden checks, which only the instructor's grading runs)"
                     if hidden else "")]
        return "\n".join(lines)


# A stub's error, as dtcourse.checks.common._student_error words it: the frame that raised, and the advice.
_STUB_FRAME = re.compile(r"^\s*in (?P<function>\w+), line \d+: raise NotImplementedError\b.*$", re.M)
_STUB_ERROR = re.compile(r"NotImplementedError: [^\n]*")
_STUB_ADVICE = "(the exercise stub is still there"


def _said_once(checks: list[Check]) -> list[str]:
    """Each check's message, with what an earlier check already said shortened to a pointer.

    An untouched exercise fails every check on the same stub: the first check shows the whole error
    and the advice; a later one whose code stops in the same stub gets one line naming it, and the
    advice is never repeated. A message identical to an earlier one points to it.
    """
    said: dict[str, str] = {}            # message -> the check that showed it
    stubs: dict[str, str] = {}           # stub function -> the check that showed its error
    advised, shown = False, []
    for c in checks:
        message = c.message
        if c.points is None or c.passed:          # HIDDEN and MANUAL rows say the same thing on purpose
            shown.append(message)
            continue
        frames = _STUB_FRAME.findall(message)
        error = _STUB_ERROR.search(message)
        if frames and error and frames[-1] in stubs:
            message = f"{frames[-1]} is still the stub ({error.group(0)}), as under {stubs[frames[-1]]} above"
        elif message in said:
            message = f"the same failure as {said[message]} above"
        else:
            said.setdefault(message, c.grade_id)
            if frames and error:
                stubs[frames[-1]] = c.grade_id
            if advised:
                message = "\n".join(line for line in message.splitlines() if not line.startswith(_STUB_ADVICE))
            advised = advised or _STUB_ADVICE in message
        shown.append(message)
    return shown


def _when(mtime: float, now: float | None = None) -> str:
    """``'at 14:02:31 today (3 min ago)'``: a file's modification time, and how long ago that was."""
    now = time.time() if now is None else now
    stamp, today = time.localtime(mtime), time.localtime(now)
    day = "today" if stamp[:3] == today[:3] else time.strftime("%Y-%m-%d", stamp)
    ago = max(0.0, now - mtime)
    how_long = (f"{ago:.0f} s" if ago < 90 else f"{ago / 60:.0f} min" if ago < 90 * 60 else
                f"{ago / 3600:.0f} hours" if ago < 48 * 3600 else f"{ago / 86400:.0f} days")
    return f"at {time.strftime('%H:%M:%S', stamp)} {day} ({how_long} ago)"
