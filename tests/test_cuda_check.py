"""scripts/check_cuda.sh (the CI gate for CUDA sources) passes a clean kernel and fails a kernel
that uses local memory and one that does not compile. Needs nvcc (present on CI), not a GPU."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
@pytest.mark.parametrize("kernel,passes,reason", [
    ("ok.cu", True, "ok   "),
    ("spill.cu", False, "register spills / local memory"),
    ("broken.cu", False, "compile error"),
])
def test_check_cuda_gate(kernel, passes, reason):
    result = subprocess.run([os.path.join(ROOT, "scripts", "check_cuda.sh"),
                             os.path.join(ROOT, "tests", "cuda_check", kernel)],
                            capture_output=True, text=True, env={**os.environ, "NVCC": NVCC}, timeout=300)
    assert (result.returncode == 0) == passes, result.stdout + result.stderr
    assert reason in result.stdout
