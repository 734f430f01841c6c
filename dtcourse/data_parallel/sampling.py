"""Which samples each data-parallel rank reads: ``DistributedSampler``, rebuilt (``dtcourse.lab.data_parallel.plot_shards`` draws it).

In data parallelism every rank loads its own part of the global batch from its
own copy of the dataset. ``torch.utils.data.DistributedSampler`` decides which
part, and it does so by arithmetic alone: every rank draws the same permutation
(the generator is seeded with ``seed + epoch``, so all ranks agree without
talking), pads it to a multiple of the number of ranks, and keeps every N-th
index starting at its own rank. No tensor and no index travels between ranks;
the sampler does not even need a process group when ``num_replicas`` and
``rank`` are given. ``shard_indices`` rebuilds that rule in a few lines, and
``torch_shards`` asks torch's own sampler, so the two can be compared.

Example::

    from dtcourse.data_parallel.sampling import shard_indices, torch_shards
    shard_indices(10, num_replicas=4, rank=1, shuffle=False)   # -> [1, 5, 9]
    torch_shards(10, num_replicas=4, shuffle=False)            # -> [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]

Padding (``drop_last=False``, the default) repeats the first samples of the
epoch's order, so with 10 samples on 4 ranks, ranks 2 and 3 each read one
sample twice in the epoch (``padding_mask`` says where). ``drop_last=True``
instead cuts the order to the largest multiple of N.
"""

from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler

__all__ = ["shard_indices", "torch_shards", "padding_mask"]


def _check(dataset_len: int, num_replicas: int, rank: int = 0) -> None:
    if not isinstance(dataset_len, int) or dataset_len < 1:
        raise ValueError(f"dataset_len must be a positive number of samples, got {dataset_len!r}.")
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive number of ranks, got {num_replicas!r}.")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, {num_replicas - 1}] for num_replicas={num_replicas}, got {rank!r}.")


def _total(dataset_len: int, num_replicas: int, drop_last: bool) -> int:
    """Samples read in one epoch by all ranks together: a multiple of num_replicas."""
    if drop_last:
        return dataset_len // num_replicas * num_replicas            # cut the tail
    return -(-dataset_len // num_replicas) * num_replicas            # ceil: pad up


def shard_indices(dataset_len: int, num_replicas: int, rank: int, *, epoch: int = 0, seed: int = 0,
                  shuffle: bool = True, drop_last: bool = False) -> list[int]:
    """The dataset indices ``rank`` reads in ``epoch``: the rule of torch's ``DistributedSampler``.

    Every rank computes the same ``order``, so no rank needs to hear from another.
    """
    _check(dataset_len, num_replicas, rank)
    if shuffle:   # same seed + epoch on every rank -> the same permutation on every rank
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(dataset_len, generator=g).tolist()
    else:
        order = list(range(dataset_len))
    total = _total(dataset_len, num_replicas, drop_last)
    # Pad by wrapping around to the start of the order (several times if there are more ranks
    # than samples), or cut the tail when total < dataset_len.
    order = [order[k % dataset_len] for k in range(total)]
    return order[rank::num_replicas]          # interleaved: rank r takes positions r, r+N, r+2N, ...


def torch_shards(dataset_len: int, num_replicas: int, *, epoch: int = 0, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False) -> list[list[int]]:
    """Ask torch's ``DistributedSampler`` for every rank's indices, one sampler per rank.

    ``num_replicas`` and ``rank`` are passed explicitly, so this works in a process with no
    process group at all: the sampler never communicates.
    """
    _check(dataset_len, num_replicas)
    dataset = range(dataset_len)              # a sampler only needs len(dataset)
    shards = []
    for rank in range(num_replicas):
        sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                                     seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)              # a training loop calls this at the top of every epoch
        shards.append(list(sampler))
    return shards


def padding_mask(dataset_len: int, num_replicas: int, *, drop_last: bool = False) -> list[list[bool]]:
    """Per rank and position, True where the sample is a padded repeat (read twice in the epoch).

    Position j of rank r is slot j*N + r of the padded order; slots past ``dataset_len`` repeat
    earlier samples. Which samples those are depends on the shuffle; where they sit does not.
    """
    _check(dataset_len, num_replicas)
    per_rank = _total(dataset_len, num_replicas, drop_last) // num_replicas
    return [[j * num_replicas + r >= dataset_len for j in range(per_rank)] for r in range(num_replicas)]
