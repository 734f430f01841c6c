"""Ranks in fresh interpreters, for a parent that a forked rank could not compute in.

``launch`` forks its ranks: fast (about 0.05 s for 4), and ``fn`` may be anything defined in a
notebook. Two things a parent may have done make a plain fork unusable, and both happen only with
a CUDA build of PyTorch and a GPU in view:

* it initialised CUDA (``.cuda()``, a tensor on ``"cuda"``): a forked child cannot use the GPU. Not
  only through torch's lazy initialisation: anything that asks the CUDA runtime (``torch.accelerator``,
  a device count without NVML, a library) initialises the driver, and then even a CPU rank's
  ``Adam.step()``, which asks whether the current CUDA stream is capturing a graph, fails in the fork
  with "CUDA error: initialization error" (found on the H100 run). The driver itself is asked;
* it ran a backward pass: autograd then starts one worker thread per GPU (named ``pt_autograd_<i>``),
  even for a CPU-only backward, and PyTorch refuses any backward in a forked child ("Unable to handle
  autograd's threading in combination with fork-based multiprocessing").

Then each rank is still forked (so the pipes, the process group and the clean-up stay those of
``processes.py``) but at once replaces itself with a new Python (``execv``) that rebuilds ``fn``,
``args`` and ``kwargs`` from a file that cloudpickle wrote: functions of ``__main__`` (a notebook)
travel by value, others by reference. Starting costs an import of torch per rank (about 2 s on a GPU
node, and more on a loaded one) instead of 0.05 s; ``launch``'s timeout starts once every rank has
rebuilt ``fn``, so that start-up does not count against it. ``DTCOURSE_FRESH_RANKS=1`` asks for this path everywhere (the tests use it).
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import sys
import tempfile
import traceback
from typing import Any, Callable

import torch

__all__ = ["why_fresh", "write_payload", "exec_rank"]

_BOOT = ("import pickle, sys; f = open(sys.argv[1], 'rb'); sys.path[:] = pickle.load(f); "
         "from dtcourse.runtime.fresh import _main; _main(f, sys.argv[2])")


def _autograd_threads() -> bool:
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:                                 # not Linux: no /proc
        return False
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().startswith("pt_autograd"):
                    return True
        except OSError:
            continue
    return False


def _cuda_driver_initialised() -> bool:
    """Whether this process's CUDA driver has been initialised (cuInit), asked without initialising it:
    before cuInit, ``cuDeviceGetCount`` answers CUDA_ERROR_NOT_INITIALIZED (3)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:                                 # no NVIDIA driver: nothing to initialise
        return False
    count = ctypes.c_int()
    return driver.cuDeviceGetCount(ctypes.byref(count)) != 3


def why_fresh() -> str | None:
    """Why a forked rank could not compute here (the reason, for messages), or None."""
    if os.environ.get("DTCOURSE_FRESH_RANKS") == "1":
        return "DTCOURSE_FRESH_RANKS=1 asks for it"
    if not torch.backends.cuda.is_built():          # the CPU wheel: neither can happen
        return None
    if torch.cuda.is_initialized():
        return "CUDA is initialised in this process"
    if _cuda_driver_initialised():
        return "the CUDA driver is initialised in this process (something asked the CUDA runtime)"
    if _autograd_threads():
        return "a backward pass ran in this process with a GPU in view (autograd's GPU threads are running)"
    return None


def write_payload(fn: Callable[..., Any], args: tuple, kwargs: dict, why: str) -> str:
    """Pickle ``sys.path`` and ``(fn, args, kwargs)`` into a temporary file; return its path."""
    import cloudpickle

    handle, path = tempfile.mkstemp(prefix="dtcourse-rank-payload-")
    try:
        with os.fdopen(handle, "wb") as f:
            pickle.dump(list(sys.path), f)
            cloudpickle.dump((fn, args, kwargs), f)
    except Exception as exc:
        os.unlink(path)
        from dtcourse.runtime.processes import LaunchError
        raise LaunchError(
            f"launch: {why}, so the ranks start in fresh interpreters, and fn with its arguments must be "
            f"pickled to reach them; that failed ({type(exc).__name__}: {exc}). Restart the kernel and call "
            "launch before anything touches the GPU or runs backward in the notebook itself, or pass "
            "arguments that pickle (tensors, numbers, modules; not locks or open files).") from None
    return path


def exec_rank(payload: str, rank: int, world_size: int, backend: str, store_path: str, timeout: float,
              threads: int, fds: list[int]) -> None:
    """In a just-forked child: become a new Python that runs the rank. Never returns."""
    from dtcourse.runtime.processes import SETUP_FAILED
    try:
        for fd in fds:
            os.set_inheritable(fd, True)
        spec = json.dumps([rank, world_size, backend, store_path, timeout, threads, fds])
        os.execv(sys.executable, [sys.executable, "-c", _BOOT, payload, spec])
    finally:
        os._exit(SETUP_FAILED)


def _main(f, spec: str) -> None:
    """The new Python's rank: rebuild fn, then run it exactly as a forked rank would."""
    from dtcourse.runtime.processes import READY, _child, _send
    from dtcourse.runtime.results import encode

    rank, world_size, backend, store_path, timeout, threads, fds = json.loads(spec)
    try:
        fn, args, kwargs = pickle.load(f)
    except BaseException:
        _send(fds[2], encode(("error", "launch could not rebuild fn in the rank's fresh interpreter:\n"
                                       + traceback.format_exc())))
        os._exit(0)
    f.close()
    os.write(fds[3], READY)             # launch's timeout counts from here: the start-up was not fn's time
    _child(fn, args, kwargs, rank, world_size, backend, store_path, timeout, threads, fds)
