"""The process plumbing under ``launch``: fork, pipes, results, timeouts and clean-up.

Each rank is a forked child with four pipes to the parent: stdout, stderr, a result pipe and a
stack pipe. The parent multiplexes them with ``selectors``: it prints each output line prefixed
``[rank r]``, collects one result message per rank from the result pipes, and on a timeout asks
each stuck rank for its Python stack (faulthandler on SIGUSR1). ``results.py`` says how a result
message is laid out.

Each child runs in its own process group (``setpgid``), asks the kernel to kill it if the parent
dies (``PR_SET_PDEATHSIG``), and is killed with its whole group when the launch ends, on success,
error, timeout or Ctrl-C. A child never returns into the parent's code: whatever happens in it,
even an exception before it reaches the user's function, ends in ``os._exit``. ``fresh.py`` says
when the ranks are forked by a clean starter process instead (a parent that used the GPU).
"""

from __future__ import annotations

import os
import selectors
import signal
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from dtcourse.runtime import fresh
from dtcourse.runtime.errors import LaunchError, LaunchTimeout, RankError, frames  # noqa: F401 (re-exported)
from dtcourse.runtime.rank import READY, SETUP_FAILED, _child
from dtcourse.runtime.results import decode

__all__ = ["LaunchError", "RankError", "LaunchTimeout", "run_ranks"]

READ_CHUNK = 1 << 20            # bytes per os.read: a 256 MB result arrives in 256 reads
START_LIMIT = 300.0             # seconds the starter's ranks may take to start it (importing torch) and rebuild fn


# --------------------------------------------------------------------------- #
# In the parent
# --------------------------------------------------------------------------- #
@dataclass
class _Rank:
    rank: int
    pid: int
    fds: dict[int, str]                       # fd -> "out" | "err" | "res" | "stack"
    partial: dict[str, bytes] = field(default_factory=lambda: {"out": b"", "err": b""})
    # The result is read into one buffer of the message's size, allocated when its first 8
    # bytes (the size) have arrived. (Appending to bytes instead copied everything so far on
    # every read: a 64 MB result took the square of its size to arrive.)
    result: bytearray = field(default_factory=bytearray)
    received: int = 0
    stack: bytearray = field(default_factory=bytearray)
    message: tuple | None = None
    reaped: bool = False
    ready: bool = True                        # a fresh rank is not until its READY byte arrives
    ours: bool = True                         # forked by this process (else by the starter, which reaps it)


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, *, backend: str,
              store_path: str, timeout: float, threads: int) -> list[Any]:
    """Fork ``world_size`` ranks running ``fn`` (forked by the starter where ``fresh.why_fresh()`` says a
    fork could not compute); return their results by rank; leave none running."""
    ranks, sel, why = [], selectors.DefaultSelector(), fresh.why_fresh()
    payload = fresh.write_payload(fn, args, kwargs, why) if why else None
    try:
        for rank in range(world_size):
            pipes = [os.pipe() for _ in range(4)]
            try:
                if payload:                   # forked by the starter, a clean Python (fresh.py)
                    pid = fresh.start_rank(payload, rank, world_size, backend, store_path, timeout, threads,
                                           [w for _, w in pipes])
                else:
                    pid = _fork(ranks, pipes, partial(_child, fn, args, kwargs),
                                (rank, world_size, backend, store_path, timeout, threads, [w for _, w in pipes]))
            finally:
                for _, write_end in pipes:
                    os.close(write_end)
            info = _Rank(rank, pid, {pipes[0][0]: "out", pipes[1][0]: "err", pipes[2][0]: "res",
                                     pipes[3][0]: "stack"}, ready=payload is None, ours=payload is None)
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
        if payload:
            os.unlink(payload)


def _fork(ranks: list[_Rank], pipes: list[tuple[int, int]], start: Callable, args: tuple) -> int:
    """Fork a rank that runs ``start(*args)``; return its pid."""
    # SIGINT stays blocked across fork, so a Ctrl-C cannot raise inside the child
    # before _child has taken charge of it (and unwind into this function there).
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    pid = os.fork()
    if pid == 0:  # child: none of the parent's read ends
        for fd in [fd for r in ranks for fd in r.fds] + [read_end for read_end, _ in pipes]:
            os.close(fd)
        start(*args)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return pid


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
        if not r.reaped and r.ours:
            try:
                os.waitpid(r.pid, 0)
            except ChildProcessError:
                pass
        elif not r.reaped:                              # the starter's child: it reaps it
            end = time.monotonic() + 5
            while not fresh.ended(r.pid) and time.monotonic() < end:
                time.sleep(0.005)
        r.reaped = True


def _emit(rank: int, stream: str, text: str) -> None:
    target = sys.stdout if stream == "out" else sys.stderr
    target.write(f"[rank {rank}] {text}\n")


def _collect(ranks: list[_Rank], sel: selectors.BaseSelector, timeout: float) -> list[Any]:
    """Read every rank's output and result. ``timeout`` counts once every rank runs fn: the starter's ranks
    rebuild fn first (the first launch also starts the starter: seconds on a loaded machine)."""
    started = time.monotonic()
    deadline = started + timeout if all(r.ready for r in ranks) else None
    running = set(range(len(ranks)))
    while running:
        if deadline is None and all(r.ready or r.rank not in running for r in ranks):
            deadline = time.monotonic() + timeout
        if deadline is None and time.monotonic() - started > START_LIMIT:
            late = [r.rank for r in ranks if not r.ready]
            raise LaunchError(f"launch: rank(s) {late} had not started fn {START_LIMIT:g} s after launch (each "
                              "is forked by a starter process, which imports torch, and rebuilds fn). Is the machine "
                              "out of memory, or does importing fn's module hang?")
        remaining = (deadline if deadline is not None else started + START_LIMIT) - time.monotonic()
        if remaining <= 0:
            stuck = sorted(running)
            raise LaunchTimeout(timeout, stuck, _stacks([ranks[r] for r in stuck], sel))
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
    if kind == "res" and info.received >= 8:            # straight into the message's buffer
        end = min(len(info.result), info.received + READ_CHUNK)
        got = os.readv(key.fd, [memoryview(info.result)[info.received:end]]) if end > info.received else 0
        info.received += got
        if got:
            return True
        sel.unregister(key.fd)
        return False
    chunk = os.read(key.fd, READ_CHUNK if kind != "res" else 8 - info.received)
    if not chunk:
        sel.unregister(key.fd)
        if info.partial.get(kind):
            _emit(info.rank, kind, info.partial[kind].decode(errors="replace"))
            info.partial[kind] = b""
        return False
    if kind == "res":                                    # the first 8 bytes: the message's size
        info.result += chunk
        info.received += len(chunk)
        if info.received == 8:
            message = bytearray(int.from_bytes(info.result, "little"))
            message[:8] = info.result
            info.result = message
    elif kind == "stack":
        if not info.ready and chunk[:1] == READY:
            info.ready, chunk = True, chunk[1:]
        info.stack += chunk
    else:
        *lines, info.partial[kind] = (info.partial[kind] + chunk).split(b"\n")
        for line in lines:
            _emit(info.rank, kind, line.decode(errors="replace"))
    return True


def _stacks(stuck: list[_Rank], sel: selectors.BaseSelector) -> dict[int, str]:
    """Ask each stuck rank for its Python stack (faulthandler), innermost call first."""
    for r in stuck:
        try:
            os.kill(r.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    end = time.monotonic() + 0.5
    while time.monotonic() < end and not all(r.stack.count(b"\n") >= 2 for r in stuck):
        for key, _ in sel.select(timeout=0.05):
            _read(key, sel)
    return {r.rank: r.stack.decode(errors="replace") for r in stuck}


def _drain(sel: selectors.BaseSelector, seconds: float = 1.0) -> None:
    """After the ranks are killed, print whatever output is still in the pipes."""
    end = time.monotonic() + seconds
    while sel.get_map() and time.monotonic() < end:
        for key, _ in sel.select(timeout=max(0.0, end - time.monotonic())):
            _read(key, sel)


def _message_complete(info: _Rank) -> bool:
    return info.received >= 8 and info.received == len(info.result)


def _died(info: _Rank) -> None:
    if info.ours:
        code = os.waitstatus_to_exitcode(os.waitpid(info.pid, 0)[1])
    else:
        code = fresh.exit_code(info.pid)
    info.reaped = True
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    if code == SETUP_FAILED:
        how += " while setting itself up (before running fn)"
    raise LaunchError(f"rank {info.rank} {how} before sending a result (out of memory, a crash in "
                      "C++ code, or os._exit/sys.exit inside fn).")


def _finish(info: _Rank) -> None:
    """Turn a finished rank's result bytes into a value, or raise its error."""
    kind, payload = decode(info.result)
    info.result = bytearray()                 # the value (sharing the buffer) lives in info.message
    if kind == "error":
        raise RankError(info.rank, payload)
    if kind == "unpicklable":
        raise LaunchError(f"rank {info.rank} returned a value that cannot be sent back to the notebook "
                          f"({payload}). Return plain data: numbers, lists, dicts, numpy arrays or CPU "
                          "tensors (call .cpu() / .detach()), not modules, generators or open handles.")
    info.message = (kind, payload)
