"""Stage modules that torch's schedules can train correctly: relays, model inputs, tied parameters.

torch 2.13 builds stage graphs from a ``Pipe`` but (DESIGN.md facts 4, 5, 11, 12):
- a value used two or more stages later is sent directly, which no multi-stage schedule accepts and
  whose backward raises "Backward of skip connections not supported yet";
- model inputs are accepted only by the first stage;
- tied parameters are copied into each stage and their gradients never meet;
- stage state dicts hold stale alias copies.

``build_stages`` wraps each of torch's stage submodules (the real graph torch split) in a
``StageRunner`` whose inputs are exactly what the previous stage sends: every value still needed later
is relayed stage by stage, model inputs included, so all communication is between neighbours. It also
names, for each stage, the parameters it really uses (under the original model's names) and which of
them are tied to other stages.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from pipeviz.plan import SplitPlan

Value = tuple[Any, ...]  # ("in", placeholder) | ("s", stage, index or None)


class StageRunner(nn.Module):
    """One pipeline stage: torch's stage submodule plus the relay of values later stages need.

    ``forward`` takes what the previous stage sent (the first stage: the model's args and kwargs) and
    returns what the next stage needs, as a tuple of contiguous tensors; the last stage returns the
    model's output (a single tensor when the model has one output, e.g. HF logits).
    """

    def __init__(
        self, index: int, num_stages: int, module: nn.Module, takes: list[Value], calls: list[Value],
        gives: list[Value], output: Any, placeholders: list[str], kwarg_names: list[str],
    ) -> None:
        super().__init__()
        self.index, self.num_stages = index, num_stages
        self.stage = module
        self.takes, self.calls, self.gives, self.output = takes, calls, gives, output
        self.placeholders, self.kwarg_names = placeholders, kwarg_names
        self.compute_device: torch.device | None = None  # set when stages share a GPU over host memory
        self.output_index: int | None = None
        # Zero-bubble schedules detach stage outputs in place after the input-grad pass (torch 2.13,
        # stage_backward_input); when an output is also saved for the weight-grad pass (a ReLU's result,
        # a Linear's input) that breaks the W pass. Sending copies keeps the saved tensors intact.
        self.fresh_outputs = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.index == 0:
            # Model inputs by placeholder name, in the traced order: positional first, then kwargs.
            flat = list(args) + [kwargs[k] for k in self.kwarg_names if k in kwargs]
            env: dict[Value, Any] = {("in", p): v for p, v in zip(self.placeholders, flat, strict=False)}
        else:
            env = dict(zip(self.takes, args, strict=True))
        if self.compute_device is not None:
            env = {k: v.to(self.compute_device) if isinstance(v, torch.Tensor) else v for k, v in env.items()}
        out = self.stage(*(env[v] for v in self.calls))
        env[("s", self.index, None)] = out
        if isinstance(out, tuple | list):
            for k, item in enumerate(out):
                env[("s", self.index, k)] = item
        if self.index == self.num_stages - 1:
            leaves = [self._home(env[v]) for v in pytree.tree_leaves(self.output, is_leaf=_is_value)]
            if self.output_index is not None:  # an HF ModelOutput: the loss sees its logits
                return leaves[self.output_index]
            return leaves[0] if len(leaves) == 1 else tuple(leaves)
        # Contiguous: gloo refuses strided views (HF BERT's expanded attention mask). A relayed value
        # leaves as a new tensor: zero-bubble backward detaches stage inputs in place, which would break
        # an output that is the very same tensor.
        inputs = set() if self.fresh_outputs else {id(a) for a in args} | {id(v) for v in kwargs.values()}
        return tuple(_fresh(self._home(env[v]), inputs, self.fresh_outputs) for v in self.gives)

    def _home(self, t: Any) -> Any:
        return t.cpu() if self.compute_device is not None and isinstance(t, torch.Tensor) else t


def _fresh(t: Any, inputs: set[int], always: bool = False) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    if always or id(t) in inputs:
        return t.clone(memory_format=torch.contiguous_format)
    return t.contiguous()


def _is_value(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) >= 2 and x[0] in ("in", "s")


@dataclass
class StageSet:
    """What ``build_stages`` returns: runners, per-stage used parameters, tied groups, example tensors."""

    runners: list[StageRunner]
    params: list[dict[str, str]]  # per stage: canonical name -> name inside runner.stage
    tied: dict[str, list[int]]  # canonical name -> stages holding a copy (2 or more)
    owner: dict[str, int]  # canonical name -> stage that reports it in state_dict()
    buffers: list[dict[str, str]] = field(default_factory=list)
    inputs: list[tuple[torch.Tensor, ...]] = field(default_factory=list)  # per-stage example inputs (one mb)
    outputs: list[tuple[torch.Tensor, ...]] = field(default_factory=list)


def _used_names(mod: nn.Module, prefix: str = "") -> list[str]:
    """Parameter/buffer names a stage's graph really reads (stale alias copies are never read)."""
    if not isinstance(mod, fx.GraphModule):
        return [prefix + n for n, _ in [*mod.named_parameters(), *mod.named_buffers()]]
    names: list[str] = []
    for node in mod.graph.nodes:
        if node.op == "get_attr":
            names.append(prefix + str(node.target))
        elif node.op == "call_module":
            names.extend(_used_names(mod.get_submodule(str(node.target)), prefix + str(node.target) + "."))
    return names


def _top_level(pipe: Any) -> tuple[list[str], list[list[Value]], Any]:
    """Placeholders, per-stage call arguments and the output structure of torch's split graph."""
    ref: dict[fx.Node, Value] = {}
    placeholders: list[str] = []
    calls: list[list[Value]] = []
    output: Any = None
    for node in pipe.split_gm.graph.nodes:
        if node.op == "placeholder":
            placeholders.append(node.name)
            ref[node] = ("in", node.name)
        elif node.op == "call_module":
            if node.kwargs:
                raise RuntimeError(f"Unexpected kwargs in torch's stage call {node.format_node()}; please report.")
            ref[node] = ("s", len(calls), None)
            calls.append([ref[a] for a in node.args])
        elif node.op == "call_function" and node.target is operator.getitem:
            src = ref[node.args[0]]
            ref[node] = ("s", src[1], node.args[1])
        elif node.op == "output":
            output = pytree.tree_map(lambda n: ref[n] if isinstance(n, fx.Node) else n, node.args[0])
    return placeholders, calls, output


def build_stages(plan: SplitPlan, microbatches: int) -> StageSet:
    """Build one ``StageRunner`` per stage from torch's ``Pipe`` (or, for a manual plan, the pruned
    module copies), and run one microbatch through them in sequence to record example tensors."""
    cap = plan.graph.capture
    n = plan.num_stages
    canonical = {alias: name for name, group in cap.aliases.items() for alias in group}
    kwarg_names = list(cap.example_kwargs)
    if cap.traced:
        pipe = plan.pipe(microbatches)
        placeholders, calls, output = _top_level(pipe)
        modules = [pipe.get_stage_module(i) for i in range(n)]
        for mod in modules:
            _compiled_forward(mod)
    else:
        modules = plan.stage_modules()
        placeholders = ["input"]
        calls = [[("in", "input")]] + [[("s", i - 1, None)] for i in range(1, n)]
        output = ("s", n - 1, None)
    # Who reads each value: stage i reads calls[i]; the output counts as read by stage n (past the end).
    last_read: dict[Value, int] = {}
    for i, args in enumerate(calls):
        for v in args:
            last_read[v] = max(last_read.get(v, -1), i)
    for v in pytree.tree_leaves(output, is_leaf=_is_value):
        last_read[v] = max(last_read.get(v, -1), n - 1)

    def born(v: Value) -> int:
        return 0 if v[0] == "in" else v[1]

    order = sorted(last_read, key=lambda v: (born(v), str(v)))
    # Boundary i (into stage i) carries every value made before stage i and read at stage i or later.
    carries = [[v for v in order if born(v) < i <= last_read[v]] for i in range(n + 1)]
    runners = [
        StageRunner(i, n, modules[i], carries[i] if i else [], calls[i], carries[i + 1] if i < n - 1 else [],
                    output, placeholders, kwarg_names)
        for i in range(n)
    ]
    runners[-1].output_index = cap.output_index
    params: list[dict[str, str]] = []
    buffers: list[dict[str, str]] = []
    for mod in modules:
        used = dict.fromkeys(_used_names(mod))
        pnames = {name for name, _ in mod.named_parameters(remove_duplicate=False)}
        params.append({canonical.get(u, u): u for u in used if u in pnames})
        buffers.append({canonical.get(u, u): u for u in used if u not in pnames})
    holders: dict[str, list[int]] = {}
    for i, ps in enumerate(params):
        for p in ps:
            holders.setdefault(p, []).append(i)
    tied = {p: st for p, st in holders.items() if len(st) > 1}
    owner = {p: st[0] for p, st in holders.items()}
    for i, bs in enumerate(buffers):
        for b in bs:
            owner.setdefault(b, i)
    stage_set = StageSet(runners, params, tied, owner, buffers)
    _record_examples(stage_set, plan, microbatches)
    return stage_set


def _compiled_forward(mod: nn.Module) -> None:
    """Run torch's unflattened submodules as generated Python code instead of through ``fx.Interpreter``.

    torch 2.13's ``InterpreterModule`` interprets its graph node by node by default; measured here that adds
    1.7 ms to a 12 ms transformer stage forward (0.3 ms to an MLP stage) on CPU. The generated code runs the
    same ops in the same order (the unflatten module's own fallback, used under dynamo). A graph that calls
    a submodule named ``self`` (HF BERT's ``attention.self``) keeps the interpreter: its generated code would
    assign a local ``self`` and then fail on ``self.output``.
    """
    for sub in mod.modules():
        graph = getattr(sub, "graph", None)
        if hasattr(sub, "_run_with_interpreter") and graph is not None:
            sub._run_with_interpreter = any(node.name == "self" for node in graph.nodes)


def _record_examples(stages: StageSet, plan: SplitPlan, microbatches: int) -> None:
    """Run one microbatch through the runners in sequence: torch's stages get static shapes from it, so
    they never run shape inference (which would run an extra forward/backward inside the first step)."""
    args, kwargs = plan.microbatch_inputs(microbatches)
    x: Any = None
    with torch.no_grad():
        for i, runner in enumerate(stages.runners):
            training = runner.training
            runner.eval()  # no dropout or BatchNorm update while recording shapes
            out = runner(*args, **kwargs) if i == 0 else runner(*x)
            runner.train(training)
            stages.inputs.append(tuple(args) if i == 0 else tuple(x))
            x = out if isinstance(out, tuple) else (out,)
            stages.outputs.append(x)
