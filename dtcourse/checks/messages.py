"""How a failing check words what several ranks found: each hint once.

``_launch_check`` (``common.py``) lists every failing rank's message, and the ranks of a group mostly make the
same mistake, so each would repeat the same hint. ``hints_once`` keeps the first and points back to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Hint", "hints_once"]


@dataclass(frozen=True)
class Hint:
    """A guess at the mistake, as a rank words it: what it found, then what to change (``hints_once``)."""

    what: str
    change: str
    sep: str = ": "

    def __str__(self) -> str:
        return f"{self.what}{self.sep}{self.change}"


_RANK_LINE = re.compile(r"  rank (\d+): ")


def hints_once(message: str, inline: Sequence[Hint] = (), pointers: Sequence[str] = ()) -> str:
    """``message`` with each distinct hint once: a later rank that repeats one points to the rank that shows it.

    ``_launch_check`` lists every failing rank's message, and the ranks of a group mostly make the same mistake,
    so each would repeat the same hint. A ``hint:`` line seen on an earlier rank becomes "hint: the same as
    rank N's, above"; an ``inline`` hint seen before keeps what this rank found and drops what to change; a line
    of ``pointers`` seen before goes.
    """
    seen: dict[str, str | None] = {}
    rank, lines = None, []

    def where(key: str) -> str:
        return f"the same as rank {seen[key]}'s, above" if seen[key] is not None else "the same as above"

    for line in message.split("\n"):
        head = _RANK_LINE.match(line)
        rank = head.group(1) if head else rank
        if line.startswith("    hint: "):
            key = line.strip()
            if key in seen:
                line = f"    hint: {where(key)}"
            else:
                seen[key] = rank
        elif line.startswith("    ") and line.strip() in pointers:
            if line.strip() in seen:
                continue
            seen[line.strip()] = rank
        for hint in inline:
            key = str(hint)
            if key in line:
                if key in seen:
                    line = line.replace(key, f"{hint.what} ({where(key)})")
                else:
                    seen[key] = rank
        lines.append(line)
    return "\n".join(lines)
