"""The autograder and the checks it runs: full marks, zero marks, deadlocks, wrong answers.

Full and zero marks are checked for every exercise (test ids are the notebook names); the
deadlocks, wrong answers and cheats here are exercise 01's, the other exercises' are in
``test_<stem>_exercise.py``. Exercise 01's checks test the ring itself (who sends to whom, how
many messages of how many bytes, the same bits on every rank), so right sums sent some other way
score under half; the cheating functions are defined here, in a test file, because the guards
tell a student's code from dtcourse's by where it was defined. Each grading run starts a
Jupyter kernel (a few seconds). Run just these with ``pytest -q tests/test_grading.py``.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dtcourse import checks
from dtcourse.checks.guard import course_answer
from dtcourse.grading.grade import grade_notebook
from dtcourse.runtime.refuse import ReferenceRefused
from exercise_harness import (EXPECTED, NAMES, by_id, exercise_path, grade_answers, solution_code, source_path,
                              student_copy)

NAME = "01_collectives_ring"
SOURCE = source_path(NAME)
EXERCISE = exercise_path(NAME)

DEADLOCKED_REDUCE_SCATTER = '''
def ring_reduce_scatter(output, input_tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    for step in range(n - 1):
        dist.recv(output, (rank - 1) % n)  # every rank only receives: nobody ever sends
'''
WRONG_ALL_GATHER = '''
def ring_all_gather(output, input_tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = output.view(n, -1)
    chunks[rank] = input_tensor.reshape(-1)
    for step in range(n - 1):
        send_right_recv_left(chunks[(rank - step) % n], chunks[(rank - step - 1) % n])
    chunks[rank] += 1  # the bug: each rank's own chunk comes out one too big
'''


def processes_with(marker: str) -> list[int]:
    """Processes (kernels, forked ranks, orphans too) whose environment holds ``marker``."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if marker.encode() in (proc / "environ").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


# --------------------------------------------------------------------------- #
# (d) a complete answer earns every point, hidden tests included
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("name", NAMES)
def test_complete_answer_gets_full_marks(tmp_path, name):
    points, hidden = EXPECTED[name].points, EXPECTED[name].hidden
    start = time.monotonic()
    report = grade_answers(name, tmp_path, solution_code(name))
    assert (report.score, report.max_score, report.exit_code) == (points, points, 0), str(report)
    assert hidden <= set(by_id(report)) and all(c.passed for c in report.checks), str(report)
    assert f"Total: {points:g} / {points:g}" in str(report)
    assert time.monotonic() - start < 60


# --------------------------------------------------------------------------- #
# (e) the untouched exercise: zero, with the reason, through the command line
# --------------------------------------------------------------------------- #
def _grade_untouched(folder: Path, name: str) -> subprocess.CompletedProcess:
    copy = folder / "somewhere" / "my_copy.ipynb"    # renamed and moved: found through --source
    copy.parent.mkdir(parents=True)
    copy.write_bytes(exercise_path(name).read_bytes())
    return subprocess.run([sys.executable, "-m", "dtcourse.grade", str(copy), "--source", str(source_path(name))],
                          capture_output=True, text=True, timeout=300, cwd=folder)


@pytest.fixture(scope="module")
def untouched_gradings(request, tmp_path_factory) -> dict:
    """The command line's reports on the untouched exercises this session selected, two gradings at a time.

    An untouched exercise fails at once, so a grading is mostly two interpreters starting (the grader and
    its kernel); two in parallel took half the time of one after the other on the 2-core machine.
    Under pytest-xdist keep this file on one worker (``--dist loadfile``, as ``make test`` and ``make
    gpu-check`` do): each worker sees every test as selected, so workers sharing the file would each grade all.
    """
    selected = [item.callspec.params["name"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_untouched_exercise_scores_zero_with_a_clear_report"]
    root = tmp_path_factory.mktemp("untouched")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_grade_untouched, root / name, name) for name in selected}
    return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("name", NAMES)
def test_untouched_exercise_scores_zero_with_a_clear_report(untouched_gradings, name):
    expected = EXPECTED[name]
    done = untouched_gradings[name]
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"Total: 0 / {expected.points:g}" in done.stdout
    fails = [line for line in done.stdout.splitlines() if line.strip().startswith("FAIL")]
    assert len(fails) == expected.checks, done.stdout
    assert done.stdout.count(f"NotImplementedError: {expected.title}") == expected.checks, done.stdout
    assert "replace the `raise NotImplementedError` line" in done.stdout
    assert "Traceback" not in done.stdout
    # the report is the first thing a student reads, not the kernel's start-up warnings
    assert "without encryption" not in done.stdout + done.stderr, done.stderr


def test_an_exercise_is_found_by_number_or_name_from_any_folder(tmp_path, monkeypatch):
    from dtcourse.grading.grade import find_notebook

    monkeypatch.chdir(tmp_path)                          # not the course root
    assert find_notebook(NAME) == EXERCISE
    assert find_notebook(NAME[:2]) == EXERCISE           # "01"
    assert find_notebook(f"{NAME}.ipynb") == EXERCISE
    mine = tmp_path / "mine.ipynb"
    mine.write_text("{}")
    assert find_notebook("mine.ipynb") == Path("mine.ipynb")   # a path that exists wins
    with pytest.raises(FileNotFoundError, match="exercise's name or number .*01_collectives_ring"):
        find_notebook("99")
    with pytest.raises(FileNotFoundError, match="no file"):
        find_notebook("some/where/01")                   # a path is never guessed at
    done = subprocess.run([sys.executable, "-m", "dtcourse.cli", "grade", "99"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "dtcourse grade: no file 99" in done.stderr


def test_ungradable_inputs_exit_2(tmp_path):
    broken = tmp_path / f"{NAME}.ipynb"
    broken.write_text("{ not json")
    assert grade_notebook(broken, source=SOURCE).exit_code == 2
    orphan = tmp_path / "no_such_exercise.ipynb"
    orphan.write_bytes(EXERCISE.read_bytes())
    report = grade_notebook(orphan)
    assert report.exit_code == 2 and "--source" in str(report)


# --------------------------------------------------------------------------- #
# (f) a deadlocked ring fails after the timeout and leaves nothing running;
# (g) a wrong answer names the rank, the index, expected and got
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def broken_report(tmp_path_factory):
    marker = f"DTCOURSE_TEST_MARKER={uuid.uuid4().hex}"
    key, value = marker.split("=")
    answers = dict(solution_code(NAME), ring_reduce_scatter=DEADLOCKED_REDUCE_SCATTER,
                   ring_all_gather=WRONG_ALL_GATHER)
    path = student_copy(NAME, tmp_path_factory.mktemp("broken"), answers)
    os.environ[key] = value  # inherited by the kernel and every rank it forks
    try:
        start = time.monotonic()
        report = grade_notebook(path, source=SOURCE, check_timeout=2, cell_timeout=60)
        seconds = time.monotonic() - start
    finally:
        del os.environ[key]
    deadline = time.monotonic() + 10  # the kernel's shutdown may take a moment
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    return report, seconds, processes_with(marker)


def test_deadlock_is_a_failure_not_a_hang(broken_report):
    report, seconds, leftovers = broken_report
    checks_ = by_id(report)
    message = checks_["check_reduce_scatter"].message
    assert "ring_reduce_scatter did not finish" in message and "deadlock" in message, message
    assert "within 2 s" in message and re.search(r"rank\(s\) \[0, 1\]", message), message
    # the hidden check, and the all-reduce that calls the same reduce-scatter, fail at once
    for grade_id in ("check_reduce_scatter_hidden", "check_all_reduce", "check_all_reduce_hidden"):
        message = checks_[grade_id].message
        assert checks_[grade_id].points == 0, str(report)
        assert ("not run: ring_reduce_scatter (in check_reduce_scatter) deadlocked in an earlier check"
                in message), message
    assert checks_["check_ring_step"].passed  # the kernel went on grading after each deadlock
    assert report.exit_code == 1
    assert seconds < 90, f"grading took {seconds:.0f} s"
    assert leftovers == [], f"processes left behind: {leftovers}"


def test_wrong_answer_names_rank_index_expected_and_got(broken_report):
    report, _, _ = broken_report
    message = by_id(report)["check_all_gather"].message
    assert "ring_all_gather is wrong at world size 2" in message, message
    for rank in (0, 1):  # rank r's own chunk r is one too big, at index r
        found = re.search(rf"rank {rank}: index {rank}: expected (\S+), got (\S+);", message)
        assert found, message
        assert float(found[2]) - float(found[1]) == pytest.approx(1.0, abs=1e-3)


def _tiny_source(tmp_path: Path, answer: str = "x = 1") -> Path:
    """An instructor's notebook: an answer cell (``answer``), and a test cell worth a point, ``assert x == 1``."""
    source = tmp_path / "solutions" / "02_tiny.ipynb"
    source.parent.mkdir(parents=True)
    meta = {"grade": False, "grade_id": "answer", "locked": False, "schema_version": 3, "solution": True}
    test = {"grade": True, "grade_id": "test", "locked": False, "points": 1, "schema_version": 3,
            "solution": False}
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "id": "a", "metadata": {"nbgrader": meta},
                     "outputs": [], "source": answer},
                    {"cell_type": "code", "execution_count": None, "id": "b", "metadata": {"nbgrader": test},
                     "outputs": [], "source": "assert x == 1"}],
          "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
          "nbformat": 4, "nbformat_minor": 5}
    source.write_text(json.dumps(nb))
    return source


def test_a_hanging_cell_is_interrupted_and_grading_goes_on(tmp_path):
    source = _tiny_source(tmp_path, "import time\nx = 1\ntime.sleep(600)")
    start = time.monotonic()
    report = grade_notebook(source, source=source, cell_timeout=3)
    assert time.monotonic() - start < 60
    assert report.exit_code == 0 and report.score == 1, str(report)
    assert any("(answer) raised CellTimeoutError: the cell ran longer than 3 s" in note
               for note in report.notes), report.notes


def test_a_kernel_that_dies_before_its_first_cell_is_started_again(tmp_path, monkeypatch):
    """Fourteen graders at once on the GPU machine (2026-11-27): a kernel lost its port to another one
    ("Address already in use") and died before kernel_info; the notebook scored 0 with an error."""
    import dtcourse.grading.grade as grade
    starts, real = [], grade.NotebookClient

    class DiesFirst(real):
        def execute(self, **kwargs):
            starts.append(1)
            if len(starts) == 1:
                raise RuntimeError("Kernel died before replying to kernel_info")
            return super().execute(**kwargs)
    monkeypatch.setattr(grade, "NotebookClient", DiesFirst)
    source = _tiny_source(tmp_path)
    report = grade_notebook(source, source=source, cell_timeout=60)
    assert len(starts) == 2 and report.exit_code == 0 and report.score == 1, str(report)

    class NeverStarts(real):
        def execute(self, **kwargs):
            starts.append(1)
            raise RuntimeError("Kernel died before replying to kernel_info")
    monkeypatch.setattr(grade, "NotebookClient", NeverStarts)
    starts.clear()
    report = grade_notebook(source, source=source, cell_timeout=60)
    assert len(starts) == grade.KERNEL_STARTS == 3 and report.score == 0
    assert report.error == ("the kernel 'python3' did not run the notebook after 3 starts "
                            "(RuntimeError: Kernel died before replying to kernel_info)")

    # a kernel that the student's own first cell kills is not started again: that cell would only kill it again
    class Counts(real):
        def execute(self, **kwargs):
            starts.append(1)
            return super().execute(**kwargs)
    monkeypatch.setattr(grade, "NotebookClient", Counts)
    starts.clear()
    killer = _tiny_source(tmp_path / "killer", "import os\nos._exit(1)")
    report = grade_notebook(killer, source=killer, cell_timeout=60)
    assert len(starts) == 1 and report.score == 0
    assert report.error.startswith("the kernel 'python3' did not run the notebook ("), report.error


# --------------------------------------------------------------------------- #
# The checks on their own (no kernel): tolerances and messages
# --------------------------------------------------------------------------- #
def _ring_step(send: torch.Tensor, recv: torch.Tensor) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % n), dist.P2POp(dist.irecv, recv, (rank - 1) % n)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()


def _ring_reduce_scatter(output: torch.Tensor, input_tensor: torch.Tensor) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = input_tensor.reshape(n, -1).clone()
    incoming = torch.empty_like(chunks[0])
    for step in range(n - 1):
        _ring_step(chunks[(rank - step - 1) % n], incoming)
        chunks[(rank - step - 2) % n] += incoming
    output.copy_(chunks[rank].reshape(output.shape))


def _ring_all_reduce(tensor: torch.Tensor) -> None:
    """A ring over uneven chunks, no padding, that skips the empty ones (as dtcourse's own does)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1)
    parts = flat.tensor_split(n)                      # views; empty ones when numel < n
    for step in range(2 * (n - 1)):
        send_c, recv_c = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = torch.empty_like(parts[recv_c])
        ops = [dist.P2POp(dist.isend, parts[send_c], (rank + 1) % n)] if parts[send_c].numel() else []
        ops += [dist.P2POp(dist.irecv, incoming, (rank - 1) % n)] if incoming.numel() else []
        for request in dist.batch_isend_irecv(ops) if ops else []:
            request.wait()
        if step < n - 1:
            parts[recv_c].add_(incoming)
        else:
            parts[recv_c].copy_(incoming)


def _whole_tensor_around(tensor: torch.Tensor) -> None:
    """Right sums, wrong technique: every rank passes whole tensors around the ring, N-1 times."""
    travelling, total = tensor.clone(), tensor.clone()
    for _ in range(dist.get_world_size() - 1):
        incoming = torch.empty_like(tensor)
        _ring_step(travelling, incoming)
        total += incoming
        travelling = incoming
    tensor.copy_(total)


def _through_rank_0(tensor: torch.Tensor) -> None:
    """Right sums, wrong technique: rank 0 collects every tensor, sums, and sends the total back."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for src in range(1, n):
            dist.recv(incoming, src)
            tensor += incoming
        for dst in range(1, n):
            dist.send(tensor, dst)
    else:
        dist.send(tensor, 0)
        dist.recv(tensor, 0)


def test_right_sums_without_a_ring_fail_on_the_messages():
    with pytest.raises(AssertionError, match=r"rank 0: sent 1 message to rank 2; in a ring each rank sends only "
                                             r"to its right neighbour, here rank 1"):
        checks.check_all_reduce(_through_rank_0, world_sizes=(4,), sizes=(8,))
    # every one of the 5 ranks found the same: one line for them all
    with pytest.raises(AssertionError, match=r":\n  ranks 0, 1, 2, 3 and 4: sent a message of 22 bytes; a ring "
                                             r"all-reduce sends one chunk per message, at most ceil\(numel/N\) = 3"):
        checks.check_all_reduce(_whole_tensor_around, world_sizes=(5,), sizes=(11,), dtypes=(torch.float16,))

    def whole_input_around(output, input_tensor):      # each rank sums every whole input, in its own order
        rank, n = dist.get_rank(), dist.get_world_size()
        total = input_tensor.clone()
        _whole_tensor_around(total)
        output.copy_(total.reshape(n, -1)[rank].reshape(output.shape))

    with pytest.raises(AssertionError, match=r"ranks 0, 1, 2 and 3: sent a message of 96 bytes \(288 bytes in all\); a ring "
                                             r"reduce-scatter of S = 96 bytes on N = 4 ranks sends N-1 = 3 messages "
                                             r"of one chunk, S/N = 24 bytes, each"):
        checks.check_reduce_scatter(whole_input_around, world_sizes=(4,), sizes=(6,))

    def step_in_halves(send, recv):
        for half_send, half_recv in zip(send.chunk(2), recv.chunk(2)):
            _ring_step(half_send, half_recv)

    with pytest.raises(AssertionError, match=r"sent 2 messages \(16 bytes in all\); one ring step sends one message"):
        checks.check_ring_exchange(step_in_halves, world_sizes=(2,), sizes=(4,))


def test_sums_passed_outside_the_process_group_fail_on_the_bytes(tmp_path):
    def through_files(tensor):          # no message at all: each rank reads the others' tensors from disk
        rank, n = dist.get_rank(), dist.get_world_size()
        torch.save(tensor, tmp_path / f"{rank}.part")
        (tmp_path / f"{rank}.part").rename(tmp_path / f"{rank}.pt")
        while len(list(tmp_path.glob("*.pt"))) < n:
            time.sleep(0.01)
        tensor.copy_(sum(torch.load(tmp_path / f"{r}.pt") for r in range(n)))

    with pytest.raises(AssertionError, match=r"the 2 ranks sent 0 bytes together; a ring all-reduce moves every "
                                             r"element N-1 hops .* at least 2\(N-1\)·S = 32 bytes"):
        checks.check_all_reduce(through_files, world_sizes=(2,), sizes=(4,))


def test_every_rank_must_end_with_the_same_bits():
    def one_rank_off_by_an_ulp(tensor):
        _ring_all_reduce(tensor)
        if dist.get_rank() == 2:          # within the rounding tolerance, but not what the others hold
            tensor.view(-1)[3] = torch.nextafter(tensor.view(-1)[3], torch.tensor(float("inf"), dtype=tensor.dtype))

    with pytest.raises(AssertionError, match=r"rank 2: its result differs from rank 0's, bit for bit, at index 3: "
                                             r"\S+ here, \S+ on rank 0"):
        checks.check_all_reduce(one_rank_off_by_an_ulp, world_sizes=(3,), sizes=(5,), dtypes=(torch.float16,))


def test_a_ring_that_skips_empty_chunks_passes():
    # numel < N leaves empty chunks, whose messages it never sends: zero-byte messages are not counted
    checks.check_all_reduce(_ring_all_reduce, world_sizes=(2, 5), sizes=(1, 3, 7, (2, 3)), dtypes=checks.FLOATS)


def test_the_course_reference_refuses_to_be_the_answer():
    from dtcourse.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter, tree_all_reduce
    from dtcourse.collectives.ring import reduce_scatter_steps

    with pytest.raises(ReferenceRefused, match=r"check_all_reduce was given dtcourse\.collectives\.ring\."
                                               r"ring_all_reduce, the course's own answer to exercise 01"):
        checks.check_all_reduce(ring_all_reduce, world_sizes=(2,), sizes=(3,))
    with pytest.raises(ReferenceRefused, match=r"ring_reduce_scatter, the course's own answer"):
        checks.check_reduce_scatter(functools.partial(ring_reduce_scatter), world_sizes=(2,))
    with pytest.raises(AssertionError, match="which is library code, not yours"):
        checks.check_all_reduce(dist.all_reduce, world_sizes=(2,), sizes=(3,))

    def calls_it(output, input_tensor):
        ring_all_gather(output, input_tensor)

    with pytest.raises(AssertionError, match=r"rank \d raised ReferenceRefused: dtcourse\.collectives\.ring\."
                                             r"ring_all_gather is the course's own answer to exercise 01"):
        checks.check_all_gather(calls_it, world_sizes=(2,), sizes=(3,))

    def calls_its_steps(tensor):           # the ring's inner loop, and the other all-reduces, refuse too
        rank, n = dist.get_rank(), dist.get_world_size()
        reduce_scatter_steps(list(tensor.view(-1).tensor_split(n)), rank, n, None, None)

    with pytest.raises(AssertionError, match=r"raised ReferenceRefused: dtcourse\.collectives\.ring\."
                                             r"reduce_scatter_steps is the course's own answer"):
        checks.check_all_reduce(calls_its_steps, world_sizes=(2,), sizes=(4,))
    with pytest.raises(AssertionError, match=r"tree_all_reduce is the course's own answer"):
        checks.check_all_reduce(lambda tensor: tree_all_reduce(tensor), world_sizes=(2,), sizes=(4,))
    from dtcourse.collectives import fast_ring_all_reduce
    with pytest.raises(AssertionError, match=r"fast_ring_all_reduce is the course's own answer"):   # the fast ring too
        checks.check_all_reduce(lambda tensor: fast_ring_all_reduce(tensor), world_sizes=(2,), sizes=(4,))
    # outside a check the references run as usual, and the lesson still shows their code
    assert inspect.getsource(ring_all_reduce).startswith("def ring_all_reduce(")      # no mark above it
    assert course_answer(ring_all_reduce) == ("collectives", "01")


SAVED_ALL_REDUCE = dist.all_reduce     # taken before any check patches anything


def test_collectives_are_refused_however_they_are_reached():
    import torch.distributed.distributed_c10d as c10d

    def saved_reference(tensor):
        SAVED_ALL_REDUCE(tensor)

    def through_c10d(tensor):
        c10d.all_reduce(tensor)

    def all_gather_list(output, input_tensor):
        dist.all_gather(list(output.chunk(dist.get_world_size())), input_tensor)

    for cheat, check in [(saved_reference, checks.check_all_reduce), (through_c10d, checks.check_all_reduce),
                         (all_gather_list, checks.check_all_gather)]:
        with pytest.raises(AssertionError, match=r"rank \d raised ReferenceRefused: your code called a collective "
                                                 r"\(all(reduce|gather) on the process group"):
            check(cheat, world_sizes=(2,), sizes=(3,))


def test_checks_report_an_unwritten_output():
    def returns_instead(output, input_tensor):
        return input_tensor[: output.numel()].clone()

    with pytest.raises(AssertionError, match="The output was never written: it still holds the NaN it was filled "
                                             "with and you returned a tensor instead"):
        checks.check_reduce_scatter(returns_instead, world_sizes=(2,), sizes=(2,))

    def assigns_the_name(tensor):
        tensor = tensor * dist.get_world_size()    # noqa: F841 (the bug: the caller's tensor stays as it was)

    with pytest.raises(AssertionError, match="The tensor did not change at all: nothing wrote into it"):
        checks.check_all_reduce(assigns_the_name, world_sizes=(2,), sizes=(3,))


def test_hints_say_only_what_the_check_saw():
    # written in place, by adding into the NaN-filled output: not "write in place"
    def adds_into_the_output(output, input_tensor):
        total = torch.empty_like(output)
        _ring_reduce_scatter(total, input_tensor)
        output += total

    with pytest.raises(AssertionError) as caught:
        checks.check_reduce_scatter(adds_into_the_output, world_sizes=(2,), sizes=(2,))
    message = str(caught.value)
    assert "Your code wrote into the output, but every element still holds, bit for bit, the NaN" in message
    assert "never written" not in message and "write the result into it in place" not in message

    # written in place, but with this rank's own values: not "did not change at all"
    def copies_its_input_back(tensor):
        mine = tensor.clone()
        _ring_all_reduce(tensor)
        tensor.copy_(mine)

    with pytest.raises(AssertionError) as caught:
        checks.check_all_reduce(copies_its_input_back, world_sizes=(2,), sizes=(3,))
    message = str(caught.value)
    assert "Your code wrote into the tensor, but it still holds exactly this rank's input" in message
    assert "did not change" not in message and "assigning to the name" not in message

    # received into, but its own chunk never written: the check says which elements
    def forgets_its_own_chunk(output, input_tensor):
        rank, n = dist.get_rank(), dist.get_world_size()
        chunks = output.view(n, -1)
        for step in range(n - 1):
            _ring_step(chunks[(rank - step) % n], chunks[(rank - step - 1) % n])

    with pytest.raises(AssertionError, match=r"rank 1: .*2 elements \(the first at index 2\) still hold the NaN the "
                                             r"output was filled with: nothing overwrote them.*; 4 elements are "
                                             r"NaN that the check did not put there"):
        checks.check_all_gather(forgets_its_own_chunk, world_sizes=(3,), sizes=(2,))

def test_exchange_check_passes_on_odd_world_sizes_and_all_dtypes():
    checks.check_ring_exchange(_ring_step, world_sizes=(3, 5), sizes=(1, (2, 3)), dtypes=checks.FLOATS)


# --------------------------------------------------------------------------- #
# Exercise 01 graded whole: right sums without a ring, the course's own ring,
# and a correct ring written unlike the solution
# --------------------------------------------------------------------------- #
WHOLE_TENSOR_AROUND = {  # every rank passes whole tensors around the ring: N-1 times a ring's bytes
    "ring_reduce_scatter": '''
def ring_reduce_scatter(output, input_tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    total, travelling = input_tensor.clone(), input_tensor.clone()
    for step in range(n - 1):
        incoming = torch.empty_like(travelling)
        send_right_recv_left(travelling, incoming)
        total += incoming
        travelling = incoming
    output.copy_(total.reshape(n, -1)[rank].reshape(output.shape))
''',
    "ring_all_gather": '''
def ring_all_gather(output, input_tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    output.view(n, -1)[rank] = input_tensor.reshape(-1)
    for step in range(n - 1):
        incoming = torch.empty_like(output)
        send_right_recv_left(output.clone(), incoming)
        source = (rank - step - 1) % n
        output.view(n, -1)[source] = incoming.view(n, -1)[source]
''',
    # the same as _whole_tensor_around above, under the exercise's names
    "ring_all_reduce": "\n" + inspect.getsource(_whole_tensor_around).replace(
        "def _whole_tensor_around(tensor: torch.Tensor) -> None:", "def ring_all_reduce(tensor):").replace(
        "_ring_step(", "send_right_recv_left("),
}
THROUGH_RANK_0 = {  # everything relayed through rank 0, whose link carries (N-1) times the tensor
    "ring_reduce_scatter": '''
def ring_reduce_scatter(output, input_tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        total, incoming = input_tensor.clone(), torch.empty_like(input_tensor)
        for src in range(1, n):
            dist.recv(incoming, src)
            total += incoming
        chunks = total.reshape(n, -1)
        for dst in range(1, n):
            dist.send(chunks[dst].contiguous(), dst)
        output.copy_(chunks[0].reshape(output.shape))
    else:
        dist.send(input_tensor.contiguous(), 0)
        dist.recv(output, 0)
''',
    "ring_all_gather": '''
def ring_all_gather(output, input_tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = output.view(n, -1)
    chunks[rank] = input_tensor.reshape(-1)
    if rank == 0:
        for src in range(1, n):
            dist.recv(chunks[src], src)
        for dst in range(1, n):
            dist.send(output, dst)
    else:
        dist.send(input_tensor.contiguous(), 0)
        dist.recv(output, 0)
''',
    # the same relay as _through_rank_0 above, under the exercise's name
    "ring_all_reduce": "\n" + inspect.getsource(_through_rank_0).replace(
        "def _through_rank_0(tensor: torch.Tensor) -> None:", "def ring_all_reduce(tensor):"),
}
COURSE_RING = {  # the course's own ring, imported, called, or reached through a saved collective
    "ring_reduce_scatter": "from dtcourse.collectives import ring_reduce_scatter\n",
    "ring_all_gather": '''
import dtcourse.collectives as course

def ring_all_gather(output, input_tensor):
    course.ring_all_gather(output, input_tensor)
''',
    "ring_all_reduce": '''
everyone_at_once = dist.all_reduce          # saved before any check runs

def ring_all_reduce(tensor):
    everyone_at_once(tensor)
'''}
ANOTHER_RING = {  # correct, and unlike the solution: irecv/isend pairs, uneven chunks, no padding
    "send_right_recv_left": '''
def send_right_recv_left(send, recv):
    me, world = dist.get_rank(), dist.get_world_size()
    arriving = dist.irecv(recv, (me - 1) % world)     # post the receive first, then the send
    leaving = dist.isend(send, (me + 1) % world)
    arriving.wait()
    leaving.wait()
''',
    "ring_reduce_scatter": '''
def ring_reduce_scatter(output, input_tensor):
    me, world = dist.get_rank(), dist.get_world_size()
    parts = [part.clone() for part in input_tensor.reshape(-1).tensor_split(world)]
    for step in range(world - 1):
        outgoing, landing = (me - step - 1) % world, (me - step - 2) % world
        buffer = torch.empty_like(parts[landing])
        requests = [dist.irecv(buffer, (me - 1) % world), dist.isend(parts[outgoing], (me + 1) % world)]
        for request in requests:
            request.wait()
        parts[landing] = parts[landing] + buffer
    output.copy_(parts[me].view_as(output))
''',
    "ring_all_gather": '''
def ring_all_gather(output, input_tensor):
    me, world = dist.get_rank(), dist.get_world_size()
    pieces = output.view(-1).tensor_split(world)
    pieces[me].copy_(input_tensor.reshape(-1))
    for step in range(world - 1):
        arriving = dist.irecv(pieces[(me - step - 1) % world], (me - 1) % world)
        leaving = dist.isend(pieces[(me - step) % world], (me + 1) % world)
        arriving.wait()
        leaving.wait()
''',
    "ring_all_reduce": '''
def ring_all_reduce(tensor):
    me, world = dist.get_rank(), dist.get_world_size()
    flat = tensor.reshape(-1).clone()
    parts = flat.tensor_split(world)     # uneven views, empty ones when numel < world: sent all the same
    for step in range(2 * (world - 1)):  # N-1 steps summing, then N-1 copying
        outgoing, landing = (me - step - 1) % world, (me - step - 2) % world
        buffer = torch.empty_like(parts[landing])
        requests = [dist.irecv(buffer, (me - 1) % world), dist.isend(parts[outgoing], (me + 1) % world)]
        for request in requests:
            request.wait()
        if step < world - 1:
            parts[landing].add_(buffer)
        else:
            parts[landing].copy_(buffer)
    tensor.copy_(flat.view_as(tensor))
'''}
RING_CHECKS = ["check_reduce_scatter", "check_reduce_scatter_hidden", "check_all_gather", "check_all_gather_hidden",
               "check_all_reduce", "check_all_reduce_hidden"]


@pytest.mark.parametrize("kind", ["whole_tensor_around", "through_rank_0"])
def test_right_sums_without_a_ring_score_under_half(tmp_path, kind):
    answers = {"whole_tensor_around": WHOLE_TENSOR_AROUND, "through_rank_0": THROUGH_RANK_0}[kind]
    report = grade_answers(NAME, tmp_path, dict(solution_code(NAME), **answers))
    assert report.score < report.max_score / 2, str(report)
    assert by_id(report)["check_ring_step"].passed, str(report)
    checks_ = by_id(report)
    for grade_id in RING_CHECKS:
        message = checks_[grade_id].message
        assert checks_[grade_id].points == 0, str(report)
        assert "is wrong at world size" in message and "expected" not in message, message
        assert re.search(r"right neighbour|of one chunk|sends one chunk per message", message), message


def test_the_course_ring_scores_nothing_but_the_step(tmp_path):
    report = grade_answers(NAME, tmp_path, dict(solution_code(NAME), **COURSE_RING))
    assert report.score == 1, str(report)
    # the imports of the course's ring, listed for the instructor with their cells (torch's all_reduce is not one)
    assert [line.split(": uses ")[1].split(",")[0] for line in report.flagged] == [
        "dtcourse.collectives.ring_reduce_scatter", "dtcourse.collectives.ring_all_gather"], report.flagged
    checks_ = by_id(report)
    for grade_id in ("check_reduce_scatter", "check_reduce_scatter_hidden"):
        assert "was given dtcourse.collectives.ring.ring_reduce_scatter, the course's own answer to exercise 01" \
            in checks_[grade_id].message, checks_[grade_id].message
    assert re.search(r"raised ReferenceRefused: dtcourse\.collectives\.ring\.ring_all_gather is the course's own "
                     r"answer to exercise 01", checks_["check_all_gather"].message), checks_["check_all_gather"].message
    assert "your code called a collective (allreduce on the process group" in checks_["check_all_reduce"].message


def test_a_ring_unlike_the_solution_gets_full_marks(tmp_path):
    report = grade_answers(NAME, tmp_path, dict(solution_code(NAME), **ANOTHER_RING))
    assert report.score == report.max_score == EXPECTED[NAME].points, str(report)
