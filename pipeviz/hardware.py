"""``Hardware``: what a device can do, for costs on machines a notebook never ran on.

One table of named presets (``HARDWARE``), each figure with the datasheet it comes from, plus ``"cpu"``: this
machine, from a short measurement. The cost model (``pipeviz.costs``) turns a layer's ops into seconds on a
``Hardware`` with a roofline per op (``op_time``): ``max(flops / (peak[dtype] x efficiency), bytes /
memory_bandwidth)``.

``op_table`` reads what a capture recorded per op (FLOPs, the bytes it reads and writes, the weights it reads,
attention-score ops) and ``layer_roofline`` sums the roofline over each layer's ops.

``efficiency`` is the one calibration constant per GPU type: the fraction of the datasheet's dense peak a
well-shaped matmul reaches in practice (large training runs report 35-55 % model FLOPs utilisation on
A100/H100, Megatron-LM and torchtitan alike). Change it with ``hw.with_efficiency(0.45)`` or
``dataclasses.replace(hw, efficiency=0.45)``.

Example:
    >>> hw = pv.hardware("H100")                 # case-insensitive; pv.HARDWARE lists the presets
    >>> hw.peak("bfloat16") / 1e12
    989.5
    >>> pv.simulate(plan, "1F1B", 8, hardware=hw.with_efficiency(0.45), dtype="bfloat16")
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeviz.capture import Capture
    from pipeviz.graph import ModelGraph

__all__ = ["DTYPES", "DTYPE_BYTES", "HARDWARE", "ROOFLINES", "Hardware", "HardwareError", "OpTable",
           "forget_kernel_times", "hardware", "layer_roofline", "loss_kernel_times", "matmul_efficiency",
           "measure_cpu", "op_table", "op_time"]


DTYPES = ("float32", "tf32", "bfloat16", "float16", "fp8")
ROOFLINES = ("additive", "max", "kernels")
DTYPE_BYTES = {"float32": 4, "tf32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
                  "float8": "fp8", "float8_e4m3fn": "fp8"}


def dtype_name(dtype: object, what: str = "dtype") -> str:
    """The canonical name of a dtype given as a name, an alias (``"bf16"``) or a ``torch.dtype``, one of
    ``DTYPE_BYTES``; a ``ValueError`` naming ``what`` and the valid ones otherwise."""
    name = str(dtype).lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"Unknown {what} {dtype!r}; valid: {', '.join(DTYPE_BYTES)}.")
    return name


class HardwareError(ValueError):
    """An unknown hardware name or dtype; the message lists the valid ones."""


@dataclass(frozen=True)
class Hardware:
    """One kind of accelerator and the links between its devices.

    Example:
        >>> h100 = pv.hardware("h100-sxm")
        >>> h100.rate("bfloat16")                 # achieved matmul FLOP/s: peak x efficiency
        >>> slower = h100.with_efficiency(0.4)

    Attributes:
        name: the preset's name.
        flops: dtype name -> dense peak FLOP/s of one device (keys among ``DTYPES``).
        memory_bytes: device memory (datasheet figure; a little of it is the runtime's).
        memory_bandwidth: device memory bytes/s (what elementwise ops are bound by).
        devices_per_node: devices that share the fast intra-node link.
        intra_node: ``(bandwidth bytes/s per device per direction, latency s)`` within a node (NVLink).
        inter_node: ``(bandwidth bytes/s per device, latency s)`` between nodes (InfiniBand).
        efficiency: achieved fraction of peak for matmuls (the calibration constant): the ceiling a large
            matmul approaches; a smaller one reaches less (``roofline``, ``matmul_efficiency``).
        collective_efficiency: achieved fraction of link bandwidth in collectives and hand-offs.
        roofline: how an op's math and memory traffic combine (``op_time``): ``"additive"`` (GPU presets: a
            matmul's efficiency rises with its arithmetic intensity) or ``"max"`` (the plain roofline); or
            ``"kernels"`` (``"cpu"``: each op timed on this machine at its shapes, ``pipeviz.kernels``, the plain
            roofline where an op cannot be replayed).
        fused: the run's element-wise chains are fused kernels (Megatron-LM's fused kernels, torch.compile):
            an intermediate that only the next element-wise op reads costs no memory traffic. Default False
            (eager PyTorch: one kernel per op).
        allreduce_efficiency: an all-reduce's achieved share of what ``link`` gives a hand-off: 1 for the GPU
            presets (NCCL: ``collective_efficiency`` covers both), 0.55 for ``"cpu"`` (gloo between two processes
            here: a 13 MiB all-reduce takes 23 ms where a send of it takes 13, ``benchmarks/gloo_links.py``).
        action_overhead: fixed seconds per pipeline action around its ops (posting sends and receives, the
            stage's bookkeeping, event timing): 0 for the GPU presets (hidden behind queued kernels), for
            ``"cpu"`` the gap measured between a rank's actions (``pipeviz.profile.CPU_ACTION_OVERHEAD``).
        contention: how much longer an op runs while another rank computes at the same moment: 1 for the GPU
            presets (each rank its own device), 1.10 for ``"cpu"`` (ranks pinned to cores of one processor
            still share its cache and memory bandwidth: ``benchmarks/cpu_contention.py``). ``pv.simulate``
            stretches each rank's ops by ``1 + (contention - 1) x`` the share of their time another rank computes.
    """

    name: str
    flops: Mapping[str, float]
    memory_bytes: int
    memory_bandwidth: float
    devices_per_node: int
    intra_node: tuple[float, float]
    inter_node: tuple[float, float]
    efficiency: float = 0.55
    collective_efficiency: float = 0.8
    roofline: str = "additive"
    fused: bool = False
    action_overhead: float = 0.0
    allreduce_efficiency: float = 1.0
    contention: float = 1.0

    def __post_init__(self) -> None:
        if self.roofline not in ROOFLINES:
            raise HardwareError(f"Unknown roofline={self.roofline!r}; valid: {', '.join(ROOFLINES)}. Fix: "
                                "roofline='additive' (math + memory traffic) or 'max' (the slower of the two).")
        unknown = [k for k in self.flops if k not in DTYPES]
        if unknown:
            raise HardwareError(f"Hardware {self.name!r}: unknown dtype(s) {unknown} in flops; valid: "
                                f"{', '.join(DTYPES)}.")
        for label, value in (("efficiency", self.efficiency), ("collective_efficiency", self.collective_efficiency),
                             ("allreduce_efficiency", self.allreduce_efficiency)):
            if not 0 < value <= 1:
                raise HardwareError(f"{label} must be in (0, 1], got {value!r}. Fix: e.g. {label}=0.5.")
        if not 1 <= self.contention <= 4:
            raise HardwareError(f"contention must be in [1, 4] (1: ranks never slow each other), got "
                                f"{self.contention!r}. Fix: e.g. contention=1.1.")
        # An immutable copy, so the frozen dataclass stays hashable (costs are cached per Hardware).
        object.__setattr__(self, "flops", MappingProxyType(dict(self.flops)))

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.flops.items())), self.memory_bytes, self.memory_bandwidth,
                     self.devices_per_node, self.intra_node, self.inter_node, self.efficiency,
                     self.collective_efficiency, self.roofline, self.fused, self.action_overhead,
                     self.allreduce_efficiency, self.contention))

    def dtype(self, dtype: str | None = None) -> str:
        """The canonical dtype name (``"bf16"`` -> ``"bfloat16"``); ``None``: bfloat16 where the device computes it
        at least as fast as float32 (every GPU preset), else float32 (a CPU without bfloat16 units).

        Raises:
            HardwareError: a dtype this hardware has no figure for (the message lists the ones it has).
        """
        if dtype is None:
            fast = self.flops.get("bfloat16", 0.0) >= self.flops.get("float32", 0.0)
            return "bfloat16" if fast and "bfloat16" in self.flops else "float32"
        name = str(dtype).lower().removeprefix("torch.")
        name = _DTYPE_ALIASES.get(name, name)
        if name not in self.flops:
            raise HardwareError(f"Hardware {self.name!r} has no peak for dtype {dtype!r}; valid: "
                                f"{', '.join(self.flops)}. Fix: dtype='{self.dtype(None)}'.")
        return name

    def peak(self, dtype: str | None = None) -> float:
        """Dense peak FLOP/s of one device in ``dtype`` (datasheet)."""
        return self.flops[self.dtype(dtype)]

    def rate(self, dtype: str | None = None) -> float:
        """Achieved matmul FLOP/s: ``peak(dtype) x efficiency``."""
        return self.peak(dtype) * self.efficiency

    def with_efficiency(self, efficiency: float) -> Hardware:
        """This hardware with another calibration constant (``dataclasses.replace`` does the same)."""
        return replace(self, efficiency=efficiency)

    def link(self, span: int, rails: int = 1, allreduce: bool = False) -> tuple[float, float]:
        """``(bandwidth, latency)`` of a link between devices ``span`` ranks apart or a group spanning ``span``
        consecutive ranks: intra-node when it fits in one node, else inter-node; bandwidth x
        ``collective_efficiency`` (x ``allreduce_efficiency`` for an all-reduce's ``allreduce=True``).

        ``rails``: the group's devices in each node when it spans nodes. Each device has its own NIC (DGX A100 /
        H100: one InfiniBand NIC per GPU), and NCCL runs one ring (a "channel") per NIC, so a ring collective
        over nodes moves ``rails`` NICs' worth of bytes at once: nccl-tests' all-reduce bus bandwidth between
        DGX A100 nodes is about 8 x 25 GB/s, not one NIC's 25 GB/s. Capped at the intra-node link. A group with
        one device per node (the replicas of a tensor-parallel layout that fills the node) gets one NIC.

        Example:
            >>> pv.hardware("a100").link(32, rails=8)[0] / 1e9     # 32 GPUs, 8 per node: 8 NICs, 160 GB/s
            160.0
        """
        if span <= self.devices_per_node:
            bw, lat = self.intra_node
        else:
            rails = max(1, min(int(rails), self.devices_per_node))
            bw, lat = min(self.inter_node[0] * rails, self.intra_node[0]), self.inter_node[1]
        return bw * self.collective_efficiency * (self.allreduce_efficiency if allreduce else 1.0), lat


# Datasheet figures. Dense (no 2:4 sparsity) tensor-core peaks per GPU; torchtitan's get_peak_flops keeps the
# same BF16 numbers (A100 312e12, H100 SXM 989e12, H200 989e12, B200 2.25e15).
# Links: NVLink bandwidth per direction (the datasheets quote both directions together); between nodes one
# InfiniBand NIC per GPU as in NVIDIA's DGX systems. Latencies are typical NCCL figures, not datasheet ones.
_GB = 1e9
_PRESETS: dict[str, Hardware] = {
    # NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), A100 80GB SXM:
    # FP32 19.5 TF, TF32 156 TF, BF16/FP16 312 TF, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s (both ways).
    # DGX A100 user guide: 8 GPUs, 8x 200 Gb/s HDR InfiniBand (25 GB/s per GPU).
    "a100-80gb": Hardware("a100-80gb", {"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12},
                          80 * 10**9, 2039 * _GB, 8, (300 * _GB, 5e-6), (25 * _GB, 1e-5)),
    # NVIDIA H100 Tensor Core GPU datasheet (resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet),
    # H100 SXM: FP32 67 TF, TF32 494.5 TF, BF16/FP16 989.5 TF, FP8 1,979 TF (halves of the sparsity figures),
    # 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s (both ways). DGX H100: 8x 400 Gb/s NDR InfiniBand (50 GB/s per GPU).
    "h100-sxm": Hardware("h100-sxm", {"float32": 67e12, "tf32": 494.5e12, "bfloat16": 989.5e12, "float16": 989.5e12,
                                      "fp8": 1979e12},
                         80 * 10**9, 3350 * _GB, 8, (450 * _GB, 5e-6), (50 * _GB, 1e-5)),
    # NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200), H200 SXM: the H100's compute
    # (BF16 989 TF, FP8 1,979 TF dense), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; DGX H200: 8x 400 Gb/s NDR.
    "h200": Hardware("h200", {"float32": 67e12, "tf32": 494.5e12, "bfloat16": 989.5e12, "float16": 989.5e12,
                              "fp8": 1979e12},
                     141 * 10**9, 4800 * _GB, 8, (450 * _GB, 5e-6), (50 * _GB, 1e-5)),
    # NVIDIA HGX B200 datasheet (nvidia.com/en-us/data-center/hgx), per GPU of 8: FP32 75 TF, TF32 1.1 PF,
    # BF16/FP16 2.25 PF, FP8 4.5 PF (dense), 180 GB HBM3e at 8 TB/s (1.44 TB, 64 TB/s for 8), NVLink 5 1.8 TB/s
    # (both ways). DGX B200: 8x 400 Gb/s ConnectX-7 (50 GB/s per GPU).
    "b200": Hardware("b200", {"float32": 75e12, "tf32": 1.1e15, "bfloat16": 2.25e15, "float16": 2.25e15,
                              "fp8": 4.5e15},
                     180 * 10**9, 8000 * _GB, 8, (900 * _GB, 5e-6), (50 * _GB, 1e-5)),
}
_ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm", "h200-sxm": "h200", "b200-sxm": "b200"}


@functools.lru_cache(maxsize=1)
def measure_cpu(seconds: float = 0.3) -> Hardware:
    """``"cpu"``: this machine, one core a device (a pipeline rank pinned to its core, as ``pv.launch`` runs them),
    from a short measurement (cached for the process).

    Ops are timed themselves (``roofline="kernels"``: ``pipeviz.kernels`` replays each traced op at its shapes,
    forward and backward, on one thread); the rates below serve the ops that cannot be replayed: float32 and
    bfloat16 matmul FLOP/s (512 x 512 and 128 x 128 products) and memory bandwidth (copying 32 MiB), one thread
    each; each rate is what was achieved, so ``efficiency`` is 1. Links are gloo's on one host
    (``pipeviz.costs.LINKS``); memory is the machine's RAM. Three figures are constants measured on this machine
    by benchmarks (too noisy for a short probe): the per-action overhead, gloo's all-reduce efficiency and the
    contention between ranks computing at once.
    """
    import torch

    def timed(fn: object, work: float) -> float:
        assert callable(fn)
        fn()  # warm up
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed > seconds / 3 and n >= 3:
                return work * n / elapsed

    flops: dict[str, float] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core: what each pinned rank has
    try:
        for name, dt, k in (("float32", torch.float32, 512), ("bfloat16", torch.bfloat16, 128)):
            a = torch.randn(k, k).to(dt)  # bfloat16 is slow on CPUs without its units: a smaller product
            flops[name] = timed(lambda a=a: a @ a, 2 * k**3)
        src = torch.empty(2**23, dtype=torch.float32).fill_(1.0)
        dst = torch.empty_like(src)
        bandwidth = timed(lambda: dst.copy_(src), 2 * src.numel() * 4)  # a copy reads and writes every byte
    finally:
        torch.set_num_threads(threads)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 * 2**30
    gloo = (1e9, 2e-4)  # pipeviz.costs.LINKS["gloo"]: what a pipeline sees between ranks on one host
    return Hardware("cpu", flops, int(ram), bandwidth, os.cpu_count() or 1, gloo, gloo, efficiency=1.0,
                    collective_efficiency=1.0, roofline="kernels", action_overhead=_CPU_ACTION_OVERHEAD,
                    allreduce_efficiency=_GLOO_ALLREDUCE, contention=_CPU_CONTENTION)


# Gloo's all-reduce between two processes on this machine moves 0.5-0.6 GB/s of bus bandwidth (4-32 MiB) where a
# send moves 1.0 GB/s (benchmarks/gloo_links.py): the reduction and the extra copies run on the same cores.
_GLOO_ALLREDUCE = 0.55

# An op streaming its weights from memory runs 1.10x as long while the other core runs the same (four repeats of
# seven alternations: medians 1.097-1.118, benchmarks/cpu_contention.py). A constant, like the two above: a probe
# short enough for a first lookup scattered 0.97-1.24 on this machine, whose speed drifts 10-20 % within a second.
_CPU_CONTENTION = 1.10

# pipeviz.profile.CPU_ACTION_OVERHEAD (not imported: the profile module imports the cost model, which imports this)
_CPU_ACTION_OVERHEAD = 4e-4


class _Presets(Mapping[str, Hardware]):
    """``pv.HARDWARE``: the presets by lowercase name; ``"cpu"`` is measured when first looked up."""

    def __getitem__(self, key: str) -> Hardware:
        name = _ALIASES.get(key, key)
        if name == "cpu":
            return measure_cpu()
        return _PRESETS[name]

    def __iter__(self) -> Iterator[str]:
        return iter([*_PRESETS, "cpu"])

    def __len__(self) -> int:
        return len(_PRESETS) + 1

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and (_ALIASES.get(key, key) in _PRESETS or key == "cpu")

    def __repr__(self) -> str:
        return f"HARDWARE({', '.join(self)}; aliases {', '.join(_ALIASES)})"


HARDWARE: Mapping[str, Hardware] = _Presets()


def hardware(spec: str | Hardware) -> Hardware:
    """The ``Hardware`` for a preset name (case-insensitive, aliases ``a100``, ``h100``) or a ``Hardware`` itself.

    Example:
        >>> pv.hardware("H100").name
        'h100-sxm'

    Raises:
        HardwareError: an unknown name (the message lists the valid ones).
        TypeError: neither a name nor a ``Hardware``.
    """
    if isinstance(spec, Hardware):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"hardware= takes a preset name or a pv.Hardware, got {spec!r} ({type(spec).__name__}).")
    key = spec.strip().lower()
    if key not in HARDWARE:
        raise HardwareError(f"Unknown hardware {spec!r}; valid: {', '.join(HARDWARE)} (aliases: "
                            f"{', '.join(_ALIASES)}). Fix: hardware='h100', or build a pv.Hardware(...).")
    return HARDWARE[key]


def op_time(flops: float, nbytes: float, hw: Hardware, dtype: str | None = None) -> float:
    """Seconds of one op on ``hw``: its math at ``rate(dtype)`` and its memory traffic at ``memory_bandwidth``,
    combined as ``hw.roofline`` says.

    - ``"additive"`` (the GPU presets): ``flops / rate + bytes / bandwidth``. A matmul of arithmetic intensity
      ``I = flops / bytes`` then runs at ``rate x I / (I + I_ridge)``, with ``I_ridge = rate / bandwidth`` the
      roofline's ridge point (Williams et al. 2009): its efficiency rises with its size and shape toward
      ``efficiency`` and never passes it (``matmul_efficiency``). Megatron-LM's README reads its H100 weak
      scaling (41 % of peak at 1.7B, 47-48 % at 314B-462B) the same way: "larger GEMMs have higher arithmetic
      intensity and are consequently more efficient to execute". An element-wise op (no FLOPs) costs its bytes.
    - ``"max"`` (``"cpu"``, whose rates are measured): ``max(flops / rate, bytes / bandwidth)``, the plain
      roofline: a matmul is compute-bound, an element-wise op memory-bound.
    """
    if hw.roofline in ("max", "kernels"):  # (the plain roofline is what "kernels" falls back to)
        return max(flops / hw.rate(dtype), nbytes / hw.memory_bandwidth)
    return flops / hw.rate(dtype) + nbytes / hw.memory_bandwidth


def matmul_efficiency(m: int, k: int, n: int, hw: Hardware, dtype: str | None = None) -> float:
    """The fraction of the dense peak an ``(m x k) @ (k x n)`` matmul reaches in ``op_time``'s model: at most
    ``hw.efficiency``, rising with the matmul's arithmetic intensity (bytes: the two inputs read and the output
    written once, in ``dtype``).

    Example:
        >>> h100 = pv.hardware("h100")
        >>> matmul_efficiency(4096, 2048, 6144, h100) < matmul_efficiency(4096, 18432, 6912, h100) < h100.efficiency
        True
    """
    name = hw.dtype(dtype)
    flops = 2.0 * m * k * n
    nbytes = DTYPE_BYTES[name] * (m * k + k * n + m * n)
    return flops / op_time(flops, nbytes, hw, name) / hw.peak(name)


# Ops that move no data: views, metadata and Python-level getters (the roofline gives them no time).
_FREE = frozenset({"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze",
                   "slice", "select", "alias", "detach", "as_strided", "split", "split_with_sizes", "chunk", "unbind",
                   "sym_size", "sym_numel", "sym_stride", "getitem", "lift_fresh_copy", "view_as_real",
                   "view_as_complex", "_assert_tensor_metadata", "empty", "scalar_tensor", "arange"})


@dataclass(frozen=True)
class OpTable:
    """Per op of a capture: forward FLOPs, activation bytes read + written, weight bytes read, output bytes, the
    ops selective recomputation drops (attention scores), the views (no data of their own), and the activation
    bytes with element-wise chains fused (``_fused_activation_bytes``, for ``Hardware.fused``)."""

    flops: tuple[float, ...]
    act: tuple[float, ...]
    weight: tuple[float, ...]
    out: tuple[float, ...]
    selective: tuple[int, ...]
    views: tuple[int, ...] = ()
    fused_act: tuple[float, ...] = ()


_OP_TABLES: dict[int, tuple[weakref.ref[Capture], OpTable]] = {}


def op_table(cap: Capture) -> OpTable:
    """Per op of a capture, what the roofline needs (cached while the capture lives)."""
    hit = _OP_TABLES.get(id(cap))
    if hit is not None and hit[0]() is cap:
        return hit[1]
    ops = cap.ops
    seq, elem = _tokens_and_element_size(cap)
    flops, act, weight, out, views = [], [], [], [], []
    for op in ops:
        base = op.target.split(".")[1] if op.target.startswith("aten.") else op.target.rsplit(".", 1)[-1]
        free = base in _FREE and not op.flops
        if free:
            views.append(op.index)
        if base == "scaled_dot_product_attention" and not op.flops and seq:
            # A capture whose counter missed the attention kernel (pipeviz.capture maps torch's CPU kernel to
            # torch's SDPA formula; another kernel may be missing): QK^T and PV, 2 x 2 FLOPs per query element
            # per key, over the sequence's keys (self-attention; no causal halving, as PaLM's MFU convention).
            flops.append(4.0 * op.out_bytes / elem * seq)
        else:
            flops.append(float(op.flops))
        out.append(float(op.out_bytes))
        act.append(0.0 if free else float(op.out_bytes + sum(ops[i].out_bytes for i in op.inputs)))
        weight.append(0.0 if free else float(sum(cap.param_bytes.get(p, 0) for p in op.params)))
    table = OpTable(tuple(flops), tuple(act), tuple(weight), tuple(out), _attention_scores(cap), tuple(views),
                    _fused_activation_bytes(cap, flops, act, set(views)))
    _OP_TABLES[id(cap)] = (weakref.ref(cap), table)
    return table


def _fused_activation_bytes(cap: Capture, flops: list[float], act: list[float], views: set[int]) -> tuple[float, ...]:
    """``act`` with chains of element-wise ops fused into one kernel each, as Megatron-LM's fused kernels
    (bias-GeLU, scale-mask-softmax, bias-dropout-add) and torch.compile's generated ones run them: where an
    element-wise op (no FLOPs, not a view) reads the output of another that nothing else reads (through views),
    that output is neither written by the producer nor read back by the consumer. A matmul's output is always
    written (it ends its kernel)."""
    ops = cap.ops
    base = list(range(len(ops)))
    for op in ops:  # a view's data is its input's
        if op.index in views and op.inputs:
            base[op.index] = base[op.inputs[0]]
    readers: dict[int, int] = {}
    for op in ops:
        if op.index in views:
            continue
        for b in {base[i] for i in op.inputs}:
            readers[b] = readers.get(b, 0) + 1
    out = list(act)
    for op in ops:
        j = op.index
        if j in views or flops[j]:
            continue
        for p in {base[i] for i in op.inputs}:
            if p in views or flops[p] or readers.get(p) != 1 or not act[p]:
                continue
            nbytes = ops[p].out_bytes
            out[j] = max(0.0, out[j] - nbytes)
            out[p] = max(0.0, out[p] - nbytes)
    return tuple(out)


def _tokens_and_element_size(cap: Capture) -> tuple[int, float]:
    """The traced sequence length (dim 1 of the first integer input of rank >= 2; 0 if none) and the bytes of a
    floating-point element as traced (the parameters' average)."""
    import torch

    seq = 0
    for x in [*cap.example_args, *cap.example_kwargs.values()]:
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and not x.is_floating_point():
            seq = int(x.shape[1])
            break
    numel = sum(cap.param_numel.values())
    return seq, (sum(cap.param_bytes.values()) / numel if numel else 4.0) or 4.0


def _attention_scores(cap: Capture) -> tuple[int, ...]:
    """Ops whose outputs are attention scores (Korthikanti et al.'s selectively recomputed part): each softmax,
    the ops before it with the same output size back to the score matmul (scaling, masking), and the ops after
    it with the same size (dropout)."""
    ops = cap.ops
    readers: dict[int, list[int]] = {}
    for op in ops:
        for i in op.inputs:
            readers.setdefault(i, []).append(op.index)
    marked: set[int] = set()
    for op in ops:
        if "softmax" not in op.target:
            continue
        size = op.out_bytes
        todo = [op.index]
        while todo:
            i = todo.pop()
            if i in marked:
                continue
            marked.add(i)
            if "bmm" in ops[i].target or "matmul" in ops[i].target or "baddbmm" in ops[i].target:
                continue  # the score matmul: its inputs (queries, keys) are kept anyway
            todo += [j for j in ops[i].inputs if ops[j].out_bytes == size]
            todo += [j for j in readers.get(i, []) if ops[j].out_bytes == size and j > op.index]
    return tuple(sorted(marked))


_ROOFLINE: dict[tuple[Any, ...], tuple[OpTable, tuple[list[float], list[float], list[float]]]] = {}


def forget_kernel_times() -> None:
    """Drop every remembered ``hardware="cpu"`` kernel time (and the layer times built from them), so the next
    estimate times the ops again: on a shared machine whose speed drifts (this one's moves by 10-20 % from one
    second to the next), a benchmark retakes its measurement in each round's conditions."""
    from pipeviz import kernels

    for cached in (kernels._measure, kernels._accumulate, kernels._autograd_call):
        cached.cache_clear()
    _ROOFLINE.clear()


def _add(a: float, b: float) -> float:
    return a + b


def layer_roofline(graph: ModelGraph, hw: Hardware, dtype: str | None, k: float,
                   s: float) -> tuple[list[float], list[float], list[float]]:
    """Per layer, forward seconds on ``hw`` (the roofline per op, summed), those of its attention-score ops, and
    backward seconds (2 x forward; with ``roofline="kernels"`` each op's measured backward); remembered for the
    last few (graph, hardware, microbatch size) asked: the planner asks many times."""
    key = (id(graph.capture), graph.layer_names, hw, dtype, k, s)
    table = op_table(graph.capture)
    hit = _ROOFLINE.get(key)
    if hit is not None and hit[0] is table:  # the same capture, not a new one at a reused address
        return hit[1]
    rate, bw = hw.rate(dtype), hw.memory_bandwidth
    combine = max if hw.roofline in ("max", "kernels") else _add  # op_time's rule, inlined: asked many times
    acts = table.fused_act if hw.fused and table.fused_act else table.act
    times = [combine(f * k / rate, (a * k + w) * s / bw) for f, a, w in zip(table.flops, acts, table.weight,
                                                                            strict=True)]
    back = [2.0 * t for t in times]  # a backward computes two matmuls per forward matmul
    spans = list(zip(graph.index.layer_first, graph.index.layer_last, strict=True))
    if hw.roofline == "kernels":
        times, back = _kernel_times(graph.capture, times, back, k, dtype and hw.dtype(dtype))
        # Every op the stage runs, the ones between layers too (an embedding sum, a mask), with the layer before.
        starts = [a for a, _ in spans]
        spans = [(a if i else 0, (starts[i + 1] - 1) if i + 1 < len(starts) else len(times) - 1)
                 for i, a in enumerate(starts)]
    fwd = [sum(times[a:b + 1]) for a, b in spans]
    bwd = [sum(back[a:b + 1]) for a, b in spans]
    sel = [sum(times[i] for i in table.selective if a <= i <= b) for a, b in spans]
    if len(_ROOFLINE) > 256:
        _ROOFLINE.clear()
    _ROOFLINE[key] = (table, (fwd, sel, bwd))
    return fwd, sel, bwd


_TORCH_DTYPES = {"float32": "float32", "tf32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _torch_dtype(dtype: str | None) -> Any:
    """The torch dtype a replay runs ``dtype`` in (tf32 as float32); None: as traced (or not replayable)."""
    import torch

    return getattr(torch, _TORCH_DTYPES[dtype]) if dtype in _TORCH_DTYPES else None


def loss_kernel_times(cap: Capture, k: float, dtype: str | None) -> tuple[float, float]:
    """Forward and backward seconds of the loss (a log-softmax over the outputs a loss reads,
    ``pipeviz.kernels.loss_seconds``) at ``k`` x the traced batch, as this machine runs it."""
    from pipeviz.kernels import loss_seconds

    return loss_seconds(cap.loss_outputs, k, _torch_dtype(dtype))


def _kernel_times(cap: Capture, times: list[float], back: list[float], k: float,
                  dtype: str | None) -> tuple[list[float], list[float]]:
    """Each op's forward and backward seconds as this machine runs it (``pipeviz.kernels``), the roofline's where
    it cannot be replayed."""
    from pipeviz.kernels import op_seconds

    torch_dtype = _torch_dtype(dtype)
    fwd, bwd = list(times), list(back)
    for op in cap.ops:
        measured = op_seconds(op, k, torch_dtype, cap.batch_size)
        if measured is not None:
            fwd[op.index], bwd[op.index] = measured
    return fwd, bwd
