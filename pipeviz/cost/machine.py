"""``Hardware``: what a device can do, for costs on machines a notebook never ran on.

One table of named presets (``HARDWARE``), each figure with the datasheet it comes from, plus ``"cpu"``: this
machine, from a short measurement (its constants that no short probe measures well come from
``pipeviz.cost.calibration``). Without a named ``Hardware`` a cost is priced on a nominal device: ``LINKS`` per
communication backend and ``FLOPS_PER_S`` per device type (``device_rate``).

``efficiency`` is the one calibration constant per GPU type: the fraction of the datasheet's dense peak a
well-shaped matmul reaches in practice (large training runs report 35-55 % model FLOPs utilisation on
A100/H100, Megatron-LM and torchtitan alike). Change it with ``hw.with_efficiency(0.45)`` or
``dataclasses.replace(hw, efficiency=0.45)``.

Example:
    >>> hw = pv.hardware("H100")                 # case-insensitive; pv.HARDWARE lists the presets
    >>> hw.peak("bfloat16") / 1e12
    989.5
    >>> pv.simulate(plan, "1F1B", 8, options=pv.CostOptions(hardware=hw.with_efficiency(0.45), dtype="bfloat16"))
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from pipeviz.cost.calibration import constant

__all__ = ["DTYPES", "DTYPE_BYTES", "FLOPS_PER_S", "HARDWARE", "LINKS", "ROOFLINES", "Hardware", "HardwareError",
           "device_rate", "dtype_name", "hardware", "measure_cpu"]

# Nominal devices, for costs without a named Hardware: FLOP/s per device type, (bytes/s, latency s) per backend.
FLOPS_PER_S = {"cpu": 2e10, "cuda": 2e14}
LINKS = {"gloo": (1e9, 2e-4), "nccl": (1e11, 1e-5), "host": (1e10, 5e-5), "none": (float("inf"), 0.0)}


def device_rate(device: str | None) -> float:
    """The nominal FLOP/s of a device string (``"cpu"``, ``"cuda:0"``): ``FLOPS_PER_S`` by its type."""
    return FLOPS_PER_S["cuda" if str(device).startswith("cuda") else "cpu"]


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
            here: a 13 MiB all-reduce takes 23 ms where a send of it takes 13, ``pipeviz.cost.calibration``).
        action_overhead: fixed seconds per pipeline action around its ops (posting sends and receives, the
            stage's bookkeeping, event timing): 0 for the GPU presets (hidden behind queued kernels), for
            ``"cpu"`` the gap measured between a rank's actions (``pipeviz.cost.calibration``: ``cpu_action_overhead``).
        contention: how much longer an op runs while another rank computes at the same moment: 1 for the GPU
            presets (each rank its own device), 1.10 for ``"cpu"`` (ranks pinned to cores of one processor
            still share its cache and memory bandwidth: ``pipeviz.cost.calibration``). ``pv.simulate``
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

    Ops are timed themselves (``roofline="kernels"``: ``pipeviz.cost.replay`` replays each traced op at its shapes,
    forward and backward, on one thread); the rates below serve the ops that cannot be replayed: float32 and
    bfloat16 matmul FLOP/s (512 x 512 and 128 x 128 products) and memory bandwidth (copying 32 MiB), one thread
    each; each rate is what was achieved, so ``efficiency`` is 1. Links are gloo's on one host
    (``LINKS``); memory is the machine's RAM. Three figures are calibrated constants (``pipeviz.cost.calibration``,
    too noisy for a short probe): the per-action overhead, gloo's all-reduce efficiency and the contention between
    ranks computing at once.
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
    gloo = LINKS["gloo"]  # what a pipeline sees between ranks on one host
    return Hardware("cpu", flops, int(ram), bandwidth, os.cpu_count() or 1, gloo, gloo, efficiency=1.0,
                    collective_efficiency=1.0, roofline="kernels", action_overhead=constant("cpu_action_overhead"),
                    allreduce_efficiency=constant("gloo_allreduce_efficiency"), contention=constant("cpu_contention"))


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
