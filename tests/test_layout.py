"""The course's shape: one stem per technique, used in every place, and algorithms kept apart from drawing.

A stem names a lesson (``lessons/NN_<stem>.ipynb``), its algorithm (``dtcourse/<stem>.py`` or
``dtcourse/<stem>/``), what the lesson runs and draws (``dtcourse/lab/<stem>.py``), its exercise
checks (``dtcourse/checks/<stem>.py``), its benchmark (``dtcourse/bench/<stem>.py``) and its tests
(``tests/test_<stem>.py``). These tests read files and import statements only; they start no rank.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dtcourse"

# In syllabus order; lessons not written yet keep their place in the list.
STEMS = ("memory", "collectives", "data_parallel", "parameter_server", "mixed_precision", "checkpointing",
         "zero", "offload", "pipeline", "tensor_parallel", "parallel_3d", "moe", "fault_tolerance")
# What may stand at the top of dtcourse/ besides the stems' algorithms: shared pieces and the
# sub-packages. Anything else is a module that belongs inside one of these.
SHARED = {"__init__", "models", "mesh", "parity", "cli",
          "exercises", "grade",          # these two only keep `python -m dtcourse.exercises / .grade` working
          "site"}                        # make site: the executed course as web pages
SUBPACKAGES = {"runtime", "lab", "checks", "bench", "grading"}
# Benchmarks of the infrastructure rather than of a technique.
BENCH_EXTRAS = {"launch", "gpu"}   # gpu: every CUDA / nccl path of the course in one run
# Modules allowed past 350 lines, each with the reason it stays whole.
LONG_MODULES = {
    "dtcourse/parity.py": "the one harness every parity test goes through, plus PyTorch's own versions as its "
                          "second references (DDP through Replicated, FSDP2, the DTensor tensor-parallel plan): "
                          "the adapters are short and belong beside the protocol they implement",
    "dtcourse/pipeline/execute.py": "the engine that runs every action kind of a schedule (F, B, I, W, STEP and the "
                                    "four messages), each with the error that says what to change, plus "
                                    "run_schedule and the parity adapter; splitting it would split one loop",
    "dtcourse/lab/mixed_precision.py": "lesson 04's companion: number formats, gradients against fp16's range and "
                                       "the loss-scale widget, lost updates, the five recipes and their curves, "
                                       "each recipe's bytes held and sent, and four problems; each part under "
                                       "100 lines, read beside the lesson",
    "dtcourse/checks/data_parallel.py": "exercise 02's three graded checks (buckets, parity, overlap) share one "
                                        "set of cases and helpers; splitting them would split the exercise",
    "dtcourse/checks/checkpointing.py": "exercise 05's three graded checks share one set of layers and helpers; "
                                        "the memory check measures and explains four things (held after "
                                        "forward, recomputed once, peak in backward, left after backward)",
    "dtcourse/checks/zero.py": "exercise 06's four graded checks (gradients, memory, parity, traffic) share one set "
                               "of cases, one bucket layout and one recorder of every collective's bytes; most of "
                               "each check is its explanation of what went wrong, by rank, bucket and byte",
    "dtcourse/checks/pipeline.py": "exercise 08's three graded checks (valid, order, run on ranks) share one reading "
                                   "of the student's schedule and one catalogue of the usual mistakes that names "
                                   "which one a wrong schedule is; most of each check is its explanation",
    "dtcourse/checks/parameter_server.py": "exercise 03's four graded checks (each push once, the staleness bound, "
                                           "parity at s = 0, a hung worker named) share one set of server "
                                           "configurations and one reading of the run's log; most of each check is "
                                           "its explanation by worker, iteration and clock",
    "dtcourse/checks/fault_tolerance.py": "exercise 12's four graded checks (round trip, atomic, size, resume on "
                                          "ranks) share one reading of a snapshot's tensors and generators and one "
                                          "launcher that restarts the ranks; the atomic check's audit hook and its "
                                          "kills mid-save, and each check's explanation by step and tensor",
    "dtcourse/checks/tensor_parallel.py": "exercise 09's four graded checks (f and g, column, row, the MLP) share one "
                                          "set of cases and groups, one recorder of every collective's bytes and "
                                          "process group, and one reading of what a rank holds; most of each check "
                                          "is its explanation, by rank, tensor and byte",
    "dtcourse/checks/moe.py": "exercise 11's three graded checks (positions, dispatch, the layer) share one set of cases "
                              "and groups, every rank's tokens and routing, and one recorder of every all-to-all's rows "
                              "and process group; most of each check names what went wrong, by rank, token, expert "
                              "and slot",
    "dtcourse/zero/sharded.py": "ZeRO's one class, stages 0 to 3 on one flat-shard structure: forward and backward "
                                "hooks, the reductions, the step, the parity protocol and the per-rank snapshot "
                                "state (lesson 12) all act on the same flats; splitting it would split the class",
    "dtcourse/lab/fault_tolerance.py": "lesson 12's companion: the lesson's scripts run under launch, torchrun and two "
                                       "elastic agents with every process they start tagged and killed, the time a "
                                       "failure costs, save times, the Young/Daly interval against a simulated job, "
                                       "two figures and five problems; each part under 120 lines",
    "dtcourse/lab/moe.py": "lesson 11's companion: routing while training, drops against the capacity factor, the "
                           "observed all-to-alls named and their bytes, compute against parameters, the routing "
                           "widget and five problems",
    "dtcourse/lab/tensor_parallel.py": "lesson 09's companion: bytes per layer from the observed collectives, one block's saved "
                                       "bytes by Korthikanti's terms with Megatron's kept shards as a hook, the "
                                       "alpha-beta cost figure, the split figure from real shards, the widget and five "
                                       "problems; each part under 200 lines",
    "dtcourse/lab/data_parallel.py": "lesson 02's companion: shards, DDP timelines, pricing the step (fitted link "
                                     "with its fallback, forward-pass collectives, FLOP rate, the GPU case, the "
                                     "bucket figure) and five problems; each part under 120 lines",
    "dtcourse/lab/collectives.py": "lesson 01 draws and measures four things (the six collectives before and "
                                   "after, busbw of three collectives beside the fitted alpha-beta-gamma model, "
                                   "the ring step-through widget, the four problems); each part under 150 lines",
    "dtcourse/memory.py": "lesson 00's measurement and its formulas (storage bytes, saved tensors by kind, a "
                          "step's held bytes op by op, the optimizer-state table): one concept, each part "
                          "under 80 lines",
    "dtcourse/lab/zero.py": "lesson 06's companion: the formulas with K per optimizer, memory by kind measured per "
                            "rank, bytes sent and the collectives per unit, stage 3's recorded prefetch, FSDP2 "
                            "parity, the memory widget and four problems; each part under 120 lines",
    "dtcourse/lab/pipeline.py": "lesson 08's companion: schedules recorded on real ranks with their measured bubbles "
                                "and peaks, the sweep against the formulas and the simulator, the bubble widget "
                                "(a recording beside its simulation), PipeTransformer's freeze-and-widen run and "
                                "five problems; each part under 120 lines",
    "dtcourse/lab/parameter_server.py": "lesson 03's measurements (traffic, stragglers and who waited for whom, "
                                        "staleness, the RPC server, actors and a learner), their figures and its "
                                        "five problems: one lesson's companion, read beside it",
    "dtcourse/lab/checkpointing.py": "lesson 05's measurements (segment sweep, recomputation policies, fused "
                                     "attention's saved tensors, save_on_cpu), the three figures drawn from "
                                     "them, and its four problems: one lesson's companion, read beside it",
}
DRAWING = ("matplotlib", "ipywidgets", "dtcourse.lab", "dtcourse.bench")


def _lessons() -> dict[str, str]:
    """stem -> lesson number, from lessons/NN_<stem>.ipynb."""
    found = {}
    for path in sorted(ROOT.glob("lessons/*.ipynb")):
        number, _, stem = path.stem.partition("_")
        assert number.isdigit() and stem in STEMS, f"{path.name}: expected NN_<stem>.ipynb with a stem in {STEMS}"
        found[stem] = number
    return found


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at top level or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _algorithm_modules() -> list[Path]:
    """The algorithms and what they are built on: everything but lab/, bench/, checks/, grading/, cli."""
    skip = {"lab", "bench", "checks", "grading"}
    return sorted(p for p in PACKAGE.rglob("*.py")
                  if p.relative_to(PACKAGE).parts[0] not in skip and p.name != "cli.py")


def _code_cells(path: Path) -> str:
    return "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")


def test_the_lessons_follow_the_syllabus_order_of_stems():
    """Each lesson's number is its stem's place in the syllabus; a lesson still to be written leaves a gap
    (lesson 11 came before lesson 10, as its issue asked), but none is out of place."""
    lessons = _lessons()
    assert lessons, "no lessons found"
    for stem, number in lessons.items():
        assert int(number) == STEMS.index(stem), f"lesson {number}_{stem}: {stem} is lesson {STEMS.index(stem):02d}"
    assert list(lessons) == sorted(lessons, key=STEMS.index)


@pytest.mark.parametrize("stem", list(_lessons()))
def test_every_lesson_has_its_algorithm_lab_and_tests(stem):
    assert (PACKAGE / f"{stem}.py").exists() != (PACKAGE / stem / "__init__.py").exists(), \
        f"lesson {stem}: expected exactly one of dtcourse/{stem}.py and dtcourse/{stem}/"
    lesson = ROOT / "lessons" / f"{_lessons()[stem]}_{stem}.ipynb"
    if "matplotlib" in _code_cells(lesson) or "dtcourse.lab" in _code_cells(lesson):   # it draws
        assert (PACKAGE / "lab" / f"{stem}.py").exists(), f"lesson {stem} draws: expected dtcourse/lab/{stem}.py"
    assert (ROOT / "tests" / f"test_{stem}.py").exists(), f"expected tests/test_{stem}.py"


def test_every_exercise_is_named_after_its_lesson_and_has_its_checks():
    lessons = _lessons()
    solutions = sorted(ROOT.glob("solutions/*.ipynb"))
    assert solutions
    for path in solutions:
        found = re.fullmatch(r"(\d\d)_([a-z0-9_]+)", path.stem)
        assert found, f"{path.name}: expected NN_<stem>_<task>.ipynb"
        stem = next((s for s in STEMS if found[2].startswith(s + "_")), None)
        assert stem and lessons.get(stem) == found[1], \
            f"{path.name}: expected lesson {found[1]}'s stem, then _<task>"
        assert (PACKAGE / "checks" / f"{stem}.py").exists(), f"{path.name}: expected dtcourse/checks/{stem}.py"
        assert (ROOT / "exercises" / path.name).exists(), f"{path.name}: no released copy in exercises/"


def test_the_package_top_level_holds_only_stems_shared_pieces_and_subpackages():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    stray = modules - SHARED - set(STEMS) - {f"{stem}_cost" for stem in STEMS}   # a one-module stem's formulas
    assert not stray, f"dtcourse/{sorted(stray)}: put each in its stem's module, lab/, runtime/ or grading/"
    unknown = packages - SUBPACKAGES - set(STEMS) - SHARED        # a shared piece may grow into a package (models)
    assert not unknown, f"unexpected packages {sorted(unknown)}"
    for old in ("launcher", "timeline", "figure_widget", "ring_widget", "collective_figures", "sampling",
                "mixed_precision_figures", "checkpointing_measurements", "checkpointing_figures"):
        assert not (PACKAGE / f"{old}.py").exists(), f"dtcourse/{old}.py is an old flat name"


def test_lab_checks_and_bench_modules_are_named_by_stems():
    assert {p.stem for p in (PACKAGE / "lab").glob("*.py")} - {"__init__", "widgets", "timeline", "problems"} <= set(STEMS)
    assert {p.stem for p in (PACKAGE / "checks").glob("*.py")} - {"__init__", "common", "guard", "messages"} <= set(STEMS)
    assert {p.stem for p in (PACKAGE / "bench").glob("*.py")} - {"__init__"} <= set(STEMS) | BENCH_EXTRAS


@pytest.mark.parametrize("path", _algorithm_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_algorithm_modules_never_draw(path):
    drawing = {name for name in _imports(path) if name.startswith(DRAWING)}
    assert not drawing, f"{path.relative_to(ROOT)} imports {sorted(drawing)}: move the drawing to dtcourse/lab/"


# What the grading may not leave in the algorithms: what a check refuses is listed in its check module.
GRADING_MARKS = ("@reference", "refused while its checks run")


def _graded_algorithm_modules() -> list[Path]:
    """What a lesson may show with ``inspect.getsource``: everything but the grading, the lessons' companions
    and the command line (checks/, grading/, runtime/, lab/, bench/, grade.py, exercises.py, cli.py, site.py)."""
    skip = {"checks", "grading", "runtime", "lab", "bench", "grade.py", "exercises.py", "cli.py", "site.py"}
    return sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in skip)


@pytest.mark.parametrize("path", _graded_algorithm_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_algorithm_modules_carry_no_grading(path):
    refuse = {name for name in _imports(path) if name.startswith("dtcourse.runtime.refuse")}
    assert not refuse, f"{path.relative_to(ROOT)} imports {sorted(refuse)}: list the answer in its check module"
    text = path.read_text()
    marks = [mark for mark in GRADING_MARKS if mark in text]
    assert not marks, (f"{path.relative_to(ROOT)} holds {marks}: what a check refuses is listed in "
                       "dtcourse/checks/<stem>.py (ANSWERS), not marked where a lesson shows the code")


# Arguments through which an algorithm would report what it does: dtcourse.runtime.observe sees the traffic at the
# process group instead, and hooks see the rest. A ByteCounter (``counter``) stays where counting messages is the
# lesson: lesson 01's collectives and lesson 03's parameter server, whose per-link counts are its subject.
LOGGING_ARGUMENTS = {"traffic", "log", "logger", "on_event", "events", "counter"}
COUNTING_IS_THE_LESSON = ("collectives", "parameter_server")


@pytest.mark.parametrize("path", _graded_algorithm_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_algorithms_take_no_logging_arguments(path):
    allowed = {"counter"} if path.relative_to(PACKAGE).parts[0] in COUNTING_IS_THE_LESSON else set()
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = {a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs}
            found += [f"{node.name}({name})" for name in sorted((names & LOGGING_ARGUMENTS) - allowed)]
    assert not found, (f"{path.relative_to(ROOT)}: {found} take a logging argument; let the lab observe the "
                       "traffic with dtcourse.runtime.observe (and hooks) instead")


def test_the_runtime_depends_on_no_technique():
    for path in (PACKAGE / "runtime").glob("*.py"):
        ours = {n for n in _imports(path) if n.startswith("dtcourse.") and not n.startswith("dtcourse.runtime")}
        assert not ours, f"{path.relative_to(ROOT)} imports {sorted(ours)}: the runtime must not know any technique"


@pytest.mark.parametrize("path", sorted(ROOT.glob("lessons/*.ipynb")), ids=lambda p: p.name)
def test_lessons_never_import_benchmarks(path):
    code = _code_cells(path)
    assert not re.search(r"(from|import)\s+dtcourse\.bench|from\s+dtcourse\s+import\s+bench", code), \
        f"{path.name} imports dtcourse.bench; lessons import dtcourse.lab"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """dtcourse module -> the dtcourse modules it imports, at top level or inside a function (a cycle
    hidden inside a function is still a cycle: the two modules cannot be read, or loaded, apart).
    ``from package import module`` is an edge to the module alone: the package is loading already."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

    def owner(name: str) -> str | None:           # dtcourse.x.y.some_function -> dtcourse.x.y
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {owner(a.name) for a in node.names if a.name.startswith("dtcourse")}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dtcourse"):
                found |= {owner(f"{node.module}.{a.name}") for a in node.names}
        graph[name] = found - {None, name}
    return graph




def test_no_import_cycles():
    graph = _import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:                       # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = {stack.pop()}
            while v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                cycles.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {[sorted(c) for c in cycles]}; move what both need into a module below them"


@pytest.mark.parametrize("stem", sorted(_lessons()))
def test_every_technique_keeps_its_formulas_in_a_cost_module(stem):
    # memory.py is lesson 00's formulas themselves (bytes by kind), beside the counters that check them
    if stem == "memory":
        return
    found = [p for p in (PACKAGE / stem / "cost.py", PACKAGE / f"{stem}_cost.py") if p.exists()]
    assert found, f"{stem}: its formulas belong in dtcourse/{stem}/cost.py (or dtcourse/{stem}_cost.py)"
    assert not {n for n in _imports(found[0]) if n.startswith(("dtcourse.lab", "dtcourse.bench", "dtcourse.checks"))}


def test_layers_depend_downward_only():
    graph = _import_graph()
    for name, deps in graph.items():
        if name.startswith("dtcourse.lab"):
            up = sorted(d for d in deps if d.startswith(("dtcourse.bench", "dtcourse.checks", "dtcourse.grading")))
            assert not up, f"{name} imports {up}: lab/ measures and draws for lessons; it sits below bench/ and checks/"


def test_long_modules_are_listed_with_a_reason():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 350}
    unlisted = sorted(set(long) - set(LONG_MODULES))
    assert not unlisted, f"over 350 lines: {[(m, long[m]) for m in unlisted]}; split by concept or list with a reason"
    stale = sorted(set(LONG_MODULES) - set(long))
    assert not stale, f"no longer over 350 lines, remove from LONG_MODULES: {stale}"
    assert all(len(reason) > 30 for reason in LONG_MODULES.values())
