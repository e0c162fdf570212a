"""What ``torch.export`` captured of a model, and the view of it that plans read.

Modules, bottom up: ``names`` (names in messages), ``support`` (the library releases tested), ``measured``
(``Profile``: measured layer times), ``structure`` (what a model says of itself: module tree, tied tensors,
buffers), ``ops`` (``Op``: one ATen call, its FLOPs, bytes and saved tensors), ``export`` (the one
``torch.export`` capture, read into ops), ``units`` (the forward's call tree), ``view`` (``Layer``, ``GraphIndex``
and the ``GraphView`` protocol a plan reads), ``weights`` (a meta-device model's weights loaded per stage).

``from pipeviz.capture import capture, TraceError`` (the module's path before 0.4) keeps working.
"""

from pipeviz.capture.export import Capture, TraceError, capture

__all__ = ["Capture", "TraceError", "capture"]
