"""Which backend and which device a rank uses, decided without touching CUDA in the parent.

``launch`` forks its ranks. A process whose CUDA driver is initialised cannot hand a working
CUDA to a forked child, so the parent (a Jupyter kernel, a pytest worker) must never initialise
it. Two PyTorch calls would: ``torch.cuda.is_available()`` (it asks the CUDA runtime) and
anything that creates a CUDA tensor. ``gpu_count`` asks NVML instead, which leaves CUDA alone.

Inside a rank, ``device()`` is where that rank's tensors belong: ``cuda:<local rank>`` under nccl,
the CPU under gloo. The algorithm modules never ask it: they take the device of the tensors they
are given, so the same code runs on CPU ranks and on GPU ranks::

    x = torch.randn(8, 16, device=dtcourse.device())
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["BACKENDS", "gpu_count", "choose_backend", "device"]

BACKENDS = ("auto", "gloo", "nccl")


def gpu_count() -> int:
    """The GPUs this process can see, counted through NVML: CUDA stays uninitialised."""
    if not torch.backends.cuda.is_built():      # the CPU wheel
        return 0
    return torch.cuda.device_count()            # NVML first; torch documents it as fork-safe


def choose_backend(world_size: int, backend: str = "auto") -> str:
    """``"auto"`` is nccl with one GPU per rank when there are two ranks or more and enough GPUs, else gloo.

    One rank has nothing to communicate, and much of the course's single-rank code builds CPU
    tensors: ask for ``backend="nccl"`` by name to run one rank on the GPU.

    An unknown name is a ``ValueError``; an explicit ``"nccl"`` without a GPU for every rank is a
    ``RuntimeError``; both say what to change.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    gpus = gpu_count()
    if backend == "auto":
        return "nccl" if 1 < world_size <= gpus else "gloo"
    if backend == "nccl" and gpus < world_size:
        fix = f"or world_size<={gpus}" if gpus else "(this machine has no GPU that CUDA can use)"
        raise RuntimeError(f"backend='nccl' needs one GPU per rank, but world_size={world_size} and this "
                           f"machine has {gpus} GPU(s). Use backend='gloo' (CPU ranks) {fix}.")
    return backend


def device() -> torch.device:
    """This rank's device: ``cuda:<local rank>`` when the process group uses nccl, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
