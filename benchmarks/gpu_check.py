"""GPU check: the gpu-marked tests (tests/test_gpu.py: stages sharing one GPU over host memory, NCCL across GPUs when
there are two or more, each run checked against the unsplit model with pv.check_numerics), with their step times.

Run once on a GPU machine:

    python benchmarks/gpu_check.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("No CUDA device: nothing to check here.")
        return 0
    print(f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}; torch {torch.__version__}", flush=True)
    tests = Path(__file__).resolve().parent.parent / "tests" / "test_gpu.py"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-m", "gpu", "-p", "no:cacheprovider",
                           str(tests)]).returncode


if __name__ == "__main__":
    sys.exit(main())
