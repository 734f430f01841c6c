"""Export recorded spans to the Chrome trace format, which Perfetto (ui.perfetto.dev) and chrome://tracing open.

The format is the one ``torch.profiler``'s ``export_chrome_trace`` writes: a JSON object whose
``traceEvents`` list holds one *complete event* (``"ph": "X"``) per span, with its start ``ts`` and
length ``dur`` in microseconds, a process id ``pid`` and a thread id ``tid``. Here each rank is a
process, and within it compute and communication are two threads, as in the course's own Gantt charts
(``dtcourse.lab.timeline``). Metadata events (``"ph": "M"``) name them. Example::

    write_chrome_trace(merge(timelines), "pipeline.json")     # then open it in ui.perfetto.dev

Trace Event Format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dtcourse.runtime.timeline import COMMUNICATION_KINDS, Recording

__all__ = ["chrome_trace", "write_chrome_trace", "COMPUTE_TID", "COMMUNICATION_TID"]

COMPUTE_TID, COMMUNICATION_TID = 0, 1


def chrome_trace(recording: Recording, label: str = "rank") -> dict[str, Any]:
    """``{"traceEvents": [...]}``: one ``"X"`` event per span (``cat`` is its kind), pid = rank, tid = lane."""
    events: list[dict[str, Any]] = []
    for rank in sorted(recording):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"{label} {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for tid, lane in ((COMPUTE_TID, "compute"), (COMMUNICATION_TID, "communication")):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}})
        for span in recording[rank]:
            tid = COMMUNICATION_TID if span.kind in COMMUNICATION_KINDS else COMPUTE_TID
            events.append({"name": span.name, "cat": span.kind, "ph": "X", "pid": rank, "tid": tid,
                           "ts": 1e6 * span.start, "dur": 1e6 * span.duration})   # seconds -> microseconds
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(recording: Recording, path: str | Path, label: str = "rank") -> Path:
    """Write ``chrome_trace(recording)`` to ``path`` as JSON; return the path."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(recording, label)))
    return path
