"""dtcourse: distributed deep-learning training, taught with runnable code.

Each module implements one technique, and the lessons in ``lessons/`` import
it:

* ``dtcourse.launch`` (in ``launcher.py``): ranks from a notebook, or under torchrun
* ``dtcourse.collectives``: naive, tree and ring all-reduce from send/recv
* ``dtcourse.memory``: the bytes of a training step, by kind
* ``dtcourse.models``: the shared tiny GPT and MLP
* ``dtcourse.data_parallel``: DDP in three steps; ``dtcourse.sampling``: what DistributedSampler hands out
* ``dtcourse.timeline``: measured compute and communication spans, drawn as a Gantt chart
* ``dtcourse.parameter_server``: sync, async and bounded-staleness servers, sharded or not
* ``dtcourse.mixed_precision``: fp32 master weights and loss scaling (``mixed_precision_figures``)
* ``dtcourse.checkpointing``: activation checkpointing, full and selective
  (``checkpointing_measurements`` and ``checkpointing_figures`` measure and draw it)
* ``dtcourse.figure_widget``: the one way a figure is shown behind an ipywidgets control
* ``dtcourse.ring_widget``, ``dtcourse.collective_figures``: lesson 01's pictures
* ``dtcourse.exercises``, ``dtcourse.grade``, ``dtcourse.checks``: exercises and autograder
* ``dtcourse.bench.*``: benchmark scripts, e.g. ``python -m dtcourse.bench.collectives``

Importing the package itself is cheap and needs no torch, so the exercise
generator (``python -m dtcourse.exercises``) runs with a bare Python.
"""

__version__ = "0.1.0"
__all__ = ["launch", "init_from_env", "LaunchError", "RankError"]


def __getattr__(name: str):
    # PEP 562: load the launcher (and torch) on first use, not on import.
    if name in __all__:
        import importlib

        value = getattr(importlib.import_module("dtcourse.launcher"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dtcourse' has no attribute {name!r}")
