"""Fault tolerance (lesson 12): snapshots that resume bit for bit, and restarts that run the same resume code.

* ``snapshot.py``: ``Snapshots`` (atomic per-rank files, checksums, every generator's state, the step and
  the data position; the newest complete snapshot that every rank can read is the one restored),
  ``restart_count`` (torchrun's ``TORCHELASTIC_RESTART_COUNT``; ``dtcourse.launch(max_restarts=)`` sets it).
* ``sharded.py``: ``save`` / ``load`` with ``torch.distributed.checkpoint``: shards any world size can load
  (FSDP2 saved by 2 ranks, resumed by 4), blocking or ``async_save``.
* ``cost.py``: the formulas: Young's and Daly's snapshot intervals and the expected overhead.

Restarting is ``dtcourse.launch(fn, n, max_restarts=k)`` from a notebook, ``torchrun --max-restarts k`` from a
shell: both only start the workers again. Example, on every rank::

    snaps = Snapshots("runs/demo"); resumed = snaps.restore(model, optimizer)
    first = 0 if resumed is None else resumed.step
"""

from dtcourse.fault_tolerance.snapshot import (Resumed, SnapshotError, Snapshots, restart_count, rng_state,
                                               set_rng_state)

__all__ = ["Snapshots", "Resumed", "SnapshotError", "restart_count", "rng_state", "set_rng_state"]
