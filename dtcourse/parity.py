"""One parity harness for every parallel strategy: train it beside one process and compare every step.

Parity is how the course shows that a parallel implementation is right (STYLE.md section 7). The full
model is built once from a seed, deep-copied for a single-process baseline, and handed to the strategy,
which wraps or shards it. Both train on the same global batches: each rank of the strategy on its part
(equal contiguous slices by default; a batch that does not split evenly is refused), the baseline on the
whole batch. After every step the harness compares the outputs (this rank's, against the baseline's rows
for this rank), the full gradients by name (before the optimizer step) and the full parameters by name
(after it), with the baseline and with PyTorch's own version when one is given (``reference``), and it
checks that every rank holds the same full gradients and parameters. Each tolerance comes with its reason.

A strategy is any object with the five methods of ``Parallel``. ``Replicated`` adapts a wrapper whose
parameters are full on every rank (both DDPs); ZeRO, pipeline and tensor parallelism gather their
shards in ``full_gradients`` / ``full_parameters``. Several named strategies may train side by side
against one baseline. Example, on every rank under ``dtcourse.launch``, with ``adam = lambda ps:
torch.optim.Adam(ps, lr=1e-3)``::

    check_parity(lambda: MLP(seed=0), lambda m, g: Replicated(DistributedDataParallel(m, group=g), adam),
                 batches, F.mse_loss, adam, tolerance=Tolerance(1e-5, 0, "sums in another order"))
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from dtcourse.runtime.device import device as runtime_device

__all__ = ["check_parity", "Tolerance", "ParityReport", "Parallel", "Replicated", "FullyShard", "DTensorPlan", "even_split", "whole_batch",
           "KINDS"]

KINDS = ("output", "gradient", "parameter")          # in the order a step produces them
Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
Split = Callable[[torch.Tensor, int, int], torch.Tensor]
Tensors = dict[str, torch.Tensor]
Shard = Callable[[nn.Module, "dist.ProcessGroup | None"], "Parallel"]


@dataclass(frozen=True)
class Tolerance:
    """Tested ``a`` matches expected ``b`` where ``|a - b| <= atol + rtol * |b|`` everywhere; ``why`` says
    why that much is right (what is summed in another order, and how far that can move the result)."""

    atol: float
    rtol: float
    why: str

    def __post_init__(self) -> None:
        if not isinstance(self.why, str) or not self.why.strip():
            raise ValueError("Tolerance needs a reason: pass why='...' saying what runs in another order and "
                             "how large the difference can grow, e.g. 'the N-rank mean adds in another order: "
                             "a few ulps'. Use Tolerance.exact(why) where nothing may differ.")
        if not (self.atol >= 0 and self.rtol >= 0):       # also refuses NaN
            raise ValueError(f"Tolerance: atol and rtol must be >= 0, got atol={self.atol}, rtol={self.rtol}.")

    @classmethod
    def exact(cls, why: str) -> Tolerance:
        """Equal values (0.0 equals -0.0; NaN equals nothing): where nothing is summed in another order."""
        return cls(0.0, 0.0, why)

    def __str__(self) -> str:
        limit = "exact" if self.atol == self.rtol == 0 else f"atol={self.atol:g}, rtol={self.rtol:g}"
        return f"{limit}: {self.why}"


# Not an argument: whatever a strategy shards, the full tensors it assembles are the same on every rank.
SAME_ON_EVERY_RANK = Tolerance.exact("every rank must hold the same full tensors, or the ranks take "
                                     "different steps and drift apart")
WHO = {"single": "the single-process run's", "reference": "the reference's", "ranks": "group rank 0's"}


class Parallel(Protocol):
    """What a strategy gives the harness. Names are the plain model's ``named_parameters()`` names.

    ``forward_backward(x, y, loss_fn)``: forward and backward on this rank's part; returns this rank's
    outputs, or None if it has none (a pipeline stage before the last). One call rather than forward and
    a loss, since a pipeline schedule interleaves forwards and backwards and only its last stage has a loss.
    ``full_gradients()``: the full, averaged gradient of each parameter that has one, the same on every
    rank; ``full_parameters()``: every parameter, full; ``step()`` and ``zero_grad()``: the optimizer's.
    """

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor | None: ...
    def full_gradients(self) -> Tensors: ...
    def full_parameters(self) -> Tensors: ...
    def step(self) -> None: ...
    def zero_grad(self) -> None: ...


class Replicated:
    """``Parallel`` for a wrapper whose parameters are full on every rank (DDP), or for a plain model.

    ``micro_batches=k`` cuts this rank's part into ``k`` equal micro-batches, scales each loss by
    ``1/k`` and accumulates all but the last under the wrapper's ``no_sync()``: one step.
    """

    def __init__(self, wrapper: nn.Module, optimizer: OptimizerFactory, micro_batches: int = 1):
        inner = getattr(wrapper, "module", None)        # both DDPs keep the plain model as .module
        self.wrapper, self.module = wrapper, inner if isinstance(inner, nn.Module) else wrapper
        self.optimizer = optimizer(self.module.parameters())
        self.micro_batches = micro_batches

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        k, outputs = self.micro_batches, []
        if x.shape[0] % k:
            raise ValueError(f"Replicated: {x.shape[0]} rows per rank do not cut into {k} equal micro-batches; "
                             f"use a global batch divisible by {k} x the number of ranks.")
        for j, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k))):
            quiet = getattr(self.wrapper, "no_sync", contextlib.nullcontext) if j < k - 1 else contextlib.nullcontext
            with quiet():
                out = self.wrapper(xm)
                (loss_fn(out, ym) / k).backward()
            outputs.append(out.detach())
        return torch.cat(outputs)

    def full_gradients(self) -> Tensors:
        return {n: p.grad for n, p in self.module.named_parameters() if p.grad is not None}

    def full_parameters(self) -> Tensors:
        return {n: p.detach() for n, p in self.module.named_parameters()}

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


class FullyShard:
    """``Parallel`` for PyTorch's FSDP2: ``fully_shard`` on each submodule named in ``units``, then on the root.

    ``options`` go to every ``fully_shard`` call (``reshard_after_forward``, ``mp_policy``,
    ``offload_policy``); the full tensors are read from the sharded DTensors with ``full_tensor()``.
    """

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None, optimizer: OptimizerFactory,
                 units: Sequence[str], **options: Any):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group or dist.group.WORLD, runtime_device().type)
        for name in units:
            fully_shard(model.get_submodule(name), mesh=mesh, **options)
        self.model = fully_shard(model, mesh=mesh, **options)
        self.optimizer = optimizer(model.parameters())

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        out = self.model(x)
        loss_fn(out, y).backward()
        return out.detach()

    def full_gradients(self) -> Tensors:
        return {n: p.grad.full_tensor() for n, p in self.model.named_parameters() if p.grad is not None}

    def full_parameters(self) -> Tensors:
        return {n: p.full_tensor() for n, p in self.model.named_parameters()}

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


class _SplitQKV(nn.Module):
    """c_attn as three linears, so that ColwiseParallel splits q, k and v each by heads, as torch's Llama plan."""

    def __init__(self, c_attn: nn.Linear):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(c_attn.in_features, c_attn.out_features // 3) for _ in range(3))
        for lin, w, b in zip((self.q, self.k, self.v), c_attn.weight.chunk(3), c_attn.bias.chunk(3)):
            lin.weight.data.copy_(w), lin.bias.data.copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)    # (B, T, 3C/t): this rank's heads


class DTensorPlan:
    """``Parallel`` for PyTorch's tensor parallelism on a ``dtcourse.models.GPT``: ``parallelize_module`` with
    ``ColwiseParallel`` / ``RowwiseParallel`` (Megatron's layout), ``SequenceParallel`` on the LayerNorms if
    ``sequence_parallel``, and ``loss_parallel`` for the vocab-parallel loss, on a ``DeviceMesh`` over ``group``.

    The second reference of ``dtcourse.tensor_parallel``, in its tests and its benchmark.
    """

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None, optimizer: OptimizerFactory,
                 sequence_parallel: bool = False):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                       SequenceParallel, parallelize_module)
        t, sp = dist.get_world_size(group), sequence_parallel
        mesh = DeviceMesh.from_group(group or dist.group.WORLD, runtime_device().type)
        seq = Shard(1) if sp else Replicate()          # the layout of the residual stream
        plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                "ln_f": SequenceParallel() if sp else None,
                "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
        if sp:   # wte + wpe stays replicated; the first block cuts its sequence shard (no communication)
            plan["blocks.0"] = PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                                                  use_local_output=True)
        for i, block in enumerate(model.blocks):
            block.attn.c_attn = _SplitQKV(block.attn.c_attn)
            block.attn.n_head //= t
            p = f"blocks.{i}."
            plan.update({p + "ln_1": SequenceParallel() if sp else None, p + "ln_2": SequenceParallel() if sp else None,
                         p + "attn.c_attn": PrepareModuleInput(input_layouts=seq, desired_input_layouts=Replicate()),
                         p + "attn.c_attn.q": ColwiseParallel(), p + "attn.c_attn.k": ColwiseParallel(),
                         p + "attn.c_attn.v": ColwiseParallel(), p + "attn.c_proj": RowwiseParallel(output_layouts=seq),
                         p + "mlp.c_fc": ColwiseParallel(input_layouts=seq), p + "mlp.c_proj": RowwiseParallel(output_layouts=seq)})
        self.model = parallelize_module(model, mesh, {k: v for k, v in plan.items() if v is not None})
        self.optimizer = optimizer(self.model.parameters())

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel
        logits = self.model(x)                                             # DTensor (B, T, V), Shard(-1)
        with loss_parallel():
            loss_fn(logits, y).backward()
        return logits.full_tensor().detach()

    def _named(self, grads: bool) -> Tensors:
        out = {}
        for n, p in self.model.named_parameters():
            v = p.grad if grads else p.detach()
            if v is not None:
                out[n] = v.full_tensor() if hasattr(v, "full_tensor") else v
        for name in [n for n in out if ".c_attn.q." in n]:                 # q, k, v back into c_attn
            out[name.replace(".q.", ".")] = torch.cat([out.pop(name.replace(".q.", f".{w}.")) for w in "qkv"])
        return out

    def full_gradients(self) -> Tensors:
        return self._named(True)

    def full_parameters(self) -> Tensors:
        return self._named(False)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


def even_split(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rows ``[rank * B/N, (rank + 1) * B/N)``: equal slices, so that the mean of the ranks' mean losses
    is the whole batch's mean loss. A batch that does not split evenly is refused, not padded."""
    rows, left = divmod(t.shape[0], world)
    if left:
        raise ValueError(f"the global batch has {t.shape[0]} rows, which {world} ranks cannot share equally "
                         f"(the mean of unequal slices' mean losses is not the batch's mean loss): use a "
                         f"batch size divisible by {world}, such as {t.shape[0] + world - left}.")
    return t[rank * rows:(rank + 1) * rows]


def whole_batch(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Every rank gets the whole batch: tensor and pipeline parallelism split the model, not the data."""
    return t


@dataclass(frozen=True)
class ParityReport:
    """``max_diff[tested, against, kind][step - 1]``: that step's largest ``|difference|`` over elements and ranks.

    tested: a strategy's name (``"strategy"`` when only one is given); against: ``"single"`` (the baseline),
    ``"reference"`` or ``"ranks"`` (each rank against group rank 0); kind: one of ``KINDS``. NaN: not compared.
    """

    steps: int
    max_diff: Mapping[tuple[str, str, str], tuple[float, ...]]

    def worst(self, against: str | None = None, kind: str | None = None, tested: str | None = None) -> float:
        """The largest difference over every step and everything not named."""
        return max((d for key, per_step in self.max_diff.items() for d in per_step
                    if d == d and all(want in (None, got) for want, got in zip((tested, against, kind), key))),
                   default=float("nan"))

    def __str__(self) -> str:
        return "\n".join(f"{t} vs {a}: " + ", ".join(f"{k} {self.worst(a, k, t):.2e}" for k in KINDS
                                                      if (t, a, k) in self.max_diff)
                         for t, a in dict.fromkeys(key[:2] for key in self.max_diff))


def check_parity(make_model: Callable[[], nn.Module], shard: Shard | Mapping[str, Shard],
                 batches: Sequence[Batch] | Callable[[int], Batch], loss_fn: LossFn, optimizer: OptimizerFactory,
                 *, tolerance: Tolerance | Mapping[str, Tolerance], reference: Shard | None = None,
                 reference_tolerance: Tolerance | Mapping[str, Tolerance] | None = None, steps: int | None = None,
                 group: dist.ProcessGroup | None = None, split: Split = even_split) -> ParityReport:
    """Train ``shard(model, group)`` beside one process (and ``reference``); raise at the first step that differs.

    Call it on every rank of ``group``, or in a plain process (a world of one). ``shard`` may be a dict of
    named strategies: they train side by side against one baseline and one reference. ``batches``: global
    ``(x, y)`` batches, or ``step -> batch`` with ``steps``. ``split(t, rank, world)`` gives this rank its
    part of ``x``, ``y`` and of the baseline's outputs. ``tolerance`` (against the baseline) and
    ``reference_tolerance`` (default: ``tolerance``) are a ``Tolerance`` or a dict of one per kind in ``KINDS``.
    Raises ``AssertionError``, on every rank, naming the step, kind, parameter, difference and tolerance.
    """
    limits = {"single": _per_kind(tolerance), "ranks": _per_kind(SAME_ON_EVERY_RANK),
              "reference": _per_kind(tolerance if reference_tolerance is None else reference_tolerance)}
    shards = dict(shard) if isinstance(shard, Mapping) else {"strategy": shard}
    if steps is None and callable(batches) or {"single", "reference"} & shards.keys():
        raise ValueError("check_parity: pass steps= when batches is a function of the step, and name no "
                         "strategy 'single' or 'reference'.")
    batch_at, steps = (batches, steps) if callable(batches) else (batches.__getitem__, steps or len(batches))
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    device = runtime_device()                       # where this backend's collectives take their tensors
    model = make_model()                            # the first strategy gets it, the others copies,
    models = [model] + [copy.deepcopy(model) for _ in range(len(shards) + (reference is not None))]
    single = Replicated(models.pop(), optimizer)    # all taken before any shard() changes the model
    start = _float64(single.full_parameters())
    if world > 1 and any(_everyone(bool(_compare(start, _rank0s([(start, start)], group, device)[0],
                                                 SAME_ON_EVERY_RANK)[1]), group)):
        raise ValueError("check_parity: make_model built different parameters on different ranks; build the "
                         "model from a fixed seed (e.g. lambda: GPT(config, seed=0)) so that the baseline "
                         "starts where the strategy does.")
    tested = {name: make(models.pop(0), group) for name, make in shards.items()}
    expected = {"single": single, **({"reference": reference(models.pop(), group)} if reference is not None else {})}
    keys = [(t, a, k) for t in tested for a in [*expected, "ranks"] for k in KINDS]   # the same on every rank
    report: dict[tuple[str, str, str], list[float]] = {key: [] for key in keys}
    for s in range(1, steps + 1):
        x, y = batch_at(s - 1)
        part = split(x, rank, world), split(y, rank, world)
        seen = {name: _step(impl, *part, loss_fn) for name, impl in {**tested, **expected}.items()
                if impl is not single}              # one after the other, in the same order on every rank
        seen["single"] = _step(single, x, y, loss_fn, lambda out: split(out, rank, world))
        found = {(t, a, k): _compare(seen[t][k], seen[a][k], limits[a][k]) for t, a, k in keys
                 if a != "ranks" and k in seen[t] and k in seen[a]}    # key: (max diff, [(excess, name, diff)])
        if world > 1:   # each strategy's full gradients and parameters against group rank 0's
            pairs = [(t, "ranks", k) for t in tested for k in ("gradient", "parameter")]
            firsts = _rank0s([(seen[t][k], seen["single"][k]) for t, _, k in pairs], group, device)
            found.update({key: _compare(seen[key[0]][key[2]], first, SAME_ON_EVERY_RANK)
                          for key, first in zip(pairs, firsts)})
        # Sorted, the first problem is of the earliest kind (its cause comes first), against the baseline
        # before the others, and the worst.
        of = {t: f" of {t!r}" if len(tested) > 1 else "" for t in tested}
        problems = [(KINDS.index(k), list(WHO).index(a), -excess, f"{k}{name}{of[t]} on rank {rank} differs from "
                     f"{WHO[a]} by {d:.3g}", f"({limits[a][k]})")
                    for (t, a, k), (_, bad) in found.items() for excess, name, d in bad]
        maxima = torch.tensor([found[key][0] if key in found else -1.0 for key in keys] + [len(problems)],
                              dtype=torch.float64)  # -1: not compared on this rank
        if world > 1:                               # a few bytes per key
            maxima = maxima.to(device)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        for key, d in zip(keys, maxima.tolist()):
            report[key].append(d if d >= 0 else float("nan"))
        if maxima[-1] > 0:   # every rank knows, and raises the same error
            (*_, first, tol), *others = sorted(p for ps in _everyone(problems, group) for p in ps)
            more = f"; {len(others)} more, such as: " + "; ".join(p[-2] for p in others[:3]) if others else ""
            raise AssertionError(f"parity fails at step {s} of {steps}: {first}, beyond the tolerance {tol}{more}")
    return ParityReport(steps, {key: tuple(v) for key, v in report.items() if any(d == d for d in v)})


def _step(impl: Parallel, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn,
          rows: Callable[[torch.Tensor], torch.Tensor] = lambda out: out) -> dict[str, Tensors]:
    """One training step of one implementation: float64 copies of its outputs (``rows`` of them: this
    rank's), of its gradients before the optimizer step and of its parameters after it."""
    impl.zero_grad()
    out = impl.forward_backward(x, y, loss_fn)
    seen = {} if out is None else {"output": _float64({"": rows(out)})}
    seen["gradient"] = _float64(impl.full_gradients())
    impl.step()
    seen["parameter"] = _float64(impl.full_parameters())
    return seen


def _per_kind(tolerance: Tolerance | Mapping[str, Tolerance]) -> dict[str, Tolerance]:
    if isinstance(tolerance, Tolerance):
        return dict.fromkeys(KINDS, tolerance)
    if not isinstance(tolerance, Mapping) or set(tolerance) != set(KINDS) \
            or not all(isinstance(t, Tolerance) for t in tolerance.values()):
        raise ValueError(f"check_parity: a tolerance is one Tolerance, or a dict with one Tolerance for each "
                         f"of {KINDS}; got {tolerance!r}.")
    return dict(tolerance)


def _float64(tensors: Tensors) -> Tensors:
    # Copies, safe from the optimizer step that follows; float64 holds float32 and bf16 values exactly.
    return {n: t.detach().to("cpu", torch.float64, copy=True) for n, t in tensors.items()}


def _compare(tested: Tensors, expected: Tensors, tol: Tolerance) -> tuple[float, list[tuple[float, str, float]]]:
    """The largest |tested - expected|, and (excess over the limit, name, its max diff) for each name beyond it."""
    if tested.keys() != expected.keys():
        missing, extra = sorted(expected.keys() - tested.keys()), sorted(tested.keys() - expected.keys())
        return float("inf"), [(float("inf"), f" names ({missing} missing, {extra} unexpected)", float("inf"))]
    found = [(float("inf"), (f" {n!r}" if n else "") + f" (shape {tuple(t.shape)}, not {tuple(expected[n].shape)})",
              float("inf")) for n, t in tested.items() if t.shape != expected[n].shape]
    if found or not expected:
        return (float("inf") if found else 0.0), found
    a, b = (torch.cat([t[n].reshape(-1) for n in expected]) for t in (tested, expected))   # all names at once
    d = (a - b).abs().nan_to_num(float("inf"))                     # NaN is infinitely far from anything
    excess = d - (tol.atol + tol.rtol * b.abs())
    if excess.max() > 0:                                           # which names, and by how much
        sizes = [t.numel() for t in expected.values()]
        for name, dn, en in zip(expected, d.split(sizes), excess.split(sizes)):
            if dn.numel() and en.max() > 0:
                found.append((en.max().item(), f" {name!r}" if name else "", dn.max().item()))
    return (d.max().item() if d.numel() else 0.0), found


def _rank0s(parts: list[tuple[Tensors, Tensors]], group: dist.ProcessGroup | None,
            device: torch.device) -> list[Tensors]:
    """Group rank 0's version of each ``(tensors, layout)``, from one broadcast of a flat vector laid out
    by the layouts' names and shapes (the baseline's, the same on every rank): NaN where a name is amiss."""
    flat = torch.cat([torch.zeros(0, dtype=torch.float64)] + [
        tensors[n].reshape(-1) if n in tensors and tensors[n].shape == t.shape
        else torch.full((t.numel(),), float("nan"), dtype=torch.float64)
        for tensors, layout in parts for n, t in layout.items()]).to(device)
    dist.broadcast(flat, group_src=0, group=group)   # every other rank receives 8 bytes per element
    chunks = iter(flat.cpu().split([t.numel() for _, layout in parts for t in layout.values()]))
    return [{n: next(chunks).view(t.shape) for n, t in layout.items()} for _, layout in parts]


def _everyone(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """``obj`` from every rank of ``group``, by rank."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, obj, group=group)   # each rank receives every other's, pickled
    return everyone
