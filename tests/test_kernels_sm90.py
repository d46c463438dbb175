"""Every Triton kernel launch the package makes at the benchmarks' shapes compiles for an H100/H200 (sm_90), on a
machine without a GPU: Triton's CUDA compiler and ``ptxas`` run, nothing launches (tests/_kernels_sm90.py). The
interpreter tests check the kernels' arithmetic; this checks that the GPU's compiler takes the same code with the
package's tile tables (a kernel the interpreter runs can still fail to compile, or the other way round)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def _nvidia_backend_ok() -> bool:
    try:
        import triton.backends.nvidia as nvidia
        from triton.backends.compiler import GPUTarget

        GPUTarget("cuda", 90, 32)
    except Exception:
        return False
    return (Path(nvidia.__file__).parent / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _nvidia_backend_ok(), reason="needs Triton with its NVIDIA backend and ptxas")
def test_package_kernels_compile_for_sm90():
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(root / "tests" / "_kernels_sm90.py")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (proc.stdout[-3000:], proc.stderr[-3000:])
    kernels = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ok _")}
    # every kernel of fp8tensor/numerics/kernels.py is among the launches
    source = (root / "fp8tensor" / "numerics" / "kernels.py").read_text()
    defined = set(re.findall(r"@triton\.jit\s+def (_\w+_kernel)\(", source))
    assert defined <= kernels, sorted(defined - kernels)
