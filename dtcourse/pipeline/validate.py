"""Check a pipeline schedule before anything runs: complete, in dependency order, and free of deadlock.

A hung pipeline step gives no error message, only silence; ``validate`` turns each way to hang or to
compute garbage into a ``ValueError`` naming the rank, the step (0-based position in its list), the
action and what it is missing::

    validate(one_f_one_b(4, 8), p=4, m=8)                       # fine: returns None
    validate(with_communication(zb_h1(4, 8), 4), p=4, m=8)       # fine, sends and receives included
    validate({0: [0F0, 0B0, 0F1, 0B1], 1: [1F1, 1F0, 1B0, 1B1]}, p=2, m=2)   # (Actions)
    # ValueError: deadlock, no rank can proceed: rank 0, step 1: 0B0 needs 1B0 (the gradient from
    # stage 1), which comes later on rank 1 (step 2, behind 1F1); rank 1, step 0: 1F1 needs 0F1 ...

The checks, in order: every action belongs to its rank and its stage/micro-batch exist; every
(stage, micro-batch) has one F and one backward (B, or I then W) and nothing twice; the optimizer
step, ``STEP``, either on every stage once, after all of that stage's weight gradients (B or W), or on
none (torch's schedules leave it to the caller); on each rank F comes before its own backward, I
before W, and a stage's input before its use. With communication
(any SEND/RECV present): each cross-rank input has a RECV before its use and a SEND after the
producer, every send has its receive, and the k-th send from rank a to rank b is the k-th receive
on b from a (gloo and NCCL match point-to-point messages in order, so a swap delivers wrong tensors).
Last, the ranks are played against each other: without communication actions a rank waits until
the action it needs has run on the other rank; with them, a run of consecutive SEND/RECVs is one
batch (``batch_isend_irecv``) whose ops complete only once the peer has posted the partner op, the
strictest model, so an order that passes cannot hang with eager or with rendezvous sends (NCCL's
send kernel waits for its receive). ``blocking=False`` models an executor that waits for a send only
at the end of the step and for a receive only at the compute that uses it (gloo's buffered sends).
"""

from __future__ import annotations

from collections import Counter

from dtcourse.pipeline.actions import COMMUNICATION, STEP, Action, Schedule

__all__ = ["validate", "partner"]

_SEND_TO = {"SEND_F": (+1, "RECV_F"), "SEND_B": (-1, "RECV_B")}    # kind -> (stage step, partner kind)
_RECV_FROM = {"RECV_F": (-1, "SEND_F"), "RECV_B": (+1, "SEND_B")}


def partner(action: Action) -> Action:
    """The other end of a message: ``partner(Action(1, "SEND_F", 3)) == Action(2, "RECV_F", 3)``."""
    step, kind = {**_SEND_TO, **_RECV_FROM}[action.kind]
    return Action(action.stage + step, kind, action.microbatch)


def _what(needed: Action) -> str:
    if needed.kind == "F":
        return f"the activation from stage {needed.stage}"
    if needed.kind in ("B", "I"):
        return f"the gradient from stage {needed.stage}"
    return f"stage {needed.stage}'s {'input' if needed.kind == 'W' else 'own'} pass"


def validate(schedule: Schedule, p: int, m: int, v: int = 1, blocking: bool = True) -> None:
    """Raise ``ValueError`` saying what is wrong and where, or return None if ``schedule`` can run."""
    n = p * v
    if sorted(schedule) != list(range(p)):
        raise ValueError(f"validate: a schedule for p = {p} ranks needs the keys 0..{p - 1}, got {sorted(schedule)}.")
    where: dict[Action, tuple[int, int]] = {}                 # action -> (rank, step)
    for r in range(p):
        for i, a in enumerate(schedule[r]):
            if a.stage >= n or (a.microbatch is not None and a.microbatch >= m):
                raise ValueError(f"rank {r}, step {i}: {a} names stage {a.stage} / micro-batch {a.microbatch}, "
                                 f"but there are {n} stages and {m} micro-batches.")
            if a.stage % p != r:
                raise ValueError(f"rank {r}, step {i}: {a} belongs to rank {a.stage % p} "
                                 f"(stage {a.stage} of {n} lives on rank stage % {p}); move it there.")
            if a in where:
                raise ValueError(f"rank {r}, step {i}: {a} appears twice (also at step {where[a][1]}); remove one.")
            where[a] = (r, i)

    def at(a: Action) -> str:
        return f"rank {where[a][0]}, step {where[a][1]}: {a}"

    # Each (stage, micro-batch) computed exactly once: one F, and B or (I and W).
    for s in range(n):
        home = f"rank {s % p}'s list"
        for j in range(m):
            has = {k for k in ("F", "B", "I", "W") if Action(s, k, j) in where}
            if "F" not in has:
                raise ValueError(f"stage {s} never runs {Action(s, 'F', j)}: add it to {home}.")
            if "B" in has and has & {"I", "W"}:
                raise ValueError(f"stage {s}, micro-batch {j} has both {Action(s, 'B', j)} and its split halves: "
                                 "a backward is either whole (B) or split (I then W); keep one.")
            if "B" not in has and not {"I", "W"} <= has:
                missing = [str(Action(s, k, j)) for k in ("I", "W") if k not in has] if has & {"I", "W"} \
                    else [f"{Action(s, 'B', j)} (or {Action(s, 'I', j)} and {Action(s, 'W', j)})"]
                raise ValueError(f"stage {s} never runs {' and '.join(missing)}: add it to {home}.")

    stepped = {a.stage for a in where if a.kind == STEP}
    if stepped and len(stepped) < n:
        s = min(set(range(n)) - stepped)
        raise ValueError(f"stage {s} has no optimizer step, but stage {min(stepped)} has one: add "
                         f"{Action(s, STEP)} to rank {s % p}'s list after its last backward (or drop every STEP "
                         "and step after the list).")
    for s in sorted(stepped):
        step = Action(s, STEP)
        for j in range(m):
            weights = Action(s, "B", j) if Action(s, "B", j) in where else Action(s, "W", j)
            if where[weights][1] > where[step][1]:
                raise ValueError(f"{at(step)} updates stage {s}'s weights before {weights} (step {where[weights][1]}) "
                                 f"has added micro-batch {j}'s gradient: move {step} after it, so the step "
                                 "uses every micro-batch and no backward runs on changed weights.")

    def grad(s: int, j: int) -> Action:                        # the action that makes stage s's input gradient
        return Action(s, "B", j) if Action(s, "B", j) in where else Action(s, "I", j)

    def needs(a: Action) -> list[Action]:                      # compute actions whose results ``a`` uses
        s, j = a.stage, a.microbatch
        if a.kind == "F":
            return [Action(s - 1, "F", j)] if s > 0 else []
        if a.kind in ("B", "I"):
            return [Action(s, "F", j)] + ([grad(s + 1, j)] if s < n - 1 else [])
        if a.kind == "W":
            return [Action(s, "I", j)]
        return []

    def before(a: Action, b: Action) -> bool:
        return where[a][0] == where[b][0] and where[a][1] < where[b][1]

    with_comms = any(a.kind in COMMUNICATION for a in where)
    if with_comms:
        _check_messages(schedule, p, n, where, at)
    for a in sorted(where, key=where.get):
        if a.kind in COMMUNICATION:
            continue
        for d in needs(a):
            if where[d][0] == where[a][0]:                     # same rank: plain list order
                if not before(d, a):
                    raise ValueError(f"{at(a)} needs {d} ({_what(d)}), which comes later on rank {where[d][0]} "
                                     f"(step {where[d][1]}); swap them.")
            elif with_comms:                                   # another rank: through a message
                recv = Action(a.stage, "RECV_F" if a.kind == "F" else "RECV_B", a.microbatch)
                send = partner(recv)
                if recv not in where or not before(recv, a):
                    hint = ("add it before" if recv not in where
                            else f"it comes later (step {where[recv][1]}); move it before")
                    raise ValueError(f"{at(a)} needs {d} ({_what(d)} on rank {where[d][0]}) "
                                     f"through {recv}: {hint} {a}.")
                if send not in where or not before(d, send):
                    hint = ("add it after" if send not in where
                            else f"it comes before (step {where[send][1]}); move it after")
                    raise ValueError(f"{at(recv)} receives from {send}, which rank {where[d][0]} never sends after "
                                     f"{d}: {hint} {d}.")
    if with_comms and blocking:
        _play_messages(schedule, p)
    elif with_comms:                                           # only computes wait, for their receives
        def waits_for(a: Action) -> list[Action]:
            kind = {"F": "RECV_F", "B": "RECV_B", "I": "RECV_B"}.get(a.kind)
            recv = Action(a.stage, kind, a.microbatch) if kind else None
            return [partner(recv)] if recv in where else []
        _play_compute(schedule, p, waits_for, where)
    else:
        _play_compute(schedule, p, needs, where)


def _check_messages(schedule: Schedule, p: int, n: int, where, at) -> None:
    """Every send has its receive, on another rank, and each pair of ranks agrees on the order."""
    lanes: dict[tuple[int, int], tuple[list[Action], list[Action]]] = {}   # (src, dst) -> (sends, receives)
    for a in sorted((a for a in where if a.kind in COMMUNICATION), key=where.get):
        other = partner(a)
        if not 0 <= other.stage < n:
            raise ValueError(f"{at(a)} talks to stage {other.stage}, which does not exist ({n} stages); remove it.")
        if other.stage % p == where[a][0]:
            raise ValueError(f"{at(a)}: stages {a.stage} and {other.stage} are both on rank {where[a][0]}, "
                             "so no message is needed; remove it.")
        if other not in where:
            side = "matching receive" if a.kind in _SEND_TO else "matching send"
            raise ValueError(f"{at(a)} has no {side} {other} on rank {other.stage % p}; add it there.")
        src, dst = (where[a][0], other.stage % p) if a.kind in _SEND_TO else (other.stage % p, where[a][0])
        lanes.setdefault((src, dst), ([], []))[0 if a.kind in _SEND_TO else 1].append(a)
    for (src, dst), (sends, recvs) in sorted(lanes.items()):
        for k, (send, recv) in enumerate(zip(sends, recvs)):
            if partner(send) != recv:
                raise ValueError(f"message {k} from rank {src} to rank {dst} is {at(send)}, but rank {dst} expects "
                                 f"{at(recv)} there: point-to-point messages between two ranks are matched in "
                                 f"order, so put {partner(send)} where {recv} is (or reorder the sends).")


def _play_messages(schedule: Schedule, p: int) -> None:
    """Run the lists with batched blocking p2p: an op completes once its partner is posted too."""
    done: set[Action] = set()
    pos = {r: 0 for r in range(p)}

    def batch(r: int) -> list[Action]:                         # the consecutive SEND/RECVs at pos[r]
        ops, i = [], pos[r]
        while i < len(schedule[r]) and schedule[r][i].kind in COMMUNICATION:
            ops.append(schedule[r][i])
            i += 1
        return ops

    while True:
        for r in range(p):                                     # compute never blocks: inputs were received
            while pos[r] < len(schedule[r]) and schedule[r][pos[r]].kind not in COMMUNICATION:
                pos[r] += 1
        posted = {a for r in range(p) for a in batch(r)}
        done |= {a for a in posted if partner(a) in posted}
        moved = False
        for r in range(p):
            ops = batch(r)
            if ops and all(a in done for a in ops):
                pos[r] += len(ops)
                moved = True
        if all(pos[r] == len(schedule[r]) for r in range(p)):
            return
        if not moved:
            stuck = []
            for r in range(p):
                if pos[r] == len(schedule[r]):
                    continue
                a = next(a for a in batch(r) if a not in done)
                peer = partner(a).stage % p
                peer_at = (f"blocked at step {pos[peer]} on {schedule[peer][pos[peer]]}"
                           if pos[peer] < len(schedule[peer]) else "finished")
                stuck.append(f"rank {r}, step {schedule[r].index(a)}: {a} waits for rank {peer} to post {partner(a)} "
                             f"(its step {schedule[peer].index(partner(a))}), but rank {peer} is {peer_at}")
            raise ValueError("deadlock, no rank can proceed: " + "; ".join(stuck)
                             + ". Reorder so that both ends of each message are posted together "
                               "(with_communication does).")


def _play_compute(schedule: Schedule, p: int, needs, where) -> None:
    """Run the lists: an action waits until what ``needs`` names has run (a compute, or a posted send)."""
    done: set[Action] = set()
    pos = {r: 0 for r in range(p)}
    while True:
        moved = False
        for r in range(p):
            while pos[r] < len(schedule[r]) and all(d in done for d in needs(schedule[r][pos[r]])):
                done.add(schedule[r][pos[r]])
                pos[r] += 1
                moved = True
        if all(pos[r] == len(schedule[r]) for r in range(p)):
            return
        if not moved:
            stuck = []
            for r in range(p):
                if pos[r] == len(schedule[r]):
                    continue
                a = schedule[r][pos[r]]
                d = next(d for d in needs(a) if d not in done)
                q = where[d][0]
                what = f"the message {d}" if d.kind in COMMUNICATION else f"{d} ({_what(d)})"
                stuck.append(f"rank {r}, step {pos[r]}: {a} needs {what}, which comes later on rank {q} "
                             f"(step {where[d][1]}, behind {schedule[q][pos[q]]})")
            raise ValueError("deadlock, no rank can proceed: " + "; ".join(stuck) + ".")
