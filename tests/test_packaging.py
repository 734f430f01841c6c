"""The repository's shape: pins in step, notebooks stored clean, the two set-up commands documented."""

import json
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_pins() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["dependencies"]) | set(project["optional-dependencies"]["dev"])


def _environment_pins() -> set[str]:
    # environment.yml is simple enough to read without a YAML library: the pins
    # are the "- name==version" lines under "pip:".
    text = (ROOT / "environment.yml").read_text()
    pip_block = text.split("- pip:", 1)[1]
    return {m.group(1) for m in re.finditer(r"^\s+-\s+([A-Za-z0-9_.\-]+==[^\s#]+)", pip_block, re.M)}


def _makefile_torch_pin() -> str:
    return re.search(r"^TORCH_PIN \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)


def _torch_range() -> str:
    return next(d for d in _pyproject_pins() if d.startswith("torch"))


def test_environment_yml_has_the_same_pins_as_pyproject_and_the_makefiles_torch():
    torch_range = _torch_range()
    assert _environment_pins() == _pyproject_pins() - {torch_range} | {_makefile_torch_pin()}
    text = (ROOT / "environment.yml").read_text()
    assert "conda-forge" in text and "python=3.11" in text and "-e ." in text


def test_every_dependency_but_torch_is_pinned_exactly_and_the_torch_pin_is_in_the_range():
    from packaging.specifiers import SpecifierSet

    pins = _pyproject_pins() - {_torch_range()}
    assert all("==" in p for p in pins), pins
    assert _makefile_torch_pin() == "torch==2.13.0"
    supported = SpecifierSet(_torch_range().removeprefix("torch"))
    assert "2.13.0" in supported and "2.12.1" not in supported       # the measured pin; 2.12 lacks what 2.13 has


def test_top_level_layout():
    for name in ["lessons", "dtcourse", "assets", "exercises", "solutions", "tests", "environment.yml",
                 "README.md", "pyproject.toml", "Makefile", ".ci/run"]:
        assert (ROOT / name).exists(), f"{name} is missing"


def test_readme_gives_the_two_setup_commands_and_ci_calls_the_test_one():
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci/run").read_text()


def test_notebooks_are_stored_without_outputs():
    notebooks = sorted(ROOT.glob("lessons/*.ipynb")) + sorted(ROOT.glob("solutions/*.ipynb")) \
        + sorted(ROOT.glob("exercises/*.ipynb"))
    assert notebooks
    for path in notebooks:
        nb = json.loads(path.read_text())
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, f"{path.name} cell {i} has output"


def test_lessons_are_numbered_and_each_has_a_title():
    lessons = sorted(ROOT.glob("lessons/*.ipynb"))
    numbers = [int(p.name[:2]) for p in lessons]
    assert numbers == sorted(set(numbers)) and numbers[:1] == [0]     # 00 first, each number once (gaps: to come)
    assert len(lessons) >= 10 and numbers[:9] == list(range(9))
    for path in lessons:
        first = json.loads(path.read_text())["cells"][0]
        assert first["cell_type"] == "markdown" and "".join(first["source"]).startswith("# ")


def test_every_lesson_and_exercise_says_how_long_it_takes():
    for path in sorted(ROOT.glob("lessons/*.ipynb")) + sorted(ROOT.glob("solutions/*.ipynb")):
        first = "".join(json.loads(path.read_text())["cells"][0]["source"])
        assert re.search(r"About \d+ minutes", first), f"{path.name}: say 'About N minutes ...' in its first cell"


def test_students_jupyterlab_hides_nbgrader_and_the_news_popup_and_instructors_get_nbgrader_back():
    from jupyterlab_server.config import get_page_config

    def page_config(dirs: list[str]) -> dict:
        import os
        from unittest import mock

        with mock.patch.dict(os.environ, {"JUPYTER_CONFIG_PATH": os.pathsep.join(dirs)}):
            return get_page_config([], os.devnull)

    def server_extensions(dirs: list[str]) -> dict[str, bool]:
        import os
        from unittest import mock

        from jupyter_server.extension.config import ExtensionConfigManager
        from jupyter_server.serverapp import ServerApp

        with mock.patch.dict(os.environ, {"JUPYTER_CONFIG_PATH": os.pathsep.join(dirs)}):
            found = ExtensionConfigManager(read_config_path=ServerApp().config_file_paths).get_jpserver_extensions()
        nbgrader = {name: on for name, on in found.items() if name.startswith("nbgrader")}
        assert len(nbgrader) == 4, found
        return nbgrader

    course, student = str(ROOT / ".jupyter/course"), str(ROOT / ".jupyter/student")
    news = "@jupyterlab/apputils-extension:announcements"
    disabled = set(page_config([student, course]).get("disabledExtensions", []))
    assert {"@jupyter/nbgrader", news} <= disabled
    instructor = set(page_config([course]).get("disabledExtensions", []))
    assert news in instructor and "@jupyter/nbgrader" not in instructor
    # nbgrader's server extensions (the formgrader) follow the same split, read as the server reads them
    assert not any(server_extensions([student, course]).values())
    assert all(server_extensions([course]).values())
    makefile = (ROOT / "Makefile").read_text()
    assert "JUPYTER_CONFIG_PATH=$(CURDIR)/.jupyter/student:$(CURDIR)/.jupyter/course" in makefile


def _make_setup(tmp_path, *args, path=None):
    """``make setup`` on a copy of the Makefile and pyproject with no venv yet (nothing is installed: every
    case below stops before pip, or is a dry run)."""
    import os
    import shutil
    import subprocess
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    env = dict(os.environ, **({"PATH": path} if path else {}))
    for inherited in ("PYTHON", "KEEP_TORCH", "TORCH_INDEX", "MAKEFLAGS", "MFLAGS", "MAKELEVEL"):
        env.pop(inherited, None)         # a make test run with PYTHON=... passes it down through MAKEFLAGS
    make = shutil.which("make")                                          # found before PATH changes
    return subprocess.run([make, "-s", "setup", *args], cwd=tmp_path, env=env, capture_output=True, text=True)


def test_make_refuses_an_unsupported_python_and_says_which_work(tmp_path):
    out = _make_setup(tmp_path, "PYTHON=python2.7")
    assert out.returncode != 0
    assert "dtcourse needs Python 3.11, 3.12 or 3.13: python2.7 is not one of them (or does not run)." in out.stdout
    assert "make PYTHON=/path/to/python3.12" in out.stdout
    none = _make_setup(tmp_path, path=str(tmp_path))                    # a PATH with no Python on it
    assert none.returncode != 0 and "none of python3.11 python3.12 python3.13 python3 on the PATH is" in none.stdout


def test_make_picks_a_supported_python_and_torch_index_goes_first(tmp_path):
    import sys
    dry = _make_setup(tmp_path, "-n", f"PYTHON={sys.executable}", "TORCH_INDEX=https://example.invalid/cpu")
    lines = dry.stdout.splitlines()
    assert any(f"{sys.executable} -m venv .venv" in line for line in lines), dry.stdout
    torch_line = next(i for i, line in enumerate(lines) if "--index-url https://example.invalid/cpu" in line)
    assert "'torch==2.13.0'" in lines[torch_line]
    assert torch_line < next(i for i, line in enumerate(lines) if "-e '.[dev]'" in line)   # torch first, then the rest
    plain = _make_setup(tmp_path, "-n", f"PYTHON={sys.executable}")
    assert "--index-url" not in plain.stdout and "'torch==2.13.0'" in plain.stdout
    assert "--system-site-packages" not in plain.stdout


def test_keep_torch_uses_the_pythons_own_torch_and_installs_none_first(tmp_path):
    import sys
    keep = _make_setup(tmp_path, "-n", f"PYTHON={sys.executable}", "KEEP_TORCH=1")
    assert f"{sys.executable} -m venv --system-site-packages .venv" in keep.stdout, keep.stdout
    assert "torch==" not in keep.stdout and "-e '.[dev]'" in keep.stdout
    assert "-m torch.distributed.run" in keep.stdout      # a torchrun that runs the venv's Python
