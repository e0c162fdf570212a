"""Measure the constants the ``"cpu"`` preset cannot probe quickly, and (``--write``) record them, with their
measurement, in ``pipeviz/cost/calibration.json`` (what ``pipeviz.cost.calibration`` reads):

- ``action_overhead``: the gap between one schedule action's end and the next on a CPU rank whose next input is
  already there (1F1B runs of a small MLP on 2 ranks, 8 microbatches);
- ``gloo``: gloo's all-reduce bus bandwidth as a share of a send's, two processes (4-32 MiB, medians of 10);
- ``contention``: an op's time while the other core runs the same, over its time alone (``cpu_contention.py``'s
  method: a weight-streaming matmul, seven alternations per repeat);
- ``cp_op``: what context parallelism's share of a sequence adds per op of a stage's forward (the stage graph run
  op by op, ``pipeviz.adapter.context_graph``): a small GPT-2 stage's forward on one share (cp 2) over half its
  plain forward, per op, in one process;
- ``cp_wait``: an exchange's wait beyond its link time when the processes outnumber the cores (pp 2 x cp 2, four
  processes): the median ``CP`` action of a small GPT-2's run less the link's all-gather or all-reduce time;
- ``tp_op``: what a tensor-parallel shard's forward and backward add per op of its stage (the stage graph run on
  DTensors, ``pipeviz.adapter.dtensor_graph``: DTensor's dispatch and sharding propagation per op): the Explorer's
  tiny GPT-2's first stage sharded over a one-process mesh (every op dispatched as in a run, no collective issued)
  less the plain stage, per op, forward and backward apart (``tp_op_backward``, recorded by the same run);
- ``tp_wait``: a tensor-parallel collective's wait beyond its link time when the processes outnumber the cores
  (pp 2 x tp 2, four processes): the median ``TP`` action of the Explorer's tiny GPT-2 less the median link time
  of the collectives the launch's layout issues.

    python benchmarks/calibration/cpu_constants.py [--only action_overhead,gloo,contention,cp_op,cp_wait,tp_op,tp_wait]
        [--write]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeviz.cost.calibration import PATH, entries

NAMES = {"action_overhead": "cpu_action_overhead", "gloo": "gloo_allreduce_efficiency",
         "contention": "cpu_contention", "cp_op": "cpu_cp_op_overhead", "cp_wait": "cpu_cp_exchange_wait",
         "tp_op": "cpu_tp_op_overhead", "tp_op_backward": "cpu_tp_backward_op_overhead",
         "tp_wait": "cpu_tp_collective_wait"}


def action_overhead(runs: int = 3) -> tuple[float, str]:
    """The median gap between consecutive actions of a rank whose next action's input had already arrived (its
    dependency, the previous stage's forward or the next stage's backward of the same microbatch, ended before the
    rank's previous action did), over 1F1B runs of a small MLP on 2 ranks, 8 microbatches, steps 1-2."""
    import torch.nn.functional as F

    import pipeviz as pv
    from pipeviz.zoo import MyNetwork

    torch.manual_seed(0)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    plan = pv.trace(MyNetwork(256, [256, 256]), example_args=(x,)).split(["layer0"])
    gaps: list[float] = []
    for _ in range(runs):
        run = pv.launch(plan, "1F1B", 8, steps=3, inputs=(x,), target=y, loss_fn=F.cross_entropy)
        assert run.wait(120) == "done", run.error
        for step in (1, 2):  # past the first step's warm-up
            done = {(e.stage, e.kind, e.mb): e.end for e in run.events if e.step == step and e.kind in "FB"}
            for rank in (0, 1):
                mine = sorted((e for e in run.events if e.rank == rank and e.step == step and e.kind in "FB"),
                              key=lambda e: e.start)
                for prev, nxt in itertools.pairwise(mine):
                    dep = (nxt.stage - 1, "F", nxt.mb) if nxt.kind == "F" else (nxt.stage + 1, "B", nxt.mb)
                    if done.get(dep, -1.0) <= prev.end:  # its input was there: the gap is the runtime's own
                        gaps.append(nxt.start - prev.end)
    value = statistics.median(gaps)
    return value, (f"median gap {value * 1e3:.2f} ms between a rank's actions whose input was there, 1F1B, 2 ranks "
                   f"({len(gaps)} gaps, {min(gaps) * 1e3:.2f}-{max(gaps) * 1e3:.2f} ms)")


def _gloo_work(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ratios = []
    try:
        for nbytes in (4 * 2**20, 13 * 2**20, 32 * 2**20):
            t = torch.ones(nbytes // 4)
            sends, reduces = [], []
            for _ in range(12):
                dist.barrier()
                start = time.perf_counter()
                if rank == 0:
                    dist.send(t, 1)
                    dist.recv(t, 1)
                else:
                    dist.recv(t, 0)
                    dist.send(t, 0)
                sends.append((time.perf_counter() - start) / 2)
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(t)
                reduces.append(time.perf_counter() - start)
            ratios.append(statistics.median(sends[2:]) / statistics.median(reduces[2:]))
        if rank == 0:
            Path(out).write_text(json.dumps(ratios))
    finally:
        dist.destroy_process_group()


def gloo() -> tuple[float, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ratios.json")
        mp.spawn(_gloo_work, args=(port, out), nprocs=2)
        ratios = json.loads(Path(out).read_text())
    value = statistics.median(ratios)
    return value, f"all-reduce / send bandwidth {', '.join(f'{r:.2f}' for r in ratios)} at 4, 13, 32 MiB"


def contention() -> tuple[float, str]:
    import subprocess

    here = Path(__file__).with_name("cpu_contention.py")
    res = subprocess.run([sys.executable, str(here), "--repeats", "4"], capture_output=True, text=True, check=True)
    medians = [float(line.split("median ")[1].split()[0]) for line in res.stdout.splitlines()
               if line.startswith("alone ")]
    if not medians:
        raise SystemExit("one core: no contention to measure here")
    value = statistics.median(medians)
    return value, f"medians of four repeats of seven alternations {min(medians):.3f}-{max(medians):.3f}"


def _small_gpt2(seq: int, width: int) -> tuple[object, torch.Tensor]:
    import pipeviz as pv
    from pipeviz.zoo import gpt2

    torch.manual_seed(0)
    model = gpt2(n_layer=2, n_embd=width, n_head=2, vocab_size=64, n_positions=seq)
    ids = torch.randint(0, 64, (4, seq))
    return pv.trace(model, example_args=(ids,)).split(["transformer.h.0"]), ids


def cp_op(repeats: int = 3) -> tuple[float, str]:
    """Per op, a stage's forward on one share of the sequence (cp 2, ``ContextGraph`` on the runtime's own stage
    graph, the exchange in shape only) less half its plain forward, with gradients on, one thread: a 2-layer GPT-2
    of width 32 at 16 tokens, whose ops' compute is small beside what running each op adds."""
    from pipeviz.adapter.context_graph import ContextGraph, Share
    from pipeviz.runtime.batches import seq_share
    from pipeviz.runtime.stages import build_stages

    torch.set_num_threads(1)
    plan, ids = _small_gpt2(16, 32)
    runner = build_stages(plan, 1, cp=2).runners[0]  # type: ignore[arg-type]
    graph = runner.stage
    (share,), _ = seq_share(((ids,), {}), 0, 2, 16)
    ctx = ContextGraph(graph, Share(16, 2, 0, dry=True), runner.traced_shapes)  # type: ignore[arg-type]
    ops = sum(1 for n in graph.graph.nodes if n.op == "call_function")

    def median(f: object, *args: object) -> float:
        xs = []
        for _ in range(300):
            start = time.perf_counter()
            f(*args)  # type: ignore[operator]
            xs.append(time.perf_counter() - start)
        return statistics.median(xs)

    per = []
    for _ in range(repeats):
        plain, shared = median(graph, ids), median(ctx, share)
        per.append((shared - plain / 2) / ops)
    value = statistics.median(per)
    return value, (f"a share's forward less half the plain one, per op ({ops} ops of a GPT-2 stage, width 32, 16 "
                   f"tokens, one thread): {', '.join(f'{p * 1e6:.1f}' for p in per)} us")


def cp_wait() -> tuple[float, str]:
    """The median ``CP`` action of a pp 2 x cp 2 run (4 processes) of a small GPT-2 (width 64, 64 tokens: a few
    KB an exchange) less the gloo link's time for it, steps 1-3."""
    import pipeviz as pv
    from pipeviz.cost.comm import all_reduce_time, backend_link, cp_exchange_bytes

    plan, ids = _small_gpt2(64, 64)
    run = pv.launch(plan, "1F1B", 4, steps=4, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy, cp=2)
    assert run.wait(300) == "done", run.error
    cps = [e.duration for e in run.events if e.kind == "CP" and e.step > 0]
    nbytes = max(max(xs) for xs in cp_exchange_bytes(plan)) / 4  # a microbatch's
    link = all_reduce_time(nbytes, 2, backend_link("cpu"))  # the backward's all-reduce, the longer of the two
    value = max(0.0, statistics.median(cps) - link)
    cores = len(os.sched_getaffinity(0))
    return value, (f"4 processes on {cores} cores: median CP action {statistics.median(cps) * 1e3:.2f} ms "
                   f"({len(cps)} actions, IQR {statistics.quantiles(cps, n=4)[0] * 1e3:.2f}-"
                   f"{statistics.quantiles(cps, n=4)[2] * 1e3:.2f} ms) less the link's {link * 1e6:.0f} us")


def _explorer_gpt2() -> tuple[object, torch.Tensor]:
    """The tiny GPT-2 of the README and docs/explorer.md (4 layers, width 128, vocabulary 512, 16 x 32 tokens)
    balanced into 2 stages, as the Explorer's users launch it."""
    import pipeviz as pv
    from pipeviz.zoo import gpt2

    torch.manual_seed(0)
    ids = torch.randint(0, 512, (16, 32))
    return pv.balance(pv.trace(gpt2(4, 128, 4, 512), example_args=(ids,)), 2), ids


def _stage_call(graph: object, inputs: list[torch.Tensor]) -> tuple[float, float]:
    """One forward and one backward (of its output's sum) of a stage graph: their seconds."""
    start = time.perf_counter()
    out = graph(*inputs)  # type: ignore[operator]
    mid = time.perf_counter()
    outs = [o for o in (out if isinstance(out, tuple | list) else (out,)) if getattr(o, "requires_grad", False)]
    total = sum((o.full_tensor() if hasattr(o, "full_tensor") else o).sum() for o in outs)
    back = time.perf_counter()
    total.backward()  # type: ignore[union-attr]
    return mid - start, time.perf_counter() - back


def _paired_difference(plain: object, sharded: object, inputs: list[torch.Tensor],
                       n: int = 60) -> tuple[float, float]:
    """Median over ``n`` pairs (after 5 warm-ups) of the sharded stage's forward and backward less the plain one's
    run just before it: a busy machine's slow seconds land on both of a pair."""
    fwd, bwd = [], []
    for i in range(n + 5):
        (pf, pb), (sf, sb) = _stage_call(plain, inputs), _stage_call(sharded, inputs)
        if i >= 5:
            fwd.append(sf - pf)
            bwd.append(sb - pb)
    return statistics.median(fwd), statistics.median(bwd)


def tp_op(repeats: int = 3) -> tuple[tuple[float, float], str]:
    """Per op of the stage (``pv.simulate`` counts the traced ops a stage holds), what running the Explorer's tiny
    GPT-2's first stage on DTensors adds to its forward and to its backward, one thread: the stage sharded as
    ``pv.launch(..., tp=2)`` shards it but over a one-process mesh (each op dispatched, its sharding propagated, no
    collective issued and the whole compute kept) less the plain stage run just before it (the median of 60 such
    pairs, three times), microbatch 4 x 32 tokens."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from pipeviz.runtime.settings import tensor_parallel_placements
    from pipeviz.runtime.stages import build_stages, rank_stages
    from pipeviz.schedule.tensor_parallel import shard_stage

    torch.set_num_threads(1)
    plan, ids = _explorer_gpt2()
    place = tensor_parallel_placements(plan, 2, None)  # type: ignore[arg-type]
    st = rank_stages(build_stages(plan, 4), (0, 1), 0)[0]  # type: ignore[arg-type]
    ops = sum(1 for op in plan.graph.capture.ops if plan._stage_of_op(op.index) == 0)  # type: ignore[attr-defined]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        plain, sharded = copy.deepcopy(st.runner.stage), copy.deepcopy(st.runner.stage)
        shard_stage(sharded, st.params, place, init_device_mesh("cpu", (1,)))
        fwd, bwd = [], []
        for _ in range(repeats):
            df, db = _paired_difference(plain, sharded, [ids[:4]])
            fwd.append(df / ops)
            bwd.append(db / ops)
    finally:
        dist.destroy_process_group()
    value = (statistics.median(fwd), statistics.median(bwd))
    return value, (f"the sharded stage (one-process mesh) less the plain one run just before it, median of 60 "
                   f"pairs, per op ({ops} traced ops of the "
                   f"Explorer's tiny GPT-2's first stage, microbatch 4 x 32, one thread), load "
                   f"{os.getloadavg()[0]:.1f}: forward {', '.join(f'{p * 1e6:.0f}' for p in fwd)} us, backward "
                   f"{', '.join(f'{p * 1e6:.0f}' for p in bwd)} us")


def tp_wait() -> tuple[float, str]:
    """The median ``TP`` action of a pp 2 x tp 2 run (4 processes) of the Explorer's tiny GPT-2, 1F1B, 4
    microbatches, steps 1-3, less the median gloo link time of the collectives the launch's layout issues."""
    import pipeviz as pv
    from pipeviz.cost.comm import all_reduce_time, backend_link
    from pipeviz.cost.sharding import launch_collectives
    from pipeviz.schedule.tensor_parallel import sharded_modules

    plan, ids = _explorer_gpt2()
    run = pv.launch(plan, "1F1B", 4, steps=4, inputs=(ids,), target=ids, loss_fn=pv.cross_entropy, tp=2)
    assert run.wait(600) == "done", run.error
    tps = [e.duration for e in run.events if e.kind == "TP" and e.step > 0]
    colls = [c for cs in launch_collectives(plan, sharded_modules(plan, None, 2)) for c in cs]  # type: ignore[arg-type]
    link = statistics.median(all_reduce_time(c.nbytes / 4, 2, backend_link("cpu")) * (
        1 if c.kind == "all_reduce" else 0.5) for c in colls)
    value = max(0.0, statistics.median(tps) - link)
    q = statistics.quantiles(tps, n=4)
    cores = len(os.sched_getaffinity(0))
    return value, (f"4 processes on {cores} cores, load {os.getloadavg()[0]:.1f}: median TP action "
                   f"{statistics.median(tps) * 1e3:.2f} ms ({len(tps)} actions, IQR {q[0] * 1e3:.2f}-"
                   f"{q[2] * 1e3:.2f} ms) less the link's {link * 1e6:.0f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    measured = [n for n in NAMES if n != "tp_op_backward"]  # (tp_op records it)
    ap.add_argument("--only", default=",".join(measured), help=f"comma-separated among {', '.join(measured)}")
    ap.add_argument("--write", action="store_true", help="record the values in pipeviz/cost/calibration.json")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    table = dict(entries())
    machine = f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores"
    for name in a.only.split(","):
        measure: dict[str, Callable[[], tuple[float | tuple[float, float], str]]] = {
            "action_overhead": action_overhead, "gloo": gloo, "contention": contention, "cp_op": cp_op,
            "cp_wait": cp_wait, "tp_op": tp_op, "tp_wait": tp_wait}
        found, how = measure[name]()
        # tp_op measures two constants in one run: the forward's per op, and the backward's
        values = dict(zip(("tp_op", "tp_op_backward"), found, strict=True)) if isinstance(found, tuple) else {
            name: found}
        for part, value in values.items():
            key = NAMES[part]
            old = table[key]["value"] if key in table else float("nan")
            print(f"{key}: {value:.4g} (recorded {old:.4g}): {how}")
            table[key] = {**table[key], "value": round(value, 4 if value > 0.01 else 6),
                          "measured": f"{datetime.date.today()}, {machine}: {how}"}
    if a.write:
        PATH.write_text(json.dumps(table, indent=2) + "\n")
        print(f"written: {PATH}")


if __name__ == "__main__":
    main()
