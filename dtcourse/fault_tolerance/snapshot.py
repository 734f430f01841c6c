"""Snapshots that resume a run bit for bit: model, optimizer, every generator's state, the data position, the step.

A restart (``torchrun --max-restarts``, or ``dtcourse.launch(max_restarts=)``) only starts the workers
again, from the top of the script; it restores nothing. What lets the run continue exactly is what the
script saved and loads itself (PyTorch's torchrun documentation asks the same of an elastic script):

* the model's and the optimizer's ``state_dict`` (AdamW's moments and step count included);
* every random-number generator that the run draws from: Python's ``random``, NumPy's, torch's CPU
  generator and, where CUDA is in use, each GPU's. Dropout masks, data shuffles and augmentation depend
  on them; without them the resumed run draws different numbers and drifts away from the original;
* where the data stands: the step, the sampler (its ``state_dict``, or a ``DistributedSampler``'s epoch),
  and anything else the caller passes (the position within the epoch, when it does not follow from the step).

Each rank writes its own file, ``<directory>/step-000012/rank-1.pt``, to a temporary name and renames it
(``os.replace`` is atomic on POSIX), so a crash while saving leaves a stray temporary file, never a
half-written snapshot under the real name. Then rank 0 writes ``COMPLETE`` (also by rename) with the world
size, the model's parameter names and shapes and each rank's file's SHA-256: a snapshot without it is
ignored, and one whose file no longer matches its checksum is skipped for the one before, on every rank
alike. Example, on every rank (DDP or one process)::

    snaps = Snapshots("runs/demo", keep=2)           # ZeRO keeps its optimizer: snaps.save(step, zero_model)
    start = snaps.restore(model, optimizer)           # None on the first attempt, else the step to resume from
    for step in range(0 if start is None else start.step, steps):
        train_one_step(step)
        if step % every == every - 1:
            snaps.save(step + 1, model, optimizer, epoch=epoch)
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["Snapshots", "Resumed", "rng_state", "set_rng_state", "restart_count", "SnapshotError"]

MARKER = "COMPLETE"


class SnapshotError(ValueError):
    """A snapshot that cannot be resumed from as it is: another model, another world size."""


def restart_count() -> int:
    """Which attempt this worker belongs to: 0 first, then 1, 2, ... (torchrun's ``TORCHELASTIC_RESTART_COUNT``,
    which ``dtcourse.launch(max_restarts=)`` sets too)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def rng_state() -> dict[str, Any]:
    """Every generator's state: Python's, NumPy's (if imported), torch's CPU one and each GPU's (if CUDA is on)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put every generator back where ``rng_state`` found it."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy
        numpy.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def model_signature(model: nn.Module) -> list[tuple[str, list[int]]]:
    """The parameter names and shapes a snapshot was taken from: what ``restore`` checks before loading.

    A model that keeps only this rank's part (``dtcourse.zero.ZeRO``) gives its ``shard_layout()``."""
    if hasattr(model, "shard_layout"):
        return [(n, list(s)) for n, s in model.shard_layout()]
    return [(n, list(t.shape)) for n, t in model.state_dict().items()]


def _model_state(model: nn.Module) -> Any:
    """``state_dict()``, or this rank's part (and its optimizer's) for a sharded model with ``shard_state()``."""
    return model.shard_state() if hasattr(model, "shard_state") else model.state_dict()


def _sampler_state(sampler: Any) -> dict[str, Any]:
    if hasattr(sampler, "state_dict"):
        return {"state_dict": sampler.state_dict()}
    if hasattr(sampler, "epoch"):
        return {"epoch": sampler.epoch}
    raise TypeError(f"Snapshots: a {type(sampler).__name__} has neither state_dict() nor an epoch; save where it "
                    "stands yourself, as an extra (save(step, model, optimizer, position=...)).")


def _load_sampler_state(sampler: Any, state: dict[str, Any]) -> None:
    if "state_dict" in state:
        sampler.load_state_dict(state["state_dict"])
    else:
        sampler.set_epoch(state["epoch"])


def _load_model_state(model: nn.Module, state: Any) -> None:
    if hasattr(model, "load_shard_state"):
        model.load_shard_state(state)
    else:
        model.load_state_dict(state)


@dataclass(frozen=True)
class Resumed:
    """What ``Snapshots.restore`` found: the step to continue from, the snapshot's folder, the caller's extras."""

    step: int
    path: Path
    extra: dict[str, Any] = field(default_factory=dict)


def _rank_world(group) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, flush it to disk, then rename it to ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)                      # atomic: readers see the old file or the whole new one


class Snapshots:
    """Per-rank snapshots in ``directory``, the newest ``keep`` kept; see the module docstring.

    Call ``save`` and ``restore`` on every rank of ``group`` (None: the default group, or one process).
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 2, group: dist.ProcessGroup | None = None):
        if keep < 1:
            raise ValueError(f"Snapshots: keep = {keep}; keep at least the newest snapshot (keep=1), better 2.")
        self.directory, self.keep, self.group = Path(directory), keep, group
        self.rank, self.world = _rank_world(group)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise ValueError(f"Snapshots: cannot write to {str(self.directory)!r} ({err.strerror}); choose a "
                             "directory this job may write to, on storage every restart can read.") from None

    # ------------------------------------------------------------------ save
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             sampler: Any = None, **extra: Any) -> Path:
        """Write this rank's snapshot of ``step`` (the step to resume from), then mark it complete.

        ``sampler``: its ``state_dict()`` if it has one, else its ``epoch`` (a ``DistributedSampler``, whose order
        depends on the seed and the epoch alone); ``extra``: anything else to get back (a position, a log).
        """
        folder = self.directory / f"step-{step:06d}"
        folder.mkdir(exist_ok=True)
        state = {"step": step, "model": _model_state(model), "rng": rng_state(), "extra": extra,
                 "optimizer": None if optimizer is None else optimizer.state_dict(),
                 "sampler": None if sampler is None else _sampler_state(sampler)}
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        _atomic_write(folder / f"rank-{self.rank}.pt", data)
        digests = self._gather(hashlib.sha256(data).hexdigest())
        if self.rank == 0:                     # every rank's file is on disk: only now is the snapshot whole
            marker = {"step": step, "world_size": self.world, "sha256": digests, "model": model_signature(model)}
            _atomic_write(folder / MARKER, json.dumps(marker).encode())
            self._prune()
        self._barrier()
        return folder

    # ------------------------------------------------------------------ restore
    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                sampler: Any = None) -> Resumed | None:
        """Load the newest complete snapshot that every rank can read; None if there is none.

        A snapshot whose file fails its checksum (cut short, overwritten) is skipped, with a warning, for the
        one before it. One of another world size or another model raises ``SnapshotError`` saying what to do.
        """
        for folder in self._complete():
            marker = json.loads((folder / MARKER).read_text())
            self._check(marker, folder, model)
            state = self._read(folder, marker)
            if not self._everyone(state is not None):
                print(f"[rank {self.rank}] snapshot {folder.name} is damaged on some rank; trying the one before",
                      file=sys.stderr)
                continue
            _load_model_state(model, state["model"])
            if optimizer is not None and state["optimizer"] is not None:
                optimizer.load_state_dict(state["optimizer"])
            set_rng_state(state["rng"])
            if sampler is not None and state.get("sampler") is not None:
                _load_sampler_state(sampler, state["sampler"])
            return Resumed(state["step"], folder, state["extra"])
        return None

    def _complete(self) -> list[Path]:
        return sorted((p for p in self.directory.glob("step-*") if (p / MARKER).exists()), reverse=True)

    def _check(self, marker: dict, folder: Path, model: nn.Module) -> None:
        if marker["world_size"] != self.world:
            raise SnapshotError(
                f"{folder} was saved by {marker['world_size']} ranks and {self.world} are loading it: each rank's "
                "file holds that rank's state. Resume with the same number of ranks, or reshard through a "
                "torch.distributed.checkpoint save (dtcourse.fault_tolerance.sharded), which any world size loads.")
        mine = model_signature(model)
        if [tuple(x) for x in marker["model"]] != [tuple(x) for x in mine]:
            theirs = {n: s for n, s in marker["model"]}
            diff = next((f"{n}: {theirs.get(n)} saved, {s} now" for n, s in mine if theirs.get(n) != s),
                        f"the snapshot has {len(theirs)} tensors, the model {len(mine)}")
            raise SnapshotError(f"{folder} is a snapshot of another model ({diff}): resume with the model it "
                                "was saved from, or start this one from a fresh directory.")

    def _read(self, folder: Path, marker: dict) -> dict | None:
        path = folder / f"rank-{self.rank}.pt"
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if hashlib.sha256(data).hexdigest() != marker["sha256"][self.rank]:
            return None
        return torch.load(io.BytesIO(data), weights_only=False)

    def _prune(self) -> None:
        for old in self._complete()[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ the ranks agree
    def _gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (pickled: works on gloo and nccl alike)."""
        if self.world == 1:
            return [value]
        out: list = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def _everyone(self, ok: bool) -> bool:
        return all(self._gather(ok))

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)
