"""One observer of communication: what a process sends through its process groups, recorded where every
``torch.distributed`` call ends up, with a label that the caller sets.

The algorithms take no logging arguments. A lesson, a benchmark or a check that wants to see their
traffic wraps the run::

    with observe() as log:
        with label("blocks.0"):
            model(x).sum().backward()
    log.records[0]          # Record(op="allreduce", group_size=2, group_rank=0, peer=None, numel=..., nbytes=...,
                            #        start=..., end=..., label="blocks.0", backward=False)
    log.total("nbytes", op="allreduce", backward=True)

Where it sits: on the ``ProcessGroup`` methods that ``torch.distributed``'s functions call (``dist.all_reduce``
calls ``ProcessGroup.allreduce``; ``isend``, ``send`` and ``batch_isend_irecv`` call ``send``). So a function
saved under another name before the block, or one reached through ``distributed_c10d``, is seen too. A
record's ``nbytes`` is what the call was handed (for a collective, its input tensors; for ``send`` and
``recv``, the message), not what crosses a wire: how many bytes an algorithm moves for it is a formula
(``dtcourse.collectives.cost``). ``backward`` says whether autograd's backward pass made the call (a node,
or a callback it queued for its end, as DDP's last reduction).
``start`` is when the call was made, ``end`` when its work completed (``time.perf_counter``; ``None`` for
work not completed by the end of the block).

Labels nest (``label("blocks.0")`` inside ``label("forward")`` records ``"forward/blocks.0"``) and are
per thread. A call that a backward node makes (Megatron's ``f`` all-reduces in backward) carries the label under
which the forward created that node: the label block remembers the autograd sequence numbers its forward used,
which is how the backward of ``blocks.0`` is told from the backward of ``blocks.1`` without passing any name
to the layers. ``labelled(model, names)`` sets a label around each named module's forward with hooks.
Everything is put back when the block ends. Blocks may nest: each log sees every call.
"""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Iterator

import torch
from torch._C._distributed_c10d import ProcessGroup

__all__ = ["Record", "Records", "CommLog", "observe", "listening", "label", "labelled", "COLLECTIVE_METHODS",
           "POINT_TO_POINT_METHODS", "patched"]

COLLECTIVE_METHODS = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base",
                      "allgather_into_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base",
                      "reduce_scatter_tensor_coalesced", "broadcast", "reduce", "alltoall", "alltoall_base",
                      "scatter", "gather", "barrier",
                      # torch 2.13's own methods behind dist.all_gather_single / reduce_scatter_single / ...
                      "all_gather_single", "all_gather_single_coalesced", "reduce_scatter_single",
                      "reduce_scatter_single_coalesced", "all_to_all_single")
POINT_TO_POINT_METHODS = ("send", "recv")
_FAMILY = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "allgather": "all_gather",
           "allgather_coalesced": "all_gather", "_allgather_base": "all_gather",
           "allgather_into_tensor_coalesced": "all_gather", "all_gather_single": "all_gather",
           "all_gather_single_coalesced": "all_gather", "reduce_scatter": "reduce_scatter",
           "_reduce_scatter_base": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
           "reduce_scatter_single": "reduce_scatter", "reduce_scatter_single_coalesced": "reduce_scatter",
           "alltoall": "all_to_all", "alltoall_base": "all_to_all", "all_to_all_single": "all_to_all"}


@dataclass
class Record:
    """One call on a process group, as this rank made it."""

    op: str                 # the ProcessGroup method: "allreduce", "_allgather_base", "send", ...
    group_size: int
    group_rank: int
    peer: int | None        # send / recv: the group rank of the other side; collectives: None
    numel: int
    nbytes: int
    start: float
    end: float | None
    label: str
    backward: bool
    shape: tuple[int, ...] = ()                  # the first tensor handed to send (collectives: the input)
    dtype: torch.dtype | None = None             # ... and its dtype
    sent_to: tuple[int, ...] | None = None      # all-to-all: bytes to each group rank, itself included
    received_from: tuple[int, ...] | None = None  # all-to-all: bytes from each group rank
    ranks: tuple[int, ...] = ()                  # the group's members, as global ranks: which group it was

    @property
    def collective(self) -> str:
        """The ``torch.distributed`` family of the call: ``"all_reduce"``, ``"all_gather"`` (list or single
        tensor), ``"reduce_scatter"``, ``"all_to_all"``, ``"broadcast"``, ``"send"``, ... ."""
        return _FAMILY.get(self.op, self.op)


@dataclass
class Records:
    """Records in order, with sums by field: ``select(op="send")``, ``total("nbytes", backward=True)``. The lab's
    views of one technique's traffic (tensor parallelism's, expert parallelism's) are ``Records`` too."""

    records: list = field(default_factory=list)
    summed: ClassVar[str] = "nbytes"            # the field ``total`` sums when none is named

    def select(self, **match) -> list:
        """The records whose fields equal ``match`` (``op="send"``, ``backward=True``, ``label="blocks.0"``)."""
        return [r for r in self.records if all(getattr(r, k) == v for k, v in match.items())]

    def total(self, key: str | None = None, /, **match) -> int:
        """The sum of field ``key`` (``summed`` if None) over ``select(**match)``; positional, so that a record's
        own field may be matched by any name (an all-to-all's ``what``)."""
        return sum(getattr(r, key or self.summed) for r in self.select(**match))


@dataclass
class CommLog(Records):
    """The ``Record`` of every call of one ``observe`` block, in the order the calls were made."""


_LOGS: list[CommLog] = []                   # the open observe() blocks, innermost last
_LOCAL = threading.local()                  # .labels: this thread's label stack; .spans: its labels' node ranges


def _next_sequence_nr() -> int | None:
    """The sequence number autograd will give the next node this thread creates (None where no node can be made)."""
    try:
        with torch.enable_grad():
            return (torch.zeros((), requires_grad=True) * 1).grad_fn._sequence_nr() + 1
    except RuntimeError:                    # inference mode
        return None


@contextmanager
def label(name: str) -> Iterator[None]:
    """Calls made inside get ``name`` as their label (joined with ``/`` to the labels around it), and so do the
    calls that the backward of any autograd node created inside makes. A backward node created under no label
    takes the labels around the ``backward()`` call. A label entered during backward (in a hook) wins over the
    node's: it names what the hook does."""
    stack = getattr(_LOCAL, "labels", None)
    if stack is None:
        stack = _LOCAL.labels = []
        _LOCAL.spans, _LOCAL.in_backward = [], []
    stack.append(name)
    _LOCAL.in_backward.append(torch._C._current_graph_task_id() >= 0)
    span = None
    if _LOGS:                               # remember which nodes this label's forward creates
        start = _next_sequence_nr()
        if start is not None:
            span = [start, None, "/".join(stack)]
            _LOCAL.spans.append(span)
    try:
        yield
    finally:
        if span is not None:
            span[1] = _next_sequence_nr()
        stack.pop()
        _LOCAL.in_backward.pop()


def _current_label() -> str:
    node = torch._C._current_autograd_node()
    hooked = any(getattr(_LOCAL, "in_backward", ()))
    if node is not None and not hooked:     # a backward node: the label its forward was created under
        seq = node._sequence_nr()
        for start, end, name in reversed(getattr(_LOCAL, "spans", ())):   # the innermost span holding it
            if start <= seq and (end is None or seq < end):
                return name
    return "/".join(getattr(_LOCAL, "labels", ()))


@contextmanager
def labelled(model: torch.nn.Module, names: dict[str, str] | None = None) -> Iterator[None]:
    """Inside the block, each named submodule's forward (and so its backward) runs under ``label(name)``.

    ``names`` maps a submodule's qualified name (``"blocks.0"``) to its label (the name itself by default);
    without ``names``, every direct child is labelled by its name. Hooks, removed when the block ends.
    """
    modules = dict(model.named_modules())
    names = names or {name: name for name, _ in model.named_children()}
    open_: list = []
    hooks = []

    def enter(name, *_):
        cm = label(name)
        cm.__enter__()
        open_.append(cm)

    def leave(*_):
        if open_:
            open_.pop().__exit__(None, None, None)

    for qualified, name in names.items():
        if qualified not in modules:
            raise ValueError(f"labelled: the model has no submodule {qualified!r}; its submodules include "
                             f"{sorted(modules)[:8]}")
        hooks.append(modules[qualified].register_forward_pre_hook(lambda m, a, n=name: enter(n)))
        hooks.append(modules[qualified].register_forward_hook(lambda m, a, o: leave()))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        while open_:                        # a forward that raised left its label open
            open_.pop().__exit__(None, None, None)


def _tensors(args) -> list[torch.Tensor]:
    """The tensors of a call's arguments, nested lists included."""
    found = []
    for a in args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found += _tensors(a)
    return found


def _input_tensors(name: str, args) -> list[torch.Tensor]:
    """What the call was handed to send: the input side where a method takes (output, input)."""
    if name in ("_allgather_base", "_reduce_scatter_base", "all_gather_single", "reduce_scatter_single",
                "all_to_all_single", "alltoall_base"):
        return _tensors(args[1:2])          # (output, input, ...)
    if name in ("allgather", "reduce_scatter", "alltoall", "allgather_coalesced", "gather",
                "allgather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced",
                "all_gather_single_coalesced", "reduce_scatter_single_coalesced"):
        return _tensors(args[1:2])          # (outputs, inputs, ...)
    return _tensors(args[:1])               # allreduce, broadcast, reduce, scatter, send, recv: the tensors


def _row_splits(splits, tensor: torch.Tensor, n: int) -> tuple[int, ...]:
    """Bytes per rank of an all-to-all's ``tensor`` cut into ``splits`` rows (equal parts when empty)."""
    rows = tensor.shape[0] if tensor.dim() else 0
    row = tensor[0].nbytes if rows else 0
    return tuple(int(s) * row for s in splits) if len(splits) else (rows // n * row,) * n


def _members(group: ProcessGroup) -> tuple[int, ...]:
    """The global ranks of ``group`` (looked up once per group)."""
    found = _MEMBERS.get(id(group))
    if found is None or found[0] is not group:
        try:
            ranks = tuple(torch.distributed.get_process_group_ranks(group))
        except (RuntimeError, ValueError):                  # a group torch.distributed does not know of
            ranks = ()
        found = _MEMBERS[id(group)] = (group, ranks)
    return found[1]


_MEMBERS: dict[int, tuple[ProcessGroup, tuple[int, ...]]] = {}


def _observed(name: str, original: Callable) -> Callable:
    def call(self, *args, **kwargs):
        if not _LOGS:
            return original(self, *args, **kwargs)
        for note in list(_LISTENERS):       # a check's view of the call, before it runs (it may refuse it)
            note(name, self, args)
        tensors = _input_tensors(name, args)
        peer = int(args[1]) if name in POINT_TO_POINT_METHODS and len(args) > 1 else None
        record = Record(name, self.size(), self.rank(), peer, sum(t.numel() for t in tensors),
                        sum(t.nbytes for t in tensors), time.perf_counter(), None, _current_label(),
                        torch._C._current_graph_task_id() >= 0, tuple(tensors[0].shape) if tensors else (),
                        tensors[0].dtype if tensors else None, ranks=_members(self))
        if name in ("alltoall_base", "all_to_all_single") and len(args) >= 4:   # (out, in, out splits, in splits)
            record.sent_to = _row_splits(args[3], args[1], self.size())
            record.received_from = _row_splits(args[2], args[0], self.size())
        for log in _LOGS:
            log.records.append(record)
        work = original(self, *args, **kwargs)
        try:
            work.get_future().add_done_callback(lambda _: setattr(record, "end", time.perf_counter()))
        except (AttributeError, RuntimeError):      # a backend without futures: the call's return instead
            record.end = time.perf_counter()
        return work
    return call


@contextmanager
def patched(cls: type, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """Replace ``cls.name`` by ``make(original)``; the original descriptor comes back afterwards."""
    raw = cls.__dict__[name]
    setattr(cls, name, make(lambda self, *args, **kwargs: raw.__get__(self, cls)(*args, **kwargs)))
    try:
        yield
    finally:
        setattr(cls, name, raw)


_PATCH_LOCK = threading.Lock()
_LISTENERS: list[Callable[[str, ProcessGroup, tuple], None]] = []   # listening() blocks' callbacks
_PATCHES: list[ExitStack] = []              # the ProcessGroup patch, held while any observe() block is open


@contextmanager
def observe() -> Iterator[CommLog]:
    """Record every process-group call this process makes inside the block (see the module docstring)."""
    log = CommLog()
    with _PATCH_LOCK:
        if not _LOGS:
            stack = ExitStack()
            for name in COLLECTIVE_METHODS + POINT_TO_POINT_METHODS:
                if name in ProcessGroup.__dict__:
                    stack.enter_context(patched(ProcessGroup, name, lambda original, n=name: _observed(n, original)))
            _PATCHES.append(stack)
        _LOGS.append(log)
    try:
        yield log
    finally:
        with _PATCH_LOCK:
            _LOGS.remove(log)
            if not _LOGS:
                _PATCHES.pop().close()
                _LOCAL.spans = [span for span in getattr(_LOCAL, "spans", ()) if span[1] is None]


@contextmanager
def listening(note: Callable[[str, ProcessGroup, tuple], None]) -> Iterator[CommLog]:
    """``observe()``, and ``note(method, group, args)`` before each call runs: the exercise checks' view, which
    looks at the call's own arguments (the group it was made on, its splits) and may refuse it by raising."""
    with observe() as log:
        _LISTENERS.append(note)
        try:
            yield log
        finally:
            _LISTENERS.remove(note)
