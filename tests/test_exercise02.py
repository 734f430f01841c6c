"""Exercise 02 (gradient buckets): the notebook, its checks and the autograder.

A complete answer earns every point; the untouched exercise earns none, with the
stub named in every failed check; a wrong bucket rule and a missing division by N
each fail only their own checks, with the bucket or the parameter, rank and factor
named; a deadlock fails after the timeout. Each grading run starts one Jupyter
kernel (a few seconds). Run just these with ``pytest -q tests/test_exercise02.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dtcourse import checks, exercises
from dtcourse.data_parallel import assign_buckets
from dtcourse.grade import grade_notebook

ROOT = Path(__file__).resolve().parents[1]
NAME = "02_ddp_buckets"
SOURCE = ROOT / "solutions" / f"{NAME}.ipynb"
EXERCISE = ROOT / "exercises" / f"{NAME}.ipynb"
POINTS = 12
STUB = 'NotImplementedError: Exercise 02: ddp buckets'

# The bucket closes only once it holds *more* than the cap: wrong at a cap that is reached exactly.
WRONG_ASSIGN_BUCKETS = '''
def assign_buckets(params, cap_bytes):
    buckets, current, size = [], [], 0
    for i in reversed(range(len(params))):
        if current and params[i].dtype != params[current[0]].dtype:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += params[i].numel() * params[i].element_size()
        if size > cap_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + [current] if current else buckets
'''
# finish() copies the all-reduced sums back without dividing by the world size.
SUM_NOT_MEAN = '''
class OverlappedDDP(DDPBase):
    def grad_ready(self, i):
        if not self.finish_queued:
            self.finish_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        bucket = self.bucket_of[i]
        lo, hi = bucket.span[i]
        bucket.flat[lo:hi].copy_(self.params[i].grad.reshape(-1))
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.work = dist.all_reduce(bucket.flat, async_op=True)

    def finish(self):
        for bucket in self.buckets:
            bucket.work.wait()
            for i, (lo, hi) in bucket.span.items():
                self.params[i].grad.copy_(bucket.flat[lo:hi].view_as(self.params[i]))
'''


def solution_code() -> dict[str, str]:
    """The source's solution cells with the markers taken out: a student who got it all right."""
    answers = {}
    for cell in json.loads(SOURCE.read_text())["cells"]:
        meta = cell["metadata"].get("nbgrader", {})
        if meta.get("solution"):
            lines = "".join(cell["source"]).split("\n")
            answers[meta["grade_id"]] = "\n".join(line for line in lines if "SOLUTION" not in line)
    return answers


def student_copy(directory: Path, answers: dict[str, str]) -> Path:
    """The released exercise with some solution cells filled in, saved as a student would."""
    nb = json.loads(EXERCISE.read_text())
    for cell in nb["cells"]:
        grade_id = cell["metadata"].get("nbgrader", {}).get("grade_id")
        if grade_id in answers:
            cell["source"] = answers[grade_id]
    path = directory / f"{NAME}.ipynb"
    path.write_text(json.dumps(nb, indent=1))
    return path


def by_id(report) -> dict:
    return {check.grade_id: check for check in report.checks}


# --------------------------------------------------------------------------- #
# The released notebook
# --------------------------------------------------------------------------- #
def test_exercise_is_current_and_keeps_the_answers_out():
    assert not exercises.stale(ROOT / "solutions", ROOT / "exercises"), "run `make exercises`"
    nb = json.loads(EXERCISE.read_text())
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert "BEGIN SOLUTION" not in code and "HIDDEN TESTS" not in code
    assert "queue_callback(self.finish)" not in code and 'cases=("dtypes"' not in code
    cells = {c["metadata"]["nbgrader"]["grade_id"]: "".join(c["source"])
             for c in nb["cells"] if "nbgrader" in c["metadata"]}
    assert cells["overlapped_ddp"].count('raise NotImplementedError("Exercise 02: ddp buckets")') == 2
    assert "def grad_ready(self, i: int)" in cells["overlapped_ddp"]
    assert "def finish(self)" in cells["overlapped_ddp"]
    assert "register_post_accumulate_grad_hook" in cells["scaffold"]   # the scaffolding is given


def test_generator_matches_nbgrader(tmp_path):
    pytest.importorskip("nbgrader", reason="nbgrader is not installed: pip install -e '.[dev]'")
    assignment = tmp_path / "source" / NAME
    assignment.mkdir(parents=True)
    (assignment / f"{NAME}.ipynb").write_bytes(SOURCE.read_bytes())
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    done = subprocess.run([sys.executable, "-m", "nbgrader", "generate_assignment", NAME, "--force",
                           f"--ClearSolutions.code_stub={exercises.code_stub(NAME)}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert EXERCISE.read_text(encoding="utf-8") == \
        (tmp_path / "release" / NAME / f"{NAME}.ipynb").read_text(encoding="utf-8")


# --------------------------------------------------------------------------- #
# Grading whole notebooks
# --------------------------------------------------------------------------- #
def test_complete_answer_gets_full_marks(tmp_path):
    start = time.monotonic()
    report = grade_notebook(student_copy(tmp_path, solution_code()), source=SOURCE)
    assert (report.score, report.max_score, report.exit_code) == (POINTS, POINTS, 0), str(report)
    assert {"check_buckets_hidden", "check_parity_hidden"} <= set(by_id(report))
    assert time.monotonic() - start < 60


def test_untouched_exercise_scores_zero_with_a_clear_report(tmp_path):
    copy = tmp_path / "my_copy.ipynb"
    copy.write_bytes(EXERCISE.read_bytes())
    done = subprocess.run([sys.executable, "-m", "dtcourse.grade", str(copy), "--source", str(SOURCE)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"Total: 0 / {POINTS:g}" in done.stdout
    fails = [line for line in done.stdout.splitlines() if line.strip().startswith("FAIL")]
    assert len(fails) == 5, done.stdout
    assert done.stdout.count(STUB) == 5, done.stdout
    assert "replace the `raise NotImplementedError` line" in done.stdout
    assert "Traceback" not in done.stdout


def test_wrong_bucket_rule_fails_only_the_bucket_checks(tmp_path):
    path = student_copy(tmp_path, dict(solution_code(), assign_buckets=WRONG_ASSIGN_BUCKETS))
    report = grade_notebook(path, source=SOURCE)
    result = by_id(report)
    assert report.score == POINTS - 4, str(report)
    failed = [grade_id for grade_id, check in result.items() if not check.passed]
    assert failed == ["check_buckets", "check_buckets_hidden"], str(report)
    message = result["check_buckets"].message
    assert "case 'mlp'" in message and "cap_bytes=240" in message, message
    assert "bucket 0 should be [5, 4] but yours is [5, 4, 3]" in message, message
    assert "reach cap_bytes (>=)" in message, message


def test_sum_instead_of_mean_names_parameter_rank_and_factor(tmp_path):
    path = student_copy(tmp_path, dict(solution_code(), overlapped_ddp=SUM_NOT_MEAN))
    report = grade_notebook(path, source=SOURCE)
    result = by_id(report)
    assert report.score == POINTS - 6, str(report)
    failed = [grade_id for grade_id, check in result.items() if not check.passed]
    assert failed == ["check_parity", "check_parity_hidden"], str(report)
    visible, hidden = result["check_parity"].message, result["check_parity_hidden"].message
    assert "OverlappedDDP is wrong at world size 2 in case 'mlp'" in visible, visible
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: step 1, parameter 'net\.0\.weight' \(13, 7\): .grad differs "
                         r"from the mean gradient over all ranks by up to \S+", visible), visible
    assert "It is N = 2 times the mean" in visible and "divide by the world size" in visible, visible
    assert "world size 3" in hidden and "It is N = 3 times the mean" in hidden, hidden


# --------------------------------------------------------------------------- #
# The checks on their own (no kernel)
# --------------------------------------------------------------------------- #
def test_reference_passes_every_bucket_case():
    checks.check_bucket_assignment(assign_buckets, cases=("mlp", "dtypes", "tiny", "gpt", "empty"))


def test_bucket_check_recognises_forward_order():
    def forward_order(params, cap_bytes):
        return [list(reversed(bucket)) for bucket in reversed(assign_buckets(params[::-1], cap_bytes))]

    with pytest.raises(AssertionError, match=r"(?s)bucket 0 should be \[5\] but yours is \[0\].*"
                                             r"hint: walk the parameters from the last"):
        checks.check_bucket_assignment(forward_order, cases=("mlp",))


class _Deadlocks(torch.nn.Module):
    """Rank 0 waits for a message rank 1 never sends; rank 1 waits in the next step's all-reduce."""

    def __init__(self, module, bucket_cap_mb):
        super().__init__()
        self.module = module

    def forward(self, x):
        if dist.get_rank() == 0:
            dist.recv(torch.zeros(1), src=1)
        return self.module(x)


def test_a_deadlock_fails_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        checks.check_ddp_parity(_Deadlocks, world_sizes=(2,), timeout=2)
    message = str(info.value)
    assert "_Deadlocks did not finish at world size 2 within 2 s" in message, message
    assert "rank(s) [0] in case 'mlp'" in message and "deadlock" in message, message
    assert time.monotonic() - start < 20


def _overlap_variant(sync: bool, late: bool):
    """A correct wrapper except that its all-reduces block (sync) or start after backward (late)."""
    from dtcourse.data_parallel import DistributedDataParallel

    class Variant(DistributedDataParallel):
        def __init__(self, module, bucket_cap_mb):
            super().__init__(module, bucket_cap_mb, overlap=not late)

        def _all_reduce_sum(self, tensor, async_op):
            return dist.all_reduce(tensor, async_op=async_op and not sync)

    return Variant


@pytest.mark.parametrize("sync, late, complaint", [
    (False, False, None),
    (True, False, r"all-reduce\(s\) \[0, 1, 2\] ran with async_op=False"),
    (False, True, r"no communication overlapped with backward: your all-reduces of 60, 154, 104 elements "
                  r"started after 6, 6, 6 of the 6 gradients"),
])
def test_overlap_check(sync, late, complaint):
    variant = _overlap_variant(sync, late)
    if complaint is None:
        checks.check_overlap(variant, world_size=2)
    else:
        with pytest.raises(AssertionError, match=complaint):
            checks.check_overlap(variant, world_size=2)
