"""``pipeviz.timeline`` moved to ``pipeviz.schedule.timeline`` in pipeviz 0.4;
this path keeps working, with a ``DeprecationWarning``."""

import importlib
import sys
import warnings

warnings.warn("pipeviz.timeline moved to pipeviz.schedule.timeline in pipeviz 0.4: "
              "import it from there (or use the names on pipeviz).",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("pipeviz.schedule.timeline")
