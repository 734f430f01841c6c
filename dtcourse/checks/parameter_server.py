"""Checks for exercise 03: a student's SSP server loop, run by dtcourse's workers.

The student subclasses ``dtcourse.parameter_server.ServerBase`` and writes ``serve()``. Each check
trains the regression problem in float64 with the student's class on the server ranks and
``dtcourse.parameter_server.run_worker`` on the others, then holds the result to what the
consistency model promises:

* ``check_exactly_once``: every push recorded once, and the parameters equal w0 - lr/N * (the sum
  of every gradient pushed), which holds for plain SGD in any order of arrival; and some fast
  worker was answered ahead of the straggler (holding everyone to the slowest is synchronous);
* ``check_staleness_bound``: no worker was answered more than s iterations ahead of the slowest,
  but with a straggler the fast workers did run s ahead, and each recorded staleness is
  ``staleness(version, read_version, clock)`` and at most s;
* ``check_sync_parity``: with s = 0 the run equals one process on the averaged gradients;
* ``check_hang``: a worker that hangs ends the run within the server's timeout, named.

The student's class runs inside ``watching(ANSWERS)``, where the course's own
``ParameterServer`` refuses to run for it; a class that is or subclasses it is refused at once.
Every failure is one AssertionError that names the case, the worker, the iteration and the numbers::

    check_staleness_bound(AsyncServer, bounds=(1,))
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from typing import Callable, Sequence

import torch
from torch.nn.utils import parameters_to_vector

from dtcourse.checks.common import _where_stuck
from dtcourse.checks.guard import Answers, watching
from dtcourse.parameter_server import (Fault, ParameterServer, ParameterServerError, Problem, PSConfig, PSRun,
                                       ServerResult, reference_sgd, staleness, train)
from dtcourse.runtime.launch import LaunchTimeout
from dtcourse.runtime.refuse import ReferenceRefused

__all__ = ["check_exactly_once", "check_staleness_bound", "check_sync_parity", "check_hang", "PS_TOL"]

PROBLEM = Problem(dtype=torch.float64)
# float64. Plain SGD is linear in the gradients, so the order in which pushes arrive changes only
# rounding: measured with the solution, at most 2e-16 from w0 - lr/N * sum after 6 steps on 4
# workers. 1e-12 is far above that and far below any real mistake (a push lost or applied twice
# moves a parameter by lr/N times a gradient, about 1e-3 here).
PS_TOL = 1e-12
_STUB_HINT = " (the exercise stub is still there: replace the `raise NotImplementedError` line with your code)"


def _timeout(timeout: float | None) -> float:
    return float(os.environ.get("DTCOURSE_CHECK_TIMEOUT", "20")) if timeout is None else timeout


def _describe(config: PSConfig) -> str:
    slow = [f"worker {i} sleeps {d * 1e3:g} ms" for i, d in enumerate(config.delays) if d]
    bound = "s=inf (async)" if config.staleness_bound == math.inf else f"s={config.staleness_bound:g}"
    return (f"{bound}, {config.num_servers} server(s), {config.num_workers} workers, {config.steps} "
            f"iterations" + (f", {', '.join(slow)} per iteration" if slow else ""))


# What these checks switch off while the student's code runs (guard.watching), and refuse to be given
ANSWERS = Answers("03", course=("dtcourse.parameter_server.server.ParameterServer",
                                "dtcourse.parameter_server.server.ParameterServer.serve"))


def _refuse_the_course_server(cls: Callable) -> None:
    """The course's ``ParameterServer`` (or a subclass, which inherits its loop) is exercise 03's answer."""
    if isinstance(cls, type) and issubclass(cls, ParameterServer):
        which = ("is dtcourse.parameter_server.ParameterServer" if cls is ParameterServer
                 else "subclasses dtcourse.parameter_server.ParameterServer")
        raise ReferenceRefused(
            f"{cls.__name__} {which}, the course's own answer to exercise 03, which refuses to run while the "
            "exercise's checks run: subclass ServerBase, as the exercise's cell does, and write serve() yourself.")


def _watched(cls: Callable, started: str | None = None) -> type:
    """What ``train`` builds on each server rank: ``cls``, built and served inside ``watching``. With
    ``started`` (a folder), each server first writes there the wall-clock time it began, so that a check can
    time the server, not the ranks' start-up (seconds where the ranks' starter starts, as on a GPU machine)."""
    _refuse_the_course_server(cls)

    class Watched:
        def __init__(self, config: PSConfig, problem: Problem, group=None):
            if started is not None:
                with open(os.path.join(started, f"{os.getpid()}"), "w") as f:
                    f.write(repr(time.time()))
            with watching(ANSWERS):
                self.server = cls(config, problem, group)

        def serve(self) -> ServerResult:
            with watching(ANSWERS):
                return self.server.serve()
    return Watched


def _run(cls: Callable, config: PSConfig, timeout: float | None) -> PSRun:
    """Train with ``cls`` on the servers; turn an error or a hang into an AssertionError."""
    name, case = getattr(cls, "__name__", "your server"), _describe(config)
    limit = _timeout(timeout)
    try:
        return train(config, PROBLEM, server_cls=_watched(cls), timeout=limit)
    except ParameterServerError as err:
        raise AssertionError(_failed_message(name, case, err)) from None
    except LaunchTimeout as err:
        raise AssertionError(_timeout_message(name, case, limit, config, err)) from None


def _failed_message(name: str, case: str, err: ParameterServerError) -> str:
    remote = getattr(err.__cause__, "remote_traceback", "")
    where = "\n".join("    " + line.strip() for line in remote.strip().splitlines()[-3:-1]) if remote else ""
    stub = _STUB_HINT if err.error == "NotImplementedError" else ""
    return f"{name} failed ({case}): {err}{stub}" + (f"\n{where}" if where else "")


def _timeout_message(name: str, case: str, limit: float, config: PSConfig, err: LaunchTimeout) -> str:
    stuck = ", ".join(config.role(rank) for rank in err.stuck)
    return (f"{name} did not finish within {limit:g} s ({case}); still running: {stuck}. Does serve() stop once "
            f"every worker's clock has reached config.steps, and does every waiting worker get its answer once "
            f"it is at most s iterations ahead of the slowest?{_where_stuck(err, config.role)}")


def _pushes_problem(run: PSRun) -> str | None:
    """None if each server recorded each (worker, iteration) once, else the first that was not."""
    n, steps = run.config.num_workers, run.config.steps
    for server in run.servers:
        seen: dict[tuple[int, int], int] = {}
        for u in server.updates:
            seen[u.worker, u.clock] = seen.get((u.worker, u.clock), 0) + 1
        for w in range(n):
            for c in range(steps):
                if seen.get((w, c), 0) != 1:
                    return (f"server {server.index} recorded worker {w}'s push of iteration {c} "
                            f"{seen.get((w, c), 0)} times, not once ({len(server.updates)} records for "
                            f"{n * steps} pushes): call self.record(request, staleness) once per push you apply")
    return None


def _params_problem(run: PSRun) -> str | None:
    """None if the parameters are w0 - lr/N * (every gradient pushed), else by how much they are not."""
    n = run.config.num_workers
    start = parameters_to_vector(PROBLEM.model().parameters()).detach()
    step = -run.config.lr / n * sum(t.pushed_sum for t in run.workers)            # (P,)
    got = run.params - start
    error = (got - step).abs().max().item()
    if error <= PS_TOL:
        return None
    message = (f"the final parameters differ from w0 - lr/N * (the sum of every pushed gradient) by up to "
               f"{error:.3g}")
    if torch.allclose(got, n * step, rtol=1e-6, atol=PS_TOL):
        message += f". They moved N = {n} times too far: apply each push as 1/N of a round, grad / num_workers"
    elif not got.any():
        message += ". They never moved: call self.apply(grad) for each push"
    return message


# The slow worker of check_exactly_once sleeps this long in every iteration: a fast worker's iteration
# takes at most about 60 ms on 2 busy cores, so one is answered ahead of the slow one's first push.
SLOW_DELAY = 0.1


def _ran_ahead_problem(run: PSRun) -> str | None:
    """None if some worker was answered at least one iteration ahead of another (for s >= 1)."""
    lead = max(c - sent for _, c, _, sent in _leads(run))
    if lead >= 1:
        return None
    s = run.config.staleness_bound
    return (f"every push was applied once, but no fast worker ever ran ahead of the slow one: the largest lead "
            f"was {lead} iterations. With s = {s:g}, a worker whose push is in gets its next parameters at once "
            f"if it is at most s iterations ahead of the slowest; holding it until every worker has pushed the "
            f"round makes the server synchronous, and the fast workers wait for the slow one in every iteration")


def check_exactly_once(cls: Callable, cases: Sequence[str] = ("async",), timeout: float | None = None) -> None:
    """Every push applied and recorded exactly once, and fast workers not held back by the slow one.
    ``cases``: ``"async"`` (1 server, 3 workers, one slow) and ``"sharded"`` (2 servers, 3 workers,
    s = 2, one slow)."""
    configs = {"async": PSConfig(world_size=4, mode="async", steps=6, delays=(0, 0, SLOW_DELAY)),
               "sharded": PSConfig(world_size=5, num_servers=2, mode="ssp", bound=2, steps=6,
                                   delays=(SLOW_DELAY, 0, 0))}
    for case in cases:
        run = _run(cls, configs[case], timeout)
        problem = _pushes_problem(run) or _params_problem(run) or _ran_ahead_problem(run)
        if problem:
            raise AssertionError(f"{getattr(cls, '__name__', 'your server')} is wrong "
                                 f"({_describe(configs[case])}): {problem}")


def _leads(run: PSRun) -> list[tuple[int, int, int, int]]:
    """``(worker, c, other, sent)`` for every read and every other worker: when ``worker`` received the
    parameters of iteration c, ``other`` had sent ``sent`` pushes, so ``worker`` was c - sent ahead of it.

    Seen from the workers' side: the server cannot have applied more pushes than were sent.
    """
    leads = []
    for t in run.workers:
        reads = [end for kind, _, _, end in t.spans if kind == "wait"]
        for c, received in enumerate(reads):
            for other in run.workers:
                sent = sum(1 for kind, _, _, end in other.spans if kind == "compute" and end < received)
                leads.append((t.worker, c, other.worker, sent))
    return leads


def _bound_problem(run: PSRun) -> str | None:
    """None if no answer ran ahead of the bound and every staleness and version was recorded right."""
    s = run.config.staleness_bound
    for worker, c, other, sent in _leads(run):
        if c - sent > s:
            return (f"worker {worker} received the parameters of iteration {c} when worker {other} had sent "
                    f"only {sent} pushes: {c} - {sent} = {c - sent} iterations ahead of the slowest, more than "
                    f"s = {s:g}. Answer a waiting worker only when its clock minus the smallest clock is <= s")
    for server in run.servers:
        updates = sorted(server.updates, key=lambda u: u.time)
        before, after, version = [], [], 0      # the right version just before and just after each update
        for u in updates:
            before.append(version)
            version = max(version, u.clock + 1)
            after.append(version)
        for k, u in enumerate(updates):
            want = staleness(before[k], u.read_version, u.clock)
            if u.staleness != want:
                return (f"server {server.index}'s update {k} (worker {u.worker}, iteration {u.clock}): recorded "
                        f"staleness {u.staleness}, but the version was {before[k]} just before it and the push "
                        f"was computed on version {u.read_version}, so staleness({before[k]}, {u.read_version}, "
                        f"{u.clock}) = {want}: pushes of the same or an older iteration do not count")
            if u.staleness > s:
                return (f"server {server.index}'s update {k} (worker {u.worker}, iteration {u.clock}) has "
                        f"staleness {u.staleness}, above the bound s = {s:g}")
            if u.version != after[k]:
                return _version_problem(server.index, updates, k, before, after)
    return None


def _version_problem(server: int, updates: list, k: int, before: list[int], after: list[int]) -> str:
    """What is wrong with the version recorded at update ``k``, the first wrong one, as far as the records show."""
    u = updates[k]
    where = (f"server {server}'s update {k} (worker {u.worker}'s push of iteration {u.clock}): self.version was "
             f"{u.version} when you recorded it, expected {after[k]}")
    recorded = [v.version for v in updates]
    if k > 0 and u.version < recorded[k - 1]:
        return (f"{where}. It went back, from {recorded[k - 1]} at the update before: the version is the newest "
                f"iteration in the parameters, the largest clock so far, and a slower worker's push (iteration "
                f"{u.clock} here) must not lower it. Keep the larger of self.version and the worker's new clock")
    if not any(recorded):
        return (f"{where}. Every update you recorded has version 0: after applying a push, set self.version to "
                "the largest clock so far")
    if recorded == before:
        return (f"{where}. Every update you recorded carries the version from just before its push ({after[k]} "
                "once this push is in): call self.record(request, staleness) after updating self.version")
    return f"{where}: the largest clock so far, counting this push"


def _reach_problem(run: PSRun, want: int) -> str | None:
    """None if some worker was answered ``want`` iterations ahead of another, else how far they got."""
    lead = max(c - sent for _, c, _, sent in _leads(run))
    if lead >= want:
        return None
    s = run.config.staleness_bound
    if lead <= 0:
        return (f"it never let a fast worker run ahead: the largest lead was {lead} iterations, but with a "
                f"straggler and s = {s:g} it must reach {want}. SSP answers a waiting worker as soon as its "
                f"clock minus the smallest clock is <= s, without waiting for the slowest")
    return (f"it let a fast worker run at most {lead} iteration(s) ahead of the slowest, but with a straggler "
            f"and s = {s:g} the lead must reach {want}. Answer a waiting worker as soon as its clock minus the "
            f"smallest clock is <= s (not < s)")


# The straggler of check_staleness_bound sleeps this long in every iteration. A fast worker's iteration
# takes a few ms, and at most about 60 ms (measured on 2 cores shared with two busy processes), so the
# fast workers gain at least 3 iterations per iteration of the straggler and reach the bound within its
# first one or two iterations. From then on, each time the straggler's push lets a waiting fast worker
# go on, that worker is answered exactly s ahead: the bound is reached whatever the scheduling.
STRAGGLER_DELAY = 0.25


def check_staleness_bound(cls: Callable, bounds: Sequence[int] = (1,), world_size: int = 4,
                          timeout: float | None = None) -> None:
    """For each bound s: the last worker is slow (``STRAGGLER_DELAY`` s per iteration), no worker may be
    answered more than s iterations ahead of the slowest, yet with s >= 1 the fast workers must run
    ahead, until some worker is answered exactly s ahead (1 ahead if s is infinite); each recorded
    staleness must follow its definition."""
    for s in bounds:
        # s + 4 iterations: the fast workers reach the bound, then the last s iterations are still ahead.
        steps = 7 if s == math.inf else max(7, int(s) + 4)
        config = PSConfig(world_size=world_size, mode="ssp", bound=s, steps=steps,
                          delays=(0.0,) * (world_size - 2) + (STRAGGLER_DELAY,))
        run = _run(cls, config, timeout)
        want = 1 if s == math.inf else int(s)
        problem = _bound_problem(run) or (_reach_problem(run, want) if config.num_workers > 1 else None)
        if problem:
            raise AssertionError(f"{getattr(cls, '__name__', 'your server')} is wrong ({_describe(config)}): "
                                 f"{problem}")


# The first worker of check_sync_parity sleeps this long in every iteration, so that a server that answers a
# worker before the others have pushed lets it run visibly ahead (_leads, seen from the workers' clocks). On two
# busy cores 10 ms was sometimes too short: the others had not yet been scheduled, no lead showed, and only the
# parameters' difference named the fault (1 run in 60 beside tests/busy.py; none in 40 with 50 ms).
PARITY_DELAY = 0.05


def check_sync_parity(cls: Callable, world_sizes: Sequence[tuple[int, int]] = ((3, 1),),
                      timeout: float | None = None) -> None:
    """With s = 0 the run must equal one process on the averaged gradients, within ``PS_TOL``.
    ``world_sizes`` lists ``(world_size, num_servers)`` pairs."""
    for world_size, servers in world_sizes:
        config = PSConfig(world_size=world_size, num_servers=servers, mode="ssp", bound=0, steps=4, lr=0.2,
                          delays=(PARITY_DELAY,) + (0.0,) * (world_size - servers - 1))
        run = _run(cls, config, timeout)
        problem = _bound_problem(run)
        if problem is None:
            single = reference_sgd(PSConfig(world_size=world_size, num_servers=servers, steps=4, lr=0.2), PROBLEM)
            error = (run.params - single).abs().max().item()
            if not error <= PS_TOL:
                n = config.num_workers
                start = parameters_to_vector(PROBLEM.model().parameters()).detach()
                problem = (f"after {config.steps} iterations the parameters differ from one process on the "
                           f"averaged gradients by up to {error:.3g} (tolerance {PS_TOL:g})")
                if torch.allclose(run.params - start, n * (single - start), rtol=1e-6, atol=PS_TOL):
                    problem += f". They moved N = {n} times too far: apply grad / num_workers"
        if problem:
            raise AssertionError(f"{getattr(cls, '__name__', 'your server')} is wrong ({_describe(config)}): "
                                 f"{problem}")


def check_hang(cls: Callable, cases: Sequence[str] = ("ssp",), timeout: float | None = None) -> None:
    """A worker hangs; the server must raise within its timeout (1.5 s here), naming the worker.
    ``cases``: ``"ssp"`` (s = 1, worker 1 hangs in iteration 2) and ``"async"`` (worker 0 hangs in
    iteration 1 while the others go on)."""
    configs = {"ssp": PSConfig(world_size=4, mode="ssp", bound=1, steps=5, timeout=1.5,
                               fault=Fault(worker=1, step=2)),
               "async": PSConfig(world_size=4, mode="async", steps=5, timeout=1.5, fault=Fault(worker=0, step=1))}
    name, limit = getattr(cls, "__name__", "your server"), _timeout(timeout)
    for case in cases:
        config = configs[case]
        who = config.role(config.num_servers + config.fault.worker)
        with tempfile.TemporaryDirectory(prefix="dtcourse-check-") as started:
            try:
                train(config, PROBLEM, server_cls=_watched(cls, started), timeout=limit)
            except ParameterServerError as err:
                failure = err
            except LaunchTimeout:
                failure = None
            else:
                raise AssertionError(f"{name} finished although {who} hung in iteration {config.fault.step} "
                                     f"({_describe(config)})")
            times = [float(open(os.path.join(started, f)).read()) for f in os.listdir(started)]
            took = time.time() - min(times) if times else math.inf
        if failure is None:
            waited = f"the run was still going {limit:g} s later"
        else:
            err = failure
            by_server = err.rank is not None and err.rank < config.num_servers
            if err.error == "WorkerFailure" and by_server and f"gave up: {who}" in str(err):
                if took > config.timeout + 10:
                    raise AssertionError(f"{name} named {who} only {took:.1f} s after it started") from None
                continue
            text = _failed_message(name, _describe(config), err)
            if err.error != "WorkerFailure" or by_server:
                if err.error == "NotImplementedError":
                    raise AssertionError(text) from None
                raise AssertionError(f"{name} failed, but not by naming {who}, which hung in iteration "
                                     f"{config.fault.step} ({_describe(config)}):\n{text}") from None
            waited = "the other workers gave up waiting for your answers first"     # a worker's WorkerFailure
        raise AssertionError(
            f"{name} waited for ever ({_describe(config)}): {who} hung in iteration {config.fault.step}, "
            f"and {waited}. Keep `owed`, every worker that owes you a message with the time you last "
            f"answered it, and pass it to self.next_request(owed): it raises WorkerFailure naming the "
            f"worker once it is {config.timeout:g} s late")
