"""Inside one rank's process, once forked: its pipes, its process group, ``fn``, and ``os._exit``.

``processes.py`` forks a rank and runs ``_child`` in it; ``fresh.py``'s starter does the same in a
clean interpreter. Either way a rank never returns into the code that forked it: every path ends in
``os._exit``. ``warm_imports`` is what the parent, the starter and a torchrun worker import before
any process group exists.
"""

from __future__ import annotations

import ctypes
import datetime
import faulthandler
import os
import signal
import sys
import traceback
from typing import Callable

import torch
import torch.distributed as dist

from dtcourse.runtime.results import encode

SETUP_FAILED = 70               # a child's exit code when it failed before running fn
READY = b"\x06"                 # a fresh rank's first byte on its stack pipe: it has rebuilt fn and starts it


def warm_imports() -> None:
    """Import, before any process group exists, what the first optimizer step would import after it.

    The first ``torch.optim`` optimizer a process builds imports ``torch._dynamo``: 2.8 s per rank on
    the 2-core machine, paid again in every launch. Imported once here (about 1 s, in the parent, in
    the ranks' starter, or in a torchrun worker before ``init_from_env`` makes its group), forked
    ranks inherit it. And on torch 2.13, importing it once a gloo group exists keeps that group alive
    past ``destroy_process_group()``: its worker threads, freeing a finished collective's tensors while
    Python shuts down, abort the process ("terminate called without an active exception", exit -6; 10
    runs in 16 of a ZeRO script under torchrun, measured).
    """
    import torch._dynamo  # noqa: F401


def _set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this child if its parent dies (no orphans)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # 1 == PR_SET_PDEATHSIG
        except OSError:
            pass


def _send(fd: int, parts: list[memoryview]) -> None:
    """Write one message to the parent, part by part, from the parts' own memory."""
    for view in parts:
        while view:
            view = view[os.write(fd, view):]


def _child(fn: Callable, args: tuple, kwargs: dict, rank: int, world_size: int, backend: str,
           store_path: str, timeout: float, threads: int, fds: list[int]) -> None:
    """Everything a rank does. Never returns: every path ends in ``os._exit``."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})   # blocked by the parent across fork
        _child_main(fn, args, kwargs, rank, world_size, backend, store_path, timeout, threads, fds)
    finally:
        # Reached only if set-up itself failed: the parent reports "before sending a result".
        os._exit(SETUP_FAILED)


def _child_main(fn, args, kwargs, rank, world_size, backend, store_path, timeout, threads, fds) -> None:
    out_w, err_w, res_w, stack_w = fds
    os.setpgid(0, 0)
    _set_parent_death_signal()
    # Replace the kernel's stdout/stderr (zmq streams that a fork must not
    # touch) with our pipes, at the file-descriptor level so C++ output too.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    # On a timeout the parent sends SIGUSR1 and reports where each stuck rank was.
    faulthandler.register(signal.SIGUSR1, file=os.fdopen(stack_w, "w", closefd=False), all_threads=False)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    # gloo listens on a free port (the OS picks it) on this interface: loopback
    # unless the user chose another, so nothing is exposed to the network.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(store_path, world_size)
        # The backend's own timeout comes later than launch's, so a hang is
        # reported by launch (with the stuck ranks' stacks), not as a gloo error.
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout + 60))
        result = fn(*args, **kwargs)
    except BaseException:
        payload = encode(("error", traceback.format_exc()))
    else:
        try:
            payload = encode(("ok", result))
        except Exception as exc:
            payload = encode(("unpicklable", f"{type(result).__name__}: {exc}"))
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        _send(res_w, payload)
        # Stay alive, connections open, until the parent ends the job. Then a
        # rank stuck in a collective that this rank skipped stays stuck, and the
        # timeout reports it, instead of failing with "connection closed by peer".
        while True:
            signal.pause()
    finally:
        # Skip the parent's atexit handlers and destructors (Jupyter's, the
        # open files and sockets): this process is a fork and owns none of them.
        os._exit(0)
