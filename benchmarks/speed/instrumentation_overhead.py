"""What pipeviz's runtime costs: the same plan and schedule through ``pv.launch`` and through a plain torch
schedule loop without pipeviz (torch's ``pipeline()`` + ``build_stage`` + the schedule), runs interleaved.

Two plain loops run: torch as shipped, and torch with the two speed fixes pipeviz's runtime applies (each
stage runs as one flat generated-code graph instead of through ``fx.Interpreter``, ``pipeviz.adapter.flatten_stage``;
each rank's threads on its own cores, ``pipeviz.runtime.devices.cpu_sets``). The second isolates what
pipeviz's instrumentation, relays and event streaming cost. Prints the median step
wall time of each, the ratios (goal <= 1.02), and launch -> first event (goal < 5 s on CPU).

    python benchmarks/speed/instrumentation_overhead.py [--rounds 6] [--steps 30] [--schedule 1F1B]
"""

from __future__ import annotations

import argparse
import itertools
import os
import queue
import statistics
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F

import pipeviz as pv
from pipeviz.zoo import MyNetwork

WIDTH, BATCH = 1024, 64


def _model() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return MyNetwork(WIDTH, [WIDTH] * 4), torch.randn(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))


def _plain_worker(rank: int, world: int, port: int, schedule: str, mb: int, steps: int, out: Any,
                  fixes: bool) -> None:
    """torch's own pipelining, no pipeviz: pipeline() + build_stage + schedule, timed per step."""
    import torch.distributed as dist
    from torch.distributed.pipelining import SplitPoint, pipeline
    from torch.distributed.pipelining.schedules import get_schedule_class

    warnings.filterwarnings("ignore")
    from pipeviz.adapter.malloc import keep_heap

    keep_heap()  # the same allocator setting pipeviz's workers use: this compares instrumentation only
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    if fixes:
        from pipeviz.runtime.devices import cpu_sets
        from pipeviz.runtime.worker import _pin

        cpus = cpu_sets(world, True)[1]
        if cpus:
            _pin(cpus[rank])
    model, x, y = _model()
    pipe = pipeline(model, mb_args=(x[: BATCH // mb],), split_spec={"layer1": SplitPoint.END})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    if fixes:
        from pipeviz.adapter import flatten_stage

        # Run the stage's forward as the flat generated code, but keep the module torch built: torch's stage
        # reads its shapes from that graph's node metadata (placeholders' and outputs' ``meta["val"]``), which
        # a swapped-in flat graph lacks (``KeyError: 'val'`` in ``_create_act_recv_info``). Same parameters.
        flat = flatten_stage(stage.submod, {})
        assert {id(p) for p in flat.parameters()} == {id(p) for p in stage.submod.parameters()}
        stage.submod.forward = flat.forward
    sched = get_schedule_class(schedule)(stage, n_microbatches=mb, loss_fn=F.cross_entropy)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=0.01)
    ends = []
    for _ in range(steps):
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        opt.step()
        opt.zero_grad()
        ends.append(time.time())
    out.put((rank, ends))
    dist.destroy_process_group()


def plain(schedule: str, mb: int, steps: int, fixes: bool = False) -> list[float]:
    import torch.multiprocessing as mp

    from pipeviz.runtime.procs import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_plain_worker, args=(r, 2, port, schedule, mb, steps, q, fixes)) for r in range(2)]
    for p in procs:
        p.start()
    ends: dict[int, list[float]] = {}
    deadline = time.monotonic() + 300
    while len(ends) < len(procs):  # a rank that dies fails the benchmark now, not after the timeout
        try:
            rank, rank_ends = q.get(timeout=1)
            ends[rank] = rank_ends
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                    p.join(10)
                raise RuntimeError(f"plain torch loop failed (exit codes {[p.exitcode for p in procs]}); "
                                   "see the ranks' tracebacks above") from None
    for p in procs:
        p.join(30)
    step_end = [max(ends[0][i], ends[1][i]) for i in range(steps)]
    return [b - a for a, b in itertools.pairwise(step_end)]


def with_pipeviz(schedule: str, mb: int, steps: int) -> tuple[list[float], float]:
    model, x, y = _model()
    plan = pv.trace(model, example_args=(x,)).split(["layer1"])
    run = pv.launch(plan, schedule=schedule, microbatches=mb, steps=steps, inputs=(x,), target=y,
                    loss_fn=F.cross_entropy, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
    assert run.wait(300) == "done", run.error
    return run.step_walltimes, run.first_event_at - run.started_at


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1F1B")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    base: list[float] = []
    fixed: list[float] = []
    ours: list[float] = []
    first: list[float] = []
    paired: list[float] = []
    paired_fixed: list[float] = []
    warm = 5  # leave out start-up steps
    for _ in range(a.rounds):  # interleaved, so machine noise hits all three alike
        b_round = plain(a.schedule, a.microbatches, a.steps)[warm:]
        f_round = plain(a.schedule, a.microbatches, a.steps, fixes=True)[warm:]
        steps, fe = with_pipeviz(a.schedule, a.microbatches, a.steps)
        o_round = steps[warm:]
        base += b_round
        fixed += f_round
        ours += o_round
        first.append(fe)
        paired.append(statistics.median(o_round) / statistics.median(b_round))
        paired_fixed.append(statistics.median(o_round) / statistics.median(f_round))
    b, f, o = statistics.median(base), statistics.median(fixed), statistics.median(ours)
    print(f"MyNetwork({WIDTH}, [{WIDTH}]*4), batch {BATCH}, 2 stages / 2 processes, {a.schedule}, "
          f"{a.microbatches} microbatches, {a.rounds} rounds x {a.steps} steps, interleaved")
    print(f"plain torch schedule loop, median step:          {b * 1e3:8.2f} ms")
    print(f"plain loop + pipeviz's fixes, median step:       {f * 1e3:8.2f} ms")
    print(f"pv.launch (instrumented), median step:           {o * 1e3:8.2f} ms")
    print(f"pipeviz / plain torch: pooled {o / b:.3f}; per round {', '.join(f'{r:.3f}' for r in paired)}; "
          f"median {statistics.median(paired):.3f}   (goal <= 1.02)")
    print(f"pipeviz / plain + same fixes (instrumentation alone): pooled {o / f:.3f}; per round "
          f"{', '.join(f'{r:.3f}' for r in paired_fixed)}; median {statistics.median(paired_fixed):.3f}"
          "   (goal <= 1.02)")
    print(f"launch -> first event, median:          {statistics.median(first):8.2f} s    (goal < 5 s)")


if __name__ == "__main__":
    main()
