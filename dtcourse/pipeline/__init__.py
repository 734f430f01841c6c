"""Pipeline parallelism (lesson 08): schedules kept as data, checked, simulated and executed.

* ``actions.py``: ``Action``, one step of a schedule in ``torch.distributed.pipelining``'s notation.
"""

from dtcourse.pipeline.actions import COMMUNICATION, COMPUTE, KINDS, Action, Schedule

__all__ = ["Action", "Schedule", "COMPUTE", "COMMUNICATION", "KINDS"]
