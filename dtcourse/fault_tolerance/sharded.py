"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): each rank writes its shards, any world size reads.

A per-rank snapshot (``snapshot.py``) is the fastest to write and to read back, but only the same number of
ranks can load it: rank r's file holds rank r's shards. DCP writes each shard with its place in the full
tensor (the DTensor placements of an FSDP2 or tensor-parallel model), so a job restarted on 4 ranks can load
what 2 ranks saved: each rank reads the pieces of the saved shards that overlap its own. ``get_state_dict``
and ``set_state_dict`` (``torch.distributed.checkpoint.state_dict``) give the model's and the optimizer's
state in that form, the optimizer's keyed by parameter name rather than by position.

``save(..., blocking=False)`` is ``dcp.async_save``: the state is first copied to CPU memory (the
"staging"), then written by a background thread while training goes on; the returned future must be
waited on before the next save. That thread runs collectives of its own (the plan, the metadata), so it needs a
process group of its own (``group=dist.new_group(backend="gloo")``, made once): sharing the training's, a DDP
all-reduce or a barrier beside it can pair with the wrong collective and hang (it did, on 2 gloo ranks).
Example, on every rank of an FSDP2 job::

    save(directory, model, optimizer, step=100)          # every rank writes its shards; rank 0 the metadata
    step = load(directory, model, optimizer)             # 100, on any number of ranks

A ``dtcourse.zero.ZeRO`` model (lesson 06) is saved the same way, ``save(directory, zero_model, step=100)``: its
flats become DTensors (``_zero_state``), so what 2 ranks saved, 4 load.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from dtcourse.fault_tolerance.snapshot import SnapshotError

__all__ = ["save", "load"]


def _zero_state(model: nn.Module, step: int) -> dict:
    """A ``dtcourse.zero.ZeRO`` model as DCP sees an FSDP2 one: each flat (without its padding) a DTensor
    ``Shard(0)`` over the ranks, its optimizer states the same, so any number of ranks can load it.

    ZeRO's rank r owns [r s, (r+1) s) of a flat padded to N s, s = ceil(Ψ/N): the unpadded flat cut as
    ``torch.chunk`` cuts it, which is DTensor's layout, so each part (less the padding) is the local shard.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    mesh = DeviceMesh.from_group(model.group or dist.group.WORLD, "cpu")
    optimizer = model.optimizer
    if not optimizer.state:          # no step yet: a step at lr 0 on zero gradients makes the states, changing nothing
        lrs = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = 0.0
            for p in g["params"]:
                p.grad = torch.zeros_like(p)
        optimizer.step()
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
            for p in g["params"]:
                p.grad = None
    params, moments = {}, {}
    for names, part, numel, start in model.owned_parts():
        keep = max(0, min(part.numel(), numel - start))                  # this rank's elements, less the padding

        def sharded(t: torch.Tensor) -> DTensor:
            return DTensor.from_local(t[:keep], mesh, [Shard(0)], run_check=False, shape=(numel,), stride=(1,))
        params[names] = sharded(part.data)
        for key, value in optimizer.state.get(part, {}).items():
            moments[f"{names}/{key}"] = sharded(value) if value.dim() else value   # step counts: one number
    return {"model": params, "optimizer": moments, "step": torch.tensor(step)}


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int) -> dict:
    if hasattr(model, "owned_parts"):
        return _zero_state(model, step)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return {"model": get_model_state_dict(model), "step": torch.tensor(step)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd, "step": torch.tensor(step)}


def save(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         step: int = 0, blocking: bool = True, group: dist.ProcessGroup | None = None) -> Future | None:
    """Write ``model``'s (and ``optimizer``'s) shards to ``directory`` with DCP; every rank calls it.

    ``blocking=False``: ``dcp.async_save`` over ``group``, a process group kept for checkpoints (module
    docstring); returns the future to ``.result()`` before the next save.
    """
    if not blocking and group is None and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("sharded.save(blocking=False) runs collectives from a background thread: give it a process "
                         "group of its own, made once on every rank, group=dist.new_group(backend='gloo'), so they "
                         "cannot pair with the training's collectives.")
    Path(directory).mkdir(parents=True, exist_ok=True)
    state = _state(model, optimizer, step)
    if blocking:
        dcp.save(state, checkpoint_id=str(directory), process_group=group)
        return None
    return dcp.async_save(state, checkpoint_id=str(directory), process_group=group)


def _tensors(state, prefix: str = ""):
    """(key, tensor) for every tensor of a nested state, keyed as DCP flattens it ("model.wte.weight")."""
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else ()
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            yield name, value
        else:
            yield from _tensors(value, f"{name}.")


def _check_shapes(directory: str | os.PathLike, state: dict) -> None:
    """Raise a ``SnapshotError`` naming the first tensor whose saved shape is not this model's, on every rank
    alike (each reads the same metadata and compares the same global shapes) and before any collective."""
    saved = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    for name, tensor in _tensors(state):
        theirs = getattr(saved.get(name), "size", None)
        if theirs is not None and tuple(theirs) != tuple(tensor.shape):   # a DTensor's shape is the global one
            raise SnapshotError(f"{directory} is a checkpoint of another model ({name}: {list(theirs)} saved, "
                                f"{list(tensor.shape)} now): load it into the model it was saved from, or start "
                                "this one from a fresh directory.")


def load(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Read ``directory`` into ``model`` (and ``optimizer``), resharded to this job's ranks; return the step.

    A checkpoint of another model raises ``SnapshotError`` (a ``ValueError``) naming the first tensor that differs,
    as ``Snapshots.restore`` does, rather than DCP's ``CheckpointException`` with every rank's traceback."""
    if not (Path(directory) / ".metadata").exists():
        raise FileNotFoundError(f"{directory} holds no DCP checkpoint (no .metadata): save one there first with "
                                "dtcourse.fault_tolerance.sharded.save, on every rank.")
    state = _state(model, optimizer, 0)
    _check_shapes(directory, state)
    try:
        dcp.load(state, checkpoint_id=str(directory))            # fills the tensors in place, resharded
    except CheckpointException as err:                           # a BaseException: `except Exception` misses it
        first = next(iter(err.failures.values()), err)           # each rank's error; the ranks fail alike
        raise SnapshotError(f"{directory} could not be loaded into this model: {first}. Load it into the model "
                            "(and optimizer) it was saved from, or start this one from a fresh directory.") from None
    if hasattr(model, "owned_parts"):                            # ZeRO: its parts and states were the targets
        model.refresh()
    elif optimizer is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return int(state["step"])
