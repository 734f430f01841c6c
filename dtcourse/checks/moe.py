"""Checks for exercise 11: a student's positions, dispatch and combine for capacity-padded expert parallelism.

E experts over ep ranks, E/ep each; rank r routes its own N tokens (one GShard group) and owns experts
[r E/ep, (r+1) E/ep). The student writes three functions (GShard, Lepikhin et al., arXiv 2006.16668; Switch,
Fedus et al., arXiv 2101.03961)::

    check_moe_positions(positions_in_expert, cases=("small",))
    check_moe_dispatch(dispatch_padded, cases=("small",))
    check_moe_combine(positions_in_expert, dispatch_padded, combine_padded, cases=("small",))

* ``check_moe_positions``: ``positions_in_expert(experts, n_expert)`` against the course's on crafted and random
  routings (one process): each choice's arrival order in its expert, every first choice before any second one;
* ``check_moe_dispatch``: ``dispatch_padded(tokens, routing, n_expert, group)`` on ep ranks, with the course's routing:
  what each rank receives, row by row, laid out (source rank, local expert, slot) with zeros in empty slots and
  no dropped choice; the token gradients its backward sends back; and the traffic: one all-to-all forward and
  one backward, on the group, with equal splits of E/ep·C rows, each rank sending (ep-1)/ep·E·C·d·4 bytes;
* ``check_moe_combine``: the layer built from the three functions (the router and this rank's experts copied
  from one ``MoE``, the experts run on what ``dispatch`` delivers, ``combine`` adding the gated outputs) against
  the one-process ``MoE`` with ``groups`` = ep: every rank's output and its gradients (the input, the router and
  its experts), and two all-to-alls forward and two backward.

A failure names the rank (and its place in its group), the configuration (E, top-k, capacity factor and C),
the token, choice, expert and slot, what was expected and what came back, with a hint for the usual mistakes:
second choices queued before first ones, positions from 1, a choice past its expert's capacity sent (into the
next expert's slots, or wrapped round or clamped into its own: which expert overflowed, and by how many), the
wrong layout, the gate not applied or swapped, a dropped token's output not zero, a slot read from the wrong
row, an all-to-all on the default group. The ranks of a group mostly make the same mistake: each distinct hint
is printed once in a message, on the first rank that shows it, and a later rank that repeats it points to that
rank's line. Every rank builds every rank's tokens and routing from the same seeds, so each computes what it
expects with no communication. While the student's code runs, the course's ``positions_in_expert``,
``dispatch_padded`` and ``combine_padded`` refuse to run (``guard.watching``).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._C._distributed_c10d import ProcessGroup

from dtcourse.checks.common import (_as_student, _check_names, _GroupPlace, _launch_check,
                                     _refuse_library_code, _SideBySide, _stop_at_first_failure)
from dtcourse.checks.guard import Answers, _nbytes, watching
from dtcourse.checks.messages import Hint
from dtcourse.models.moe import MoE, Routing, capacity, route

__all__ = ["check_moe_positions", "check_moe_dispatch", "check_moe_combine", "MOE_CASES", "POSITION_CASES",
           "MOE_TOL"]

# What these checks switch off while the student's code runs (guard.watching), and refuse to be given
ANSWERS = Answers("11", course=("dtcourse.models.moe.positions_in_expert", "dtcourse.moe.dispatch.dispatch_padded",
                                "dtcourse.moe.dispatch._add_up", "dtcourse.moe.dispatch.combine_padded"))


class _Case(_SideBySide):
    """``_Case(world, ep)``: groups of ep ranks side by side."""

    symbol = "ep"

    @property
    def ep(self) -> int:      # expert-parallel size
        return self.size


MOE_CASES = {
    "small": ("ep = 2 and ep = 3", (_Case(2, 2), _Case(3, 3))),
    "large": ("two groups of ep = 2 side by side on 4 ranks, ep = 4, and ep = 5",
              (_Case(4, 2), _Case(4, 4), _Case(5, 5))),
}
POSITION_CASES = {
    "small": "crafted routings and random ones of 12 to 16 tokens, top-1 and top-2",
    "large": "one token, one expert, 40 to 100 tokens, top-3, queues longer than the tokens",
}
B, T, D = 2, 6, 8        # each rank's tokens (B, T, d): N = 12 a rank
N = B * T
# float32. The expert-parallel layer runs each expert on its padded (ep C, d) rows where one process runs it
# on a group's kept rows alone, and sums an expert's gradient over the ranks in another order: the same products
# summed otherwise, a few ulps. Measured with the solution over every case: outputs at most 8.9e-8, gradients
# 9.5e-7. A real mistake is off by a whole expert output or gate, around 0.1.
MOE_TOL = 1e-5
# Dispatch copies rows and its backward adds at most k = 2 of them per token: exact in float32, in either order.

_ADVICE = "Write it yourself, in the exercise's cell, and pass that."
_HINT = ("This is most likely a deadlock: a rank waits in an all-to-all that another rank of its group never "
         "started. Every rank of the group must run the same all-to-alls, in the same order, on the same group. "
         "Raise timeout= only if your code is merely slow.")
_POINTER = "check_moe_positions names it on smaller routings"
_DROP = ("A choice at position >= C is dropped, not sent: send only the kept ones, kept = position < C "
         "(routing.kept), as the lesson's route does")
_LAYOUT = ("the received buffer is laid out (source rank, local expert, slot): row s·(E/ep)·C + l·C + c. Build the "
           "send buffer (E·C, d) with each kept choice at row expert·C + position, zeros elsewhere, and split it "
           "equally: rank q gets rows [q·(E/ep)·C, (q+1)·(E/ep)·C), its experts' slots")


_CUT = Hint("the gates' gradient is cut",
            "keep routing.gates in the graph (no .detach(), .item() or .tolist() on them)")
_UNREACHED = Hint("the outputs' gradient never reached this rank's experts",
                  "combine's all-to-all must be differentiable (the given all_to_all is; dist.all_to_all_single "
                  "alone is not)")
_HINTS = (_CUT, _UNREACHED)          # hints that read the same on every rank: printed once (hints_once)


@dataclass(frozen=True)
class _Config:
    E: int            # experts
    k: int            # choices per token
    cf: float         # capacity factor

    @property
    def C(self) -> int:
        return capacity(N, self.E, self.k, self.cf)

    def __str__(self) -> str:
        return f"E = {self.E}, top-{self.k}, capacity factor {self.cf} (C = {self.C})"


def _configs(ep: int) -> list[_Config]:
    """E = ep and 2 ep, top-1 and top-2; every one drops choices on some rank (tests/test_moe_exercise.py)."""
    return [_Config(ep, 1, 1.0), _Config(2 * ep, 2, 1.0), _Config(2 * ep, 1, 0.75), _Config(ep, 2, 0.75)]


def _randn(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _reference_positions(experts: torch.Tensor, n_expert: int) -> torch.Tensor:
    from dtcourse.models.moe import positions_in_expert
    return positions_in_expert(experts, n_expert)       # the check's own call: no student frame on its stack


# --------------------------------------------------------------------------- #
# This rank in a case: its group, and every collective its code starts
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class _Call:
    op: str                       # "all-to-all", or the process group's method
    rows: tuple[int, ...]         # an all-to-all's rows to each rank of the group (its input splits)
    received: tuple[int, ...]     # and from each (its output splits)
    row: int                      # bytes of one row; of the whole tensor for other collectives
    on: str                       # "the group", "the default group (all N ranks)" or "another group"
    phase: str

    def __str__(self) -> str:
        if self.op != "all-to-all":
            return f"{'an' if self.op[0] in 'aeiou' else 'a'} {self.op} of {self.row} B on {self.on}"
        return f"an all-to-all on {self.on} sending rows {list(self.rows)} of {self.row} B to the ranks"


def _a2a_splits(args: tuple, ep: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    out, x, out_splits, in_splits = args[:4]
    rows = tuple(int(s) for s in in_splits) or (x.shape[0] // ep,) * ep    # [] means equal splits
    received = tuple(int(s) for s in out_splits) or (out.shape[0] // ep,) * ep
    return rows, received, x[0].nbytes if x.dim() and x.shape[0] else 0


class _Place(_GroupPlace):
    """This rank in a case: its expert-parallel group, its rank r in it, and a log of what it sends."""

    advice = "pass group=group to all_to_all, and take ep from dist.get_world_size(group)"

    def __init__(self, case: _Case, progress: str):
        super().__init__(case, progress, phase=None)
        self.ep = case.ep

    def agree(self, problem: str | None) -> str | None:
        """Every rank learns whether any found a problem, so none goes on alone into a collective."""
        phase, self.phase = self.phase, None                   # not the student's traffic
        flag = torch.tensor([problem is not None], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)           # sends 4 bytes per rank
        self.phase = phase
        return problem if problem is not None else ("" if flag.item() else None)

    def _call(self, method: str, pg: ProcessGroup, args: tuple) -> _Call:
        on = self._on(pg)
        if method in ("all_to_all_single", "alltoall_base"):
            rows, received, row = _a2a_splits(args, pg.size())
            return _Call("all-to-all", rows, received, row, on, self.phase)
        op = "all-to-all (list form)" if method == "alltoall" else method
        return _Call(op, (), (), max([_nbytes(a) for a in args[:2]] + [0]), on, self.phase)

    def traffic(self, what: str, count: int, rows: int, phases: Sequence[str]) -> str | None:
        """None if ``phases`` started ``count`` all-to-alls on the group, each of ``rows`` rows split equally."""
        found = [c for c in self.calls if c.phase in phases]
        each = (rows // self.ep,) * self.ep
        if [(c.op, c.rows, c.received, c.row, c.on) for c in found] == [("all-to-all", each, each, 4 * D,
                                                                         "the group")] * count:
            return None
        nbytes = rows * D * 4
        expected = (f"{'one all-to-all' if count == 1 else f'{count} all-to-alls'} on the group of the E·C = {rows}"
                    f"-row buffer ({nbytes} B of float32), split equally: E/ep·C = {rows // self.ep} rows to each "
                    f"rank, rows {list(each)}, so each rank sends (ep-1)/ep of it, "
                    f"{(self.ep - 1) * nbytes // self.ep} B, and keeps its own share")
        listed = ", ".join(map(str, found))
        listed = f"{len(found)} collectives ({listed})" if len(found) > 1 else listed or "no collective"
        return f"{what} started {listed}; expected {expected}"


# --------------------------------------------------------------------------- #
# Check 1: positions, in one process
# --------------------------------------------------------------------------- #
def _choices(n: int, n_expert: int, k: int, seed: int, skew: float = 1.0) -> torch.Tensor:
    """k distinct experts per token, as top-k picks them; ``skew`` favours the low experts (long queues)."""
    scores = torch.rand(n, n_expert, generator=torch.Generator().manual_seed(seed))
    return (scores + skew * torch.linspace(1, 0, n_expert)).topk(k, dim=1).indices


def _position_examples(name: str) -> list[tuple[str, torch.Tensor, int]]:
    if name == "small":
        return [("3 tokens, top-1, E = 2", torch.tensor([[1], [0], [1]]), 2),
                ("3 tokens, top-2, E = 3", torch.tensor([[1, 0], [0, 1], [1, 2]]), 3),
                ("6 tokens all to expert 1, top-1, E = 2", torch.ones(6, 1, dtype=torch.long), 2),
                ("16 random tokens, top-1, E = 4", _choices(16, 4, 1, seed=1), 4),
                ("16 random tokens, top-2, E = 4", _choices(16, 4, 2, seed=2), 4),
                ("12 random tokens, top-2, E = 3", _choices(12, 3, 2, seed=3), 3)]
    return [("one token, top-2, E = 2", torch.tensor([[1, 0]]), 2),
            ("5 tokens, one expert", torch.zeros(5, 1, dtype=torch.long), 1),
            ("40 random tokens, top-3, E = 6", _choices(40, 6, 3, seed=4), 6),
            ("64 random tokens, top-2, E = 8, most to experts 0 and 1", _choices(64, 8, 2, seed=5, skew=3.0), 8),
            ("100 random tokens, top-1, E = 16", _choices(100, 16, 1, seed=6), 16)]


def _count(flat: torch.Tensor, n_expert: int) -> torch.Tensor:
    one_hot = F.one_hot(flat, n_expert)
    return ((one_hot.cumsum(0) - 1) * one_hot).sum(1)


def _position_mistakes(experts: torch.Tensor, n_expert: int) -> list[tuple[str, torch.Tensor]]:
    """(what went wrong, the positions it gives) for the usual mistakes, in the order tried."""
    n, k = experts.shape
    right = _reference_positions(experts, n_expert)
    return [
        ("your positions start at 1: a position is the number of earlier choices of the same expert, so the first "
         "arrival is at 0 (the running count, less one)", right + 1),
        ("you counted token by token (token 0's choices, then token 1's, ...): GShard queues every token's first "
         "choice before any second choice, so that second choices are the ones dropped when an expert is full. "
         "Lay the choices out choice-major, experts.t(), before the cumulative sum",
         _count(experts.reshape(-1), n_expert).view(n, k)),
        ("your second choices are counted before the first ones: first choices of every token come first",
         _count(experts.flip(1).t().reshape(-1), n_expert).view(k, n).t().flip(1)),
        ("your second choices start again from 0: they queue behind every first choice of the same expert, in one "
         "count over all k·N choices", torch.stack([_count(experts[:, j], n_expert) for j in range(k)], 1)),
        ("that is each token's index: count per expert, not per token: only the earlier choices that picked the "
         "same expert come before it", torch.arange(n)[:, None].expand(n, k)),
        ("you counted all choices, whatever their expert: a position counts only the earlier choices of the "
         "same expert (a cumulative sum per expert, over the one-hot choices)", torch.arange(k * n).view(k, n).t()),
    ]


def _queue(experts: torch.Tensor, e: int, upto: int) -> str:
    """Expert e's queue in arrival order, up to position ``upto``: 'token 1 (choice 0), ...'."""
    n, k = experts.shape
    seen = [f"token {i} (choice {j})" for j in range(k) for i in range(n) if experts[i, j] == e][:upto + 1]
    return ", ".join(seen if len(seen) <= 8 else [*seen[:3], "...", *seen[-4:]])


def _positions_problem(got: object, experts: torch.Tensor, n_expert: int, label: str) -> str | None:
    n, k = experts.shape
    call = f"positions_in_expert(experts, {n_expert}) for {label}"
    if not isinstance(got, torch.Tensor):
        return f"{call} returned {type(got).__name__}; it must return a tensor (N, k) = ({n}, {k}) of positions"
    if tuple(got.shape) != (n, k):
        return f"{call} returned shape {tuple(got.shape)}; expected (N, k) = ({n}, {k}), one position per choice"
    if got.dtype.is_floating_point or got.dtype == torch.bool:
        return f"{call} returned {got.dtype}; positions index rows: return integers (torch.long)"
    want = _reference_positions(experts, n_expert)
    if torch.equal(got.long(), want):
        return None
    i, j = (got.long() != want).nonzero()[0].tolist()
    e = int(experts[i, j])
    hint = next((what for what, wrong in _position_mistakes(experts, n_expert)
                 if not torch.equal(wrong, want) and torch.equal(got.long(), wrong)), "")
    return (f"{call}: token {i}'s choice {j} (expert {e}): expected position {int(want[i, j])}, found "
            f"{int(got[i, j])}.\n    expert {e}'s queue, in arrival order: {_queue(experts, e, int(want[i, j]))}"
            + (f"\n    hint: {hint}." if hint else ""))


def check_moe_positions(fn: Callable, cases: Sequence[str] = ("small",), timeout: float | None = None) -> None:
    """``fn(experts, n_expert)`` for ``experts`` (N, k) must equal the course's positions on every example.

    Each choice's 0-based arrival order in its expert, the first choices of all tokens before any second one.
    The first difference names the example, the token, the choice and the expert, with the expert's queue.
    """
    _check_names("check_moe_positions", fn, cases, POSITION_CASES)
    _refuse_library_code("check_moe_positions", fn, ANSWERS.exercise, _ADVICE)
    _launch_check(getattr(fn, "__name__", "your function"), 1, _positions_rank, (fn, tuple(cases)), timeout,
                       where="", hint="Does a loop in it never end?", inline=_HINTS, pointers=(_POINTER,))


def _positions_rank(fn: Callable, cases: tuple[str, ...], progress: str) -> list:
    for name in cases:
        where = f"case {name!r} ({POSITION_CASES[name]})"
        for label, experts, n_expert in _position_examples(name):
            Path(progress, "0").write_text(f"{where}, {label}")
            given = experts.clone()
            with watching(ANSWERS):
                got = _as_student(progress, lambda: fn(given, n_expert))
            problem = _positions_problem(got, experts, n_expert, label)
            if problem is None and not torch.equal(given, experts):
                problem = f"positions_in_expert changed its argument experts in place ({label}): leave it as it was"
            if problem:
                return [where, problem]
    Path(progress, "0").write_text("finished")
    return []


# --------------------------------------------------------------------------- #
# Every rank's tokens and routing, and what each rank should receive
# --------------------------------------------------------------------------- #
def _logits(seed: int, s: int, cfg: _Config) -> torch.Tensor:
    """Rank s's router logits (N, E): random, leaning to the low experts so that some choices are dropped."""
    return 2 * _randn((N, cfg.E), seed + 100 * cfg.E + 10 * cfg.k + s) + torch.linspace(1.5, 0, cfg.E)


def _placed(routing: Routing) -> dict[tuple[int, int], tuple[int, int]]:
    """(expert, position) -> (token, choice), for every choice, kept or dropped."""
    return {(int(routing.experts[i, j]), int(routing.positions[i, j])): (i, j)
            for i in range(routing.experts.shape[0]) for j in range(routing.experts.shape[1])}


def _expected_received(tokens: list[torch.Tensor], routings: list[Routing], r: int, local: int) -> torch.Tensor:
    """What rank r's experts receive, (ep·E/ep·C, d): [source rank][local expert][slot], zeros where empty."""
    C = routings[0].capacity
    out = torch.zeros(len(tokens), local, C, D)
    for s, routing in enumerate(routings):
        for (e, c), (i, _) in _placed(routing).items():
            if r * local <= e < (r + 1) * local and c < C:
                out[s, e - r * local, c] = tokens[s][i]
    return out.view(-1, D)


def _row_name(row: int, r: int, local: int, C: int) -> str:
    s, rest = divmod(row, local * C)
    l, c = divmod(rest, C)
    return f"row {row} = (from rank {s}, local expert {l} = expert {r * local + l}, slot {c})"


def _choice_text(routing: Routing, i: int, j: int, local: int) -> str:
    e, p, C = int(routing.experts[i, j]), int(routing.positions[i, j]), routing.capacity
    if p >= C:
        return f"its choice {j} to expert {e} at position {p}, dropped: past the capacity C = {C}"
    return f"its choice {j} to expert {e}, slot {p}, which rank {e // local} receives"


def _over_capacity(routing: Routing, e: int, whose: str) -> str:
    """'expert e is over capacity in <whose> routing: ...': how many of its choices are past C."""
    C = routing.capacity
    n = int(((routing.experts == e) & (routing.positions >= C)).sum())
    past = f"{n} choices, at positions {C} to {C + n - 1}, are" if n > 1 else f"one choice, at position {C}, is"
    return (f"expert {e} is over capacity in {whose} routing: its tokens chose it {C + n} times for C = {C} "
            f"slots, so {past} past C")


def _overflow(got: torch.Tensor, want: torch.Tensor, tokens: list[torch.Tensor], routings: list[Routing], r: int,
              local: int, lead: str = "a dropped choice was sent") -> str:
    """The capacity hint if rank r received a choice past its expert's capacity; '' if none arrived.

    Sending every choice, dropped ones too, puts a choice at position p >= C at row expert·C + p: past its
    expert's C slots, into the next expert's (or past the buffer, for the last expert: ``_student``); with the
    position taken modulo C, or clamped, it lands on its own expert's slots. A slot that holds (or adds) a token
    that only such a choice could have put there names the expert that overflowed, and by how many.
    """
    C, ep = routings[0].capacity, len(tokens)
    got, want = got.detach().reshape(ep, local, C, -1), want.view(ep, local, C, -1)
    for s, routing in enumerate(routings):
        dropped = sorted(((int(routing.experts[i, j]), int(routing.positions[i, j]), i, j)
                          for i, j in (~routing.kept).nonzero().tolist()))
        for l, c in ((l, c) for l in range(local) for c in range(C)):
            e, row, slot = r * local + l, got[s, l, c], want[s, l, c]
            if torch.equal(row, slot):
                continue
            for owner, p, i, j in dropped:
                token = tokens[s][i]
                if not (torch.equal(row, token) or (slot.any() and torch.allclose(row, slot + token, atol=1e-6))):
                    continue
                if owner * C + p == e * C + c:
                    how = (f"went to row expert·C + position = {owner * C + p} of the send buffer: past expert "
                           f"{owner}'s C slots, into expert {e}'s slot {c}")
                elif owner == e and p % C == c:
                    how = f"wrapped round onto expert {e}'s slot {c} = {p} mod C, the slot of a kept choice"
                elif owner == e and c == C - 1:
                    how = f"was clamped onto expert {e}'s last slot, {c}, the slot of a kept choice"
                elif not routing.kept[i].any():
                    how = f"arrived in expert {e}'s slot {c}, though every choice of token {i} was dropped"
                else:
                    continue
                whose = f"rank {s}'s"
                return (f"{lead}: {_over_capacity(routing, owner, whose)}. Token {i}'s choice {j} ({whose}), at "
                        f"position {p}, {how}. {_DROP}")
    return ""


def _received_problem(got: torch.Tensor, want: torch.Tensor, tokens: list[torch.Tensor], routings: list[Routing],
                      place: _Place, local: int) -> str | None:
    if torch.equal(got.detach(), want):
        return None
    r, C = place.r, routings[0].capacity
    row = int((got.detach() != want).any(1).nonzero()[0])
    s = row // (local * C)
    e, c = r * local + (row % (local * C)) // C, row % C
    placed = _placed(routings[s])
    owner, filled = placed.get((e, c)), sum(1 for (x, p) in placed if x == e and p < C)
    expected = (f"token {owner[0]} of rank {s} (its choice {owner[1]})" if owner else
                f"zeros (an empty slot: rank {s}'s tokens fill {filled} of expert {e}'s C = {C} slots)")
    found_row, hint = got.detach()[row], _overflow(got, want, tokens, routings, r, local)
    match = [(q, i) for q in range(len(tokens)) for i in range(N) if torch.equal(found_row, tokens[q][i])]
    if not found_row.any():
        found = "zeros"
        if owner and owner[1] > 0 and torch.equal(got.detach(), _first_choices_only(tokens, routings, place, local)):
            hint = "only first choices arrived: send every kept choice, j = 0 to k-1"
    elif match:
        q, i = match[0]
        found = f"token {i} of rank {q}"
        choices = [_choice_text(routings[q], i, j, local) for j in range(routings[q].experts.shape[1])]
        found += f" ({'; '.join(choices)})"
        hint = hint or _LAYOUT
    else:
        gated = [(q, i, j) for q in range(len(tokens)) for i in range(N) for j in range(routings[q].experts.shape[1])
                 if torch.allclose(found_row, tokens[q][i] * routings[q].gates[i, j].detach(), atol=1e-6)]
        found = f"a row that is no token of any rank (largest |value| {found_row.abs().max().item():.3g})"
        if gated:
            q, i, j = gated[0]
            found = f"token {i} of rank {q} times its choice {j}'s gate"
            hint = hint or "dispatch sends the tokens as they are; combine applies the gates to the experts' outputs"
    return (f"the received buffer, {_row_name(row, r, local, C)}: expected {expected}, found {found}"
            + (f"\n    hint: {hint}" if hint else ""))


def _first_choices_only(tokens: list[torch.Tensor], routings: list[Routing], place: _Place,
                        local: int) -> torch.Tensor:
    firsts = [Routing(r.experts[:, :1], r.gates[:, :1], r.positions[:, :1], r.kept[:, :1], r.probs, r.logits,
                      r.capacity) for r in routings]
    return _expected_received(tokens, firsts, place.r, local)


def _expected_token_grad(ups: list[torch.Tensor], routing: Routing, r: int, local: int) -> torch.Tensor:
    """Rank r's token gradient: each kept choice's row of its expert's rank's upstream gradient, summed per token."""
    C, grad = routing.capacity, torch.zeros(N, D)
    for j in range(routing.experts.shape[1]):
        for i in range(N):
            if routing.kept[i, j]:
                e, p = int(routing.experts[i, j]), int(routing.positions[i, j])
                grad[i] += ups[e // local][r * local * C + (e % local) * C + p]
    return grad


# --------------------------------------------------------------------------- #
# Check 2: dispatch on ep ranks
# --------------------------------------------------------------------------- #
def _launch(check: str, label: str, rank_case: Callable, students: tuple, cases: Sequence[str],
            timeout: float | None) -> None:
    for student in students:
        _check_names(check, student, cases, MOE_CASES)
        _refuse_library_code(check, student, ANSWERS.exercise, _ADVICE)
    chosen = [case for name in cases for case in MOE_CASES[name][1]]
    for world in sorted({case.world for case in chosen}):
        mine = tuple(case for case in chosen if case.world == world)
        _launch_check(label, world, _rank, (rank_case, students, mine), timeout, where=f" on {world} ranks",
                           hint=_HINT, inline=_HINTS, pointers=(_POINTER,))


def _rank(rank_case: Callable, students: tuple, cases: tuple[_Case, ...], progress: str) -> list:
    def run(place: _Place, cfg: _Config) -> str | None:
        place.label, place.calls = str(cfg), []
        problem = rank_case(*students, place, cfg, progress)
        return f"{place.who()}{problem}{place.group_hint()}" if problem else problem

    def steps():
        for case in cases:
            place = _Place(case, progress)
            for cfg in _configs(case.ep):
                yield f"{case}, {cfg}", partial(run, place, cfg)
    return _stop_at_first_failure(steps(), progress)


def _call(fn: Callable, arguments: str) -> str:
    """How a message writes the call of the student's function: its own name (``dispatch_padded``, ...)."""
    return getattr(fn, "__name__", "your function") + arguments


def check_moe_dispatch(dispatch: Callable, cases: Sequence[str] = ("small",), timeout: float | None = None) -> None:
    """``dispatch(tokens, routing, n_expert, group)`` on every group of ``cases``, with the course's routing.

    Rank r must return (ep·E/ep·C, d): from each source rank s, for each of its experts, the C slots of s's
    kept choices to that expert, token rows as they are, zeros in empty slots; one all-to-all forward on the
    group with equal splits of E/ep·C rows; backward, each token's gradient the sum of its kept choices' rows
    of the upstream gradients on their experts' ranks, sent back by one all-to-all of the same rows.
    """
    _launch("check_moe_dispatch", getattr(dispatch, "__name__", "your function"), _dispatch_case, (dispatch,),
            cases, timeout)


def _dispatch_case(dispatch: Callable, place: _Place, cfg: _Config, progress: str) -> str | None:
    ep, r, local, C = place.ep, place.r, cfg.E // place.ep, cfg.C
    tokens = [_randn((N, D), place.seed + s) for s in range(ep)]
    routings = [route(_logits(place.seed, s, cfg), cfg.k, cfg.cf) for s in range(ep)]
    want = _expected_received(tokens, routings, r, local)                     # (ep·E/ep·C, d)
    ups = [_randn((ep * local * C, D), place.seed + 50 + q) for q in range(ep)]
    x, routing = tokens[r].clone().requires_grad_(), routings[r]
    with watching(ANSWERS), place.recording():
        place.at("dispatch's forward")
        got = _student(progress, lambda: dispatch(x, routing, cfg.E, place.group), routing, cfg.E, place)
        problem = _form(_call(dispatch, "(tokens, routing, n_expert, group)"), got, want, "(ep·E/ep·C, d)")
        problem = problem or _received_problem(got, want, tokens, routings, place, local)
        problem = problem or place.traffic("dispatch's forward", 1, cfg.E * C, ["dispatch's forward"])
        if problem is None and not got.requires_grad:
            problem = ("the received rows do not require grad: autograd cannot send the gradients back. Use the given "
                       "all_to_all (an autograd function whose backward is the reverse all-to-all), and build the "
                       "send buffer from tokens with differentiable operations (index_copy, not .data or no_grad)")
        problem = place.agree(problem)
        if problem is not None:
            return problem
        place.at("dispatch's backward")
        _as_student(progress, lambda: got.backward(ups[r]))
        grad, want_grad = x.grad, _expected_token_grad(ups, routing, r, local)
        if grad is None:
            return "autograd never reached the tokens: tokens.grad is None after backward (a .detach() on the way?)"
        if not torch.equal(grad, want_grad):
            i = int((grad != want_grad).any(1).nonzero()[0])
            kept = [f"choice {j} to expert {int(routing.experts[i, j])}, slot {int(routing.positions[i, j])}"
                    for j in range(cfg.k) if routing.kept[i, j]]
            return (f"tokens.grad of token {i} differs from the sum of its kept choices' gradients ("
                    f"{'; '.join(kept) or 'none: every choice dropped, so it must be zero'}) by up to "
                    f"{(grad[i] - want_grad[i]).abs().max().item():.3g}: the backward all-to-all returns each row's "
                    "gradient to the slot it came from")
        return place.traffic("dispatch's backward", 1, cfg.E * C, ["dispatch's backward"])


def _student(progress: str, call: Callable, routing: Routing, n_expert: int, place: _Place) -> object:
    """``_as_student``, with a hint in the error: a dropped choice's row past the E·C rows, or another group."""
    try:
        return _as_student(progress, call)
    except Exception:
        rows = routing.experts * routing.capacity + routing.positions
        hint = place.group_hint()
        if bool((rows >= n_expert * routing.capacity).any()):
            i, j = (rows >= n_expert * routing.capacity).nonzero()[0].tolist()
            over = _over_capacity(routing, int(routing.experts[i, j]), "this rank's")
            hint += (f"\n    hint: {over}, and token {i}'s choice {j}, at position {int(routing.positions[i, j])}, "
                     f"has row expert·C + position = {int(rows[i, j])}, past the buffer's E·C = "
                     f"{n_expert * routing.capacity} rows, so sending it (or reading its output back) fails as "
                     f"above. {_DROP}")
        with Path(progress, f"{dist.get_rank()}.error").open("a") as error:
            error.write(hint)
        raise


def _form(call: str, got: object, want: torch.Tensor, shape: str) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"{call} returned {type(got).__name__}; it must return a tensor {shape} = {tuple(want.shape)}"
    if tuple(got.shape) != tuple(want.shape):
        return f"{call} returned shape {tuple(got.shape)}; expected {shape} = {tuple(want.shape)}"
    return None


# --------------------------------------------------------------------------- #
# Check 3: the layer from the three functions, against one process
# --------------------------------------------------------------------------- #
def check_moe_combine(positions_in_expert: Callable, dispatch: Callable, combine: Callable,
                      cases: Sequence[str] = ("small",), timeout: float | None = None) -> None:
    """The layer of the three functions on every group of ``cases``, against ``MoE(groups=ep)`` in one process.

    Each rank keeps the router and its E/ep experts of one ``MoE`` (the same seed on every rank), routes its
    own tokens with ``positions_in_expert``, sends them with ``dispatch``, runs its experts on each
    (source rank, local expert) block of C rows, and adds the outputs with ``combine(outputs, routing,
    group)``. Its output, its input gradient, its router's gradient (from its own tokens) and its experts'
    gradients (from every rank's) must equal one process's within ``MOE_TOL``, with two all-to-alls of E·C
    rows forward (dispatch, combine) and two backward.
    """
    names = ", ".join(getattr(f, "__name__", "your function") for f in (positions_in_expert, dispatch, combine))
    _launch("check_moe_combine", f"the layer of {names}", _layer_case, (positions_in_expert, dispatch, combine),
            cases, timeout)


@dataclass
class _OneProcess:
    """What one process computes for rank r: its output and gradients, and its routing for the hints."""

    out: torch.Tensor
    x_grad: torch.Tensor
    router_grad: torch.Tensor
    expert_grads: dict[str, torch.Tensor]
    routing: Routing
    returned: torch.Tensor        # (E·C, d): each slot's expert output, as combine gets it back


def _one_process(full: MoE, xs: list[torch.Tensor], ups: list[torch.Tensor], r: int, mine: range) -> _OneProcess:
    ep, ref = len(xs), copy.deepcopy(full)
    ref.groups = ep                                      # GShard groups = ranks: the parallel layer's routing
    x = torch.cat(xs).requires_grad_()                   # (ep B, T, d): group r = rank r's tokens
    out = ref(x)
    mine_out = out[r * B:(r + 1) * B]
    router_grad, = torch.autograd.grad((mine_out * ups[r]).sum(), ref.router.weight, retain_graph=True)
    (out * torch.cat(ups)).sum().backward()
    tokens = xs[r].reshape(N, D)
    with torch.no_grad():
        routing = route(full.router(tokens), full.top_k, full.capacity_factor)
        C, buffer = routing.capacity, torch.zeros(full.n_expert * routing.capacity, D)
        for (e, c), (i, _) in _placed(routing).items():
            if c < C:
                buffer[e * C + c] = tokens[i]
        returned = torch.cat([full.experts[e](buffer[e * C:(e + 1) * C]) for e in range(full.n_expert)])
    grads = {f"expert {e}'s {n}": p.grad for e in mine for n, p in ref.experts[e].named_parameters()}
    return _OneProcess(mine_out.detach().reshape(N, D), x.grad[r * B:(r + 1) * B].reshape(N, D),
                       router_grad, grads, routing, returned)


def _layer(seed: int, cfg: _Config, ep: int) -> tuple[MoE, list[torch.Tensor]]:
    """The MoE (no auxiliary losses: the layer under test has none) and every rank's tokens (B, T, d)."""
    torch.manual_seed(seed + cfg.E)                      # the same layer on every rank of the group
    full = MoE(D, cfg.E, cfg.k, cfg.cf, aux_loss_coef=0.0, z_loss_coef=0.0).train(False)
    return full, [_randn((B, T, D), seed + 200 + s) for s in range(ep)]


def _layer_case(positions_in_expert: Callable, dispatch: Callable, combine: Callable, place: _Place, cfg: _Config,
                progress: str) -> str | None:
    ep, r, local, C = place.ep, place.r, cfg.E // place.ep, cfg.C
    full, xs = _layer(place.seed, cfg, ep)

    ups = [_randn((B, T, D), place.seed + 300 + s) for s in range(ep)]
    mine = range(r * local, (r + 1) * local)
    want = _one_process(full, xs, ups, r, mine)
    router, experts = copy.deepcopy(full.router), {e: copy.deepcopy(full.experts[e]) for e in mine}
    with torch.no_grad():        # every rank's routing (its positions checked first), for the capacity hint
        tokens = [t.reshape(N, D) for t in xs]
        routings = [route(full.router(t), cfg.k, cfg.cf) for t in tokens]
    x = xs[r].reshape(N, D).clone().requires_grad_()
    with watching(ANSWERS), place.recording():
        place.at("forward, positions_in_expert")
        logits = router(x)                                                       # (N, E)
        probs = F.softmax(logits, dim=-1)
        top, chosen = probs.topk(cfg.k, dim=-1)                                  # (N, k)
        gates = top if cfg.k == 1 else top / top.sum(dim=-1, keepdim=True)
        pos = _as_student(progress, lambda: positions_in_expert(chosen.clone(), cfg.E))
        problem = _positions_problem(pos, chosen, cfg.E, f"rank {r}'s {N} tokens, {cfg}")
        problem = place.agree(f"your {problem}\n    {_POINTER}" if problem else None)
        if problem is not None:
            return problem
        routing = Routing(chosen, gates, pos.long(), pos.long() < C, probs, logits, C)
        place.at("forward, dispatch")
        received = _student(progress, lambda: dispatch(x, routing, cfg.E, place.group), routing, cfg.E, place)
        problem = place.agree(_form(_call(dispatch, "(tokens, routing, n_expert, group)"), received,
                                    torch.empty(cfg.E * C, D), "(ep·E/ep·C, d)"))     # before combine's all-to-all
        if problem is not None:
            return problem
        blocks = received.view(ep, local, C, D)                                   # [source][local expert][slot]
        outputs = torch.stack([experts[e](blocks[:, e - r * local]) for e in mine], 1).reshape(-1, D)
        place.at("forward, combine")
        y = _student(progress, lambda: combine(outputs, routing, place.group), routing, cfg.E, place)
        problem = (_form(_call(combine, "(outputs, routing, group)"), y, want.out, "(N, d)")
                   or _output_problem(y, want, routing, cfg, lambda: _overflow(
                       received, _expected_received(tokens, routings, r, local), tokens, routings, r, local,
                       "your dispatch sent a dropped choice (check_moe_dispatch names the row it landed in)"))
                   or place.traffic("the layer's forward", 2, cfg.E * C,
                                    ["forward, positions_in_expert", "forward, dispatch", "forward, combine"]))
        if problem is None and not y.requires_grad:
            problem = ("combine's output does not require grad: keep it in the graph (the given all_to_all, and "
                       "the gates and outputs without .detach())")
        problem = place.agree(problem)
        if problem is not None:
            return problem
        place.at("backward")
        _as_student(progress, lambda: y.backward(ups[r].reshape(N, D)))
        cut, unreached = str(_CUT), str(_UNREACHED)
        return (next(filter(None, (_grad_problem(f"expert {e}'s {n} gradient", p.grad,
                                                 want.expert_grads[f"expert {e}'s {n}"], unreached)
                                   for e in mine for n, p in experts[e].named_parameters())), None)
                or _grad_problem("the router's weight gradient", router.weight.grad, want.router_grad, cut, cut)
                or _grad_problem("the input gradient x.grad", x.grad, want.x_grad)
                or place.traffic("the layer's backward", 2, cfg.E * C, ["backward"]))


def _output_problem(y: torch.Tensor, want: _OneProcess, routing: Routing, cfg: _Config,
                    overflow: Callable[[], str] = str) -> str | None:
    """None if combine's output is the one-process layer's; else the first token that differs, with a hint.

    ``overflow()``: the capacity hint if dispatch delivered a choice past its expert's capacity, the cause
    to name before any of combine's own mistakes.
    """
    diff = (y.detach() - want.out).abs().amax(1)
    if not diff.max() > MOE_TOL and not torch.isnan(diff).any():
        return None
    i, C, ret = int((diff > MOE_TOL).logical_or(diff.isnan()).nonzero()[0]), cfg.C, want.returned
    experts, pos, kept, gates = routing.experts, routing.positions, routing.kept, routing.gates.detach()
    choices = "; ".join(f"choice {j}: expert {int(experts[i, j])}, " + (
        f"slot {int(pos[i, j])} (row {int(experts[i, j]) * C + int(pos[i, j])} of the returned buffer), gate "
        f"{float(gates[i, j]):.3f}" if kept[i, j] else f"position {int(pos[i, j])}, dropped (C = {C})")
        for j in range(cfg.k))
    hint = overflow() or _combine_mistake(y.detach()[i], i, routing, cfg, ret)
    return (f"token {i}'s output differs from the one-process layer's by up to {float(diff[i]):.3g} (tolerance "
            f"{MOE_TOL:g}); its {choices}" + (f"\n    hint: {hint}" if hint else ""))


def _combine_mistake(found: torch.Tensor, i: int, routing: Routing, cfg: _Config, ret: torch.Tensor) -> str:
    """What combine did with token i's choices, if a usual mistake gives its output ``found``; '' if none."""
    C, experts, pos, kept, gates = cfg.C, routing.experts, routing.positions, routing.kept, routing.gates.detach()
    slot = (experts * C + pos).clamp(max=cfg.E * C - 1)
    plain = sum(kept[:, j, None] * ret[slot[:, j]] for j in range(cfg.k))
    swapped = sum(kept[:, j, None] * gates[:, cfg.k - 1 - j, None] * ret[slot[:, j]] for j in range(cfg.k))
    hint = ""
    if torch.allclose(found, plain[i], atol=MOE_TOL):
        hint = "the gate is not applied: add gate × output for each kept choice (routing.gates[:, j])"
    elif cfg.k > 1 and torch.allclose(found, swapped[i], atol=MOE_TOL):
        hint = ("choice j's output is weighted by another choice's gate: in step j, take the output of row "
                "expert·C + position of choice j and routing.gates[:, j]")
    elif not kept[i].any():
        hint = ("every choice of this token was dropped, so its output must be zero (the block's residual connection "
                "carries it past the layer): add only the kept choices (routing.kept)")
    elif not kept[i].all():
        hint = "a dropped choice adds nothing: add only the kept choices (routing.kept)"
    else:
        for j in range(cfg.k):       # one choice read from another row of the returned buffer?
            rest = found - sum(gates[i, q] * ret[slot[i, q]] for q in range(cfg.k) if q != j)
            rows = [R for R in range(cfg.E * C) if torch.allclose(rest, gates[i, j] * ret[R], atol=MOE_TOL)]
            if rows:
                R = rows[0]
                hint = (f"choice {j}'s output was read from row {R} (expert {R // C}, slot {R % C}) of the buffer "
                        f"the all-to-all returned, not row expert·C + position = {int(slot[i, j])}: combine's "
                        "all-to-all puts every row back where dispatch took it from, the send buffer's layout")
                break
    return hint


def _grad_problem(name: str, got: object, want: torch.Tensor, if_none: str = "", if_zero: str = "") -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"{name} is None after backward: " + (if_none or "autograd never reached it (a .detach() on the way?)")
    diff = (got - want).abs().max().item()
    if diff <= MOE_TOL:                                     # False for NaN too
        return None
    return (f"{name} differs from the one-process layer's by up to {diff:.3g} (tolerance {MOE_TOL:g})"
            + (f"\n    hint: {if_zero}" if if_zero and not got.any() else ""))
