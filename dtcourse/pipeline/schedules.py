"""Pipeline schedules as data: for each rank, the order in which it runs forwards and backwards.

p ranks, m micro-batches, v chunks (stages) per rank: p·v stages, and rank r holds stages
r, r + p, ..., r + (v-1)p (torch's looped placement, ``stage % p``). Every generator returns a
``Schedule`` (rank -> list of ``Action``) holding compute and, last on each rank, the optimizer step of
each of its stages; ``with_communication`` then adds the sends and receives. Orders follow
``torch.distributed.pipelining`` action by action, ``without_steps`` (tests check it)::

    one_f_one_b(3, 4)[2]        # [2F0, 2B0, 2F1, 2B1, 2F2, 2B2, 2F3, 2B3, 2STEP]

* ``naive``: model parallelism with one batch; one rank works at a time (the idle-device problem).
* ``gpipe``: all forwards, then all backwards (Huang et al., arXiv 1811.06965).
* ``one_f_one_b``: PipeDream-flush (Narayanan et al., arXiv 2006.09503; Megatron, arXiv 2104.04473).
* ``interleaved_1f1b``: v chunks per rank, Megatron's interleaved schedule (arXiv 2104.04473).
* ``zb_h1``: zero-bubble's handcrafted ZB-H1, backward split into I and W (Qi et al., arXiv 2401.10241).
"""

from __future__ import annotations

from dtcourse.pipeline.actions import COMMUNICATION, STEP, Action, Schedule
from dtcourse.pipeline.partition import rank_of_stage

__all__ = ["naive", "gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1", "with_communication", "with_steps",
           "SCHEDULES", "build"]


def _check(name: str, p: int, m: int) -> None:
    if p < 1:
        raise ValueError(f"{name}: a pipeline needs at least one rank, got p = {p}.")
    if m < 1:
        raise ValueError(f"{name}: a step needs at least one micro-batch, got m = {m}.")


def with_steps(schedule: Schedule) -> Schedule:
    """Each rank's list followed by a ``STEP`` for each stage it runs, in the order their last backward ends.

    ``with_steps({0: [0F0, 0B0]}) == {0: [0F0, 0B0, 0STEP]}``. The step waits for the flush: every
    micro-batch's weight gradient (B, or W when split) must be in before the weights change, and the
    next step's forwards then all see the new weights (no weight stashing, unlike PipeDream).
    """
    out: Schedule = {}
    for r, actions in schedule.items():
        last = {a.stage: i for i, a in enumerate(actions) if a.kind in ("B", "W")}
        stages = sorted(last, key=last.get) + sorted({a.stage for a in actions} - set(last))
        out[r] = list(actions) + [Action(s, STEP) for s in stages]
    return out


def naive(p: int) -> Schedule:
    """Plain model parallelism, one batch (m = 1): rank r waits for r forwards, then 2(p-1-r) backwards.

    ``naive(2) == {0: [0F0, 0B0, 0STEP], 1: [1F0, 1B0, 1STEP]}``; the bubble is (p-1)/p of the step.
    """
    return gpipe(p, 1)


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (arXiv 1811.06965): every forward, then every backward, in micro-batch order.

    ``gpipe(2, 2)[0] == [0F0, 0F1, 0B0, 0B1, 0STEP]``. Keeps m micro-batches of activations per rank.
    Backwards go 0, 1, ..., m-1 as in torch's ``ScheduleGPipe`` (any order gives the same bubble).
    """
    _check("gpipe", p, m)
    return with_steps({r: [Action(r, "F", j) for j in range(m)] + [Action(r, "B", j) for j in range(m)]
                       for r in range(p)})


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B, PipeDream-flush (arXiv 2006.09503, 2104.04473): warm-up, steady one-forward-one-backward, cool-down.

    ``one_f_one_b(2, 3)[0] == [0F0, 0F1, 0B0, 0F2, 0B1, 0B2, 0STEP]``. Rank r runs p-1-r warm-up
    forwards, so it never holds more than p - r micro-batches of activations (GPipe holds m); the
    optimizer step comes last, once the cool-down has flushed every micro-batch.
    """
    _check("one_f_one_b", p, m)
    schedule: Schedule = {}
    for r in range(p):
        warmup = min(p - 1 - r, m)
        ops = [Action(r, "F", j) for j in range(warmup)]
        for j in range(m - warmup):                       # steady state: F of a new one, B of the oldest
            ops += [Action(r, "F", warmup + j), Action(r, "B", j)]
        ops += [Action(r, "B", j) for j in range(m - warmup, m)]   # cool-down
        schedule[r] = ops + [Action(r, STEP)]                      # the flush is over: update the weights
    return schedule


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., arXiv 2104.04473, section 2.2): v chunks per rank, depth first.

    ``interleaved_1f1b(2, 2, 2)[0] == [0F0, 0F1, 2F0, 2F1, 2B0, 2B1, 0B0, 0B1, 2STEP, 0STEP]``.
    Micro-batches go through a rank's chunks in groups of p, so a chunk's work waits on the other ranks' 1/v-sized
    chunks only: the bubble shrinks to (p-1)/(v·m + p-1) at the price of v times more messages.
    """
    _check("interleaved_1f1b", p, m)
    if v < 2:
        raise ValueError(f"interleaved_1f1b: v = {v} chunks per rank; interleaving needs v >= 2 "
                         "(for one chunk per rank use one_f_one_b).")
    if m % p:
        raise ValueError(f"interleaved_1f1b: m = {m} micro-batches is not a multiple of p = {p} ranks, "
                         f"as Megatron requires; use m = {(m // p + 1) * p} (or {max(p, m // p * p)}).")
    total = m * v                                          # forwards (and backwards) on each rank

    def stage(k: int, r: int, forward: bool) -> int:       # the k-th forward (backward) runs this stage
        chunk = (k % (p * v)) // p                         # p micro-batches through chunk 0, then chunk 1, ...
        return (chunk if forward else v - 1 - chunk) * p + r

    def microbatch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    schedule: Schedule = {}
    for r in range(p):
        # Megatron's warm-up: 2 per hop from the last rank, plus a full round for the extra chunks.
        # (Megatron once ran all forwards first when m == p; torch and this module do not.)
        warmup = min(2 * (p - 1 - r) + (v - 1) * p, total)
        ops = [Action(stage(k, r, True), "F", microbatch(k)) for k in range(warmup)]
        for k in range(total - warmup):
            ops += [Action(stage(warmup + k, r, True), "F", microbatch(warmup + k)),
                    Action(stage(k, r, False), "B", microbatch(k))]
        ops += [Action(stage(k, r, False), "B", microbatch(k)) for k in range(total - warmup, total)]
        schedule[r] = ops
    return with_steps(schedule)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., arXiv 2401.10241, section 3.1): 1F1B with B split into I (input grad) and W (weights).

    ``zb_h1(2, 2)[1] == [1F0, 1I0, 1F1, 1I1, 1W0, 1W1, 1STEP]``. Only I lies on the critical path back to
    rank 0, so the backward wave runs faster; rank r delays its W's by r micro-batches, which fills
    the cool-down bubble (the later ranks finish their I's earliest). Activations are freed at W, so
    rank r holds up to (p - r) + r = p micro-batches: rank 0's peak, the same as 1F1B's.
    The bubble drops from (p-1)(t_f + t_b) to (p-1)(t_f + t_i - t_w): a third of 1F1B's when all equal.
    """
    _check("zb_h1", p, m)
    schedule: Schedule = {}
    for r in range(p):
        warmup = min(p - 1 - r, m)
        ops = [Action(r, "F", j) for j in range(warmup)]
        w_next = 0                                           # the oldest micro-batch still missing its W
        for j in range(m):
            if j < m - warmup:
                ops.append(Action(r, "F", warmup + j))       # steady state; none left in cool-down
            ops.append(Action(r, "I", j))
            if j >= r:                                       # W lags I by r micro-batches on rank r
                ops.append(Action(r, "W", w_next))
                w_next += 1
        ops += [Action(r, "W", j) for j in range(w_next, m)]  # the delayed W's fill the cool-down
        schedule[r] = ops
    return with_steps(schedule)


SCHEDULES = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b,
             "interleaved_1f1b": interleaved_1f1b, "zb_h1": zb_h1}


def build(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule ``name`` (a key of ``SCHEDULES``), without messages, for p ranks, m micro-batches, v chunks.

    ``build("1f1b", 4, 8) == one_f_one_b(4, 8)``; naive ignores m, and only interleaving takes v.
    """
    if name == "naive":
        return naive(p)
    return interleaved_1f1b(p, m, v) if name == "interleaved_1f1b" else SCHEDULES[name](p, m)


def _message(action: Action, p: int, n: int) -> tuple[Action, Action] | None:
    """(send, receive) that ``action``'s result needs, when the next consumer lives on another rank."""
    if action.kind == "F" and action.stage < n - 1 and rank_of_stage(action.stage + 1, p) != rank_of_stage(action.stage, p):
        return Action(action.stage, "SEND_F", action.microbatch), Action(action.stage + 1, "RECV_F", action.microbatch)
    if action.kind in ("B", "I") and action.stage > 0 and rank_of_stage(action.stage - 1, p) != rank_of_stage(action.stage, p):
        return Action(action.stage, "SEND_B", action.microbatch), Action(action.stage - 1, "RECV_B", action.microbatch)
    return None


def _ready(action: Action, placed: set[Action], n: int) -> bool:
    """Whether ``action``'s input is on its rank: received, or made by a stage of the same rank.

    (A STEP's inputs are its own stage's weight gradients, earlier in the same list.)"""
    s, j = action.stage, action.microbatch
    if action.kind == "F" and s > 0:
        return Action(s, "RECV_F", j) in placed or Action(s - 1, "F", j) in placed
    if action.kind in ("B", "I") and s < n - 1:
        return (Action(s, "RECV_B", j) in placed or Action(s + 1, "B", j) in placed
                or Action(s + 1, "I", j) in placed)
    return True


def with_communication(schedule: Schedule, p: int, v: int = 1) -> Schedule:
    """Insert SEND_F/RECV_F/SEND_B/RECV_B wherever a stage's output goes to another rank.

    ``with_communication(one_f_one_b(2, 1), 2)[1] == [1RECV_F0, 1F0, 1B0, 1SEND_B0, 1STEP]``.
    The same lowering as torch's ``_add_send_recv``: the ranks take turns placing their next compute
    action once its input has been received; the moment one is placed, its send goes right after
    it and the matching receive onto the end of the receiver's list. So every list follows one
    global sequence of messages, and the earliest unfinished message always has both ends posted:
    no deadlock even if each send blocks until its receive is posted (or with batched p2p).
    """
    n = p * v
    todo = {r: list(schedule[r]) for r in range(p)}
    out: Schedule = {r: [] for r in range(p)}
    placed: dict[int, set[Action]] = {r: set() for r in range(p)}
    nxt = {r: 0 for r in range(p)}
    while any(nxt[r] < len(todo[r]) for r in range(p)):
        progress = False
        for r in range(p):                                   # one turn each, in rank order
            if nxt[r] == len(todo[r]):
                continue
            action = todo[r][nxt[r]]
            if action.kind in COMMUNICATION:
                raise ValueError(f"with_communication: rank {r}, step {nxt[r]}: {action} is already a "
                                 "communication action; pass a schedule without messages.")
            if not _ready(action, placed[r], n):
                continue                                     # its input hasn't been sent yet
            out[r].append(action)
            placed[r].add(action)
            message = _message(action, p, n)
            if message:
                send, recv = message
                out[r].append(send)
                placed[r].add(send)
                out[rank_of_stage(recv.stage, p)].append(recv)
                placed[rank_of_stage(recv.stage, p)].add(recv)
            nxt[r] += 1
            progress = True
        if not progress:
            stuck = "; ".join(f"rank {r}, step {nxt[r]}: {todo[r][nxt[r]]}" for r in range(p) if nxt[r] < len(todo[r]))
            raise ValueError(f"with_communication: no rank can place its next action, each waits for an input "
                             f"that is never sent ({stuck}); run validate() on the compute schedule to see why.")
    return out
