"""Host time of the eager fp8 Linear's routes, on any machine with Triton >= 3.3 (CPU included): the no-grad decode
call of a ``quantize_weights`` Linear, and the forward + backward of a ``convert_to_fp8`` (training) Linear.

What is timed is fp8tensor's Python from the module call to the launches (checks, settings, launch arguments, output
allocation, the eager launcher's argument classes and cached-kernel lookup), not Triton's compiled-kernel launch,
cuBLAS, nor the GPU. Stand-ins, in this process only: tensors report ``is_cuda`` (so every route takes its CUDA
branch: the Triton kernels' availability checks run as on a GPU), every Triton launch goes through fp8tensor's eager
launcher (``kernels._Launcher``) on CUDA device 0, where Triton's JIT is replaced by a compiled kernel whose ``run``
does nothing (grids, arguments and launch keys are still computed; outputs are allocated, unwritten), and
``torch._scaled_mm`` returns an unwritten output of its shape. Shapes are small so that the few real CPU ops left
(bias add, bias gradient, gradient accumulation) cost little. Per call, min over batches (µs); bf16 ``nn.Linear``
modules of small shapes as yardsticks (they include their small GEMMs on the CPU). The real launches and GEMMs are
timed on the GPU by ``benchmarks/serve.py --host``.

    PYTHONPATH=. python benchmarks/host_route.py
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

import fp8tensor
from fp8tensor.numerics import kernels
from fp8tensor.subclass import gemm


def per_call(fn, n: int = 50, batches: int = 400) -> float:
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(batches):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


class _NoOpCompiled:
    """A compiled kernel whose launch does nothing (what Triton's JIT returns, for the launcher's cache)."""

    function, packed_metadata = None, None

    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        if not self.launches:  # (a sign that a launch was reached; the list does not grow while timing)
            self.launches.append(self.fn)


class _StandInJit:
    """Triton's JIT function ``fn`` with compilation replaced: ``fn[grid](...)`` returns a :class:`_NoOpCompiled`."""

    def __init__(self, fn, launches: list):
        self.params, self.compiled = fn.params, _NoOpCompiled(fn, launches)

    def __getitem__(self, grid):
        def first_launch(*args, **kwargs):
            self.compiled.run()
            return self.compiled

        return first_launch


def _stand_ins(launches: list) -> None:
    """The stand-ins of the module docstring (the CPU GEMM backend is resolved first, by the real probe)."""
    if kernels._KNOBS is None:
        raise SystemExit("benchmarks/host_route.py: the eager launcher's direct launch needs Triton >= 3.3 "
                         "(pip install 'triton>=3.3'; Triton runs its CPU-only parts without a GPU)")
    gemm.choose_backend(torch.device("cpu"), torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16)
    cuda0, launchers = torch.device("cuda", 0), {}

    def launcher(fn):
        if fn not in launchers:
            launchers[fn] = kernels._Launcher(_StandInJit(fn, launches))
        return launchers[fn]

    def launch(fn, grid, args, consts, num_warps, device, num_stages=None, *, traced=False):
        launcher(fn)(grid, args, consts, num_warps, cuda0, num_stages)

    kernels._launch, kernels._launcher = launch, launcher
    kernels._FAST_OK = True
    torch.cuda.current_device = lambda: 0
    torch.cuda.is_current_stream_capturing = lambda: False
    kernels.compat.raw_cuda_stream = lambda idx: 0
    torch._scaled_mm = lambda a, b, *, out_dtype=None, **k: torch.empty(a.shape[0], b.shape[1], dtype=out_dtype)
    torch.Tensor.is_cuda = property(lambda self: True)


def main() -> None:
    dt = torch.bfloat16
    torch.manual_seed(0)
    tiny = nn.Linear(16, 16, dtype=dt)
    lin = fp8tensor.quantize_weights(nn.Sequential(nn.Linear(4096, 4096, dtype=dt)))[0]
    xt = torch.randn(1, 16, dtype=dt)
    x2 = torch.randn(1, 4096, dtype=dt)
    x3 = x2.view(1, 1, 4096)
    x64 = torch.randn(64, 4096, dtype=dt)
    ref = nn.Linear(64, 64, dtype=dt)
    train = fp8tensor.convert_to_fp8(nn.Sequential(nn.Linear(64, 64, dtype=dt)))[0]
    xg = torch.randn(16, 64, dtype=dt, requires_grad=True)  # (an inner layer: grad_input is computed)
    gy = torch.randn(16, 64, dtype=dt)
    decode = [("nn.Linear bf16 16 -> 16, one token (no grad)", lambda: tiny(xt)),
              ("fp8 Linear 4096 -> 4096 (bias), x (1, 4096) (no grad)", lambda: lin(x2)),
              ("fp8 Linear 4096 -> 4096 (bias), x (1, 1, 4096) (no grad)", lambda: lin(x3)),
              ("fp8 Linear 4096 -> 4096 (bias), x (64, 4096) (no grad; x quantized per row)", lambda: lin(x64))]
    training = [("nn.Linear bf16 64 -> 64, 16 tokens, forward + backward", lambda: ref(xg).backward(gy)),
                ("fp8 training Linear 64 -> 64 (bias), 16 tokens, forward + backward", lambda: train(xg).backward(gy)),
                ("fp8 training Linear 64 -> 64 (bias), 16 tokens, forward (grad mode)", lambda: train(xg))]
    launches: list = []
    _stand_ins(launches)  # (after the models are built: quantize_weights quantizes on the CPU for real)
    with torch.no_grad():
        lin(x3)
    assert launches and type(train.weight).__name__ == "Fp8MasterWeight", "the routes were not taken"
    print(f"torch {torch.__version__}\n\n| call | µs |\n|---|---|")
    for name, fn in decode:
        with torch.no_grad():
            print(f"| {name} | {per_call(fn):.1f} |")
    for name, fn in training:
        print(f"| {name} | {per_call(fn, batches=150):.1f} |")


if __name__ == "__main__":
    main()
