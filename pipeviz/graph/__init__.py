"""``trace()`` and the ``ModelGraph`` a user holds (``model``): layers, edges, split candidates, ``graph.split``;
and plans written by hand over it (``manual``).

``from pipeviz.graph import trace, ModelGraph`` (the module's path before 0.4) keeps working.
"""

from pipeviz.capture.view import Layer
from pipeviz.graph.model import ModelGraph, trace

__all__ = ["Layer", "ModelGraph", "trace"]
