"""Grad-mode and autocast regions of a forward, made splittable.

``torch.export`` captures a ``with torch.no_grad():`` / ``torch.enable_grad()`` / ``torch.set_grad_enabled(b)`` /
``torch.autocast(...)`` block (or such a decorator) as a higher-order op whose body is a submodule of the graph:
``wrap_with_set_grad_enabled(False, body, *args)`` or ``wrap_with_autocast(device, dtype, enabled, cache, body,
*args)``. torch's ``pipeline()`` loses those bodies when it splits the graph into stages ("Node submod_1 target
submod_1 references nonexistent attribute", or a body that is ``None`` on the rank), whatever the split.

``inline_regions`` puts each body back into the graph it came from, between two plain calls that enter and leave
the region at run time (the form ``torch.export`` produced before it had these higher-order ops): the region's
values pass through the leaving call, so every later use still reads ``getitem(region, i)`` and the region keeps
its place in the order. A split never falls inside a region (``pipeviz.capture.export`` records the modules a region
runs, and the graph does not offer them as split points), so each region runs whole in one stage, in the grad
mode and autocast state the unsplit model runs it in.

Example:
    >>> ep = torch.export.export(model, (x,))
    >>> inline_regions(ep.graph_module)        # the number of regions inlined
    1
"""

from __future__ import annotations

import base64
import functools
import pickle
import warnings
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import fx
from torch.fx.node import Argument

__all__ = ["REGION_META", "REGION_OPS", "describe_region", "enter_autocast", "enter_grad", "hold_constants",
           "inline_regions", "leave_region", "load_constant", "region_bodies"]


def _hop(name: str) -> torch._ops.HigherOrderOperator | None:
    return getattr(torch.ops.higher_order, name, None)


# name of the higher-order op -> how the region is written in a forward (for messages)
REGION_OPS = {"wrap_with_set_grad_enabled": "torch.no_grad() / torch.set_grad_enabled()",
              "wrap_with_autocast": "torch.autocast()"}


class _Region:
    """What ``enter_*`` hands to ``leave_region``: how to restore the state before the region."""

    def __init__(self, grad: bool | None = None, autocast: torch.autocast | None = None) -> None:
        self.grad = grad
        self.autocast = autocast


@torch.fx.node.has_side_effect
def enter_grad(enabled: bool) -> _Region:
    """Set grad mode to ``enabled`` (a ``torch.set_grad_enabled`` region starts); returns the previous mode."""
    region = _Region(grad=torch.is_grad_enabled())
    torch._C._set_grad_enabled(bool(enabled))
    return region


@torch.fx.node.has_side_effect
def enter_autocast(device_type: str, dtype: torch.dtype | None, enabled: bool, cache_enabled: bool | None) -> _Region:
    """Enter ``torch.autocast(device_type, dtype, enabled, cache_enabled)`` (an autocast region starts)."""
    ctx = torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
    ctx.__enter__()
    return _Region(autocast=ctx)


@torch.fx.node.has_side_effect
def leave_region(region: _Region, *values: object) -> tuple[object, ...]:
    """Leave the region ``region`` entered (restore grad mode / autocast) and pass its results on."""
    if region.autocast is not None:
        region.autocast.__exit__(None, None, None)
    if region.grad is not None:
        torch._C._set_grad_enabled(region.grad)
    return values


def _is_region(node: fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    for name in REGION_OPS:
        hop = _hop(name)
        if hop is not None and node.target is hop:
            return name
    return None


def _split_args(name: str, args: tuple[Argument, ...]
                ) -> tuple[tuple[Argument, ...], fx.Node, tuple[Argument, ...]]:
    """(the region's own arguments, the body's get_attr node, the body's inputs)."""
    n = 1 if name == "wrap_with_set_grad_enabled" else 4
    return tuple(args[:n]), cast(fx.Node, args[n]), tuple(args[n + 1:])


def region_bodies(gm: fx.GraphModule) -> Iterator[tuple[str, fx.Node, fx.GraphModule]]:
    """Every region of ``gm`` (nested ones too): (the higher-order op's name, its node, its body)."""
    for node in gm.graph.nodes:
        name = _is_region(node)
        if name is None:
            continue
        _, body_node, _ = _split_args(name, node.args)
        body = _body(gm, body_node)
        yield name, node, body
        yield from region_bodies(body)


def _attr(gm: fx.GraphModule, target: str) -> object:
    value: object = gm
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def _body(gm: fx.GraphModule, body_node: fx.Node) -> fx.GraphModule:
    """The body graph a region's ``get_attr`` node reads."""
    return cast(fx.GraphModule, _attr(gm, str(body_node.target)))


REGION_META = "pipeviz_region"  # node.meta key: the outermost region a node runs in, as ``describe_region`` says


def describe_region(node: fx.Node) -> str:
    """How a region's higher-order op reads in the source: ``torch.no_grad() block in Rotary.forward (rotary)``."""
    name = _is_region(node)
    own = _split_args(name, node.args)[0] if name else ()
    if name == "wrap_with_set_grad_enabled":
        what = "torch.enable_grad()" if own[0] else "torch.no_grad()"
    else:
        device, dtype, enabled = own[0], own[1], own[2]
        what = f"torch.autocast({device!r}, {str(dtype).replace('torch.', '')})" if enabled \
            else f"torch.autocast({device!r}, enabled=False)"
    stack = node.meta.get("nn_module_stack") or {}
    fqn, cls = list(stack.values())[-1] if stack else ("", "")
    cls = cls.rsplit(".", 1)[-1] if isinstance(cls, str) else getattr(cls, "__name__", "")
    where = f"{cls}.forward" + (f" ({fqn})" if fqn else "") if cls else "the model's forward"
    return f"{what} block in {where}"


def inline_regions(gm: fx.GraphModule, _label: str | None = None) -> int:
    """Replace every grad-mode / autocast region of ``gm`` (nested ones too) by its body between
    ``enter_grad`` / ``enter_autocast`` and ``leave_region`` calls, in place; returns how many were inlined.
    Every node of a region, its enter and leave calls included, gets ``meta[REGION_META]``: the outermost
    region's description, numbered (``"2: torch.no_grad() block in Rotary.forward (rotary)"``)."""
    count = 0
    graph = gm.graph
    for node in list(graph.nodes):
        name = _is_region(node)
        if name is None:
            continue
        own, body_node, inputs = _split_args(name, node.args)
        body = _body(gm, body_node)
        label = _label or f"{_next_id()}: {describe_region(node)}"
        count += inline_regions(body, label)
        enter = enter_grad if name == "wrap_with_set_grad_enabled" else enter_autocast
        with graph.inserting_before(node):
            token = graph.call_function(enter, own)
            token.meta = {k: v for k, v in node.meta.items() if k != "val"}
            results = _copy_body(gm, body, inputs)
            leave = graph.call_function(leave_region, (token, *results))
            leave.meta = dict(node.meta)
        for n in _between(token, leave):
            n.meta[REGION_META] = label
        node.replace_all_uses_with(leave)
        for user in leave.users:
            # export gives the getitems reading a region's results the module stack of the body's last op (a
            # module called inside the block); they run after the block, where the region was written.
            if "nn_module_stack" in leave.meta:
                user.meta["nn_module_stack"] = dict(leave.meta["nn_module_stack"])
        graph.erase_node(node)
        if not body_node.users:
            graph.erase_node(body_node)
            if all(n.op != "get_attr" or n.target != body_node.target for n in graph.nodes):
                _del_attr(gm, str(body_node.target))
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count


_ids = iter(range(1, 1 << 62))


def _next_id() -> int:
    return next(_ids)


def _between(first: fx.Node, last: fx.Node) -> Iterator[fx.Node]:
    n = first
    while True:
        yield n
        if n is last:
            return
        n = n.next


def _copy_body(gm: fx.GraphModule, body: fx.GraphModule, inputs: tuple[Argument, ...]) -> tuple[Argument, ...]:
    """Copy ``body``'s nodes into ``gm``'s graph at its insertion point, its placeholders bound to ``inputs``;
    returns the nodes of its results."""
    graph = gm.graph
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    for ph, value in zip(placeholders, inputs, strict=True):
        env[ph] = value
    for n in body.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            out = fx.node.map_arg(n.args[0], env.__getitem__)
            return tuple(out) if isinstance(out, tuple | list) else (out,)
        if n.op == "get_attr":  # a constant or a nested body the body holds: move it to gm
            fresh = _free_name(gm, f"_pv_region_{str(n.target).replace('.', '_')}")
            _set_attr(gm, fresh, _attr(body, str(n.target)))
            env[n] = graph.get_attr(fresh)
            env[n].meta = dict(n.meta)
            continue
        env[n] = graph.node_copy(n, env.__getitem__)
    raise RuntimeError("a region's body graph has no output; please report.")


def _free_name(gm: fx.GraphModule, base: str) -> str:
    name, k = base, 0
    while hasattr(gm, name):
        k += 1
        name = f"{base}_{k}"
    return name


def _set_attr(gm: fx.GraphModule, name: str, value: object) -> None:
    if isinstance(value, torch.nn.Module):
        gm.add_module(name, value)
    elif isinstance(value, torch.Tensor):
        gm.register_buffer(name, value, persistent=False)
    else:
        setattr(gm, name, value)


def _del_attr(gm: fx.GraphModule, target: str) -> None:
    *path, leaf = target.split(".")
    parent: Any = gm
    for atom in path:
        parent = getattr(parent, atom)
    if hasattr(parent, leaf):
        delattr(parent, leaf)


@functools.lru_cache(maxsize=256)
def load_constant(blob: str) -> object:
    """The constant ``hold_constants`` wrote into the graph as ``blob`` (base64 of its pickle)."""
    with warnings.catch_warnings():  # torch's own pytree deprecation notice while a TreeSpec unpickles
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        return pickle.loads(base64.b64decode(blob))


def hold_constants(gm: fx.GraphModule) -> int:
    """Make every non-tensor constant of ``gm`` (``get_attr`` of a ``TreeSpec``, as transformers 4.x's vmapped
    attention masks leave for ``flat_apply``) a call ``load_constant(blob)`` carrying its pickle, in place;
    returns how many. torch's ``pipeline()`` moves every root attribute into the stages as a tensor and refuses
    these ("Expected 'function_const_func_spec0' to be Tensor but got TreeSpec"); a literal argument travels with
    the node into whichever stage reads it, and through pipeviz's flat stages to the ranks."""
    count = 0
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        value = _attr(gm, str(node.target))
        if isinstance(value, torch.Tensor | torch.nn.Module):
            continue
        blob = base64.b64encode(pickle.dumps(value)).decode("ascii")
        with graph.inserting_before(node):
            read = graph.call_function(load_constant, (blob,))
        read.meta = dict(node.meta)
        node.replace_all_uses_with(read)
        graph.erase_node(node)  # the attribute stays: another get_attr may read it too
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count
