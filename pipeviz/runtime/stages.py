"""Stage modules that torch's schedules can train exactly: relays, model inputs, shared parameters, state.

Built once, in the launching process, from torch's ``Pipe`` (the real split), then pickled per rank: each
rank receives only its own stages as flat ``fx.GraphModule``s (``pipeviz.adapter.flatten_stage``), so no rank
re-traces the model or imports the model's library. torch 2.13's stage graphs need these fixes
(docs/torch-fixes.md, "What pipeviz fixes in torch's pipelining"):

- a value used two or more stages later is sent directly, which no multi-stage schedule accepts and whose
  backward raises "Backward of skip connections not supported yet": ``StageRunner`` relays every value
  stage by stage, model inputs included, so all communication is between neighbours;
- a parameter used by several stages (tied embeddings, a module called in two stages) is copied into each
  and its gradients never meet: ``StageSet.tied`` names the holders, the worker sums their gradients;
- torch names the copies a second call makes ``shared@1.0@1.weight`` and may keep stale alias copies: the
  flat stages use the original model's canonical names, each tensor once.

Example:
    >>> stages = build_stages(plan, microbatches=4)
    >>> stages.runners[1](*stages.inputs[1])          # what stage 1 computes for one microbatch
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from pipeviz.adapter import canonical_name, flatten_stage, split_graph
from pipeviz.plan.split import SplitPlan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import Pipe

__all__ = ["RankStage", "StageRunner", "StageSet", "StepError", "build_stages", "rank_stages", "tied_ranks"]

Value = tuple[Any, ...]  # ("in", placeholder) | ("s", stage, index or None)


class StepError(RuntimeError):
    """A failure inside a training step, saying what the rank was doing (stage, layer or loss, shapes)."""


class StageRunner(nn.Module):
    """One pipeline stage: the stage's module plus the relay of values later stages need.

    ``forward`` takes what the previous stage sent (the first stage: the model's args and kwargs) and
    returns what the next stage needs, as a tuple of contiguous tensors; the last stage returns the
    model's output (a single tensor when the model has one output, e.g. HF logits).
    """

    def __init__(
        self, index: int, num_stages: int, module: nn.Module, takes: list[Value], calls: list[Value],
        gives: list[Value], output: object, placeholders: list[str], kwarg_names: list[str],
    ) -> None:
        super().__init__()
        self.index, self.num_stages = index, num_stages
        self.stage = module
        self.takes, self.calls, self.gives, self.output = takes, calls, gives, output
        self.placeholders, self.kwarg_names = placeholders, kwarg_names
        self.compute_device: torch.device | None = None  # set when stages share a GPU over host memory
        self.output_index: int | None = None
        self.whole_output = False  # forward-only runs: the last stage returns every output leaf, not the logits
        # Zero-bubble schedules detach stage outputs in place after the input-grad pass (torch 2.13,
        # stage_backward_input); when an output is also saved for the weight-grad pass (a ReLU's result,
        # a Linear's input) that breaks the W pass. Sending copies keeps the saved tensors intact.
        self.fresh_outputs = False
        # tensor parallel: the shards' 1-D DeviceMesh (pipeviz.schedule.tensor_parallel)
        self.tp_mesh: DeviceMesh | None = None
        # the last stage's logits leave sharded by vocabulary for a parallel cross-entropy (torch's loss_parallel)
        self.vocab_parallel_loss = False
        self.compiled: Callable[..., object] | None = None  # torch.compile of ``stage`` (``compile_stage``)
        # mixed precision: the stage computes under torch.autocast(autocast_device, autocast) (master weights fp32)
        self.autocast: torch.dtype | None = None
        self.autocast_device = "cpu"
        self.out_dtypes: tuple[torch.dtype | None, ...] = ()  # what build_stages recorded (hand-offs, checked)
        # activation recomputation (pipeviz.schedule.recompute): the stage's layers and attention score ops, found
        # by build_stages while the trace's sizes are known; ``recomputed`` runs the stage with regions checkpointed
        self.layer_names: tuple[str, ...] = ()
        self.attention: tuple[tuple[str, ...], ...] = ()
        self.recomputed: Callable[..., object] | None = None
        # context parallelism: the stage graph run on this share of every sequence (adapter.context_graph)
        self.context: Callable[..., object] | None = None
        self.traced_shapes: dict[str, Any] = {}  # (its graph's values' shapes at the whole sequence, for it)

    def compile_stage(self, backend: str) -> None:
        """Run ``stage`` through ``torch.compile(stage, backend=backend)`` from now on. The compiled module is kept
        outside the module tree (not a submodule), so parameter names, DDP and FSDP2 see the stage as it is."""
        self.__dict__["compiled"] = torch.compile(self.stage, backend=backend, dynamic=False)

    def recompute(self, mode: str) -> int:
        """Run the stage with its layers (``"full"``) or its attention scores (``"selective"``) checkpointed from now
        on (``pipeviz.schedule.recompute``); returns the number of checkpointed regions. Kept outside the module tree,
        as a compiled stage is."""
        from pipeviz.schedule.recompute import Recomputed, regions

        if mode == "none":
            self.__dict__["recomputed"] = None
            return 0
        if not isinstance(self.stage, fx.GraphModule):
            raise TypeError(f"stage {self.index} is not a traced graph ({type(self.stage).__name__}): recompute= needs "
                            "a plan from pv.trace")
        found = regions(self.stage, getattr(self.stage, "node_modules", {}), self.layer_names, mode, self.attention)
        self.__dict__["recomputed"] = Recomputed(self.stage, found) if found else None
        return len(found)

    def forward(self, *args: object, **kwargs: object) -> object:
        if self.index == 0:
            # Model inputs by placeholder name, in the traced order: positional first, then kwargs.
            flat = list(args) + [kwargs[k] for k in self.kwarg_names if k in kwargs]
            env: dict[Value, object] = {("in", p): v for p, v in zip(self.placeholders, flat, strict=False)}
        else:
            env = dict(zip(self.takes, args, strict=True))
        if self.compute_device is not None:
            env = {k: v.to(self.compute_device) if isinstance(v, torch.Tensor) else v for k, v in env.items()}
        call_args = tuple(env[v] for v in self.calls)
        run = self.stage if self.compiled is None else self.compiled
        if self.recomputed is not None:
            run = self.recomputed
        if self.context is not None:
            run = self.context
        if self.autocast is not None:
            run = _autocast(run, self.autocast_device, self.autocast)
        try:
            if self.tp_mesh is not None:  # sharded parameters: the graph runs on DTensors, full tensors leave
                from pipeviz.schedule.tensor_parallel import to_full, to_replicated

                out = run(*to_replicated(self.tp_mesh, call_args))
                if not self.vocab_parallel_loss:
                    out = to_full(out)
            else:
                out = run(*call_args)
        except Exception as exc:
            raise self._located(call_args, exc) from exc
        env[("s", self.index, None)] = out
        if isinstance(out, tuple | list):
            for k, item in enumerate(out):
                env[("s", self.index, k)] = item
        if self.index == self.num_stages - 1:
            leaves = [self._home(env[v]) for v in pytree.tree_leaves(self.output, is_leaf=_is_value)]
            if self.vocab_parallel_loss:  # the loss's logits stay sharded by vocabulary, everything else whole
                from pipeviz.schedule.tensor_parallel import class_sharded, to_full

                loss_leaf = self.output_index if self.output_index is not None else 0 if len(leaves) == 1 else -1
                leaves = [t if k == loss_leaf and not self.whole_output and class_sharded(t) else to_full(t)
                          for k, t in enumerate(leaves)]
            if self.whole_output:
                return tuple(leaves)
            if self.output_index is not None:  # an HF ModelOutput: the loss sees its logits
                return leaves[self.output_index]
            return leaves[0] if len(leaves) == 1 else tuple(leaves)
        # Contiguous: gloo refuses strided views (HF BERT's expanded attention mask). A relayed value
        # leaves as a new tensor: zero-bubble backward detaches stage inputs in place, which would break
        # an output that is the very same tensor.
        inputs = set() if self.fresh_outputs else {id(a) for a in args} | {id(v) for v in kwargs.values()}
        sent = tuple(_fresh(self._home(env[v]), inputs, self.fresh_outputs) for v in self.gives)
        if self.autocast is not None:
            self._check_dtypes(sent)
        return sent

    def _check_dtypes(self, sent: tuple[object, ...]) -> None:
        """Under mixed precision a hand-off's dtype is what autocast made of it when the stages were built (the
        receiving stage's buffers are allocated so): a dtype that differs here would be received wrongly."""
        for k, (t, want) in enumerate(zip(sent, self.out_dtypes, strict=False)):
            if isinstance(t, torch.Tensor) and want is not None and t.dtype != want:
                raise StepError(
                    f"stage {self.index}'s output {k} is {t.dtype} under autocast on {self.autocast_device}, but "
                    f"the stages were built with {want} there (autocast on the CPU, where pipeviz records the "
                    "hand-offs, casts this op otherwise). Fix: mixed_precision=None, or split elsewhere.")

    def _home(self, t: object) -> object:
        return t.cpu() if self.compute_device is not None and isinstance(t, torch.Tensor) else t

    def _located(self, args: tuple[object, ...], exc: Exception) -> StepError:
        """The error, with the layer and the op that raised and their input shapes (found by running the stage
        again node by node)."""
        finder = getattr(self.stage, "failing_op", None)
        found = finder(*args) if callable(finder) else None
        where = f"stage {self.index}'s forward"
        if found is not None:
            module, op, shapes = found
            where += f", in {'layer ' + repr(module) if module else 'the ops between layers'}, at {op}"
            if shapes:
                where += f" on {shapes}"
        return StepError(f"{where}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


def _fresh(t: object, inputs: set[int], always: bool = False) -> object:
    if not isinstance(t, torch.Tensor):
        return t
    if always or id(t) in inputs:
        return t.clone(memory_format=torch.contiguous_format)
    return t.contiguous()


def _is_value(x: object) -> bool:
    return isinstance(x, tuple) and len(x) >= 2 and x[0] in ("in", "s")


@dataclass
class StageSet:
    """What ``build_stages`` returns: runners, the model tensors each stage holds, shared ones, examples."""

    runners: list[StageRunner]
    params: list[dict[str, str]]  # per stage: canonical name -> name inside runner.stage
    tied: dict[str, list[int]]  # canonical name -> stages holding a copy (2 or more)
    owner: dict[str, int]  # canonical name -> stage that reports it in state_dict()
    buffers: list[dict[str, str]] = field(default_factory=list)
    inputs: list[tuple[torch.Tensor, ...]] = field(default_factory=list)  # per-stage example inputs (one mb)
    outputs: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    draws: list[int] = field(default_factory=list)  # per stage: random ops in one forward (pipeviz.runtime.rng)


def _top_level(pipe: Pipe) -> tuple[list[str], list[list[Value]], object]:
    """Placeholders, per-stage call arguments and the output structure of torch's split graph.

    Stages are numbered by their submodule's name (``submod_pp_2`` is stage 2), not by where the call sits
    in the graph: a stage that reads no input (HF GPT-2's position ids, LLaMA's rotary tables) can be
    called before stage 0.
    """
    ref: dict[fx.Node, Value] = {}
    placeholders: list[str] = []
    calls: dict[int, list[Value]] = {}
    output: object = None
    for node in split_graph(pipe).nodes:
        if node.op == "placeholder":
            placeholders.append(node.name)
            ref[node] = ("in", node.name)
        elif node.op == "call_module":
            if node.kwargs:
                raise RuntimeError(f"Unexpected kwargs in torch's stage call {node.format_node()}; please report.")
            index = int(str(node.target).rpartition("_")[2])
            ref[node] = ("s", index, None)
            calls[index] = [ref[a] for a in node.args]
        elif node.op == "call_function" and node.target is operator.getitem:
            src = ref[node.args[0]]
            ref[node] = ("s", src[1], node.args[1])
        elif node.op == "output":
            output = pytree.tree_map(lambda n: ref[n] if isinstance(n, fx.Node) else n, node.args[0])
    return placeholders, [calls[i] for i in range(len(calls))], output


def build_stages(plan: SplitPlan, microbatches: int, whole_output: bool = False,
                 autocast: torch.dtype | None = None, cp: int = 1) -> StageSet:
    """Build one ``StageRunner`` per stage from torch's ``Pipe`` (or, for a manual plan, the pruned
    module copies) and record every stage's example inputs and outputs for one microbatch (no model
    buffer is touched: BatchNorm statistics see only the training run's forwards). With ``cp`` > 1 the examples
    are one share's of every sequence (``adapter.context_graph``: what each context-parallel process sends); an op
    a share cannot run raises ``ContextError`` here."""
    cap = plan.graph.capture
    n = plan.num_stages
    aliases = {alias: name for name, group in cap.aliases.items() for alias in group}
    kwarg_names = list(cap.example_kwargs)
    if cap.traced:
        pipe = plan.pipe(microbatches)
        placeholders, calls, output = _top_level(pipe)
        modules: list[nn.Module] = [flatten_stage(pipe.get_stage_module(i), aliases) for i in range(n)]
    else:
        modules = plan.stage_modules()
        placeholders = ["input"]
        calls = [[("in", "input")]] + [[("s", i - 1, None)] for i in range(1, n)]
        output = ("s", n - 1, None)
    # Who reads each value: stage i reads calls[i]; the output counts as read by the last stage.
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
    runners[-1].whole_output = whole_output
    for r in runners:  # mixed precision: recorded (and later run) under autocast, hand-offs in its dtypes
        r.autocast = autocast
    if cap.traced:
        from pipeviz.schedule.recompute import attention_ops

        for r, info in zip(runners, plan.stages, strict=True):
            r.layer_names = tuple(info.layers)
            r.attention = attention_ops(r.stage.graph) if isinstance(r.stage, fx.GraphModule) else ()
    known = set(cap.param_numel)
    params: list[dict[str, str]] = []
    buffers: list[dict[str, str]] = []
    for mod in modules:
        ps: dict[str, str] = {}
        bs: dict[str, str] = {}
        seen: set[int] = set()
        for inner, t in [*mod.named_parameters(remove_duplicate=False), *mod.named_buffers(remove_duplicate=False)]:
            canon = canonical_name(inner, aliases)
            if canon not in known or id(t) in seen:
                continue  # torch's lifted constants, or a second name of one tensor
            seen.add(id(t))
            (bs if canon in cap.buffers else ps).setdefault(canon, inner)
        params.append(ps)
        buffers.append(bs)
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
    _record_examples(stage_set, plan, microbatches, cp)
    for r, outs in zip(runners, stage_set.outputs, strict=True):
        r.out_dtypes = tuple(t.dtype if isinstance(t, torch.Tensor) else None for t in outs)
    return stage_set


def _record_examples(stages: StageSet, plan: SplitPlan, microbatches: int, cp: int = 1) -> None:
    """Run one microbatch through the runners in sequence to learn every stage's input and output shapes:
    torch's stages get static shapes from it, so they never run shape inference (an extra forward and
    backward inside the first step). Fake tensors first (no compute); a forward that branches on values
    (a manual plan's data-dependent model) runs for real instead. Either way every buffer is put back, so
    BatchNorm statistics see only the training run's forwards."""
    args, kwargs = plan.microbatch_inputs(microbatches)
    if cp > 1:  # the whole sequence's shapes, then one share's tokens through every stage (exchanges in shape only)
        from pipeviz.adapter.context_graph import ContextGraph, ShapeRecorder, Share
        from pipeviz.runtime.batches import seq_share, sequence_length

        seq = sequence_length(args, kwargs)
        assert seq is not None
        recorders = [ShapeRecorder(r.stage) for r in stages.runners]  # type: ignore[arg-type]
        for r, rec in zip(stages.runners, recorders, strict=True):
            r.context = rec
        try:
            _record_chain(stages, args, kwargs)
        finally:
            for r in stages.runners:
                r.context = None
        stages.inputs.clear()
        stages.outputs.clear()
        args, kwargs = seq_share((args, kwargs), 0, cp, seq)
        for r, rec in zip(stages.runners, recorders, strict=True):
            r.traced_shapes = rec.shapes
            r.context = ContextGraph(r.stage, Share(seq, cp, 0, dry=True), rec.shapes)  # type: ignore[arg-type]
    try:
        _record_chain(stages, args, kwargs)
    finally:
        for r in stages.runners:
            r.context = None


def _record_chain(stages: StageSet, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    from pipeviz.adapter import defake, fake_cpu, fake_tensors

    every = nn.ModuleList(stages.runners)
    if any(t.is_meta for t in [*every.parameters(), *every.buffers()]):  # a meta model: fake CPU tensors
        mode = fake_cpu(every)
        try:
            with torch.no_grad(), mode:
                _chain(stages, *pytree.tree_map(
                    lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, (args, kwargs)))
        finally:
            defake(every)
        stages.inputs[:] = [tuple(_empty_like(t) for t in ts) for ts in stages.inputs]
        stages.outputs[:] = [tuple(_empty_like(t) for t in ts) for ts in stages.outputs]
        return
    saved = [(b, b.detach().clone()) for r in stages.runners for b in r.buffers()]
    try:
        with fake_tensors() as fake:
            _chain(stages, *fake((args, kwargs)))
    except Exception:
        stages.inputs.clear()
        stages.outputs.clear()
        with torch.no_grad():
            _chain(stages, args, kwargs)
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)
    stages.inputs[:] = [tuple(_empty_like(t) for t in ts) for ts in stages.inputs]
    stages.outputs[:] = [tuple(_empty_like(t) for t in ts) for ts in stages.outputs]


def _autocast(fn: Callable[..., object], device: str, dtype: torch.dtype) -> Callable[..., object]:
    def run(*args: object) -> object:
        with torch.autocast(device, dtype=dtype):
            return fn(*args)

    return run


def _chain(stages: StageSet, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    from pipeviz.runtime.rng import CountDraws

    x: Any = None
    stages.draws[:] = []
    for i, runner in enumerate(stages.runners):
        with CountDraws() as counted:  # dropout and the like: what pipeviz.runtime.rng seeds per stage forward
            out = runner(*args, **kwargs) if i == 0 else runner(*x)
        stages.draws.append(counted.count)
        stages.inputs.append(tuple(args) if i == 0 else tuple(x))
        x = out if isinstance(out, tuple) else (out,)
        stages.outputs.append(x)


@overload
def _empty_like(t: torch.Tensor) -> torch.Tensor: ...
@overload
def _empty_like(t: object) -> object: ...
def _empty_like(t: object) -> object:
    # Plain meta tensors: picklable descriptions of a shape and dtype, cheap to send.
    return torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t


@dataclass
class RankStage:
    """One stage as a rank receives it: the runner, the model tensors it holds, example shapes, and which
    of its tensors it reports in the run's state (the stage that owns them)."""

    index: int
    runner: StageRunner
    params: dict[str, str]
    buffers: dict[str, str]
    reports: tuple[str, ...]
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    source: Any = None  # a pipeviz.capture.weights.StageSource: tensors the rank loads or initialises itself
    draws: int = 0  # random ops in one forward: the rank seeds its generator before each (pipeviz.runtime.rng)


def rank_stages(stages: StageSet, stage_ranks: tuple[int, ...], rank: int,
                sources: Sequence[object] | None = None) -> list[RankStage]:
    """The stages ``rank`` holds (``stage_ranks[s]`` is the rank of stage ``s``), ready to pickle."""
    return [
        RankStage(
            index=s, runner=stages.runners[s], params=stages.params[s], buffers=stages.buffers[s],
            reports=tuple(c for c in [*stages.params[s], *stages.buffers[s]] if stages.owner.get(c) == s),
            inputs=stages.inputs[s], outputs=stages.outputs[s], source=sources[s] if sources else None,
            draws=stages.draws[s] if stages.draws else 0,
        )
        for s, r in enumerate(stage_ranks) if r == rank
    ]


def tied_ranks(stages: StageSet, stage_ranks: tuple[int, ...]) -> dict[str, list[int]]:
    """Shared parameters -> the ranks holding a copy (every rank builds the same groups from this)."""
    return {name: sorted({stage_ranks[s] for s in held}) for name, held in stages.tied.items()}
