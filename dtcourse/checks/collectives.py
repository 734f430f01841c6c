"""Checks for exercise 01 (ring collectives): a student's function against torch.distributed, and its traffic.

Each check runs the student's function on every world size it is given (``dtcourse.launch``)
next to PyTorch's own collective on the same inputs, and reports the first case that breaks one
of three rules, with the world size, the case, the rank, what was expected and what was seen:

1. **The numbers** match PyTorch's (bit for bit where nothing is added; within a rounding bound
   where sums are reordered).
2. **The traffic is a ring's**, as ``dtcourse.checks.guard.watching`` records it: each rank sends
   only to rank + 1 and receives only from rank - 1 (mod N). For a big tensor of S bytes, a
   reduce-scatter or all-gather sends N-1 messages of one chunk (S/N), (N-1)/N·S in all; an
   all-reduce sends at most 2(N-1) messages of at most ceil(numel/N) elements (padding allowed),
   and the ranks together at least 2(N-1)·S, what an unpadded ring sends; a ring step sends one
   message, the whole tensor. A zero-byte message carries nothing and is not counted: a ring over
   fewer elements than ranks may send its empty chunks or skip them.
3. **One answer everywhere**: after an all-reduce or all-gather every rank holds rank 0's bits.

The student's code may send only point-to-point messages (every collective of the process group
raises), and the course's own answers in ``dtcourse.collectives`` refuse to run, or to be passed
to a check. A raised error is reported as the student's, a deadlock as a failure::

    from dtcourse.checks import check_all_reduce
    check_all_reduce(ring_all_reduce, world_sizes=(2, 3), sizes=(1, 7, (3, 5)))

``timeout=None`` means ``$DTCOURSE_CHECK_TIMEOUT`` seconds (20 if unset) per world size.
"""

from __future__ import annotations

import warnings
from collections import Counter
from functools import partial
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from dtcourse.checks.common import _as_student, _launch_check, _refuse_library_code, _stop_at_first_failure
from dtcourse.checks.guard import Answers, Watch, watching

__all__ = ["check_ring_exchange", "check_reduce_scatter", "check_all_gather", "check_all_reduce", "FLOATS"]

Size = int | tuple[int, ...]
FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# What these checks switch off while the student's code runs (guard.watching), and refuse to be given
ANSWERS = Answers("01", course=tuple(f"dtcourse.collectives.{name}" for name in (
    "ring.reduce_scatter_steps", "ring.all_gather_steps", "ring.ring_reduce_scatter", "ring.ring_all_gather",
    "ring.ring_all_reduce", "pipelined.all_gather_receives", "pipelined.pipelined_reduce_scatter_steps",
    "pipelined.pipelined_all_gather_steps", "fast_ring.fast_reduce_scatter_steps", "fast_ring.fast_all_gather_steps",
    "fast_ring.fast_ring_reduce_scatter", "fast_ring.fast_ring_all_gather", "fast_ring.fast_ring_all_reduce",
    "blocks.blocked_all_reduce", "naive.naive_all_reduce", "tree.tree_all_reduce")))
_NAMES = {"ring_exchange": "ring step", "reduce_scatter": "ring reduce-scatter", "all_gather": "ring all-gather",
          "all_reduce": "ring all-reduce"}
# Each float's integer of the same width (to compare bits) and its quiet NaN, whose low bits the
# check sets to rank + 1, so that a rank's unwritten output is told apart by its bits.
_BITS = {torch.float16: (torch.int16, 0x7E00), torch.bfloat16: (torch.int16, 0x7FC0),
         torch.float32: (torch.int32, 0x7FC00000), torch.float64: (torch.int64, 0x7FF8000000000000)}
_DEADLOCK_HINT = (
    "This is most likely a deadlock: a rank waits in recv() or wait() for a message its "
    "neighbour never sends. Post each step's send and receive together (dist.isend + "
    "dist.irecv, or dist.batch_isend_irecv) before waiting on either, and make every rank "
    "run the same number of steps. Raise timeout= only if your code is merely slow.")


def check_ring_exchange(fn: Callable, world_sizes: Sequence[int] = (2, 3), sizes: Sequence[Size] = (1, 4),
                        dtypes: Sequence[torch.dtype] = (torch.float32,), timeout: float | None = None) -> None:
    """``fn(send, recv)`` must send ``send`` to rank + 1, in one message, and fill ``recv`` from rank - 1 (mod N)."""
    _run("ring_exchange", fn, world_sizes, sizes, dtypes, timeout)


def check_reduce_scatter(fn: Callable, world_sizes: Sequence[int] = (2, 4), sizes: Sequence[Size] = (1, 3),
                         dtypes: Sequence[torch.dtype] = (torch.float32,), timeout: float | None = None) -> None:
    """``fn(output, input)`` must match ``dist.reduce_scatter_tensor`` (sum), sending as a ring does.

    ``sizes`` are the shapes of ``output``; ``input`` is ``world_size`` of them, concatenated on dim 0.
    """
    _run("reduce_scatter", fn, world_sizes, sizes, dtypes, timeout)


def check_all_gather(fn: Callable, world_sizes: Sequence[int] = (2, 4), sizes: Sequence[Size] = (1, 3),
                     dtypes: Sequence[torch.dtype] = (torch.float32,), timeout: float | None = None) -> None:
    """``fn(output, input)`` must match ``dist.all_gather_into_tensor`` exactly, sending as a ring does.

    ``sizes`` are the shapes of ``input``; ``output`` is ``world_size`` of them, concatenated on dim 0.
    """
    _run("all_gather", fn, world_sizes, sizes, dtypes, timeout)


def check_all_reduce(fn: Callable, world_sizes: Sequence[int] = (2, 4), sizes: Sequence[Size] = (1, 6),
                     dtypes: Sequence[torch.dtype] = (torch.float32,), timeout: float | None = None) -> None:
    """``fn(tensor)`` must sum ``tensor`` over the ranks in place, as ``dist.all_reduce`` does, as a ring.

    ``sizes`` are the shapes of ``tensor``: any, including fewer elements than ranks.
    """
    _run("all_reduce", fn, world_sizes, sizes, dtypes, timeout)


# --------------------------------------------------------------------------- #
# In the notebook's process
# --------------------------------------------------------------------------- #
def _run(kind: str, fn: Callable, world_sizes: Sequence[int], sizes: Sequence[Size],
         dtypes: Sequence[torch.dtype], timeout: float | None) -> None:
    """One launch per world size runs every case; the first that goes wrong raises AssertionError."""
    if not callable(fn):
        raise TypeError(f"check_{kind}: pass your function itself, e.g. check_{kind}(my_fn), "
                        f"not {type(fn).__name__}")
    _refuse_library_code(f"check_{kind}", fn, ANSWERS.exercise, "Write the function yourself (lesson 01 shows how "
                         "the ring works), from point-to-point messages, and pass that.")
    shapes = [(s,) if isinstance(s, int) else tuple(s) for s in sizes]
    if not shapes or any(not shape or min(shape) < 1 for shape in shapes):
        raise ValueError(f"check_{kind}: sizes must be positive ints or shapes, got {sizes!r}")
    if any(dtype not in FLOATS for dtype in dtypes):
        raise ValueError(f"check_{kind}: dtypes must be among {FLOATS}, got {dtypes!r}")
    cases = [(dtype, shape) for dtype in dtypes for shape in shapes]
    for world_size in world_sizes:
        _launch_check(getattr(fn, "__name__", "your function"), world_size, _rank_main,
                      (kind, fn, cases), timeout, where=f" at world size {world_size}", hint=_DEADLOCK_HINT)


# --------------------------------------------------------------------------- #
# Inside each rank
# --------------------------------------------------------------------------- #
def _rank_main(kind: str, fn: Callable, cases: list, progress: str) -> list:
    """Run every case on this rank; return [] or (case, message) for the first wrong case."""
    world_size = dist.get_world_size()
    runs = [(f"case {_describe(kind, dtype, shape, world_size)}",
             partial(_run_case, kind, fn, dtype, shape, index, progress))
            for index, (dtype, shape) in enumerate(cases)]
    return _stop_at_first_failure(runs, progress)


def _describe(kind: str, dtype: torch.dtype, shape: tuple, world_size: int) -> str:
    def size(dims: tuple) -> str:
        return "x".join(map(str, dims)) if len(dims) > 1 else f"{dims[0]} element" + "s" * (dims[0] != 1)
    one, whole = size(shape), size((world_size * shape[0], *shape[1:]))
    dtype_name = str(dtype).removeprefix("torch.")
    return {"reduce_scatter": f"({dtype_name}, input of {whole}, output of {one} per rank)",
            "all_gather": f"({dtype_name}, input of {one} per rank, output of {whole})",
            }.get(kind, f"({dtype_name}, tensor of {one})")


def _random(shape: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)


def _unwritten(shape: tuple, dtype: torch.dtype, rank: int) -> torch.Tensor:
    """An output that starts as NaN, so that an unwritten element cannot pass; its bits name this rank."""
    ints, quiet_nan = _BITS[dtype]
    return torch.full(shape, quiet_nan | (rank + 1), dtype=ints).view(dtype)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(_BITS[tensor.dtype][0])


def _reference(name: str, *args: torch.Tensor) -> None:
    """PyTorch's collective; newer names first, deprecation warnings silenced (stderr fails nbgrader)."""
    newer = {"reduce_scatter_tensor": "reduce_scatter_single", "all_gather_into_tensor": "all_gather_single"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (getattr(dist, newer.get(name, name), None) or getattr(dist, name))(*args)


def _run_case(kind: str, fn: Callable, dtype: torch.dtype, shape: tuple, index: int, progress: str) -> str | None:
    rank, n = dist.get_rank(), dist.get_world_size()
    big = (n * shape[0], *shape[1:])
    x = _random(big if kind == "reduce_scatter" else shape, dtype, seed=1000 * index + rank)
    # Sums over N ranks in two different orders (PyTorch's and the student's) may
    # differ: each rounds N-1 times, by at most eps/2 of a partial sum that is no
    # larger than sum_r |x_r|. So |got - expected| <= (N-1) * eps * sum_r |x_r|;
    # allow N * eps for the second-order terms. Moving data (all-gather, the
    # exchange) does no arithmetic, so there the results must be equal, bit for bit.
    tolerance = torch.zeros(())
    if kind == "ring_exchange":
        expected = _random(shape, dtype, seed=1000 * index + (rank - 1) % n)
        got = _unwritten(shape, dtype, rank)
        args, whole = (x, got), x.nbytes
    elif kind == "reduce_scatter":
        expected, tolerance = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=torch.float64)
        _reference("reduce_scatter_tensor", expected, x.clone())
        _reference("reduce_scatter_tensor", tolerance, x.abs().double())
        tolerance *= n * torch.finfo(dtype).eps
        got = _unwritten(shape, dtype, rank)
        args, whole = (got, x), x.nbytes
    elif kind == "all_gather":
        expected, got = torch.empty(big, dtype=dtype), _unwritten(big, dtype, rank)
        _reference("all_gather_into_tensor", expected, x.clone())
        args, whole = (got, x), got.nbytes
    else:  # all_reduce, in place
        expected, tolerance = x.clone(), x.abs().double()
        _reference("all_reduce", expected)
        _reference("all_reduce", tolerance)
        tolerance *= n * torch.finfo(dtype).eps
        got = x.clone()
        args, whole = (got,), x.nbytes
    original, before, version = x.clone(), got.clone(), got._version
    with watching(ANSWERS, p2p_only=True) as watch:
        returned = _as_student(progress, lambda: fn(*args))

    if kind != "all_reduce" and not torch.equal(x, original):
        problem = "changed its input tensor; a collective must leave its input as it was (work on a copy)"
    else:
        problem = _compare(got, expected, tolerance, before, version, returned, kind == "all_reduce")
    problem = problem or _traffic_problem(kind, watch, whole, expected.numel(), dtype.itemsize, rank, n)
    # Outside the watch, and on every rank whatever it found: each rank's bytes sent, whether it
    # found nothing wrong, and its result's bits (zeros if the student changed its shape).
    same_shape = got.shape == expected.shape and got.dtype == expected.dtype
    bits = _bits(got).reshape(-1).long() if same_shape else torch.zeros(expected.numel(), dtype=torch.long)
    mine = torch.cat([torch.tensor([sum(b for _, b in watch.sent), problem is None]), bits])
    rows = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(rows, mine)                        # sends (2 + numel) * 8 bytes per rank
    if problem or not all(row[1] for row in rows):     # report the first kind of problem alone
        return problem
    if kind == "all_reduce":
        together = sum(int(row[0]) for row in rows)
        if together < 2 * (n - 1) * whole:
            return (f"the {n} ranks sent {together} bytes together; a ring all-reduce moves every element N-1 "
                    f"hops in its reduce-scatter and N-1 in its all-gather, at least 2(N-1)·S = "
                    f"{2 * (n - 1) * whole} bytes for a tensor of S = {whole} bytes")
    if kind in ("all_reduce", "all_gather"):
        return _differs_from_rank_0(got, rows, rank)
    return None


def _compare(got: torch.Tensor, expected: torch.Tensor, tolerance: torch.Tensor, before: torch.Tensor,
             version: int, returned: object, in_place: bool) -> str | None:
    """None if ``got`` matches, else where it first differs, by how much, and what the bits show.

    ``before`` and ``version`` are ``got``'s bits and version counter before the call. Every in-place
    op on it or a view moves the counter, a received message does not: "never written" needs both.
    """
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return (f"the output became {tuple(got.shape)} {got.dtype} during the call; it must stay "
                f"{tuple(expected.shape)} {expected.dtype}: write into it in place")
    bad = ~((got.double() - expected.double()).abs() <= tolerance)  # NaN counts as bad
    if not bad.any():
        return None
    flat = int(bad.reshape(-1).nonzero()[0])
    want, have = expected.reshape(-1)[flat].item(), got.reshape(-1)[flat].item()
    message = f"index {_index(flat, got.shape)}: expected {want:.6g}, got {have:.6g}"
    if tolerance.any():
        message += f" (tolerance {tolerance.reshape(-1)[flat].item():.2g})"
    message += f"; {int(bad.sum())} of {got.numel()} elements wrong"
    kept = _bits(got) == _bits(before)                  # still the bits the check put there
    untouched = got._version == version and bool(kept.all())
    nan, filled = got.isnan(), got.isnan() & kept       # the all-reduce's input holds no NaN: filled is empty
    if in_place and untouched:
        message += (". The tensor did not change at all: nothing wrote into it. Sum into it in place (e.g. "
                    "tensor.copy_(total)); assigning to the name inside your function (tensor = ...) leaves the "
                    "caller's tensor as it was")
    elif in_place and kept.all():
        message += ". Your code wrote into the tensor, but it still holds exactly this rank's input"
    elif untouched:
        hint = " and you returned a tensor instead" if isinstance(returned, torch.Tensor) else ""
        message += (f". The output was never written: it still holds the NaN it was filled with{hint}. Write the "
                    "result into it in place, e.g. output.copy_(result)")
    elif filled.all():
        message += (". Your code wrote into the output, but every element still holds, bit for bit, the NaN it "
                    "was filled with before the call: adding or multiplying into a NaN leaves it NaN. Overwrite "
                    "the output (output.copy_(result)) rather than adding into it")
    elif filled.any():
        first = int(filled.reshape(-1).nonzero()[0])
        message += (f". {int(filled.sum())} elements (the first at index {_index(first, got.shape)}) still hold the "
                    "NaN the output was filled with: nothing overwrote them (adding into a NaN leaves it NaN)")
    if (nan & ~kept).any():
        message += (f"{'; ' if filled.any() else '. '}{int((nan & ~kept).sum())} elements are NaN that the check "
                    "did not put there: your code computed or received them")
    return message


def _index(flat: int, shape: torch.Size) -> int | tuple[int, ...]:
    return flat if len(shape) == 1 else tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape))


def _traffic_problem(kind: str, watch: Watch, whole: int, numel: int, itemsize: int, rank: int,
                     n: int) -> str | None:
    """None if this rank's messages are a ring's, else the first rule they break.

    ``whole`` is S, the bytes of the big tensor (of the tensor sent, for a ring step); ``numel`` the
    result's elements. Messages of zero bytes are left out."""
    right, left, name = (rank + 1) % n, (rank - 1) % n, _NAMES[kind]
    if watch.collectives:
        called = ", ".join(sorted({method for method, _ in watch.collectives}))
        return (f"ran a collective ({called} on the process group); a {name} is built from point-to-point "
                "messages only")
    sent = [(peer, nbytes) for peer, nbytes in watch.sent if nbytes]
    received = [(peer, nbytes) for peer, nbytes in watch.received if nbytes]
    for peer, count in Counter(peer for peer, _ in sent if peer != right).items():
        return (f"sent {_count(count, 'message')} to rank {peer}; in a ring each rank sends only to its right "
                f"neighbour, here rank {right}")
    for peer, count in Counter(peer for peer, _ in received if peer != left).items():
        return (f"received {_count(count, 'message')} from rank {peer}; in a ring each rank receives only from "
                f"its left neighbour, here rank {left}")
    total = sum(nbytes for _, nbytes in sent)
    if kind == "ring_exchange":
        return None if (len(sent), total) == (1, whole) else (
            f"sent {_count(len(sent), 'message')} ({total} bytes in all); one ring step sends one message, the "
            f"whole send tensor ({whole} bytes), to rank {right}")
    if kind in ("reduce_scatter", "all_gather"):
        chunk = whole // n
        rule = (f"a {name} of S = {whole} bytes on N = {n} ranks sends N-1 = {_count(n - 1, 'message')} of one "
                f"chunk, S/N = {chunk} bytes, each: (N-1)/N·S = {(n - 1) * chunk} bytes in all")
        if len(sent) != n - 1:
            return f"sent {_count(len(sent), 'message')} ({total} bytes in all); {rule}"
        for nbytes in {nbytes for _, nbytes in sent if nbytes != chunk}:
            return f"sent a message of {nbytes} bytes ({total} bytes in all); {rule}"
        return None
    k = -(-numel // n)                       # elements in the largest chunk, padded or not
    for nbytes in {nbytes for _, nbytes in sent if nbytes > k * itemsize}:
        return (f"sent a message of {nbytes} bytes; a ring all-reduce sends one chunk per message, at most "
                f"ceil(numel/N) = {_count(k, 'element')} = {k * itemsize} bytes here ({numel} elements on {n} ranks)")
    if len(sent) > 2 * (n - 1):
        return (f"sent {len(sent)} messages ({total} bytes in all); a ring all-reduce sends at most 2(N-1) = "
                f"{2 * (n - 1)}, one chunk in each of the N-1 steps of its reduce-scatter and N-1 of its all-gather")
    return None


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'s' * (number != 1)}"


def _differs_from_rank_0(got: torch.Tensor, rows: list[torch.Tensor], rank: int) -> str | None:
    """None if this rank's result has rank 0's bits, else the first index where it does not."""
    differ = rows[rank][2:] != rows[0][2:]
    if rank == 0 or not differ.any():
        return None
    flat = int(differ.nonzero()[0])
    theirs = rows[0][2 + flat:3 + flat].to(_BITS[got.dtype][0]).view(got.dtype).item()   # bits back to a float
    return (f"its result differs from rank 0's, bit for bit, at index {_index(flat, got.shape)}: "
            f"{got.reshape(-1)[flat].item()!r} here, {theirs!r} on rank 0. Every rank must end with the same "
            "bits: a ring works out each chunk once, on one rank, and then copies it unchanged to every rank")
