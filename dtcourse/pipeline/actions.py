"""One action of a pipeline schedule, written in the notation of ``torch.distributed.pipelining``.

A schedule is data: for each rank, the ordered list of what it does. An ``Action`` names a
*stage* (a contiguous slice of the model's layers; with v chunks per rank, rank r holds the stages
r, r + p, ..., r + (v-1)p of p·v), a *kind* and a *micro-batch*. Its string is torch's::

    Action(0, "F", 1)        # "0F1": stage 0's forward of micro-batch 1
    Action(2, "I", 0)        # "2I0": stage 2's input-gradient backward (zero-bubble's B split)
    Action(3, "W", 1)        # "3W1": stage 3's weight-gradient backward
    Action(1, "SEND_F", 4)   # "1SEND_F4": stage 1 sends micro-batch 4's activations to stage 2
    Action.parse("2RECV_B0") # the reverse

Kinds: ``F`` forward; ``B`` the whole backward (input and weight gradients together); ``I`` and
``W`` the two halves of zero-bubble's split backward (Qi et al., arXiv 2401.10241); ``SEND_F`` /
``RECV_F`` an activation to the next stage / from the previous one; ``SEND_B`` / ``RECV_B`` a gradient
to the previous stage / from the next one. The optimizer step is not an action: it follows the list.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Action", "COMPUTE", "COMMUNICATION", "KINDS", "Schedule"]

COMPUTE = ("F", "B", "I", "W")
COMMUNICATION = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE + COMMUNICATION
_PATTERN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")

Schedule = dict[int, list["Action"]]      # rank -> its actions, in order


@dataclass(frozen=True, order=True)
class Action:
    """``stage`` (global index), ``kind`` (one of ``KINDS``), ``microbatch``; ``str()`` is torch's notation."""

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action: kind must be one of {KINDS}, got {self.kind!r}.")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"Action: stage and micro-batch are indices >= 0, got {self.stage} and {self.microbatch}.")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    __repr__ = __str__

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    @staticmethod
    def parse(text: str) -> "Action":
        """``Action.parse("2I0") == Action(2, "I", 0)``; the string of torch's ``_Action`` parses too."""
        found = _PATTERN.match(str(text).strip())
        if not found:
            raise ValueError(f"Action.parse: {text!r} is not [stage][kind][micro-batch] with kind in {KINDS}, "
                             "for example '0F1', '2I0' or '1SEND_F3'.")
        return Action(int(found[1]), found[2], int(found[3]))
