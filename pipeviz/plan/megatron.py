"""A plan as Megatron-Core's ``--pipeline-model-parallel-layout`` string, and such a string read back into a plan.

Megatron-Core (0.19: ``megatron/core/transformer/pipeline_parallel_layer_layout.py``) takes the split as one string of
tokens per stage: ``E`` the embedding, ``t`` a transformer layer, ``L`` the loss head (the final norm and the output
layer), ``|`` between stages, ``x*N`` a token repeated, ``(...)*N`` stages repeated, commas for reading only; empty
stages are allowed (``E||t|L``). Stage ``i`` runs on pipeline rank ``i % pp`` (``--pipeline-model-parallel-size``),
the loop layout pipeviz's interleaved schedules use, so a layout of ``v * pp`` stages is ``v`` virtual stages per rank.

Example:
    >>> plan = graph.split(["model.layers.0", "model.layers.2"])      # a Llama with 4 layers
    >>> pv.megatron_layout(plan)
    'Et|tt|tL'
    >>> graph.split_megatron("E|t*4|L").stages                        # embedding and head on stages of their own

In pipeviz's terms: ``t`` is a block of the model's one stack of blocks (an ``nn.ModuleList`` of two or more blocks
of one class, each feeding the next: ``model.layers``, ``transformer.h``), ``E`` every module that runs before the
first block (embeddings, rotary tables), ``L`` every module after the last (final norm, head). A plan converts when
its splits fall between blocks, or between ``E`` and the first block, or between the last block and ``L``.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.distributed.pipelining import SplitPoint

from pipeviz.capture.names import listed
from pipeviz.capture.units import ROOT
from pipeviz.plan.errors import PlanError
from pipeviz.plan.split import SplitPlan

if TYPE_CHECKING:
    from pipeviz.capture.view import GraphView

__all__ = ["format_layout", "megatron_layout", "parse_layout", "split_megatron"]

TOKENS = {"E": "embedding", "t": "transformer layer", "L": "loss head"}
# Megatron's own unrolling, in its order: groups first, then single tokens (parse_str_to_list).
_GROUP = re.compile(r"\(([^)]+)\)\*(\d+)")
_REPEAT = re.compile(r"(.)\*(\d+)")
_GRAMMAR = ("E (embedding), t (transformer layer), L (loss head), | between stages, x*N a token repeated, "
            "(...)*N stages repeated, commas to read")


@dataclass(frozen=True)
class Stack:
    """The model's one stack of blocks and what runs around it, in op indices of the capture.

    Attributes:
        name: the container (``"model.layers"``).
        blocks: its blocks' unit names, in order (``fqn@k`` for calls of one shared block).
        first, last: the first op of the first block, the last op of the last block.
        pre_last: the last op run inside a module before the first block (the end of ``E``).
        post_first: the first op run inside a module after the last block (the start of ``L``).
        pre_end: the outermost module that ends at ``pre_last`` (a split at its END ends ``E``).
    """

    name: str
    blocks: tuple[str, ...]
    first: int
    last: int
    pre_last: int
    post_first: int
    pre_end: str


def stack(graph: GraphView) -> Stack:
    """The one stack of transformer blocks in ``graph`` and the ``E`` / ``L`` parts around it.

    Raises:
        PlanError: no stack, several (an encoder-decoder: Megatron's layout describes one decoder stack), or
            nothing before the first block or after the last (no ``E`` or ``L``).
    """
    tree = graph._tree
    model = type(graph.model).__name__
    lists = [n for n in tree.units if n != ROOT and tree.block_list(n)]
    top = [n for n in lists if not any(a in lists for a in tree.ancestors(n))]
    if not top:
        raise PlanError(f"{model} has no stack of transformer blocks for Megatron's 't': no module holds two or more "
                        "blocks of one class, each feeding the next (an nn.ModuleList of decoder layers). Its layers: "
                        f"{listed(list(graph.layer_names))}. Fix: a model built as embedding, a list of blocks, head.")
    if len(top) > 1:
        raise PlanError(f"{model} has {len(top)} stacks of blocks ({', '.join(top)}); Megatron's layout describes one "
                        "decoder stack (its flexible layout refuses encoder layers). Fix: export a decoder-only model.")
    blocks = tree.units[top[0]].children
    first, last = tree.units[blocks[0]].first, tree.units[blocks[-1]].last
    # An op of E or L runs in a module other than those enclosing the stack (their own code between calls is glue).
    around = set(tree.ancestors(top[0]))

    def runs_in_module(op: int) -> bool:
        return any(u not in around for u in tree.paths[op])

    before = [i for i in range(first) if runs_in_module(i)]
    after = [i for i in range(last + 1, len(tree.paths)) if runs_in_module(i)]
    if not before or not after:
        where, part = ("before its first block", "E, the embedding") if not before else \
            ("after its last block", "L, the loss head")
        raise PlanError(f"{model} runs no module {where} {(blocks[0] if not before else blocks[-1])!r}: nothing for "
                        f"Megatron's {part}, which its layout requires. Fix: a model with an embedding before its "
                        f"blocks ({top[0]!r}) and a head after them.")
    pre_last = before[-1]
    pre_end = next(u for u in tree.paths[pre_last] if u not in around)  # outermost: it ends at pre_last
    return Stack(top[0], blocks, first, last, pre_last, after[0], pre_end)


def megatron_layout(plan: SplitPlan) -> str:
    """``plan`` as Megatron-Core's ``--pipeline-model-parallel-layout``: one stage per plan stage, ``E`` where the
    embedding runs, a ``t`` per transformer block, ``L`` where the head runs, runs of 3 or more as ``t*N`` and
    repeated stages as ``(...|)*N``.

    Example:
        >>> pv.megatron_layout(graph.split(["model.layers.0", "model.layers.2"]))
        'Et|tt|tL'
        >>> pv.megatron_layout(pv.balance(graph_32_layers, 8))             # then --pipeline-model-parallel-size 8
        'Et*3|(t*4|)*6,t*4L'

    ``graph.split_megatron(layout)`` reads it back into the same stages.

    Raises:
        PlanError: the model has no one stack of blocks with an embedding before it and a head after it, or a split
            falls inside a block, inside the part before the first block, or inside the part after the last (the
            message names the split and where Megatron can place it).
    """
    st = stack(plan.graph)
    tree = plan.graph._tree
    positions = plan.positions
    for pos, (name, point) in zip(positions, plan.splits, strict=True):
        where = f"The split at the {point.name} of {name!r}"
        if pos < st.pre_last:
            raise PlanError(f"{where} cuts the part before the first block in two; Megatron's E (the embedding) is one "
                            f"layer on one stage. Fix: split at the END of {st.pre_end!r} (the BEGINNING of "
                            f"{st.blocks[0]!r}) or later.")
        if pos > st.post_first:
            raise PlanError(f"{where} cuts the part after the last block in two; Megatron's L (the loss head) is one "
                            f"layer on one stage. Fix: split at the END of {st.blocks[-1]!r} or earlier.")
        for i, block in enumerate(st.blocks):
            unit = tree.units[block]
            if unit.first < pos < unit.last:
                fix = f"the END of {st.blocks[i - 1]!r} or of {block!r}" if i else f"the END of {block!r}"
                raise PlanError(f"{where} falls inside block {block!r}; Megatron places whole transformer layers (t). "
                                f"Fix: split between blocks, at {fix}.")

    def stage(op: int) -> int:
        return bisect.bisect_left(positions, op)

    tokens: list[list[str]] = [[] for _ in range(plan.num_stages)]
    tokens[stage(st.pre_last)].append("E")
    for block in st.blocks:
        tokens[stage(tree.units[block].first)].append("t")
    tokens[stage(st.post_first)].append("L")
    return format_layout(tokens)


def format_layout(stages: list[list[str]]) -> str:
    """Per-stage tokens as a layout string: ``[["E", "t"], ["t", "t"], ["t", "t"], ["t", "L"]]`` ->
    ``"Et|(tt|)*2,tL"``; a stage's 3 or more ``t`` as ``t*N``."""

    def text(tokens: list[str]) -> str:
        n = tokens.count("t")
        body = "t" * n if n <= 2 else f"t*{n}"
        return ("E" if "E" in tokens else "") + body + ("L" if "L" in tokens else "")

    texts = [text(s) for s in stages]
    pieces: list[str] = []
    i = 0
    while i < len(texts):
        j = i
        while j + 1 < len(texts) - 1 and texts[j + 1] == texts[i]:  # the last stage has no "|" after it
            j += 1
        if j > i:
            pieces.append(f"({texts[i]}|)*{j - i + 1}" + ("," if j + 1 < len(texts) else ""))
        else:
            pieces.append(texts[i] + ("|" if i + 1 < len(texts) else ""))
        i = j + 1
    return "".join(pieces)


def parse_layout(layout: str) -> list[list[str]]:
    """A layout string read as Megatron-Core reads it (commas dropped, ``(...)*N`` then ``x*N`` unrolled, split at
    ``|``): one list of tokens per stage, empty stages kept.

    Example:
        >>> parse_layout("Et*2|(t|)*2,L")
        [['E', 't', 't'], ['t'], ['t'], ['L']]

    Raises:
        PlanError: a character that is not a token (``m``, Megatron's multi-token prediction layer, included:
            pipeviz's models have none).
    """
    if not isinstance(layout, str):
        raise TypeError(f"A Megatron layout is a string such as 'Et|tt|tL', got {layout!r} ({type(layout).__name__}).")
    text = layout.replace(",", "")
    for pattern in (_GROUP, _REPEAT):
        text = pattern.sub(lambda m: m.group(1) * int(m.group(2)), text)
    stages = [list(s) for s in text.split("|")]
    for i, tokens in enumerate(stages):
        for tok in tokens:
            if tok == "m":
                raise PlanError(f"Layout {layout!r}: stage {i} holds an MTP layer (m); pipeviz's graph has no "
                                "multi-token-prediction layers. Fix: leave out the m.")
            if tok not in TOKENS:
                raise PlanError(f"Layout {layout!r}: {tok!r} in stage {i} is not a layer. Valid: {_GRAMMAR}.")
    return stages


def split_megatron(graph: GraphView, layout: str) -> SplitPlan:
    """The plan a Megatron-Core layout string describes, over ``graph`` (``graph.split_megatron(layout)``).

    Example:
        >>> plan = graph.split_megatron("Ett|ttL")          # a Llama with 4 layers: 2 stages
        >>> [s.layers for s in plan.stages]
        [('model.embed_tokens', 'model.rotary_emb', 'model.layers.0', 'model.layers.1'),
         ('model.layers.2', 'model.layers.3', 'model.norm', 'lm_head')]

    Raises:
        PlanError: a token that is not ``E``, ``t`` or ``L``; ``E`` not once and first, ``L`` not once and last; a
            ``t`` count other than the model's blocks; an empty stage (a pipeviz stage runs at least one module);
            or a model without one stack of blocks (the message names what the model has).
    """
    stages = parse_layout(layout)
    st = stack(graph)
    flat = [t for s in stages for t in s]
    empty = [i for i, s in enumerate(stages) if not s]
    if empty:
        kept = format_layout([s for s in stages if s])
        raise PlanError(f"Layout {layout!r}: stage {empty[0]} is empty; a pipeviz plan runs at least one module on "
                        f"every stage. Fix: drop the empty stage ({kept!r}).")
    for tok, where, at in (("E", "first", 0), ("L", "last", -1)):
        if flat.count(tok) != 1 or flat[at] != tok:
            raise PlanError(f"Layout {layout!r}: {tok} ({TOKENS[tok]}) must come once, as the {where} token (Megatron "
                            f"requires it); found {flat.count(tok)}.")
    n = flat.count("t")
    if n != len(st.blocks):
        even = _even(len(st.blocks), len(stages))
        raise PlanError(f"Layout {layout!r} places {n} transformer layers (t); {st.name!r} holds {len(st.blocks)} "
                        f"blocks ({st.blocks[0]!r} ... {st.blocks[-1]!r}). Fix: {len(st.blocks)} t in all, e.g. "
                        f"{even!r}.")
    splits: list[tuple[str, SplitPoint]] = []
    count = 0
    for tokens in stages[:-1]:
        count += tokens.count("t")
        # The END of a distinct module for every boundary: the part before the first block ends at pre_end.
        splits.append((st.blocks[count - 1] if count else st.pre_end, SplitPoint.END))
    return SplitPlan(graph, tuple(splits))


def _even(blocks: int, stages: int) -> str:
    """A layout of ``stages`` stages spreading ``blocks`` as evenly as whole blocks allow (E first, L last)."""
    base, extra = divmod(blocks, stages)
    tokens = [["t"] * (base + (1 if i < extra else 0)) for i in range(stages)]
    tokens[0].insert(0, "E")
    tokens[-1].append("L")
    return format_layout(tokens)
