"""The parameter server: parity of sync with one process, exactly-once async, the SSP bound, bytes, failures.

Each ``train`` call is one launch (a few tenths of a second); the failure cases wait out a
1.5 s server timeout, and the SSP runs a straggler that sleeps 0.4 s in each of 5 iterations. Run just these with ``pytest -q tests/test_parameter_server.py``.
"""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from dtcourse.parameter_server import (Fault, ParameterServer, ParameterServerError, Problem, PSConfig, Quadratic,
                                       Stall, reference_sgd, shard_ranges, staleness, train)

F64 = Problem(dtype=torch.float64)        # 676 parameters: not divisible by 3 servers
P = 16 * 32 + 32 + 32 * 4 + 4


def start_params(problem: Problem) -> torch.Tensor:
    return parameters_to_vector(problem.model().parameters()).detach()


def full_batch_sgd(problem: Problem, num_workers: int, steps: int, lr: float) -> torch.Tensor:
    """One process, one backward per step on all N * rows rows: synchronous SGD as one large batch."""
    model = problem.model()
    big = dataclasses.replace(problem, rows=problem.rows * num_workers)
    for c in range(steps):
        model.zero_grad(set_to_none=True)
        big.loss(model, *big.batch(c, 0, 1)).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return parameters_to_vector(model.parameters()).detach()


# --------------------------------------------------------------------------- #
# Configuration and helpers (no launch)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=1), r"at least one server and one worker, so world_size must be an integer >= 2, got 1"),
    (dict(world_size=3, num_servers=3), r"num_servers=3 leaves 0 workers in world_size=3; at least one worker "
                                        r"is needed: use num_servers <= 2"),
    (dict(world_size=3, num_servers=5), r"num_servers=5 leaves -2 workers"),
    (dict(world_size=3, num_servers=0), r"num_servers must be an integer >= 1, got 0"),
    (dict(world_size=3, mode="ssp", bound=-1), r"needs a staleness bound s >= 0 .*got bound=-1"),
    (dict(world_size=3, mode="ssp"), r"needs a staleness bound s >= 0 .*got bound=None"),
    (dict(world_size=3, mode="ssp", bound=1.5), r"counts iterations: an integer or math.inf, got 1.5"),
    (dict(world_size=3, mode="sync", bound=2), r"bound is for mode='ssp' only"),
    (dict(world_size=3, mode="hogwild"), r"mode must be one of \('sync', 'ssp', 'async'\)"),
    (dict(world_size=3, delays=(0, 12.0)), r"worker 1's delay 12.0 s must be >= 0 and below timeout"),
    (dict(world_size=3, delays=(0, 0, 0)), r"3 delays given for 2 workers"),
    (dict(world_size=3, fault=Fault(worker=2, step=0)), r"fault .* worker in \[0, 2\)"),
    (dict(world_size=3, steps=0), r"steps must be an integer >= 1"),
    (dict(world_size=3, delay_period=0), r"delay_period must be an integer >= 1"),
])
def test_config_rejects_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PSConfig(**kwargs)


def test_config_is_frozen_and_names_roles():
    config = PSConfig(world_size=5, num_servers=2, mode="ssp", bound=math.inf)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.steps = 3
    assert config.num_workers == 3 and config.staleness_bound == math.inf
    assert [config.role(r) for r in (1, 2)] == ["server 1 (rank 1)", "worker 0 (rank 2)"]
    assert PSConfig(world_size=2).staleness_bound == 0
    assert PSConfig(world_size=2, mode="async").staleness_bound == math.inf


@pytest.mark.parametrize("numel, k", [(676, 1), (676, 3), (10, 4), (3, 5)])
def test_shard_ranges_cover_the_keys_in_balanced_ranges(numel, k):
    ranges = shard_ranges(numel, k)
    assert ranges[0][0] == 0 and ranges[-1][1] == numel and len(ranges) == k
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))            # contiguous, no gap or overlap
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1                                       # balanced by size


def test_staleness_counts_newer_iterations_only():
    assert staleness(version=3, read_version=3, clock=3) == 0      # sync: version c, iteration c
    assert staleness(version=4, read_version=3, clock=3) == 0      # another worker's push of the same iteration
    assert staleness(version=15, read_version=10, clock=3) == 5    # a straggler: iterations 10..14 landed meanwhile
    assert staleness(version=10, read_version=10, clock=3) == 0    # nothing newer landed


# --------------------------------------------------------------------------- #
# Synchronous mode: one process on the averaged gradients
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("world_size, num_servers", [(3, 1), (5, 1), (5, 2), (4, 3)])
def test_sync_matches_single_process_sgd(world_size, num_servers):
    config = PSConfig(world_size=world_size, num_servers=num_servers, steps=4, lr=0.2, momentum=0.5)
    run = train(config)
    # float32. The server averages the N gradients exactly as reference_sgd does (stack, mean
    # over workers in worker order) and SGD with momentum is elementwise, so cutting the
    # parameters into key ranges changes no rounding: the two agree to the bit. 1e-6 is the
    # contract; the bitwise check says why it holds.
    assert (run.params - reference_sgd(config)).abs().max() < 1e-6
    assert torch.equal(run.params, reference_sgd(config))
    assert {u.staleness for u in run.updates} == {0}
    assert len(run.updates) == num_servers * config.num_workers * config.steps


@pytest.mark.parametrize("world_size", [3, 5])
def test_sync_is_one_large_batch(world_size):
    config = PSConfig(world_size=world_size, steps=3, lr=0.2)
    run = train(config, F64)
    # float64: the mean over N workers of means over `rows` rows groups the same terms as one
    # mean over N * rows rows; they differ by a few ulps (~1e-16) and 3 steps keep it far below 1e-12.
    assert (run.params - full_batch_sgd(F64, config.num_workers, 3, 0.2)).abs().max() < 1e-12


def test_sharded_and_unsharded_servers_agree_exactly():
    one = train(PSConfig(world_size=4, num_servers=1, steps=3, momentum=0.9))
    three = train(PSConfig(world_size=6, num_servers=3, steps=3, momentum=0.9))
    assert three.params.numel() == P and [s.hi - s.lo for s in three.servers] == [226, 225, 225]
    assert torch.equal(one.params, three.params)       # elementwise optimizer, same averages: bit-identical


# --------------------------------------------------------------------------- #
# Asynchronous and bounded staleness
# --------------------------------------------------------------------------- #
def _exactly_once(run, problem: Problem) -> None:
    n, steps = run.config.num_workers, run.config.steps
    for server in run.servers:
        pairs = [(u.worker, u.clock) for u in server.updates]
        assert sorted(pairs) == [(w, c) for w in range(n) for c in range(steps)]       # each push once
    pushed = sum(t.pushed_sum for t in run.workers)                                      # (P,) float64
    # Plain SGD is linear in the gradients: whatever the order, the parameters end at w0 - lr/N * sum.
    # float64 rounding of N * steps additions stays below 1e-13.
    expected = start_params(problem) - run.config.lr / n * pushed
    assert (run.params - expected).abs().max() < 1e-12


def _async(world_size: int, num_servers: int) -> PSConfig:
    # The last worker sleeps 0.1 s per iteration; a fast worker's iteration takes a few ms (at most
    # ~60 ms on 2 busy cores), so the fast ones push new iterations while the straggler sleeps.
    delays = (0.0,) * (world_size - num_servers - 1) + (0.1,)
    return PSConfig(world_size=world_size, num_servers=num_servers, mode="async", steps=6, delays=delays)


@pytest.mark.parametrize("world_size, num_servers", [(3, 1), (5, 2)])
def test_async_terminates_and_applies_every_push_exactly_once(world_size, num_servers):
    config = _async(world_size, num_servers)
    run = train(config, F64)
    _exactly_once(run, F64)
    assert all(len(t.losses) == 6 for t in run.workers)
    _check_bound(run)                  # s = inf: only that each staleness follows its definition
    _assert_bound_reached(run)         # nobody waits for the straggler: its pushes arrive stale


def _check_bound(run) -> None:
    """Recorded staleness <= s and equal to its definition; every read respected the clock bound."""
    s, n = run.config.staleness_bound, run.config.num_workers
    for server in run.servers:
        version = 0
        for u in sorted(server.updates, key=lambda u: u.time):
            assert u.staleness == staleness(version, u.read_version, u.clock) <= s
            version = max(version, u.clock + 1)
            assert u.version == version
    # From the workers' side: when worker w received the parameters of iteration c, every worker's
    # pushes of iterations < c - s had been applied (the server applies before it answers).
    applied_at = {(u.worker, u.clock): u.time for u in run.updates}
    for t in run.workers:
        for c, (_, _, _, received) in enumerate(x for x in t.spans if x[0] == "wait"):
            for u in range(n):
                if c - s - 1 >= 0:
                    assert applied_at[u, c - s - 1] < received, (t.worker, c, u)


def _largest_lead(run) -> int:
    """The most iterations a worker was ahead of another when its parameters arrived: c - (the other's
    pushes sent by then), largest over every read of every worker."""
    sent_by = [[end for kind, _, _, end in t.spans if kind == "compute"] for t in run.workers]
    return max(c - sum(end < received for end in sent)
               for t in run.workers
               for c, (_, _, _, received) in enumerate(x for x in t.spans if x[0] == "wait")
               for sent in sent_by)


def _assert_bound_reached(run) -> None:
    """With a straggler, the bound is not only kept but reached: a fast worker runs s iterations ahead,
    and the straggler's first push (computed on version 0) is applied s iterations stale. In async mode
    its pushes are stale at all. A server that waits for the slowest fails this (see the test below)."""
    s, late = run.config.staleness_bound, max(u.staleness for u in run.updates)
    if s == math.inf:
        assert late > 0 and _largest_lead(run) > 0, (late, _largest_lead(run))
    else:
        assert late == s and _largest_lead(run) == s, (late, _largest_lead(run))


def _ssp(bound: int) -> PSConfig:
    # World size 5: three fast workers and one that is slow every iteration, so a finite bound must bite.
    # The straggler sleeps 0.4 s per iteration: the fast workers' s + 1 iterations before its first push
    # take at most ~0.2 s (measured on 2 cores shared with two busy processes), so that push is s stale.
    return PSConfig(world_size=5, mode="ssp", bound=bound, steps=5, delays=(0, 0, 0, 0.4))


@pytest.mark.parametrize("bound", [0, 1, 2])
def test_ssp_never_exceeds_its_bound(bound):
    run = train(_ssp(bound), F64)
    _check_bound(run)
    _assert_bound_reached(run)
    _exactly_once(run, F64)


class WaitsForTheSlowest(ParameterServer):
    """Ignores the bound: every worker waits for the slowest each iteration, as with s = 0."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bound = 0


@pytest.mark.parametrize("config", [_ssp(2), _async(3, 1)], ids=["ssp", "async"])
def test_a_server_that_waits_for_the_slowest_does_not_reach_the_bound(config):
    run = train(config, F64, server_cls=WaitsForTheSlowest)
    _check_bound(run)                            # it keeps the bound, and records staleness right ...
    with pytest.raises(AssertionError):
        _assert_bound_reached(run)               # ... but never lets a fast worker run ahead
    assert _largest_lead(run) == 0 and {u.staleness for u in run.updates} == {0}


def test_ssp_with_zero_bound_is_synchronous():
    config = PSConfig(world_size=4, mode="ssp", bound=0, steps=4, lr=0.2, delays=(0, 0.01, 0))
    run = train(config, F64)
    # Every worker computes iteration c on the same parameters; the server adds the N shares
    # one at a time instead of averaging first: float64 rounding only.
    assert (run.params - reference_sgd(dataclasses.replace(config, mode="sync", bound=None), F64)).abs().max() < 1e-12
    assert {u.staleness for u in run.updates} == {0}


# --------------------------------------------------------------------------- #
# Bytes through each link
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("world_size, num_servers", [(4, 1), (5, 2)])
def test_bytes_per_link(world_size, num_servers):
    config = PSConfig(world_size=world_size, num_servers=num_servers, steps=3)
    run = train(config)
    n, k, s = config.num_workers, num_servers, 4 * P
    links = run.link_bytes()
    for j, (lo, hi) in enumerate(shard_ranges(P, k)):
        for w in range(k, world_size):
            assert links[w, j] == links[j, w] == 3 * 4 * (hi - lo)   # a push and a pull of range j per iteration
    assert sum(links.values()) == 3 * 2 * n * s
    rank, per_iteration = run.busiest_link()
    assert rank < k and per_iteration == n * 4 * max(hi - lo for lo, hi in shard_ranges(P, k))   # ~N * S / k
    headers = run.link_bytes(phases=("header",))
    assert all(b % 8 == 0 for b in headers.values()) and sum(headers.values()) < 0.1 * sum(links.values())


# --------------------------------------------------------------------------- #
# Failures end the run, naming the worker
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("mode, kind, message", [
    ("ssp", "hang", r"server 0 \(rank 0\) failed: WorkerFailure: server 0 \(rank 0\) gave up: worker 1 \(rank 2\) "
                    r"owed it a push and sent nothing for 1.5 s \(timeout\); it has hung or died"),
    ("async", "hang", r"gave up: worker 2 \(rank 3\) owed it a push and sent nothing for 1.5 s"),
    ("sync", "crash", r"worker 1 \(rank 2\) exited with code 1 before sending a result"),
    ("sync", "raise", r"worker 2 \(rank 3\) failed: RuntimeError: worker 2: failure injected at iteration 2"),
])
def test_a_failed_worker_is_named_within_the_timeout(mode, kind, message):
    worker = 1 if kind in ("hang", "crash") and mode != "async" else 2
    config = PSConfig(world_size=4, mode=mode, bound=1 if mode == "ssp" else None, steps=5, timeout=1.5,
                      fault=Fault(worker=worker, step=2, kind=kind))
    start = time.monotonic()
    with pytest.raises(ParameterServerError, match=message):
        train(config)
    assert time.monotonic() - start < 1.5 + 5


def test_final_parameters_train_the_model():
    config = PSConfig(world_size=4, mode="async", steps=20, lr=0.5)
    run = train(config)
    model = Problem().model()
    before = Problem().loss(model, *Problem().eval_batch()).item()
    vector_to_parameters(run.params, model.parameters())
    assert Problem().loss(model, *Problem().eval_batch()).item() < 0.5 * before


# --------------------------------------------------------------------------- #
# k = N servers beside the workers: the ring's traffic per machine
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("workers", [3, 4])
def test_colocated_servers_move_what_a_ring_moves(workers):
    run = train(PSConfig(world_size=2 * workers, num_servers=workers, steps=2))
    ranges = shard_ranges(P, workers)
    for j, (out, into) in enumerate(run.machine_bytes()):
        mine = ranges[j][1] - ranges[j][0]
        # Worker j pushes every range but its own; server j sends its own range to the N-1 other workers.
        assert out == into == 4 * ((P - mine) + (workers - 1) * mine)
        assert abs(out - 2 * (workers - 1) / workers * 4 * P) <= 4 * workers      # 2(N-1)/N·S, up to uneven ranges
    with pytest.raises(ValueError, match="needs k = N"):
        train(PSConfig(world_size=3, steps=1)).machine_bytes()


# --------------------------------------------------------------------------- #
# What a stale gradient costs: the quadratic of the lesson's sweep
# --------------------------------------------------------------------------- #
def test_quadratic_bowl():
    bowl = Quadratic(dtype=torch.float64)
    x, y = bowl.batch(0, 1, 4)
    assert x.shape == (bowl.rows, bowl.dim) and y.shape == (bowl.rows, 1)
    assert torch.equal(x, bowl._data(4 * bowl.rows, seed=0)[0][bowl.rows:2 * bowl.rows])   # worker 1's slice
    # Sync with lr 0.25 on a round bowl of curvature ~2 halves the error per step: the loss falls ~4x a step.
    config = PSConfig(world_size=3, steps=10, lr=0.25)
    run = train(config, bowl)
    model = bowl.model()
    start = bowl.loss(model, *bowl.eval_batch()).item()
    vector_to_parameters(run.params, model.parameters())
    assert bowl.loss(model, *bowl.eval_batch()).item() < start * 4.0 ** -7


def test_a_stalled_worker_costs_async_and_ssp_bounds_it():
    bowl = Quadratic(dtype=torch.float64)
    # Worker 3 stalls after its first gradient until the others can go no further (Stall): the
    # protocol sets the stall's length, so what follows holds on a quiet and on a loaded machine.
    base = PSConfig(world_size=5, steps=16, lr=0.25, stall=Stall(worker=3, step=0), mode="async")
    finals = {}
    for config in (base, dataclasses.replace(base, mode="ssp", bound=1), dataclasses.replace(base, mode="sync")):
        run = train(config, bowl)
        model = bowl.model()
        vector_to_parameters(run.params, model.parameters())
        late = next(u for u in run.updates if (u.worker, u.clock) == (3, 0))
        assert late.read_version == 0                     # every first pull is answered with version 0
        finals[config.mode] = (bowl.loss(model, *bowl.eval_batch()).item(), late.staleness,
                               max(u.staleness for u in run.updates))
        applied_after = [u for u in run.updates if u.time > late.time]
        if config.mode == "async":                        # held until the others had pushed everything
            assert all(u.worker == 3 for u in applied_after) and len(applied_after) == 15
    assert finals["async"][1] == 15 and finals["ssp"][1:] == (1, 1) and finals["sync"][1:] == (0, 0)
    # The late push drags async back toward the error of version 0; worker 3 then finishes alone, at 1/N
    # of a step per push: ~1e-3 against ~1e-8 with the bound, whatever the load.
    assert finals["async"][0] > 1e3 * max(finals["ssp"][0], finals["sync"][0])


def test_a_stall_outside_the_run_is_refused():
    with pytest.raises(ValueError, match="stall"):
        PSConfig(world_size=3, steps=4, stall=Stall(worker=2, step=0))
    with pytest.raises(ValueError, match="step in"):
        PSConfig(world_size=3, steps=4, stall=Stall(worker=1, step=4))


def test_answered_after_delays_reads_who_waited_for_whom():
    from dtcourse.lab import parameter_server as lab

    runs = lab.straggler_runs(world_size=4, delay=0.02, steps=6, bound=1)
    assert lab.answered_after_delays(runs["sync"], lag=1) and lab.answered_after_delays(runs["ssp s=1"], lag=2)
    # lag 0 cannot hold: a pull of round c is always answered before the sleep of that same round
    assert not any(lab.answered_after_delays(r, lag=0) for r in runs.values())


# --------------------------------------------------------------------------- #
# What lesson 03 runs: the lab functions and problems
# --------------------------------------------------------------------------- #
def test_straggler_recording_puts_the_pull_in_the_communication_lane():
    from dtcourse.lab import parameter_server as lab
    from dtcourse.lab.timeline import timeline_widget

    runs = lab.straggler_runs(world_size=3, delay=0.01, steps=3, bound=1)
    widget = timeline_widget({name: lab.recording(r) for name, r in runs.items()})
    widget.dropdown.value = "async"
    assert {rank for rank, _, _ in widget.view.bars} == {1, 2}
    lanes = {s.kind: round(bar.get_y() + bar.get_height() / 2) % 2 for _, s, bar in widget.view.bars}
    assert lanes == {"compute": 0, "delay": 0, "recv": 1}      # compute lane 0, communication lane 1
    assert all(w > 0 for w in lab.pull_waits(runs).values())


@pytest.mark.parametrize("name, kwargs", [
    ("problem_sharded_link", dict(workers=4, servers=2)),
    ("problem_colocated_machine", dict(workers=3)),
    ("problem_ssp_staleness", dict(bound=1)),
    ("problem_actor_staleness", dict(actors=2, pull_every=20, push_every=10, updates=3)),
    ("problem_pull_bytes", dict(actors=2, pull_every=20, hidden=16)),
])
def test_each_problem_measures_what_its_formula_says(name, kwargs):
    from dtcourse.lab import parameter_server as lab
    from dtcourse.lab.problems import check

    answer = getattr(lab, name)(**kwargs)
    assert answer.agrees and answer.measured > 0
    check(None, answer)
    wrong = dataclasses.replace(answer, formula=answer.formula * 1.5 + 1)     # a worked answer with a slip
    assert not wrong.agrees
    with pytest.raises(AssertionError, match="more than the"):
        check(None, wrong)
