"""Run a plan as real processes: ``launch`` -> ``Run`` (events, losses, state), and the unsplit reference.

``checks`` checks a launch before any process starts (its options: ``settings``; its inputs: ``batches``) and
returns the ``spec`` it runs, ``devices`` places the ranks, ``payloads`` builds each rank's payload, ``procs`` starts
rank processes, ``worker`` is one rank, ``stages`` builds the stage modules, ``run`` watches a launch.
"""

from pipeviz.errors import LaunchError
from pipeviz.runtime.launch import launch
from pipeviz.runtime.reference import train_reference
from pipeviz.runtime.run import Run
from pipeviz.schedule.config import LaunchConfig

__all__ = ["LaunchConfig", "LaunchError", "Run", "launch", "train_reference"]
