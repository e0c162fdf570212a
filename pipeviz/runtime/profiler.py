"""``profile()``: measure each layer's forward and backward time on a device.

The result is a value: attach it to a view of the graph (``graph.with_profile(prof)``) and ``pv.simulate`` and
``pv.balance(by="time")`` on that view (and on plans made from it) use measured times (``pipeviz.costs``).

Example:
    >>> prof = pv.profile(graph, device="cpu", microbatches=4)
    >>> prof.forward["layer1"], prof.backward["layer1"], prof.peak_memory
    >>> graph = graph.with_profile(prof)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree

from pipeviz._compat import positional_legacy
from pipeviz.capture.measured import CPU_ACTION_OVERHEAD, Profile
from pipeviz.graph.model import ModelGraph
from pipeviz.plan.pipe import check_batch_split

__all__ = ["CPU_ACTION_OVERHEAD", "Profile", "profile"]


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


# Seconds now, read after synchronising the device: a module attribute, so a test can make time a counter.
CLOCK: Callable[[], float] = time.perf_counter


@positional_legacy("device", "microbatches", "repeats", "warmup", "loss_fn", "threads", "busy_cores")
def profile(graph: ModelGraph, *, device: str = "cpu", microbatches: int = 1, repeats: int = 7,
            warmup: int = 2, loss_fn: Callable[..., torch.Tensor] | None = None, threads: int | None = None,
            busy_cores: bool = True) -> Profile:
    """Time every layer's forward and backward for one microbatch on ``device`` and calibrate ``graph``.

    A deep copy of the model runs ``warmup + repeats`` forward/backward passes on one microbatch of the
    example inputs; module hooks time each layer (on a GPU after synchronising, so the time is when the
    work ran). Medians are kept. Like pipeviz's workers, this process then keeps large freed CPU buffers
    for reuse (``pipeviz.adapter.malloc``), so the times match what a run sees.

    Args:
        graph: the traced graph (its layers are what gets timed).
        device: ``"cpu"`` or ``"cuda[:N]"``.
        microbatches: the example batch is cut into this many; one piece is timed.
        loss_fn: ``output -> scalar`` for the backward (default: sum of the output's float tensors).
        threads: CPU threads while timing; use what each rank of the run gets (``pv.launch`` gives each
            ``cpu_count // ranks``). Default: torch's current setting.
        busy_cores: on the CPU, keep the other cores busy with matrix products while timing, as the other
            ranks of a run do (they share caches and memory bandwidth, so an action takes longer than on an
            idle machine).

    Returns:
        The ``Profile``; ``graph.with_profile(prof)`` gives a view that ``simulate``/``balance`` calibrate with.
    """
    from pipeviz.adapter.malloc import keep_heap

    keep_heap()  # time what pipeviz's workers will do (they keep large buffers in the heap)
    dev = torch.device(device)
    check_batch_split(graph.batch_size, microbatches)
    args, kwargs = graph.capture.example_args, graph.example_kwargs
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    a, k = split_args_kwargs_into_chunks(args, kwargs, microbatches)
    mb_args, mb_kwargs = pytree.tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, (a[0], k[0]))
    model = graph.capture.fresh_copy().to(dev)
    sync = _sync(dev)

    def now() -> float:
        sync()
        return CLOCK()

    fwd: dict[str, list[float]] = {n: [] for n in graph.layer_names}
    bwd: dict[str, list[float]] = {n: [] for n in graph.layer_names}
    marks: dict[str, float] = {}
    grad_ready: dict[str, float] = {}  # when each layer's output gradient arrived: its backward starts
    handles = []

    def pre(name: str) -> Callable[..., None]:
        def hook(*_: object) -> None:
            marks[name] = now()
        return hook

    def post(name: str) -> Callable[..., None]:
        def hook(_mod: torch.nn.Module, _inp: tuple[object, ...], out: object) -> None:
            fwd[name].append(now() - marks.pop(name))
            tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                tensors[0].register_hook(lambda g: grad_ready.__setitem__(name, now()))
        return hook

    for name in graph.layer_names:
        mod = model.get_submodule(name)
        handles += [mod.register_forward_pre_hook(pre(name)), mod.register_forward_hook(post(name))]
    loss_of = loss_fn or _default_loss
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    saved_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    load = _Load(dev.type == "cpu" and busy_cores, torch.get_num_threads())
    try:
        total_f, loss_f, total_b = _passes(model, mb_args, mb_kwargs, loss_of, now, warmup, repeats, fwd, bwd,
                                           grad_ready, accumulate=microbatches > 1)
    finally:
        load.stop()
        torch.set_num_threads(saved_threads)
    for h in handles:
        h.remove()
    med_f = {n: statistics.median(v) if v else 0.0 for n, v in fwd.items()}
    med_b = {n: statistics.median(v) if v else 0.0 for n, v in bwd.items()}
    tf, tb = statistics.median(total_f), statistics.median(total_b)
    # The backward before the first layer's output gradient arrives: the loss's gradient and the ops
    # after the last layer. The last stage runs it.
    head_b = max(0.0, tb - sum(med_b.values()))
    prof = Profile(
        device=str(dev), microbatches=microbatches, forward=med_f, backward=med_b,
        glue_forward=max(0.0, tf - sum(med_f.values())), glue_backward=0.0,
        total_forward=tf, total_backward=tb, loss_forward=statistics.median(loss_f), loss_backward=head_b,
        overhead=CPU_ACTION_OVERHEAD if dev.type == "cpu" else 2e-5,
        peak_memory=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
    )
    return prof


class _Load:
    """Background threads multiplying matrices on the cores this process's threads leave free."""

    def __init__(self, on: bool, threads: int) -> None:
        import os
        import threading

        self._stop = threading.Event()
        n = max(0, (os.cpu_count() or 1) // max(1, threads) - 1) if on else 0
        self._threads = [threading.Thread(target=self._spin, daemon=True) for _ in range(n)]
        for t in self._threads:
            t.start()

    def _spin(self) -> None:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        while not self._stop.is_set():
            torch.mm(a, b)  # releases the GIL: a core's worth of load

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)


def _passes(model: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object],
            loss_of: Callable[..., torch.Tensor],
            now: Callable[[], float], warmup: int, repeats: int, fwd: dict[str, list[float]],
            bwd: dict[str, list[float]], grad_ready: dict[str, float],
            accumulate: bool) -> tuple[list[float], list[float], list[float]]:
    """Forward/backward passes; a layer's backward runs from its output gradient's arrival to the next
    (earlier) layer's, the first layer's until the backward ends (so ops between layers count too).

    With ``accumulate`` gradients are added into the existing ``.grad`` as in a pipelined step, where all
    microbatches but the first accumulate (every gradient is read and written once more); otherwise each
    pass allocates them anew.
    Returns the forward, loss and backward (loss gradient included) times.
    """
    total_f: list[float] = []
    total_l: list[float] = []
    total_b: list[float] = []
    for i in range(warmup + repeats):
        grad_ready.clear()
        t0 = now()
        out = model(*args, **kwargs)
        t1 = now()
        loss = loss_of(out)
        t_loss = now()
        loss.backward()
        t2 = now()
        if not accumulate:
            model.zero_grad(set_to_none=True)
        if i < warmup:  # warm-up passes are not kept
            for v in fwd.values():
                v.clear()
            continue
        total_f.append(t1 - t0)
        total_l.append(t_loss - t1)
        total_b.append(t2 - t_loss)
        starts = sorted(grad_ready.items(), key=lambda kv: kv[1])
        for (name, t), nxt in zip(starts, [*starts[1:], (None, t2)], strict=True):
            bwd[name].append(nxt[1] - t)
    return total_f, total_l, total_b


def _default_loss(out: object) -> torch.Tensor:
    from pipeviz.schedule.training import model_output

    out = model_output(out)
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.float().sum() for t in leaves)  # type: ignore[return-value]
