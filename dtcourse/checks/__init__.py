"""Checks that exercise notebooks call; the autograder reports their AssertionErrors.

One module per exercise topic; a notebook's test cell imports the check it runs, in the cell
itself, so that nothing a solution cell binds can stand in for it::

    from dtcourse.checks import check_all_reduce
    check_all_reduce(ring_all_reduce, world_sizes=(2, 3))

* ``dtcourse.checks.memory``: exercise 00 (the bytes of a training step, kind by kind)
* ``dtcourse.checks.collectives``: exercise 01 (ring collectives from send/recv)
* ``dtcourse.checks.data_parallel``: exercise 02 (bucketed, overlapped DDP)
* ``dtcourse.checks.parameter_server``: exercise 03 (an SSP parameter server loop)
* ``dtcourse.checks.mixed_precision``: exercise 04 (a dynamic loss scaler against GradScaler)
* ``dtcourse.checks.checkpointing``: exercise 05 (a checkpointed sequential container)
* ``dtcourse.checks.zero``: exercise 06 (the ZeRO stage-2 step: reduce-scatter, sharded step, all-gather)
* ``dtcourse.checks.pipeline``: exercise 08 (the 1F1B schedule generator, as data)
* ``dtcourse.checks.tensor_parallel``: exercise 09 (Megatron's f and g, column- and row-parallel linear layers)
* ``dtcourse.checks.moe``: exercise 11 (expert parallelism: positions in experts, dispatch and combine)
* ``dtcourse.checks.fault_tolerance``: exercise 12 (a snapshot's save and load: atomic, resumed bit for bit)
* ``dtcourse.checks.common``: running a check on ranks and reporting what went wrong
* ``dtcourse.checks.guard``: what the student's code may call, and what it sent, while it runs

Each ``check_*`` here does three things before the check itself:

1. **Audit** (``dtcourse.grading.audit``) the cells this kernel has run: a notebook that rebinds a
   check's name or changes ``dtcourse.checks``, ``torch.distributed`` or the import system fails
   with a message that names the cell and line.
2. **Fail fast after a deadlock.** A check whose student code deadlocked (timed out) remembers
   that code; a later check that would run it again (the same function, or one that calls it)
   fails at once, instead of waiting out its timeout once more.
3. **Run fresh copies** of the check modules (and the launcher under them), executed anew from
   the files on disk, so that a cell that replaced a function inside ``dtcourse.checks`` changes
   nothing. This package's own ``check_*`` names are sealed (``_seal``): assigning one changes
   nothing the test cells import.

``timeout=None`` means ``$DTCOURSE_CHECK_TIMEOUT`` seconds (20 if unset); the autograder sets it
(``dtcourse grade --check-timeout``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from types import CodeType, FunctionType, MappingProxyType, ModuleType
from typing import Callable

from dtcourse.checks.collectives import FLOATS
from dtcourse.checks.guard import code_objects, reached_functions
from dtcourse.runtime.refuse import is_library_file

__all__ = ["check_model_states", "check_activations",
           "check_ring_exchange", "check_reduce_scatter", "check_all_gather", "check_all_reduce", "FLOATS",
           "check_bucket_assignment", "check_ddp_parity", "check_overlap",
           "check_exactly_once", "check_staleness_bound", "check_sync_parity", "check_hang",
           "check_loss_scaler",
           "check_segment_bounds", "check_checkpoint_gradients", "check_checkpoint_memory",
           "check_zero_gradients", "check_zero_memory", "check_zero_parity", "check_zero_traffic",
           "check_1f1b_valid", "check_1f1b_order", "check_1f1b_run",
           "check_f_and_g", "check_column_parallel", "check_row_parallel", "check_parallel_mlp",
           "check_moe_positions", "check_moe_dispatch", "check_moe_combine",
           "check_snapshot_round_trip", "check_snapshot_atomic", "check_snapshot_size", "check_snapshot_resume"]

# loaded afresh for every check, in this order (each module's imports find the fresh ones before it)
_FRESH = ("dtcourse.runtime.results", "dtcourse.runtime.processes", "dtcourse.runtime.launch",
          "dtcourse.checks.guard", "dtcourse.checks.common")
# what deadlocked in a check, for this kernel: (the student code it ran, what deadlocked where)
_DEADLOCKED: list[tuple[tuple[CodeType, ...], str]] = []


def fresh(topic: str) -> ModuleType:
    """``dtcourse.checks.<topic>`` executed anew from its file, with fresh copies of what it builds on."""
    names = (*_FRESH, f"dtcourse.checks.{topic}")
    saved = {name: sys.modules.get(name) for name in names}
    try:
        for name in names:
            spec = importlib.util.find_spec(name)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module          # so that the next module's imports bind this copy
            spec.loader.exec_module(module)
        return module
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _kernel_history() -> list[tuple[int, str]]:
    """``(execution count, code)`` of the cells this IPython kernel has run, in order ([] outside IPython)."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return [(count, code) for count, code in enumerate(shell.user_ns.get("In", []) if shell else []) if code]


def _audit() -> None:
    from dtcourse.grading.audit import audit_cells, first_line

    history = _kernel_history()
    findings = audit_cells(code for _, code in history)
    if findings:                # named as JupyterLab shows a run cell, [n], and by its first line, as the grader does
        listed = "\n  ".join(f"the cell run as [{history[f.cell][0]}] (it begins {first_line(history[f.cell][1])!r}), "
                             f"line {f.line}: {f.what}" for f in findings[:5])
        raise AssertionError(
            "this notebook reaches into the grading, so no check runs:\n  " + listed + "\nRemove that code "
            "(a check's name must stay the check, and dtcourse.checks, torch.distributed and the import "
            "system must stay as they are), then restart the kernel and run all cells.")


def _student_code(obj: object) -> list[CodeType]:
    """The code objects of a student's function or class, and of the student functions they reach."""
    return [code for f in reached_functions(obj) if not is_library_file(f.__code__.co_filename)
            for code in code_objects(f.__code__)]


def _name(obj: object) -> str:
    return getattr(obj, "__qualname__", getattr(obj, "__name__", type(obj).__name__))


def _isolated(topic: str, name: str) -> Callable:
    original = getattr(importlib.import_module(f"dtcourse.checks.{topic}"), name)

    @functools.wraps(original)
    def check(*args, **kwargs):
        _audit()
        students = [a for a in (*args, *kwargs.values()) if isinstance(a, (FunctionType, type))]
        codes = tuple(code for student in students for code in _student_code(student))
        for earlier, what in _DEADLOCKED:   # this check runs all the code that deadlocked, unchanged
            if earlier and all(any(code is mine for mine in codes) for code in earlier):
                raise AssertionError(
                    f"not run: {what} deadlocked in an earlier check, and this check would run the same code "
                    "again, unchanged. Fix the deadlock and run the cells again; until then each check of that "
                    "code fails at once instead of waiting out its timeout.")
        try:
            result = getattr(fresh(topic), name)(*args, **kwargs)
        except AssertionError as error:
            if getattr(error, "deadlock", False) and codes:
                _DEADLOCKED.append((codes, f"{', '.join(map(_name, students))} (in {name})"))
            raise
        _receipt(name)
        return result
    return check


def _receipt(name: str) -> None:
    """Leave a receipt: the grader gives a cell its points only if every check it calls left one while it ran,
    so a check that a cell's code was rewritten not to call (IPython's input transformers, say) earns nothing."""
    from dtcourse.grading import RECEIPTS

    path = os.environ.get(RECEIPTS)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(name + "\n")


check_model_states = _isolated("memory", "check_model_states")
check_activations = _isolated("memory", "check_activations")
check_ring_exchange = _isolated("collectives", "check_ring_exchange")
check_reduce_scatter = _isolated("collectives", "check_reduce_scatter")
check_all_gather = _isolated("collectives", "check_all_gather")
check_all_reduce = _isolated("collectives", "check_all_reduce")
check_bucket_assignment = _isolated("data_parallel", "check_bucket_assignment")
check_ddp_parity = _isolated("data_parallel", "check_ddp_parity")
check_overlap = _isolated("data_parallel", "check_overlap")
check_exactly_once = _isolated("parameter_server", "check_exactly_once")
check_staleness_bound = _isolated("parameter_server", "check_staleness_bound")
check_sync_parity = _isolated("parameter_server", "check_sync_parity")
check_hang = _isolated("parameter_server", "check_hang")
check_loss_scaler = _isolated("mixed_precision", "check_loss_scaler")
check_segment_bounds = _isolated("checkpointing", "check_segment_bounds")
check_checkpoint_gradients = _isolated("checkpointing", "check_checkpoint_gradients")
check_checkpoint_memory = _isolated("checkpointing", "check_checkpoint_memory")
check_zero_gradients = _isolated("zero", "check_zero_gradients")
check_zero_memory = _isolated("zero", "check_zero_memory")
check_zero_parity = _isolated("zero", "check_zero_parity")
check_zero_traffic = _isolated("zero", "check_zero_traffic")
check_1f1b_valid = _isolated("pipeline", "check_1f1b_valid")
check_1f1b_order = _isolated("pipeline", "check_1f1b_order")
check_1f1b_run = _isolated("pipeline", "check_1f1b_run")
check_f_and_g = _isolated("tensor_parallel", "check_f_and_g")
check_column_parallel = _isolated("tensor_parallel", "check_column_parallel")
check_row_parallel = _isolated("tensor_parallel", "check_row_parallel")
check_parallel_mlp = _isolated("tensor_parallel", "check_parallel_mlp")
check_moe_positions = _isolated("moe", "check_moe_positions")
check_moe_dispatch = _isolated("moe", "check_moe_dispatch")
check_moe_combine = _isolated("moe", "check_moe_combine")
check_snapshot_round_trip = _isolated("fault_tolerance", "check_snapshot_round_trip")
check_snapshot_atomic = _isolated("fault_tolerance", "check_snapshot_atomic")
check_snapshot_size = _isolated("fault_tolerance", "check_snapshot_size")
check_snapshot_resume = _isolated("fault_tolerance", "check_snapshot_resume")


def _seal() -> None:
    """Make this package's ``check_*`` names always give the checks defined above.

    A test cell's ``from dtcourse.checks import check_x`` reads the name through the module's
    class; a cell that assigns, deletes or ``setattr``s a check name, or writes it into the
    module's ``__dict__``, changes nothing the test cells see (the audit then fails the notebook).
    """
    genuine = MappingProxyType({name: value for name, value in globals().items() if name.startswith("check_")})

    class SealedChecks(ModuleType):
        def __getattribute__(self, name: str):
            if name in genuine:
                return genuine[name]
            return super().__getattribute__(name)

        def __setattr__(self, name: str, value) -> None:
            if name in genuine:
                raise AttributeError(f"dtcourse.checks.{name} is a check and cannot be replaced")
            super().__setattr__(name, value)

        def __delattr__(self, name: str) -> None:
            if name in genuine:
                raise AttributeError(f"dtcourse.checks.{name} is a check and cannot be deleted")
            super().__delattr__(name)

    sys.modules[__name__].__class__ = SealedChecks


_seal()
