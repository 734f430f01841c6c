"""Checks that exercise notebooks call; the autograder reports their AssertionErrors.

One module per exercise topic, all re-exported here, so a notebook writes
``from dtcourse.checks import check_all_reduce``:

* ``dtcourse.checks.memory``: exercise 00 (the bytes of a training step, kind by kind)
* ``dtcourse.checks.collectives``: exercise 01 (ring collectives from send/recv)
* ``dtcourse.checks.data_parallel``: exercise 02 (bucketed, overlapped DDP)
* ``dtcourse.checks.parameter_server``: exercise 03 (an SSP parameter server loop)
* ``dtcourse.checks.mixed_precision``: exercise 04 (a dynamic loss scaler against GradScaler)
* ``dtcourse.checks.checkpointing``: exercise 05 (a checkpointed sequential container)
* ``dtcourse.checks.common``: running a check on ranks and reporting what went wrong

``timeout=None`` means ``$DTCOURSE_CHECK_TIMEOUT`` seconds (20 if unset); the
autograder sets it (``python -m dtcourse.grade --check-timeout``).
"""

from dtcourse.checks.memory import check_activations, check_model_states
from dtcourse.checks.collectives import (FLOATS, check_all_gather, check_all_reduce, check_reduce_scatter,
                                         check_ring_exchange)
from dtcourse.checks.data_parallel import check_bucket_assignment, check_ddp_parity, check_overlap
from dtcourse.checks.parameter_server import check_exactly_once, check_hang, check_staleness_bound, check_sync_parity
from dtcourse.checks.mixed_precision import check_loss_scaler
from dtcourse.checks.checkpointing import (check_checkpoint_gradients, check_checkpoint_memory,
                                           check_segment_bounds)

__all__ = ["check_ring_exchange", "check_reduce_scatter", "check_all_gather", "check_all_reduce", "FLOATS",
           "check_bucket_assignment", "check_ddp_parity", "check_overlap"]
__all__ += ["check_segment_bounds", "check_checkpoint_gradients", "check_checkpoint_memory"]
__all__ += ["check_loss_scaler"]
__all__ += ["check_exactly_once", "check_staleness_bound", "check_sync_parity", "check_hang"]
__all__ += ["check_model_states", "check_activations"]
