"""The call tree of a captured forward: every module call (and every container of modules) as a ``Unit``
with the range of ops it ran, in execution order.

A module called once is one unit named by its FQN (``"transformer.h.3"``); a module called several times
(a block reused, ALBERT's one shared layer) gives one unit per call, ``"shared@0"``, ``"shared@1"``. Containers
that are never called themselves (``ModuleList``, ``ModuleDict``) are units too, so ``"transformer.h"`` names
all the blocks. ``ModelGraph`` picks a granularity from this tree; plans place split points on it.

Example:
    >>> tree = CallTree(capture)
    >>> tree.units["transformer.h"].children[:2]
    ('transformer.h.0', 'transformer.h.1')
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeviz.capture.export import Capture

__all__ = ["CallTree", "Unit"]

ROOT = ""

# A unit's key: ("m", fqn, call) for a called module, ("c", fqn, parent key) for a container.
_Key = tuple[str, str, object]


@dataclass(frozen=True)
class Unit:
    """One module call (or container) in the forward.

    Attributes:
        name: the FQN, or ``fqn@k`` for call ``k`` of a module that runs several times.
        fqn: the module's FQN in the original model.
        kind: the module's class name.
        first, last: index of the first and last op it ran.
        children: names of the units it contains, in execution order.
        parent: name of the enclosing unit (``""`` for the model itself).
        called: False for a container that is never called itself (its children are).
        calls: how many units share this FQN (how many times forward calls the module).
        elementwise: a parameter-free activation / dropout / identity module.
    """

    name: str
    fqn: str
    kind: str
    first: int
    last: int
    children: tuple[str, ...]
    parent: str
    called: bool
    calls: int
    elementwise: bool


class CallTree:
    """Units of a ``Capture`` and, for every op, the chain of units it ran in (outermost first)."""

    def __init__(self, cap: Capture) -> None:
        self.ops = cap.ops
        keys_of: dict[tuple[tuple[str, ...], tuple[int, ...]], tuple[_Key, ...]] = {}
        op_keys: list[tuple[tuple[Any, ...], ...]] = []
        span: dict[tuple[Any, ...], list[int]] = {}
        kids: dict[tuple[Any, ...], dict[tuple[Any, ...], None]] = {("root",): {}}
        for op in cap.ops:
            sig = (op.stack, op.calls)
            if sig not in keys_of:
                keys_of[sig] = _key_path(op.stack, op.calls)
            path = keys_of[sig]
            op_keys.append(path)
            parent: tuple[Any, ...] = ("root",)
            for key in path:
                s = span.setdefault(key, [op.index, op.index])
                s[1] = op.index
                kids.setdefault(parent, {})[key] = None
                kids.setdefault(key, {})
                parent = key
        # Names: the FQN when it occurs once, fqn@k (k-th occurrence) when a module runs several times.
        occurrences: dict[str, list[tuple[Any, ...]]] = {}
        for key in sorted(span, key=lambda k: span[k][0]):
            occurrences.setdefault(key[1], []).append(key)
        name_of: dict[tuple[Any, ...], str] = {("root",): ROOT}
        for fqn, keys in occurrences.items():
            for k, key in enumerate(keys):
                name_of[key] = fqn if len(keys) == 1 else f"{fqn}@{k}"
        modules, elementwise = cap.modules, cap.elementwise
        self.units: dict[str, Unit] = {}
        n_ops = len(cap.ops)
        for node, children in kids.items():
            name = name_of[node]
            fqn = "" if node == ("root",) else node[1]
            first, last = span.get(node, [0, n_ops - 1])
            ordered = sorted(children, key=lambda k: span[k][0])
            self.units[name] = Unit(
                name=name, fqn=fqn, kind=modules.get(fqn, ("?", ()))[0], first=first, last=last,
                children=tuple(name_of[k] for k in ordered), parent="", called=node[0] != "c",
                calls=len(occurrences.get(fqn, [node])), elementwise=fqn in elementwise,
            )
        for unit in list(self.units.values()):
            for child in unit.children:
                self.units[child] = _replace(self.units[child], parent=unit.name)
        self.paths: list[tuple[str, ...]] = [tuple(name_of[k] for k in path) for path in op_keys]
        self.by_fqn: dict[str, tuple[str, ...]] = {
            fqn: tuple(name_of[k] for k in keys) for fqn, keys in occurrences.items()
        }
        self._chained: dict[str, bool] = {}

    # ----------------------------------------------------------------- queries
    def ancestors(self, name: str) -> list[str]:
        """Enclosing units of ``name``, innermost first (the model itself excluded)."""
        out = []
        parent = self.units[name].parent
        while parent != ROOT:
            out.append(parent)
            parent = self.units[parent].parent
        return out

    def depth(self, name: str) -> int:
        return len(self.ancestors(name)) + 1 if name != ROOT else 0

    def composite(self, name: str) -> bool:
        return bool(self.units[name].children)

    def chained(self, name: str) -> bool:
        """Whether each child's output feeds the next child (a trunk of blocks, not parallel experts)."""
        if name not in self._chained:
            self._chained[name] = self._compute_chained(name)
        return self._chained[name]

    def _compute_chained(self, name: str) -> bool:
        unit = self.units[name]
        kids = [self.units[c] for c in unit.children]
        if len(kids) < 2:
            return False
        firsts = [k.first for k in kids]
        need = set(range(len(kids) - 1))
        src: dict[int, frozenset[int]] = {}
        for i in range(unit.first, unit.last + 1):
            j = bisect.bisect_right(firsts, i) - 1
            inputs = self.ops[i].inputs
            if j >= 0 and i <= kids[j].last:
                src[i] = frozenset((j,))
                if j - 1 in need and any(j - 1 in src.get(s, ()) for s in inputs):
                    need.discard(j - 1)
            else:
                acc: set[int] = set()
                for s in inputs:
                    acc.update(src.get(s, ()))
                src[i] = frozenset(acc)
        return not need

    def block_list(self, name: str) -> bool:
        """Two or more composite children of one class, each feeding the next: GPT-2's ``h``, ALBERT's
        repeated layer, a ResNet stage. Parallel experts are not one (they do not chain)."""
        kids = [self.units[c] for c in self.units[name].children]
        return (len(kids) >= 2 and all(k.children for k in kids) and len({k.kind for k in kids}) == 1
                and self.chained(name))

    def holds_block_list(self, name: str) -> bool:
        return any(self.block_list(c) or self.holds_block_list(c) for c in self.units[name].children)

    def natural(self, depth: int | None = None) -> list[str]:
        """Default layers: blocks kept whole, block lists opened, elementwise modules left as glue.

        With ``depth``: every unit down to that module depth instead.
        """
        def opens(name: str) -> bool:
            unit = self.units[name]
            if name == ROOT:
                return True
            if not unit.children:
                return False
            if depth is not None:
                return self.depth(name) < depth
            if self.block_list(name):
                return True
            inside_block = unit.parent != ROOT and self.block_list(unit.parent)
            return not inside_block and self.holds_block_list(name)

        out: list[str] = []

        def walk(name: str) -> None:
            if opens(name):
                for kid in self.visible_children(name):
                    walk(kid)
            else:
                out.append(name)

        walk(ROOT)
        # A wrapper with a single child says nothing: open it until there is something to split.
        while depth is None and len(out) == 1 and self.visible_children(out[0]):
            out = self.visible_children(out[0])
        return out

    def visible_children(self, name: str) -> list[str]:
        """Children that can be layers: elementwise modules are glue (unless nothing else is there)."""
        kids = list(self.units[name].children)
        shown = [k for k in kids if not self.units[k].elementwise]
        return shown or kids


def _key_path(stack: tuple[str, ...], calls: tuple[int, ...]) -> tuple[_Key, ...]:
    """Unit keys of one op, outermost first: ("m", fqn, call) for a called module, ("c", fqn, parent key)
    for a container between two called modules (never in torch's module stack, as it is never called)."""
    path: list[_Key] = []
    parent: tuple[object, ...] = ("root",)
    parent_fqn = ""
    for fqn, call in zip(stack, calls, strict=True):
        if not parent_fqn or fqn.startswith(parent_fqn + "."):
            atoms = fqn.split(".")
            start = len(parent_fqn.split(".")) if parent_fqn else 0
            for k in range(start + 1, len(atoms)):
                path.append(("c", ".".join(atoms[:k]), parent))
        key: _Key = ("m", fqn, call)
        path.append(key)
        parent, parent_fqn = key, fqn
    return tuple(path)


def _replace(unit: Unit, *, parent: str) -> Unit:
    from dataclasses import replace

    return replace(unit, parent=parent)
