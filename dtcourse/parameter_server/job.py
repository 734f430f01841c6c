"""A whole parameter-server job: ``train`` launches the ranks (``ps_rank`` in each), turns a rank's
failure into a ``ParameterServerError`` that names its role, and joins the results into a
``PSRun``; ``reference_sgd`` is the one-process run that sync must match.

    run = train(PSConfig(world_size=4, mode="async", steps=20))
    run.params, run.updates, run.busiest_link(), run.seconds_per_iteration()
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from dtcourse.runtime.launch import LaunchError, LaunchTimeout, RankError, launch
from dtcourse.parameter_server.config import Problem, PSConfig
from dtcourse.parameter_server.server import ParameterServer, ServerResult, Update
from dtcourse.parameter_server.worker import WorkerTrace, run_worker

class ParameterServerError(RuntimeError):
    """A rank failed; the message names its role. ``rank`` is that rank (None if unknown) and
    ``error`` the name of the exception it raised (``"WorkerFailure"``; None if it crashed)."""

    def __init__(self, message: str, rank: int | None = None, error: str | None = None):
        super().__init__(message)
        self.rank, self.error = rank, error


def ps_rank(config: PSConfig, problem: Problem = Problem(), server_cls: type = ParameterServer,
            group=None) -> ServerResult | WorkerTrace:
    """Inside every rank of a launch: ranks below ``num_servers`` serve, the others work."""
    size = dist.get_world_size(group)
    if size != config.world_size:
        raise ValueError(f"PSConfig.world_size is {config.world_size} but the process group has {size} ranks.")
    # A server builds its shard and optimizer before the barrier, so a worker's first wait for
    # the parameters measures the protocol, not the server's set-up.
    server = server_cls(config, problem, group) if dist.get_rank(group) < config.num_servers else None
    dist.barrier(group=group)                            # every rank ready: the clocks start together
    return run_worker(config, problem, group) if server is None else server.serve()


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

    def machine_bytes(self, phases: tuple[str, ...] = ("push", "pull")) -> list[tuple[float, float]]:
        """``(out, in)`` bytes per iteration of machine j, when server j and worker j share machine j
        (k = N servers): only messages between two machines cross a machine's link."""
        k = self.config.num_servers
        if k != self.config.num_workers:
            raise ValueError(f"machine_bytes pairs server j with worker j: needs k = N, got k={k}, "
                             f"N={self.config.num_workers}.")
        home = [r if r < k else r - k for r in range(self.config.world_size)]       # rank -> machine
        out, into = [0] * k, [0] * k
        for (src, dst), nbytes in self.link_bytes(phases).items():
            if home[src] != home[dst]:
                out[home[src]] += nbytes
                into[home[dst]] += nbytes
        return [(o / self.config.steps, i / self.config.steps) for o, i in zip(out, into)]

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
        kind = kind.rsplit(".", 1)[-1]                                             # drop the module path
        text = f"{kind}: {message}" if message else kind
        raise ParameterServerError(f"{config.role(err.rank)} failed: {text}", err.rank, kind) from err
    except LaunchError as err:
        text = str(err)
        for rank in range(config.world_size):
            text = text.replace(f"rank {rank} ", f"{config.role(rank)} ", 1)
        raise ParameterServerError(text) from err
    except LaunchTimeout as err:
        # The same exception goes on, .stuck and .stacks included; the note names the stuck ranks' roles.
        err.add_note(f"Still running: {', '.join(config.role(r) for r in err.stuck)}.")
        raise
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
