"""Big models: stages whose weights come from a checkpoint, or from their modules' own initialisers, on
the rank that runs them, so that no process ever holds the whole model.

A model built on the meta device (``with torch.device("meta"): model = LlamaForCausalLM(config)``) traces,
previews, balances and simulates without allocating anything. To run it, ``pv.launch(plan, ...,
weights=PATH)`` reads each rank's tensors from a safetensors checkpoint: one ``.safetensors`` file, or a
folder of shards with its ``model.safetensors.index.json`` (what HF ``save_pretrained`` writes). Without
``weights``, each rank initialises its own tensors with the modules' initialisers (HF ``_init_weights``,
else ``reset_parameters``), seeded per module by its name, so a run repeats and does not depend on the
split. ``materialize`` builds the same tensors for the whole model (a small model's reference),
``save_state`` writes trained tensors back as safetensors.

Example:
    >>> with torch.device("meta"):
    ...     model = LlamaForCausalLM(config)
    >>> plan = pv.balance(pv.trace(model, example_args=(ids,)), 4)
    >>> run = pv.launch(plan, "1F1B", 8, 10, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy,
    ...                 weights="llama-checkpoint/")          # or no weights: initialised on the ranks
    >>> run.wait(); run.save("trained/")
"""

from __future__ import annotations

import copy
import json
import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn

__all__ = ["INDEX_FILE", "Checkpoint", "InitUnit", "Source", "StageSource", "WeightsError", "init_units",
           "initialisable", "is_meta", "materialize", "materialize_stage", "open_checkpoint", "owner_of",
           "plan_sources", "save_state", "strip"]

INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class WeightsError(ValueError):
    """A checkpoint that cannot start this run, or a meta tensor nothing can initialise."""


@dataclass(frozen=True)
class Checkpoint:
    """A safetensors checkpoint's table of contents (headers only: no tensor is read).

    Attributes:
        path: the file or folder given.
        files: tensor name -> the file holding it.
        shapes: tensor name -> shape; dtypes: tensor name -> torch dtype.
    """

    path: str
    files: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor in the checkpoint."""
        return sum(_numel(s) * torch.empty((), dtype=self.dtypes[k]).element_size() for k, s in self.shapes.items())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _safetensors() -> ModuleType:
    try:
        import safetensors
        import safetensors.torch
    except ImportError as exc:  # pragma: no cover - an install without the extra
        raise WeightsError("weights= and run.save() need safetensors. Fix: pip install 'pipeviz[checkpoints]'.") \
            from exc
    return safetensors


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a checkpoint's names, shapes and dtypes: a ``.safetensors`` file, or a folder with
    ``model.safetensors.index.json`` and its shards (or a single ``model.safetensors``).

    Raises:
        WeightsError: the path does not exist, is not safetensors, or its index names a missing shard.
    """
    st = _safetensors()
    path = os.fspath(path)
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_FILE)
        if os.path.exists(index):
            with open(index) as f:
                weight_map: dict[str, str] = json.load(f).get("weight_map", {})
            files = {k: os.path.join(path, v) for k, v in weight_map.items()}
        elif os.path.exists(os.path.join(path, "model.safetensors")):
            files = {}
            single = os.path.join(path, "model.safetensors")
            with st.safe_open(single, framework="pt") as f:
                files = dict.fromkeys(f.keys(), single)
        else:
            raise WeightsError(f"weights={path!r} is a folder without {INDEX_FILE} or model.safetensors. Fix: pass "
                               "a .safetensors file, or the folder HF save_pretrained (or run.save) wrote.")
    elif os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise WeightsError(f"weights={path!r} is not a .safetensors file. Fix: save the weights with "
                               "safetensors (HF save_pretrained, safetensors.torch.save_file, or run.save).")
        with st.safe_open(path, framework="pt") as f:
            files = dict.fromkeys(f.keys(), path)
    else:
        raise WeightsError(f"weights={path!r} does not exist. Fix: a .safetensors file or a checkpoint folder.")
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for shard in sorted(set(files.values())):
        if not os.path.exists(shard):
            raise WeightsError(f"{path}: the index names {os.path.basename(shard)!r}, which is missing.")
        with st.safe_open(shard, framework="pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                shapes[key] = tuple(piece.get_shape())
                dtypes[key] = _DTYPES.get(piece.get_dtype(), torch.float32)
    return Checkpoint(path, files, shapes, dtypes)


def is_meta(model: nn.Module) -> bool:
    """True when any parameter or buffer of ``model`` is on the meta device (no values)."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


# --- initialising meta tensors where they run ----------------------------------------------------------------


@dataclass
class InitUnit:
    """What a rank needs to initialise one module's own tensors: the module (on meta) under a copy of its
    ancestors that keeps only the path to it, so HF's per-model initialiser applies as in the whole model."""

    fqn: str
    chain: nn.Module  # the pruned root (meta)
    names: dict[str, str]  # the module's own tensor name -> canonical name


@dataclass
class StageSource:
    """Where each tensor of one stage comes from on its rank: a checkpoint entry, an initialiser, or the
    stage as shipped (real tensors not in the checkpoint, such as a non-persistent buffer)."""

    load: dict[str, tuple[str, str]] = field(default_factory=dict)  # canonical -> (file, key)
    init: list[InitUnit] = field(default_factory=list)
    seed: int = 0


def owner_of(name: str) -> tuple[str, str]:
    """``"a.b.weight"`` -> (``"a.b"``, ``"weight"``): the module that holds a tensor, and its own name there."""
    fqn, _, local = name.rpartition(".")
    return fqn, local


def _is_hf(mod: nn.Module) -> bool:
    return callable(getattr(mod, "_init_weights", None)) and hasattr(mod, "config")


def _chain(model: nn.Module, fqn: str) -> nn.Module:
    """A copy of ``model`` keeping only the modules on the path to ``fqn`` (each with its own tensors) and the
    whole subtree of ``fqn``; meta tensors stay meta, so this costs no memory."""
    target = model.get_submodule(fqn)
    if not fqn:
        return copy.deepcopy(target)
    atoms = fqn.split(".")
    root = copy.copy(model)
    node, src = root, model
    for i, atom in enumerate(atoms):
        node._parameters, node._buffers = dict(src._parameters), dict(src._buffers)
        node._non_persistent_buffers_set = set(src._non_persistent_buffers_set)
        child_src = src._modules[atom]
        assert child_src is not None
        child = copy.deepcopy(child_src) if i == len(atoms) - 1 else copy.copy(child_src)
        node._modules = {atom: child}
        node, src = child, child_src
    return root


def initialisable(model: nn.Module, fqn: str) -> bool:
    """Whether ``fqn``'s own tensors have an initialiser: an HF model above it, or its ``reset_parameters``."""
    path = [model] + [model.get_submodule(".".join(fqn.split(".")[:i + 1])) for i in range(len(fqn.split(".")))] \
        if fqn else [model]
    mod = path[-1]
    return any(_is_hf(m) for m in path) or callable(getattr(mod, "reset_parameters", None))


def _seed(seed: int, fqn: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(fqn.encode())) % (2**63)


def _initialise(unit: InitUnit, seed: int) -> dict[str, torch.Tensor]:
    """Run the module's initialisers on a CPU copy of it; returns its own tensors by canonical name.

    HF models: the nearest HF model's ``_init_weights`` on every module of the subtree (children first), then
    on the ancestors (whose initialiser may set a descendant's tensor by name, as GPT-2's does), like
    ``PreTrainedModel.initialize_weights``. Other modules: ``reset_parameters`` over the subtree. A float
    tensor the initialisers never set is an error, not garbage: it starts as NaN and is checked."""
    chain = unit.chain.to_empty(device="cpu")
    atoms = unit.fqn.split(".") if unit.fqn else []
    path = [chain] + [chain.get_submodule(".".join(atoms[:i + 1])) for i in range(len(atoms))]
    target = path[-1]
    with torch.no_grad():  # what no initialiser writes: NaN, or the smallest integer
        for t in [*target.parameters(recurse=False), *target.buffers(recurse=False)]:
            t.fill_(_unset(t.dtype))
    torch.manual_seed(_seed(seed, unit.fqn))
    hf_of: dict[int, nn.Module] = {}
    last_hf: nn.Module | None = None
    for m in path:
        if _is_hf(m):
            last_hf = m
        hf_of[id(m)] = last_hf  # type: ignore[assignment]
    with torch.no_grad():
        if last_hf is not None:
            _hf_subtree(target, hf_of[id(target)])
            for anc in reversed(path[:-1]):
                try:
                    getattr(hf_of[id(anc)], "_init_weights")(anc)  # noqa: B009  (an HF method mypy cannot see)
                except (AttributeError, TypeError, KeyError):
                    pass  # an ancestor's initialiser reaching for a sibling pruned from the chain
        else:
            for m in _post_order(target):
                reset = getattr(m, "reset_parameters", None)
                if callable(reset):
                    reset()
    own = {**dict(target.named_parameters(recurse=False)), **dict(target.named_buffers(recurse=False))}
    out: dict[str, torch.Tensor] = {}
    for local, canon in unit.names.items():
        t = own[local].detach()
        unset = torch.isnan(t) if t.is_floating_point() else t == _unset(t.dtype)
        if t.dtype != torch.bool and t.numel() and bool(unset.any()):
            raise WeightsError(
                f"{canon} ({type(target).__name__} {unit.fqn!r}) was left unset by its module's initialiser "
                f"({'HF _init_weights' if last_hf is not None else 'reset_parameters'}), and the model is on the "
                "meta device, so it has no value. Fix: pass weights=PATH (a safetensors checkpoint), or build "
                "the model on the CPU.")
        out[canon] = t
    return out


def _unset(dtype: torch.dtype) -> float | int | bool:
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return False if dtype == torch.bool else int(torch.iinfo(dtype).min)


def _hf_subtree(mod: nn.Module, hf: nn.Module | None) -> None:
    for child in mod.children():  # children first, like HF's smart_apply; a nested HF model uses its own
        _hf_subtree(child, child if _is_hf(child) else hf)
    if hf is not None:
        getattr(hf, "_init_weights")(mod)  # noqa: B009


def _post_order(mod: nn.Module) -> Iterable[nn.Module]:
    for child in mod.children():
        yield from _post_order(child)
    yield mod


def init_units(model: nn.Module, names: Iterable[str], aliases: dict[str, tuple[str, ...]]) -> list[InitUnit]:
    """The ``InitUnit`` list that initialises the canonical tensors ``names`` of ``model`` (one per module)."""
    by_owner: dict[str, dict[str, str]] = {}
    for canon in names:
        fqn, local = owner_of(canon)
        by_owner.setdefault(fqn, {})[local] = canon
    return [InitUnit(fqn, _chain(model, fqn), locals_) for fqn, locals_ in sorted(by_owner.items())]


# --- on a rank -------------------------------------------------------------------------------------------------


def strip(module: nn.Module, inner_names: Iterable[str]) -> None:
    """Replace the named tensors of ``module`` by meta tensors of the same shape and dtype (what a rank
    receives instead of values it will load or initialise itself)."""
    for inner in inner_names:
        owner_name, local = owner_of(inner)
        owner = module.get_submodule(owner_name)
        if local in owner._parameters:
            p = owner._parameters[local]
            assert p is not None
            owner._parameters[local] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        elif local in owner._buffers:
            b = owner._buffers[local]
            assert b is not None
            owner._buffers[local] = torch.empty_like(b, device="meta")


def materialize_stage(module: nn.Module, inner: dict[str, str], source: StageSource, device: torch.device) -> None:
    """Give ``module``'s meta tensors their values on ``device``: each read from its checkpoint file alone,
    or made by its module's initialiser (``inner``: canonical name -> name inside ``module``)."""
    st = _safetensors()
    values: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[tuple[str, str]]] = {}
    for canon, (file, key) in source.load.items():
        if canon in inner:
            by_file.setdefault(file, []).append((canon, key))
    for file, pairs in sorted(by_file.items()):
        with st.safe_open(file, framework="pt", device="cpu") as f:
            for canon, key in pairs:
                values[canon] = f.get_tensor(key)
    for unit in source.init:
        values.update(_initialise(unit, source.seed))
    for canon, name in inner.items():
        owner_name, local = owner_of(name)
        owner = module.get_submodule(owner_name)
        if local in owner._parameters:
            p = owner._parameters[local]
            assert p is not None
            if not p.is_meta:
                continue
            owner._parameters[local] = nn.Parameter(_value(values, canon, p, device), requires_grad=p.requires_grad)
        elif local in owner._buffers:
            b = owner._buffers[local]
            assert b is not None
            if b.is_meta:
                owner._buffers[local] = _value(values, canon, b, device)
    left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left:
        raise WeightsError(f"no value for {', '.join(left[:5])} on this rank; please report.")


def _value(values: dict[str, torch.Tensor], canon: str, like: torch.Tensor, device: torch.device) -> torch.Tensor:
    if canon not in values:
        raise WeightsError(f"no checkpoint entry or initialiser for {canon}; please report.")
    return values.pop(canon).to(device=device, dtype=like.dtype).detach()


# --- the whole model, and saving -------------------------------------------------------------------------------


def materialize(model: nn.Module, weights: str | os.PathLike[str] | None = None, seed: int = 0) -> nn.Module:
    """A real (CPU) copy of ``model`` with every meta tensor given the value a ``pv.launch`` of it gets:
    read from ``weights``, else initialised exactly as the ranks do (seeded per module). For models that fit
    one process: the reference a meta model's run is checked against. Real tensors are copied as they are."""
    from pipeviz.capture.structure import alias_groups

    canonical, groups = alias_groups(model)
    ckpt = open_checkpoint(weights) if weights is not None else None
    out = copy.deepcopy(model)
    values: dict[str, torch.Tensor] = {}
    todo = []
    for canon, names in groups.items():
        t = lookup_tensor(model, canon)
        key = next((n for n in names if ckpt is not None and n in ckpt.files), None)
        if key is not None and ckpt is not None:
            with _safetensors().safe_open(ckpt.files[key], framework="pt") as f:
                values[canon] = f.get_tensor(key).to(t.dtype)
        elif t.is_meta:
            todo.append(canon)
    for unit in init_units(model, todo, groups):
        values.update(_initialise(unit, seed))
    if is_meta(out):
        out.to_empty(device="cpu")
        for names in groups.values():  # to_empty gives every module its own tensor: tie them again
            first = lookup_tensor(out, names[0])
            for n in names[1:]:
                fqn, local = owner_of(n)
                mod = out.get_submodule(fqn)
                if local in mod._parameters:
                    mod._parameters[local] = first  # type: ignore[assignment]
                else:
                    mod._buffers[local] = first
    with torch.no_grad():
        for canon, names in groups.items():
            src = values.get(canon)
            if src is None:
                src = lookup_tensor(model, canon)
            for n in names:
                lookup_tensor(out, n).copy_(src)
    del canonical
    return out


def lookup_tensor(model: nn.Module, name: str) -> torch.Tensor:
    fqn, local = owner_of(name)
    mod = model.get_submodule(fqn)
    t: torch.Tensor | None = mod._parameters.get(local)
    if t is None:
        t = mod._buffers.get(local)
    if t is None:
        raise KeyError(name)
    return t


def save_state(files: list[dict[str, torch.Tensor]], path: str | os.PathLike[str]) -> list[str]:
    """Write tensors as safetensors: ``path`` ending in ``.safetensors``: one file; else a folder with one
    shard per entry of ``files`` and ``model.safetensors.index.json`` (what HF ``from_pretrained`` and
    ``weights=`` read). Returns the files written."""
    st = _safetensors()
    path = os.fspath(path)
    tensors = [{k: v.contiguous() for k, v in part.items()} for part in files]
    if path.endswith(".safetensors"):
        merged = {k: v for part in tensors for k, v in part.items()}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        st.torch.save_file(merged, path, metadata={"format": "pt"})
        return [path]
    os.makedirs(path, exist_ok=True)
    n = len(tensors)
    weight_map: dict[str, str] = {}
    written = []
    total = 0
    for i, part in enumerate(tensors):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        st.torch.save_file(part, os.path.join(path, name), metadata={"format": "pt"})
        written.append(os.path.join(path, name))
        for k, v in part.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return [*written, os.path.join(path, INDEX_FILE)]


# --- before launching ------------------------------------------------------------------------------------------

Source = tuple[str, str] | str  # (file, key) to load, "init", or "keep" (the value the model has)


def plan_sources(model: nn.Module, aliases: dict[str, tuple[str, ...]], stage_tensors: list[frozenset[str]],
                 weights: str | os.PathLike[str] | None) -> dict[str, Source] | None:
    """Where every tensor a stage holds comes from on its rank; ``None`` for an ordinary run (a real model,
    no checkpoint: the stages are shipped with their values).

    Raises:
        WeightsError: naming the tensors a checkpoint lacks (and their stages), the shapes that differ from the
            traced model's, or the meta tensors with neither a checkpoint entry nor an initialiser.
    """
    if weights is None and not is_meta(model):
        return None
    ckpt = open_checkpoint(weights) if weights is not None else None
    persistent = set(model.state_dict())
    stages_of: dict[str, list[int]] = {}
    for s, names in enumerate(stage_tensors):
        for n in names:
            stages_of.setdefault(n, []).append(s)
    sources: dict[str, Source] = {}
    missing, wrong, bare = [], [], []
    for canon in sorted(stages_of):
        try:
            t = lookup_tensor(model, canon)
        except (KeyError, AttributeError):
            continue  # a constant the trace lifted out of the forward (not a model tensor): shipped as it is
        alias = aliases.get(canon, (canon,))
        key = next((n for n in alias if ckpt is not None and n in ckpt.files), None)
        where = f"stage{'s' * (len(stages_of[canon]) > 1)} {', '.join(map(str, stages_of[canon]))}"
        if key is not None and ckpt is not None:
            if ckpt.shapes[key] != tuple(t.shape):
                wrong.append(f"{key}: {ckpt.shapes[key]} in the checkpoint, {tuple(t.shape)} in the model ({where})")
            sources[canon] = (ckpt.files[key], key)
        elif ckpt is not None and any(n in persistent for n in alias):
            missing.append(f"{canon} ({where})")
        elif t.is_meta:
            if initialisable(model, owner_of(canon)[0]):
                sources[canon] = "init"
            else:
                fqn = owner_of(canon)[0]
                bare.append(f"{canon} ({type(model.get_submodule(fqn)).__name__} {fqn!r}, {where})")
        else:
            sources[canon] = "keep"
    if missing:
        raise WeightsError(
            f"The checkpoint {ckpt.path if ckpt else ''} lacks {len(missing)} tensor(s) the stages need: "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}. Fix: a checkpoint of this model "
            "(the same config), or save it with run.save() / save_pretrained().")
    if wrong:
        raise WeightsError(
            f"{len(wrong)} tensor(s) of the checkpoint do not match the traced model's shapes: "
            f"{'; '.join(wrong[:6])}{' ...' if len(wrong) > 6 else ''}. Fix: build the model from the "
            "checkpoint's config.")
    if bare:
        raise WeightsError(
            f"{len(bare)} tensor(s) are on the meta device (no values) and nothing can give them one: "
            f"{', '.join(bare[:6])}{' ...' if len(bare) > 6 else ''}. Their modules have no initialiser "
            "(reset_parameters) and no HF model contains them. Fix: weights=PATH (a safetensors checkpoint), "
            "or build the model on the CPU.")
    return sources
