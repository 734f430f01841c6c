"""3D parallelism (lesson 10): data × pipeline × tensor parallelism, with ZeRO over the data-parallel ranks.

* ``plan.py``: ``Plan``, the sizes and the techniques' settings, which checks itself against a model and a world;
* ``compose.py``: ``parallelize(model, mesh, plan, optimizer)``, which applies them in one commented order, and
  ``Parallel3D``, the result (``train_step``), which is also the parity harness's adapter;
* ``cost.py``: the bytes each rank sends per step over tp, pp and dp (``step_bytes``), equal to the counted ones.

Example, on every rank under ``dtcourse.launch``::

    plan = Plan(dp=2, pp=2, tp=2, zero_stage=1, microbatches=4)
    model = parallelize(GPT(config, seed=0), build_groups(plan.dims), plan, adamw)
    model.train_step(plan.split(x, rank, world), plan.split(y, rank, world))   # one step, optimizer included
"""

from dtcourse.parallel_3d.compose import Parallel3D, parallelize
from dtcourse.parallel_3d.plan import SCHEDULES, Plan

__all__ = ["Plan", "SCHEDULES", "parallelize", "Parallel3D"]
