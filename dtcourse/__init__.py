"""dtcourse: distributed deep-learning training, taught with runnable code.

One stem per technique, the same in every place: lesson ``lessons/NN_<stem>.ipynb``, algorithm
``dtcourse/<stem>`` (the algorithm alone, what a student reads after the lesson), what the lesson
runs and draws ``dtcourse/lab/<stem>.py``, exercise checks ``dtcourse/checks/<stem>.py``,
benchmark ``dtcourse/bench/<stem>.py`` and tests ``tests/test_<stem>.py``.

Algorithms, by lesson:

* 00 ``dtcourse.memory``: the bytes of a training step, by kind
* 01 ``dtcourse.collectives``: naive, tree and ring all-reduce from send/recv, byte counters
* 02 ``dtcourse.data_parallel``: DDP in three steps, and what DistributedSampler hands out
* 03 ``dtcourse.parameter_server``: sync, async and bounded-staleness servers, sharded or not
* 04 ``dtcourse.mixed_precision``: fp32 master weights and loss scaling
* 05 ``dtcourse.checkpointing``: activation checkpointing, full and selective

Shared by every lesson:

* ``dtcourse.models``: the tiny GPT and MLP, and each lesson's model size
* ``dtcourse.mesh``: the data x pipeline x tensor grid of process groups (``ParallelDims``)
* ``dtcourse.parity``: one harness that checks a parallel strategy against one process
* ``dtcourse.runtime``: ``launch`` / ``init_from_env``, ``device()``, the timeline recorder
* ``dtcourse.lab``: measurements, figures and widgets; ``dtcourse.checks`` and
  ``dtcourse.grading``: exercise checks, generator and autograder; ``dtcourse.bench``: benchmarks
* the ``dtcourse`` command (``dtcourse.cli``): ``dtcourse check`` (students), ``dtcourse grade``,
  ``dtcourse audit`` and ``dtcourse course`` (instructors), ``dtcourse exercises``, ``dtcourse bench STEM``

Importing the package itself is cheap and needs no torch, so the exercise
generator (``python -m dtcourse.exercises``) runs with a bare Python.
"""

import os

__version__ = "0.1.0"
__all__ = ["launch", "init_from_env", "device", "LaunchError", "RankError", "LaunchTimeout"]

# torch.cuda.is_available() asks NVML instead of initialising CUDA when this is set. A notebook
# that calls it before dtcourse.launch forks its ranks then leaves them a usable GPU.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


def __getattr__(name: str):
    # PEP 562: load the runtime (and torch) on first use, not on import.
    if name in __all__:
        import importlib

        value = getattr(importlib.import_module("dtcourse.runtime"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dtcourse' has no attribute {name!r}")
