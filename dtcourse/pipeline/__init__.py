"""Pipeline parallelism (lesson 08): schedules kept as data, checked, simulated and executed.

* ``actions.py``: ``Action``, one step of a schedule in ``torch.distributed.pipelining``'s notation.
* ``schedules.py``: naive, GPipe, 1F1B, interleaved 1F1B and ZB-H1 orders per rank, each ending in its
  optimizer steps; ``with_communication`` adds the messages.
* ``validate.py``: ``validate``, a schedule checked for order, completeness, matched messages and deadlock.
* ``simulate.py``: ``simulate``, a predicted timeline and bubble; ``peak_activations``.
* ``cost.py``: ``bubble_formula``, the papers' idle share of a step by schedule.
* ``partition.py``: ``balanced_partition`` and ``split_gpt``, a GPT cut into p·v stages of contiguous blocks.
* ``execute.py``: ``PipelineExecutor`` / ``run_schedule``, one rank's actions run on real ranks, every one timed.
* ``trace.py``: ``chrome_trace`` / ``write_chrome_trace``, recorded spans for Perfetto and chrome://tracing.
"""

from dtcourse.pipeline.actions import COMMUNICATION, COMPUTE, KINDS, STEP, Action, Schedule, without_steps
from dtcourse.pipeline.schedules import (SCHEDULES, build, gpipe, interleaved_1f1b, naive, one_f_one_b,
                                         with_communication, with_steps, zb_h1)
from dtcourse.pipeline.cost import bubble_formula
from dtcourse.pipeline.simulate import Prediction, peak_activations, simulate
from dtcourse.pipeline.validate import validate
from dtcourse.pipeline.partition import GPTStage, balanced_partition, gpt_boundary_shape, split_gpt, stages_of_rank
from dtcourse.pipeline.execute import PipelineExecutor, PipelineParallel, rank_actions, run_schedule, stepper
from dtcourse.pipeline.trace import chrome_trace, write_chrome_trace

__all__ = ["Action", "Schedule", "COMPUTE", "COMMUNICATION", "STEP", "KINDS", "without_steps"]
__all__ += ["naive", "gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1", "with_communication", "with_steps", "SCHEDULES",
            "build"]
__all__ += ["validate", "simulate", "Prediction", "bubble_formula", "peak_activations"]
__all__ += ["balanced_partition", "split_gpt", "GPTStage", "gpt_boundary_shape", "stages_of_rank"]
__all__ += ["PipelineExecutor", "PipelineParallel", "run_schedule", "rank_actions", "stepper"]
__all__ += ["chrome_trace", "write_chrome_trace"]
