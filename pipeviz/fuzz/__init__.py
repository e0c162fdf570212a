"""The composition fuzzer (``pipeviz fuzz``): draws compositions pipeviz accepts — a model, its split, a schedule or a
custom order, microbatches, every mesh dimension ``pv.launch`` takes, every training option — and checks each: a
refusal before any process starts must be a ``LaunchError`` naming the setting, and a run must match the unsplit
model (``pv.check_numerics``). The first failure is shrunk to a minimal case and written as scripts that reproduce
it. See docs/fuzz.md.

Example:
    >>> from pipeviz.fuzz import fuzz
    >>> report = fuzz(seconds=120, seed=0, out="fuzz-out", model="my_model.py")
    >>> print(report.summary())

The part sits above the runtime and the package's face (it builds the zoo's models) and below the views.
"""

from pipeviz.fuzz.models import BUILTIN, FuzzModel, build_model, builtin_models
from pipeviz.fuzz.runner import Outcome, build_case, run_case
from pipeviz.fuzz.session import FuzzReport, fuzz, write_repro
from pipeviz.fuzz.shrink import neighbours, shrink
from pipeviz.fuzz.space import CUSTOM_ORDERS, DEGREES, MESH_DIMS, OPTIONS, Case, custom_order, draw_case

__all__ = ["BUILTIN", "CUSTOM_ORDERS", "DEGREES", "MESH_DIMS", "OPTIONS", "Case", "FuzzModel", "FuzzReport",
           "Outcome", "build_case", "build_model", "builtin_models", "custom_order", "draw_case", "fuzz", "neighbours",
           "run_case", "shrink", "write_repro"]
