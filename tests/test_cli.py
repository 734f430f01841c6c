"""The ``dtcourse`` command and the ``python -m`` commands the README and the lessons give."""

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
                              "parameter_server", "pipeline", "tensor_parallel", "zero"]
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
