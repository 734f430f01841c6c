"""ZeRO, stages 0 to 3, on one flat-shard structure: the stage only decides what stays sharded.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(arXiv 1910.02054); stage 3 as FSDP builds it (Zhao et al., arXiv 2304.11277). Each unit's
parameters are one flat vector padded to a multiple of N (``flat.py``); rank r owns part r of it
and steps only that part, with the fp32 master and optimizer states of that part alone.

=====  ==========================  =================================================================
stage  kept full on every rank     collectives, and when
=====  ==========================  =================================================================
0      everything                  after backward: all-reduce each unit's gradient (2Ψ(N-1)/N)
1      parameters, gradients       after backward: reduce-scatter each unit's gradient; after the
                                   step: all-gather the updated parts (Ψ(N-1)/N each)
2      parameters                  during backward, from the gradient hooks: reduce-scatter a unit
                                   as soon as its gradients are complete, then drop them; after
                                   the step: all-gather (Ψ(N-1)/N each)
3      nothing                     before a unit's forward and again before its backward:
                                   all-gather it, and free it after; reduce-scatter as stage 2
                                   (3Ψ(N-1)/N in all)
=====  ==========================  =================================================================

Stage 3 prefetches (``prefetch=True``): when a unit starts, the all-gather of the unit that runs
next (forward order, or reversed in backward) is issued asynchronously and overlaps this unit's
compute. ``reshard_after_forward=False`` keeps each unit gathered from its forward to its
backward: stage 2's parameter memory with stage 3's structure, and 2Ψ(N-1)/N bytes.

Gradient accumulation: several forward/backward passes (micro-batches) before one ``step()``, each
loss divided by their number, as with ``torch.nn.parallel.DistributedDataParallel``. By default every
backward reduces what it produced and the reduced parts add up (stage 2-3: ``(N-1)/N·Ψ`` sent per
micro-batch, a rank holds ``Ψ/N`` gradients); under ``no_sync()`` (FSDP2's
``set_requires_gradient_sync(False)``) a backward only adds to full, unreduced gradients kept on the rank
(``Ψ`` of them), and the next synchronised backward reduces the sum once. Stages 0-1 keep full gradients
anyway, so ``no_sync()`` costs them no memory; stage 2-3 trade ``Ψ(N-1)/N`` bytes of memory for
``(M-1)·Ψ(N-1)/N`` bytes of traffic.

Mixed precision is lesson 04's copy recipe, sharded: ``precision=Recipe(torch.bfloat16)``
computes with 16-bit parameters, steps fp32 masters of this rank's part, and ``reduce_dtype``
chooses the dtype the gradients are summed in (default: the compute dtype)::

    model = ZeRO(MLP(seed=0), stage=3, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    loss_fn(model(x), y).backward(); model.step(); model.zero_grad()
    model.full_parameters()       # {name: full tensor}, the same on every rank
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map

from dtcourse.mixed_precision import Recipe
from dtcourse.zero.validate import MARK, build_optimizer, check_arguments, check_module, check_same_model
from dtcourse.runtime.compat import all_gather_single
from dtcourse.runtime.observe import label
from dtcourse.zero.communication import Communicator, Handle
from dtcourse.zero.flat import FlatShard
from dtcourse.zero.memory import ModelStateBytes, held_bytes
from dtcourse.zero.units import ROOT, Unit, build_units, default_units

__all__ = ["ZeRO"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class ZeRO(nn.Module):
    """``module`` trained with ZeRO ``stage`` over ``group``; ``optimizer(params)`` builds the optimizer.

    units: names of the submodules gathered one at a time (default ``default_units(module)``).
    comm: ``"backend"`` (torch.distributed, asynchronous) or ``"ring"`` (lesson 01's ring, synchronous).
    prefetch, reshard_after_forward: stage 3's overlap and memory switches (module docstring).
    precision: lesson 04's ``Recipe``; a 16-bit ``compute`` runs forward and backward in 16 bits.
    reduce_dtype: the dtype gradients are summed in (None: the compute dtype).
    Every parameter must start in fp32 and equal on every rank. Buffers are not sharded: every rank
    keeps its own, started from rank 0's. Each unit's collectives run under ``label(unit name)``, an
    annotation that ``dtcourse.runtime.observe`` records (as FSDP2's ``record_function`` ranges in a trace).
    """

    def __init__(self, module: nn.Module, stage: int, optimizer: OptimizerFactory,
                 group: dist.ProcessGroup | None = None, *, units: Iterable[str] | None = None,
                 comm: str = "backend", prefetch: bool = True, reshard_after_forward: bool = True,
                 precision: Recipe = Recipe(), reduce_dtype: torch.dtype | None = None):
        check_arguments(stage, optimizer, precision, reduce_dtype)
        check_module(module, ZeRO)
        super().__init__()
        self.module, self.stage, self.group = module, stage, group
        self.comm = Communicator(comm, group)
        self._async = comm == "backend"           # the ring is synchronous: a prefetch gathers at once
        self.world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.compute_dtype, self.reduce_dtype = precision.compute, reduce_dtype or precision.compute
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        check_same_model(module, group)
        with torch.no_grad():
            for b in module.buffers():
                dist.broadcast(b, group_src=0, group=group)       # every other rank receives b.nbytes
        self._names = [n for n, _ in module.named_parameters()]
        # stage 0 owns every part (rank None); stage 3 keeps only its part of the parameters
        self.units = build_units(module, default_units(module) if units is None else list(units), self.world,
                                 None if stage == 0 else rank, self.compute_dtype, keep_full=stage < 3)
        self._grad_is_view = stage <= 1 and self.reduce_dtype == self.compute_dtype
        for unit in self.units:
            for flat in unit.flats:
                if flat.trainable:
                    self._prepare_gradients(unit, flat)
            if stage == 3 and unit.name != ROOT:
                unit.module.register_forward_pre_hook(lambda m, args, unit=unit: self._pre_forward(unit))
                unit.module.register_forward_hook(lambda m, args, out, unit=unit: self._post_forward(unit, out))
        self.optimizer = build_optimizer(optimizer, [f.master for f in self._flats(trainable=True)])
        self._order = [u for u in self.units if u.name != ROOT]     # forward order: declared, then as run
        self._ran: list[Unit] = []
        self._in_backward = self._has_grads = False
        self._sync, self._rescaled = True, False  # reduce at each backward; stage 1's parts made ready to add to
        self._arrived: set[int] = set()
        self._reduced: set[int] = set()           # ids of the flats reduced since zero_grad (their grads add up)
        self._reductions: list[tuple[FlatShard, Handle, torch.Tensor, torch.Tensor]] = []
        self._now = {"gathered": 0, "buckets": 0}
        self._peak = dict(self._now)
        setattr(module, MARK, True)

    def _prepare_gradients(self, unit: Unit, flat: FlatShard) -> None:
        """Where this flat's reduced gradient lives, and the hook that reduces it."""
        if self.stage <= 1:       # the full gradient stays: autograd adds into views of one flat buffer
            flat.grad_full = torch.zeros(flat.padded, dtype=self.compute_dtype, device=flat.shard.device)
            flat.attach_grad_views()
        lo, hi = flat.owned
        flat.grad = flat.grad_full[lo:hi] if self._grad_is_view else \
            torch.zeros(hi - lo, dtype=self.reduce_dtype, device=flat.shard.device)   # (s,), or (N·s,) in stage 0
        for p in flat.params:
            p.register_post_accumulate_grad_hook(lambda p, unit=unit, flat=flat: self._grad_ready(unit, flat, p))

    # ------------------------------------------------------------------ #
    # Forward: stage 3 gathers a unit just before it runs and frees it after
    # ------------------------------------------------------------------ #
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.stage <= 1:
            for flat in self._flats(trainable=True):
                flat.attach_grad_views()          # again, in case someone set p.grad to None
            if self.stage == 1 and self._grad_is_view and self._reduced and not self._rescaled:
                self._ready_to_add()
        if self.stage == 3:
            for unit in self.units:
                self._reshard(unit)               # left gathered by a forward that had no backward
            self._ran = []
            root = self.units[0] if self.units[0].name == ROOT else None
            if root is not None:                  # the root's parameters are used until the end
                self._unshard(root)
            if self.prefetch and self._order:
                self._prefetch(self._order[0])
        if self.compute_dtype != torch.float32:   # 16-bit parameters take 16-bit inputs
            args, kwargs = _cast_floats((args, kwargs), self.compute_dtype)
        out = self.module(*args, **kwargs)
        if self.stage == 3:
            self._order = list(dict.fromkeys(self._ran)) or self._order
            if not torch.is_grad_enabled() and root is not None:
                self._reshard(root)
        # as lesson 04's Trainer: the loss always sees fp32 outputs
        return out if self.compute_dtype == torch.float32 else _cast_floats(out, torch.float32)

    def _pre_forward(self, unit: Unit) -> None:
        self._ran.append(unit)
        self._unshard(unit)
        if self.prefetch:
            self._prefetch(_neighbour(self._order, unit, +1))    # overlaps this unit's forward

    def _post_forward(self, unit: Unit, out: Any) -> None:
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self._reshard(unit)
        if torch.is_grad_enabled():   # the gradient of the output arrives just before the unit's backward
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, unit=unit: self._pre_backward(unit))

    def _pre_backward(self, unit: Unit) -> None:
        self._backward_starts()
        self._unshard(unit)
        if self.prefetch:
            self._prefetch(_neighbour(self._order, unit, -1))   # overlaps this unit's backward

    def _unshard(self, unit: Unit) -> None:
        """Make ``unit`` full: wait for its prefetch, or all-gather it now."""
        if unit.state == "free":
            self._count("gathered", unit.gather(self.comm, async_op=False))
        unit.wait()

    def _prefetch(self, unit: Unit | None) -> None:
        if unit is not None and unit.state == "free":
            self._count("gathered", unit.gather(self.comm, self._async))

    def _reshard(self, unit: Unit) -> None:
        if self.stage == 3 and unit.state != "free":
            self._count("gathered", -unit.free())

    # ------------------------------------------------------------------ #
    # Backward: gradients reduced from the hooks (stages 2-3) or after backward (stages 0-1)
    # ------------------------------------------------------------------ #
    def _backward_starts(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _grad_ready(self, unit: Unit, flat: FlatShard, p: nn.Parameter) -> None:
        self._backward_starts()
        self._arrived.add(id(p))
        flat.ready += 1
        if self.stage >= 2 and flat.ready == len(flat.params):
            if not self._sync:                  # no_sync(): add to this flat's full, unreduced gradient
                self._keep_unreduced(flat)
            else:
                self._reduce(unit, flat)
            if self.stage == 3 and all(f.trainable and f.ready == len(f.params) for f in unit.flats):
                self._reshard(unit)   # nothing needs its parameters now (a frozen one may: kept to the end)

    def _reduce(self, unit: Unit, flat: FlatShard) -> None:
        """Start the reduction of ``flat``'s gradient; at most one more stays in flight in stages 2-3."""
        if flat.grad_full is not None:          # stages 0-1: the full gradient autograd accumulated
            bucket = flat.grad_full if self._grad_is_view else flat.grad_full.to(self.reduce_dtype)
        else:                                   # stages 2-3: the unit's gradients, moved out of p.grad
            bucket = flat.gradient_bucket(self.reduce_dtype)                   # (N·s,)
            if flat.unreduced is not None:      # plus what the micro-batches under no_sync() added up
                bucket += flat.unreduced
                self._count("buckets", -flat.unreduced.nbytes)
                flat.unreduced = None
        if bucket is not flat.grad_full:
            self._count("buckets", bucket.nbytes)
        with label(unit.name):
            if self.stage == 0:                 # sends 2(N-1)/N * bucket.nbytes
                out, handle = bucket, self.comm.all_reduce(bucket, self._async)
            else:                               # sends (N-1)/N * bucket.nbytes; out may not alias bucket
                adds = self.stage >= 2 and id(flat) in self._reduced     # a later micro-batch: adds to flat.grad
                out = torch.empty_like(flat.grad) if self._grad_is_view or adds else flat.grad
                handle = self.comm.reduce_scatter(out, bucket, self._async)
        self._reductions.append((flat, handle, bucket, out))
        while self.stage >= 2 and len(self._reductions) > 1:
            self._complete(*self._reductions.pop(0))

    def _complete(self, flat: FlatShard, handle: Handle, bucket: torch.Tensor, out: torch.Tensor) -> None:
        handle.wait()
        if self.stage >= 2 and id(flat) in self._reduced:
            flat.grad.add_(out.div_(self.world))    # this micro-batch's mean, added to the earlier ones'
        else:
            if out.data_ptr() != flat.grad.data_ptr():
                flat.grad.copy_(out)
            flat.grad.div_(self.world)          # sum -> mean over ranks
        self._reduced.add(id(flat))
        if bucket is not flat.grad_full:
            self._count("buckets", -bucket.nbytes)

    def _finish_backward(self) -> None:
        """Engine callback, after the last gradient and before ``backward()`` returns."""
        try:
            for unit in self.units:
                for flat in unit.flats:       # stages 0-1: everything; 2-3: units some gradient skipped
                    if flat.trainable and (self.stage <= 1 or flat.ready < len(flat.params)):
                        if not self._sync:
                            if self.stage >= 2:
                                self._keep_unreduced(flat)
                        else:
                            self._reduce(unit, flat)   # so that every rank runs the same collectives
            while self._reductions:
                self._complete(*self._reductions.pop(0))
            for unit in self.units:
                self._reshard(unit)
            missing = [n for f in self._flats(trainable=True) for n, p in zip(f.names, f.params)
                       if id(p) not in self._arrived]
            if missing:
                raise RuntimeError(
                    f"ZeRO: parameter(s) {missing} received no gradient in this backward. Each unit's part is "
                    "stepped as one tensor, where a missing gradient could only be a zero one, which AdamW "
                    "would still decay and count, unlike torch, which skips it. Use them in forward, or freeze "
                    "them with requires_grad_(False) before wrapping.")
            self._has_grads = self._has_grads or self._sync
            if self._sync:
                self._rescaled = False
        finally:
            self._in_backward = False
            self._arrived.clear()
            for flat in self._flats(trainable=True):
                flat.ready = 0

    # ------------------------------------------------------------------ #
    # Step: each rank steps its part, then (stages 1-2) everyone gets everyone's
    # ------------------------------------------------------------------ #
    def step(self) -> None:
        """Step this rank's fp32 master part with its reduced gradient; refresh the 16-bit parameters."""
        if not self._has_grads:
            raise RuntimeError("ZeRO.step(): there is no reduced gradient to step with. Run a forward through "
                               "this ZeRO wrapper and loss.backward() first (and zero_grad() after each step); "
                               "with gradient accumulation, run the last micro-batch's backward outside no_sync().")
        for flat in self._flats(trainable=True):
            flat.master.grad = flat.grad if flat.grad.dtype == torch.float32 else flat.grad.float()
        self.optimizer.step()
        handles = []
        with torch.no_grad():
            for unit, flat in [(u, f) for u in self.units for f in u.flats if f.trainable]:
                flat.master.grad = None
                if flat.master.data_ptr() != flat.shard.data_ptr():
                    flat.shard.copy_(flat.master)          # round the fp32 master into the 16-bit part
                if self.stage in (1, 2):                   # sends (N-1)/N * full.nbytes; full is the output
                    with label(unit.name):
                        handles.append(self.comm.all_gather(flat.full, flat.shard.clone(), self._async))
        for handle in handles:
            handle.wait()

    def zero_grad(self) -> None:
        """Forget this step's gradients (stages 0-1 zero the buffer autograd adds into)."""
        for flat in self._flats(trainable=True):
            if flat.grad_full is not None:
                flat.grad_full.zero_()
            if flat.unreduced is not None:
                self._count("buckets", -flat.unreduced.nbytes)
                flat.unreduced = None
            flat.master.grad = None
        self._has_grads = self._rescaled = False
        self._reduced.clear()

    # ------------------------------------------------------------------ #
    # Gradient accumulation: micro-batches before one step
    # ------------------------------------------------------------------ #
    def set_requires_gradient_sync(self, sync: bool) -> None:
        """Whether the next backwards reduce their gradients (FSDP2's switch); ``no_sync()`` sets it for a block."""
        self._sync = bool(sync)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards in this block only add to full, unreduced gradients; the next backward outside it reduces
        their sum once (DDP's ``no_sync``)::

            for x, y in micro_batches[:-1]:
                with model.no_sync():
                    (loss_fn(model(x), y) / m).backward()
            (loss_fn(model(x_last), y_last) / m).backward(); model.step(); model.zero_grad()
        """
        before = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = before

    def reduce_gradients(self) -> None:
        """Reduce now what the backwards under ``no_sync()`` added up, every flat once: a pipeline's last backward
        of this stage has run (torch's ``REDUCE_GRAD``; ``dtcourse.pipeline`` calls it at the stage's STEP)."""
        if self._in_backward:
            raise RuntimeError("ZeRO.reduce_gradients: called during backward; call it once backward has returned.")
        for unit in self.units:
            for flat in unit.flats:
                if flat.trainable:
                    self._reduce(unit, flat)            # stages 2-3: the unreduced sum (zeros if none arrived)
        while self._reductions:
            self._complete(*self._reductions.pop(0))
        self._has_grads, self._rescaled = True, False

    def _keep_unreduced(self, flat: FlatShard) -> None:
        """Stages 2-3 under no_sync(): move this backward's gradients of ``flat`` into its unreduced sum (N·s,)."""
        bucket = flat.gradient_bucket(self.reduce_dtype)
        if flat.unreduced is None:
            flat.unreduced = bucket
            self._count("buckets", bucket.nbytes)
        else:
            flat.unreduced += bucket

    def _ready_to_add(self) -> None:
        """Stage 1 reduced into its full gradient buffer already this step (its part is a view of it), and autograd
        will add the next micro-batch's gradients to that buffer: this rank's part becomes N times its mean and the
        other parts 0, so that the next reduce-scatter, divided by N, gives the earlier mean plus the new one."""
        with torch.no_grad():
            for flat in self._flats(trainable=True):
                lo, hi = flat.owned
                flat.grad_full[lo:hi].mul_(self.world)
                flat.grad_full[:lo].zero_()
                flat.grad_full[hi:].zero_()
        self._rescaled = True

    # ------------------------------------------------------------------ #
    # Looking at it: full tensors, memory, and the parity harness's protocol
    # ------------------------------------------------------------------ #
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, full and fp32, by its name in the plain model: the same on every rank."""
        found = {}
        for flat in self._flats():
            found.update(flat.unflatten(self._whole(flat.master if flat.trainable else flat.shard, flat).float()))
        return {n: found[n] for n in self._names}

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The mean gradient of every trainable parameter, full (empty before backward)."""
        found = {}
        for flat in self._flats(trainable=True) if self._has_grads else []:
            found.update(flat.unflatten(self._whole(flat.grad, flat).float()))
        return {n: found[n] for n in self._names if n in found}

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``dtcourse.parity``'s protocol: forward and backward on this rank's part of the batch."""
        out = self(x)
        loss_fn(out, y).backward()
        return out.detach()

    # ------------------------------------------------------------------ #
    # Snapshots (lesson 12): this rank's part of the state, saved and loaded by the rank itself
    # ------------------------------------------------------------------ #
    def shard_layout(self) -> list[tuple[str, list[int]]]:
        """What this rank's part belongs to: each flat's parameter names and padded size, the stage, N."""
        return [(f"stage {self.stage} of {self.world} ranks", [])] + [
            (",".join(f.names), [f.padded]) for f in self._flats()]

    def shard_state(self) -> dict[str, Any]:
        """This rank's part of the training state: each flat's owned part (the fp32 master where trained) and
        the optimizer's state of those parts. ``dtcourse.fault_tolerance.Snapshots`` saves it per rank."""
        return {"layout": self.shard_layout(), "optimizer": self.optimizer.state_dict(),
                "parts": [(f.master if f.trainable else f.shard).detach().clone() for f in self._flats()]}

    def load_shard_state(self, state: dict[str, Any]) -> None:
        """Put back what ``shard_state`` gave, on the same stage and number of ranks; refresh what is kept full."""
        if [tuple(x) for x in state["layout"]] != [tuple(x) for x in self.shard_layout()]:
            raise ValueError(f"ZeRO.load_shard_state: the state is of {state['layout'][0][0]}, this model is "
                             f"{self.shard_layout()[0][0]} (or other parameters): load it into the same model, "
                             "stage and world size, or reshard through torch.distributed.checkpoint.")
        with torch.no_grad():
            for flat, part in zip(self._flats(), state["parts"]):
                (flat.master if flat.trainable else flat.shard).copy_(part)
        self.refresh()
        self.optimizer.load_state_dict(state["optimizer"])

    def owned_parts(self) -> list[tuple[str, torch.Tensor, int, int]]:
        """(the flat's parameter names, this rank's part of it (the fp32 master where trained), the flat's length
        without padding, where the part starts in it): what a sharded checkpoint stores of this rank."""
        return [(",".join(f.names), f.master if f.trainable else f.shard, f.numel, f.owned[0]) for f in self._flats()]

    def refresh(self) -> None:
        """After the parts were written from outside (a checkpoint): the compute copies from the masters, and,
        where parameters are kept full (stages 1-2), everyone's parts again."""
        with torch.no_grad():
            for flat in self._flats():
                if flat.trainable and flat.master.data_ptr() != flat.shard.data_ptr():
                    flat.shard.copy_(flat.master)          # the 16-bit part from its fp32 master
                if 1 <= self.stage <= 2:                   # kept full: everyone's parts again (N-1)/N * nbytes
                    all_gather_single(flat.full, flat.shard.clone(), group=self.group)

    def gathered_units(self) -> list[str]:
        """Names of the units whose parameters are gathered now, or being gathered."""
        return [u.name for u in self.units if u.state != "free"]

    def memory(self) -> ModelStateBytes:
        """This rank's bytes by kind, padding included (``dtcourse.zero.memory``); the optimizer's
        states exist from its first step on."""
        return held_bytes(self._flats(), self.stage, self.optimizer, self._peak)

    def reset_peaks(self) -> None:
        """Start ``memory()``'s ``gathered`` and ``buckets`` peaks again from what is held now."""
        self._peak = dict(self._now)

    def _count(self, kind: str, nbytes: int) -> None:
        self._now[kind] += nbytes
        self._peak[kind] = max(self._peak[kind], self._now[kind])

    def _flats(self, trainable: bool | None = None) -> list[FlatShard]:
        return [f for u in self.units for f in u.flats if trainable is None or f.trainable == trainable]

    def _whole(self, part: torch.Tensor, flat: FlatShard) -> torch.Tensor:
        """The (N·s,) vector whose part this rank holds: for looking (outside training's collectives)."""
        part = part.detach()
        if part.numel() == flat.padded:
            return part
        whole = part.new_empty(flat.padded)
        with torch.no_grad():
            all_gather_single(whole, part.contiguous(), group=self.group)
        return whole


def _neighbour(order: list[Unit], unit: Unit, step: int) -> Unit | None:
    if unit not in order:
        return None
    i = order.index(unit) + step
    return order[i] if 0 <= i < len(order) else None


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)
