"""Checks for the collective exercises: a student's function against torch.distributed.

Each check runs the student's function on every world size it is given, with
``dtcourse.launch``, and in the same ranks runs PyTorch's own collective on the
same inputs. On any difference it raises ``AssertionError`` that names the world
size, the case (dtype and size), the rank and the element, with the expected and
the actual value. A rank that raises is reported with the student's error, and
a deadlock becomes a failure after ``timeout`` seconds, never a hang.

Example::

    from dtcourse.checks import check_all_reduce
    check_all_reduce(ring_all_reduce, world_sizes=(2, 3), sizes=(1, 7, (3, 5)))

``timeout=None`` means ``$DTCOURSE_CHECK_TIMEOUT`` seconds (20 if unset), per
world size; the autograder sets it (``python -m dtcourse.grade --check-timeout``).
By default the student's function may use only point-to-point messages: while
it runs, the collectives in ``torch.distributed`` raise.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from functools import partial
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from dtcourse.checks.common import _as_student, _launch_check, _stop_at_first_failure

__all__ = ["check_ring_exchange", "check_reduce_scatter", "check_all_gather", "check_all_reduce", "FLOATS"]

Size = int | tuple[int, ...]
FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
                "all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast", "reduce",
                "all_to_all", "all_to_all_single", "scatter", "gather")
_DEADLOCK_HINT = (
    "This is most likely a deadlock: a rank waits in recv() or wait() for a message its "
    "neighbour never sends. Post each step's send and receive together (dist.isend + "
    "dist.irecv, or dist.batch_isend_irecv) before waiting on either, and make every rank "
    "run the same number of steps. Raise timeout= only if your code is merely slow.")


def check_ring_exchange(fn: Callable, world_sizes: Sequence[int] = (2, 3), sizes: Sequence[Size] = (1, 4),
                        dtypes: Sequence[torch.dtype] = (torch.float32,), timeout: float | None = None,
                        p2p_only: bool = True) -> None:
    """``fn(send, recv)`` must send ``send`` to rank + 1 and fill ``recv`` from rank - 1 (mod N)."""
    _run("ring_exchange", fn, world_sizes, sizes, dtypes, timeout, p2p_only)


def check_reduce_scatter(fn: Callable, world_sizes: Sequence[int] = (2, 4), sizes: Sequence[Size] = (1, 3),
                         dtypes: Sequence[torch.dtype] = (torch.float32,), timeout: float | None = None,
                         p2p_only: bool = True) -> None:
    """``fn(output, input)`` must match ``dist.reduce_scatter_tensor`` (sum).

    ``sizes`` are the shapes of ``output``; ``input`` is ``world_size`` of them
    concatenated along the first dimension.
    """
    _run("reduce_scatter", fn, world_sizes, sizes, dtypes, timeout, p2p_only)


def check_all_gather(fn: Callable, world_sizes: Sequence[int] = (2, 4), sizes: Sequence[Size] = (1, 3),
                     dtypes: Sequence[torch.dtype] = (torch.float32,), timeout: float | None = None,
                     p2p_only: bool = True) -> None:
    """``fn(output, input)`` must match ``dist.all_gather_into_tensor`` exactly.

    ``sizes`` are the shapes of ``input``; ``output`` is ``world_size`` of them
    concatenated along the first dimension.
    """
    _run("all_gather", fn, world_sizes, sizes, dtypes, timeout, p2p_only)


def check_all_reduce(fn: Callable, world_sizes: Sequence[int] = (2, 4), sizes: Sequence[Size] = (1, 6),
                     dtypes: Sequence[torch.dtype] = (torch.float32,), timeout: float | None = None,
                     p2p_only: bool = True) -> None:
    """``fn(tensor)`` must sum ``tensor`` over the ranks in place, as ``dist.all_reduce`` does.

    ``sizes`` are the shapes of ``tensor``: any, including fewer elements than ranks.
    """
    _run("all_reduce", fn, world_sizes, sizes, dtypes, timeout, p2p_only)


# --------------------------------------------------------------------------- #
# In the notebook's process
# --------------------------------------------------------------------------- #
def _run(kind: str, fn: Callable, world_sizes: Sequence[int], sizes: Sequence[Size],
         dtypes: Sequence[torch.dtype], timeout: float | None, p2p_only: bool) -> None:
    """One launch per world size runs every case; the first that goes wrong raises AssertionError."""
    if not callable(fn):
        raise TypeError(f"check_{kind}: pass your function itself, e.g. check_{kind}(my_fn), "
                        f"not {type(fn).__name__}")
    shapes = [(s,) if isinstance(s, int) else tuple(s) for s in sizes]
    if not shapes or any(not shape or min(shape) < 1 for shape in shapes):
        raise ValueError(f"check_{kind}: sizes must be positive ints or shapes, got {sizes!r}")
    if any(dtype not in FLOATS for dtype in dtypes):
        raise ValueError(f"check_{kind}: dtypes must be among {FLOATS}, got {dtypes!r}")
    cases = [(dtype, shape) for dtype in dtypes for shape in shapes]
    for world_size in world_sizes:
        _launch_check(getattr(fn, "__name__", "your function"), world_size, _rank_main,
                      (kind, fn, cases, p2p_only), timeout, where=f" at world size {world_size}",
                      hint=_DEADLOCK_HINT)


# --------------------------------------------------------------------------- #
# Inside each rank
# --------------------------------------------------------------------------- #
def _rank_main(kind: str, fn: Callable, cases: list, p2p_only: bool, progress: str) -> list:
    """Run every case on this rank; return [] or (case, message) for the first wrong case."""
    world_size = dist.get_world_size()
    runs = [(f"case {_describe(kind, dtype, shape, world_size)}",
             partial(_run_case, kind, fn, dtype, shape, index, progress, p2p_only))
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


def _reference(name: str, *args: torch.Tensor) -> None:
    """PyTorch's collective; newer names first, deprecation warnings silenced (stderr fails nbgrader)."""
    newer = {"reduce_scatter_tensor": "reduce_scatter_single", "all_gather_into_tensor": "all_gather_single"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (getattr(dist, newer.get(name, name), None) or getattr(dist, name))(*args)


def _run_case(kind: str, fn: Callable, dtype: torch.dtype, shape: tuple, index: int, progress: str,
              p2p_only: bool) -> str | None:
    rank, n = dist.get_rank(), dist.get_world_size()
    big = (n * shape[0], *shape[1:])
    nan = float("nan")  # outputs start as NaN, so an unwritten element cannot pass
    x = _random(big if kind == "reduce_scatter" else shape, dtype, seed=1000 * index + rank)
    # Sums over N ranks in two different orders (PyTorch's and the student's) may
    # differ: each rounds N-1 times, by at most eps/2 of a partial sum that is no
    # larger than sum_r |x_r|. So |got - expected| <= (N-1) * eps * sum_r |x_r|;
    # allow N * eps for the second-order terms. Moving data (all-gather, the
    # exchange) does no arithmetic, so there the results must be equal, bit for bit.
    tolerance = torch.zeros(())
    if kind == "ring_exchange":
        expected = _random(shape, dtype, seed=1000 * index + (rank - 1) % n)
        got = torch.full(shape, nan, dtype=dtype)
        args = (x, got)
    elif kind == "reduce_scatter":
        expected, tolerance = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=torch.float64)
        _reference("reduce_scatter_tensor", expected, x.clone())
        _reference("reduce_scatter_tensor", tolerance, x.abs().double())
        tolerance *= n * torch.finfo(dtype).eps
        got = torch.full(shape, nan, dtype=dtype)
        args = (got, x)
    elif kind == "all_gather":
        expected, got = torch.empty(big, dtype=dtype), torch.full(big, nan, dtype=dtype)
        _reference("all_gather_into_tensor", expected, x.clone())
        args = (got, x)
    else:  # all_reduce, in place
        expected, tolerance = x.clone(), x.abs().double()
        _reference("all_reduce", expected)
        _reference("all_reduce", tolerance)
        tolerance *= n * torch.finfo(dtype).eps
        got = x.clone()
        args = (got,)
    original = x.clone()
    with _point_to_point_only(getattr(fn, "__name__", "your function"), p2p_only):
        returned = _as_student(progress, lambda: fn(*args))
    if kind != "all_reduce" and not torch.equal(x, original):
        return "changed its input tensor; a collective must leave its input as it was (work on a copy)"
    problem = _compare(got, expected, tolerance, returned)
    if problem and kind == "all_reduce" and n > 1 and torch.equal(got, original):
        problem += (". The tensor did not change at all: sum into it in place (e.g. tensor.copy_(total)); "
                    "assigning a new tensor to the name inside your function changes nothing outside")
    return problem


def _compare(got: torch.Tensor, expected: torch.Tensor, tolerance: torch.Tensor,
             returned: object) -> str | None:
    """None if ``got`` matches, else where it first differs and by how much."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return (f"the output became {tuple(got.shape)} {got.dtype} during the call; it must stay "
                f"{tuple(expected.shape)} {expected.dtype}: write into it in place")
    bad = ~((got.double() - expected.double()).abs() <= tolerance)  # NaN counts as bad
    if not bad.any():
        return None
    flat = int(bad.reshape(-1).nonzero()[0])
    index = flat if got.dim() == 1 else tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), got.shape))
    want, have = expected.reshape(-1)[flat].item(), got.reshape(-1)[flat].item()
    message = f"index {index}: expected {want:.6g}, got {have:.6g}"
    if tolerance.any():
        message += f" (tolerance {tolerance.reshape(-1)[flat].item():.2g})"
    message += f"; {int(bad.sum())} of {got.numel()} elements wrong"
    if got.isnan().all():
        hint = " and you returned a tensor instead" if isinstance(returned, torch.Tensor) else ""
        message += (f". The output still holds the NaN it was filled with{hint}: write the result into "
                    "it in place, e.g. output.copy_(result)")
    elif got.isnan().any():
        message += ". Some outputs were never written (they still hold NaN) or you added into them"
    return message


@contextmanager
def _point_to_point_only(name: str, enabled: bool) -> Iterator[None]:
    """While the student's function runs in this rank, make every collective raise."""
    saved = {attr: getattr(dist, attr) for attr in _COLLECTIVES if enabled and hasattr(dist, attr)}

    def forbidden(attr: str) -> Callable:
        def call(*args, **kwargs):
            raise AssertionError(f"{name} called torch.distributed.{attr}; build it from point-to-point "
                                 "messages only (isend/irecv, send/recv or batch_isend_irecv)")
        return call

    for attr in saved:
        setattr(dist, attr, forbidden(attr))
    try:
        yield
    finally:
        for attr, value in saved.items():
            setattr(dist, attr, value)
