"""Expert parallelism inside a traced stage graph: each of ``ep`` processes computes only its share of every MoE
block's routed experts (``ExpertGraph``), the tokens routed to the others' experts sent there and back by
all-to-all. The graph is the one traced for the whole model; it runs op by op (an ``fx.Interpreter``), in an order
where each block's experts meet once:

- a block's routed experts are found by the module each op ran in (``node_modules``): ops inside ``<block>.experts.
  <e>`` are expert ``e`` of an ``nn.ModuleList`` (``pipeviz.zoo.MoENet``, transformers 4.x Mixtral / Qwen2-MoE),
  ops inside ``<block>.experts`` reading 3-D ``gate_up_proj`` / ``down_proj`` weights are transformers 5.x's fused
  experts (``Qwen2MoeExperts``, ``MixtralExperts``: hidden states, top-k indices, top-k weights in, the weighted sum
  out);
- every value the block's experts read is computed first (the graph reordered, each op after its inputs), then one
  exchange per block: per expert the rows routed to it (``Team.dispatch``: a count exchange, then one
  ``all_to_all_single`` of the rows), the owner runs its experts on every process's rows at once, the outputs go
  back (``Team.combine``, one more all-to-all); backward is the same exchanges reversed (autograd);
- share ``r`` of ``ep`` owns experts ``[r·E/ep, (r+1)·E/ep)``; routing, shared experts and the rest run as traced.
  Dropless: every routed token is computed, so the run equals the unsplit model's to rounding (the owner's matmul
  covers more rows at once).

A process holds only its own experts' weights (``pipeviz.runtime.expert_shards`` cuts the stage after this finds its
blocks: an ``nn.ModuleList`` expert of another share keeps an empty placeholder that nothing here reads, a fused
block's 3-D weights keep this share's rows of dim 0, indexed here from the share's first expert); the owner's expert
gradients hold every group member's tokens, and the runtime reduces them over the processes holding the same experts.

Example:
    >>> team = Team(ep=2, rank=0, group=ep_group)
    >>> ExpertGraph(stage_graph, find_blocks(stage_graph), team)(*inputs)
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

__all__ = ["Block", "ExpertError", "ExpertGraph", "Team", "find_blocks"]

_LISTED = re.compile(r"^(?P<block>.+\.experts)\.(?P<e>\d+)(\..+)?$")
_FUSED = re.compile(r"^(?P<block>.+\.experts)(\.[A-Za-z_][\w.]*)?$")


class ExpertError(ValueError):
    """A stage graph whose experts expert parallelism cannot run exactly (the message names the block and why)."""


@dataclass
class Block:
    """One MoE block's routed experts in a stage graph: ``name`` (the experts' module, ``"blocks.3.experts"``),
    ``count`` experts, ``regions`` (per expert, its ops in graph order: a ``ModuleList``'s) or ``fused`` (all of
    them: transformers 5.x's 3-D experts), ``inputs`` per region (the values it reads from outside), ``output`` per
    region."""

    name: str
    count: int
    regions: list[list[fx.Node]]
    inputs: list[list[fx.Node]]
    outputs: list[fx.Node]
    fused: bool = False
    weights: tuple[str, str] = ("", "")  # fused: the gate_up_proj and down_proj attributes
    act: Any = None  # fused: the activation op (the graph's op in <block>.experts.act_fn)

    @property
    def nodes(self) -> set[fx.Node]:
        return {n for r in self.regions for n in r}


def _region(name: str, nodes: list[fx.Node]) -> tuple[list[fx.Node], fx.Node]:
    """The values a region reads from outside (its parameters included) and its one output."""
    inside = set(nodes)
    reads = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    outs = [n for n in nodes if any(u not in inside for u in n.users)]
    if len(outs) != 1:
        raise ExpertError(f"{name}: {len(outs)} of its values are used outside it ({', '.join(o.name for o in outs)}); "
                          "an expert gives one tensor of rows")
    return reads, outs[0]


def find_blocks(graph: fx.GraphModule) -> list[Block]:
    """The MoE blocks' routed experts in a stage graph, in graph order (none: no routed experts here).

    Raises:
        ExpertError: experts whose ops pipeviz cannot cut out (an expert with two outputs, fused experts without
            ``gate_up_proj`` / ``down_proj``).
    """
    modules: dict[str, str] = getattr(graph, "node_modules", {}) or {}
    listed: dict[str, dict[int, list[fx.Node]]] = {}
    fused: dict[str, list[fx.Node]] = {}
    for n in graph.graph.nodes:
        if n.op != "call_function":
            continue
        mod = modules.get(n.name, "")
        if m := _LISTED.match(mod):
            listed.setdefault(m["block"], {}).setdefault(int(m["e"]), []).append(n)
        elif (m := _FUSED.match(mod)) and m["block"] not in listed:
            fused.setdefault(m["block"], []).append(n)
    blocks = []
    for name, per in listed.items():
        if sorted(per) != list(range(len(per))):
            raise ExpertError(f"{name}: experts {sorted(per)} of a list run here; expert parallelism needs each of "
                              "0..E-1 in the stage")
        regions = [per[e] for e in range(len(per))]
        cut = [_region(f"{name}.{e}", r) for e, r in enumerate(regions)]
        for e, (reads, _) in enumerate(cut):
            if len([a for a in reads if a.op != "get_attr"]) != 1:
                raise ExpertError(f"{name}.{e} reads {len(reads)} values; an expert reads one tensor of rows")
        blocks.append(Block(name, len(per), regions, [c[0] for c in cut], [c[1] for c in cut]))
    for name, nodes in fused.items():
        blocks.append(_fused(graph, name, nodes, modules))
    order = {n: i for i, n in enumerate(graph.graph.nodes)}
    return sorted(blocks, key=lambda b: order[b.regions[0][0]])


def _fused(graph: fx.GraphModule, name: str, nodes: list[fx.Node], modules: dict[str, str]) -> Block:
    reads, out = _region(name, nodes)
    attrs = {str(a.target).rpartition(".")[2]: str(a.target) for a in reads if a.op == "get_attr"}
    if set(attrs) != {"gate_up_proj", "down_proj"}:
        raise ExpertError(f"{name}: fused experts with weights {sorted(attrs)}; expert parallelism runs "
                          "transformers' gate_up_proj / down_proj experts (no biases)")
    acts = [n for n in nodes if modules.get(n.name, "").startswith(name + ".act_fn")]
    if len(acts) != 1:
        raise ExpertError(f"{name}: {len(acts)} activation ops in its act_fn; one expected")
    weight = _attr(graph, attrs["gate_up_proj"])
    count = int(getattr(weight, "expert_count", weight.shape[0]))  # (a share's rows once cut: the whole's count)
    if len([a for a in reads if a.op != "get_attr"]) != 3:
        raise ExpertError(f"{name}: fused experts read {len(reads) - 2} values; three expected (hidden states, "
                          "top-k indices, top-k weights)")
    return Block(name, count, [nodes], [reads], [out], fused=True,
                 weights=(attrs["gate_up_proj"], attrs["down_proj"]), act=acts[0].target)


def _attr(graph: fx.GraphModule, target: str) -> torch.Tensor:
    value: Any = graph
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


@dataclass
class Team:
    """This process's share of every block's experts: ``ep`` shares, this one ``rank``, over the process ``group``
    (``dry``: one process plays every share, no exchange: shapes and routing only). ``record(start, end)`` is told
    of every all-to-all (wall clock), ``count(block, counts)`` of the tokens routed to each expert per forward.
    ``back_group``: the backward's all-to-alls go over this group (``ep_overlap``: a forward and a backward run at
    once in two threads, each on its own group, so their collectives never pair up across them); ``delay``: seconds
    each all-to-all waits after its exchange (``LaunchConfig.ep_delay``, a slowed link)."""

    ep: int
    rank: int
    group: Any = None
    dry: bool = False
    record: Callable[[float, float], None] | None = None
    count: Callable[[str, list[int]], None] | None = None
    back_group: Any = None
    delay: float = 0.0

    def owned(self, experts: int) -> range:
        per = experts // self.ep
        return range(self.rank * per, (self.rank + 1) * per) if not self.dry else range(experts)

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out: torch.Tensor = _AllToAll.apply(x, send, recv, self)  # type: ignore[no-untyped-call]
        return out

    def exchange(self, rows: list[torch.Tensor], expert: Callable[[int, torch.Tensor], torch.Tensor],
                 ) -> list[torch.Tensor]:
        """Every expert's output for this process's ``rows`` routed to it (one tensor per expert, in expert order),
        each computed by its owner on every process's rows at once: dispatch, compute, combine."""
        import torch.distributed as dist

        n = len(rows)
        if self.dry:
            return [expert(e, r) for e, r in enumerate(rows)]
        per = n // self.ep
        counts = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
        got = torch.empty(self.ep * per, dtype=torch.int64)
        dist.all_to_all_single(got, counts, group=self.group)  # got[s, j]: rows share s routes to my expert j
        got2 = got.reshape(self.ep, per).tolist()
        send = [int(counts[s * per:(s + 1) * per].sum()) for s in range(self.ep)]
        recv = [sum(row) for row in got2]
        received = self.all_to_all(torch.cat(rows), send, recv)  # by source, then my expert
        pieces = list(received.split([c for row in got2 for c in row]))
        outs = []
        for j in range(per):
            e = self.rank * per + j
            mine = [pieces[s * per + j] for s in range(self.ep)]
            outs.append(list(expert(e, torch.cat(mine)).split([m.shape[0] for m in mine])))
        back = [outs[j][s] for s in range(self.ep) for j in range(per)]
        combined = self.all_to_all(torch.cat(back), recv, send)
        return list(combined.split([r.shape[0] for r in rows]))


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with ``send`` rows to each share and ``recv`` from each; backward: the reverse."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], team: Team) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.team = send, recv, team
        return _a2a(x, send, recv, team, team.group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        team = ctx.team
        group = team.back_group if team.back_group is not None else team.group
        return _a2a(g.contiguous(), ctx.recv, ctx.send, team, group), None, None, None


def _a2a(x: torch.Tensor, send: list[int], recv: list[int], team: Team, group: Any) -> torch.Tensor:
    import torch.distributed as dist

    out = x.new_empty((sum(recv), *x.shape[1:]))
    start = time.time()
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    if team.delay:  # a slowed link (LaunchConfig.ep_delay): the time a slower transfer would take, GIL released
        time.sleep(team.delay)
    if team.record is not None:
        team.record(start, time.time())
    return out


def schedule(graph: fx.Graph, blocks: list[Block]) -> list[fx.Node | Block]:
    """The graph's ops in an order where each block's experts run at once: at a block's first op, everything its
    experts read (and what that reads) first, then the block (one exchange), then the rest in graph order.

    Raises:
        ExpertError: an expert reading another expert's output of the same block (experts in sequence).
    """
    inside = {n: b for b in blocks for n in b.nodes}
    done: set[fx.Node] = set()
    order: list[fx.Node | Block] = []

    def emit_with_inputs(n: fx.Node, block: Block) -> None:
        stack, need = [n], []
        while stack:
            x = stack.pop()
            if x in done or x in need:
                continue
            if inside.get(x) is block:
                raise ExpertError(f"{block.name}: an expert reads another expert's output ({x.name}); expert "
                                  "parallelism needs the experts of a block side by side")
            need.append(x)
            stack.extend(x.all_input_nodes)
        position = {x: i for i, x in enumerate(graph.nodes)}
        for x in sorted(need, key=position.__getitem__):
            order.append(x)
            done.add(x)

    for n in graph.nodes:
        if n in done:
            continue
        block = inside.get(n)
        if block is None:
            order.append(n)
            done.add(n)
            continue
        for reads in block.inputs:
            for r in reads:
                emit_with_inputs(r, block)
        order.append(block)
        done.update(block.nodes)
    return order


class ExpertGraph:
    """Run a traced stage graph with its MoE blocks' routed experts sharded over ``team`` (call it as the graph
    module is called)."""

    def __init__(self, graph: fx.GraphModule, blocks: list[Block], team: Team) -> None:
        self.graph, self.blocks, self.team = graph, blocks, team
        self.order = schedule(graph.graph, blocks)

    def __call__(self, *args: object) -> object:
        return _Interpreter(self.graph, self).run(*args)


class _Interpreter(fx.Interpreter):
    def __init__(self, module: fx.GraphModule, owner: ExpertGraph) -> None:
        super().__init__(module)
        self.owner = owner

    def run(self, *args: object, initial_env: Any = None, enable_io_processing: bool = True) -> Any:
        self.args_iter = iter(args)
        self.env = {}
        for item in self.owner.order:
            if isinstance(item, Block):
                self.block(item)
                continue
            out = self.run_node(item)
            if item.op == "output":
                return out
            self.env[item] = out
        raise RuntimeError("a stage graph without an output")

    def block(self, b: Block) -> None:
        team = self.owner.team
        if b.fused:
            self.fused(b)
            return
        rows = [self.env[next(a for a in reads if a.op != "get_attr")] for reads in b.inputs]
        if team.count is not None:
            team.count(b.name, [int(r.shape[0]) for r in rows])
        outs = team.exchange(rows, lambda e, x: self.expert(b, e, x))
        for e, y in enumerate(outs):
            self.env[b.outputs[e]] = y

    def expert(self, b: Block, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s ops run on rows ``x`` (the region's ops, its input bound to ``x``)."""
        source = next(a for a in b.inputs[e] if a.op != "get_attr")
        saved = self.env.get(source)
        self.env[source] = x
        try:
            for n in b.regions[e]:
                self.env[n] = self.run_node(n)
            y = self.env[b.outputs[e]]
        finally:
            self.env[source] = saved
        return y

    def fused(self, b: Block) -> None:
        """transformers 5.x's experts (hidden states, top-k indices, top-k weights -> the weighted sum), as its eager
        loop computes them: per expert the tokens routed to it (``torch.where``), weighted, added in expert order."""
        team = self.owner.team
        vals = [self.env[a] for a in b.inputs[0] if a.op != "get_attr"]
        index = next(v for v in vals if not v.is_floating_point())
        floats = [v for v in vals if v.is_floating_point()]
        weights = next(v for v in floats if v.shape == index.shape)
        hidden = next(v for v in floats if v is not weights)
        gate_up, down = (self.env[next(a for a in b.inputs[0] if str(a.target) == w)] for w in b.weights)
        routes = [torch.where(index == e) for e in range(b.count)]  # (token, slot) pairs, by token
        rows = [hidden[tok] for tok, _ in routes]
        if team.count is not None:
            team.count(b.name, [int(r.shape[0]) for r in rows])

        first = 0 if gate_up.shape[0] == b.count else team.owned(b.count).start  # a share's rows: its experts'

        def expert(e: int, x: torch.Tensor) -> torch.Tensor:
            gate, up = F.linear(x, gate_up[e - first]).chunk(2, dim=-1)
            return F.linear(b.act(gate) * up, down[e - first])

        outs = team.exchange(rows, expert)
        final = torch.zeros_like(hidden)
        for (tok, slot), y in zip(routes, outs, strict=True):
            final = final.index_add(0, tok, (y * weights[tok, slot, None]).to(final.dtype))
        self.env[b.outputs[0]] = final
