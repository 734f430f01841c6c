"""What a parameter-server run is: ``PSConfig`` (roles, consistency mode, stragglers), a
``Stall``, the injected ``Fault`` and ``_fail`` that carries it out, and the ``Problem`` the workers train on.

    PSConfig(world_size=4, num_servers=1, mode="ssp", bound=1, delays=(0, 0, 0.02))
    PSConfig(world_size=5, mode="async", stall=Stall(worker=3, step=3))
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtcourse.models import MLP, regression_batch

MODES = ("sync", "ssp", "async")
FAULTS = ("hang", "crash", "raise")


@dataclass(frozen=True)
class Fault:
    """Make worker ``worker`` fail as iteration ``step`` starts: ``"hang"``, ``"crash"`` (exit) or ``"raise"``."""

    worker: int
    step: int
    kind: str = "hang"


@dataclass(frozen=True)
class Stall:
    """Worker ``worker`` stalls after computing its gradient of iteration ``step`` (a garbage-collection
    pause, a preempted machine) for as long as the other workers can go on without it.

    The length is set by the protocol, not by a clock: each server holds that push back until no
    other worker owes it one, because the others have finished (async) or wait at their bound (SSP,
    sync). So a run gives the same staleness on a quiet laptop and on a busy one.
    """

    worker: int
    step: int


def _fail(fault: Fault, worker: int, step: int) -> None:
    if fault is None or (fault.worker, fault.step) != (worker, step):
        return
    if fault.kind == "hang":
        time.sleep(10**6)                                     # until the run ends and kills the rank
    if fault.kind == "crash":
        os._exit(1)
    raise RuntimeError(f"worker {worker}: failure injected at iteration {step}")


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
    stall: Stall | None = None

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

        st = self.stall
        if st is not None and not (0 <= st.worker < self.num_workers and 0 <= st.step < self.steps):
            raise ValueError(f"{name}: stall {st} needs worker in [0, {self.num_workers}) and step in "
                             f"[0, {self.steps}).")

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


@dataclass(frozen=True)
class Quadratic(Problem):
    """Least squares on a linear model, ``y = x w*`` exactly: a quadratic bowl with its minimum at 0 loss.

    The loss ``mean((x w - y)^2)`` has curvature 2 along the first feature and 2 / ``condition`` along
    the last (feature i is scaled by ``condition ** (-i / (2 (dim - 1)))``); with ``condition=1`` the
    bowl is round and one synchronous SGD step multiplies the error by (1 - 2 lr) in every direction.
    A gradient computed on old parameters points back at the old, larger error, so it undoes
    progress made since: the clearest place to watch staleness cost loss.
    """

    dim: int = 8
    condition: float = 1.0

    def model(self) -> nn.Module:
        model = nn.Linear(self.dim, 1, bias=False).to(self.dtype)
        nn.init.zeros_(model.weight)                   # w = 0 to start: the same on every rank
        return model

    def _data(self, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        scales = self.condition ** (-torch.arange(self.dim) / (2 * (self.dim - 1)))             # (dim,)
        x = torch.randn(rows, self.dim, generator=g) * scales                                    # (rows, dim)
        w_star = torch.randn(self.dim, 1, generator=torch.Generator().manual_seed(self.seed))    # (dim, 1)
        return x.to(self.dtype), (x @ w_star).to(self.dtype)                                    # (rows, 1)

    def batch(self, clock: int, worker: int, num_workers: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self._data(self.rows * num_workers, seed=clock)
        mine = slice(worker * self.rows, (worker + 1) * self.rows)
        return x[mine], y[mine]

    def eval_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._data(256, seed=10**6)
