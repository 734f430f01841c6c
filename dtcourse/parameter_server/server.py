"""A server rank: ``ServerBase`` holds its key range, its optimizer and its side of the protocol;
a subclass's ``serve()`` is the consistency model, deciding when to apply a push and when to answer
a pull. ``ParameterServer`` is the course's loop (sync, or SSP with bound s; async is s = inf,
after Ho et al. 2013), and exercise 03 writes another on ``ServerBase``.

    ParameterServer(config, problem, group).serve()     # inside server rank j (ps_rank calls it)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.utils import parameters_to_vector

from dtcourse.collectives import ByteCounter
from dtcourse.parameter_server.config import Problem, PSConfig
from dtcourse.parameter_server.messages import (TAG_GRAD, TAG_PARAMS, TAG_PUSH, TAG_REPLY, Request, WorkerFailure,
                                                _isend, _recv, shard_ranges)

def staleness(version: int, read_version: int, clock: int) -> int:
    """Iterations newer than both the parameters read and the push's own iteration ``clock`` that
    reached the server before the push is applied (``version``: the server's, just before)."""
    return max(0, version - max(read_version, clock + 1))


@dataclass(frozen=True)
class Update:
    """One push as its server applied it (sync: as part of its round's step)."""

    server: int
    worker: int
    clock: int
    read_version: int
    version: int          # the server's version once this push is in
    staleness: int
    time: float           # time.perf_counter() when applied


@dataclass
class ServerResult:
    """What a server rank returns: its key range ``[lo, hi)``, its final values, its updates, its bytes."""

    index: int
    lo: int
    hi: int
    shard: torch.Tensor
    updates: list[Update]
    counter: ByteCounter


class ServerBase:
    """A server rank's transport and optimizer; a subclass writes ``serve()``, the loop that decides
    when to apply a push and when to answer a pull."""

    def __init__(self, config: PSConfig, problem: Problem = Problem(), group=None):
        self.config, self.group = config, group
        self.index = dist.get_rank(group)                  # server j is rank j
        self.num_workers, self.steps, self.bound = config.num_workers, config.steps, config.staleness_bound
        flat = parameters_to_vector(problem.model().parameters()).detach()        # (P,)
        self.lo, self.hi = shard_ranges(flat.numel(), config.num_servers)[self.index]
        self.shard = nn.Parameter(flat[self.lo:self.hi].clone())                   # (hi - lo,) my keys
        self.optimizer = torch.optim.SGD([self.shard], lr=config.lr, momentum=config.momentum)
        self.version = 0           # the newest iteration in the parameters (sync: steps taken)
        self.applied = 0           # worker gradients folded into the parameters
        self.updates: list[Update] = []
        self.counter = ByteCounter()
        self._sends: dict[int, list] = {}
        self._held: Request | None = None      # a stalled push (config.stall), not yet handed out

    def next_request(self, owed: Mapping[int, float]) -> Request:
        """The next push from any worker. ``owed`` maps each worker that owes this server a push to the
        ``time.perf_counter()`` since when; past ``config.timeout`` this raises ``WorkerFailure``.

        A ``config.stall`` push is held back, as if still on its way, until no other worker owes one."""
        held = self._held
        others = {w: t for w, t in owed.items() if held is None or w != held.worker}
        if held is not None and not others:                  # nobody else can push: the stall ends
            self._held = None
            return held
        request = self._receive(others)
        stall = self.config.stall
        if stall is not None and (request.worker, request.clock) == (stall.worker, stall.step):
            self._held = request
            return self.next_request(owed)
        return request

    def _receive(self, owed: Mapping[int, float]) -> Request:
        header = torch.empty(3, dtype=torch.int64)          # [worker, clock, read_version]
        limit = None if not owed else min(owed.values()) + self.config.timeout - time.perf_counter()
        try:
            _recv(header, None, TAG_PUSH, self.group, self.counter, limit)         # from any worker
        except (TimeoutError, RuntimeError) as err:
            raise self._failure(owed, err) from None
        worker, clock, read_version = header.tolist()       # the header names its sender
        grad = torch.empty(self.hi - self.lo, dtype=self.shard.dtype)           # (hi - lo,)
        try:                                                 # receives (hi - lo) * itemsize bytes
            _recv(grad, self.config.num_servers + worker, TAG_GRAD, self.group, self.counter,
                  self.config.timeout)
        except (TimeoutError, RuntimeError) as err:
            raise self._failure({worker: time.perf_counter() - self.config.timeout}, err) from None
        return Request(worker, clock, read_version, grad)

    def _failure(self, owed: Mapping[int, float], err: Exception) -> WorkerFailure:
        now, cfg = time.perf_counter(), self.config
        late = sorted(w for w, since in owed.items() if now - since >= 0.9 * cfg.timeout) or sorted(owed)
        names = ", ".join(cfg.role(cfg.num_servers + w) for w in late)
        why = (f"sent nothing for {cfg.timeout:g} s (timeout)" if isinstance(err, TimeoutError)
               else f"dropped its connection ({str(err).splitlines()[0][:120]})")
        return WorkerFailure(f"{cfg.role(self.index)} gave up: {names} owed it a push and {why}; "
                             "it has hung or died.", late[0] if late else None)

    def apply(self, grad: torch.Tensor, gradients: int = 1) -> None:
        """One optimizer step on ``grad`` (this server's range), which folds in ``gradients`` pushes."""
        self.shard.grad = grad
        self.optimizer.step()
        self.applied += gradients

    def record(self, request: Request, late: int) -> None:
        """Note an applied push that was ``late`` iterations stale; call it once ``self.version`` includes it."""
        self.updates.append(Update(self.index, request.worker, request.clock, request.read_version,
                                   self.version, late, time.perf_counter()))

    def reply(self, worker: int) -> None:
        """Send ``worker`` this server's range of the parameters and ``[version, applied]``."""
        dst = self.config.num_servers + worker
        for work in self._sends.pop(worker, []):
            work.wait()                                      # the previous reply: long delivered
        header = torch.tensor([self.version, self.applied], dtype=torch.int64)
        params = self.shard.detach().clone()                 # a snapshot: the optimizer goes on
        self._sends[worker] = [  # sends (hi - lo) * itemsize bytes to the worker: a pull
            _isend(header, dst, TAG_REPLY, self.group, self.counter, "header", self.version, self.index),
            _isend(params, dst, TAG_PARAMS, self.group, self.counter, "pull", self.version, self.index)]

    def finish(self) -> ServerResult:
        for works in self._sends.values():
            for work in works:
                work.wait()
        return ServerResult(self.index, self.lo, self.hi, self.shard.detach().clone(), self.updates,
                            self.counter)

    def serve(self) -> ServerResult:
        raise NotImplementedError("a server subclass writes serve()")


class ParameterServer(ServerBase):
    """The course's server loop: sync, or ssp with bound s (async is s = inf)."""

    def serve(self) -> ServerResult:
        n, steps, s = self.num_workers, self.steps, self.bound
        clock = [0] * n            # iterations of each worker the parameters contain
        asked = [0] * n            # iteration each worker wants parameters for: its pushes received
        waiting = set(range(n))    # unanswered pulls: at first, everyone's for iteration 0
        owed: dict[int, float] = {}                            # workers that owe a push, since when
        this_round: dict[int, Request] = {}                    # sync: the round's pushes by worker
        while min(clock) < steps:
            slowest = min(clock)
            for u in sorted(waiting):
                if asked[u] - slowest <= s:                    # SSP: at most s iterations ahead
                    self.reply(u)
                    waiting.discard(u)
                    owed[u] = time.perf_counter()
            request = self.next_request(owed)
            w = request.worker
            del owed[w]
            asked[w] += 1
            if self.config.mode == "sync":
                this_round[w] = request
                if len(this_round) == n:                       # all N are in: average (in worker order), step
                    self.apply(torch.stack([this_round[u].grad for u in range(n)]).mean(0), n)
                    late = [staleness(self.version, r.read_version, r.clock) for r in this_round.values()]
                    clock = [c + 1 for c in clock]
                    self.version += 1
                    for r, late_by in zip(this_round.values(), late):
                        self.record(r, late_by)
                    this_round.clear()
            else:                                              # ssp / async: apply it now, as 1/N of a round
                late_by = staleness(self.version, request.read_version, request.clock)
                self.apply(request.grad / n)
                clock[w] += 1
                self.version = max(self.version, clock[w])
                self.record(request, late_by)
            if asked[w] < steps:
                waiting.add(w)                                 # it wants iteration asked[w] next
        return self.finish()
