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
``init_from_env()`` first (see its docstring).

How the pieces fit:

* The children rendezvous through a ``FileStore`` in a temporary file, and
  gloo connects them over loopback (127.0.0.1) on ports the operating system
  picks, so two launches never collide.
* Each child gets three pipes: stdout, stderr and a result pipe. The parent
  multiplexes them with ``selectors``, prints each line prefixed by
  ``[rank r]``, and reads one pickled ``("ok", value)`` or ``("error", text)``
  message per rank.
* Each child runs in its own process group (``setpgid``), asks the kernel to
  kill it if the parent dies (``PR_SET_PDEATHSIG``), and is killed with its
  whole group when the launch ends, on success, error, timeout or Ctrl-C.
"""

from __future__ import annotations

import ctypes
import datetime
import faulthandler
import os
import pickle
import selectors
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["launch", "init_from_env", "LaunchError", "RankError"]

# Each rank runs one intra-op thread. On a laptop with C cores, N ranks that
# each start a C-thread pool run N*C busy threads on C cores: every rank waits
# for the others to be descheduled and a step gets slower, not faster. One
# thread per rank also keeps timings comparable between world sizes.
DEFAULT_THREADS = 1
DEFAULT_TIMEOUT = 60.0


class LaunchError(RuntimeError):
    """A launch could not start, or a rank failed to send its result back."""


class RankError(RuntimeError):
    """A rank raised an exception; ``rank`` and ``remote_traceback`` say where."""

    def __init__(self, rank: int, remote_traceback: str):
        self.rank = rank
        self.remote_traceback = remote_traceback
        super().__init__(f"rank {rank} raised an exception:\n\n{remote_traceback}")


# --------------------------------------------------------------------------- #
# Under torchrun
# --------------------------------------------------------------------------- #
def default_backend(world_size: int) -> str:
    """nccl when CUDA has a GPU for every rank, gloo otherwise."""
    if torch.cuda.is_available() and world_size <= torch.cuda.device_count():
        return "nccl"
    return "gloo"


def init_from_env(backend: str | None = None) -> tuple[int, int]:
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
    world_size = int(os.environ["WORLD_SIZE"])
    backend = backend or default_backend(world_size)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, init_method="env://")
    return dist.get_rank(), dist.get_world_size()


# --------------------------------------------------------------------------- #
# Inside a child
# --------------------------------------------------------------------------- #
def _set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this child if its parent dies (no orphans)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # 1 == PR_SET_PDEATHSIG
        except OSError:
            pass


def _send(fd: int, payload: bytes) -> None:
    """Write one length-prefixed pickled message to the parent."""
    os.write(fd, len(payload).to_bytes(8, "little"))
    view = memoryview(payload)
    while view:
        view = view[os.write(fd, view):]


def _child_main(fn, args, kwargs, rank, world_size, backend, store_path, timeout, threads, fds) -> None:
    out_w, err_w, res_w, stack_w = fds
    os.setpgid(0, 0)
    _set_parent_death_signal()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
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
        payload = pickle.dumps(("error", traceback.format_exc()))
    else:
        try:
            payload = pickle.dumps(("ok", result))
        except Exception as exc:
            payload = pickle.dumps(("unpicklable", f"{type(result).__name__}: {exc}"))
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


# --------------------------------------------------------------------------- #
# In the parent
# --------------------------------------------------------------------------- #
@dataclass
class _Rank:
    rank: int
    pid: int
    fds: dict[int, str]                       # fd -> "out" | "err" | "res" | "stack"
    partial: dict[str, bytes] = field(default_factory=lambda: {"out": b"", "err": b""})
    result: bytes = b""
    stack: bytes = b""
    message: tuple | None = None
    reaped: bool = False


def _check_inputs(fn, world_size, backend) -> str:
    if not callable(fn):
        raise TypeError(f"launch: fn must be a function to run on every rank, got {type(fn).__name__}. "
                        "Pass the function itself, e.g. launch(train, 4), not train().")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"launch: world_size must be an integer >= 1 (number of ranks), got {world_size!r}.")
    if not hasattr(os, "fork"):
        raise LaunchError("launch forks its ranks, which this platform cannot do. Use Linux or macOS, "
                          "or run the script under torchrun.")
    backend = backend or default_backend(world_size)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"launch: backend must be 'gloo' or 'nccl', got {backend!r}.")
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < world_size:
            raise LaunchError(f"launch: backend='nccl' needs one GPU per rank, but world_size={world_size} "
                              f"and this machine has {gpus} GPU(s). Use backend='gloo' (CPU) or "
                              f"world_size<={gpus}.")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise LaunchError(
            "launch: CUDA is already initialized in this process, and a forked child cannot use it. "
            "Restart the kernel and call launch before anything touches the GPU (no .cuda(), "
            "torch.cuda.* calls or tensors on 'cuda' in the notebook itself): create GPU tensors "
            "inside fn instead.")
    return backend


def _warm_imports() -> None:
    """Import once in the parent what every rank would otherwise import for itself.

    The first ``torch.optim`` optimizer a process builds imports ``torch._dynamo``:
    2.8 s per rank on the 2-core machine, paid again in every launch. Importing
    it here costs about 1 s, once per kernel, and forked ranks inherit it.
    """
    import torch._dynamo  # noqa: F401


def _kill_all(ranks: list[_Rank]) -> None:
    # killpg also ends anything a rank started itself (its group is its own).
    for r in ranks:
        try:
            os.killpg(r.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            if not r.reaped:
                try:
                    os.kill(r.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    for r in ranks:
        if not r.reaped:
            try:
                os.waitpid(r.pid, 0)
            except ChildProcessError:
                pass
            r.reaped = True


def _emit(rank: int, stream: str, text: str) -> None:
    target = sys.stdout if stream == "out" else sys.stderr
    target.write(f"[rank {rank}] {text}\n")


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT,
           backend: str | None = None, threads: int = DEFAULT_THREADS, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` forked ranks; return their results by rank.

    ``backend`` defaults to nccl (one GPU per rank) when CUDA has enough GPUs,
    else gloo. ``timeout`` (seconds) bounds the whole run: a rank that hangs,
    for example in a collective another rank skipped, makes ``launch`` raise
    ``TimeoutError`` naming the ranks still running. ``threads`` is the number
    of intra-op threads per rank (one by default: see ``DEFAULT_THREADS``).
    Every child is killed before ``launch`` returns or raises.
    """
    backend = _check_inputs(fn, world_size, backend)
    _warm_imports()
    sys.stdout.flush()
    sys.stderr.flush()
    # Rendezvous through a FileStore: no server thread in the parent and no
    # port to race for. (A TCPStore served from the parent left a late rank
    # stuck connecting in about 1 launch in 50 on this machine.)
    handle, store_path = tempfile.mkstemp(prefix="dtcourse-rendezvous-")
    os.close(handle)
    ranks: list[_Rank] = []
    sel = selectors.DefaultSelector()
    try:
        for rank in range(world_size):
            pipes = [os.pipe() for _ in range(4)]
            pid = os.fork()
            if pid == 0:  # child
                for r in ranks:
                    for fd in r.fds:
                        os.close(fd)
                for read_end, _ in pipes:
                    os.close(read_end)
                _child_main(fn, args, kwargs, rank, world_size, backend, store_path, timeout, threads,
                            [w for _, w in pipes])
            for _, write_end in pipes:
                os.close(write_end)
            info = _Rank(rank, pid, {pipes[0][0]: "out", pipes[1][0]: "err", pipes[2][0]: "res",
                                     pipes[3][0]: "stack"})
            ranks.append(info)
            for fd, kind in info.fds.items():
                sel.register(fd, selectors.EVENT_READ, (info, kind))
        return _collect(ranks, sel, timeout)
    finally:
        _kill_all(ranks)
        _drain(sel)
        sel.close()
        for r in ranks:
            for fd in r.fds:
                os.close(fd)
        try:
            os.unlink(store_path)
        except FileNotFoundError:
            pass


def _collect(ranks: list[_Rank], sel: selectors.BaseSelector, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    running = set(range(len(ranks)))
    while running:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            stuck = sorted(running)
            raise TimeoutError(
                f"launch timed out after {timeout:g} s; rank(s) {stuck} still running. A common cause is a "
                "collective or recv that another rank never reached (for example a call inside "
                "`if rank == 0:`). All ranks were stopped; raise timeout= if the work is just slow."
                + _where_stuck([ranks[r] for r in stuck], sel))
        for key, _ in sel.select(timeout=min(remaining, 1.0)):
            info, kind = key.data
            got_data = _read(key, sel)
            if kind != "res" or info.rank not in running:
                continue
            if _message_complete(info):
                running.discard(info.rank)
                _finish(info)
            elif not got_data:
                _died(info)  # result pipe closed before a whole message arrived
    return [r.message[1] for r in ranks]


def _read(key: selectors.SelectorKey, sel: selectors.BaseSelector) -> bool:
    """Read what one pipe has; print whole output lines. False at end of file."""
    info, kind = key.data
    chunk = os.read(key.fd, 1 << 16)
    if not chunk:
        sel.unregister(key.fd)
        if info.partial.get(kind):
            _emit(info.rank, kind, info.partial[kind].decode(errors="replace"))
            info.partial[kind] = b""
        return False
    if kind == "res":
        info.result += chunk
    elif kind == "stack":
        info.stack += chunk
    else:
        *lines, info.partial[kind] = (info.partial[kind] + chunk).split(b"\n")
        for line in lines:
            _emit(info.rank, kind, line.decode(errors="replace"))
    return True


def _where_stuck(stuck: list[_Rank], sel: selectors.BaseSelector) -> str:
    """Ask each stuck rank for its Python stack (faulthandler) and format the innermost frames."""
    for r in stuck:
        try:
            os.kill(r.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    end = time.monotonic() + 0.5
    while time.monotonic() < end and not all(r.stack.count(b"\n") >= 2 for r in stuck):
        for key, _ in sel.select(timeout=0.05):
            _read(key, sel)
    lines = []
    for r in stuck:
        frames = [ln.strip() for ln in r.stack.decode(errors="replace").splitlines()
                  if ln.strip().startswith("File")]
        if frames:
            lines.append(f"  rank {r.rank} was at " + "\n      called from ".join(frames[:3]))
    return ("\nWhere the stuck ranks were (innermost call first):\n" + "\n".join(lines)) if lines else ""


def _drain(sel: selectors.BaseSelector, seconds: float = 1.0) -> None:
    """After the ranks are killed, print whatever output is still in the pipes."""
    end = time.monotonic() + seconds
    while sel.get_map() and time.monotonic() < end:
        for key, _ in sel.select(timeout=max(0.0, end - time.monotonic())):
            _read(key, sel)


def _message_complete(info: _Rank) -> bool:
    return len(info.result) >= 8 and len(info.result) >= 8 + int.from_bytes(info.result[:8], "little")


def _died(info: _Rank) -> None:
    _, status = os.waitpid(info.pid, 0)
    info.reaped = True
    code = os.waitstatus_to_exitcode(status)
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    raise LaunchError(f"rank {info.rank} {how} before sending a result (out of memory, a crash in "
                      "C++ code, or os._exit/sys.exit inside fn).")


def _finish(info: _Rank) -> None:
    """Turn a finished rank's result bytes into a value, or raise its error."""
    kind, payload = pickle.loads(info.result[8:])
    if kind == "error":
        raise RankError(info.rank, payload)
    if kind == "unpicklable":
        raise LaunchError(f"rank {info.rank} returned a value that cannot be sent back to the notebook "
                          f"({payload}). Return plain data: numbers, lists, dicts, numpy arrays or CPU "
                          "tensors (call .cpu() / .detach()), not modules, generators or open handles.")
    info.message = (kind, payload)
