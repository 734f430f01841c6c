"""dtcourse: distributed deep-learning training, taught with runnable code.

Each module implements one technique and the lessons in ``lessons/`` import
it: ``dtcourse.launch`` (ranks from a notebook, in ``launcher.py``), ``dtcourse.collectives``
(naive, tree and ring all-reduce from send/recv), ``dtcourse.memory`` (bytes of
a training step), ``dtcourse.models`` (the shared tiny models).

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
