"""Data parallelism: DistributedDataParallel built in three steps.

Every rank holds a full copy of the model and runs forward and backward on its
own slice of the batch; averaging the gradients over the ranks makes every copy
take the same step, as one large batch would (Goyal et al., arXiv 1706.02677).
The wrapper keeps the contract of PyTorch's DDP (Li et al., "PyTorch
Distributed", arXiv 2006.15704): when ``loss.backward()`` returns, every
``p.grad`` holds the average, and the training loop needs no extra call::

    ddp = DistributedDataParallel(MLP(), bucket_cap_mb=25, overlap=True)
    F.mse_loss(ddp(x), y).backward()      # each p.grad is now the mean over ranks

Lesson 02 builds the averaging in three steps, each kept as a ``strategy``
(``overlap=True``/``False`` is the short way to pick step 3 or step 2):

1. ``"per_parameter"``: after backward, one all-reduce per gradient; with P
   parameters the latency term alpha is paid P times.
2. ``"bucketed"``: after backward, gradients are copied into flat buckets of
   about ``bucket_cap_mb`` MiB (filled in reverse registration order, roughly
   the order gradients become ready), and each bucket is all-reduced once.
3. ``"overlapped"``: a bucket's all-reduce starts (``async_op=True``) in the
   gradient hook that completes it, while backward computes earlier layers.

In all three, each trainable parameter has a ``register_post_accumulate_grad_hook``.
The first hook of a backward queues a callback with the autograd engine
(``Variable._execution_engine.queue_callback``), which runs after the last
gradient and before ``backward()`` returns: it launches what is left, waits,
divides by N and writes the means into ``p.grad``.

``comm="ring"`` uses ``dtcourse.collectives.fast_ring_all_reduce``, which is
synchronous: under ``"overlapped"`` it runs inside the hook that completes a
bucket, so it starts as early but backward pauses while it runs. Its messages
are point-to-point sends that ``dtcourse.runtime.observe`` records one by one:
2(N-1)/N of the gradient bytes in all. Nothing here logs or times itself;
lesson 02's timeline watches the wrapper from outside (hooks and the observer).

The forward pass sends nothing: the buffers are copied from rank 0 once, at
construction. torch's DDP by default also re-broadcasts them at the start of
every forward (``broadcast_buffers``, renamed ``forward_sync_buffers`` in
torch 2.13), one collective per step that this wrapper never makes.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ReduceOp

from dtcourse.collectives import fast_ring_all_reduce
from dtcourse.data_parallel.buckets import Bucket, assign_buckets

__all__ = ["DistributedDataParallel", "assign_buckets", "STRATEGIES", "COMMS"]

STRATEGIES = ("per_parameter", "bucketed", "overlapped")
COMMS = ("backend", "ring")
_MARK = "_dtcourse_ddp_wrapped"   # set on a wrapped module, so wrapping it twice is caught


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so that ``backward()`` leaves each ``p.grad`` averaged over the ranks of ``group``.

    strategy: ``"per_parameter"``, ``"bucketed"`` or ``"overlapped"``, the three steps above.
    bucket_cap_mb: a bucket closes once it holds this many MiB (unused by ``"per_parameter"``).
    comm: ``"backend"`` (``dist.all_reduce``) or ``"ring"`` (``dtcourse.collectives.fast_ring_all_reduce``).
    group: the ranks to average over (None: the default group). Construction copies group rank 0's
        parameters and buffers to the others; unlike torch, buffers are not re-sent every forward.
    find_unused_parameters: when False, a trainable parameter with no gradient in a synced backward
        raises (cleanly only if every rank misses the same ones; otherwise the ranks' collectives no
        longer match). When True it contributes zeros, so ranks may use different parameters, and
        one more all-reduce of a (P,) usage count finds those unused on every rank, whose ``.grad``
        is left untouched, as torch does.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, overlap: bool = True,
                 group: dist.ProcessGroup | None = None, *, strategy: str | None = None,
                 comm: str = "backend", find_unused_parameters: bool = False):
        super().__init__()
        # overlap picks between steps 2 and 3, as torch users expect; strategy=
        # names any of the three steps and, when given, decides.
        strategy = strategy or ("overlapped" if overlap else "bucketed")
        _check_arguments(module, strategy, bucket_cap_mb, comm)
        self.module = module
        self.strategy, self.comm, self.group = strategy, comm, group
        self.find_unused_parameters = find_unused_parameters
        self.world_size = dist.get_world_size(group)
        _check_same_model(module, group)
        _broadcast_from_rank0(module, group)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]   # frozen ones skipped
        self._names = [n for n, _ in named]
        self._buckets = self._make_buckets(named, int(bucket_cap_mb * 2**20))        # MiB, as torch
        self._bucket_of = {i: b for b in self._buckets for i in b.param_ids}
        self._require_sync = True         # False inside no_sync()
        self._sync_this_backward = True   # snapshot taken by forward, as torch does
        self._used = [False] * len(named)  # accumulates over no_sync steps, for find_unused_parameters
        self._reset()
        for i, (_, p) in enumerate(named):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._grad_ready(i))
        setattr(module, _MARK, True)

    @property
    def buckets(self) -> list[list[str]]:
        """Parameter names per bucket, in the order the buckets are all-reduced."""
        return [[self._names[i] for i in b.param_ids] for b in self._buckets]

    def _make_buckets(self, named: list[tuple[str, nn.Parameter]], cap_bytes: int) -> list[Bucket]:
        if self.strategy == "per_parameter":
            groups = [[i] for i in reversed(range(len(named)))]
        else:
            groups = assign_buckets([p for _, p in named], cap_bytes)
        buckets = []
        for k, ids in enumerate(groups):
            params = [named[i][1] for i in ids]
            spans, lo = [], 0
            for p in params:
                spans.append((lo, lo + p.numel()))
                lo += p.numel()
            # One flat buffer per bucket for the whole run: as many bytes again as the gradients.
            flat = None if self.strategy == "per_parameter" else params[0].new_zeros(lo)   # (numel,)
            buckets.append(Bucket(k, ids, params, spans, flat))
        return buckets

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards of forwards run in here only accumulate ``p.grad`` locally; the next synced
        backward averages the accumulated totals: k micro-batches, one round of all-reduces."""
        before, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = before

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._sync_this_backward = self._require_sync
        return self.module(*args, **kwargs)

    # ------------------------------------------------------------------ #
    # During backward
    # ------------------------------------------------------------------ #
    def _grad_ready(self, i: int) -> None:
        """Hook: parameter i's gradient has been accumulated into its ``.grad``."""
        self._used[i] = True
        if not self._sync_this_backward:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._ready[i] = True
        self._bucket_of[i].pending -= 1
        if self.strategy == "overlapped":
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # Buckets are launched strictly in index order, even if a later one fills
        # first: every rank must issue the same collectives in the same order.
        while self._next < len(self._buckets) and self._buckets[self._next].pending == 0:
            self._launch(self._buckets[self._next])
            self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        with torch.no_grad():
            if bucket.flat is None:              # per_parameter: reduce the gradient itself
                p = bucket.params[0]
                bucket.tensor = p.grad if p.grad is not None else torch.zeros_like(p)
            else:                                # copy each gradient into its slice of the bucket
                for p, (lo, hi) in zip(bucket.params, bucket.spans):
                    if p.grad is None:           # unused here (find_unused_parameters): contributes 0
                        bucket.flat[lo:hi].zero_()
                    else:
                        bucket.flat[lo:hi].copy_(p.grad.reshape(-1))
                bucket.tensor = bucket.flat
            bucket.work = self._all_reduce_sum(bucket.tensor, async_op=self.strategy == "overlapped")

    def _all_reduce_sum(self, tensor: torch.Tensor, async_op: bool) -> Any:
        """Sum ``tensor`` over the group in place; return a handle to wait on, or None if done."""
        if self.comm == "ring":   # synchronous; each rank sends 2(N-1)/N * tensor.nbytes
            fast_ring_all_reduce(tensor, op=ReduceOp.SUM, group=self.group)
            return None
        # the backend picks its own algorithm; a ring-like one also sends ~2(N-1)/N * tensor.nbytes
        return dist.all_reduce(tensor, op=ReduceOp.SUM, group=self.group, async_op=async_op)

    def _finish_backward(self) -> None:
        """Engine callback, after the last gradient and before ``backward()`` returns."""
        try:
            missing = [self._names[i] for i, ready in enumerate(self._ready) if not ready]
            if missing and not self.find_unused_parameters:
                for bucket in self._buckets[: self._next]:   # keep the ranks' collectives matched
                    if bucket.work is not None:
                        bucket.work.wait()
                raise RuntimeError(
                    f"DistributedDataParallel: parameter(s) {missing} received no gradient in this "
                    "backward, so their buckets could never be all-reduced. Use them in forward, freeze "
                    "them with requires_grad_(False) before wrapping, or pass "
                    "find_unused_parameters=True (their contribution is then taken as zero, at the cost "
                    "of one extra small all-reduce per step).")
            for bucket in self._buckets[self._next:]:       # per_parameter and bucketed: all of them
                self._launch(bucket)
            self._next = len(self._buckets)
            used = self._globally_used() if self.find_unused_parameters else None
            for bucket in self._buckets:
                self._complete(bucket, used)
        finally:
            self._used = [False] * len(self._names)
            self._reset()

    def _globally_used(self) -> list[bool]:
        # sends 2(N-1)/N * 4P bytes: the price of find_unused_parameters
        counts = torch.tensor(self._used, dtype=torch.int32)   # (P,)
        self._all_reduce_sum(counts, async_op=False)
        return [c > 0 for c in counts.tolist()]

    def _complete(self, bucket: Bucket, used: list[bool] | None) -> None:
        if bucket.work is not None:
            bucket.work.wait()
        with torch.no_grad():
            bucket.tensor.div_(self.world_size)        # sum -> mean; the same bits on every rank
            for i, p, (lo, hi) in zip(bucket.param_ids, bucket.params, bucket.spans):
                if used is not None and not used[i]:
                    continue                           # unused on every rank: leave .grad as it was
                mean = bucket.tensor.view(-1)[lo:hi].view(p.shape)
                if p.grad is None:
                    p.grad = mean.clone()
                elif p.grad.data_ptr() != mean.data_ptr():
                    p.grad.copy_(mean)

    def _reset(self) -> None:
        self._ready = [False] * len(self._names)
        self._next = 0                                 # index of the next bucket to launch
        self._callback_queued = False
        for bucket in self._buckets:
            bucket.pending, bucket.tensor, bucket.work = len(bucket.params), None, None


# ---------------------------------------------------------------------- #
# Checks and setup at construction
# ---------------------------------------------------------------------- #
def _check_arguments(module: nn.Module, strategy: str, bucket_cap_mb: float, comm: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError("DistributedDataParallel needs a process group: build it inside a function run "
                           "by dtcourse.launch(fn, N), or call dtcourse.init_from_env() first under torchrun.")
    if isinstance(module, (DistributedDataParallel, nn.parallel.DistributedDataParallel)) \
            or getattr(module, _MARK, False):
        raise ValueError("DistributedDataParallel: this module is already wrapped, and wrapping it again "
                         "would all-reduce every gradient twice. Wrap the plain model once "
                         "(DistributedDataParallel(model)) and keep using that wrapper.")
    if strategy not in STRATEGIES:
        raise ValueError(f"DistributedDataParallel: strategy must be one of {STRATEGIES}, got {strategy!r}.")
    if comm not in COMMS:
        raise ValueError(f"DistributedDataParallel: comm must be one of {COMMS}, got {comm!r}.")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ValueError(f"DistributedDataParallel: bucket_cap_mb must be a positive number of MiB, got "
                         f"{bucket_cap_mb!r}. Use 25 (torch's default), or a small value such as 0.01 "
                         "to get many buckets.")
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError("DistributedDataParallel: the module has no parameter that requires a gradient, "
                         "so there is nothing to average. Unfreeze some parameters or skip the wrapper.")


def _check_same_model(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Every rank must hold the same parameters and buffers: names, shapes, dtypes, frozen or not."""
    mine = ([("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad)
             for n, p in module.named_parameters()]
            + [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in module.named_buffers()])
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)   # a few dozen bytes per tensor, from each rank

    def show(entry: tuple | None) -> str:
        return "nothing" if entry is None else \
            f"{entry[0]} {entry[1]!r} (shape {entry[2]}, {entry[3]}, requires_grad={entry[4]})"

    for rank, theirs in enumerate(everyone):
        for a, b in itertools.zip_longest(everyone[0], theirs):
            if a != b:
                raise ValueError(f"DistributedDataParallel: rank 0 has {show(a)} where rank {rank} has "
                                 f"{show(b)}. Every rank must build the same model (same sizes and config) "
                                 "and freeze the same parameters before wrapping.")


def _broadcast_from_rank0(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Start every replica from group rank 0's parameters and buffers."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.detach(), group_src=0, group=group)   # every other rank receives t.nbytes
