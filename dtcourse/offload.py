"""Offloading (lesson 07): the optimizer's states and its step live in a slower, larger memory.

ZeRO-Offload (Ren et al., arXiv 2101.06840) keeps the fp32 optimizer states and runs the optimizer
step on the host (CPU) while the device (GPU) computes forward and backward. Each step, the
gradient of this rank's part goes down (device -> host), the host steps it, and the updated part
comes back up (host -> device): 4 bytes per fp32 element each way, against the 8 bytes of Adam's
two moments that no longer take device memory. ZeRO-Infinity (Rajbhandari et al., arXiv
2104.07857) goes one tier further, to NVMe: the states live in files and are read in for the step
and written back after it.

``OffloadedOptimizer`` is an optimizer that does this for any ``torch.optim`` optimizer over any
parameters, so ``ZeRO`` (lesson 06) takes it as its optimizer and offloads this rank's part::

    opt = functools.partial(OffloadedOptimizer, inner=functools.partial(torch.optim.AdamW, lr=1e-3),
                            tier="disk")
    model = ZeRO(GPT(config), stage=2, optimizer=opt)       # a normal training loop after this

``tier="host"``: a host copy of each parameter and its states in CPU memory (pinned, with
non-blocking copies, when the parameters are on a GPU). ``tier="disk"``: the host copy and the
states live in files under ``directory`` and are read in for each step and written out after it,
so between steps they take no memory at all; on a CPU-only machine that is the slower tier that
makes the transfers real. ``delayed=True`` is the paper's delayed parameter update (DPU): the
host steps this step's gradient in a background thread while the device runs the next forward
and backward, which therefore use parameters one update old. ``stats`` counts the bytes moved
each way and the seconds spent in transfers, disk and the optimizer.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch
import torch.nn as nn

__all__ = ["OffloadedOptimizer", "OffloadStats", "TIERS"]

TIERS = ("host", "disk")
InnerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class OffloadStats:
    """What offloading moved and cost, summed over the steps since the last ``reset``."""

    steps: int = 0
    down: int = 0               # bytes device -> host: the gradients
    up: int = 0                 # bytes host -> device: the updated parameters
    read: int = 0               # bytes read from disk (parameters and states, tier "disk")
    written: int = 0            # bytes written to disk
    seconds: dict[str, float] = field(default_factory=lambda: {"transfer": 0.0, "disk": 0.0, "optimizer": 0.0})

    def reset(self) -> None:
        self.__init__()


class _Swapped:
    """One host tensor kept in a file between steps: ``load()`` before the step, ``store()`` after."""

    def __init__(self, tensor: torch.Tensor, path: str):
        self.tensor, self.path = tensor, path
        self.shape, self.dtype = tensor.shape, tensor.dtype

    def store(self) -> int:
        with open(self.path, "wb") as f:
            f.write(memoryview(self.tensor.detach().numpy()).cast("B"))
        self.tensor.data = torch.empty(0, dtype=self.dtype)          # the memory goes back to the allocator
        return self.shape.numel() * self.dtype.itemsize

    def load(self) -> int:
        loaded = torch.empty(self.shape, dtype=self.dtype)
        with open(self.path, "rb") as f:
            f.readinto(memoryview(loaded.numpy().reshape(-1)).cast("B"))
        self.tensor.data = loaded
        return self.shape.numel() * self.dtype.itemsize


class OffloadedOptimizer(torch.optim.Optimizer):
    """``inner`` stepping host copies of ``params``: gradients down, the step on the host, parameters up.

    The device parameters keep no optimizer state here (``state`` stays empty), which is what a
    ZeRO rank's memory counts. The parameters must be fp32 and on one device.
    """

    def __init__(self, params: Iterable[nn.Parameter], inner: InnerFactory, *, tier: str = "host",
                 directory: str | None = None, delayed: bool = False):
        params = list(params)
        if tier not in TIERS:
            raise ValueError(f"OffloadedOptimizer: tier must be one of {TIERS}, got {tier!r}.")
        if not callable(inner) or isinstance(inner, torch.optim.Optimizer):
            raise TypeError("OffloadedOptimizer: inner must be an optimizer class or a factory, such as "
                            f"functools.partial(torch.optim.AdamW, lr=1e-3); got {inner!r}.")
        if any(p.dtype != torch.float32 for p in params):
            raise ValueError("OffloadedOptimizer: the parameters it steps must be fp32 (ZeRO passes its fp32 parts).")
        super().__init__(params, {})
        self.tier, self.delayed, self.stats = tier, delayed, OffloadStats()
        device = params[0].device if params else torch.device("cpu")
        self._pinned = device.type == "cuda"
        # The host copies: what the inner optimizer steps, keyed like the device parameters
        self.host = [nn.Parameter(torch.empty(p.shape, dtype=p.dtype, pin_memory=self._pinned)) for p in params]
        for h, p in zip(self.host, params):
            h.data.copy_(p.detach())
        self.inner = inner(self.host)
        if not isinstance(self.inner, torch.optim.Optimizer):
            raise TypeError(f"OffloadedOptimizer: inner(params) returned {type(self.inner).__name__}, not a "
                            "torch.optim.Optimizer.")
        self._directory = self._swap_directory(directory) if tier == "disk" else None
        self._swapped: dict[int, _Swapped] = {}
        self._grads: list[torch.Tensor | None] = [None] * len(params)    # host copies of the gradients
        self._pending: threading.Thread | None = None
        self._error: BaseException | None = None
        if tier == "disk":
            for i, h in enumerate(self.host):
                self.stats.written += self._swap(h, f"param{i}").store()

    # ------------------------------------------------------------------ #
    def _swap_directory(self, directory: str | None) -> str:
        if directory is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="dtcourse-offload-")   # removed with the optimizer
            return self._tmp.name
        try:
            os.makedirs(directory, exist_ok=True)
            with tempfile.TemporaryFile(dir=directory):
                pass
        except OSError as exc:
            raise PermissionError(
                f"OffloadedOptimizer: cannot write to the offload directory {directory!r} ({exc.strerror or exc}). "
                "Pass directory= a folder this process can write to (for example tempfile.mkdtemp()), leave it "
                "None for a temporary one, or use tier='host'.") from None
        return directory

    def _swap(self, tensor: torch.Tensor, name: str) -> _Swapped:
        key = id(tensor)
        if key not in self._swapped:
            self._swapped[key] = _Swapped(tensor, os.path.join(self._directory, f"{os.getpid()}-{name}.bin"))
        return self._swapped[key]

    def _big_states(self) -> list[tuple[str, torch.Tensor]]:
        """The inner optimizer's per-element states (Adam's m and v), not its scalar step counts."""
        return [(f"state{i}-{k}", t) for i, h in enumerate(self.host)
                for k, t in self.inner.state.get(h, {}).items()
                if isinstance(t, torch.Tensor) and (t.numel() > 1 or id(t) in self._swapped)]

    @contextlib.contextmanager
    def _timed(self, kind: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stats.seconds[kind] += time.perf_counter() - start

    # ------------------------------------------------------------------ #
    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Gradients down, the inner step on the host, parameters up (with ``delayed``: last step's)."""
        if closure is not None:
            raise ValueError("OffloadedOptimizer.step does not take a closure.")
        params = self.param_groups[0]["params"]
        if self.delayed:
            self._finish_pending(params)               # the update of the previous step goes up now
        with self._timed("transfer"):                   # sends 4 bytes per element down
            for i, p in enumerate(params):
                if p.grad is None:
                    self._grads[i] = None
                    continue
                if self._grads[i] is None:
                    self._grads[i] = torch.empty(p.shape, dtype=p.dtype, pin_memory=self._pinned)
                self._grads[i].copy_(p.grad, non_blocking=self._pinned)
                self.stats.down += p.grad.nbytes
            if self._pinned:
                torch.cuda.current_stream(params[0].device).synchronize()
        if self.delayed:
            self._pending = threading.Thread(target=self._host_step_safely, daemon=True)
            self._pending.start()
        else:
            self._host_step()
            self._upload(params)
        self.stats.steps += 1

    def _host_step(self) -> None:
        if self.tier == "disk":
            with self._timed("disk"):
                for i, h in enumerate(self.host):
                    self.stats.read += self._swap(h, f"param{i}").load()
                for name, t in self._big_states():
                    self.stats.read += self._swap(t, name).load()
        with self._timed("optimizer"):
            for h, g in zip(self.host, self._grads):
                h.grad = g
            self.inner.step()
            for h in self.host:
                h.grad = None
        if self.tier == "disk":
            with self._timed("disk"):
                for name, t in self._big_states():
                    self.stats.written += self._swap(t, name).store()
            self._grads = [None] * len(self.host)       # on disk's tier, allocated again next step

    def _host_step_safely(self) -> None:
        try:
            self._host_step()
        except BaseException as exc:            # raised again in the caller's thread at the next step
            self._error = exc

    @torch.no_grad()
    def _upload(self, params: list[nn.Parameter]) -> None:
        with self._timed("transfer"):           # sends 4 bytes per element up
            for p, h in zip(params, self.host):
                p.copy_(h, non_blocking=self._pinned)
                self.stats.up += p.nbytes
            if self._pinned:                    # the host copy must stay until the copies have read it
                torch.cuda.current_stream(params[0].device).synchronize()
        if self.tier == "disk":                 # the host copy leaves memory until the next step
            with self._timed("disk"):
                for i, h in enumerate(self.host):
                    self.stats.written += self._swap(h, f"param{i}").store()

    def _finish_pending(self, params: list[nn.Parameter]) -> None:
        if self._pending is None:
            return
        self._pending.join()
        self._pending = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        self._upload(params)

    def flush(self) -> None:
        """With ``delayed``: wait for the update in flight and copy it up (call before reading the weights)."""
        self._finish_pending(self.param_groups[0]["params"])


    def host_bytes(self) -> int:
        """Bytes of host memory the offloaded copies and states hold now (0 between steps on disk)."""
        tensors = list(self.host) + [t for _, t in self._big_states()]
        return sum(t.numel() * t.element_size() for t in tensors)
