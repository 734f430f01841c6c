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


def test_environment_yml_has_the_same_pins_as_pyproject():
    assert _environment_pins() == _pyproject_pins()
    text = (ROOT / "environment.yml").read_text()
    assert "conda-forge" in text and "python=3.11" in text and "-e ." in text


def test_every_dependency_is_pinned_exactly_and_torch_is_2_13():
    pins = _pyproject_pins()
    assert all("==" in p for p in pins), pins
    assert "torch==2.13.0" in pins


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
    assert [p.name[:2] for p in lessons] == [f"{i:02d}" for i in range(len(lessons))]
    for path in lessons:
        first = json.loads(path.read_text())["cells"][0]
        assert first["cell_type"] == "markdown" and "".join(first["source"]).startswith("# ")
