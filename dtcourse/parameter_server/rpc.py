"""The parameter server in the form PyTorch's RPC tutorials give it: a remote object, RRefs,
distributed autograd and ``DistributedOptimizer``.

``torch.distributed.rpc`` lets a process run a function in another (``rpc_sync``, ``rpc_async``) or
build an object there and keep a remote reference to it (``rpc.remote`` returns an ``RRef``; calls
on ``rref.rpc_sync()`` run the object's methods where it lives). The server is then an object that
workers call. Here, with the key ranges of the message-based server (``shard_ranges``):

* server j (rank j) holds a ``ParameterHolder``: its key range of the flat parameters, one
  ``nn.Parameter``. Server 0 builds every holder (``rpc.remote``) and starts the workers' loops
  (``rpc_async``), handing each the holders' RRefs: the "master" of the tutorials;
* a worker, inside a **distributed autograd** context, *pulls* every range with
  ``holder.rpc_sync().pull()``. The tensors that come back are recorded in the context's graph, so
  ``dist_autograd.backward`` sends each range's gradient back to its server, where it waits in the
  context (never in ``.grad``);
* ``DistributedOptimizer.step(context)`` asks every server to run the optimizer on that context's
  gradients.

Each worker steps the parameters with its own gradient as soon as it has one, so this form is
asynchronous by construction. ``synchronous=True`` makes server 0's holder a gate, a barrier of the
N workers: a pull waits until all N have asked (so iteration c-1's N steps are all in), and
``arrive`` waits until all N have finished backward (so nobody steps before everyone has pulled).
With the loss divided by N, the N steps of lr·g_w/N on the same parameters add up to one step of
lr·mean(g): the course's synchronous server (``train``), up to the order of the additions. That
holds for plain SGD only: each worker's ``DistributedOptimizer`` builds its own optimizer object
on each server, so momentum would be kept per worker. The message-based server steps once per
round; here a round is N steps.

Start-up: RPC needs its own rendezvous and agent. ``launch``'s ranks already share a gloo group, so
rank 0 makes a fresh file for a ``FileStore``, broadcasts its name, and every rank calls
``rpc.init_rpc`` with ``init_method="file://..."`` (no port to pick, so no port to race for);
TensorPipe listens on loopback.

    run = rpc_train(PSConfig(world_size=4, steps=5, lr=0.1))      # sync: the same parameters as train()
    run.params, run.servers[0].calls, run.startup_seconds
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
from torch.distributed.optim import DistributedOptimizer
from torch.func import functional_call
from torch.nn.utils import parameters_to_vector

from dtcourse.parameter_server.config import Problem, PSConfig
from dtcourse.parameter_server.messages import shard_ranges
from dtcourse.runtime.launch import launch

__all__ = ["ParameterHolder", "HolderStats", "RPCRun", "rpc_train", "rpc_rank", "rpc_worker"]


@dataclass
class HolderStats:
    """What one server's holder saw: calls by name, and tensor bytes out (pulls) and in (gradients)."""

    index: int
    lo: int
    hi: int
    shard: torch.Tensor                  # (hi - lo,) the final values
    calls: dict[str, int]
    bytes_out: int
    bytes_in: int
    grad_sum: torch.Tensor               # (hi - lo,) float64: every gradient that arrived, added up


class _CountedSGD(torch.optim.SGD):
    """SGD that tells its holder about each step. (A subclass also keeps ``DistributedOptimizer`` on
    the plain Python optimizer; for ``torch.optim.SGD`` itself it would compile a TorchScript one.)"""

    def __init__(self, params, holders: list[rpc.RRef], lr: float):
        super().__init__(params, lr=lr)
        self.holder = next(h.local_value() for h in holders if h.is_owner())

    def step(self, closure=None):
        self.holder.count("optimizer step")
        return super().step(closure)


class ParameterHolder:
    """Lives on server j: key range [lo, hi) of the parameters, and (server 0, sync) the workers' gate."""

    def __init__(self, index: int, lo: int, hi: int, values: torch.Tensor, num_workers: int, gate: bool,
                 timeout: float):
        self.index, self.lo, self.hi = index, lo, hi
        self.shard = nn.Parameter(values.clone())                                 # (hi - lo,)
        self.gate = threading.Barrier(num_workers) if gate else None
        self.timeout = timeout
        self.calls: dict[str, int] = {}
        self.bytes_out = self.bytes_in = 0
        self.grad_sum = torch.zeros(hi - lo, dtype=torch.float64)
        self.lock = threading.Lock()                         # RPC runs calls on a pool of threads
        self.shard.register_hook(self._gradient_arrived)     # distributed autograd calls it too

    def count(self, name: str, bytes_out: int = 0, bytes_in: int = 0) -> None:
        with self.lock:
            self.calls[name] = self.calls.get(name, 0) + 1
            self.bytes_out += bytes_out
            self.bytes_in += bytes_in

    def _gradient_arrived(self, grad: torch.Tensor) -> None:
        self.count("gradient", bytes_in=grad.nbytes)            # receives (hi - lo) * itemsize bytes
        with self.lock:
            self.grad_sum += grad.double()

    def param_rrefs(self) -> list[rpc.RRef]:
        """What ``DistributedOptimizer`` needs: an RRef to each parameter it steps."""
        return [rpc.RRef(self.shard)]

    def pull(self) -> torch.Tensor:
        """The current values of this range (with the gate: once all N workers have asked)."""
        if self.gate is not None:
            self.gate.wait(self.timeout)                     # raises BrokenBarrierError on a hung worker
        self.count("pull", bytes_out=self.shard.nbytes)          # sends (hi - lo) * itemsize bytes
        # A copy, which autograd records: the reply then carries a link back to the shard, so
        # the worker's backward reaches it. (The Parameter itself would arrive as a new leaf.)
        return self.shard.clone()

    def arrive(self) -> None:
        """Sync only: wait until all N workers have finished backward, then let them step."""
        self.count("arrive")
        self.gate.wait(self.timeout)

    def result(self) -> HolderStats:
        with self.lock:
            return HolderStats(self.index, self.lo, self.hi, self.shard.detach().clone(), dict(self.calls),
                               self.bytes_out, self.bytes_in, self.grad_sum.clone())


def _name(config: PSConfig, rank: int) -> str:
    return f"server{rank}" if rank < config.num_servers else f"worker{rank - config.num_servers}"


def rpc_worker(holders: list[rpc.RRef], config: PSConfig, problem: Problem, worker: int) -> list[float]:
    """One worker's loop, run on its rank by an RPC from server 0; returns its losses."""
    n, model = config.num_workers, problem.model()
    names = [name for name, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    param_rrefs = [r for h in holders for r in h.rpc_sync().param_rrefs()]
    optimizer = DistributedOptimizer(_CountedSGD, param_rrefs, holders=holders, lr=config.lr)
    losses = []
    for c in range(config.steps):
        with dist_autograd.context() as context:
            flat = torch.cat([h.rpc_sync().pull() for h in holders])                 # (P,) from k servers
            params = dict(zip(names, (t.view(s) for t, s in zip(flat.split([s.numel() for s in shapes]), shapes))))
            loss = problem.loss(lambda x: functional_call(model, params, (x,)), *problem.batch(c, worker, n))
            dist_autograd.backward(context, [loss / n])      # each range's gradient goes back to its server
            if config.mode == "sync":
                holders[0].rpc_sync().arrive()
            optimizer.step(context)                          # every server steps on this worker's gradient
        losses.append(loss.item())
    return losses


@dataclass
class RPCRun:
    """The result of ``rpc_train``: final parameters, each holder's counts, each worker's losses."""

    config: PSConfig
    params: torch.Tensor               # (P,)
    servers: list[HolderStats]
    losses: list[list[float]]
    startup_seconds: float             # rpc.init_rpc on server 0
    seconds: float                     # the workers' loops, from server 0

    def calls_per_iteration(self) -> dict[str, float]:
        """Calls each server handled per worker iteration, by kind, averaged over servers."""
        per = self.config.num_workers * self.config.steps * len(self.servers)
        total: dict[str, int] = {}
        for s in self.servers:
            for name, count in s.calls.items():
                total[name] = total.get(name, 0) + count
        return {name: count / per for name, count in total.items()}


def _check(config: PSConfig) -> None:
    if config.mode == "ssp" or config.momentum or config.delays or config.fault:
        raise ValueError("rpc_train runs mode='sync' or 'async' with plain SGD (momentum=0), no delays and no "
                         f"fault: got mode={config.mode!r}, momentum={config.momentum!r}, delays={config.delays!r}, "
                         f"fault={config.fault!r}.")


def rpc_rank(config: PSConfig, problem: Problem = Problem()) -> RPCRun | None:
    """Inside every rank of a launch: join RPC; server 0 runs the job; every rank leaves together."""
    _check(config)
    rank, k, n = dist.get_rank(), config.num_servers, config.num_workers
    name = torch.zeros(4096, dtype=torch.uint8)      # the rendezvous file's name, sent over launch's gloo group
    if rank == 0:
        handle, made = tempfile.mkstemp(prefix="dtcourse-rpc-")
        os.close(handle)
        name[:len(made.encode())] = torch.frombuffer(bytearray(made.encode()), dtype=torch.uint8)
    dist.broadcast(name, src=0)
    path = bytes(name[name > 0].tolist()).decode()
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    # Inside this rank only: rpc's own set-up warns about gloo internals, and DistributedOptimizer
    # warns that our SGD subclass is not TorchScript (that is the point: see _CountedSGD).
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
    logging.getLogger("torch.distributed.optim.optimizer").setLevel(logging.ERROR)
    start = time.perf_counter()
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{path}", rpc_timeout=2 * config.timeout,
                                              num_worker_threads=max(16, 2 * n + 4))
    rpc.init_rpc(_name(config, rank), rank=rank, world_size=config.world_size, rpc_backend_options=options)
    startup = time.perf_counter() - start
    result = None
    try:
        if rank == 0:
            flat = parameters_to_vector(problem.model().parameters()).detach()       # (P,)
            holders = [rpc.remote(_name(config, j), ParameterHolder,
                                  args=(j, lo, hi, flat[lo:hi], n, j == 0 and config.mode == "sync", config.timeout))
                       for j, (lo, hi) in enumerate(shard_ranges(flat.numel(), k))]
            begin = time.perf_counter()
            futures = [rpc.rpc_async(_name(config, k + w), rpc_worker, args=(holders, config, problem, w))
                       for w in range(n)]
            losses = [f.wait() for f in futures]
            seconds = time.perf_counter() - begin
            stats = [h.rpc_sync().result() for h in holders]
            result = RPCRun(config, torch.cat([s.shard for s in stats]), stats, losses, startup, seconds)
    finally:
        rpc.shutdown()                                        # waits for every rank's outstanding work
        dist.barrier()                                        # every rank is done with the file's store
        if rank == 0:
            os.unlink(path)
    return result


def rpc_train(config: PSConfig, problem: Problem = Problem(), timeout: float = 60.0) -> RPCRun:
    """Launch ``config.world_size`` ranks and run the RPC parameter server; return server 0's ``RPCRun``."""
    _check(config)
    return launch(rpc_rank, config.world_size, config, problem, timeout=timeout)[0]
