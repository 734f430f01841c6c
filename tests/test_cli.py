"""The ``dtcourse`` command and the ``python -m`` commands the README and the lessons give."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dtcourse import cli

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_the_console_script_is_declared_and_installed():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"dtcourse": "dtcourse.cli:main"}
    installed = Path(sys.executable).parent / "dtcourse"      # pip put it beside this Python
    assert installed.exists(), f"{installed} is missing: reinstall with `pip install -e .` (make setup does)"
    run = subprocess.run([str(installed), "bench", "--list"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "collectives" in run.stdout, run.stderr


def test_bench_lists_one_benchmark_per_stem_and_refuses_unknown_names(capsys):
    assert cli.benchmarks() == ["checkpointing", "collectives", "data_parallel", "gpu", "launch", "moe", "offload",
                              "parallel_3d", "parameter_server", "pipeline", "tensor_parallel", "zero"]
    assert cli.main(["bench", "--list"]) == 0
    assert "collectives, data_parallel" in capsys.readouterr().out
    assert cli.main(["bench", "ddp"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark named 'ddp'" in err and "data_parallel" in err


def test_unknown_command_and_no_command_print_usage(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    assert cli.main([]) == 2
    assert "usage: dtcourse" in capsys.readouterr().out


def test_exercises_check_passes_through_every_entry_point():
    for args in (["-m", "dtcourse.cli", "exercises", "--check"], ["-m", "dtcourse.exercises", "--check"]):
        run = _run(*args)
        assert run.returncode == 0, (args, run.stderr)
    stub = _run("-m", "dtcourse.cli", "exercises", "--stub", "01_collectives_ring")
    assert stub.returncode == 0 and "NotImplementedError" in stub.stdout


def test_grade_reports_a_missing_notebook_with_exit_2():
    for args in (["-m", "dtcourse.cli", "grade", "no_such.ipynb"], ["-m", "dtcourse.grade", "no_such.ipynb"]):
        run = _run(*args)
        assert run.returncode == 2, (args, run.stdout, run.stderr)
        assert "no_such.ipynb" in run.stdout + run.stderr


def test_the_gpu_benchmark_says_it_needs_a_gpu(monkeypatch):
    """`dtcourse bench gpu` (make gpu-check) on a machine without CUDA: one clear line, no traceback."""
    import dtcourse.bench.gpu as gpu
    monkeypatch.setattr("dtcourse.runtime.gpu_count", lambda: 0)
    with pytest.raises(SystemExit, match="needs a CUDA GPU; this machine has none"):
        gpu.main([])


# --------------------------------------------------------------------------- #
# What `dtcourse check` prints: each failure once, and when the notebook was saved
# --------------------------------------------------------------------------- #
def _stub_error(folder: Path, function_name: str) -> str:
    """The error a check reports for an unwritten exercise function, worded by the checks themselves."""
    from dtcourse.checks.common import _student_error

    cell = folder / f"{function_name}.py"        # a file, so that the traceback shows the line, as for a cell
    cell.write_text(f"def {function_name}():\n    raise NotImplementedError('Exercise 06: zero stage2')\n")
    namespace: dict = {}
    exec(compile(cell.read_text(), str(cell), "exec"), namespace)
    try:
        namespace[function_name]()
    except NotImplementedError as exc:
        return _student_error(exc)
    raise AssertionError("the stub did not raise")


def test_a_stub_that_fails_every_check_is_explained_once(tmp_path):
    from dtcourse.grading.report import Check, Report

    first, other = _stub_error(tmp_path, "grad_ready"), _stub_error(tmp_path, "step")
    assert "in grad_ready, line 2: raise NotImplementedError" in first and "(the exercise stub" in first
    report = Report(Path("06_zero_stage2.ipynb"), None, checks=[
        Check("check_gradients", 0.0, 2, f"AssertionError: ZeroStage2 failed: rank 0 raised {first}"),
        Check("check_gradients_hidden", None, 1, "hidden checks: your instructor's grading runs them", hidden=True),
        Check("check_memory", 0.0, 2, f"AssertionError: ZeroStage2 failed: rank 1 raised {first}"),
        Check("check_memory_hidden", None, 2, "hidden checks: your instructor's grading runs them", hidden=True),
        Check("check_parity", 0.0, 2, f"AssertionError: ZeroStage2 failed: rank 1 raised {first}"),
        Check("check_step", 0.0, 2, f"AssertionError: ZeroStage2.step failed: rank 0 raised {other}"),
        Check("check_wrong", 0.0, 1, "AssertionError: rank 1 got 3.0, expected 4.0"),
        Check("check_wrong_again", 0.0, 1, "AssertionError: rank 1 got 3.0, expected 4.0"),
        Check("check_right", 1.0, 1),
    ])
    text = str(report)
    assert text.count("(the exercise stub is still there") == 1, text               # the advice: once
    assert text.count("raise NotImplementedError('Exercise 06") == 2, text            # each stub's line: once
    # every failed check still says why in its own row, with the error's name (graders count it)
    assert text.count("NotImplementedError: Exercise 06: zero stage2") == 4, text
    assert text.count("grad_ready is still the stub (NotImplementedError: Exercise 06: zero stage2), as under "
                      "check_gradients above") == 2, text
    assert "in step, line 2: raise NotImplementedError" in text                      # a second stub: its own line
    assert "the same failure as check_wrong above" in text and text.count("got 3.0, expected 4.0") == 1
    assert text.count("hidden checks: your instructor's grading runs them") == 2      # not failures: as they are
    assert report.checks[2].message.endswith("with your code)")                     # only the printing says less


def test_the_report_says_when_the_notebook_was_last_saved(tmp_path):
    """What runs is the file on disk: the report gives its time, so a student sees unsaved edits were left out.

    A JupyterLab checkpoint would not tell: it is written by a manual save (Ctrl+S) just after the notebook,
    and autosave writes the notebook alone, so the notebook is never older than its checkpoint; the
    unsaved edits are in the browser, which no file shows.
    """
    import time

    import nbformat

    from dtcourse.grading.grade import grade_notebook
    from dtcourse.grading.report import _when

    now = time.mktime((2025, 3, 4, 14, 5, 0, 0, 0, -1))
    assert _when(now - 180, now) == "at 14:02:00 today (3 min ago)"
    assert _when(now - 20, now) == "at 14:04:40 today (20 s ago)"
    assert _when(now - 3 * 86400, now) == "at 14:05:00 2025-03-01 (3 days ago)"
    notebook = tmp_path / "mine.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")]), notebook)
    saved = time.time() - 300
    os.utime(notebook, (saved, saved))
    report = grade_notebook(notebook, source=notebook, self_check=True, cell_timeout=60)
    assert report.exit_code == 0 and report.saved == saved, str(report)
    line = str(report).splitlines()[2]
    assert line == (f"  last saved {_when(saved)}: what runs is the file, not edits made since, so save the "
                    "notebook first (Ctrl+S)"), str(report)
    assert time.strftime("%H:%M:%S", time.localtime(saved)) in line and "(5 min ago)" in line
    assert "last saved" not in str(grade_notebook(tmp_path / "missing.ipynb", source=notebook))
