"""What a check watches and forbids while a student's code runs in a rank.

``watching`` wraps the student's call::

    with watching({"collectives": "01"}, p2p_only=True) as watch:
        student_fn(tensor)
    watch.sent        # [(peer, nbytes), ...]: every message this rank sent, in order

Inside the block:

* the course's reference answers for the listed topics refuse calls from the student's code
  (``dtcourse.runtime.refuse``), and so does PyTorch's own answer where it has one
  (``_library_answers``): ``torch.utils.checkpoint`` in both forms, ``DistributedDataParallel``,
  ``torch.amp.GradScaler``;
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
from types import FunctionType
from typing import Callable, Iterator, Mapping

import torch
from torch._C._distributed_c10d import ProcessGroup

from dtcourse.runtime.observe import COLLECTIVE_METHODS, patched
from dtcourse.runtime.refuse import refuse_if_student, refusing

__all__ = ["Watch", "watching", "COLLECTIVE_METHODS"]

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


def _library_answers(topic: str, exercise: str) -> tuple[str, list[tuple[object, str]]]:
    """PyTorch's own answer to an exercise: why it is off, and the (owner, attribute) pairs to guard.

    Each pair is what the answer looks up at every call, so a name the student bound before the
    check is caught too (``torch.utils.checkpoint.checkpoint`` reaches ``CheckpointFunction.apply``
    or the non-reentrant generator through its module on each call).
    """
    if topic == "checkpointing":
        import torch.utils.checkpoint as tc
        return (f"torch.utils.checkpoint is switched off while exercise {exercise}'s checks run: the exercise "
                "asks you to write the checkpointing yourself",
                [(tc.CheckpointFunction, "apply")]     # torch 2.15 calls the generator's _impl directly
                + [(tc, name) for name in ("_checkpoint_without_reentrant_generator",
                                           "_checkpoint_without_reentrant_generator_impl") if hasattr(tc, name)])
    if topic == "data_parallel":
        return (f"torch.nn.parallel.DistributedDataParallel is switched off while exercise {exercise}'s checks "
                "run: the exercise asks you to write the bucketing and the overlap yourself",
                [(torch.nn.parallel.DistributedDataParallel, "__init__")])
    if topic == "mixed_precision":
        return (f"torch.amp.GradScaler is what your scaler is compared with, so it refuses to run for your code "
                f"while exercise {exercise}'s checks run: write step() and update() yourself",
                [(torch.amp.GradScaler, name) for name in ("__init__", "scale", "unscale_", "step", "update")]
                + [(torch, "_amp_update_scale_")])
    return "", []


@contextmanager
def _switched_off(owner: object, name: str, topic: str, why: str) -> Iterator[None]:
    """``owner.name`` refuses calls from the student's code (the check's own calls run as usual)."""
    missing = object()
    raw = vars(owner).get(name, missing)      # what to put back; missing if a class inherits it
    target = getattr(owner, name)
    what = f"{getattr(owner, '__name__', owner)}.{name}"

    def call(*args, **kwargs):
        refuse_if_student(topic, what, why)
        return target(*args, **kwargs)

    # a method defined on the class stays a method; a static, class or inherited one is already bound
    plain = not isinstance(owner, type) or isinstance(raw, FunctionType)
    setattr(owner, name, call if plain else staticmethod(call))
    try:
        yield
    finally:
        if raw is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, raw)


@contextmanager
def watching(topics: Mapping[str, str], p2p_only: bool = False) -> Iterator[Watch]:
    """Refuse the references of ``topics`` (topic -> exercise), and record the process group's traffic."""
    watch = Watch()
    exercise = next(iter(topics.values()), "")
    with ExitStack() as stack:
        # the frame that entered `with watching(...)` is where the check's own frames end
        stack.enter_context(refusing({**topics, **({"p2p-only": exercise} if p2p_only else {})},
                                     boundary=sys._getframe(2)))
        for topic, exercise_of_topic in topics.items():
            why, pairs = _library_answers(topic, exercise_of_topic)
            for owner, name in pairs:
                stack.enter_context(_switched_off(owner, name, topic, why))
        for name in COLLECTIVE_METHODS:
            if name in ProcessGroup.__dict__:
                stack.enter_context(patched(ProcessGroup, name,
                                            lambda original, n=name: _collective(n, original, watch, p2p_only)))
        stack.enter_context(patched(ProcessGroup, "send", lambda original: _point_to_point(watch.sent, original)))
        stack.enter_context(patched(ProcessGroup, "recv",
                                    lambda original: _point_to_point(watch.received, original)))
        yield watch
