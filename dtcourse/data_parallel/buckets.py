"""Gradient buckets for DDP (lesson 02, step 2): which parameters' gradients travel together.

An all-reduce pays a fixed latency alpha however small its message, so DDP packs gradients into
flat buckets of about ``bucket_cap_mb`` MiB and all-reduces each bucket once (Li et al.,
"PyTorch Distributed", arXiv 2006.15704, section 3.2.3). Buckets are filled in reverse
registration order, roughly the order in which backward produces the gradients, so the first
bucket is complete early and its all-reduce can start while backward goes on (step 3)::

    assign_buckets(list(model.parameters()), cap_bytes=25 * 2**20)   # lists of parameter indices, last first
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = ["assign_buckets", "Bucket"]


def assign_buckets(params: list[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """Group the indices of ``params`` into buckets, walking them in reverse registration order.

    A bucket is closed as soon as it holds ``cap_bytes`` or more (torch's rule,
    so a bucket overshoots the cap by at most one parameter); a change of dtype
    or device also starts a new bucket, since a bucket is one flat tensor.
    torch also gives its first bucket a smaller cap (1 MiB) and, after the first
    iteration, re-buckets by the order gradients really arrived: both left out.
    """
    buckets, current, size = [], [], 0
    for i in reversed(range(len(params))):
        p = params[i]
        if current and (p.dtype, p.device) != (params[current[0]].dtype, params[current[0]].device):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass
class Bucket:
    """Parameters whose gradients travel in one all-reduce, and that all-reduce's state."""

    index: int
    param_ids: list[int]                  # positions in the wrapper's list of trainable parameters
    params: list[nn.Parameter]
    spans: list[tuple[int, int]]          # [lo, hi) of each gradient inside the flat tensor
    flat: torch.Tensor | None             # (sum of numels,) reused every step; None for per_parameter
    pending: int = 0                      # gradients not yet accumulated in this backward
    tensor: torch.Tensor | None = None    # what is being all-reduced: flat, or p.grad itself
    work: Any = None                      # async handle from dist.all_reduce, or None once done
