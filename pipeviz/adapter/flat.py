"""torch's stage submodules as flat, picklable ``fx.GraphModule``s (``flatten_stage``), with the original
model's canonical parameter names, and where in a stage an op failed (``describe``)."""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

_CALL = re.compile(r"@\d+")


def canonical_name(path: str, aliases: dict[str, str]) -> str:
    """The original model's name for a stage attribute: torch names the copies a second call of a module
    makes ``shared@1.0@1.weight``; those are ``shared.0.weight``, under its canonical alias."""
    plain = _CALL.sub("", path)
    return aliases.get(plain, plain)


class FlatStage(fx.GraphModule):
    """A flat stage graph that pickles as its node list (fx's own pickling re-traces the generated code and
    loses in-place ops whose result is unused, such as BatchNorm's ``num_batches_tracked.add_(1)``).

    ``node_modules`` names, for each op, the module of the original model it ran in (errors name it).
    """

    node_modules: dict[str, str]

    def __reduce__(self) -> tuple[Callable[..., FlatStage], tuple[object, ...]]:
        attrs: dict[str, Any] = {}
        for node in self.graph.nodes:
            if node.op in ("get_attr", "call_module"):
                value: Any = self
                for atom in str(node.target).split("."):
                    value = getattr(value, atom)
                attrs[str(node.target)] = value
        return (_rebuild, (attrs, [_node_record(n) for n in self.graph.nodes], getattr(self, "node_modules", {})))

    def retarget(self, device: torch.device) -> int:
        """Make every device the trace baked into the graph ``device`` (a model traced on the CPU or the meta
        device creates position ids, masks and casts there); returns how many ops changed. Needed wherever
        the stage runs elsewhere than it was traced."""
        changed = 0

        def swap(x: object) -> object:
            return device if isinstance(x, torch.device) and x != device else x

        for node in self.graph.nodes:
            args, kwargs = pytree.tree_map(swap, (node.args, node.kwargs))
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs = args, kwargs
                changed += 1
        if changed:
            self.recompile()
        return changed

    def failing_op(self, *args: object) -> tuple[str, str, str] | None:
        """Run the graph node by node on ``args`` and describe the op that raises: (module, op, inputs)."""
        where: list[fx.Node] = []

        class Finder(fx.Interpreter):
            def run_node(self, n: fx.Node) -> object:
                where[:] = [n]
                return super().run_node(n)

        try:
            with torch.no_grad():
                Finder(self).run(*args)
        except Exception:
            node = where[0] if where else None
            if node is None:
                return None
            return getattr(self, "node_modules", {}).get(node.name, ""), str(node.target), _inputs_of(node, self, args)
        return None


class _Ref:
    """A reference to an earlier node, by name, in a pickled node list."""

    def __init__(self, name: str) -> None:
        self.name = name


def _target_record(target: object) -> tuple[object, ...]:
    if isinstance(target, torch._ops.OpOverload):
        # A custom op (transformers' grouped_mm_fallback in Mixtral) exists only once the module defining it
        # is imported: remember which, so a rank imports just that module.
        from torch._library.custom_ops import OPDEFS

        qualname = target._schema.name
        init = getattr(OPDEFS.get(qualname), "_init_fn", None)
        home = getattr(init, "__module__", None)
        return ("op", target.namespace, qualname.split("::")[-1], target._overloadname, home)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return ("hop", target.name())
    return ("py", target)


def _node_record(node: fx.Node) -> tuple[object, ...]:
    return (node.op, node.name, _target_record(node.target), fx.node.map_aggregate(node.args, _ref_of),
            fx.node.map_aggregate(node.kwargs, _ref_of))


def _ref_of(x: Any) -> Any:
    return _Ref(x.name) if isinstance(x, fx.Node) else x


def _resolve_target(record: Any) -> Any:
    kind = record[0]
    if kind == "op":
        _, ns, name, overload, home = record
        if home and not hasattr(getattr(torch.ops, ns), name):
            import importlib

            importlib.import_module(home)
        packet = getattr(getattr(torch.ops, ns), name)
        return getattr(packet, overload or "default")
    if kind == "hop":
        return getattr(torch.ops.higher_order, record[1])
    return record[1]


def describe(x: object) -> str:
    """A tensor as ``[8, 512] float32`` (a tuple of them joined); anything else by its repr."""
    if isinstance(x, tuple | list):
        return "(" + ", ".join(describe(v) for v in x) + ")"
    if isinstance(x, torch.Tensor):
        return f"{list(x.shape)} {str(x.dtype).replace('torch.', '')}"
    return repr(x)[:40]


def _inputs_of(node: fx.Node, gm: fx.GraphModule, args: tuple[object, ...]) -> str:
    """Shapes of a node's tensor inputs, recomputed up to that node on fake tensors."""
    values: dict[fx.Node, object] = {}

    class Upto(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            if n is node:
                raise _Stop
            values[n] = out = super().run_node(n)
            return out

    try:
        with torch.no_grad():
            Upto(gm).run(*args)
    except _Stop:
        pass
    except Exception:
        return ""
    shown = [describe(values[a]) for a in node.all_input_nodes if a in values]
    return ", ".join(shown)


class _Stop(Exception):
    pass


def _rebuild(attrs: dict[str, torch.Tensor | nn.Module], records: list[tuple[Any, ...]],
             node_modules: dict[str, str]) -> FlatStage:
    root = nn.Module()
    _register(root, attrs)
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}

    def back(x: Any) -> Any:
        return env[x.name] if isinstance(x, _Ref) else x

    for op, name, target, args, kwargs in records:
        node = graph.create_node(op, _resolve_target(target), fx.node.map_aggregate(args, back),
                                 fx.node.map_aggregate(kwargs, back), name=name)
        env[name] = node
    flat = FlatStage(root, graph, class_name="PipevizStage")
    flat.node_modules = node_modules
    return flat


def _register(root: nn.Module, attrs: dict[str, torch.Tensor | nn.Module]) -> None:
    for name, value in attrs.items():
        *path, leaf = name.split(".")
        parent = root
        for atom in path:
            if atom not in parent._modules:
                parent.add_module(atom, nn.Module())
            parent = parent._modules[atom]  # type: ignore[assignment]
        if isinstance(value, nn.Parameter):
            parent.register_parameter(leaf, value)
        elif isinstance(value, nn.Module):
            parent.add_module(leaf, value)
        else:
            parent.register_buffer(leaf, value)


def flatten_stage(stage: nn.Module, aliases: dict[str, str]) -> FlatStage:
    """One flat ``fx.GraphModule`` computing what torch's stage module ``stage`` computes.

    Every submodule call is inlined (torch's unflattened submodules hold an fx graph each); attributes are
    registered under canonical names (``canonical_name``), each tensor once; the inputs are the stage's
    placeholders in order.
    """
    new = fx.Graph()
    attrs: dict[str, torch.Tensor | nn.Module] = {}
    nodes: dict[str, fx.Node] = {}
    node_modules: dict[str, str] = {}

    model_names = set(aliases.values())

    def attribute(path: str, value: torch.Tensor | nn.Module) -> fx.Node:
        name = canonical_name(path, aliases)
        # torch copies a module's tensors for each of its calls (ALBERT's one layer, called 12 times): one
        # model tensor is one parameter again. Other attributes (lifted constants) stay apart.
        if name in attrs and attrs[name] is not value and name not in model_names:
            name = path.replace("@", "_at_")
        if name not in nodes:
            attrs[name] = value
            nodes[name] = new.get_attr(name)
        return nodes[name]

    def inline(mod: nn.Module, prefix: str, args: Sequence[object]) -> fx.node.Argument:
        env: dict[fx.Node, Any] = {}
        graph = _graph_of(mod)
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        for i, ph in enumerate(placeholders):
            env[ph] = args[i] if i < len(args) else (ph.args[0] if ph.args else None)
        for n in graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                return fx.node.map_arg(n.args[0], lambda x: env[x])
            if n.op == "get_attr":
                value: Any = mod
                for atom in str(n.target).split("."):
                    value = getattr(value, atom)
                if isinstance(getattr(value, "graph", None), fx.Graph):  # a higher-order op's body
                    value = flatten_stage(value, {})
                env[n] = attribute(prefix + str(n.target), value) if isinstance(value, torch.Tensor | nn.Module) \
                    else value
            elif n.op == "call_module":
                sub = mod.get_submodule(str(n.target))
                call_args = fx.node.map_arg(n.args, lambda x: env[x])
                if isinstance(getattr(sub, "graph", None), fx.Graph):
                    env[n] = inline(sub, f"{prefix}{n.target}.", list(call_args))
                else:  # a leaf module the exporter kept whole
                    target = attribute(f"{prefix}{n.target}", sub).target
                    env[n] = new.call_module(str(target), call_args, fx.node.map_arg(n.kwargs, lambda x: env[x]))
            elif n.op == "call_function" and n.target is operator.getitem and isinstance(env[n.args[0]], list | tuple):
                env[n] = env[n.args[0]][n.args[1]]  # an inlined call's output is a Python tuple of nodes
            elif n.op == "call_function" and getattr(n.target, "__name__", "") == "tree_flatten_spec":
                env[n] = pytree.tree_leaves(fx.node.map_arg(n.args[0], lambda x: env[x]))
            else:
                env[n] = new.node_copy(n, lambda x: env[x])
                node_modules[env[n].name] = _CALL.sub("", prefix.rstrip("."))
        raise RuntimeError(f"torch's stage graph of {type(mod).__name__} has no output; please report.")

    inputs = [new.placeholder(n.name) for n in _graph_of(stage).nodes if n.op == "placeholder"]
    out = inline(stage, "", inputs)
    if isinstance(out, list):
        out = tuple(out)
    new.output(out)
    root = nn.Module()
    _register(root, attrs)
    flat = FlatStage(root, new, class_name="PipevizStage")
    flat.node_modules = node_modules
    return flat


def _graph_of(mod: nn.Module) -> fx.Graph:
    graph = getattr(mod, "graph", None)
    if not isinstance(graph, fx.Graph):
        raise RuntimeError(f"torch's stage module {type(mod).__name__} has no fx graph; pipeviz needs updating.")
    return graph


def compiled_submodules(stage: nn.Module) -> nn.Module:
    """``stage`` (torch's stage submodule, an unflattened ``InterpreterModule`` tree) made to run each submodule's
    generated code instead of ``torch.fx.Interpreter``, node by node in Python; returns ``stage``.

    torch 2.13-2.15 run the unflattened modules through the interpreter (for readable stack traces): a 2-layer
    Llama stage's forward took 28.5-30.7 ms here against 20.0-20.4 ms as generated code (1 thread, the same
    results bit for bit). torch itself switches to the generated code under ``torch.compile``; this sets the same
    per-module switch (``_run_with_interpreter``). Workers run ``flatten_stage``'s one flat module and never meet
    this; it is for ``plan.stage_modules()``.
    """
    from torch.export.unflatten import InterpreterModule

    for mod in stage.modules():
        if isinstance(mod, InterpreterModule):
            if not hasattr(mod, "_run_with_interpreter"):
                raise RuntimeError("torch's InterpreterModule has no _run_with_interpreter switch any more; "
                                   "pipeviz needs updating for this torch.")
            mod._run_with_interpreter = False
    return stage
