"""Run a plan as real processes: ``launch`` -> ``Run`` (events, losses, state), and the unsplit reference.

``config`` is the one launch configuration (``LaunchConfig``), ``spec`` checks a launch and builds each rank's
payload, ``procs`` starts rank processes, ``worker`` is one rank, ``stages`` builds the stage modules, ``run``
watches a launch.
"""

from pipeviz.runtime.launch import launch
from pipeviz.runtime.reference import train_reference
from pipeviz.runtime.run import Run
from pipeviz.runtime.spec import LaunchError
from pipeviz.schedule.config import LaunchConfig

__all__ = ["LaunchConfig", "LaunchError", "Run", "launch", "train_reference"]
