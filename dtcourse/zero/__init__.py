"""ZeRO (lesson 06): data parallelism whose model states are sharded, stage by stage, on one structure.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(arXiv 1910.02054); stage 3 as PyTorch's FSDP builds it (Zhao et al., arXiv 2304.11277).

* ``flat.py``: ``FlatShard``, a unit's parameters as one padded flat vector and this rank's part of it.
* ``units.py``: which parameters travel together (``default_units``, ``assign_parameters``), and
  ``Unit``, a block gathered and freed together (``build_units``).
* ``validate.py``: the checks made before anything changes, each error saying what to change.
* ``communication.py``: the reduce-scatter, all-gather and all-reduce ZeRO runs, through the
  backend or lesson 01's ring (nothing logged: ``dtcourse.runtime.observe`` records them).
* ``sharded.py``: ``ZeRO(module, stage, optimizer)``, stages 0-3, stage 3's prefetch.
* ``memory.py``: ``ModelStateBytes`` (what a rank holds, ``held_bytes``).
* ``cost.py``: the formulas: ``paper_bytes`` (the paper's table), ``predicted_memory`` by kind,
  ``traffic_formula`` (bytes sent per step) and ``activation_bytes``.

Example, on every rank under ``dtcourse.launch``::

    from dtcourse.zero import ZeRO
    model = ZeRO(MLP(seed=0), stage=2, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    F.mse_loss(model(x), y).backward(); model.step(); model.zero_grad()
"""

from dtcourse.zero.validate import check_same_model
from dtcourse.zero.communication import COMMS, Communicator
from dtcourse.zero.flat import FlatShard
from dtcourse.zero.memory import STAGES, ModelStateBytes, held_bytes, paper_bytes
from dtcourse.zero.sharded import ZeRO
from dtcourse.zero.units import ROOT, Unit, assign_parameters, build_units, default_units

__all__ = ["ZeRO", "Unit", "FlatShard", "Communicator", "COMMS", "STAGES", "ModelStateBytes",
           "paper_bytes", "held_bytes", "default_units", "assign_parameters", "build_units", "check_same_model", "ROOT"]
