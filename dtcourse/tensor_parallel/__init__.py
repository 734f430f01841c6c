"""Tensor and sequence parallelism (lesson 09): Megatron's layers, cut from a plain GPT.

* ``communications.py``: Megatron's ``f`` and ``g`` (Shoeybi et al., arXiv 1909.08053) and sequence
  parallelism's all-gather / reduce-scatter pair (Korthikanti et al., arXiv 2205.05198), as autograd
  functions taking the process group (``dtcourse.runtime.observe`` counts what they send).
* ``layers.py``: ``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding`` and
  ``vocab_parallel_cross_entropy``, each built from the full serial layer.
* ``parallelize.py``: ``parallelize(gpt, group, sequence_parallel)`` and ``TensorParallel``, the parity
  harness's adapter.
* ``cost.py``: the formulas: bytes per layer, activations per layer by Korthikanti's terms, and the
  alpha-beta time of a layer's all-reduces beside its compute (``tp_cost``, ``crossover``).

Example, on every rank under ``dtcourse.launch``::

    gpt = parallelize(GPT(cfg, seed=0), group=None, sequence_parallel=True)
"""

from dtcourse.tensor_parallel.communications import (
    copy_to_tensor_parallel, gather_from_sequence_parallel, reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel)
from dtcourse.tensor_parallel.layers import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, check_divides, check_ids, full_of, gather_shards,
    shard_of, vocab_parallel_cross_entropy)
from dtcourse.tensor_parallel.parallelize import (
    PositionShard, SequenceParallelGrads, ShardedDropout, TensorParallel, all_reduce_sequence_parallel_grads,
    parallelize, sequence_parallel_parameters, tensor_parallel_group, vocab_parallel_lm_loss)

__all__ = ["copy_to_tensor_parallel", "reduce_from_tensor_parallel",
           "gather_from_sequence_parallel", "reduce_scatter_to_sequence_parallel"]
__all__ += ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
            "check_divides", "check_ids", "shard_of", "gather_shards", "full_of"]
__all__ += ["parallelize", "vocab_parallel_lm_loss", "all_reduce_sequence_parallel_grads", "TensorParallel",
            "SequenceParallelGrads", "sequence_parallel_parameters", "PositionShard", "ShardedDropout", "tensor_parallel_group"]
