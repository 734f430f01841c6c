"""What every lesson runs on: the launcher, device and backend choice, and the timeline recorder.

* ``launch`` / ``init_from_env`` (``launch.py``): ranks from a notebook, or under torchrun;
  ``results.py`` is how a rank's result travels back (tensors out of band);
  ``processes.py`` is the fork-and-pipes plumbing beneath it.
* ``device`` / ``choose_backend`` / ``gpu_count`` (``device.py``): nccl or gloo, and each rank's
  device, decided without initialising CUDA in the parent.
* ``timeline.py``: per-rank spans of compute and communication on one clock.
"""

from dtcourse.runtime.device import choose_backend, device, gpu_count
from dtcourse.runtime.launch import LaunchError, LaunchTimeout, RankError, init_from_env, launch

__all__ = ["launch", "init_from_env", "LaunchError", "RankError", "LaunchTimeout", "device", "choose_backend",
           "gpu_count"]
