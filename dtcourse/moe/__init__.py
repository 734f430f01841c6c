"""Expert parallelism (lesson 11): an MoE layer's experts spread over ranks, tokens moved with all-to-all.

The layer itself (router, top-k gating, capacity, the Switch and z losses) is an architecture and lives in
``dtcourse.models.moe``; this package holds its parallel form.

* ``communication.py``: ``all_to_all``, an autograd function over ``all_to_all_single`` that takes its group;
  ``exchange_counts`` for the dropless mode (``dtcourse.runtime.observe`` counts their bytes).
* ``dispatch.py``: ``dispatch_padded`` / ``dispatch_dropless`` and ``combine_padded`` / ``combine_dropless``:
  tokens to their experts' ranks (capacity slots with equal splits, or sorted rows with uneven splits), and back.
* ``expert_parallel.py``: ``ExpertParallelMoE``, ``expert_parallelize(gpt, group)`` and ``ExpertParallel``,
  the parity harness's adapter (data parallelism for the non-expert parameters).
* ``cost.py``: the formulas: a balanced router's dropped share, all-to-all bytes, parameters and FLOPs.

Example, on every rank under ``dtcourse.launch``::

    model = expert_parallelize(GPT(GPTConfig(n_expert=4, top_k=2), seed=0), group=None)
"""

from dtcourse.moe.communication import all_to_all, exchange_counts
from dtcourse.moe.dispatch import Plan, combine_dropless, combine_padded, dispatch_dropless, dispatch_padded
from dtcourse.moe.expert_parallel import (ExpertParallel, ExpertParallelMoE, check_expert_parallel,
                                          expert_parallelize)

__all__ = ["all_to_all", "exchange_counts"]
__all__ += ["Plan", "dispatch_padded", "combine_padded", "dispatch_dropless", "combine_dropless"]
__all__ += ["ExpertParallelMoE", "expert_parallelize", "ExpertParallel", "check_expert_parallel"]
