"""One action of a pipeline schedule, written in the notation of ``torch.distributed.pipelining``.

A schedule is data: for each rank, the ordered list of what it does. An ``Action`` names a
*stage* (a contiguous slice of the model's layers; with v chunks per rank, rank r holds the stages
r, r + p, ..., r + (v-1)p of p·v), a *kind* and a *micro-batch*. Its string is torch's::

    Action(0, "F", 1)        # "0F1": stage 0's forward of micro-batch 1
    Action(2, "I", 0)        # "2I0": stage 2's input-gradient backward (zero-bubble's B split)
    Action(3, "W", 1)        # "3W1": stage 3's weight-gradient backward
    Action(1, "SEND_F", 4)   # "1SEND_F4": stage 1 sends micro-batch 4's activations to stage 2
    Action(0, "STEP")        # "0STEP": stage 0's optimizer step, once its last weight gradient is in
    Action.parse("2RECV_B0") # the reverse

Kinds: ``F`` forward; ``B`` the whole backward (input and weight gradients together); ``I`` and
``W`` the two halves of zero-bubble's split backward (Qi et al., arXiv 2401.10241); ``SEND_F`` /
``RECV_F`` an activation to the next stage / from the previous one; ``SEND_B`` / ``RECV_B`` a gradient
to the previous stage / from the next one; ``STEP`` the optimizer step of one stage's parameters, which
names no micro-batch (torch writes its ``UNSHARD`` and ``RESHARD`` the same way, ``0UNSHARD``). Every
generator ends each stage's work with its ``STEP``: the "flush" of PipeDream-flush, after which the next
step's forwards see the new weights. torch's schedules leave the step to the caller, so
``without_steps`` gives the part that compares with theirs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Action", "COMPUTE", "COMMUNICATION", "STEP", "KINDS", "Schedule", "without_steps"]

COMPUTE = ("F", "B", "I", "W")
COMMUNICATION = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
STEP = "STEP"
KINDS = COMPUTE + COMMUNICATION + (STEP,)
_PATTERN = re.compile(r"^(\d+)(?:(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)|(STEP))$")

Schedule = dict[int, list["Action"]]      # rank -> its actions, in order


@dataclass(frozen=True, order=True)
class Action:
    """``stage`` (global index), ``kind`` (one of ``KINDS``), ``microbatch`` (None for ``STEP`` only);
    ``str()`` is torch's notation."""

    stage: int
    kind: str
    microbatch: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action: kind must be one of {KINDS}, got {self.kind!r}.")
        if (self.microbatch is None) != (self.kind == STEP):
            raise ValueError(f"Action: {self.kind} needs a micro-batch, Action({self.stage}, {self.kind!r}, j)"
                             if self.microbatch is None else
                             f"Action: STEP updates stage {self.stage}'s weights once for all micro-batches; "
                             f"write Action({self.stage}, 'STEP'), without {self.microbatch}.")
        if self.stage < 0 or (self.microbatch or 0) < 0:
            raise ValueError(f"Action: stage and micro-batch are indices >= 0, got {self.stage} and {self.microbatch}.")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{'' if self.microbatch is None else self.microbatch}"

    __repr__ = __str__

    @property
    def is_compute(self) -> bool:
        """F, B, I or W: work on one micro-batch (not a message, not the optimizer step)."""
        return self.kind in COMPUTE

    @property
    def is_communication(self) -> bool:
        return self.kind in COMMUNICATION

    @staticmethod
    def parse(text: str) -> "Action":
        """``Action.parse("2I0") == Action(2, "I", 0)``; the string of torch's ``_Action`` parses too."""
        found = _PATTERN.match(str(text).strip())
        if not found:
            raise ValueError(f"Action.parse: {text!r} is not [stage][kind][micro-batch] with kind in {KINDS}, "
                             "for example '0F1', '2I0', '1SEND_F3' or '0STEP' (no micro-batch).")
        if found[4]:
            return Action(int(found[1]), STEP)
        return Action(int(found[1]), found[2], int(found[3]))


def without_steps(schedule: Schedule) -> Schedule:
    """``schedule`` less its ``STEP`` actions: forwards, backwards and messages, as torch's schedules hold."""
    return {r: [a for a in actions if a.kind != STEP] for r, actions in schedule.items()}
