"""Pipeline parallelism (lesson 08): schedules kept as data, checked, simulated and executed.

* ``actions.py``: ``Action``, one step of a schedule in ``torch.distributed.pipelining``'s notation.
* ``schedules.py``: naive, GPipe, 1F1B, interleaved 1F1B and ZB-H1 orders per rank; ``with_communication``.
* ``validate.py``: ``validate``, a schedule checked for order, completeness, matched messages and deadlock.
* ``simulate.py``: ``simulate``, a predicted timeline and bubble; ``bubble_formula``; ``peak_activations``.
"""

from dtcourse.pipeline.actions import COMMUNICATION, COMPUTE, KINDS, Action, Schedule
from dtcourse.pipeline.schedules import SCHEDULES, gpipe, interleaved_1f1b, naive, one_f_one_b, with_communication, zb_h1
from dtcourse.pipeline.simulate import Prediction, bubble_formula, peak_activations, simulate
from dtcourse.pipeline.validate import validate

__all__ = ["Action", "Schedule", "COMPUTE", "COMMUNICATION", "KINDS"]
__all__ += ["naive", "gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1", "with_communication", "SCHEDULES"]
__all__ += ["validate", "simulate", "Prediction", "bubble_formula", "peak_activations"]
