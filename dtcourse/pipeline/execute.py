"""Run one rank's list of pipeline actions on real ranks: forwards, backwards, and the traffic between stages.

A schedule is data (``dtcourse.pipeline.actions``); this module is the engine that executes it, as
DeepSpeed's pipeline engine executes its instructions. Each rank holds its stages (``partition.py``) and
walks its own list once per training step:

* ``F`` runs the stage on micro-batch j and keeps its input and output for the backward. On the last
  stage it also computes the loss, scaled by rows_j / B (1/m for equal micro-batches), so the m losses
  add up to the mean over the global batch and the gradients equal one process's on the whole batch.
* ``B`` backpropagates through the stage: weight gradients accumulate in ``.grad``, and the gradient of
  the stage's input is what the previous stage needs.
* ``I`` and ``W`` are zero-bubble's split of ``B`` (Qi et al., arXiv 2401.10241): ``I`` is
  ``torch.autograd.grad`` with respect to the input only (keeping the graph), ``W`` with respect to the
  parameters, added to ``.grad``. ``W`` may run any time before the step, so a schedule fills bubbles
  with it. (Here ``W`` backpropagates again through the stage's activations; the paper's implementation
  keeps the activation gradients ``I`` found instead.)
* ``SEND_F`` / ``RECV_F`` / ``SEND_B`` / ``RECV_B`` move an activation or a gradient to the neighbouring
  stage's rank. Consecutive ones are posted together with ``dist.batch_isend_irecv``; a receive is
  waited for only by the compute that needs it, and sends only at the end of the list, so a rank never
  blocks on a message before it has posted its own. ``run_schedule`` and ``PipelineParallel`` take a
  whole schedule, and give one without messages its messages with ``schedules.with_communication``
  (one global order of messages, which cannot deadlock even where a send waits for its receive).
* ``STEP`` runs the optimizer on one stage's parameters, where the schedule puts it (every generator:
  last, once the stage's weight gradients are all in). ``run`` calls its ``step(stage)`` argument;
  ``run_schedule`` takes one optimizer per stage, or one for the rank, which steps at its last STEP.
  A schedule without STEPs (torch's kind) is stepped after the list.

Every action is a span of ``self.timeline`` (``dtcourse.runtime.timeline``), so the bubble is measured on
the real run; ``peak_held`` counts the micro-batches whose activations each stage held at once (m for
GPipe, p - r on rank r for 1F1B). Example, on every rank under ``dtcourse.launch``::

    ex = PipelineExecutor({r: split_gpt(model, p)[r]}, p, gpt_boundary_shape(model))
    logits = run_schedule(ex, schedules.one_f_one_b(p, 4), idx, targets, lm_loss, 4, optimizer)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from dtcourse.pipeline.actions import STEP, Action, Schedule
from dtcourse.pipeline.partition import rank_of_stage
from dtcourse.pipeline.schedules import with_communication
from dtcourse.pipeline.validate import validate
from dtcourse.runtime.timeline import Timeline

__all__ = ["PipelineExecutor", "PipelineParallel", "run_schedule", "rank_actions", "stepper", "SPAN_KINDS"]

SPAN_KINDS = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight",
              "SEND_F": "send", "SEND_B": "send", "RECV_F": "recv", "RECV_B": "recv", "wait": "wait",
              STEP: "optimizer", "REDUCE_GRAD": "reduce"}
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BoundaryShape = Callable[[int, torch.Tensor], Sequence[int]]   # (stage, micro-batch input) -> its input's shape


def rank_actions(schedule: Schedule, rank: int, n_ranks: int, n_stages: int,
                 microbatches: int | None = None) -> list[Action]:
    """This rank's list of ``schedule``, with the messages ``schedules.with_communication`` places if it has none.

    With ``microbatches``, the whole schedule is validated first (``validate``, in this executor's
    model: sends complete at the end of the step), so a schedule that would deadlock or skip an
    action is refused, with the rank, step and action, before any rank runs it.
    """
    if microbatches is not None and any(schedule.values()):
        validate(schedule, n_ranks, microbatches, n_stages // n_ranks, blocking=False)
    if n_ranks == 1 or any(a.is_communication for acts in schedule.values() for a in acts):
        return list(schedule.get(rank, []))
    if not any(schedule.values()):
        return []
    return with_communication(schedule, n_ranks, n_stages // n_ranks)[rank]


@dataclass
class _Held:
    """What a stage keeps of one micro-batch from its forward to its (last) backward."""

    x: torch.Tensor              # the stage's input (a leaf that requires grad, after stage 0)
    root: torch.Tensor           # its output, or on the last stage its scaled loss
    grad: torch.Tensor | None    # d loss / d root: received from the next stage; None for the loss
    input_done: bool = False     # I ran: W may follow


class PipelineExecutor:
    """Runs this rank's actions for ``stages`` (stage index -> module), ``n_stages`` in all, on ``group``.

    ``boundary_shape(s, x_j)`` is the shape of stage s's input (s > 0) for micro-batch input ``x_j``:
    receive buffers are allocated with it and every sent activation is checked against it.
    """

    def __init__(self, stages: Mapping[int, nn.Module], n_stages: int, boundary_shape: BoundaryShape, *,
                 group: dist.ProcessGroup | None = None, timeline: Timeline | None = None,
                 dtype: torch.dtype = torch.float32):
        on = dist.is_initialized()
        self.rank, self.n_ranks = (dist.get_rank(group), dist.get_world_size(group)) if on else (0, 1)
        wrong = [s for s in stages if not 0 <= s < n_stages or rank_of_stage(s, self.n_ranks) != self.rank]
        if wrong or not stages:
            raise ValueError(f"PipelineExecutor: rank {self.rank} of {self.n_ranks} holds stages "
                             f"{list(range(self.rank, n_stages, self.n_ranks))} of {n_stages}, got {sorted(stages)}; "
                             "give each rank r the stages r, r + p, ... (partition.stages_of_rank).")
        self.stages, self.n_stages, self.boundary_shape = dict(stages), n_stages, boundary_shape
        self.group, self.dtype = group, dtype
        self.timeline = Timeline() if timeline is None else timeline
        self.peak_held: dict[int, int] = {}    # stage -> most micro-batches held at once in the last run
        self.peak_held_rank = 0                # the same, summed over this rank's stages
        self.loss = 0.0                        # the last run's global-batch loss (on the last stage's rank)
        self._plan: tuple = (None, [])         # (the schedule and m it was made from, this rank's list)

    def plan(self, schedule: Schedule, n_microbatches: int) -> list[Action]:
        """This rank's validated list of ``schedule`` (``rank_actions``), worked out once while it stays the same."""
        frozen = (n_microbatches, {r: tuple(acts) for r, acts in schedule.items()})
        if self._plan[0] != frozen:           # validating and lowering is per schedule, not per step
            self._plan = (frozen, rank_actions(schedule, self.rank, self.n_ranks, self.n_stages, n_microbatches))
        return self._plan[1]

    # ------------------------------------------------------------------ one run of the list
    def run(self, actions: Sequence[Action], x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn,
            n_microbatches: int, step: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """Run the list on the global batch ``(x, y)`` cut into ``n_microbatches``; the last stage's outputs or None.

        ``step(stage)`` is called at each ``STEP`` action (it runs that stage's optimizer); a list with
        STEPs needs it.
        """
        if not 1 <= n_microbatches <= x.shape[0]:
            raise ValueError(f"PipelineExecutor.run: {n_microbatches} micro-batches of a {x.shape[0]}-row batch; "
                             f"use between 1 and {x.shape[0]}.")
        alien = [str(a) for a in actions if a.stage not in self.stages or (a.microbatch or 0) >= n_microbatches]
        if alien:
            raise ValueError(f"rank {self.rank}'s list names {alien[:4]}, but it holds stages {sorted(self.stages)} "
                             f"and there are {n_microbatches} micro-batches: give it only its own stages' actions.")
        self.m, self.rows, self.loss_fn = n_microbatches, x.shape[0], loss_fn
        self.xs, self.ys = x.tensor_split(n_microbatches), y.tensor_split(n_microbatches)
        self.held: dict[tuple[int, int], _Held] = {}
        self.inbox: dict[tuple[str, int, int], tuple[torch.Tensor, list]] = {}   # (F|B, stage, j) -> (tensor, works)
        self.outbox: dict[tuple[str, int, int], torch.Tensor] = {}              # computed, not yet sent
        self.sends: list = []                                                   # (work, tensor) to finish
        self.outputs: dict[int, torch.Tensor] = {}
        self.count, self.peak_held, self.peak_held_rank, self.loss = {s: 0 for s in self.stages}, {}, 0, 0.0
        if step is None and any(a.kind == STEP for a in actions):
            raise ValueError(f"rank {self.rank}'s list has optimizer steps ({[str(a) for a in actions if a.kind == STEP]}) "
                             "but run() got no step=: pass step=lambda stage: optimizer.step(), or use run_schedule.")
        self.step_fn = step
        # Stages that reduce their gradients themselves (ZeRO over a data-parallel group): their micro-batches'
        # backwards only add up, and the sum is reduced once, at the stage's STEP (torch's REDUCE_GRAD), whose place
        # after the stage's last backward validate() checks; a list without STEPs reduces at its end.
        self.reducing = {s for s, m in self.stages.items() if hasattr(m, "reduce_gradients")}
        split = sorted({a.stage for a in actions if a.kind in ("I", "W")} & self.reducing)
        if split:
            raise ValueError(f"rank {self.rank}: stage(s) {split} reduce their gradients over data-parallel ranks "
                             "(ZeRO), which counts each parameter's gradient as it arrives: zero-bubble's split "
                             "backward (I, then W) is not supported for them; use one B (GPipe, 1F1B, interleaved).")
        for s in self.reducing:
            self.stages[s].set_requires_gradient_sync(False)
        if self.n_ranks > 1 and actions and not any(a.is_communication for a in actions):
            raise ValueError(f"rank {self.rank}'s list has no SEND/RECV actions, but its stages exchange data with "
                             "other ranks: pass rank_actions(schedule, rank, p, p * v), or run_schedule with the "
                             "whole schedule, which add them.")
        todo = list(actions)
        batch: list[Action] = []
        for a in todo:
            if a.is_communication:
                batch.append(a)              # posted together, just before the next compute or step
                continue
            self._post(batch)
            batch = []
            getattr(self, f"_{a.kind}")(a)
        self._post(batch)
        for work, _ in self.sends:           # the tensor stays referenced until its send is done
            work.wait()
        self._check_finished()
        for s in sorted(self.reducing - {a.stage for a in actions if a.kind == STEP}):
            self._reduce(s)                  # no STEP in the list: reduced here, stepped by the caller
        last = self.n_stages - 1
        return torch.cat([self.outputs[j] for j in range(self.m)]) if last in self.stages else None

    def _check_finished(self) -> None:
        problems = [f"stage {s} still holds micro-batch {j} (no B, or no W after its I)" for s, j in self.held]
        problems += [f"{k}{s}{j} arrived but nothing used it" for k, s, j in self.inbox]
        problems += [f"stage {s}'s {'activation' if k == 'F' else 'gradient'} of micro-batch {j} was never sent"
                     for k, s, j in self.outbox]
        if problems:
            raise RuntimeError(f"rank {self.rank}'s list ended with work left: " + "; ".join(problems[:4]) +
                               ". Every F needs a later B (or I then W), and every SEND its RECV on the other rank.")

    # ------------------------------------------------------------------ compute
    def _F(self, a: Action) -> None:
        s, j = a.stage, a.microbatch
        x = self.xs[j] if s == 0 else self._take("F", a).requires_grad_(True)
        with self.timeline.span(SPAN_KINDS["F"], str(a)):
            out = self.stages[s](x)
            if s == self.n_stages - 1:   # loss per micro-batch, scaled so that the m of them sum to the batch mean
                root = self.loss_fn(out, self.ys[j]) * (self.xs[j].shape[0] / self.rows)
                self.outputs[j], self.loss = out.detach(), self.loss + root.item()
            else:
                root = out
                self._check_shape(s, j, out)
                self._hand_over("F", s + 1, s, j, out.detach())
        self.held[(s, j)] = _Held(x, root, None)
        self.count[s] += 1
        self.peak_held[s] = max(self.peak_held.get(s, 0), self.count[s])
        self.peak_held_rank = max(self.peak_held_rank, sum(self.count.values()))

    def _B(self, a: Action) -> None:
        s, j = a.stage, a.microbatch
        held = self._pop_held(a)
        grad = None if s == self.n_stages - 1 else self._take("B", a)
        with self.timeline.span(SPAN_KINDS["B"], str(a)):
            torch.autograd.backward(held.root, grad)     # weight gradients accumulate into .grad
        if s > 0:
            self._hand_over("B", s - 1, s, j, held.x.grad)
        self.count[s] -= 1

    def _I(self, a: Action) -> None:
        s, j = a.stage, a.microbatch
        held = self.held.get((s, j))
        if held is None or held.input_done:
            raise RuntimeError(f"rank {self.rank}: {a} needs {s}F{j} before it, and no other I for it.")
        held.grad = None if s == self.n_stages - 1 else self._take("B", a)
        with self.timeline.span(SPAN_KINDS["I"], str(a)):
            if s > 0:        # stage 0's input is token ids: there is no input gradient to compute
                (dx,) = torch.autograd.grad(held.root, [held.x], held.grad, retain_graph=True)   # W needs the graph
        if s > 0:
            self._hand_over("B", s - 1, s, j, dx)
        held.input_done = True

    def _W(self, a: Action) -> None:
        held = self._pop_held(a)
        if not held.input_done:
            raise RuntimeError(f"rank {self.rank}: {a} runs before {a.stage}I{a.microbatch}; "
                               "put the I (input gradient) first, or use one B for both.")
        params = [p for p in self.stages[a.stage].parameters() if p.requires_grad]
        with self.timeline.span(SPAN_KINDS["W"], str(a)):
            grads = torch.autograd.grad(held.root, params, held.grad, allow_unused=True)   # frees the graph
            for p, g in zip(params, grads):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad.add_(g)
        self.count[a.stage] -= 1

    def _STEP(self, a: Action) -> None:
        unfinished = sorted(j for s, j in self.held if s == a.stage)
        if unfinished:
            raise RuntimeError(f"rank {self.rank}: {a} before stage {a.stage}'s backward of micro-batch {unfinished[0]}; "
                               "put the step after the stage's last B (or W).")
        if a.stage in self.reducing:
            self._reduce(a.stage)
        with self.timeline.span(SPAN_KINDS[STEP], str(a)):
            self.step_fn(a.stage)

    def _reduce(self, s: int) -> None:
        with self.timeline.span(SPAN_KINDS["REDUCE_GRAD"], f"{s}REDUCE_GRAD"):
            self.stages[s].reduce_gradients()

    def _pop_held(self, a: Action) -> _Held:
        held = self.held.pop((a.stage, a.microbatch), None)
        if held is None:
            raise RuntimeError(f"rank {self.rank}: {a} has no forward to go back through; put "
                               f"{a.stage}F{a.microbatch} before it, once.")
        return held

    def _check_shape(self, s: int, j: int, out: torch.Tensor) -> None:
        want = tuple(self.boundary_shape(s + 1, self.xs[j]))
        if tuple(out.shape) != want or out.dtype != self.dtype:
            raise ValueError(f"stage {s}'s output for micro-batch {j} is {tuple(out.shape)} {out.dtype}, but stage "
                             f"{s + 1} expects {want} {self.dtype}: cut the model where one stage's output is what the "
                             "next one takes, or make boundary_shape (and dtype) describe that activation.")

    # ------------------------------------------------------------------ communication
    def _tag(self, kind: str, boundary: int, j: int) -> int:
        """One tag per message of a run: activations and gradients crossing boundary b (stage b to b + 1)."""
        return 2 * (boundary * self.m + j) + (kind == "B")

    def _hand_over(self, kind: str, to: int, s: int, j: int, t: torch.Tensor) -> None:
        """A computed activation (to stage s+1) or input gradient (to s-1): to the local inbox, or to send."""
        if to in self.stages:
            self.inbox[(kind, to, j)] = (t, [])
        else:
            self.outbox[(kind, s, j)] = t.contiguous()     # a message is one contiguous buffer (SP's shards are not)

    def _post(self, batch: list[Action]) -> None:
        """Post a run of consecutive SEND/RECV actions as one ``batch_isend_irecv``."""
        ops, receives = [], []
        for a in batch:
            s, j, kind = a.stage, a.microbatch, a.kind[-1]        # kind: "F" (activation) or "B" (gradient)
            peer = s + 1 if a.kind in ("SEND_F", "RECV_B") else s - 1
            if not 0 <= peer < self.n_stages:
                raise ValueError(f"rank {self.rank}: {a} goes to stage {peer}, which does not exist.")
            if peer in self.stages:                               # same rank: _hand_over already delivered it
                continue
            boundary = min(s, peer)
            if a.kind.startswith("SEND"):
                t = self.outbox.pop((kind, s, j), None)
                if t is None:
                    raise RuntimeError(f"rank {self.rank}: {a} before the compute that produces it "
                                       f"({s}{'F' if kind == 'F' else 'B or I'}{j}); move it after that.")
                ops.append(dist.P2POp(dist.isend, t, group=self.group, group_peer=rank_of_stage(peer, self.n_ranks),
                                      tag=self._tag(kind, boundary, j)))
            else:
                shape = self.boundary_shape(max(s, peer), self.xs[j])   # the input of the later stage
                t = torch.empty(tuple(shape), dtype=self.dtype, device=self._device(s))
                ops.append(dist.P2POp(dist.irecv, t, group=self.group, group_peer=rank_of_stage(peer, self.n_ranks),
                                      tag=self._tag(kind, boundary, j)))
                receives.append(((kind, s, j), len(ops) - 1))
        if not ops:
            return
        start = time.perf_counter()
        works = dist.batch_isend_irecv(ops)       # each op moves prod(shape) * 4 bytes (float32)
        end = time.perf_counter()
        for a in batch:                           # posting is all the batch's actions take on this rank
            self.timeline.record(SPAN_KINDS[a.kind], str(a), start, end)
        each = len(works) == len(ops)              # one work per op, or one for the whole batch
        for i, op in enumerate(ops):
            if op.op is dist.isend:
                self.sends += [(w, op.tensor) for w in ([works[i]] if each else works)]
        for key, i in receives:
            self.inbox[key] = (ops[i].tensor, [works[i]] if each else list(works))

    def _take(self, kind: str, a: Action) -> torch.Tensor:
        """The activation (kind F) or gradient (B) that action ``a`` consumes, waiting for it if in flight."""
        found = self.inbox.pop((kind, a.stage, a.microbatch), None)
        if found is None:
            what = f"{a.stage}RECV_F{a.microbatch}" if kind == "F" else f"{a.stage}RECV_B{a.microbatch}"
            raise RuntimeError(f"rank {self.rank}: {a} needs data that never arrived; put {what} before it "
                               "(and the matching SEND on the neighbouring stage's rank).")
        t, works = found
        if works:
            with self.timeline.span(SPAN_KINDS["wait"], f"wait {a}"):
                for w in works:
                    w.wait()
        return t

    def _device(self, s: int) -> torch.device:
        p = next(self.stages[s].parameters(), None)
        return p.device if p is not None else torch.device("cpu")


Optimizers = torch.optim.Optimizer | Mapping[int, torch.optim.Optimizer]


def stepper(actions: Sequence[Action], optimizer: Optimizers) -> Callable[[int], None]:
    """What ``run`` calls at a STEP: ``optimizer[stage].step()``, or, for one optimizer over the rank's
    stages, its ``step()`` at the rank's last STEP (so each parameter is updated once)."""
    if isinstance(optimizer, Mapping):
        return lambda stage: optimizer[stage].step()
    last = [a.stage for a in actions if a.kind == STEP][-1:]
    return lambda stage: optimizer.step() if [stage] == last else None


def _optimizers(optimizer: Optimizers) -> list[torch.optim.Optimizer]:
    return list(optimizer.values()) if isinstance(optimizer, Mapping) else [optimizer]


def run_schedule(executor: PipelineExecutor, schedule: Schedule, x: torch.Tensor, y: torch.Tensor,
                 loss_fn: LossFn, n_microbatches: int, optimizer: Optimizers) -> torch.Tensor | None:
    """One training step: clear the gradients, run this rank's part of ``schedule``, steps included.

    ``optimizer``: one per stage ({stage: optimizer}) or one for all this rank's stages. The schedule's
    STEP actions run it; a schedule without them is stepped after its list.
    """
    for opt in _optimizers(optimizer):
        opt.zero_grad(set_to_none=True)
    actions = executor.plan(schedule, n_microbatches)
    if isinstance(optimizer, Mapping) and set(optimizer) != set(executor.stages):
        raise ValueError(f"run_schedule: rank {executor.rank} holds stages {sorted(executor.stages)}, but the "
                         f"optimizers are for stages {sorted(optimizer)}: give one per stage held.")
    out = executor.run(actions, x, y, loss_fn, n_microbatches, stepper(actions, optimizer))
    if not any(a.kind == STEP for a in actions):
        with executor.timeline.span(SPAN_KINDS[STEP], "step"):
            for opt in _optimizers(optimizer):
                opt.step()
    return out


class PipelineParallel:
    """``dtcourse.parity.Parallel`` for a pipeline: this rank's ``stages``, the ``schedule``, ``n_microbatches``.

    Stage modules must keep the plain model's parameter names (``GPTStage`` does); ``full_gradients`` and
    ``full_parameters`` gather every stage's to every rank. Other arguments go to ``PipelineExecutor``.
    Each stage gets its own ``optimizer(parameters)``; the schedule's STEPs run them inside
    ``forward_backward`` (``step`` then does nothing), or ``step`` runs them all if it has none.
    """

    def __init__(self, stages: Mapping[int, nn.Module], n_stages: int, schedule: Schedule,
                 n_microbatches: int, optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                 boundary_shape: BoundaryShape, **options):
        self.executor = ex = PipelineExecutor(stages, n_stages, boundary_shape, **options)
        self.actions, self.m = ex.plan(schedule, n_microbatches), n_microbatches
        self.optimizers = {s: optimizer(stage.parameters()) for s, stage in stages.items()}
        self.steps_in_schedule = any(a.kind == STEP for a in self.actions)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor | None:
        return self.executor.run(self.actions, x, y, loss_fn, self.m, stepper(self.actions, self.optimizers))

    def _named(self, grads: bool) -> dict[str, torch.Tensor]:
        mine = {n: (p.grad if grads else p).detach().cpu() for stage in self.executor.stages.values()
                for n, p in stage.named_parameters() if not grads or p.grad is not None}
        if self.executor.n_ranks == 1:
            return mine
        everyone: list = [None] * self.executor.n_ranks
        dist.all_gather_object(everyone, mine, group=self.executor.group)   # every rank gets every stage's, pickled
        return {n: t for part in everyone for n, t in part.items()}

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return self._named(grads=True)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self._named(grads=False)

    def step(self) -> None:
        if self.steps_in_schedule:            # already run, at the schedule's STEP actions
            return
        with self.executor.timeline.span(SPAN_KINDS[STEP], "step"):
            for opt in self.optimizers.values():
                opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)
