"""What ``launch`` raises: a launch that could not start, a rank's exception, a timeout."""

from __future__ import annotations

__all__ = ["LaunchError", "RankError", "LaunchTimeout", "frames"]


class LaunchError(RuntimeError):
    """A launch could not start, or a rank failed to send its result back."""


class RankError(RuntimeError):
    """A rank raised an exception; ``rank`` and ``remote_traceback`` say where."""

    def __init__(self, rank: int, remote_traceback: str):
        self.rank = rank
        self.remote_traceback = remote_traceback
        super().__init__(f"rank {rank} raised an exception:\n\n{remote_traceback}")


class LaunchTimeout(TimeoutError):
    """Ranks still ran when the timeout expired.

    ``stuck`` lists those ranks; ``stacks`` maps each to the Python stack it was on (innermost
    call first), as faulthandler printed it. Both are there to read, so no caller parses the
    message.
    """

    def __init__(self, timeout: float, stuck: list[int], stacks: dict[int, str]):
        self.timeout = timeout
        self.stuck = stuck
        self.stacks = stacks
        where = "".join(f"\n  rank {r} was at " + "\n      called from ".join(frames(stacks[r])[:3])
                        for r in stuck if frames(stacks.get(r, "")))
        super().__init__(
            f"launch timed out after {timeout:g} s; rank(s) {stuck} still running. A common cause is a "
            "collective or recv that another rank never reached (for example a call inside "
            "`if rank == 0:`). All ranks were stopped; raise timeout= if the work is just slow."
            + (f"\nWhere the stuck ranks were (innermost call first):{where}" if where else ""))


def frames(stack: str) -> list[str]:
    """The ``File ..., line ..., in ...`` lines of a faulthandler stack, innermost first."""
    return [ln.strip() for ln in stack.splitlines() if ln.strip().startswith("File")]
