"""Exercise 03 (an SSP server loop): the released notebook, its checks and the autograder.

A server that ignores the bound, never lets a fast worker run ahead, or applies whole gradients
instead of 1/N shares, fails only the checks about that, with the worker, iteration or factor
named; bounded staleness itself (parts 1 and 2) carries 8 of the 12 points, so a server that keeps
every worker in step with the slowest (a barrier each round) scores under half. A server with no
deadline fails the hang check after the check's time limit. The course's ``ParameterServer``,
subclassed, aliased or called, is refused. Full marks for the solution and zero for the untouched
exercise are checked with every exercise's, in ``test_grading.py``; here a correct server written
differently from the solution gets full marks too. Each grading run starts one Jupyter kernel. Run
just these with ``pytest -q test_parameter_server_exercise.py``, and everything about this
exercise with ``pytest -q tests -k "03_parameter_server_staleness or test_parameter_server_exercise"``.
"""

from __future__ import annotations

import re
import time

import pytest

from dtcourse import checks
from dtcourse.parameter_server import ParameterServer, ServerBase
from exercise_harness import (EXPECTED, assert_released, by_id, failed, grade_answers, nbgrader_cells, solution_code,
                              source_path)

NAME = "03_parameter_server_staleness"
POINTS = EXPECTED[NAME].points

# Answers every waiting worker at once: correct as async, wrong for any finite bound.
NO_BOUND = '''
class AsyncServer(ServerBase):
    def serve(self):
        n = self.num_workers
        clock, waiting, owed = [0] * n, set(range(n)), {}
        while min(clock) < self.steps:
            for u in sorted(waiting):
                self.reply(u)
                owed[u] = time.perf_counter()
            waiting.clear()
            request = self.next_request(owed)
            w = request.worker
            del owed[w]
            late = staleness(self.version, request.read_version, request.clock)
            self.apply(request.grad / n)
            clock[w] += 1
            self.version = max(self.version, clock[w])
            self.record(request, late)
            if clock[w] < self.steps:
                waiting.add(w)
        return self.finish()
'''

# Answers only when every worker has pushed the round: a barrier, correct for s = 0 and a straggler's
# pace for any bound, so fast workers never run ahead. NO_BOUND with one condition added.
_ANSWER_ALL = """            for u in sorted(waiting):
                self.reply(u)
                owed[u] = time.perf_counter()
            waiting.clear()
"""
assert _ANSWER_ALL in NO_BOUND
BARRIER = NO_BOUND.replace(_ANSWER_ALL, "            if len(waiting) == n:     # the barrier: answer only once every worker has pushed\n"
                           + "".join("    " + line + "\n" for line in _ANSWER_ALL.splitlines()))


# A correct server written unlike the solution: workers wait in a queue in arrival order, the loop
# counts pushes rather than watching the smallest clock, and the version is raised with an `if`.
QUEUE_SERVER = '''
class AsyncServer(ServerBase):
    def serve(self):
        n, s = self.num_workers, self.bound
        done = {w: 0 for w in range(n)}          # pushes applied, per worker
        queue = list(range(n))                    # workers waiting for parameters, in arrival order
        since = {}
        for _ in range(n * self.steps):           # one push per pass
            floor = min(done.values())
            for w in [w for w in queue if done[w] - floor <= s]:
                queue.remove(w)
                self.reply(w)
                since[w] = time.perf_counter()
            req = self.next_request(since)
            since.pop(req.worker)
            stale = staleness(self.version, req.read_version, req.clock)
            self.apply(req.grad / n)
            done[req.worker] += 1
            if done[req.worker] > self.version:
                self.version = done[req.worker]
            self.record(req, stale)
            if done[req.worker] != self.steps:
                queue.append(req.worker)
        return self.finish()
'''


def server_class(body: str) -> type:
    """``AsyncServer`` from the notebook's setup cell plus ``body``, built without a kernel."""
    namespace: dict = {}
    exec(compile(nbgrader_cells(source_path(NAME))["setup"], "<setup>", "exec"), namespace)
    exec(compile(body, "<answer>", "exec"), namespace)
    return namespace["AsyncServer"]


def solution_server() -> type:
    return server_class(solution_code(NAME)["async_server"])


# --------------------------------------------------------------------------- #
# The released notebook
# --------------------------------------------------------------------------- #
def test_released_notebook_hides_the_answer_and_gives_the_loop_shape():
    assert_released(NAME, absent=["clock[u] - min(clock)", 'cases=("sharded",)'], stubs={"async_server": 1},
                    given={"async_server": ["def serve(self)", "return self.finish()"]})


# --------------------------------------------------------------------------- #
# Grading whole notebooks
# --------------------------------------------------------------------------- #
def test_ignoring_the_bound_fails_only_the_bound_and_parity_checks(tmp_path):
    report = grade_answers(NAME, tmp_path, {"async_server": NO_BOUND})
    result = by_id(report)
    assert failed(report) == ["check_bound", "check_bound_hidden", "check_parity", "check_parity_hidden"], str(report)
    assert report.score == POINTS - 7 < POINTS / 2, str(report)
    message = result["check_bound"].message
    assert "AsyncServer is wrong (s=1, 1 server(s), 3 workers, 7 iterations, worker 2 sleeps 250 ms" in message
    # Which worker lags most depends on scheduling (worker 2 sleeps, but on 2 busy cores another
    # one can fall further behind), so the message must name a worker, not necessarily worker 2.
    assert re.search(r"worker \d received the parameters of iteration \d+ when worker \d had sent only \d+ "
                     r"pushes: .* more than s = 1", message), message
    assert "more than s = 0" in result["check_parity"].message, result["check_parity"].message


def test_a_barrier_each_round_scores_under_half(tmp_path):
    # It applies every push once, keeps every bound and is exact at s = 0, but nobody ever runs ahead.
    report = grade_answers(NAME, tmp_path, {"async_server": BARRIER})
    result = by_id(report)
    assert failed(report) == ["check_once", "check_once_hidden", "check_bound", "check_bound_hidden"], str(report)
    assert report.score == 4 < POINTS / 2, str(report)
    for grade_id, s in [("check_once", "inf"), ("check_once_hidden", "2")]:
        message = result[grade_id].message
        assert (f"AsyncServer is wrong (s={s}" in message and "every push was applied once, but no fast worker ever "
                "ran ahead of the slow one: the largest lead was 0 iterations" in message), message
    for grade_id, s in [("check_bound", 1), ("check_bound_hidden", 3)]:
        message = result[grade_id].message
        assert (f"AsyncServer is wrong (s={s}, 1 server(s), " in message and "sleeps 250 ms per iteration): it never "
                f"let a fast worker run ahead: the largest lead was 0 iterations, but with a straggler and s = {s} "
                f"it must reach {s}" in message), message


def test_a_server_written_unlike_the_solution_gets_full_marks(tmp_path):
    report = grade_answers(NAME, tmp_path, {"async_server": QUEUE_SERVER})
    assert report.score == POINTS and not failed(report), str(report)


# --------------------------------------------------------------------------- #
# The checks on their own (no kernel)
# --------------------------------------------------------------------------- #
SOLUTION = solution_server()


class WholeGradients(SOLUTION):
    """The solution, but each push is applied whole instead of as 1/N of a round."""

    def apply(self, grad, gradients=1):
        super().apply(grad * self.num_workers, gradients)


def test_whole_gradients_are_reported_as_n_times_too_far():
    with pytest.raises(AssertionError, match=r"WholeGradients is wrong \(s=inf \(async\), 1 server\(s\), 3 workers.*"
                                             r"moved N = 3 times too far: apply each push as 1/N of a round"):
        checks.check_exactly_once(WholeGradients)
    checks.check_staleness_bound(WholeGradients)         # its clocks and staleness are right


class WrongStaleness(SOLUTION):
    """Records version - read_version: every push since the read, even the same iteration's."""

    def apply(self, grad, gradients=1):
        self.before = self.version
        super().apply(grad, gradients)

    def record(self, request, late):
        super().record(request, self.before - request.read_version)


def test_staleness_with_the_wrong_rule_names_the_update():
    with pytest.raises(AssertionError, match=r"update \d+ \(worker \d, iteration \d\): recorded staleness 1, but "
                                             r"the version was \d just before it .* pushes of the same or an older"):
        checks.check_staleness_bound(WrongStaleness, bounds=(0,))


# The solution with `self.version = max(self.version, clock[w])` changed: the version is the clock of
# the worker that pushed last, so a slow worker's push takes it back.
_MAX = "self.version = max(self.version, clock[w])"
assert _MAX in solution_code(NAME)["async_server"]
VERSION_BACKWARDS = server_class(solution_code(NAME)["async_server"].replace(_MAX, "self.version = clock[w]"))
# ... and with self.record moved before the version's update.
RECORD_FIRST = server_class(solution_code(NAME)["async_server"].replace(
    f"{_MAX}\n            self.record(request, late)", f"self.record(request, late)\n            {_MAX}"))


def test_a_version_that_goes_back_is_named_and_not_blamed_on_the_order_of_record():
    with pytest.raises(AssertionError) as error:
        checks.check_staleness_bound(VERSION_BACKWARDS, bounds=(1,))
    message = str(error.value)
    assert re.search(r"update \d+ \(worker \d's push of iteration \d+\): self.version was \d+ when you recorded it, "
                     r"expected \d+\. It went back, from \d+ at the update before: .*a slower worker's push .* must "
                     r"not lower it\. Keep the larger of self.version and the worker's new clock", message), message
    assert "record after" not in message and "after updating" not in message, message


def test_recording_before_the_version_moves_is_named():
    with pytest.raises(AssertionError, match=r"update 0 \(worker \d's push of iteration 0\): self.version was 0 when "
                                             r"you recorded it, expected 1\. Every update you recorded carries the "
                                             r"version from just before its push .*call self.record\(request, "
                                             r"staleness\) after updating self.version"):
        checks.check_staleness_bound(RECORD_FIRST, bounds=(1,))


class NoDeadline(SOLUTION):
    """Waits for requests with an empty `owed`: no deadline at all."""

    def next_request(self, owed):
        return super().next_request({})


def test_a_server_without_deadline_fails_the_hang_check_after_the_time_limit():
    start = time.monotonic()
    # Here the other workers' own deadlines (twice the server's) run out first; in async mode the
    # check's time limit would.
    with pytest.raises(AssertionError, match=r"NoDeadline waited for ever \(s=1, .*\): worker 1 \(rank 2\) hung in "
                                             r"iteration 2, and (the run was still going 5 s later|the other workers "
                                             r"gave up waiting for your answers first)\. Keep `owed`"):
        checks.check_hang(NoDeadline, timeout=5)
    assert time.monotonic() - start < 15


# --------------------------------------------------------------------------- #
# The course's server refuses to run inside the checks
# --------------------------------------------------------------------------- #
class Inherited(ParameterServer):
    """A subclass of the course's server: its serve() is the course's."""


class CallsTheCourse(ServerBase):
    """Writes serve() by calling the course's loop on itself."""

    def serve(self):
        return ParameterServer.serve(self)


class Wraps(ServerBase):
    """Builds the course's server inside its own and hands the work over."""

    def serve(self):
        return ParameterServer(self.config, group=self.group).serve()


def test_the_course_server_subclassed_or_aliased_is_refused_before_it_runs():
    for check in (checks.check_exactly_once, checks.check_staleness_bound, checks.check_sync_parity, checks.check_hang):
        with pytest.raises(AssertionError, match=r"Inherited subclasses dtcourse.parameter_server.ParameterServer, the "
                                                 r"course's own answer to exercise 03, which refuses to run while the "
                                                 r"exercise's checks run: subclass ServerBase"):
            check(Inherited)
    AsyncServer = ParameterServer                    # noqa: N806 - as a notebook cell would bind it
    with pytest.raises(AssertionError, match=r"ParameterServer is dtcourse.parameter_server.ParameterServer, the "
                                             r"course's own answer"):
        checks.check_exactly_once(AsyncServer)


@pytest.mark.parametrize("server, what", [(CallsTheCourse, r"ParameterServer\.serve"), (Wraps, r"ParameterServer")])
def test_the_course_server_called_from_a_serve_is_refused(server, what):
    with pytest.raises(AssertionError, match=rf"{server.__name__} failed \(s=inf \(async\), .*\): server 0 \(rank 0\) "
                                             rf"failed: ReferenceRefused: dtcourse\.parameter_server\.server\.{what} "
                                             r"is the course's own answer to exercise 03, and it refuses to run"):
        checks.check_exactly_once(server)


def test_the_course_server_still_runs_outside_the_checks():
    from dtcourse.parameter_server import PSConfig, train

    run = train(PSConfig(world_size=3, mode="ssp", bound=1, steps=2), server_cls=Inherited)
    assert len(run.updates) == 4
