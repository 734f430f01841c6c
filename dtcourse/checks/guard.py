"""What a check watches and forbids while a student's code runs in a rank.

``watching`` wraps the student's call::

    with watching({"collectives": "01"}, p2p_only=True) as watch:
        student_fn(tensor)
    watch.sent        # [(peer, nbytes), ...]: every message this rank sent, in order

Inside the block:

* the course's reference answers for the listed topics refuse calls from the student's code
  (``dtcourse.runtime.refuse``); topic ``checkpointing`` also switches off
  ``torch.utils.checkpoint`` (both of its forms);
* with ``p2p_only``, every collective of the process group raises when the student's code calls
  it. The guard sits on the ``ProcessGroup`` methods that ``torch.distributed``'s functions call,
  so a reference to ``dist.all_reduce`` saved before the check, or one taken through
  ``torch.distributed.distributed_c10d``, is caught as well;
* every point-to-point message (``send``/``recv`` on the process group, which ``isend``,
  ``irecv``, ``send``, ``recv`` and ``batch_isend_irecv`` all reach) and every collective is
  recorded, with its peer or name and its bytes, so a check can test who talks to whom and how
  much, not only the final numbers.

Everything is put back when the block ends, whatever happens in it.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

import torch
from torch._C._distributed_c10d import ProcessGroup

from dtcourse.runtime.refuse import refuse_if_student, refusing

__all__ = ["Watch", "watching", "COLLECTIVE_METHODS"]

COLLECTIVE_METHODS = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base",
                      "allgather_into_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base",
                      "reduce_scatter_tensor_coalesced", "broadcast", "reduce", "alltoall", "alltoall_base",
                      "scatter", "gather", "barrier")


@dataclass
class Watch:
    """What the student's code did on this rank's process group inside ``watching``."""

    sent: list[tuple[int, int]] = field(default_factory=list)       # (group rank of the peer, bytes)
    received: list[tuple[int, int]] = field(default_factory=list)
    collectives: list[tuple[str, int]] = field(default_factory=list)  # (ProcessGroup method, bytes)

    @property
    def bytes_sent(self) -> int:
        return sum(nbytes for _, nbytes in self.sent)


def _nbytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.nbytes
    if isinstance(tensors, (list, tuple)):
        return sum(_nbytes(t) for t in tensors)
    return 0


@contextmanager
def _patched(cls: type, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """Replace ``cls.name`` by ``make(original)``; the original descriptor comes back afterwards."""
    raw = cls.__dict__[name]
    setattr(cls, name, make(lambda self, *args, **kwargs: raw.__get__(self, cls)(*args, **kwargs)))
    try:
        yield
    finally:
        setattr(cls, name, raw)


def _collective(name: str, original: Callable, watch: Watch, p2p_only: bool) -> Callable:
    def call(self, *args, **kwargs):
        if p2p_only:
            refuse_if_student("p2p-only", name, why=(
                f"your code called a collective ({name} on the process group, which torch.distributed's "
                "collectives call); build it from point-to-point messages only (isend/irecv, send/recv or "
                "batch_isend_irecv)"))
        watch.collectives.append((name, _nbytes(args[:2])))
        return original(self, *args, **kwargs)
    return call


def _point_to_point(log: list, original: Callable) -> Callable:
    def call(self, tensors, peer, *args, **kwargs):
        log.append((int(peer), _nbytes(tensors)))
        return original(self, tensors, peer, *args, **kwargs)
    return call


@contextmanager
def _no_torch_checkpoint(exercise: str) -> Iterator[None]:
    """``torch.utils.checkpoint.checkpoint`` looks these two up at each call: guard them, not the name."""
    import torch.utils.checkpoint as tc

    why = (f"torch.utils.checkpoint is switched off while exercise {exercise}'s checks run: the exercise asks "
           "you to write the checkpointing yourself")

    class Refused(tc.CheckpointFunction):
        @staticmethod
        def forward(ctx, *args):
            refuse_if_student("checkpointing", "torch.utils.checkpoint", why)
            return tc.CheckpointFunction.forward(ctx, *args)

    generator = tc._checkpoint_without_reentrant_generator

    def refused_generator(*args, **kwargs):
        refuse_if_student("checkpointing", "torch.utils.checkpoint", why)
        return generator(*args, **kwargs)

    saved = tc.CheckpointFunction
    tc.CheckpointFunction, tc._checkpoint_without_reentrant_generator = Refused, refused_generator
    try:
        yield
    finally:
        tc.CheckpointFunction, tc._checkpoint_without_reentrant_generator = saved, generator


@contextmanager
def watching(topics: Mapping[str, str], p2p_only: bool = False) -> Iterator[Watch]:
    """Refuse the references of ``topics`` (topic -> exercise), and record the process group's traffic."""
    watch = Watch()
    exercise = next(iter(topics.values()), "")
    with ExitStack() as stack:
        # the frame that entered `with watching(...)` is where the check's own frames end
        stack.enter_context(refusing({**topics, **({"p2p-only": exercise} if p2p_only else {})},
                                     boundary=sys._getframe(2)))
        if "checkpointing" in topics:
            stack.enter_context(_no_torch_checkpoint(topics["checkpointing"]))
        for name in COLLECTIVE_METHODS:
            if name in ProcessGroup.__dict__:
                stack.enter_context(_patched(ProcessGroup, name,
                                             lambda original, n=name: _collective(n, original, watch, p2p_only)))
        stack.enter_context(_patched(ProcessGroup, "send", lambda original: _point_to_point(watch.sent, original)))
        stack.enter_context(_patched(ProcessGroup, "recv",
                                     lambda original: _point_to_point(watch.received, original)))
        yield watch
