"""Capture a model once with torch.export and keep what every later view of it needs.

The capture is the same one torch's ``pipeline()`` uses (``torch.export.export``), so every split the
graph offers is a split torch can make. It is op-level: one record per ATen op in execution order with
its module stack, FLOPs, output bytes and inputs. ``ModelGraph`` groups these records into layers at any
granularity without tracing again.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.utils import _pytree as pytree

from pipeviz.adapter import fake_cpu
from pipeviz.adapter.hf_layerdrop import LayerDropError, decided_layerdrop
from pipeviz.adapter.hf_moe import exportable_moe
from pipeviz.adapter.regions import REGION_META, inline_regions, leave_region
from pipeviz.capture.ops import (
    Op,
    SavedTensors,
    batched_nodes,
    count_flops,
    cpu_flash_attention_flops,
    data_dependent,
    grad_nodes,
    op_saved_bytes,
    op_spec,
    tensor_bytes,
    unsupported_ops,
)
from pipeviz.capture.structure import (
    alias_groups,
    buffer_names,
    elementwise_modules,
    frozen_names,
    module_table,
    tensor_sizes,
)
from pipeviz.capture.support import model_notes

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["TRACE_LOCK", "Capture", "Op", "SavedTensors", "TraceError", "apply_fixups", "batch_size_of", "capture",
           "loss_input_bytes", "op_saved_bytes"]


# torch.export keeps global tracing state: traces from two threads (a run starting in the background while a
# notebook traces or builds a Pipe) take turns.
TRACE_LOCK = threading.RLock()

_T = TypeVar("_T")


class TraceError(ValueError):
    """torch.export could not capture the model; the message names the cause and the manual route.

    The message leads with pipeviz's diagnosis and quotes torch's first line; torch's whole report is
    ``err.torch_error`` (its exception and traceback) and ``err.torch_output`` (the partial graph it prints), both
    kept out of what a notebook shows (together they ran to 26.5 KB for a small model).
    """

    def __init__(self, message: str, torch_error: BaseException | None = None) -> None:
        super().__init__(message)
        self.torch_error = torch_error
        self.torch_output = ""  # what torch printed while failing (the partial graph), held back from stderr


@dataclass
class Capture:
    """Everything known about one traced model; shared by all ``ModelGraph`` views of it."""

    model: nn.Module
    example_args: tuple[Any, ...]
    example_kwargs: dict[str, Any]
    ops: list[Op]
    modules: dict[str, tuple[str, tuple[str, ...]]]  # fqn -> (class name, child fqns)
    param_numel: dict[str, int]  # canonical name -> elements
    param_bytes: dict[str, int]
    aliases: dict[str, tuple[str, ...]]  # canonical name -> every FQN of that tensor
    batch_size: int | None
    buffers: frozenset[str] = frozenset()  # canonical names (in param_numel) that are buffers, not parameters
    frozen: frozenset[str] = frozenset()  # parameters that do not train (requires_grad=False): no gradient or state
    mutated: frozenset[str] = frozenset()  # buffers the forward updates in place (BatchNorm statistics)
    elementwise: frozenset[str] = frozenset()  # parameter-free activation / dropout / identity modules
    fixups: dict[str, Any] = field(default_factory=dict)  # config attributes set on every copy
    notes: list[str] = field(default_factory=list)
    traced: bool = True  # False for the manual route (no torch.export graph)
    output_index: int | None = None  # which output leaf is ``logits`` for HF ModelOutputs (what a loss sees)
    input_bytes: dict[str, int] = field(default_factory=dict)  # model input placeholder -> bytes (example batch)
    outputs: list[tuple[tuple[int, ...], torch.dtype]] = field(default_factory=list)  # output leaves' shapes
    out_spec: Any = None  # the output's pytree structure (an HF ModelOutput, a tuple, a tensor)
    unsupported: list[str] = field(default_factory=list)  # ops torch's pipeline() cannot split: why, where, fix

    @property
    def loss_outputs(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The output leaves a loss reads: the ``logits`` of an HF output, else every leaf (shape, dtype)."""
        i = self.output_index
        return self.outputs if i is None else self.outputs[i:i + 1]

    def fresh_copy(self) -> nn.Module:
        """A deep copy of the user's model with the capture's fixups applied; the original is untouched."""
        model = copy.deepcopy(self.model)
        apply_fixups(model, self.fixups)
        return model


def apply_fixups(model: nn.Module, fixups: Mapping[str, object]) -> None:
    """Set config attributes (e.g. HF ``use_cache=False``) on a model copy."""
    if not fixups:
        return
    # Sub-models may hold config copies of their own (T5's decoder stack does).
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    for cfg in configs.values():
        for key, value in fixups.items():
            if hasattr(cfg, key):
                setattr(cfg, key, value)


def _needs_cache_fix(model: nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    return bool(getattr(cfg, "use_cache", False))


def batch_size_of(args: tuple[object, ...], kwargs: Mapping[str, object]) -> int | None:
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


@contextlib.contextmanager
def quiet_torch_logs() -> Iterator[None]:
    """Keep torch's internal error logs (fake-tensor tracebacks printed while export fails) off the user's
    stderr: pipeviz's own error says what went wrong and how to fix it."""
    previous = logging.root.manager.disable
    logging.disable(logging.ERROR)
    try:
        yield
    finally:
        logging.disable(previous)


@contextlib.contextmanager
def _inference_mode_seen(seen: list[str]) -> Iterator[None]:
    """Inside the block, every ``torch.inference_mode()`` a forward enters is recorded (where it is written):
    ``torch.export`` drops that region silently, and the graph would then compute with autograd where the
    model does not (the pipelined run would train differently)."""
    import traceback

    cls = torch.autograd.grad_mode.inference_mode
    original = cls.__enter__

    def enter(self: torch.autograd.grad_mode.inference_mode) -> None:
        if getattr(self, "mode", True):
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            seen.append(f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "the forward")
        return original(self)

    cls.__enter__ = enter  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.__enter__ = original  # type: ignore[method-assign]


def _export(model: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> torch.export.ExportedProgram:
    seen: list[str] = []
    # torch prints the partial graph of a failed export to stderr (twice, ~1 KB a layer of HF model): held here,
    # re-emitted when the export succeeds, and kept on the TraceError (err.torch_output) when it fails
    printed = io.StringIO()
    try:
        with (TRACE_LOCK, quiet_torch_logs(), _inference_mode_seen(seen), exportable_moe(), decided_layerdrop(),
              contextlib.redirect_stderr(printed)):
            ep = torch.export.export(model, args, kwargs)
        sys.stderr.write(printed.getvalue())
    except LayerDropError as exc:
        raise TraceError(f"Cannot trace {type(model).__name__}: {exc}") from None
    except Exception as exc:  # torch raises many types here; all mean "cannot capture"
        text = f"{type(exc).__name__}: {exc}".strip()
        first = text.splitlines()[0][:300]
        manual = (
            "Fix: remove the data-dependent branch, or use the manual route, which needs no trace: "
            "pv.manual_plan(model, [[...stage 0 module names...], [...stage 1...]], example_args=...) "
            "runs the named modules in sequence (models whose forward is a ModuleList/Sequential loop)."
        )
        if "Cache" in text and "not a known type" in text:
            hint = "The model returns a KV cache, which torch.export cannot carry."
            manual = "Fix: set model.config.use_cache = False (or pass use_cache=False in example_kwargs)."
        elif "data-dependent" in text.lower() or "GuardOnDataDependent" in text or "Could not guard" in text:
            hint = "The forward has data-dependent control flow (an `if` or loop on tensor values)."
        else:
            unfit = _inputs_do_not_fit(model, args, kwargs)
            if unfit is not None:
                unfit.torch_error = exc
                raise unfit from None
            hint = "torch.export cannot capture this forward as one graph."
        err = TraceError(f"Cannot trace {type(model).__name__}: {hint}\n  torch said: {first} (the whole report: "
                         f"err.torch_error, err.torch_output)\n{manual}", exc)
        err.torch_output = printed.getvalue()
        raise err from None
    if seen:
        raise TraceError(
            f"Cannot trace {type(model).__name__}: its forward enters torch.inference_mode() (at {seen[0]}), which "
            "torch.export drops without a word: the captured graph would compute with autograd where the model "
            "does not, and a pipelined run would train differently.\nFix: use torch.no_grad() there (pipeviz "
            "splits and runs no_grad and autocast blocks exactly), or the manual route, which needs no trace: "
            "pv.manual_plan(model, [[...stage 0 module names...], [...stage 1...]], example_args=...)."
        )
    return ep


def _inputs_do_not_fit(model: nn.Module, args: tuple[object, ...], kwargs: Mapping[str, object]) -> TraceError | None:
    """A ``TraceError`` when the model fails on the example inputs even without tracing (a shape or dtype
    that does not fit), else None (then it is torch.export that cannot capture the forward)."""
    try:
        with torch.no_grad(), quiet_torch_logs():
            copy.deepcopy(model)(*args, **kwargs)  # a copy: a forward in train mode updates BatchNorm statistics
    except Exception as exc:
        shown = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in pytree.tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor))
        first = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
        return TraceError(
            f"Cannot trace {type(model).__name__}: the example inputs do not fit the model (a shape or dtype "
            f"mismatch, not a tracing limit): it fails on them even when run normally.\n  inputs: {shown}\n"
            f"  torch said: {first}\nFix: pass example inputs shaped like one real batch, with the dtype the "
            "model expects (e.g. torch.randn(batch, in_features) for a Linear, torch.randint(0, vocab, "
            "(batch, seq)) for token ids)."
        )
    return None


_CALL_SUFFIX = re.compile(r"@(\d+)$")


def capture(
    model: nn.Module, example_args: tuple[object, ...] | torch.Tensor = (),
    example_kwargs: Mapping[str, object] | None = None,
) -> Capture:
    """Export a deep copy of ``model`` and measure every op (see ``pipeviz.trace`` for the public entry).

    The steps: settle the config fixes a trace needs (``_fixups``), export a fixed copy (on fake CPU tensors for a
    meta model), inline its ``no_grad`` / ``autocast`` regions, run the graph once to count FLOPs, bytes and what
    autograd saves (``_measure``), then read one ``Op`` per ATen call (``_read_ops``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"trace() needs a torch.nn.Module, got {type(model).__name__}. Fix: pass the model itself.")
    if not isinstance(example_args, tuple):
        example_args = (example_args,)
    kwargs = dict(example_kwargs or {})
    fixups, notes = _fixups(model, kwargs)
    # Trace a copy: export runs forward, which would update BatchNorm statistics of the user's model.
    traced = copy.deepcopy(model)
    apply_fixups(traced, fixups)
    # A meta model is traced on fake CPU tensors: no memory, and the code paths it will run on the CPU.
    mode = fake_cpu(traced) if _is_meta(traced) else contextlib.nullcontext()
    trace_args, trace_kwargs = _faked(mode, (example_args, kwargs))
    with mode:
        ep = _export(traced, trace_args, trace_kwargs)
    gm = ep.module()
    # no_grad / autocast blocks are higher-order ops with a body graph: inlined, their ops count (FLOPs,
    # parameters, modules) where they run, and each op knows its region, inside which no split may fall.
    inline_regions(gm)
    canonical, groups = alias_groups(model)
    measured = _measure(gm, mode, pytree.tree_leaves((trace_args, trace_kwargs)),
                        lambda: _inputs_do_not_fit(traced, example_args, kwargs))
    # Whatever the forward updated in place (running statistics, counters) is state a pipeline must keep
    # exactly where the unsplit model keeps it: what export recorded as mutated, and (real tensors) what
    # running the graph changed.
    changed = measured.changed | set(ep.graph_signature.buffers_to_mutate.values())
    ops = _read_ops(gm, measured, canonical, batch_size_of(example_args, kwargs))
    unsupported = unsupported_ops(gm)
    if unsupported:
        notes.append(unsupported[0])
    numel, nbytes = tensor_sizes(model, groups)
    return Capture(
        model=model, example_args=example_args, example_kwargs=kwargs, ops=ops, modules=module_table(model),
        param_numel=numel, param_bytes=nbytes, aliases=groups,
        batch_size=batch_size_of(example_args, kwargs), fixups=fixups, notes=notes,
        output_index=_logits_index(ep.call_spec.out_spec), outputs=_output_leaves(ep), out_spec=ep.call_spec.out_spec,
        buffers=buffer_names(model), mutated=frozenset(canonical.get(name, name) for name in changed),
        elementwise=elementwise_modules(model), frozen=frozen_names(model, groups),
        unsupported=unsupported,
        input_bytes={n.name: tensor_bytes(n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder"},
    )


def _fixups(model: nn.Module, kwargs: Mapping[str, object]) -> tuple[dict[str, object], list[str]]:
    """The config attributes pipeviz sets on its copies of ``model`` (HF ``use_cache=False``), and the notes that
    say so and what else a user should know about the model."""
    fixups: dict[str, object] = {}
    notes: list[str] = []
    if _needs_cache_fix(model) and "use_cache" not in kwargs:
        fixups["use_cache"] = False
        note = (
            f"{type(model).__name__}: set config.use_cache=False on pipeviz's copies (a KV cache cannot cross "
            "pipeline stages or be exported); your model is unchanged."
        )
        notes.append(note)  # shown where the user looks (graph.notes, the Explorer), not as a Python warning
    notes += model_notes(model)  # a transformers release newer than CI has tested: said, not refused
    return fixups, notes


def _output_leaves(ep: torch.export.ExportedProgram) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every tensor leaf of the exported forward's output."""
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    return [(tuple(int(d) for d in v.shape), v.dtype) for leaf in pytree.tree_leaves(out_node.args[0])
            if isinstance(v := getattr(leaf, "meta", {}).get("val"), torch.Tensor)]


@dataclass
class _Measured:
    """What one run of the exported graph measured, by node name."""

    flops: dict[str, int]
    ran_bytes: dict[str, int] | None  # output bytes as the nodes ran (real tensors only; a fake run has none)
    saved: SavedTensors  # what autograd saved for backward
    changed: set[str]  # buffers the run changed in place (real tensors only)


def _measure(gm: torch.fx.GraphModule, mode: FakeTensorMode | contextlib.nullcontext[None],
             flat_inputs: list[Any], unfit: Callable[[], TraceError | None]) -> _Measured:
    """Run ``gm`` once under ``mode`` to count every node's FLOPs, output bytes and saved tensors.

    Raises:
        TraceError: the graph does not run on the inputs (``unfit()`` says why: they do not fit the model), or a
            meta model runs an op whose output size depends on the data.
    """
    fake = not isinstance(mode, contextlib.nullcontext)
    before = {} if fake else {name: b.detach().clone() for name, b in gm.named_buffers()}
    ran_bytes: dict[str, int] | None = None if fake else {}
    saved = SavedTensors()
    try:
        with mode:
            flops = count_flops(gm, flat_inputs, ran_bytes, saved)
    except Exception as exc:  # export took the inputs, running them did not (an integer input to a Linear)
        if fake and type(exc).__name__ == "DynamicOutputShapeException":
            raise TraceError(
                f"This model runs an op whose output size depends on the data ({str(exc).strip().splitlines()[0]}), "
                "such as transformers 4.x's "
                "mixture-of-experts routing (torch.where over the router's choice): on the meta device there is no "
                "data to size it by, so its FLOPs and activations cannot be counted. Fix: build the model on the "
                "CPU (real tensors; small configs trace in seconds), or use transformers 5.x, whose experts have "
                "no such op.", exc) from None
        error = None if fake else unfit()
        if error is not None:
            raise error from exc
        raise
    changed = {name for name, b in gm.named_buffers() if name in before and not torch.equal(before[name], b)}
    return _Measured(flops, ran_bytes, saved, changed)


def _module_stack(node: torch.fx.Node) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The FQNs of the modules ``node`` runs in, outermost first, and which call of each (``fqn@k``: the k-th)."""
    stack: list[str] = []
    calls: list[int] = []
    for key, (fqn, _cls) in (node.meta.get("nn_module_stack") or {}).items():
        if not fqn:
            continue
        m = _CALL_SUFFIX.search(key)
        stack.append(fqn)
        calls.append(int(m.group(1)) if m else 0)
    return tuple(stack), tuple(calls)


def _read_ops(gm: torch.fx.GraphModule, measured: _Measured, canonical: Mapping[str, str],
              batch_size: int | None) -> list[Op]:
    """One ``Op`` per ATen call of ``gm``, in execution order, with what ``measured`` counted for it."""
    ops: list[Op] = []
    index_of: dict[str, int] = {}
    gm_buffers = frozenset(name for name, _ in gm.named_buffers())  # get_attr targets that train no gradient
    batched = batched_nodes(gm, batch_size)
    grads = grad_nodes(gm, gm_buffers)
    saved = measured.saved
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        stack, calls = _module_stack(node)
        inputs, model_inputs, params = [], [], []
        for arg in node.all_input_nodes:
            if arg.op == "call_function" and arg.name in index_of:
                inputs.append(index_of[arg.name])
            elif arg.op == "placeholder":
                model_inputs.append(arg.name)
            elif arg.op == "get_attr":
                params.append(canonical.get(str(arg.target), str(arg.target)))
        index_of[node.name] = len(ops)
        ops.append(
            Op(
                index=len(ops), name=node.name, target=str(node.target), stack=stack, calls=calls,
                flops=measured.flops.get(node.name, 0),
                # a region's leave call passes its results on: their bytes are the body's, counted there
                out_bytes=0 if node.target is leave_region else
                (measured.ran_bytes or {}).get(node.name, tensor_bytes(node.meta.get("val"))),
                inputs=tuple(dict.fromkeys(inputs)), model_inputs=tuple(dict.fromkeys(model_inputs)),
                params=tuple(dict.fromkeys(params)), region=node.meta.get(REGION_META, ""),
                saved_bytes=saved.first.get(node.name, 0) if saved.ok else None,
                resaved=tuple((index_of[first], slot, b) for first, slot, b in saved.again.get(node.name, ())
                              if first in index_of) if saved.ok else (),
                spec=op_spec(node, grads, batched),
                data_dependent=data_dependent(node.meta.get("val")),
            )
        )
    return ops


def _is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _faked(mode: FakeTensorMode | contextlib.nullcontext[None], tree: _T) -> _T:
    """``tree``'s tensors as ``mode``'s fakes (a ``fake_cpu`` trace), or as they are."""
    if isinstance(mode, contextlib.nullcontext):
        return tree
    return pytree.tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, tree)


def _logits_index(spec: pytree.TreeSpec | None) -> int | None:
    """Leaf index of ``logits`` in an HF ModelOutput's flattened output, else None."""
    keys = getattr(spec, "context", None)
    if spec is None or not isinstance(keys, list | tuple) or "logits" not in keys:
        return None
    k = list(keys).index("logits")
    return sum(child.num_leaves for child in list(spec.children())[:k])


# torch's FLOP counter knows SDPA's GPU kernels and meta, not the CPU kernel a model traced on CPU tensors runs:
# without this an HF model's attention counted 0 FLOPs on the CPU (and its full count on the meta device).
cpu_flash_attention_flops._get_raw = True  # type: ignore[attr-defined]  # called with tensors, not shapes


def loss_input_bytes(cap: Capture) -> int:
    """Bytes the loss saves for backward on the last stage, for the example batch: one tensor the size of the
    model's (floating) output, the ``logits`` of an HF output. Cross-entropy saves its log-softmax, MSE its input:
    either is the output's size (the target, saved too, is not known before a launch and is usually small)."""
    import torch

    total = 0
    for shape, dtype in cap.loss_outputs:
        if dtype.is_floating_point:
            n = 1
            for d in shape:
                n *= d
            total += n * torch.empty((), dtype=dtype).element_size()
    return total
