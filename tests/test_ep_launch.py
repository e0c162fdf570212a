"""Expert parallelism at launch (``LaunchConfig(ep=N)``): each MoE block's routed experts shared out over ``ep`` of a
stage's replicas (share r computes experts [r·E/ep, (r+1)·E/ep)), tokens sent to their experts' processes and back
by all-to-all, exact against the unsplit model on ``pipeviz.zoo.MoENet`` (experts in an ``nn.ModuleList``, routing
by ``torch.where``), HF Qwen2-MoE and Mixtral (transformers 5.x's fused experts), with experts that receive no
token; its all-to-alls timed as ``A2A`` actions, the tokens per expert on ``run.expert_tokens``; refused naming ep
before any process starts where it cannot run."""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import pytest
import torch

import pipeviz as pv
from tests.foreign import routed_moe_net

_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def _model(kind: str, starve: bool = False) -> tuple[torch.nn.Module, int, str]:
    torch.manual_seed(0)
    if kind == "moenet":
        model = routed_moe_net()
        if starve:  # expert 3 of every block receives no token: its router logit -16 (the norm's output sums to 16)
            with torch.no_grad():
                for block in model.blocks:  # type: ignore[union-attr]
                    block.norm.bias.fill_(1.0)
                    block.router.weight[3].fill_(-1.0)
        return model, 32, "blocks"
    from tests.compat import ROWS

    row = next(r for r in ROWS if r.name == kind)
    return row.build(), 96, "model.layers"


def _plan(kind: str, schedule: str, ids: torch.Tensor, starve: bool = False) -> pv.SplitPlan:
    model, _, blocks = _model(kind, starve)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = pv.trace(model, example_args=(ids[:2],))
    one = schedule in ("GPipe", "1F1B")
    return graph.split([f"{blocks}.1"] if one else [f"{blocks}.{i}" for i in range(3)])


def _train(kind: str, schedule: str, steps: int = 2, **launch: Any) -> pv.Run:
    vocab = 32 if kind == "moenet" else 96
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (8, 6))
    run = pv.launch(_plan(kind, schedule, ids), schedule, 4, steps=steps, inputs=(ids,), target=ids,
                    loss_fn=pv.cross_entropy, optimizer=pv.sgd(lr=0.1), dp=2, ep=2, **launch)
    assert run.wait(300) == "done", f"{kind} {schedule}: {run.error}"
    check = pv.check_numerics(run)
    assert check.ok and check.loss_diff <= 1e-6 and check.param_diff <= 1e-6, f"{kind} {schedule}: {check}"
    return run


_RUNS: dict[tuple[str, str, int], pv.Run] = {}


def _train_once(kind: str, schedule: str, steps: int = 2) -> pv.Run:
    """One finished (and checked) run per model, schedule and steps, read by every test that asks for it: each
    launch is 4 processes, and the tests read a finished run without changing it."""
    key = (kind, schedule, steps)
    if key not in _RUNS:
        _RUNS[key] = _train(kind, schedule, steps=steps)
    return _RUNS[key]


@pytest.mark.slow
def test_moenet_pp2_dp2_ep2_under_1f1b_is_exact_with_a2a_actions_and_tokens_per_expert() -> None:
    run = _train_once("moenet", "1F1B", steps=1)
    kinds = Counter(e.kind for e in run.events)
    # each of 4 processes (one stage each), per block of its stage (2), per microbatch (4): the forward's dispatch
    # and combine, the backward's two reversed
    assert kinds["A2A"] == 4 * 2 * 4 * (2 + 2), kinds
    a2a = [e for e in run.events if e.kind == "A2A"]
    assert {e.mb for e in a2a} == {0, 1, 2, 3} and all(e.end >= e.start for e in a2a)
    loads = run.expert_tokens
    # every replica's forward of every block and microbatch: 4 blocks x 4 microbatches x 2 replicas
    assert len(loads) == 4 * 4 * 2
    assert {ld.block for ld in loads} == {f"blocks.{i}.experts" for i in range(4)}
    rows_per_mb = 8 // 2 // 4 * 6  # tokens of one microbatch on one replica
    assert all(sum(ld.counts) == 2 * rows_per_mb and len(ld.counts) == 4 for ld in loads)  # top-2 routing
    assert any(0 in ld.counts for ld in loads)  # an expert that receives no token in some microbatch


# MoENet and Qwen2-MoE under all seven schedules, Mixtral (the same fused experts as Qwen2-MoE's in transformers 5)
# under a flat and a V-shaped one: the rest of Mixtral's row (exact too, measured 2026-12-06) would add 2 minutes to
# CI's `make compat`.
_CASES = [(kind, s) for kind in ("moenet", "Qwen2-MoE") for s in _SCHEDULES] + \
    [("Mixtral", "1F1B"), ("Mixtral", "DualPipeV")]


@pytest.mark.compat
@pytest.mark.slow
@pytest.mark.parametrize(("kind", "schedule"), _CASES)
def test_every_schedule_trains_exactly_with_experts_sharded(kind: str, schedule: str) -> None:
    if kind != "moenet":
        pytest.importorskip("transformers")
    run = _train(kind, schedule)
    assert Counter(e.kind for e in run.events)["A2A"] > 0 and run.expert_tokens


def _refused(plan: pv.SplitPlan, ids: torch.Tensor, match: str, **launch: Any) -> pv.LaunchError:
    with pytest.raises(pv.LaunchError, match=match) as err:
        pv.launch(plan, "1F1B", 4, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy, **launch)
    assert err.value.setting == "ep", err.value
    assert "ep=" in str(err.value) and "Fix:" in str(err.value)
    return err.value


@pytest.fixture(scope="module")
def moe_plan() -> tuple[pv.SplitPlan, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(0, 32, (12, 6))
    return _plan("moenet", "1F1B", ids), ids


def test_ep_not_dividing_dp_or_the_experts_is_refused(moe_plan: tuple[pv.SplitPlan, torch.Tensor]) -> None:
    plan, ids = moe_plan
    _refused(plan, ids, r"ep=2 does not divide dp × cp = 1 × 1 = 1.*Valid ep: 1", ep=2)
    _refused(plan, ids, r"ep=3 does not divide the 4 routed experts of blocks.0.experts.*Valid ep: 1", dp=3, ep=3)


@pytest.mark.parametrize(("option", "words"), [
    ({"tp": 2}, "tp=2"), ({"cp": 2}, "cp=2"), ({"dp_shard": True}, "dp_shard=True"),
    ({"mixed_precision": "bf16"}, "mixed_precision='bf16'"), ({"compile": True}, "compile=True"),
    ({"recompute": "full"}, "recompute='full'"), ({"dp_reduce": "zero1"}, "dp_reduce='zero1'"),
])
def test_settings_ep_does_not_run_with_are_refused_naming_both(moe_plan: tuple[pv.SplitPlan, torch.Tensor],
                                                                option: dict[str, Any], words: str) -> None:
    plan, ids = moe_plan
    dp = 4 if "cp" in option else 2
    exc = _refused(plan, ids, "ep=2 with ", dp=dp, ep=2, **option)
    assert words in str(exc)


def test_a_model_without_routed_experts_is_refused_naming_ep() -> None:
    model = pv.zoo.MyNetwork(8, [8, 8, 8, 8], 4)
    x = torch.randn(8, 8)
    plan = pv.trace(model, example_args=(x,)).split(["layer1"])
    with pytest.raises(pv.LaunchError, match="ep=2: the model has no routed experts") as err:
        pv.launch(plan, "1F1B", 2, inputs=(x,), target=torch.randint(0, 4, (8,)), loss_fn=pv.cross_entropy, dp=2,
                  ep=2)
    assert err.value.setting == "ep"


def _as_traced(kind: str, plan: pv.SplitPlan, ids: torch.Tensor) -> None:
    # One process playing every share (no exchange): the blocks found, the reordered graph's output and gradients
    # as the traced graph's (MoENet bit for bit; transformers 5.x's fused experts as their eager loop, to rounding)
    from pipeviz.adapter.expert_graph import ExpertGraph, Team, find_blocks
    from pipeviz.runtime.stages import build_stages

    stages = build_stages(plan, 1)  # (one microbatch of the traced two rows)
    stage = stages.runners[1].stage
    blocks = find_blocks(stage)  # type: ignore[arg-type]
    assert [(b.count, b.fused) for b in blocks] == [(4, kind != "moenet")] * 2
    inputs = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in stages.runners[0](ids))  # type: ignore[union-attr]
    team = Team(ep=2, rank=0, dry=True, count=lambda block, counts: seen.append((block, counts)))
    seen: list[tuple[str, list[int]]] = []
    want, got = stage(*inputs), ExpertGraph(stage, blocks, team)(*inputs)  # type: ignore[arg-type, operator]
    want, got = (w[0] if isinstance(w, tuple | list) else w for w in (want, got))
    params = [p for p in stage.parameters() if p.requires_grad]
    grads = [torch.autograd.grad(t.sum(), params, allow_unused=True) for t in (want, got)]
    tol = 0.0 if kind == "moenet" else 1e-5
    assert torch.allclose(want, got, rtol=0, atol=tol)
    for a, b in zip(*grads, strict=True):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, rtol=1e-5, atol=tol))
    assert [b for b, _ in seen] == [b.name for b in blocks] and all(sum(c) == 2 * 6 * 2 for _, c in seen)  # top-2


def test_the_expert_graph_computes_a_stage_as_traced(moe_plan: tuple[pv.SplitPlan, torch.Tensor]) -> None:
    plan, ids = moe_plan
    _as_traced("moenet", plan, ids[:2])


@pytest.mark.compat
def test_the_expert_graph_computes_fused_hf_experts_as_their_eager_loop() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 6))
    _as_traced("Qwen2-MoE", _plan("Qwen2-MoE", "1F1B", ids), ids)


@pytest.mark.compat
@pytest.mark.slow
def test_an_exported_torchrun_script_shares_the_experts_out_too(tmp_path: Any) -> None:
    # pp 2 x dp 2 x ep 2 under torchrun: the exported ranks build their payloads (and expert groups) as pv.launch's
    import subprocess
    import sys

    from pipeviz.runtime.procs import free_port

    torch.manual_seed(1)
    ids = torch.randint(0, 32, (8, 6))
    plan = _plan("moenet", "1F1B", ids)
    cfg = pv.LaunchConfig(schedule="1F1B", microbatches=4, steps=2, loss_fn=pv.cross_entropy, dp=2, ep=2)
    script = pv.export_torchrun(plan, tmp_path / "ep.py", config=cfg, inputs=(ids,), target=ids)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()), str(script)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    watched = pv.watch(tmp_path / "ep_events", timeout=30)
    assert watched.wait(30) == "done", watched.error
    run = pv.launch(plan, config=cfg, inputs=(ids,), target=ids)
    assert run.wait(120) == "done", run.error
    assert watched.losses == pytest.approx(run.losses, abs=1e-6)
    assert any(e.kind == "A2A" for e in watched.events) and len(watched.expert_tokens) == len(run.expert_tokens)
    # each exported process held its share of the experts; the state it wrote holds every expert whole
    state: dict[str, torch.Tensor] = {}
    for path in watched.state_files:
        state.update(torch.load(path, weights_only=True))
    want = run.state_dict()
    experts = [n for n in want if ".experts." in n]
    assert experts and all(torch.allclose(state[n], want[n], atol=1e-6) for n in experts)


# ------------------------------------------------------------------- each process holds only its own experts
def _held_bytes(run: pv.Run, kind: str, ep: int) -> dict[int, int]:
    """Per process rank, the bytes of the parameters it should hold: its stage's, less the routed experts of the
    other ep shares (share r = dp mod ep holds experts [r·E/ep, (r+1)·E/ep) of every block)."""
    model, _, _ = _model(kind)
    mesh = pv.Mesh(pp=run.layout.num_ranks, dp=2, ep=ep)
    out = {}
    for rank in run.memory:
        me = mesh.coords(rank)
        layers = [n for s in run.layout.stages_of(me.pp) for n in run.plan.stages[s].layers]  # (V: two stages)
        total = 0
        for name, t in model.named_parameters():
            if not any(name == n or name.startswith(n + ".") for n in layers):
                continue
            share = range(me.dp % ep * 4 // ep, (me.dp % ep + 1) * 4 // ep)  # (4 experts per block here)
            if ".experts." in name and name.split(".experts.")[1].split(".")[0].isdigit():  # an nn.ModuleList's
                total += t.numel() * t.element_size() * (int(name.split(".experts.")[1].split(".")[0]) in share)
            elif name.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # fused: this share's rows
                total += t.numel() * t.element_size() * len(share) // 4
            else:
                total += t.numel() * t.element_size()
        out[rank] = total
    return out


def _static(run: pv.Run) -> dict[int, list[int]]:
    """Per process rank, the parameter, gradient and optimizer bytes it held at each memory sample (on the CPU:
    the total less the tensors saved for backward)."""
    return {r: [m - a for (_, m), (_, a) in zip(run.memory[r], run.activation_memory[r], strict=True)]
            for r in run.memory}


@pytest.mark.slow
def test_each_process_holds_only_its_own_experts() -> None:
    # the 1F1B run above (SGD, one step): before the first gradients, a process holds its stage's parameters less
    # the other share's experts, half of each block's 4 (measured, not assumed: the memory meter counts them)
    run = _train_once("moenet", "1F1B", steps=1)
    want, got = _held_bytes(run, "moenet", ep=2), _static(run)
    assert {r: min(v) for r, v in got.items()} == want
    unsplit = _held_bytes(run, "moenet", ep=1)
    assert all(want[r] < unsplit[r] for r in want)  # (the experts are most of MoENet's blocks)
    # each process's ready line says so: 2 blocks x 4 experts x 1,072 elements (16 -> 32 -> 16, biases) per stage
    ready = [text for _, text in run.phases if "ready" in text]
    assert sum("experts 2-3 of every block's 4, share 1 of ep=2: 4,288 of 8,576 routed-expert elements held" in t
               for t in ready) == 2, ready


def test_a_stage_cut_to_its_share_keeps_its_experts_alone(moe_plan: tuple[pv.SplitPlan, torch.Tensor]) -> None:
    # in one process: share 1 of 2 keeps experts 2 and 3 of each block whole, the others empty and frozen, the
    # router and the rest untouched; a checkpoint's whole tensors cut to what each parameter holds
    from pipeviz.adapter.expert_graph import find_blocks
    from pipeviz.runtime.expert_shards import Share, expert_params, held_part, shard_experts
    from pipeviz.runtime.stages import build_stages

    plan, _ = moe_plan
    stages = build_stages(plan, 1)
    stage = stages.runners[1].stage
    before = {n: t.numel() for n, t in stage.named_parameters()}
    dropped = shard_experts(stage, stages.params[1], find_blocks(stage), Share(ep=2, rank=1))  # type: ignore[arg-type]
    after = dict(stage.named_parameters())
    for name, t in after.items():
        expert = name.split(".experts.")[1].split(".")[0] if ".experts." in name else None
        assert t.numel() == (0 if expert in ("0", "1") else before[name]), name
        assert t.requires_grad == (expert not in ("0", "1")), name
    assert dropped == sum(n for name, n in before.items() if ".experts.0." in name or ".experts.1." in name) > 0
    rest, experts = expert_params(after.values())
    assert {n for n, t in after.items() if any(t is x for x in experts)} == {n for n in after if ".experts.2." in n
                                                                             or ".experts.3." in n}
    assert len(rest) + len(experts) + 2 * 4 * 2 == len(after)  # (2 blocks x 2 experts x 4 tensors left out)
    whole = torch.ones(3)
    assert held_part(whole, after["blocks.2.experts.0.w1.bias"]) is None
    assert held_part(whole, after["blocks.2.experts.2.w1.bias"]) is whole
    assert held_part(whole, after["blocks.2.router.weight"]) is whole
    assert shard_experts(stage, stages.params[1], find_blocks(stage), Share(ep=2, rank=1)) == 0  # cut once


def _adamw(ps: Any) -> torch.optim.Optimizer:
    # (lr 1e-3: Adam's step is about lr whatever the gradient, so the rounding of a near-zero expert gradient moves
    # a weight by up to lr; 1e-2 measured 1.9e-5 against the unsplit model already at ep=1)
    return torch.optim.AdamW(ps, lr=1e-3)


@pytest.mark.compat
@pytest.mark.slow
@pytest.mark.parametrize(("kind", "schedule", "then"), [
    ("moenet", "1F1B", "ZBVZeroBubble"), ("moenet", "ZBVZeroBubble", "1F1B"),
    ("Qwen2-MoE", "1F1B", "ZBVZeroBubble"), ("Qwen2-MoE", "ZBVZeroBubble", "1F1B"),
])
def test_adamw_with_experts_sharded_is_exact_holds_its_share_and_resumes(kind: str, schedule: str, then: str,
                                                                        tmp_path: Any) -> None:
    """AdamW under 1F1B and a zero-bubble schedule: exact; each process holds its experts' weights, gradients and
    two Adam states alone (4 x its parameters' bytes after a step); the checkpoint holds every expert's optimizer
    state as the unsplit model's AdamW has it; resumed under the other schedule (another split), exact again."""
    if kind != "moenet":
        pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from pipeviz.runtime.reference import train_reference

    vocab = 32 if kind == "moenet" else 96
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (8, 6))
    kw: dict[str, Any] = {"inputs": (ids,), "target": ids, "loss_fn": pv.cross_entropy, "optimizer": _adamw,
                          "dp": 2, "ep": 2}
    first = pv.launch(_plan(kind, schedule, ids, starve=True), schedule, 4, steps=2, **kw)
    assert first.wait(300) == "done", first.error
    assert pv.check_numerics(first).ok, pv.check_numerics(first)
    loads = Counter()  # tokens per (step, block, mb, expert), both replicas of the group summed
    for ld in first.expert_tokens:
        for e, c in enumerate(ld.counts):
            loads[(ld.step, ld.block, ld.mb, e)] += c
    if kind == "moenet":  # expert 3 of every block receives no token: its owner runs it on no rows
        assert {e for (_, _, _, e), n in loads.items() if n == 0} == {3}
    held = _held_bytes(first, kind, ep=2)
    assert {r: max(v) for r, v in _static(first).items()} == {r: 4 * b for r, b in held.items()}
    first.save(tmp_path)
    saved = load_file(str(tmp_path / "optimizer.safetensors"))
    made: list[torch.optim.Optimizer] = []
    model, _, _ = _model(kind, starve=True)
    graph = first.plan.graph
    train_reference(model, (ids,), ids, loss_fn=pv.cross_entropy, optimizer=lambda ps: made.append(_adamw(ps)) or
                    made[-1], microbatches=8, steps=2, fixups=graph.capture.fixups, replicas=2)
    names = [n for n, _ in model.named_parameters()]  # (train_reference steps a copy: the same order)
    ref = made[0].param_groups[0]["params"]
    assert len(ref) == len(names)
    experts = 0
    for name, t in zip(names, ref, strict=True):
        for what in ("exp_avg", "exp_avg_sq"):
            want = made[0].state[t][what]
            assert torch.allclose(saved[f"{name}::{what}"], want, rtol=1e-4, atol=1e-7), (name, what)
        experts += ".experts" in name
    assert experts
    second = pv.launch(_plan(kind, then, ids, starve=True), then, 4, steps=2, resume=tmp_path, **kw)
    assert second.wait(300) == "done", second.error
    check = pv.check_numerics(second)
    assert check.ok, check


@pytest.mark.compat
@pytest.mark.slow
@pytest.mark.parametrize(("kind", "schedule", "reduce"), [("moenet", "1F1B", "after_flush"),
                                                          ("Qwen2-MoE", "ZBVZeroBubble", "overlap")])
def test_dp4_ep2_reduces_experts_over_the_processes_holding_them(kind: str, schedule: str, reduce: str) -> None:
    """dp 4 x ep 2: two processes hold each share of the experts, their gradients summed over those two and divided
    by the 4 replicas (after the step, or overlapped with the backward), the global norm clipped counting each
    expert once: exact, AdamW."""
    if kind != "moenet":
        pytest.importorskip("transformers")
    vocab = 32 if kind == "moenet" else 96
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (16, 6))
    run = pv.launch(_plan(kind, schedule, ids, starve=True), schedule, 4, steps=2, inputs=(ids,), target=ids,
                    loss_fn=pv.cross_entropy, optimizer=_adamw, dp=4, ep=2, dp_reduce=reduce, clip_grad_norm=0.05)
    assert run.wait(600) == "done", run.error
    check = pv.check_numerics(run)
    assert check.ok, check
    assert min(run.grad_norms) > 0.05  # (clipped: the norm's count matters)


@pytest.mark.compat
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["moenet", "Qwen2-MoE"])
def test_a_batch_of_another_shape_binds_the_same_expert_shares(kind: str) -> None:
    """A data= batch of a new length: its stages (traced again) bound to the tensors this process holds, already
    cut to its share (a fused block's count read from the whole, not the rows held): exact."""
    if kind != "moenet":
        pytest.importorskip("transformers")
    vocab = 32 if kind == "moenet" else 96
    torch.manual_seed(1)
    a, b = torch.randint(0, vocab, (8, 6)), torch.randint(0, vocab, (8, 4))
    run = pv.launch(_plan(kind, "1F1B", a), "1F1B", 4, steps=3, data=iter([(a, a), (b, b), (a, a)]),
                    loss_fn=pv.cross_entropy, optimizer=_adamw, dp=2, ep=2)
    assert run.wait(300) == "done", run.error
    check = pv.check_numerics(run)
    assert check.ok, check
