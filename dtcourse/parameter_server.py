"""Parameter servers: server ranks own the parameters, worker ranks push gradients and pull parameters.

The design of DistBelief (Dean et al., "Large Scale Distributed Deep Networks", NeurIPS 2012) and
of Li et al. ("Scaling Distributed Machine Learning with the Parameter Server", OSDI 2014). Ranks
``0 .. k-1`` are **servers**: the flat parameter vector is cut into k key ranges of nearly equal
size (``shard_ranges``), and server j keeps range j and the optimizer state for it. The other N
ranks are **workers**: each pulls every range, computes a gradient on its own slice of the data,
and pushes each range of the gradient to its owner; a push also asks for the next iteration's
parameters. Workers never talk to each other. The server speaks first: it sends every worker the
parameters of iteration 0 before it receives anything.

When a server applies a push, and when it answers a pull, is the consistency model:

* ``mode="sync"``: the server waits for all N gradients of iteration c, averages them and steps
  once. This is synchronous SGD, the same steps as one process on the averaged gradients.
* ``mode="ssp", bound=s``: Stale Synchronous Parallel (Ho et al., "More Effective Distributed ML
  via a Stale Synchronous Parallel Parameter Server", NeurIPS 2013). Each push is applied the
  moment it arrives, as 1/N of a round's update, so N pushes move the parameters as far as one
  synchronous step. A worker's **clock** is the number of its pushes applied; a worker that asks for
  the parameters of iteration c waits while c - (the slowest clock) > s. With s = 0 every worker
  computes iteration c on the same parameters (with plain SGD, the result is sync's, up to rounding).
* ``mode="async"``: ``ssp`` with s = inf. Nobody ever waits (DistBelief's Downpour SGD).

The server's **version** is the newest iteration its parameters contain: the largest clock (in
sync, the number of steps). A push of iteration c computed on version v is late by the newer
iterations that reached the server meanwhile, ``staleness = max(0, version - max(v, c + 1))``
(``staleness``), with version read just before the push is applied: 0 for every push in sync, at
most s under SSP, unbounded in async (a straggler's gradients arrive many iterations late).

Transport: torch.distributed point-to-point messages (``isend``/``irecv`` with tags), not
``torch.distributed.rpc``. ``dtcourse.launch`` already gives every rank a gloo process group, while
RPC needs its own agent and rendezvous in every process and is in maintenance mode upstream. With
plain messages every byte is visible, so each rank counts what it sends and receives per link with
lesson 01's ``ByteCounter``, and a server waits for a request with a deadline, so a worker that hangs
or dies ends the run with an error that names it (``WorkerFailure``) instead of a silent wait.

Example::

    run = train(PSConfig(world_size=4, mode="ssp", bound=1, steps=20, delays=(0, 0, 0.02)))
    run.params, [u.staleness for u in run.updates], run.busiest_link()
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from dtcourse.collectives import ByteCounter, Message, chunk_sizes
from dtcourse.launcher import LaunchError, RankError, launch
from dtcourse.models import MLP, regression_batch

__all__ = ["PSConfig", "Fault", "Problem", "Request", "Update", "ServerBase", "ParameterServer",
           "WorkerFailure", "ParameterServerError", "WorkerTrace", "ServerResult", "PSRun", "shard_ranges",
           "staleness", "run_worker", "ps_rank", "train", "reference_sgd", "MODES"]

MODES = ("sync", "ssp", "async")
FAULTS = ("hang", "crash", "raise")
TAG_PUSH, TAG_GRAD, TAG_REPLY, TAG_PARAMS = 1, 2, 3, 4   # a push is a header then a gradient; a reply too


@dataclass(frozen=True)
class Fault:
    """Make worker ``worker`` fail as iteration ``step`` starts: ``"hang"``, ``"crash"`` (exit) or ``"raise"``."""

    worker: int
    step: int
    kind: str = "hang"


@dataclass(frozen=True)
class PSConfig:
    """Who is a server, the consistency mode, and how a run goes. Checks itself when built."""

    world_size: int
    num_servers: int = 1
    mode: str = "sync"
    bound: float | None = None        # ssp only: s, the most iterations a worker may lead the slowest
    steps: int = 10                   # iterations per worker
    lr: float = 0.1
    momentum: float = 0.0
    delays: tuple[float, ...] = ()    # seconds worker i sleeps in its slow iterations: a straggler
    delay_period: int = 1             # worker i is slow in iterations c with (c - i) % period == 0
    timeout: float = 10.0             # seconds a server waits for a worker that owes it a message
    fault: Fault | None = None

    def __post_init__(self) -> None:
        name = "PSConfig"
        if not isinstance(self.world_size, int) or self.world_size < 2:
            raise ValueError(f"{name}: a parameter server needs at least one server and one worker, so "
                             f"world_size must be an integer >= 2, got {self.world_size!r}.")
        if not isinstance(self.num_servers, int) or self.num_servers < 1:
            raise ValueError(f"{name}: num_servers must be an integer >= 1, got {self.num_servers!r}.")
        if self.num_servers >= self.world_size:
            raise ValueError(f"{name}: num_servers={self.num_servers} leaves "
                             f"{self.world_size - self.num_servers} workers in world_size={self.world_size}; "
                             f"at least one worker is needed: use num_servers <= {self.world_size - 1}.")
        if self.mode not in MODES:
            raise ValueError(f"{name}: mode must be one of {MODES}, got {self.mode!r}.")
        if self.mode == "ssp":
            s = self.bound
            if s is None or isinstance(s, bool) or not isinstance(s, (int, float)) or s < 0:
                raise ValueError(f"{name}: mode='ssp' needs a staleness bound s >= 0 (0 is synchronous, "
                                 f"math.inf asynchronous), got bound={s!r}.")
            if s != math.inf and s != int(s):
                raise ValueError(f"{name}: the bound counts iterations: an integer or math.inf, got {s!r}.")
        elif self.bound is not None:
            raise ValueError(f"{name}: bound is for mode='ssp' only (sync is s=0, async s=inf), "
                             f"got bound={self.bound!r} with mode={self.mode!r}.")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"{name}: steps must be an integer >= 1, got {self.steps!r}.")
        if not self.lr > 0 or not 0 <= self.momentum < 1:
            raise ValueError(f"{name}: need lr > 0 and 0 <= momentum < 1, got lr={self.lr!r}, "
                             f"momentum={self.momentum!r}.")
        if not self.timeout > 0:
            raise ValueError(f"{name}: timeout must be > 0 seconds, got {self.timeout!r}.")
        if not isinstance(self.delay_period, int) or self.delay_period < 1:
            raise ValueError(f"{name}: delay_period must be an integer >= 1 (1: slow in every iteration), "
                             f"got {self.delay_period!r}.")
        if len(self.delays) > self.num_workers:
            raise ValueError(f"{name}: {len(self.delays)} delays given for {self.num_workers} workers.")
        for i, d in enumerate(self.delays):
            if not 0 <= d < self.timeout:
                raise ValueError(f"{name}: worker {i}'s delay {d!r} s must be >= 0 and below timeout "
                                 f"({self.timeout} s), or the server would report it as hung.")
        f = self.fault
        if f is not None and (f.kind not in FAULTS or not 0 <= f.worker < self.num_workers
                              or not 0 <= f.step < self.steps):
            raise ValueError(f"{name}: fault {f} needs kind in {FAULTS}, worker in [0, {self.num_workers}) "
                             f"and step in [0, {self.steps}).")

    @property
    def num_workers(self) -> int:
        return self.world_size - self.num_servers

    @property
    def staleness_bound(self) -> float:
        """s: 0 for sync, the bound for ssp, inf for async."""
        return {"sync": 0, "async": math.inf}.get(self.mode, self.bound)

    def role(self, rank: int) -> str:
        """'server j (rank r)' or 'worker i (rank r)', as error messages name ranks."""
        if rank < self.num_servers:
            return f"server {rank} (rank {rank})"
        return f"worker {rank - self.num_servers} (rank {rank})"


@dataclass(frozen=True)
class Problem:
    """Least squares on dtcourse's MLP; worker w's batch at iteration c is its slice of global batch c.

    Global batch c is ``regression_batch(rows * N, seed=c)`` and worker w takes rows
    ``[w * rows, (w + 1) * rows)``, so the N workers of one round see the batch one process would.
    """

    sizes: tuple[int, ...] = (16, 32, 4)
    rows: int = 8
    dtype: torch.dtype = torch.float32
    seed: int = 0

    def model(self) -> nn.Module:
        return MLP(self.sizes, seed=self.seed).to(self.dtype)

    def batch(self, clock: int, worker: int, num_workers: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = regression_batch(self.rows * num_workers, self.sizes[0], self.sizes[-1], seed=clock)
        mine = slice(worker * self.rows, (worker + 1) * self.rows)
        return x[mine].to(self.dtype), y[mine].to(self.dtype)       # (rows, in), (rows, out)

    def eval_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = regression_batch(256, self.sizes[0], self.sizes[-1], seed=10**6)   # never a training batch
        return x.to(self.dtype), y.to(self.dtype)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)


def shard_ranges(numel: int, num_servers: int) -> list[tuple[int, int]]:
    """Key ranges ``[lo, hi)`` of the flat parameters, one per server, sizes differing by at most one."""
    bounds = [0]
    for size in chunk_sizes(numel, num_servers):
        bounds.append(bounds[-1] + size)
    return list(zip(bounds[:-1], bounds[1:]))


def staleness(version: int, read_version: int, clock: int) -> int:
    """Iterations newer than both the parameters read and the push's own iteration ``clock`` that
    reached the server before the push is applied (``version``: the server's, just before)."""
    return max(0, version - max(read_version, clock + 1))


class WorkerFailure(RuntimeError):
    """A rank stopped waiting for another that owed it a message; ``worker`` names the worker."""

    def __init__(self, message: str, worker: int | None = None):
        super().__init__(message)
        self.worker = worker


class ParameterServerError(RuntimeError):
    """A run failed; the message names the role of the rank that failed or hung."""


# --------------------------------------------------------------------------- #
# Messages, counted as lesson 01 counts them
# --------------------------------------------------------------------------- #
def _isend(tensor, dst: int, tag: int, group, counter: ByteCounter, phase: str, step: int, chunk: int):
    counter.sent += tensor.nbytes
    counter.messages.append(Message(phase, step, dist.get_rank(group), dst, chunk, tensor.nbytes))
    return dist.isend(tensor, group=group, group_dst=dst, tag=tag)


def _wait(work, seconds: float | None) -> None:
    # A gloo receive that times out also closes its connection, so a timeout here is final.
    if seconds is None:
        work.wait()
    else:
        work.wait(timeout=timedelta(seconds=max(seconds, 1e-3)))


def _recv(tensor, src: int | None, tag: int, group, counter: ByteCounter, seconds: float | None):
    work = dist.irecv(tensor, group=group, group_src=src, tag=tag)   # src None: from any rank
    _wait(work, seconds)
    counter.received += tensor.nbytes
    return work


@dataclass(frozen=True)
class Request:
    """A push: worker ``worker``'s gradient of iteration ``clock``, computed on version ``read_version``."""

    worker: int
    clock: int
    read_version: int
    grad: torch.Tensor       # (hi - lo,) this server's range


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

    def next_request(self, owed: Mapping[int, float]) -> Request:
        """The next push from any worker. ``owed`` maps each worker that owes this server a push to the
        ``time.perf_counter()`` since when; past ``config.timeout`` this raises ``WorkerFailure``."""
        header = torch.empty(2, dtype=torch.int64)          # [clock, read_version]
        limit = None if not owed else min(owed.values()) + self.config.timeout - time.perf_counter()
        try:
            work = _recv(header, None, TAG_PUSH, self.group, self.counter, limit)   # from any worker
        except RuntimeError as err:
            raise self._failure(owed, err) from None
        src = work._source_rank()                            # the group rank it came from
        clock, read_version = header.tolist()
        worker = src - self.config.num_servers
        grad = torch.empty(self.hi - self.lo, dtype=self.shard.dtype)           # (hi - lo,)
        try:                                                 # receives (hi - lo) * itemsize bytes
            _recv(grad, src, TAG_GRAD, self.group, self.counter, self.config.timeout)
        except RuntimeError as err:
            raise self._failure({worker: time.perf_counter() - self.config.timeout}, err) from None
        return Request(worker, clock, read_version, grad)

    def _failure(self, owed: Mapping[int, float], err: RuntimeError) -> WorkerFailure:
        now, cfg = time.perf_counter(), self.config
        late = sorted(w for w, since in owed.items() if now - since >= 0.9 * cfg.timeout) or sorted(owed)
        names = ", ".join(cfg.role(cfg.num_servers + w) for w in late)
        why = (f"sent nothing for {cfg.timeout:g} s (timeout)" if "imed out" in str(err)
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


# --------------------------------------------------------------------------- #
# Workers
# --------------------------------------------------------------------------- #
@dataclass
class WorkerTrace:
    """What one worker did, iteration by iteration (times are ``time.perf_counter()`` seconds)."""

    worker: int
    rank: int
    losses: list[float] = field(default_factory=list)        # on its own mini-batch
    eval_losses: list[float] = field(default_factory=list)   # on a fixed held-out batch, at the read
    read_versions: list[int] = field(default_factory=list)   # server 0's version it computed on
    applied: list[int] = field(default_factory=list)         # gradients server 0 had applied by then
    spans: list[tuple[str, str, float, float]] = field(default_factory=list)   # wait / delay / compute
    pushed_sum: torch.Tensor | None = None                    # (P,) float64 sum of every gradient pushed
    counter: ByteCounter = field(default_factory=ByteCounter)


def _fail(fault: Fault, worker: int, step: int) -> None:
    if fault is None or (fault.worker, fault.step) != (worker, step):
        return
    if fault.kind == "hang":
        time.sleep(10**6)                                     # until the run ends and kills the rank
    if fault.kind == "crash":
        os._exit(1)
    raise RuntimeError(f"worker {worker}: failure injected at iteration {step}")


def run_worker(config: PSConfig, problem: Problem = Problem(), group=None) -> WorkerTrace:
    """One worker rank: pull every range, compute a gradient on its own data, push each range to its owner."""
    rank, k, n = dist.get_rank(group), config.num_servers, config.num_workers
    w = rank - k
    trace = WorkerTrace(w, rank)
    model = problem.model()
    flat = parameters_to_vector(model.parameters()).detach()                  # (P,) filled by pulls
    ranges = shard_ranges(flat.numel(), k)
    trace.pushed_sum = torch.zeros(flat.numel(), dtype=torch.float64)
    delay = config.delays[w] if w < len(config.delays) else 0.0
    patience = 2 * config.timeout + delay      # longer than any server's own deadline for a worker
    sends = []                     # the server speaks first: the parameters of iteration 0
    eval_x, eval_y = problem.eval_batch()
    for c in range(config.steps):
        start = time.perf_counter()
        read = []                                             # each server's version, as read
        for j, (lo, hi) in enumerate(ranges):
            header = torch.empty(2, dtype=torch.int64)                         # [version, applied]
            try:
                _recv(header, j, TAG_REPLY, group, trace.counter, patience)
                _recv(flat[lo:hi], j, TAG_PARAMS, group, trace.counter, patience)   # a pull of range j
            except RuntimeError as err:
                # Most often the server is giving up on another worker and its report, which names
                # that worker, is on its way to launch: let it arrive first.
                time.sleep(1.0)
                raise WorkerFailure(f"{config.role(rank)} lost {config.role(j)} while waiting for the "
                                    f"parameters of iteration {c}: {str(err).splitlines()[0][:160]}") from None
            read.append(int(header[0]))
            if j == 0:
                trace.read_versions.append(int(header[0]))
                trace.applied.append(int(header[1]))
        pulled = time.perf_counter()
        trace.spans.append(("wait", f"pull {c}", start, pulled))
        for work in sends:
            work.wait()                                   # last iteration's pushes: delivered by now
        with torch.no_grad():
            vector_to_parameters(flat, model.parameters())
            trace.eval_losses.append(problem.loss(model, eval_x, eval_y).item())
        _fail(config.fault, w, c)
        if delay and (c - w) % config.delay_period == 0:
            time.sleep(delay)                             # the straggler's extra time
            trace.spans.append(("delay", f"iteration {c}", pulled, time.perf_counter()))
        begin = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss = problem.loss(model, *problem.batch(c, w, n))
        loss.backward()
        grad = parameters_to_vector([p.grad for p in model.parameters()])     # (P,)
        trace.losses.append(loss.item())
        trace.pushed_sum += grad.double()
        trace.spans.append(("compute", f"iteration {c}", begin, time.perf_counter()))
        sends = []
        for j, (lo, hi) in enumerate(ranges):            # sends (hi - lo) * itemsize bytes to server j
            sends.append(_isend(torch.tensor([c, read[j]]), j, TAG_PUSH, group, trace.counter, "header", c, j))
            sends.append(_isend(grad[lo:hi], j, TAG_GRAD, group, trace.counter, "push", c, j))
    for work in sends:
        work.wait()
    return trace


# --------------------------------------------------------------------------- #
# A whole run
# --------------------------------------------------------------------------- #
def ps_rank(config: PSConfig, problem: Problem = Problem(), server_cls: type = ParameterServer,
            group=None) -> ServerResult | WorkerTrace:
    """Inside every rank of a launch: ranks below ``num_servers`` serve, the others work."""
    size = dist.get_world_size(group)
    if size != config.world_size:
        raise ValueError(f"PSConfig.world_size is {config.world_size} but the process group has {size} ranks.")
    dist.barrier(group=group)                            # every rank ready: the clocks start together
    if dist.get_rank(group) < config.num_servers:
        return server_cls(config, problem, group).serve()
    return run_worker(config, problem, group)


@dataclass
class PSRun:
    """The result of ``train``: the final parameters and what every rank recorded."""

    config: PSConfig
    params: torch.Tensor                  # (P,) the servers' ranges, joined
    servers: list[ServerResult]
    workers: list[WorkerTrace]

    @property
    def updates(self) -> list[Update]:
        return [u for s in self.servers for u in s.updates]

    @property
    def origin(self) -> float:
        """When the first worker started waiting for its first pull (``time.perf_counter()``)."""
        return min(t.spans[0][2] for t in self.workers)

    @property
    def seconds(self) -> float:
        """From ``origin`` to the last push of the last worker."""
        return max(t.spans[-1][3] for t in self.workers) - self.origin

    def link_bytes(self, phases: tuple[str, ...] = ("push", "pull")) -> dict[tuple[int, int], int]:
        """Bytes sent over each link ``(src, dst)``, from the senders' counters, in ``phases``."""
        links: dict[tuple[int, int], int] = {}
        for counter in [s.counter for s in self.servers] + [t.counter for t in self.workers]:
            for m in counter.messages:
                if m.phase in phases:
                    links[m.src, m.dst] = links.get((m.src, m.dst), 0) + m.nbytes
        return links

    def busiest_link(self, phases: tuple[str, ...] = ("push", "pull")) -> tuple[int, float]:
        """``(rank, bytes per iteration)`` of the rank whose link carries most in one direction."""
        sent, received = {}, {}
        for (src, dst), nbytes in self.link_bytes(phases).items():
            sent[src] = sent.get(src, 0) + nbytes
            received[dst] = received.get(dst, 0) + nbytes
        load = {r: max(sent.get(r, 0), received.get(r, 0)) for r in set(sent) | set(received)}
        rank = max(load, key=load.get)
        return rank, load[rank] / self.config.steps

    def seconds_per_iteration(self) -> list[float]:
        """Each worker's mean time per iteration, from its first pull to its last push."""
        return [(t.spans[-1][3] - t.spans[0][2]) / self.config.steps for t in self.workers]


def train(config: PSConfig, problem: Problem = Problem(), server_cls: type = ParameterServer,
          timeout: float | None = None) -> PSRun:
    """Launch ``config.world_size`` ranks, run the parameter server, and gather the results."""
    if timeout is None:                 # generous: the servers' own deadlines fire long before
        timeout = 30 + 3 * config.timeout + config.steps * max(config.delays, default=0)
    try:
        results = launch(ps_rank, config.world_size, config, problem, server_cls, timeout=timeout)
    except RankError as err:
        last = err.remote_traceback.strip().splitlines()[-1]
        kind, _, message = last.partition(": ")
        last = f"{kind.rsplit('.', 1)[-1]}: {message}" if message else last       # drop the module path
        raise ParameterServerError(f"{config.role(err.rank)} failed: {last}") from err
    except LaunchError as err:
        text = str(err)
        for rank in range(config.world_size):
            text = text.replace(f"rank {rank} ", f"{config.role(rank)} ", 1)
        raise ParameterServerError(text) from err
    except TimeoutError as err:
        k = config.num_servers
        raise TimeoutError(f"{err}\n(ranks 0-{k - 1} are the servers; rank {k} + i is worker i)") from None
    servers, workers = results[:config.num_servers], results[config.num_servers:]
    return PSRun(config, torch.cat([s.shard for s in servers]), servers, workers)


def reference_sgd(config: PSConfig, problem: Problem = Problem()) -> torch.Tensor:
    """One process, ``config.steps`` SGD steps on the N workers' averaged gradients: sync's answer."""
    model = problem.model()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=config.lr, momentum=config.momentum)
    n = config.num_workers
    for c in range(config.steps):
        grads = []
        for w in range(n):
            model.zero_grad(set_to_none=True)
            problem.loss(model, *problem.batch(c, w, n)).backward()
            grads.append(parameters_to_vector([p.grad for p in params]))      # (P,)
        mean = torch.stack(grads).mean(0)                                      # (N, P) -> (P,)
        for p, g in zip(params, mean.split([p.numel() for p in params])):
            p.grad = g.view_as(p)
        optimizer.step()
    return parameters_to_vector(params).detach()
