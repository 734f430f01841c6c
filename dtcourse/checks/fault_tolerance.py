"""Checks for exercise 12: a student's ``save_snapshot`` and ``load_snapshot``, one rank's snapshot file.

The student writes ``save_snapshot(path, step, model, optimizer)``, which writes to ``path`` everything a bit-for-bit
resume needs (the model's and the optimizer's ``state_dict``, the state of Python's, NumPy's and torch's generators,
the step) atomically: to a temporary file beside ``path``, then ``os.replace``. And ``load_snapshot(path, model,
optimizer)``, which puts all of it back and returns the step, or None where nothing was saved. Four checks::

    check_snapshot_round_trip(save_snapshot, load_snapshot, cases=("small",))

* ``check_snapshot_round_trip``: in one process, a snapshot loaded into a fresh model and optimizer restores every
  tensor (parameters, buffers, the optimizer's moments and step counts) and every generator (the next
  ``torch.rand``, ``random.random`` and ``numpy.random.rand`` are the original's); the save itself changes nothing,
  and a path where nothing was saved loads as None. The first tensor or generator that differs is named;
* ``check_snapshot_atomic``: Python's audit events (``sys.addaudithook``) show how the file reached its name: one
  rename (``os.replace``) of a whole file from the same directory, the previous snapshot untouched until then. Then
  the process is killed in the middle of a save: by the kernel once the file reaches a size limit
  (``RLIMIT_FSIZE``), or by SIGKILL at the rename itself. After the restart the previous snapshot must still load,
  whole, and never a cut-short file under the real name. A save into a location that cannot be written must raise;
* ``check_snapshot_size``: the file holds the model's and the optimizer's state and little else (no gradients, no
  pickled modules); the check reports its bytes by kind;
* ``check_snapshot_resume``: the course's training loop (a GPT with dropout under the course's DDP, batches drawn
  from NumPy's, Python's and torch's generators) on real ranks, with the student's save and load in it, one rank
  killed at a chosen step, ``launch(max_restarts=)`` restarting every rank: the resumed run's losses and final
  parameters must equal, bit for bit, those of the run that never stopped. A difference is named by its first step
  and its first tensor (parameter, optimizer state entry) or generator, with the usual cause.

The student's code runs in child processes. While it runs, ``dtcourse.fault_tolerance``'s ``Snapshots.save``,
``Snapshots.restore``, ``rng_state``, ``set_rng_state`` and its atomic writer refuse to run (``guard.watching``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import random
import resource
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from dtcourse.checks.common import (_as_student, _check_names, _deadlock, _notes, _read, _refuse_library_code,
                                     _stderr_to_stdout, _tail, _where_stuck)
from dtcourse.checks.guard import Answers, watching
from dtcourse.runtime.launch import LaunchError, LaunchTimeout, RankError, launch

__all__ = ["check_snapshot_round_trip", "check_snapshot_atomic", "check_snapshot_size", "check_snapshot_resume",
           "ROUND_TRIP_CASES", "ATOMIC_CASES", "RESUME_CASES", "SIZE_SLACK"]

# What these checks switch off while the student's code runs (guard.watching), and refuse to be given
ANSWERS = Answers("12", course=tuple(f"dtcourse.fault_tolerance.snapshot.{name}" for name in (
    "rng_state", "set_rng_state", "_atomic_write", "Snapshots.save", "Snapshots.restore")))
_LABEL = "save_snapshot and load_snapshot"
_ADVICE = "Write save_snapshot and load_snapshot yourself, in the exercise's cells, and pass those."
_HINT = ("Does a loop in your code never end, or does it wait for another rank (a barrier, a collective) that "
         "the other ranks never join?")


# --------------------------------------------------------------------------- #
# Running the student's code: in ranks, restarted, watched
# --------------------------------------------------------------------------- #
def _launch(world: int, rank_fn: Callable, args: tuple, timeout: float | None, where: str,
            restarts: int = 0) -> list:
    """``launch(rank_fn, world, *args, progress, max_restarts=restarts)``; whatever went wrong as an AssertionError.

    ``dtcourse.checks.common._launch_check`` with restarts, and the ranks' results returned. The launcher's note
    of each restart goes to stdout: nbgrader scores a test cell that wrote to stderr as 0.
    """
    if timeout is None:
        timeout = float(os.environ.get("DTCOURSE_CHECK_TIMEOUT", "20"))
    with tempfile.TemporaryDirectory(prefix="dtcourse-check-") as progress, \
            contextlib.redirect_stderr(sys.stdout):
        try:
            results = launch(_stderr_to_stdout, world, rank_fn, *args, progress, timeout=timeout, backend="gloo",
                             max_restarts=restarts)
            _stopped(progress, where)
            return results
        except LaunchTimeout as err:
            notes = _notes(progress, world)
            stuck = "; ".join(f"rank {rank} in {notes.get(rank) or 'its start'}" for rank in err.stuck)
            raise _deadlock(f"{_LABEL} did not finish{where} within {timeout:g} s (each attempt): {stuck}. "
                            f"{_HINT}{_where_stuck(err)}") from None
        except RankError as err:
            _stopped(progress, where)
            note = _notes(progress, world).get(err.rank, "")
            text = _read(Path(progress, f"{err.rank}.error")) or _tail(err.remote_traceback)
            raise AssertionError(f"{_LABEL} failed{where} in {note}: rank {err.rank} raised {text}") from None
        except LaunchError as err:
            _stopped(progress, where)
            raise AssertionError(f"{_LABEL} crashed a rank{where}, in the last attempt: {err}") from None


def _stopped(progress: str, where: str) -> None:
    """The first error of the student's code, in whichever attempt: it ends the check (see ``_student``)."""
    stop = Path(progress, "stop")
    if stop.exists():
        first = json.loads(stop.read_text())
        raise AssertionError(f"{_LABEL} failed{where} in {first['note']}: "
                             f"{'it' if where == '' else 'rank ' + str(first['rank'])} raised {first['error']}")


def _note(progress: str, text: str) -> None:
    rank = dist.get_rank()
    Path(progress, str(rank)).write_text(text)


def _student(fn: Callable, progress: str, *args: Any) -> Any:
    """``fn(*args)`` with the course's snapshots (and their atomic writer) refused; its error stops the check.

    A check that restarts its ranks restarts them after any failure, the student's too: so the first error is
    written to ``progress/stop``, every later attempt returns at once (``_stop_here``), and ``_launch`` reports it.
    """
    try:
        with watching(ANSWERS):
            return _as_student(progress, lambda: fn(*args))
    except Exception:
        rank, stop = dist.get_rank(), Path(progress, "stop")
        tmp = Path(progress, f".stop-{rank}")
        tmp.write_text(json.dumps({"rank": rank, "note": _read(Path(progress, str(rank))),
                                   "error": _read(Path(progress, f"{rank}.error"))}))
        with contextlib.suppress(FileExistsError):   # the first rank's, whole: a link is made at once or not at all
            os.link(tmp, stop)                         # (several ranks fail together; one may be read mid-write)
        raise


def _stop_here(progress: str) -> bool:
    """Has the student's code failed in an earlier attempt? Then this one does nothing."""
    return Path(progress, "stop").exists()


def _check_functions(check: str, save: Callable, load: Callable, cases: Sequence[str], known: dict) -> None:
    _check_names(check, save, cases, known)
    _check_names(check, load, cases, known)
    for fn in (save, load):
        _refuse_library_code(check, fn, ANSWERS.exercise, _ADVICE)


def _problems(results: list, where: str) -> None:
    """Raise the ranks' ``(case, message)`` problems, worded as ``_launch_check`` words them."""
    failures = [(rank, r["problem"]) for rank, r in enumerate(results) if r.get("problem")]
    if not failures:
        return
    lines = [message for _, (_, message) in failures[:1]] if len(results) == 1 else \
        [f"rank {rank}: {message}" for rank, (_, message) in failures[:4]]
    more = f"\n  ... and {len(failures) - 4} more ranks" if len(failures) > 4 else ""
    raise AssertionError(f"{_LABEL} are wrong{where} in {failures[0][1][0]}:\n  " + "\n  ".join(lines) + more)


# --------------------------------------------------------------------------- #
# What a snapshot must bring back: tensors by name, and the generators
# --------------------------------------------------------------------------- #
def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _generators() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


_GENERATOR = {"torch": "torch's generator (torch.get_rng_state / torch.set_rng_state)",
              "python": "Python's random (random.getstate / random.setstate)",
              "numpy": "NumPy's global generator (numpy.random.get_state / numpy.random.set_state)"}
_DRAW = {"torch": "torch.rand(4)", "python": "random.random()", "numpy": "numpy.random.rand(2)"}


def _draw() -> dict[str, Any]:
    """What each generator gives next (and each moves on)."""
    return {"torch": torch.rand(4).tolist(), "python": [random.random()], "numpy": np.random.rand(2).tolist()}


def _short(numbers: list[float]) -> str:
    return "[" + ", ".join(f"{x:.4f}" for x in numbers) + "]"


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None, generators: bool = False) -> dict:
    """Everything a resume needs, by a readable key: model tensors, optimizer entries, (generators)."""
    out: dict[tuple, Any] = {("model", n.removeprefix("module.")): t.detach().clone()
                             for n, t in model.state_dict().items()}
    if optimizer is not None:
        names = [n.removeprefix("module.") for n, _ in model.named_parameters()]
        saved = optimizer.state_dict()
        for group in saved["param_groups"]:
            for index in group["params"]:
                for key, value in saved["state"].get(index, {}).items():
                    out[("optimizer", names[index], key)] = value.clone() if torch.is_tensor(value) else value
    if generators:
        out.update({("generator", k): v for k, v in _generators().items()})
    return out


def _what(key: tuple) -> str:
    if key[0] == "model":
        return f"the model's {key[1]!r}"
    if key[0] == "optimizer":
        return f"the optimizer's {key[2]!r} of {key[1]!r}"
    return _GENERATOR[key[1]]


def _equal(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape \
            and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _first_difference(want: dict, got: dict, whose: str = "the original's") -> tuple[tuple, str] | None:
    """The first key of ``want`` (in order) that ``got`` lacks or holds otherwise, and how, or None."""
    for key, value in want.items():
        if key not in got and key[0] == "optimizer" and not any(k[0] == "optimizer" for k in got):
            params = len({k[1] for k in want if k[0] == "optimizer"})
            kinds = ", ".join(repr(k) for k in dict.fromkeys(k[2] for k in want if k[0] == "optimizer"))
            return key, f"the optimizer holds no state at all, where {whose} holds {kinds} for each of {params} " \
                        "parameters"
        if key not in got:
            return key, f"{_what(key)} is missing"
        mine = got[key]
        if _equal(value, mine):
            continue
        if key[0] == "generator":
            return key, f"{_what(key)} is not where it was"
        if torch.is_tensor(value) and torch.is_tensor(mine) and value.shape == mine.shape and value.is_floating_point():
            off = (value.double() - mine.double()).abs().max().item()
            return key, f"{_what(key)} differs from {whose} by up to {off:.3g}"
        if torch.is_tensor(value) and torch.is_tensor(mine):
            return key, (f"{_what(key)} is {tuple(mine.shape)} {mine.dtype} where {whose} is {tuple(value.shape)} "
                         f"{value.dtype}" if (mine.shape, mine.dtype) != (value.shape, value.dtype) else
                         f"{_what(key)} differs from {whose}: {mine.flatten()[:4].tolist()} where it holds "
                         f"{value.flatten()[:4].tolist()}")
        return key, f"{_what(key)} is {mine!r:.60} where {whose} is {value!r:.60}"
    return None


_CAUSE = {
    "model": "save model.state_dict() (the parameters and the buffers, such as BatchNorm's running statistics) and "
             "load it with model.load_state_dict",
    "optimizer": "save optimizer.state_dict() (AdamW's two moments and step count per parameter, SGD's momentum) "
                 "and load it with optimizer.load_state_dict",
    "generator": "save each generator's state (random.getstate(), numpy.random.get_state(), torch.get_rng_state()) "
                 "and put it back (random.setstate, numpy.random.set_state, torch.set_rng_state)",
}


def _step_problem(got: Any, want: int, call: str) -> str | None:
    if type(got) is int and got == want:
        return None
    if got is None or type(got) is not int:
        return (f"{call} returned {got!r} ({type(got).__name__}); the snapshot was saved as step {want}: return "
                "that step, an int (None only where nothing was saved)")
    return (f"{call} returned {got}, but the snapshot was saved as step {want}: return the step save_snapshot was "
            "given, as it was given" + (" (you added one: the step saved is already the next step to run)"
                                        if got == want + 1 else " (you took one away)" if got == want - 1 else ""))


# --------------------------------------------------------------------------- #
# Check 1: the round trip, in one process
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class _Setup:
    model: str          # "gpt" (dropout 0.1) or "mlp" (BatchNorm: buffers)
    optimizer: str      # "adamw", "amsgrad" (Adam's max_exp_avg_sq too) or "sgd" (momentum)
    trained: int        # optimizer steps before the snapshot
    step: int           # the step saved

    def __str__(self) -> str:
        model = "a GPT with dropout" if self.model == "gpt" else "an MLP with BatchNorm"
        optimizer = {"adamw": "AdamW", "amsgrad": "Adam with amsgrad", "sgd": "SGD with momentum"}[self.optimizer]
        return f"{model} and {optimizer} after {self.trained} steps, saved as step {self.step}"


ROUND_TRIP_CASES = {
    "small": ("a GPT with dropout and AdamW", (_Setup("gpt", "adamw", 3, 3),)),
    "large": ("an MLP with BatchNorm and SGD with momentum, Adam with amsgrad, a snapshot of step 0",
              (_Setup("mlp", "sgd", 2, 41), _Setup("gpt", "amsgrad", 2, 7), _Setup("gpt", "adamw", 0, 0))),
}
_GPT = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, d_model=16)


def _build(setup: _Setup, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (initialised from ``seed``, the caller's generators left alone) and its optimizer, untrained."""
    from dtcourse.models import GPT, GPTConfig, seeded
    if setup.model == "gpt":
        model = GPT(GPTConfig(**_GPT, dropout=0.1), seed=seed)
    else:
        with seeded(seed):
            model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 8))
    optimizer = {"adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
                 "amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, weight_decay=0.1),
                 "sgd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True)}[setup.optimizer]
    return model, optimizer(model.parameters())


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    """``steps`` steps on batches drawn from torch's generator (dropout draws from it too)."""
    from dtcourse.models import lm_loss
    for _ in range(steps):
        optimizer.zero_grad()
        if isinstance(model, nn.Sequential):
            x = torch.randn(16, 8)
            loss = (model(x) - x.flip(1)).pow(2).mean()
        else:
            idx = torch.randint(_GPT["vocab_size"], (4, _GPT["block_size"]))
            loss = lm_loss(model(idx), idx.roll(-1, dims=1))
        loss.backward()
        optimizer.step()


def check_snapshot_round_trip(save: Callable, load: Callable, cases: Sequence[str] = ("small",),
                              timeout: float | None = None) -> None:
    """``save(path, step, model, optimizer)`` then ``load(path, fresh_model, fresh_optimizer)``, for ``cases``.

    ``load`` must return the step, and leave the fresh model and optimizer equal to the saved ones tensor for tensor
    (parameters, buffers, every optimizer state entry) and the generators where they were after the save (the next
    ``torch.rand``, ``random.random``, ``numpy.random.rand`` the same). ``save`` must change nothing: not the model,
    not a generator. ``load`` of a path where nothing was saved returns None and changes nothing.
    """
    _check_functions("check_snapshot_round_trip", save, load, cases, ROUND_TRIP_CASES)
    with tempfile.TemporaryDirectory(prefix="dtcourse-snapshots-") as directory:
        results = _launch(1, _round_trip_rank, (save, load, tuple(cases), directory), timeout, "")
    _problems(results, "")


def _round_trip_rank(save: Callable, load: Callable, cases: tuple[str, ...], directory: str, progress: str) -> dict:
    for name in cases:
        setups = ROUND_TRIP_CASES[name][1]
        for setup in setups:
            _note(progress, f"case {name!r}, {setup}")
            problem = _round_trip(save, load, setup, Path(directory, f"{name}-{setup.step}"), progress)
            if problem:
                return {"problem": (f"case {name!r}, {setup}", problem)}
    _note(progress, "finished")
    return {}


def _round_trip(save: Callable, load: Callable, setup: _Setup, folder: Path, progress: str) -> str | None:
    folder.mkdir(parents=True)
    path = folder / "rank-0.pt"
    _seed(setup.step + 1)
    model, optimizer = _build(setup, seed=0)
    _train(model, optimizer, setup.trained)
    want, before = _state(model, optimizer), _generators()
    call = f"save_snapshot(path, {setup.step}, model, optimizer)"
    _student(save, progress, path, setup.step, model, optimizer)
    if not path.is_file():
        return f"{call} returned, but there is no file at path ({path.name}): write the snapshot to the path given"
    moved = _first_difference({("generator", k): v for k, v in before.items()},
                              {("generator", k): v for k, v in _generators().items()})
    if moved:
        return (f"{call} moved {_what(moved[0])}: it drew a number from it or seeded it. A snapshot only reads each "
                "generator's state; drawing changes the numbers the run draws next, so the run that saved differs "
                "from the one that never did")
    changed = _first_difference(want, _state(model, optimizer))
    if changed:
        return f"{call} changed the model or the optimizer: afterwards, {changed[1]}. A snapshot only reads them"
    drawn = _draw()                                   # what the run would have drawn next, had it gone on
    fresh, fresh_optimizer = _build(setup, seed=1)    # other weights, an optimizer with no state
    _seed(12345)                                      # a new process's generators are somewhere else
    call = "load_snapshot(path, model, optimizer)"
    got = _student(load, progress, path, fresh, fresh_optimizer)
    problem = _step_problem(got, setup.step, call)
    if problem:
        return problem
    differs = _first_difference(want, _state(fresh, fresh_optimizer))
    if differs:
        return (f"after {call} into a fresh model and optimizer, {differs[1]}: {_CAUSE[differs[0][0]]}")
    again = _draw()
    for key, value in drawn.items():
        if again[key] != value:
            return (f"after {call}, the next {_DRAW[key]} is {_short(again[key])}, where right after the save it "
                    f"was {_short(value)}: load_snapshot did not restore {_GENERATOR[key]}. Dropout masks, batches and "
                    "augmentations are drawn from the generators: " + _CAUSE["generator"])
    return _nothing_saved(load, setup, folder)


def _nothing_saved(load: Callable, setup: _Setup, folder: Path) -> str | None:
    model, optimizer = _build(setup, seed=2)
    want = _state(model, optimizer, generators=True)
    path = folder / "never-saved" / "rank-0.pt"
    try:
        with watching(ANSWERS):
            got = load(path, model, optimizer)
    except Exception as exc:
        return (f"load_snapshot on a path where nothing was saved yet raised {type(exc).__name__}: {exc}. The first "
                "attempt of a run has no snapshot: return None, and the run starts at step 0")
    if got is not None:
        return f"load_snapshot on a path where nothing was saved returned {got!r}; return None there"
    changed = _first_difference(want, _state(model, optimizer, generators=True))
    if changed:
        return f"load_snapshot on a path where nothing was saved changed something: {changed[1]}"
    return None


# --------------------------------------------------------------------------- #
# Check 2: atomic, watched and killed
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class _Kill:
    what: str            # "half-way through writing its file", ...
    fraction: float = 0  # kill once the file written reaches this fraction of a whole snapshot ...
    nbytes: int = 0      # ... or this many bytes (negative: this many before the end)
    rename: bool = False  # ... or by SIGKILL as the file is renamed onto the snapshot's name


ATOMIC_CASES = {
    "small": ("a save killed half-way through writing its file", (_Kill("half-way through writing", fraction=0.5),)),
    "large": ("saves killed after 1 KB, 100 bytes before the end, and as the file is renamed",
              (_Kill("after writing its first kilobyte", nbytes=1024),
               _Kill("100 bytes before the end of its file", nbytes=-100),
               _Kill("by SIGKILL as the file was renamed onto its name", rename=True))),
}


class _Watcher:
    """Audit events while a save runs (``sys.addaudithook``): each rename or copy onto the snapshot's path.

    A hook cannot be removed: one per process, switched on by ``target``. An event fires before its operation, so
    at a rename the file being renamed is seen as it is then, and the snapshot's path still holds the old file.
    """

    def __init__(self) -> None:
        self.target: Path | None = None
        self.before: bytes | None = None
        self.kill_at_rename, self.busy = False, False
        self.renames: list[dict] = []
        self.copies: list[str] = []
        sys.addaudithook(self)

    def __call__(self, event: str, args: tuple) -> None:
        if self.target is None or self.busy or event not in ("os.rename", "shutil.copyfile"):
            return
        self.busy = True          # what this hook reads must not come back here
        try:
            src, dst = (Path(os.fsdecode(a)).resolve() for a in args[:2])
            if dst != self.target:
                return
            if event == "shutil.copyfile":
                self.copies.append(src.name)
                return
            if self.kill_at_rename:
                os.kill(os.getpid(), signal.SIGKILL)
            now = self.target.read_bytes() if self.target.exists() else None
            self.renames.append({"src": src, "size": src.stat().st_size if src.exists() else -1,
                                 "untouched": now == self.before})
        except Exception as exc:             # never let the check's hook break the student's rename
            self.renames.append({"error": f"{type(exc).__name__}: {exc}"})
        finally:
            self.busy = False

    def watch(self, path: Path) -> None:
        self.target, self.before = path.resolve(), path.read_bytes() if path.exists() else None
        self.renames, self.copies = [], []

    def problem(self, path: Path, call: str) -> str | None:
        """What the audit events say against an atomic write, once the save returned (None: nothing)."""
        self.target = None
        name, renames = path.name, [r for r in self.renames if "error" not in r]
        if not path.is_file():
            return f"{call} returned, but there is no file at path ({name}): write the snapshot to the path given"
        if not renames:
            copied = f" (it copied {self.copies[0]} onto it, byte by byte)" if self.copies else ""
            return (f"{call} never renamed a finished file onto {name}{copied}: it wrote {name} in place, so a crash "
                    f"while writing leaves a cut-short {name} and no snapshot at all. Write to a temporary file in the "
                    f"same directory, then os.replace(tmp, path)")
        last, size = renames[-1], path.stat().st_size
        if last["src"].parent != path.resolve().parent:
            return (f"{call} renamed {last['src']} onto {name}, from another directory: a rename is atomic only "
                    "within one file system (across two, os.replace fails and shutil.move copies byte by byte). "
                    "Write the temporary file beside the snapshot, in the same directory")
        if last["size"] != size:
            return (f"when {call} renamed {last['src'].name} onto {name}, that file held {last['size']} B of the "
                    f"{size} B it ended with: the rest was written after the rename, through a handle still open. "
                    "Close (or flush) the temporary file before os.replace")
        if self.before is not None and not last["untouched"]:
            return (f"before {call} renamed its file onto {name}, {name} had already changed (deleted or written "
                    "over): until the rename, the previous snapshot must stay whole, or a crash loses both")
        return None


def _atomic_state(step: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model and optimizer that only ``step`` decides (any process rebuilds them bit for bit)."""
    from dtcourse.models import GPT, GPTConfig, lm_loss, token_batch
    model = GPT(GPTConfig(**_GPT), seed=step)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = token_batch(model.config, 4, seed=step)
    lm_loss(model(x), y).backward()
    optimizer.step()
    return model, optimizer


def check_snapshot_atomic(save: Callable, load: Callable, cases: Sequence[str] = ("small",),
                          timeout: float | None = None) -> None:
    """Saves watched, then killed part-way through, then loaded after a restart, for every kill of ``cases``.

    Each attempt (one process, restarted by ``launch(max_restarts=)``) checks what the last one left: the previous
    snapshot, whole and loading as its step and state. Then it saves a snapshot with its writes watched (one rename
    of a whole file from the same directory onto the path, the old file untouched until then), and starts another
    save that the check kills part-way. The last attempt also saves where nothing can be written: it must raise.
    """
    _check_functions("check_snapshot_atomic", save, load, cases, ATOMIC_CASES)
    kills = tuple(kill for name in cases for kill in ATOMIC_CASES[name][1])
    descriptions = "; ".join(ATOMIC_CASES[name][0] for name in cases)
    with tempfile.TemporaryDirectory(prefix="dtcourse-snapshots-") as directory:
        results = _launch(1, _atomic_rank, (save, load, kills, directory), timeout, "", restarts=len(kills))
    for result in results:
        if result.get("problem"):
            raise AssertionError(f"{_LABEL} fail the atomic check ({descriptions}):\n  {result['problem'][1]}")


def _atomic_rank(save: Callable, load: Callable, kills: tuple[_Kill, ...], directory: str, progress: str) -> dict:
    from dtcourse.fault_tolerance import restart_count
    attempt, folder = restart_count(), Path(directory)
    if _stop_here(progress):
        return {}
    path, watcher = folder / "rank-0.pt", _Watcher()
    if attempt:
        kill = kills[attempt - 1]
        _note(progress, f"restart {attempt}, after a save killed {kill.what}")
        problem = _after_crash(load, path, kill, 10 * attempt, folder, progress)
        if problem:
            return {"problem": ("", problem)}
    step = 10 * (attempt + 1)
    call = f"save_snapshot(path, {step}, model, optimizer)"
    _note(progress, f"attempt {attempt}, {call}, watched")
    watcher.watch(path)
    _student(save, progress, path, step, *_atomic_state(step))
    observed = watcher.problem(path, call)
    (folder / "observed.txt").write_text(observed or "")
    if observed and attempt:          # the first attempt's finding waits: the crash shows what it costs
        return {"problem": ("", observed)}
    if attempt == len(kills):
        problem = _unwritable(save, folder)
        return {"problem": ("", problem)} if problem else {}
    return {"problem": ("", _crash(save, path, step + 5, kills[attempt], watcher, folder, progress))}


def _crash(save: Callable, path: Path, step: int, kill: _Kill, watcher: _Watcher, folder: Path, progress: str) -> str:
    """Start ``save`` of ``step`` and have it killed as ``kill`` says; returns only if it was not."""
    whole = path.stat().st_size
    (folder / "whole.txt").write_text(str(whole))
    _note(progress, f"save_snapshot(path, {step}, model, optimizer), to be killed {kill.what}")
    state = _atomic_state(step)
    if kill.rename:
        watcher.watch(path)
        watcher.kill_at_rename = True
    else:
        limit = int(whole * kill.fraction) if kill.fraction else kill.nbytes % whole
        _limit_file_size(limit)
    _student(save, progress, path, step, *state)
    return (f"save_snapshot(path, {step}, model, optimizer) should have been killed {kill.what}, and it finished: "
            f"did it write no file, or one of under {whole} B, though the snapshot before was {whole} B?")


def _limit_file_size(limit: int) -> None:
    """From now on, a write that takes any file past ``limit`` bytes kills this process (SIGXFSZ), no core dump."""
    with contextlib.suppress(Exception):          # Linux: a non-dumpable process writes no core
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)     # PR_SET_DUMPABLE = 4
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it (a write fails with EFBIG); the kernel kills
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _readable(data: bytes) -> str | None:
    """None if ``data`` loads (torch.load, else pickle), else why not."""
    try:
        torch.load(io.BytesIO(data), weights_only=False)
        return None
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc).split('. ')[0][:100]}"          # its first sentence
    try:
        pickle.loads(data)
        return None
    except Exception:
        return error


def _after_crash(load: Callable, path: Path, kill: _Kill, step: int, folder: Path, progress: str) -> str | None:
    """After the save of ``step + 5`` was killed: the snapshot of ``step`` must be under its name, whole."""
    died = f"save_snapshot(path, {step + 5}, ...) was killed {kill.what}"
    observed = (folder / "observed.txt").read_text()
    hint = f"\n  what the check saw of your save before: {observed}" if observed else ""
    if not path.exists():
        return (f"{died}, and afterwards there is no {path.name} at all: the snapshot of step {step} was deleted "
                f"before the new one was whole. Replace the old file with os.replace, never delete it first{hint}")
    data, whole = path.read_bytes(), int((folder / "whole.txt").read_text())
    broken = _readable(data)
    if broken:
        return (f"{died}, and afterwards {path.name} is cut short: {len(data)} B of a {whole} B snapshot, and it "
                f"does not load ({broken}). The snapshot of step {step} is lost, and the run cannot resume. A crash "
                f"part-way through a write must leave the previous file as it was{hint}")
    model, optimizer = _atomic_state(0)
    got = _student(load, progress, path, model, optimizer)
    problem = _step_problem(got, step, f"after {died}, load_snapshot(path, model, optimizer)")
    if problem:
        return problem + (" (did it read a temporary file the killed save left behind?)" if got == step + 5 else "")
    differs = _first_difference(_state(*_atomic_state(step)), _state(model, optimizer), "the snapshot's")
    if differs:
        return f"after {died}, load_snapshot gave step {step} but {differs[1]}{hint}"
    return None


def _unwritable(save: Callable, folder: Path) -> str | None:
    blocker = folder / "a-file"
    blocker.write_text("")
    path = blocker / "rank-0.pt"                  # a directory that is a file: nothing can be written there
    try:
        with watching(ANSWERS):
            save(path, 1, *_atomic_state(1))
    except Exception:
        return None
    return (f"save_snapshot(path, 1, model, optimizer) with path = {path} (inside a file, where nothing can be "
            "written) returned without an error. A save that fails silently leaves the run with no snapshot and "
            "no one told: let the OSError reach the caller")


# --------------------------------------------------------------------------- #
# Check 3: what the file holds
# --------------------------------------------------------------------------- #
# The file holds the model's and the optimizer's tensors (torch.save stores each storage once, uncompressed) plus
# what is not a tensor: the generators' states (torch's 5,056 B, Python's and NumPy's a few KB, pickled) and the zip
# format's headers and 64-byte alignment for each of its 125 tensors. Measured with the solution: 46,305 B over the
# tensors' 1,606,772 B (2.9%). Saving the gradients too adds 535,552 B (33%), float64 copies double the file.
SIZE_SLACK = 0.1          # relative, over the model's and the optimizer's tensor bytes
_SIZE_EXTRA = 64 * 1024    # absolute: the generators and the format
_SIZE_GPT = dict(vocab_size=256, block_size=16, n_layer=2, n_head=4, d_model=64)


def check_snapshot_size(save: Callable, load: Callable, cases: Sequence[str] = ("small",),
                        timeout: float | None = None) -> str:
    """The bytes of one snapshot of a GPT after an AdamW step, against its model's and optimizer's state bytes.

    The file must hold at least those tensors and at most ``SIZE_SLACK`` more (plus 64 KB for the generators and
    the format), and no pickled module or optimizer object. Returns the report: the file's bytes by kind.
    """
    _check_functions("check_snapshot_size", save, load, cases, {"small": ""})
    with tempfile.TemporaryDirectory(prefix="dtcourse-snapshots-") as directory:
        result = _launch(1, _size_rank, (save, directory), timeout, "")[0]
    if result.get("problem"):
        raise AssertionError(f"{_LABEL} hold the wrong bytes (a GPT of {result['params']:,} parameters after one "
                             f"AdamW step):\n  {result['problem'][1]}")
    return result["report"]


def _bytes(tensors: Any) -> int:
    """Bytes of the distinct storages under ``tensors`` (what torch.save writes)."""
    seen: dict[int, int] = {}
    for t in _walk(tensors):
        if torch.is_tensor(t):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _walk(obj: Any, depth: int = 0):
    yield obj
    if depth > 8:
        return
    if isinstance(obj, dict):
        for value in obj.values():
            yield from _walk(value, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _walk(value, depth + 1)


def _size_rank(save: Callable, directory: str, progress: str) -> dict:
    from dtcourse.models import GPT, GPTConfig, lm_loss, token_batch
    model = GPT(GPTConfig(**_SIZE_GPT), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = token_batch(model.config, 4, seed=0)
    lm_loss(model(x), y).backward()                  # the gradients stay: a snapshot must not take them
    optimizer.step()
    params = sum(p.numel() for p in model.parameters())
    path = Path(directory, "rank-0.pt")
    _note(progress, "save_snapshot(path, 1, model, optimizer) of a GPT after one AdamW step")
    _student(save, progress, path, 1, model, optimizer)
    if not path.is_file():
        return {"problem": ("", "save_snapshot(path, 1, model, optimizer) returned, but there is no file at path "
                                f"({path.name}): write the snapshot to the path given"), "params": params}
    size = path.stat().st_size
    own, moments = _bytes(model.state_dict()), _bytes(optimizer.state_dict()["state"])
    rest = size - own - moments
    report = (f"your snapshot of a GPT of {params:,} parameters after one AdamW step is {size:,} B: the model's state "
              f"{own:,} B + the optimizer's {moments:,} B (two moments and a step count per parameter) + {rest:,} B "
              "of generator states, the step and the file's format")
    problem = None
    if size < own + moments:
        problem = (f"the file is {size:,} B, less than the model's state ({own:,} B) and the optimizer's ({moments:,} "
                   "B) that it must hold, uncompressed, in their own dtypes")
    elif rest > SIZE_SLACK * (own + moments) + _SIZE_EXTRA:
        problem = (f"{report}. That is {rest:,} B more than the model's and the optimizer's state, where generator "
                   f"states and the format take under {_SIZE_EXTRA // 1024} KB; what it holds, by key: "
                   f"{_held(path)}. Save state_dict()s, not the gradients or copies")
    else:
        objects = _objects(path)
        if objects:
            problem = (f"the file holds {objects}, pickled whole: save state_dict()s, plain tensors and numbers. A "
                       "pickled module needs its class's code, unchanged, to load, and drags along whatever it "
                       "refers to (hooks, process groups)")
    return {"problem": ("", problem) if problem else None, "report": report, "params": params}


def _load_any(path: Path) -> Any:
    try:
        return torch.load(path, weights_only=False)
    except Exception:
        with path.open("rb") as f:
            return pickle.load(f)


def _held(path: Path) -> str:
    try:
        saved = _load_any(path)
    except Exception as exc:
        return f"(it does not load: {type(exc).__name__})"
    if not isinstance(saved, dict):
        return f"a {type(saved).__name__} of {_bytes(saved):,} B of tensors"
    return ", ".join(f"{key!r} {_bytes(value):,} B" for key, value in saved.items())


def _objects(path: Path) -> str:
    """The modules and optimizers pickled in the file, named ('' if none)."""
    try:
        saved = _load_any(path)
    except Exception:
        return ""
    found = [type(o).__name__ for o in _walk(saved) if isinstance(o, (nn.Module, torch.optim.Optimizer))]
    return " and ".join(f"an object of class {name}" for name in dict.fromkeys(found))


# --------------------------------------------------------------------------- #
# Check 4: kill a rank, restart, resume bit for bit
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class _Failure:
    attempt: int        # the attempt it happens in (0: the first run)
    rank: int
    step: int           # it fails as this step starts
    how: str            # "raise" or "SIGKILL"


@dataclass(frozen=True)
class _Run:
    world: int
    steps: int
    every: int          # save_snapshot(path, step + 1, ...) after every step + 1 that this divides
    failures: tuple[_Failure, ...]

    def resumes(self) -> list[int]:
        """The step each restart must resume from: the last snapshot before its failure."""
        return [f.step // self.every * self.every for f in self.failures]


RESUME_CASES = {
    "small": ("2 ranks, snapshots every 2 steps, rank 1 raising at step 5",
              (_Run(2, 8, 2, (_Failure(0, 1, 5, "raise"),)),)),
    "large": ("3 ranks, snapshots every 3 steps, rank 2 killed by SIGKILL at step 7, then rank 0 at step 9",
              (_Run(3, 10, 3, (_Failure(0, 2, 7, "SIGKILL"), _Failure(1, 0, 9, "SIGKILL"))),)),
}
_RESUME_GPT = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, d_model=16, dropout=0.1)
_CORPUS = torch.tensor([(7 * i * i + 3 * i) % 32 for i in range(200)])    # the data set: a fixed token stream


def check_snapshot_resume(save: Callable, load: Callable, cases: Sequence[str] = ("small",),
                          timeout: float | None = None) -> None:
    """The course's training loop with the student's snapshots, a rank failing, every rank restarted.

    The run that never stops (no snapshots) is the reference. The other saves ``save(path, step + 1, model,
    optimizer)`` every few steps, ``path`` each rank's own file, and starts each attempt with
    ``load(path, model, optimizer)``; ``launch(max_restarts=)`` restarts every rank after a failure. Every
    attempt's losses, the state right after each load, and the final parameters and optimizer state must equal the
    reference's bit for bit; the first difference is named by its step and its tensor or generator.
    """
    _check_functions("check_snapshot_resume", save, load, cases, RESUME_CASES)
    for name in cases:
        description, runs = RESUME_CASES[name]
        for run in runs:
            where = f" on {run.world} ranks"
            with tempfile.TemporaryDirectory(prefix="dtcourse-snapshots-") as directory:
                _launch(run.world, _resume_rank, (None, None, run, directory), timeout, where)
                resumed = _launch(run.world, _resume_rank, (save, load, run, directory), timeout, where,
                                  restarts=len(run.failures))
                problems = [_resume_problem(run, rank, resumed[rank], Path(directory)) for rank in range(run.world)]
            _problems([{"problem": (f"case {name!r} ({description})", p)} if p else {} for p in problems], where)


def _resume_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A batch as a data pipeline draws it: NumPy picks the windows, Python's random flips some, torch adds noise."""
    T = _RESUME_GPT["block_size"]
    starts = np.random.randint(0, len(_CORPUS) - T - 1, size=4)            # a sampler's choice of windows
    rows = [_CORPUS[s:s + T + 1].flip(0) if random.random() < 0.5 else _CORPUS[s:s + T + 1] for s in starts]
    tokens = torch.stack(rows)                                              # (B, T + 1)
    noise = torch.rand(tokens.shape) < 0.1                                  # an augmentation: 10% random tokens
    tokens = torch.where(noise, torch.randint(_RESUME_GPT["vocab_size"], tokens.shape), tokens)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()      # (B, T) inputs, (B, T) targets


def _resume_rank(save: Callable | None, load: Callable | None, run: _Run, directory: str, progress: str) -> dict:
    """One attempt of one rank: with ``save`` None, the reference run (no snapshots, no failures)."""
    from dtcourse.data_parallel import DistributedDataParallel
    from dtcourse.fault_tolerance import restart_count
    from dtcourse.models import GPT, GPTConfig, lm_loss
    rank, attempt, folder = dist.get_rank(), restart_count(), Path(directory)
    if _stop_here(progress):
        return {"stopped": True}
    model = DistributedDataParallel(GPT(GPTConfig(**_RESUME_GPT), seed=0), strategy="overlapped", comm="backend")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _seed(100 + rank)                                 # each rank its own streams: its data and its dropout
    path, record, states = folder / f"rank-{rank}.pt", {"start": None, "losses": {}}, {}
    if save is not None:
        _note(progress, f"attempt {attempt}, load_snapshot(path, model, optimizer)")
        start = _student(load, progress, path, model, optimizer)
        starts: list = [None] * run.world
        dist.all_gather_object(starts, repr(start))   # sends one pickled string per rank
        if len(set(starts)) > 1:
            return {"disagree": starts, "attempt": attempt}
        if start is not None and (type(start) is not int or not 0 <= start <= run.steps):
            return {"bad": repr(start), "attempt": attempt}
        record["start"] = start
        if start is not None:
            torch.save(_state(model, optimizer, generators=True), folder / f"resumed-{attempt}-{rank}.pt")
    for step in range(record["start"] or 0, run.steps):
        planned = [f for f in run.failures if save is not None and (f.attempt, f.step) == (attempt, step)]
        if planned:
            # every rank first finishes the step before, and the save after it: otherwise a rank that failed right
            # after a save could take the others down before theirs, and where they resume would depend on timing
            dist.barrier()
        failure = next((f for f in planned if f.rank == rank), None)
        if failure and failure.how == "raise":
            raise RuntimeError(f"the check's planned failure: rank {rank} raises at step {step}")
        if failure:
            os.kill(os.getpid(), signal.SIGKILL)
        if save is None and step in run.resumes():
            states[step] = _state(model, optimizer, generators=True)
        _note(progress, f"attempt {attempt}, step {step}")
        x, y = _resume_batch()
        optimizer.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()                                # the course's DDP all-reduces the gradients
        optimizer.step()
        record["losses"][step] = loss.item()
        if save is not None:
            tmp = folder / f".attempt-{attempt}-{rank}.json.tmp"   # this rank may be killed mid-write: atomic too
            tmp.write_text(json.dumps(record))
            os.replace(tmp, folder / f"attempt-{attempt}-{rank}.json")
            if (step + 1) % run.every == 0:
                _note(progress, f"attempt {attempt}, save_snapshot(path, {step + 1}, model, optimizer)")
                _student(save, progress, path, step + 1, model, optimizer)
    # the records go through a file: a rank's result travels pickled, and these check modules are fresh copies
    records = {"losses": record["losses"], "states": states, "final": _state(model, optimizer, generators=True)}
    torch.save(records, folder / (f"never-{rank}.pt" if save is None else f"final-{rank}.pt"))
    return {"attempt": attempt}


def _resume_problem(run: _Run, rank: int, resumed: dict, folder: Path) -> str | None:
    """The first place rank ``rank``'s resumed run differs from the one that never stopped, and why, or None."""
    if "disagree" in resumed:
        return (f"after restart {resumed['attempt']}, the ranks' load_snapshot returned different steps "
                f"({', '.join(f'rank {r}: {s}' for r, s in enumerate(resumed['disagree']))}): every rank saves and "
                "loads its own file (path is rank-<r>.pt), and all must resume from the same step")
    if "bad" in resumed:
        return (f"after restart {resumed['attempt']}, load_snapshot returned {resumed['bad']}: return the step that "
                "was saved, an int between 0 and the number of steps, or None where nothing was saved")
    never = torch.load(folder / f"never-{rank}.pt", weights_only=False)
    want = never["losses"]
    final = _first_difference(never["final"], torch.load(folder / f"final-{rank}.pt", weights_only=False)["final"],
                              "the uninterrupted run's")
    for attempt in range(len(run.failures) + 1):
        record = json.loads((folder / f"attempt-{attempt}-{rank}.json").read_text()) \
            if (folder / f"attempt-{attempt}-{rank}.json").exists() else {"start": None, "losses": {}}
        losses = {int(k): v for k, v in record["losses"].items()}
        if attempt == 0:
            step = next((s for s in sorted(losses) if losses[s] != want[s]), None)
            if step is not None:
                return (f"before any failure, the loss of step {step} is {losses[step]!r} where the run without "
                        f"snapshots had {want[step]!r}: the only difference is your save_snapshot (and "
                        "load_snapshot, which found nothing). A snapshot only reads the model, the optimizer and the "
                        "generators: it must not draw from a generator, seed one, or change the model")
            continue
        last = attempt == len(run.failures)
        problem = _restart_problem(run, rank, attempt, record, losses, want, never, folder, final if last else None)
        if problem:
            return problem
    if final:
        return f"the losses all match, but after the last step {final[1]}: " + _CAUSE[final[0][0]]
    return None


def _restart_problem(run: _Run, rank: int, attempt: int, record: dict, losses: dict, want: dict, never: dict,
                     folder: Path, final: tuple | None) -> str | None:
    """What went wrong in restarted ``attempt``: where it resumed, its first loss and state that differ, and why."""
    expected, start, failure = run.resumes()[attempt - 1], record["start"], run.failures[attempt - 1]
    prefix = (f"after rank {failure.rank} {'raised' if failure.how == 'raise' else 'was killed by SIGKILL'} at step "
              f"{failure.step} and every rank restarted")
    last = f"save_snapshot(path, {expected}, model, optimizer)" if expected else "none (no snapshot yet)"
    if start != expected:
        if start is None:
            missing = "" if (folder / f"rank-{rank}.pt").exists() else (
                f", and there is no rank-{rank}.pt: save_snapshot wrote nothing at the path it was given")
            return (f"{prefix}, load_snapshot returned None and the run began again at step 0, though the last "
                    f"snapshot before the failure was {last}{missing}")
        what = (f"step {expected} was skipped" if start == expected + 1 else
                f"step {start} ran twice" if start == expected - 1 else f"the run went on from step {start}")
        return (f"{prefix}, load_snapshot returned {start}, but the last snapshot before the failure was {last}: "
                f"{what}. Return the step save_snapshot was given: it is the next step to run")
    step = next((s for s in sorted(losses) if losses[s] != want[s]), None)
    differs = None
    if start is not None:
        saved = torch.load(folder / f"resumed-{attempt}-{rank}.pt", weights_only=False)
        differs = _first_difference(never["states"][start], saved, "the uninterrupted run's")
    if step is None and differs is None and final is None:
        return None
    told = f"{prefix}, the run resumed from step {start}, and " + (
        f"the loss of step {step} is {losses[step]!r} where the run that never stopped had {want[step]!r}"
        f"{' (the first step after the restart)' if step == start else ''}" if step is not None
        else "every loss matches") + (f"; after the last step, {final[1]}" if final else "")
    if differs is None:
        return told + (": what differs was not in the model, the optimizer or the generators that load_snapshot "
                       "restored")
    kind = differs[0][0]
    effect = {"generator": f"the dropout masks and batches drawn after the restart differ, and the losses with them "
                           f"from step {start} on",
              "optimizer": f"step {start}'s loss can still match, but its update differs, and the parameters after "
                           "it",
              "model": f"the losses differ from step {start} on"}[kind]
    cause = _CAUSE[kind]
    return f"{told}. Right after load_snapshot, {differs[1]} at step {start}: {effect}. {cause[0].upper()}{cause[1:]}"
