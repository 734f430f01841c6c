"""Grading an instructor can trust: the checks cannot be talked out of checking.

* the course's answers, listed in each check module's ``ANSWERS``, refuse student callers while a
  check runs, and only them, whatever name the student bound them to (``runtime/refuse.py``);
* ``guard.watching`` catches a collective however it is reached, records messages, and puts
  the process group back;
* the audit finds code that rebinds a check or patches what the checks rely on, and a notebook
  with such code scores 0, in our grader and under nbgrader's rules alike;
* a harmless warning in a rank costs no points; a deadlock is waited out once, not once per cell;
* a student's self-check needs no ``solutions/``; grading without them says what to run instead.

Exercise 01 stands in for all: every exercise's check goes through the same wrappers.
Each graded notebook starts a kernel (a few seconds).
"""

from __future__ import annotations

import json
import types
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dtcourse.checks as checks
from dtcourse import launch
from dtcourse.checks.guard import watching
from dtcourse.grading.audit import audit_cells
from dtcourse.grading.grade import grade_notebook
from dtcourse.checks.collectives import ANSWERS
from dtcourse.collectives import ring_all_reduce as mine      # bound at notebook level, before any check
from dtcourse.runtime.refuse import ReferenceRefused, refusing
from exercise_harness import EXPECTED, NAMES, by_id, exercise_path, solution_code, source_path, student_copy

NAME = "01_collectives_ring"


# --------------------------------------------------------------------------- #
# The course's answers refuse the student's calls, and only while a check runs
# --------------------------------------------------------------------------- #
def _answer(x: int) -> int:
    return 2 * x


def _other_answer(x: int) -> int:
    return 3 * x


class _Server:
    def __init__(self, n: int) -> None:
        self.n = n


class _StudentServer(_Server):   # defined here, in a test file: a student's frame
    pass


def _student_calls(fn, *args):
    return fn(*args)


def _refused(fn, *args) -> str:
    try:
        fn(*args)
        return "ran"
    except ReferenceRefused:
        return "refused"


def test_an_answer_refuses_student_callers_inside_a_check_only():
    assert _answer(2) == 4 and _Server(1).n == 1                     # outside a check: as usual
    with refusing([_answer, _Server], "99"):
        with pytest.raises(ReferenceRefused, match="exercise 99.*do this part yourself"):
            _student_calls(_answer, 2)
        with pytest.raises(ReferenceRefused, match="_Server"):
            _StudentServer(3)                      # a subclass refuses, even made by the check itself
        assert _answer(2) == 4                     # the check's own use: no student frame below the block's
        import threading

        caught = []
        worker = threading.Thread(target=lambda: caught.append(_refused(_answer, 2)))
        worker.start()
        worker.join()
        assert caught == ["refused"]                                 # a thread the student starts too
    with refusing([_other_answer], "98"):
        assert _student_calls(_answer, 2) == 4                       # another exercise's check
    assert _student_calls(_answer, 5) == 10


def _calls_mine(tensor: torch.Tensor) -> None:
    mine(tensor)                      # the name the notebook bound before the check


def _mine_on_ranks() -> list[float]:
    total = torch.ones(3)
    mine(total)
    return total.tolist()


def test_an_answer_bound_before_the_check_is_refused_and_runs_again_after():
    original = mine.__code__
    with pytest.raises(AssertionError, match=r"rank \d raised ReferenceRefused: dtcourse\.collectives\.ring\."
                                             r"ring_all_reduce is the course's own answer to exercise 01"):
        checks.check_all_reduce(_calls_mine, world_sizes=(2,), sizes=(3,))
    import dtcourse.collectives.ring as ring
    with watching(ANSWERS):                   # in this process too: the same object, switched off in place
        assert mine is ring.ring_all_reduce and mine.__code__ is not original
        with pytest.raises(ReferenceRefused, match="ring_all_reduce is the course's own answer to exercise 01"):
            _student_calls(mine, torch.ones(3))
    with pytest.raises(KeyError), watching(ANSWERS):      # put back however the block ends
        raise KeyError("the student's error")
    assert mine.__code__ is original and not [name for name in vars(ring) if name.startswith("__dtcourse")]
    assert launch(_mine_on_ranks, 2) == [[2.0, 2.0, 2.0]] * 2          # after the check: as usual


def test_a_check_refuses_the_answer_itself_passed_by_name():
    with pytest.raises(AssertionError, match="was given .*ring_all_reduce, the course's own answer to exercise"):
        checks.check_all_reduce(mine, world_sizes=(2,))     # a student's `ring_all_reduce = the course's one`


def _ring_of_collectives(x: torch.Tensor, how: str) -> None:
    n = dist.get_world_size()
    calls = {"saved": lambda: _SAVED_ALL_REDUCE(x), "c10d": lambda: dist.distributed_c10d.all_reduce(x),
             "barrier": dist.barrier,
             # torch 2.13's collectives with methods of their own on the process group
             "reduce_scatter_single": lambda: dist.reduce_scatter_single(torch.empty(1), torch.ones(n)),
             "all_gather_single": lambda: dist.all_gather_single(torch.empty(n), torch.ones(1)),
             "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(n), torch.ones(n))}
    calls[how]()


HOWS = ("saved", "c10d", "barrier", "reduce_scatter_single", "all_gather_single", "all_to_all_single")


_SAVED_ALL_REDUCE = dist.all_reduce     # taken before any check starts


def _guard_rank() -> dict:
    found = {}
    for how in HOWS:
        with watching(ANSWERS, p2p_only=True):
            try:
                _ring_of_collectives(torch.ones(3), how)
                found[how] = "ran"
            except AssertionError as error:
                found[how] = str(error)
    rank, n = dist.get_rank(), dist.get_world_size()
    with watching(p2p_only=True) as watch:
        sent, received = torch.arange(5.0), torch.empty(5)
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, (rank + 1) % n),
                                               dist.P2POp(dist.irecv, received, (rank - 1) % n)]):
            request.wait()
    found["sent"], found["received"] = watch.sent, watch.received
    total = torch.ones(2)
    dist.all_reduce(total)                   # after the block, collectives work again
    found["after"] = total.tolist()
    return found


def test_the_guard_catches_collectives_however_reached_and_records_messages():
    results = launch(_guard_rank, 3)
    for rank, found in enumerate(results):
        for how in HOWS:
            assert "point-to-point messages only" in found[how], (how, found[how])
        assert found["sent"] == [((rank + 1) % 3, 20)] and found["received"] == [((rank - 1) % 3, 20)]
        assert found["after"] == [3.0, 3.0]


# --------------------------------------------------------------------------- #
# The audit
# --------------------------------------------------------------------------- #
CHEATS = {
    "rebinds a check": "check_all_reduce = lambda *args, **kwargs: None",
    "defines a check": "def check_ring_exchange(*args, **kwargs):\n    pass",
    "patches a check's insides": "import dtcourse.checks.collectives\n"
                                 "dtcourse.checks.collectives._compare = lambda *args: None",
    "patches through an alias": "import dtcourse.checks.common as common\ncommon._launch_check = print",
    "setattr on the package": "import dtcourse.checks\nsetattr(dtcourse.checks, 'check_all_gather', print)",
    "patches torch.distributed": "import torch\ntorch.distributed.all_reduce = print",
    "replaces a module": "import sys\nsys.modules['dtcourse.checks'] = None",
    "touches the guard": "from dtcourse.runtime.refuse import refusing",
    "writes the module's dict": "import dtcourse.checks\nvars(dtcourse.checks)['check_all_reduce'] = print",
    "object.__setattr__": "import dtcourse.checks as c\nobject.__setattr__(c, 'x', 1)",
    "patches torch's tensor methods": "import torch\ntorch.Tensor.__sub__ = lambda a, b: torch.zeros_like(a)",
    "patches a comparison": "from torch import Tensor\nsetattr(Tensor, 'abs', lambda t: t * 0)",
    "patches torch.equal": "import torch as T\nT.equal = lambda a, b: True",
}


@pytest.mark.parametrize("kind", CHEATS)
def test_the_audit_finds_each_kind_of_reaching_in(kind):
    findings = audit_cells(["import torch\nimport torch.distributed as dist", CHEATS[kind]])
    assert findings and all(f.cell == 1 for f in findings), (kind, findings)


def test_the_audit_leaves_ordinary_code_alone():
    ordinary = ["import torch\nimport torch.distributed as dist\nfrom dtcourse.checks import check_all_reduce",
                "def ring(t):\n    check_ok = True\n    rank = dist.get_rank()\n    t.add_(1)\n    return check_ok",
                "class DDP:\n    def __init__(self):\n        self.work = dist.get_world_size()",
                "check_all_reduce(ring)", "import dtcourse.checks as c\nc.check_all_reduce(ring)",
                "!ls\n%timeit ring",
                # the student's own helper, and a helper the exercise offers, named like checks: not checks
                "def check_split(t, n):\n    assert t % n == 0",
                "from dtcourse.tensor_parallel.layers import check_divides\ncheck_divides(2, 8, 'width')",
                "torch.backends.cudnn.deterministic = True\ntorch.manual_seed(0)"]
    assert audit_cells(ordinary) == []
    for name in NAMES:   # every solution and released notebook, every cell
        for folder in ("solutions", "exercises"):
            cells = [("".join(c["source"])) for c in json.loads((Path(source_path(name)).parents[1] / folder
                                                                  / f"{name}.ipynb").read_text())["cells"]
                     if c["cell_type"] == "code"]
            assert audit_cells(cells) == [], (folder, name)


def _with_cell_after_setup(path: Path, code: str) -> None:
    nb = json.loads(path.read_text())
    index = next(i for i, c in enumerate(nb["cells"]) if c["metadata"].get("nbgrader", {}).get("grade_id") == "setup")
    nb["cells"].insert(index + 1, {"cell_type": "code", "execution_count": None, "id": "extra", "metadata": {},
                                   "outputs": [], "source": code})
    path.write_text(json.dumps(nb, indent=1))


# Exercise 01's four answers, each an empty function
EMPTY = {"send_right_recv_left": "def send_right_recv_left(send, recv):\n    pass",
         "ring_reduce_scatter": "def ring_reduce_scatter(output, input_tensor):\n    pass",
         "ring_all_gather": "def ring_all_gather(output, input_tensor):\n    pass",
         "ring_all_reduce": "def ring_all_reduce(tensor):\n    pass"}


def test_cheating_notebooks_score_zero_and_are_flagged(tmp_path):
    """Empty functions, with the checks rebound in a solution cell and patched in an extra cell."""
    rebinds = ("\ncheck_ring_exchange = check_reduce_scatter = lambda *a, **k: None\n"
               "check_all_gather = check_all_reduce = lambda *a, **k: None")
    path = student_copy(NAME, tmp_path, dict(EMPTY, send_right_recv_left=EMPTY["send_right_recv_left"] + rebinds))
    _with_cell_after_setup(path, "import dtcourse.checks.common as common\n"
                                 "common._launch_check = lambda *args, **kwargs: None\n"
                                 "import dtcourse.checks.collectives as mine\nmine._compare = lambda *args: None")
    report = grade_notebook(path, source=source_path(NAME), check_timeout=30)
    assert report.score == 0, str(report)
    for check in report.checks:
        assert "reaches into the grading" in check.message, str(report)
    assert len(report.flagged) >= 4 and report.exit_code == 1
    assert "Flagged for the instructor" in str(report)
    # one cell, named the same way in the check's message and in the Flagged list: by its first line
    begins = "'import dtcourse.checks.common as common'"
    assert any(f"(the cell that begins {begins}), line 2" in line for line in report.flagged), report.flagged
    message = report.checks[0].message
    assert re.search(r"the cell run as \[\d+\] \(it begins " + re.escape(begins) + r"\), line 2", message), message


def test_an_answer_executed_from_its_source_is_refused_and_one_typed_alike_is_not():
    import inspect
    from dtcourse.pipeline import schedules
    namespace = dict(vars(schedules))                                         # what the answer's code looks up
    exec(inspect.getsource(schedules.one_f_one_b), namespace)                 # noqa: S102 - the cheat under test
    copied = namespace["one_f_one_b"]
    assert copied is not schedules.one_f_one_b and copied(3, 4) == schedules.one_f_one_b(3, 4)
    with pytest.raises(ReferenceRefused, match=r"check_1f1b_order was given one_f_one_b, which reaches one_f_one_b: "
                                                r"it was executed from a string holding the code of "
                                                r"dtcourse\.pipeline\.schedules\.one_f_one_b"):
        checks.check_1f1b_order(copied)
    # a copy of the function object, from its __code__, called by the student's own function
    clone = types.FunctionType(schedules.one_f_one_b.__code__, vars(schedules), "clone")

    def mine(p, m):
        return clone(p, m)
    with pytest.raises(ReferenceRefused, match=r"which reaches clone: it is a copy, made from its __code__, of the "
                                                r"code of dtcourse\.pipeline\.schedules\.one_f_one_b"):
        checks.check_1f1b_order(mine)
    # the same code compiled under a file's name, as a cell's is: not compared (a short right answer may coincide)
    typed = dict(vars(schedules))
    exec(compile(inspect.getsource(schedules.one_f_one_b), "/tmp/ipykernel_0/cell.py", "exec"), typed)  # noqa: S102
    checks.check_1f1b_order(typed["one_f_one_b"])


def test_checks_rewritten_before_they_run_leave_no_receipt_and_score_nothing(tmp_path):
    """An IPython input transformer that turns every later cell's check calls into ``pass``: each graded cell
    then finishes without an error, but its check never ran, so it left no receipt."""
    path = student_copy(NAME, tmp_path, EMPTY)
    _with_cell_after_setup(path, "def quiet(lines):\n"
                                 "    return [('pass\\n' if 'check_' in line else line) for line in lines]\n"
                                 "get_ipython().input_transformers_post.append(quiet)")
    report = grade_notebook(path, source=source_path(NAME), check_timeout=30)
    assert report.score == 0, str(report)
    for check in report.checks:
        assert "left no receipt: the cell finished, but the check did not run as written" in check.message, str(report)
    assert any("did not run, though the cell finished" in line for line in report.flagged), report.flagged


def test_the_checks_cannot_be_rebound_on_the_package():
    genuine = checks.check_all_reduce
    with pytest.raises(AttributeError, match="is a check and cannot be replaced"):
        checks.check_all_reduce = print
    with pytest.raises(AttributeError, match="cannot be deleted"):
        del checks.check_all_reduce
    checks.__dict__["check_all_reduce"] = print          # even behind the module's back
    try:
        from dtcourse.checks import check_all_reduce
        assert check_all_reduce is genuine
    finally:
        checks.__dict__["check_all_reduce"] = genuine


def test_fresh_copies_ignore_a_patched_check_module():
    """Outside any notebook (no history to audit): a patched helper inside dtcourse.checks changes nothing."""
    import dtcourse.checks.collectives as module

    def empty(output, input_tensor):
        pass

    saved = module._compare
    module._compare = lambda *args: None
    try:
        with pytest.raises(AssertionError, match="still holds the NaN"):
            checks.check_reduce_scatter(empty, world_sizes=(2,), sizes=(2,))
    finally:
        module._compare = saved


# --------------------------------------------------------------------------- #
# Warnings cost nothing; a deadlock is waited out once
# --------------------------------------------------------------------------- #
def _exchange_that_warns(send: torch.Tensor, recv: torch.Tensor) -> None:
    warnings.warn("a harmless warning from the student's code", UserWarning)
    rank, n = dist.get_rank(), dist.get_world_size()
    for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, (rank + 1) % n),
                                           dist.P2POp(dist.irecv, recv, (rank - 1) % n)]):
        request.wait()


def test_a_warning_in_a_rank_goes_to_stdout_not_stderr(capfd):
    checks.check_ring_exchange(_exchange_that_warns, world_sizes=(2,), sizes=(3,))
    out, err = capfd.readouterr()
    assert "a harmless warning" not in err, err
    assert "printed on stdout, so it costs no points" in out and "a harmless warning" in out, out


def _deadlocked_reduce_scatter(output: torch.Tensor, input_tensor: torch.Tensor) -> None:
    dist.recv(output, (dist.get_rank() - 1) % dist.get_world_size())    # nobody ever sends


def _all_reduce_on_top(tensor: torch.Tensor) -> None:
    _deadlocked_reduce_scatter(tensor, tensor)


def test_after_a_deadlock_the_checks_of_the_same_code_fail_at_once():
    with pytest.raises(AssertionError, match="did not finish"):
        checks.check_reduce_scatter(_deadlocked_reduce_scatter, world_sizes=(2,), sizes=(1,), timeout=2)
    start = time.monotonic()
    for run in (lambda: checks.check_reduce_scatter(_deadlocked_reduce_scatter, world_sizes=(3,), timeout=2),
                lambda: checks.check_all_reduce(_all_reduce_on_top, world_sizes=(2,), timeout=2)):
        with pytest.raises(AssertionError, match="not run: _deadlocked_reduce_scatter .*deadlocked in an earlier"):
            run()
    assert time.monotonic() - start < 1.5           # neither waited for its timeout

    def fixed(output, input_tensor):                # new code: checked as usual
        output.copy_(input_tensor[: output.numel()])

    with pytest.raises(AssertionError, match="is wrong"):
        checks.check_reduce_scatter(fixed, world_sizes=(2,), sizes=(1,))


# --------------------------------------------------------------------------- #
# A student's self-check needs no solutions/
# --------------------------------------------------------------------------- #
def test_self_check_runs_the_visible_checks_without_solutions(tmp_path):
    released = tmp_path / "course" / "exercises" / f"{NAME}.ipynb"    # a class's copy: no solutions/
    released.parent.mkdir(parents=True)
    released.write_bytes(exercise_path(NAME).read_bytes())
    mine = student_copy(NAME, tmp_path, solution_code(NAME))
    report = grade_notebook(mine, source=released, self_check=True)
    hidden = [c for c in report.checks if c.hidden]
    assert {c.grade_id for c in hidden} == EXPECTED[NAME].hidden, str(report)
    assert all(c.passed for c in report.checks if not c.hidden) and report.exit_code == 0, str(report)
    assert "HIDDEN" in str(report) and "only the instructor's grading runs" in str(report)
    assert report.max_score == EXPECTED[NAME].points - sum(c.max_points for c in hidden)


def test_grading_without_the_source_says_to_self_check(tmp_path):
    mine = tmp_path / f"{NAME}.ipynb"
    mine.write_bytes(exercise_path(NAME).read_bytes())
    report = grade_notebook(mine, source=tmp_path / "solutions" / mine.name)
    assert report.exit_code == 2 and "dtcourse check 01" in report.error, report.error
    done = subprocess.run([sys.executable, "-m", "dtcourse.cli", "check", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "visible checks" in done.stdout


# --------------------------------------------------------------------------- #
# How failures of several ranks read
# --------------------------------------------------------------------------- #
def _same_but_one(progress):
    rank = torch.distributed.get_rank()
    Path(progress, str(rank)).write_text("finished")
    found = "ring step 2 sent 16 B; expected 32 B\n    hint: send the whole chunk" if rank < 4 else "timed out"
    return ["case 'small'", found]


def test_three_or_more_ranks_that_found_the_same_share_one_line_and_one_hint():
    from dtcourse.checks.common import _launch_check
    with pytest.raises(AssertionError) as info:
        _launch_check("ring_all_reduce", 5, _same_but_one, (), 60, where=" on 5 ranks", hint="")
    message = str(info.value)
    assert message == ("ring_all_reduce is wrong on 5 ranks in case 'small':\n"
                       "  ranks 0, 1, 2 and 3: ring step 2 sent 16 B; expected 32 B\n    hint: send the whole chunk\n"
                       "  rank 4: timed out"), message
