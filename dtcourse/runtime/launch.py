"""Run one function as several ranks of an SPMD job, from a notebook or a script.

``launch(fn, world_size)`` forks ``world_size`` processes from the current one
(a Jupyter kernel, a pytest worker, a plain script). Each child joins a
``torch.distributed`` process group and calls ``fn``, so inside ``fn`` the usual
``dist.get_rank()``, ``dist.get_world_size()`` and collectives work as they do
under ``torchrun``. Because the children are forked, ``fn`` may be a function
defined in a notebook cell, a lambda or a closure: nothing has to be pickled
on the way in. Only return values travel back, pickled through a pipe.

Example::

    import torch, torch.distributed as dist
    from dtcourse import launch

    def fn():
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    launch(fn, 4)          # -> [6.0, 6.0, 6.0, 6.0]

The same ``fn`` runs unchanged under ``torchrun`` by calling
``init_from_env()`` first (see its docstring). ``max_restarts=k`` restarts every
rank after one fails, as ``torchrun --max-restarts k`` does, and sets
``TORCHELASTIC_RESTART_COUNT`` (0, 1, ...) as torchrun does, so one resume code
(``dtcourse.fault_tolerance``) runs under both.

The children rendezvous through a ``FileStore`` in a temporary file, and gloo connects them
over loopback (127.0.0.1) on ports the operating system picks, so two launches never collide.
How the ranks are forked, watched and cleaned up is in ``dtcourse.runtime.processes``; which
backend and device they use is in ``dtcourse.runtime.device``.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from typing import Any, Callable

import torch.distributed as dist

from dtcourse.runtime.device import choose_backend
from dtcourse.runtime.processes import LaunchError, LaunchTimeout, RankError, run_ranks
from dtcourse.runtime.rank import warm_imports

__all__ = ["launch", "init_from_env", "LaunchError", "RankError", "LaunchTimeout"]

# Each rank runs one intra-op thread. On a laptop with C cores, N ranks that
# each start a C-thread pool run N*C busy threads on C cores: every rank waits
# for the others to be descheduled and a step gets slower, not faster. One
# thread per rank also keeps timings comparable between world sizes.
DEFAULT_THREADS = 1
DEFAULT_TIMEOUT = 60.0
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"     # torchrun's name for the attempt a worker belongs to


def init_from_env(backend: str = "auto") -> tuple[int, int]:
    """Join the process group that ``torchrun`` (or ``launch``) describes.

    Call it at the top of a script's ``main``; it returns ``(rank, world_size)``.
    Under ``launch`` the group already exists and this returns at once, so the
    same function works in both places::

        def main():
            rank, world = dtcourse.init_from_env()
            ...
        if __name__ == "__main__":
            main()      # torchrun --nproc-per-node 4 script.py
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise LaunchError(
            f"init_from_env: environment variables {missing} are not set. Start the script with "
            "`torchrun --nproc-per-node N script.py`, or call dtcourse.launch(fn, N) from Python."
        )
    warm_imports()                                    # before the group exists: see there

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    backend = choose_backend(local_world, backend)     # one GPU per rank of this node
    if backend == "nccl":
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Under torchrun the agent hosts the store, and on torch 2.13 it keeps it across restarts: restarted gloo
        # workers read the killed attempt's addresses and fail ("Connection refused"; 4 restarts in 5 measured).
        # Each attempt, and each membership (world size), gets keys of its own.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        prefix = f"dtcourse/attempt-{os.environ.get(RESTART_COUNT, '0')}/world-{os.environ['WORLD_SIZE']}"
        dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group(backend, init_method="env://")
    return dist.get_rank(), dist.get_world_size()


def _check_inputs(fn: Any, world_size: Any, timeout: Any, threads: Any) -> None:
    if not callable(fn):
        raise TypeError(f"launch: fn must be a function to run on every rank, got {type(fn).__name__}. "
                        "Pass the function itself, e.g. launch(train, 4), not train().")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"launch: world_size must be an integer >= 1 (number of ranks), got {world_size!r}.")
    if (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not math.isfinite(timeout)
            or timeout <= 0):
        raise ValueError(f"launch: timeout must be a positive number of seconds (how long the ranks may "
                         f"run before launch stops them), got {timeout!r}.")
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
        raise ValueError(f"launch: threads must be an integer >= 0 (intra-op threads per rank; 0 leaves "
                         f"torch's default), got {threads!r}.")
    if not hasattr(os, "fork"):
        raise LaunchError("launch forks its ranks, which this platform cannot do. Use Linux or macOS, "
                          "or run the script under torchrun.")


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT,
           backend: str = "auto", threads: int = DEFAULT_THREADS, max_restarts: int = 0, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` forked ranks; return their results by rank.

    ``backend`` is ``"auto"`` (nccl with one GPU per rank when there are two ranks or more and
    enough GPUs, else gloo), ``"gloo"`` or ``"nccl"``; inside ``fn``, ``dtcourse.device()`` is the
    rank's device. Where a fork could not use the GPU, a clean starter process forks the ranks
    (``dtcourse.runtime.fresh``): the first such launch takes a second or two more, and ``fn`` must pickle.
    ``timeout`` (seconds) bounds the whole run: a rank that hangs, for example in a collective
    another rank skipped, makes ``launch`` raise ``LaunchTimeout`` (a ``TimeoutError``) with
    ``.stuck`` (the ranks still running) and ``.stacks`` (where each was). ``threads`` is the
    number of intra-op threads per rank (one by default: see ``DEFAULT_THREADS``). Every child
    is killed before ``launch`` returns or raises.

    ``max_restarts``: when a rank raises or dies (``RankError``, ``LaunchError``), kill every rank and
    start them all again, up to that many times, each attempt with ``TORCHELASTIC_RESTART_COUNT`` set to
    its number, as torchrun's agent does. A restart only starts the ranks again: whatever they should
    resume from, they must have saved and must load themselves. A timeout is not restarted (torchrun
    does not detect a hang either), and the last attempt's error is raised, with the earlier ones in
    its ``__notes__``.
    """
    _check_inputs(fn, world_size, timeout, threads)
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ValueError(f"launch: max_restarts must be an integer >= 0 (how many times to restart every rank "
                         f"after one fails), got {max_restarts!r}.")
    try:
        backend = choose_backend(world_size, backend)
    except (ValueError, RuntimeError) as err:
        raise (ValueError if isinstance(err, ValueError) else LaunchError)(f"launch: {err}") from None
    warm_imports()
    failures: list[str] = []
    for attempt in range(max_restarts + 1):
        try:
            return _attempt(fn, world_size, args, kwargs, backend, float(timeout), threads, attempt)
        except (RankError, LaunchError) as err:
            if attempt == max_restarts:
                for note in failures:
                    err.add_note(note)
                raise
            first = str(err).strip().splitlines()[-1] if isinstance(err, RankError) else str(err)
            failures.append(f"attempt {attempt} failed: {first}")
            print(f"[launch] attempt {attempt} of {max_restarts + 1} failed ({first[:120]}); restarting every "
                  "rank", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def _attempt(fn, world_size, args, kwargs, backend, timeout, threads, attempt) -> list[Any]:
    """One start of every rank, with torchrun's ``TORCHELASTIC_RESTART_COUNT`` set for them to read."""
    sys.stdout.flush()
    sys.stderr.flush()
    # Rendezvous through a FileStore: no server thread in the parent and no
    # port to race for. (A TCPStore served from the parent left a late rank
    # stuck connecting in about 1 launch in 50 on this machine.)
    handle, store_path = tempfile.mkstemp(prefix="dtcourse-rendezvous-")
    os.close(handle)
    before = os.environ.get(RESTART_COUNT)
    os.environ[RESTART_COUNT] = str(attempt)      # inherited by the forks (and by fresh interpreters)
    try:
        return run_ranks(fn, world_size, args, kwargs, backend=backend, store_path=store_path,
                         timeout=timeout, threads=threads)
    finally:
        if before is None:
            os.environ.pop(RESTART_COUNT, None)
        else:
            os.environ[RESTART_COUNT] = before
        try:
            os.unlink(store_path)
        except FileNotFoundError:
            pass
