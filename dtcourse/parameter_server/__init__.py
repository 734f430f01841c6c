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
``torch.distributed.rpc``, so every byte is counted per link with lesson 01's ``ByteCounter``, and
a server waits for a push with a deadline, so a worker that hangs or dies ends the run with an
error that names it (``WorkerFailure``). ``messages.py`` says why.

The files, in the order a run uses them:

* ``config.py``: ``PSConfig`` (who serves, the mode, stragglers), ``Stall`` (a worker that stalls
  once, for as long as the protocol lets the others run), ``Fault`` (an injected failure),
  ``Problem`` (the model and each worker's data) and ``Quadratic`` (a least-squares bowl).
* ``messages.py``: the protocol: key ranges (``shard_ranges``), tags, counted sends and receives
  with deadlines, a push (``Request``) and ``WorkerFailure``.
* ``server.py``: ``ServerBase`` (a server's transport and optimizer, the base of exercise 03),
  ``staleness``, and ``ParameterServer``, the sync / SSP / async loop.
* ``worker.py``: ``run_worker``, a worker's pull, compute, push loop, and its ``WorkerTrace``.
* ``job.py``: ``train`` launches the ranks and gathers a ``PSRun``; ``reference_sgd`` is the
  one-process answer that sync must match.
* ``rpc.py``: the same server in the form of PyTorch's RPC tutorials (``rpc_train``: a remote
  parameter holder, RRefs, distributed autograd and ``DistributedOptimizer``).
* ``cartpole.py`` and ``actor_learner.py``: actors and a learner after Gorila and Ape-X
  (``act_and_learn``): experience flows to the learner, parameters flow back.

Example::

    run = train(PSConfig(world_size=4, mode="ssp", bound=1, steps=20, delays=(0, 0, 0.02)))
    run.params, [u.staleness for u in run.updates], run.busiest_link()
"""

from dtcourse.parameter_server.config import MODES, Fault, Problem, PSConfig, Quadratic, Stall
from dtcourse.parameter_server.job import ParameterServerError, PSRun, ps_rank, reference_sgd, train
from dtcourse.parameter_server.messages import Request, WorkerFailure, shard_ranges
from dtcourse.parameter_server.server import ParameterServer, ServerBase, ServerResult, Update, staleness
from dtcourse.parameter_server.worker import WorkerTrace, run_worker

__all__ = ["PSConfig", "Stall", "Fault", "Problem", "Quadratic", "Request", "Update", "ServerBase", "ParameterServer",
           "WorkerFailure", "ParameterServerError", "WorkerTrace", "ServerResult", "PSRun", "shard_ranges",
           "staleness", "run_worker", "ps_rank", "train", "reference_sgd", "MODES"]
