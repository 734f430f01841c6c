"""Data parallelism (lesson 02): DistributedDataParallel in three steps, and which samples each rank reads.

* ``ddp.py``: ``DistributedDataParallel(module, bucket_cap_mb=25, overlap=True, group=None)`` with
  its three strategies (per-parameter, bucketed, overlapped).
* ``buckets.py``: ``assign_buckets``, which gradients share one all-reduce.
* ``sampling.py``: ``DistributedSampler``'s rule rebuilt (``shard_indices``), beside torch's own.
* ``cost.py``: a step's FLOPs beside its all-reduce (``hiding_batch``), and the bucket count that
  overlaps best (``best_bucket_count``).

Example::

    from dtcourse.data_parallel import DistributedDataParallel
    ddp = DistributedDataParallel(MLP(), bucket_cap_mb=25, overlap=True)
    F.mse_loss(ddp(x), y).backward()      # each p.grad is now the mean over ranks
"""

from dtcourse.data_parallel.buckets import assign_buckets
from dtcourse.data_parallel.ddp import COMMS, STRATEGIES, DistributedDataParallel

__all__ = ["DistributedDataParallel", "assign_buckets", "STRATEGIES", "COMMS"]
