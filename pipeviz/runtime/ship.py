"""How a launch's stage tensors reach its ranks: mapped from one file, not pickled.

Pickling a stage copies every parameter three times (into the pickle's bytes, into the payload file, out of it in
the rank) and runs at a few hundred MB/s: 2.5 s for GPT-2 small's 474 MB. Instead the launching process writes each
model tensor once into a values file (``/dev/shm`` when it has room, else the temporary folder), in page-aligned
slots, and pickles the stages with every model tensor replaced by a reference to its slot (pickle's
``persistent_id``). A rank maps its own slots copy-on-write (``MAP_PRIVATE``): nothing is read until used, pages
are copied only when the rank writes them (its optimizer steps), and no rank ever sees another's writes.

The values are the user's model's tensors *now* (by canonical name), so a launch after the model changed ships
the new values even when the stages' structure comes from the cache (``pipeviz.runtime.payloads.launch_stages``).

Example:
    >>> shipment = write_values({"w": torch.ones(4096, 64)}, prefix="pipeviz-state-1-")
    >>> blob = dumps(payload, shipped)      # shipped: {id(tensor): Shipped(...)} for the stage tensors
    >>> loads(blob, shipment)               # in the rank: the payload, its tensors mapped from the file
"""

from __future__ import annotations

import errno
import io
import mmap
import os
import pickle
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import torch
from torch import nn

__all__ = ["MIN_MAPPED", "Shipment", "Shipped", "ValuesSpaceError", "dump_payload", "dumps", "load_payload", "loads",
           "values_folder", "write_values"]

MIN_MAPPED = 64 * 1024  # bytes: smaller tensors travel inline in the pickle (a mapping each would cost more)
_PAGE = mmap.ALLOCATIONGRANULARITY  # mmap offsets must be multiples of it


class ValuesSpaceError(OSError):
    """No room for the values file (``write_values``): the message names the folder, the size and the fix."""


@dataclass(frozen=True)
class Shipped:
    """One model tensor of a stage, as the pickle refers to it: its canonical name, whether it is a parameter
    (and then whether it requires grad), and a serial number that keeps two copies of one tensor (a tied weight in
    two stages of one rank) two objects on the rank, as they are here."""

    canon: str
    serial: int
    param: bool
    requires_grad: bool


@dataclass(frozen=True)
class Slot:
    offset: int
    numel: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class Shipment:
    """Where a launch's tensor values are: ``path``'s slots for the large ones, ``inline`` for the rest."""

    path: str | None = None
    slots: dict[str, Slot] = field(default_factory=dict)
    inline: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(s.numel * s.dtype.itemsize for s in self.slots.values())


def values_folder(nbytes: int) -> str:
    """``/dev/shm`` (memory, never written to disk) when it has room for ``nbytes`` with a margin (a container's
    /dev/shm is often 64 MB), else the temporary folder."""
    shm = "/dev/shm"
    try:
        if os.path.isdir(shm) and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > nbytes * 1.1 + 2**26:
            return shm
    except OSError:
        pass
    return tempfile.gettempdir()


def write_values(values: dict[str, torch.Tensor], prefix: str) -> Shipment:
    """Write ``values`` (canonical name -> tensor, any device and dtype) for ranks to map: large ones into a new
    file named with ``prefix`` (the caller removes it once the ranks have mapped it, or at the end of the run),
    small ones inline. Returns the ``Shipment`` the ranks need."""
    out = Shipment()
    big: list[tuple[str, torch.Tensor]] = []
    for name, t in values.items():
        t = t.detach()
        if t.numel() * t.element_size() >= MIN_MAPPED and t.layout == torch.strided and not t.is_quantized:
            big.append((name, t))
        else:
            out.inline[name] = t.cpu()
    if not big:
        return out
    total = sum(-(-t.numel() * t.element_size() // _PAGE) * _PAGE for _, t in big)
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".values", dir=values_folder(total))
    out.path = path
    try:
        offset = 0
        for name, t in big:
            data = t.to("cpu").contiguous().view(-1).view(torch.uint8)
            view = data.numpy().data
            while view:  # os.write may write less than asked
                view = view[os.write(fd, view):]
            size = data.numel()
            out.slots[name] = Slot(offset, t.numel(), t.dtype, tuple(t.shape))
            pad = -size % _PAGE
            if pad:
                os.lseek(fd, pad, os.SEEK_CUR)
            offset += size + pad
        os.ftruncate(fd, offset)
    except BaseException as exc:
        os.close(fd)
        os.unlink(path)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ValuesSpaceError(
                f"No space left in {os.path.dirname(path)} for the model's values ({total / 2**20:.1f} MiB, mapped by "
                "the ranks). Fix: free some space there, or point TMPDIR at a disk with room.") from exc
        raise
    os.close(fd)
    return out


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # (cloudpickle ships no types)
    """cloudpickle's pickler (objects from ``__main__`` by value), with the stage tensors left out."""

    def __init__(self, file: io.BytesIO, shipped: Mapping[int, tuple[object, Shipped]]) -> None:
        super().__init__(file)
        self._shipped = shipped

    def persistent_id(self, obj: object) -> Shipped | None:
        found = self._shipped.get(id(obj))
        return found[1] if found is not None and found[0] is obj else None


def dumps(obj: object, shipped: Mapping[int, tuple[object, Shipped]]) -> bytes:
    """Pickle ``obj`` (cloudpickle), replacing each tensor in ``shipped`` (``id(tensor) -> (tensor, Shipped)``) by
    its reference."""
    buf = io.BytesIO()
    _Pickler(buf, shipped).dump(obj)
    return buf.getvalue()


def loads(data: bytes, shipment: Shipment) -> object:
    """Unpickle what ``dumps`` wrote, in the rank: each reference becomes its value, mapped copy-on-write from the
    shipment's file (or inline), as an ``nn.Parameter`` where it was one. One object per ``Shipped``."""
    memo: dict[Shipped, torch.Tensor] = {}
    fd = os.open(shipment.path, os.O_RDONLY) if shipment.path else -1

    def value(ref: Shipped) -> torch.Tensor:
        if ref.canon in shipment.inline:
            t = shipment.inline[ref.canon].clone()
        else:
            slot = shipment.slots[ref.canon]
            nbytes = slot.numel * slot.dtype.itemsize
            # Each tensor its own mapping (its own storage: saving it later writes it alone); private: writes are the
            # rank's own; the file may be gone afterwards, the mapping stays.
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                           offset=slot.offset)
            t = torch.frombuffer(mm, dtype=slot.dtype, count=slot.numel).view(slot.shape)
        return nn.Parameter(t, requires_grad=ref.requires_grad) if ref.param else t

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: object) -> torch.Tensor:
            if not isinstance(pid, Shipped):
                raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
            if pid not in memo:
                memo[pid] = value(pid)
            return memo[pid]

    try:
        return Unpickler(io.BytesIO(data)).load()
    finally:
        if fd >= 0:
            os.close(fd)


def dump_payload(obj: object, shipped: Mapping[int, tuple[object, Shipped]], shipment: Shipment) -> bytes:
    """A rank's payload: its ``Shipment`` (small values inline, where the rest lie), then ``obj`` by ``dumps``."""
    return pickle.dumps(shipment) + dumps(obj, shipped)


def load_payload(data: bytes) -> Any:
    """In the rank: what ``dump_payload`` wrote, its tensors mapped from the values file."""
    buf = io.BytesIO(data)
    shipment = pickle.load(buf)
    return loads(buf.read(), shipment)
