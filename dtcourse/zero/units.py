"""Which parameters travel together: the model cut into units, and the checks made before cutting it.

A unit is a block of the model (a transformer layer, a ``Linear``) whose parameters are flattened
into one vector, reduced together and, in stage 3, gathered together just before the block runs.
The unit is ZeRO-3's granularity of memory: the gathered parameters of one or two units are all
that is ever full. By default every child module that holds parameters is a unit, looking inside
containers (``Sequential``, ``ModuleList``, ``ModuleDict``), which is the per-block wrapping FSDP's
users write by hand::

    default_units(MLP((6, 10, 12, 7)))     # ['net.0', 'net.2', 'net.4']
    default_units(GPT(config))             # ['wte', 'wpe', 'blocks.0', 'blocks.1', 'ln_f', 'lm_head']

Parameters that belong to no unit form the root unit ``""``, gathered for the whole forward and
backward. A parameter shared by two units (tied weights) goes to the root too: both units need it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from dtcourse.runtime.observe import label
from dtcourse.zero.communication import Communicator, Handle
from dtcourse.zero.flat import FlatShard

__all__ = ["default_units", "assign_parameters", "build_units", "Unit", "ROOT"]

ROOT = ""                                           # the root unit's name
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def default_units(module: nn.Module) -> list[str]:
    """Names of the children holding parameters, containers opened, in registration order."""
    units: list[str] = []

    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in parent.named_children():
            if isinstance(child, CONTAINERS):
                visit(child, f"{prefix}{name}.")
            elif next(child.parameters(), None) is not None:
                units.append(f"{prefix}{name}")

    visit(module, "")
    return units


def assign_parameters(module: nn.Module, units: list[str]) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """``{unit: [(name, parameter), ...]}`` for the root ``""`` and each unit, each parameter once.

    A parameter belongs to the innermost unit that contains every name it has; if no unit contains
    all of them (a weight tied across units), it belongs to the root. Its name is the first one
    ``module.named_parameters()`` gives, as in the plain model.
    """
    modules = dict(module.named_modules())
    for name in units:
        if name == ROOT or name not in modules:
            raise ValueError(f"ZeRO: units names submodules of the model, and {name!r} is not one; "
                             f"the default would be {default_units(module)}.")
        if isinstance(modules[name], (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(f"ZeRO: unit {name!r} is a {type(modules[name]).__name__}, which forward never "
                             "calls, so its parameters would never be gathered; name the modules inside it "
                             f"(e.g. '{name}.0') instead.")
    if len(set(units)) != len(units):
        raise ValueError(f"ZeRO: units lists a module twice: {units}.")
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)

    def innermost(name: str) -> str:
        holders = [u for u in units if name.startswith(u + ".")]
        return max(holders, key=len, default=ROOT)

    assigned: dict[str, list[tuple[str, nn.Parameter]]] = {u: [] for u in [ROOT, *units]}
    for name, p in module.named_parameters():
        owners = {innermost(n) for n in names[id(p)]}
        assigned[owners.pop() if len(owners) == 1 else ROOT].append((name, p))
    return assigned


@dataclass(eq=False)
class Unit:
    """A block of the model and its flat shards (trainable, frozen), gathered and freed together.

    ``state`` is ``"full"`` (always, in stages 0-2), ``"free"`` (only this rank's parts are held) or
    ``"gathering"`` (all-gathers in flight, in ``pending``).
    """

    name: str
    module: nn.Module
    flats: list[FlatShard]
    state: str = "full"
    pending: list[Handle] = field(default_factory=list)

    def gather(self, comm: Communicator, async_op: bool) -> int:
        """Start all-gathering every flat into its ``full``; returns the bytes this allocates."""
        for flat in self.flats:
            flat.allocate()
            with label(self.name):      # an annotation, as FSDP2's record_function: names the unit in traces
                # sends (N-1)/N * full.nbytes: this rank's part to every other rank
                self.pending.append(comm.all_gather(flat.full, flat.shard, async_op))
        self.state = "gathering"
        return sum(flat.full.nbytes for flat in self.flats)

    def wait(self) -> None:
        """Finish a gather: wait for its all-gathers, then point the parameters into the gathered flats."""
        for handle in self.pending:
            handle.wait()
        if self.state == "gathering":
            self.pending, self.state = [], "full"
            for flat in self.flats:
                flat.use_views()

    def free(self) -> int:
        """Release every flat's ``full`` (after any gather in flight); returns the bytes released."""
        self.wait()
        for flat in self.flats:
            flat.free()
        self.state = "free"
        return sum(flat.full.nbytes for flat in self.flats)


def build_units(module: nn.Module, names: list[str], world: int, rank: int | None, dtype: torch.dtype,
                keep_full: bool) -> list[Unit]:
    """The root unit (if it has parameters) and each named unit, with one flat shard per kind of parameter.

    Trainable and frozen parameters go to separate flats: a frozen one has no gradient, master or
    optimizer state, but in stage 3 it is sharded and gathered like the others.
    """
    units = []
    for name, named in assign_parameters(module, names).items():
        kinds = [[(n, p) for n, p in named if p.requires_grad], [(n, p) for n, p in named if not p.requires_grad]]
        flats = [FlatShard([n for n, _ in kind], [p for _, p in kind], world, rank, dtype, keep_full)
                 for kind in kinds if kind]
        if flats:
            units.append(Unit(name, module.get_submodule(name), flats, "full" if keep_full else "free"))
    return units
