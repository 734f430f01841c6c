"""Exercise 03 (an SSP server loop): the released notebook, its checks and the autograder.

A server that ignores the bound, never lets a fast worker run ahead, or applies whole gradients
instead of 1/N shares, fails only the checks about that, with the worker, iteration or factor named; a server with no deadline fails
the hang check after the check's time limit. Full marks for the solution and zero for the
untouched exercise are checked with every exercise's, in ``test_grading.py``. Each grading run
starts one Jupyter kernel. Run just these with ``pytest -q test_parameter_server_exercise.py``, and
everything about this exercise with ``pytest -q tests -k "03_parameter_server_staleness or test_parameter_server_exercise"``.
"""

from __future__ import annotations

import re
import time

import pytest

from dtcourse import checks
from dtcourse.parameter_server import ParameterServer
from exercise_harness import EXPECTED, assert_released, by_id, failed, grade_answers

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
    assert report.score == POINTS - 6, str(report)
    message = result["check_bound"].message
    assert "AsyncServer is wrong (s=1, 1 server(s), 3 workers, 7 iterations, worker 2 sleeps 250 ms" in message
    # Which worker lags most depends on scheduling (worker 2 sleeps, but on 2 busy cores another
    # one can fall further behind), so the message must name a worker, not necessarily worker 2.
    assert re.search(r"worker \d received the parameters of iteration \d+ when worker \d had sent only \d+ "
                     r"pushes: .* more than s = 1", message), message
    assert "more than s = 0" in result["check_parity"].message, result["check_parity"].message


def test_a_barrier_each_round_fails_only_the_bound_checks(tmp_path):
    report = grade_answers(NAME, tmp_path, {"async_server": BARRIER})
    result = by_id(report)
    assert failed(report) == ["check_bound", "check_bound_hidden"], str(report)
    assert report.score == POINTS - 3, str(report)
    for grade_id, s in [("check_bound", 1), ("check_bound_hidden", 3)]:
        message = result[grade_id].message
        assert (f"AsyncServer is wrong (s={s}, 1 server(s), " in message and "sleeps 250 ms per iteration): it never "
                f"let a fast worker run ahead: the largest lead was 0 iterations, but with a straggler and s = {s} "
                f"it must reach {s}" in message), message


# --------------------------------------------------------------------------- #
# The checks on their own (no kernel)
# --------------------------------------------------------------------------- #
class WholeGradients(ParameterServer):
    """The course's server, but each push is applied whole instead of as 1/N of a round."""

    def apply(self, grad, gradients=1):
        super().apply(grad * self.num_workers if self.config.mode != "sync" else grad, gradients)


def test_whole_gradients_are_reported_as_n_times_too_far():
    with pytest.raises(AssertionError, match=r"WholeGradients is wrong \(s=inf \(async\), 1 server\(s\), 3 workers.*"
                                             r"moved N = 3 times too far: apply each push as 1/N of a round"):
        checks.check_exactly_once(WholeGradients)
    checks.check_staleness_bound(WholeGradients)         # its clocks and staleness are right


class WrongStaleness(ParameterServer):
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


class NoDeadline(ParameterServer):
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
