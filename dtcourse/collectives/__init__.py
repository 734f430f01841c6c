"""Collectives (lesson 01): all-reduce three ways, built only from point-to-point messages.

* ``messages.py``: ``post`` and ``exchange``, the one way every algorithm here sends bytes, and
  the ``ByteCounter`` that records each ``Message``.
* ``naive.py``: ``naive_all_reduce``, everything through rank 0, whose link carries (N-1)·S.
* ``tree.py``: ``tree_all_reduce``, a binomial tree: 2·ceil(log2 N) rounds of S bytes.
* ``ring.py``: ``ring_reduce_scatter``, ``ring_all_gather`` and ``ring_all_reduce`` (the two in a
  row): 2(N-1) steps, 2(N-1)/N·S bytes per rank, bandwidth-optimal; the algorithm alone, as the
  lesson draws it.
* ``fast_ring.py``: the same three as a library runs them (``fast_ring_all_reduce`` ...): the same
  messages and sums, with receives posted ahead and a reused buffer; ``slices=k`` pipelines the
  additions behind the transfers (``pipelined.py``), and ``chunk_bytes=c`` sends a large tensor
  round in blocks of N chunks of at most c bytes (``blocks.py``). DDP and ZeRO use these.
* ``cost.py``: the alpha-beta(-gamma) model (``predict_time``, ``predict_ring_step``,
  ``fit_alpha_beta``), the byte formulas (``analytic_bytes``) and nccl-tests' ``algbw``/``busbw``.

Call shapes follow ``torch.distributed``: the all-reduces work in place on one tensor;
``ring_reduce_scatter(output, input_tensor)`` and ``ring_all_gather(output, input_tensor)``
follow ``reduce_scatter_tensor`` and ``all_gather_into_tensor``. Example::

    counter = ByteCounter()
    ring_all_reduce(grad, op=ReduceOp.AVG, counter=counter)
    counter.sent      # == 2 * (N - 1) / N * grad.nbytes when N divides grad.numel()
"""

from dtcourse.collectives.cost import (BUSBW_FACTOR, algbw, analytic_bytes, busbw, fit_alpha_beta, predict_ring_step,
                                       predict_time)
from dtcourse.collectives.messages import ByteCounter, Message
from dtcourse.collectives.fast_ring import fast_ring_all_gather, fast_ring_all_reduce, fast_ring_reduce_scatter
from dtcourse.collectives.naive import naive_all_reduce
from dtcourse.collectives.ring import chunk_sizes, ring_all_gather, ring_all_reduce, ring_reduce_scatter
from dtcourse.collectives.tree import tree_all_reduce

ALGORITHMS = {"naive": naive_all_reduce, "tree": tree_all_reduce, "ring": ring_all_reduce}

__all__ = [
    "naive_all_reduce", "tree_all_reduce", "ring_all_reduce", "ring_reduce_scatter", "ring_all_gather",
    "fast_ring_all_reduce", "fast_ring_reduce_scatter", "fast_ring_all_gather",
    "ByteCounter", "Message", "chunk_sizes", "analytic_bytes", "predict_time", "predict_ring_step", "algbw",
    "busbw", "BUSBW_FACTOR", "fit_alpha_beta", "ALGORITHMS",
]
