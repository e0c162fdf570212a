"""Every place pipeviz touches torch internals (torch 2.13), in one module.

- ``flatten_stage``: torch's stage submodules are unflattened ``InterpreterModule`` trees that cannot be
  pickled; each is turned into one flat ``fx.GraphModule`` (pure torch: no model class needed to run it),
  so the parent traces once and each rank receives only its own stage. Parameters get the original model's
  canonical names, so a tensor used twice in a stage (T5's shared embedding) is one parameter.
- ``split_graph``: the top-level graph of a ``Pipe`` (which stage reads which value).
- ``timed_waits``: times blocking communication waits inside torch's schedules.
- ``fake_tensors``: run stages on fake tensors to learn their shapes without computing or touching any
  real tensor (BatchNorm statistics stay as they are).
- ``exact_split_backward``: zero-bubble schedules split a backward into input grads (I) and weight grads
  (W); torch 2.13 gives no gradient at all to a weight whose path to the stage's outputs never meets the
  inputs' path (OPT's and BART's learned positions, a stage computing only position embeddings), and its W
  pass frees graph parts that another weight group still needs (T5's relative attention bias).
- ``schedule_actions``: the action order torch's multi-stage schedules build in their constructor.

``tests/test_adapter.py`` checks each against the installed torch, so a torch whose internals changed
fails there loudly, not in a worker.
"""

from __future__ import annotations

import contextlib
import operator
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

__all__ = ["FlatStage", "canonical_name", "defake", "describe", "exact_split_backward", "fake_cpu", "fake_tensors",
           "flatten_stage", "schedule_actions", "split_graph", "timed_waits"]

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

    def __reduce__(self) -> Any:
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

        def swap(x: Any) -> Any:
            return device if isinstance(x, torch.device) and x != device else x

        for node in self.graph.nodes:
            args, kwargs = pytree.tree_map(swap, (node.args, node.kwargs))
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs = args, kwargs
                changed += 1
        if changed:
            self.recompile()
        return changed

    def failing_op(self, *args: Any) -> tuple[str, str, str] | None:
        """Run the graph node by node on ``args`` and describe the op that raises: (module, op, inputs)."""
        where: list[fx.Node] = []

        class Finder(fx.Interpreter):
            def run_node(self, n: fx.Node) -> Any:
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


def _target_record(target: Any) -> Any:
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


def _node_record(node: fx.Node) -> tuple[Any, ...]:
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


def describe(x: Any) -> str:
    """A tensor as ``[8, 512] float32`` (a tuple of them joined); anything else by its repr."""
    if isinstance(x, tuple | list):
        return "(" + ", ".join(describe(v) for v in x) + ")"
    if isinstance(x, torch.Tensor):
        return f"{list(x.shape)} {str(x.dtype).replace('torch.', '')}"
    return repr(x)[:40]


def _inputs_of(node: fx.Node, gm: fx.GraphModule, args: tuple[Any, ...]) -> str:
    """Shapes of a node's tensor inputs, recomputed up to that node on fake tensors."""
    values: dict[fx.Node, Any] = {}

    class Upto(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
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


def _rebuild(attrs: dict[str, Any], records: list[tuple[Any, ...]], node_modules: dict[str, str]) -> FlatStage:
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


def _register(root: nn.Module, attrs: dict[str, Any]) -> None:
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
    attrs: dict[str, Any] = {}
    nodes: dict[str, fx.Node] = {}
    node_modules: dict[str, str] = {}

    model_names = set(aliases.values())

    def attribute(path: str, value: Any) -> fx.Node:
        name = canonical_name(path, aliases)
        # torch copies a module's tensors for each of its calls (ALBERT's one layer, called 12 times): one
        # model tensor is one parameter again. Other attributes (lifted constants) stay apart.
        if name in attrs and attrs[name] is not value and name not in model_names:
            name = path.replace("@", "_at_")
        if name not in nodes:
            attrs[name] = value
            nodes[name] = new.get_attr(name)
        return nodes[name]

    def inline(mod: nn.Module, prefix: str, args: list[Any]) -> Any:
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


@contextlib.contextmanager
def fake_tensors() -> Iterator[Callable[[Any], Any]]:
    """Inside the block, run code on fake tensors: ``fake(tree)`` turns the tensors of ``tree`` into fake
    ones; real parameters and buffers met along the way are used as fakes too, so nothing real changes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(tree: Any) -> Any:
        return pytree.tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, tree)

    with torch.no_grad(), mode:
        yield fake


def fake_cpu(model: nn.Module) -> Any:
    """Turn ``model``'s meta tensors into fake CPU tensors (no memory) and return their ``FakeTensorMode``:
    traced inside it (``with mode: torch.export.export(model, fake_inputs)``), a meta model takes the code
    paths it takes on the CPU, where it will run (HF Mixtral dispatches experts by the device type; on the
    meta device it would trace the GPU path). Tensors shared by several modules stay shared."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for key, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in memo:
                    with mode:
                        fake = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                    memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) \
                        if isinstance(t, nn.Parameter) else fake
                table[key] = memo[id(t)]  # type: ignore[assignment]
    return mode


def defake(module: nn.Module) -> None:
    """Turn the fake tensors a ``fake_cpu`` trace left in ``module`` back into meta tensors (constants the
    trace created from Python numbers keep their value)."""
    from torch._subclasses.fake_tensor import FakeTensor

    def plain(t: torch.Tensor) -> torch.Tensor:
        const = getattr(t, "constant", None)
        if isinstance(const, torch.Tensor) and not isinstance(const, FakeTensor):
            return const.clone()
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    for mod in module.modules():
        for table in (mod._parameters, mod._buffers):
            for key, t in list(table.items()):
                if isinstance(t, FakeTensor):
                    value = plain(t)
                    table[key] = nn.Parameter(value, requires_grad=t.requires_grad) \
                        if isinstance(t, nn.Parameter) else value  # type: ignore[assignment]
        for key, t in list(vars(mod).items()):
            if isinstance(t, FakeTensor):
                setattr(mod, key, plain(t))


@contextlib.contextmanager
def exact_split_backward() -> Iterator[None]:
    """Inside the block, torch's zero-bubble input-grad / weight-grad split gives every weight its exact
    gradient: weights off the inputs' path get theirs during the input-grad pass (there is nothing to share
    with it), and the weight-grad pass keeps the graph until every weight group is done."""
    from torch.distributed.pipelining import stage as torch_stage

    original_input, original_weight = torch_stage.stage_backward_input, torch_stage.stage_backward_weight

    def backward_input(outputs: list[Any], output_grads: Any, input_values: list[Any], weights: Any) -> Any:
        weights = list(weights)
        _grads_off_the_input_path(outputs, output_grads, input_values, weights)
        dinputs, groups = original_input(outputs, output_grads, input_values, iter(weights))
        # torch sends these to the previous stage as they are; autograd.grad keeps the strides of the op that
        # made them (a transpose's), and gloo refuses a non-contiguous tensor ("input tensor has to be
        # contiguous"). The full backward's accumulated .grad is contiguous already.
        dinputs = tuple(d.contiguous() if isinstance(d, torch.Tensor) else d for d in dinputs)
        return dinputs, groups

    def backward_weight(weights: Any, param_groups: Any, retain_graph: bool = False) -> Any:
        return original_weight(weights, param_groups, retain_graph=True)

    # Patched where PipelineStage looks them up (torch's own module globals), for the block only.
    torch_stage.stage_backward_input = backward_input  # type: ignore[assignment]
    torch_stage.stage_backward_weight = backward_weight
    try:
        yield
    finally:
        torch_stage.stage_backward_input, torch_stage.stage_backward_weight = original_input, original_weight


def _grads_off_the_input_path(outputs: list[Any], output_grads: Any, input_values: list[Any],
                              weights: list[torch.Tensor]) -> None:
    from torch.distributed.pipelining._backward import (
        _get_grad_fn_or_grad_acc,
        construct_reverse_graph,
        reverse_closure,
    )

    valid = [(o, torch.ones_like(o) if output_grads is None else output_grads[i])
             for i, o in enumerate(outputs) if isinstance(o, torch.Tensor) and (o.requires_grad or o.grad_fn)]
    input_fns = [f for x in input_values if isinstance(x, torch.Tensor) and (f := _get_grad_fn_or_grad_acc(x))]
    if not valid or not input_fns:  # the first stage: torch runs a full backward in its W pass instead
        return
    roots = {f for o, _ in valid if (f := _get_grad_fn_or_grad_acc(o))}
    reverse = construct_reverse_graph(list(roots))
    inputs_closure, _ = reverse_closure(input_fns, set(), reverse)
    # torch's W pass starts from the nodes where a weight's path meets the inputs' path. A weight whose path
    # never meets it, or also reaches an output around it (T5's position bias, computed in one block and
    # sent on to the next stage), would lose that part: such weights get their whole gradient here, and
    # torch's split never sees them.
    off = []
    for w in weights:
        acc = _get_grad_fn_or_grad_acc(w)
        if acc is None or acc not in reverse:
            continue
        closure, met = reverse_closure([acc], inputs_closure, reverse)
        if not met or (closure & roots):
            off.append(w)
    if off:
        grads = torch.autograd.grad([o for o, _ in valid], off, [g for _, g in valid], retain_graph=True,
                                    allow_unused=True)
        for w, g in zip(off, grads, strict=True):
            if g is not None:
                w.grad = g if w.grad is None else w.grad + g
    kept = [w for w in weights if all(w is not o for o in off)]
    weights[:] = kept


def _graph_of(mod: nn.Module) -> fx.Graph:
    graph = getattr(mod, "graph", None)
    if not isinstance(graph, fx.Graph):
        raise RuntimeError(f"torch's stage module {type(mod).__name__} has no fx graph; pipeviz needs updating.")
    return graph


def split_graph(pipe: Any) -> fx.Graph:
    """The top-level graph of torch's ``Pipe``: placeholders, one ``call_module`` per stage, the output."""
    graph = getattr(getattr(pipe, "split_gm", None), "graph", None)
    if not isinstance(graph, fx.Graph):
        raise RuntimeError("torch's Pipe has no split_gm graph any more; pipeviz needs updating for this torch.")
    return graph


@contextlib.contextmanager
def timed_waits(record: Callable[[float, float], None], threshold: float = 1e-4) -> Iterator[None]:
    """Inside the block, ``record(start, end)`` (wall clock) every blocking wait of torch's schedules on
    batched sends and receives that lasts more than ``threshold`` seconds."""
    import time

    from torch.distributed.pipelining import schedules

    original = schedules._wait_batch_p2p

    def timed(work: Any) -> Any:
        if not work:  # torch waits on empty lists too: nothing to time
            return original(work)
        start = time.time()
        out = original(work)
        end = time.time()
        if end - start > threshold:
            record(start, end)
        return out

    schedules._wait_batch_p2p = timed
    try:
        yield
    finally:
        schedules._wait_batch_p2p = original


def schedule_actions(schedule: str, num_ranks: int, num_stages: int, microbatches: int) -> list[list[str]]:
    """Per-rank compute actions (``2F0``, ``1I3``, ``0W3``) of a multi-stage torch schedule, as its
    constructor lays them out in ``pipeline_order`` (overlapped F/B pairs of DualPipeV in run order)."""
    from unittest import mock

    from torch.distributed.pipelining.schedules import get_schedule_class
    from torch.distributed.pipelining.stage import PipelineStage

    # torch builds pipeline_order from a few stage attributes; a spec'd stand-in is enough (torch's own
    # _schedule_visualizer does the same).
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, num_ranks, None, num_stages
    sched = get_schedule_class(schedule)([stage] * (num_stages // num_ranks), microbatches)
    out: list[list[str]] = []
    for rank in range(num_ranks):
        acts: list[str] = []
        for action in sched.pipeline_order[rank]:
            if action is None:
                continue
            for a in getattr(action, "sub_actions", None) or [action]:
                kind = a.computation_type.value if hasattr(a.computation_type, "value") else str(a.computation_type)
                if kind in ("F", "B", "I", "W"):
                    acts.append(f"{a.stage_index}{kind}{a.microbatch_index}")
        out.append(acts)
    return out


@contextlib.contextmanager
def regions_inlined() -> Iterator[None]:
    """Inside the block, torch's ``pipeline()`` splits a graph whose grad-mode / autocast regions are inlined and
    whose non-tensor constants are held in modules (``pipeviz.regions``): torch 2.13–2.15 lose those regions'
    bodies when they split the exported graph, and refuse a constant that is not a tensor."""
    from torch.distributed.pipelining._IR import Pipe

    from pipeviz.regions import hold_constants, inline_regions

    original = Pipe.__dict__["_trace_with_export"]

    def trace(mod: nn.Module, example_args: tuple[Any, ...], example_kwargs: dict[str, Any] | None = None) -> Any:
        ep = original.__func__(mod, example_args, example_kwargs)
        inline_regions(ep.graph_module)
        hold_constants(ep.graph_module)
        return ep

    Pipe._trace_with_export = staticmethod(trace)  # type: ignore[method-assign]
    try:
        yield
    finally:
        Pipe._trace_with_export = original  # type: ignore[method-assign]
