"""dtcourse: distributed deep-learning training, taught with runnable code.

Each module implements one technique; the lessons in ``lessons/`` import them.
"""
from dtcourse.launch import LaunchError, RankError, init_from_env, launch

__all__ = ["launch", "init_from_env", "LaunchError", "RankError"]
__version__ = "0.1.0"
