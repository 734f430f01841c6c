"""A worker rank: pull every key range, compute a gradient on its own slice of the data, push each
range to its owner; ``WorkerTrace`` is what it records on the way. Workers never talk to each other.

    run_worker(config, problem, group)     # inside worker rank k + i (ps_rank calls it)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from dtcourse.collectives import ByteCounter
from dtcourse.parameter_server.config import Problem, PSConfig, _fail
from dtcourse.parameter_server.messages import (TAG_GRAD, TAG_PARAMS, TAG_PUSH, TAG_REPLY, WorkerFailure, _isend,
                                                _recv, shard_ranges)

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
            except (TimeoutError, RuntimeError) as err:
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
            header = torch.tensor([w, c, read[j]])                              # [worker, clock, read_version]
            sends.append(_isend(header, j, TAG_PUSH, group, trace.counter, "header", c, j))
            sends.append(_isend(grad[lo:hi], j, TAG_GRAD, group, trace.counter, "push", c, j))
    for work in sends:
        work.wait()
    return trace
