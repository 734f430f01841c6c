"""Two collectives under the names torch 2.13 gives them, on older releases too.

torch 2.13 (the course's pin) names them ``all_gather_single`` and ``reduce_scatter_single`` and
deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor``; releases before it have only the
latter (the GPU machine this course was checked on has torch 2.11). Same arguments, same result::

    all_gather_single(full, part, group=group)          # full (N·s,) <- every rank's part (s,)
    reduce_scatter_single(part, full, group=group)      # part (s,) <- sum over ranks of this rank's slice
"""

import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
