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

Then the ranks are forked by a *starter* instead: a new Python, started once per process on first need,
that imports torch and this package and never runs backward nor touches CUDA, so it forks clean ranks
as fast as a clean parent would (a new Python per rank, as before, cost about 2 s of start-up each on
a GPU node, and one lesson's cell of many launches ran past its time limit there). The parent sends it,
over a Unix socket, the ranks' pipe ends (``SCM_RIGHTS``), its environment and working directory, and
a file that cloudpickle wrote with ``fn``, ``args`` and ``kwargs``: functions of ``__main__`` (a
notebook) travel by value, others by reference. The pipes, the process groups and the clean-up stay
those of ``processes.py``; the starter reaps the ranks and tells the parent how one ended. The starter
dies with its parent (``PR_SET_PDEATHSIG``). Modules are those the starter imported when it started.
``launch``'s timeout starts once every rank has rebuilt ``fn``, so that start-up never counts against
it. ``DTCOURSE_FRESH_RANKS=1`` asks for this path everywhere (the tests use it).
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch

from dtcourse.runtime.errors import LaunchError
from dtcourse.runtime.rank import READY, SETUP_FAILED, _child, _send, _set_parent_death_signal, warm_imports
from dtcourse.runtime.results import encode

__all__ = ["why_fresh", "write_payload", "start_rank", "ended", "exit_code"]

_BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv[2]); "
         "from dtcourse.runtime.fresh import _starter_main; _starter_main(int(sys.argv[1]))")


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
        raise LaunchError(
            f"launch: {why}, so the ranks start in fresh interpreters, and fn with its arguments must be "
            f"pickled to reach them; that failed ({type(exc).__name__}: {exc}). Restart the kernel and call "
            "launch before anything touches the GPU or runs backward in the notebook itself, or pass "
            "arguments that pickle (tensors, numbers, modules; not locks or open files).") from None
    return path


# --------------------------------------------------------------------------- #
# In the parent: the starter, and what it is asked
# --------------------------------------------------------------------------- #
class _Starter:
    """The starter process and the parent's end of its socket (one message per request and per reply)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, str(theirs.fileno()), json.dumps(sys.path)],
                                     pass_fds=[theirs.fileno()], start_new_session=True,
                                     stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        self.owner = os.getpid()          # a forked child of this process must not share its socket
        self.sock.settimeout(300)        # the first reply waits for the starter to import torch

    def ask(self, request: dict, fds: list[int] = ()) -> dict:
        try:
            socket.send_fds(self.sock, [json.dumps(request).encode()], list(fds))
            reply = self.sock.recv(1 << 16)
        except OSError:
            reply = b""
        if not reply:
            code = self.proc.poll()
            raise LaunchError(f"launch: the process that starts the ranks (fresh.py) ended or did not answer in 300 s "
                              f"(exit code {code}); the next launch starts a new one.")
        return json.loads(reply)

    def close(self) -> None:
        self.sock.close()                 # the starter reads end-of-file and exits
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_STARTER: _Starter | None = None


def _starter() -> _Starter:
    global _STARTER
    if _STARTER is None or _STARTER.proc.poll() is not None or _STARTER.owner != os.getpid():
        _STARTER = _Starter()
        atexit.register(_STARTER.close)
    return _STARTER


def start_rank(payload: str, rank: int, world_size: int, backend: str, store_path: str, timeout: float,
               threads: int, fds: list[int]) -> int:
    """Have the starter fork rank ``rank``, writing to ``fds``; return its pid (not a child of this process)."""
    spec = [rank, world_size, backend, store_path, timeout, threads]
    try:
        modules = sorted(m for m in sys.modules if m == "dtcourse" or m.startswith("dtcourse."))
        reply = _starter().ask({"start": spec, "payload": payload, "env": dict(os.environ), "cwd": os.getcwd(),
                                "modules": modules}, fds)
    except Exception:
        global _STARTER
        _STARTER = None                   # a dead starter: the next launch starts another
        raise
    return reply["pid"]


def ended(pid: int) -> bool:
    """Whether a rank the starter forked is gone (reaped by the starter)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:                # alive, though not ours to signal
        pass
    return False


def exit_code(pid: int) -> int:
    """How a rank the starter forked ended: ``os.waitstatus_to_exitcode``'s number (negative: a signal)."""
    return _starter().ask({"status": pid})["code"]


# --------------------------------------------------------------------------- #
# In the starter
# --------------------------------------------------------------------------- #
def _starter_main(fd: int) -> None:
    """Serve the parent: fork a rank per request, reap ranks, say how one ended. Exits with the parent."""
    _set_parent_death_signal()
    if os.getppid() == 1:                 # the parent died before the line above
        os._exit(0)
    sock = socket.socket(fileno=fd)
    codes: dict[int, int] = {}
    warm_imports()                       # once here, not in every rank's first optimizer step

    def reap(*_: Any) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            codes[pid] = os.waitstatus_to_exitcode(status)
            while len(codes) > 1000:      # ranks nobody asked about
                codes.pop(next(iter(codes)))
    signal.signal(signal.SIGCHLD, reap)
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 8)
        except OSError:
            os._exit(0)
        if not message:
            os._exit(0)
        request = json.loads(message)
        if "start" in request:
            _import(request["modules"])   # the course's modules the parent has: once here, not in every rank
            pid = os.fork()
            if pid == 0:
                _rank(sock, request, fds)
            for f in fds:
                os.close(f)
            sock.send(json.dumps({"pid": pid}).encode())
        else:
            pid, end = request["status"], time.monotonic() + 10
            while pid not in codes and time.monotonic() < end:
                reap()
                time.sleep(0.01)
            sock.send(json.dumps({"code": codes.pop(pid, 70)}).encode())


def _import(modules: list[str]) -> None:
    """Import what is not imported yet; a module that fails to import is left to the rank that needs it."""
    import importlib
    for name in modules:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except Exception:
                pass


def _rank(sock: socket.socket, request: dict, fds: list[int]) -> None:
    """In a child of the starter: the parent's environment, then the rank as a forked one runs it. Never returns."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        rank, world_size, backend, store_path, timeout, threads = request["start"]
        try:
            with open(request["payload"], "rb") as f:
                sys.path[:] = pickle.load(f)
                fn, args, kwargs = pickle.load(f)
        except BaseException:
            _send(fds[2], encode(("error", "launch could not rebuild fn in the rank's fresh interpreter:\n"
                                           + traceback.format_exc())))
            os._exit(0)
        os.write(fds[3], READY)           # launch's timeout counts from here: the start-up was not fn's time
        _child(fn, args, kwargs, rank, world_size, backend, store_path, timeout, threads, fds)
    finally:
        os._exit(SETUP_FAILED)
