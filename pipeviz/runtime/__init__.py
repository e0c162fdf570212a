"""Run a plan as real processes: ``launch`` -> ``Run`` (events, losses, state), and the unsplit reference."""

from pipeviz.runtime.reference import train_reference
from pipeviz.runtime.run import LaunchError, Run, launch

__all__ = ["LaunchError", "Run", "launch", "train_reference"]
