"""Shared helpers for the CPU test suites.

Randomness: every test draws fresh random inputs. The autouse fixture :func:`_fresh_seed` seeds torch with a new
random seed per test and prints it, so a failure shows ``FP8TENSOR_TEST_SEED=<seed>`` in its captured output;
setting that environment variable replays the exact inputs.

Error metric: :func:`rel_err` is the relative Frobenius error ``‖out − ref‖ / ‖ref‖`` computed in float64.
Bounds follow from fp8 precision: e4m3 rounds to 3 mantissa bits (relative rounding error ≤ 2^-4, RMS ≈ 2^-4/√3
for uniformly spread mantissas), and a GEMM with *both* operands rounded gives ≈ 3.6 % typical relative error on
Gaussian data, hence the project bound :data:`E4M3_GEMM_BOUND` = 5e-2.
"""
from __future__ import annotations

import contextlib
import os
import random

import pytest
import torch

import fp8tensor
from fp8tensor.quantize import quantize_rowwise

#: Relative Frobenius error bound of a GEMM with both operands rounded to e4m3 (typical value ≈ 3.6e-2).
E4M3_GEMM_BOUND = 5e-2
#: Same for e5m2 (2 mantissa bits: twice the rounding error of e4m3; typical ≈ 7e-2).
E5M2_GEMM_BOUND = 1.0e-1
#: Bounds for a small block of fp8 GEMMs in series (an MLP and an output head over a residual stream): the first
#: GEMMs' errors reach the last one's input, so independent errors add in quadrature, √2 × the one-GEMM bound.
#: Few distinct rows (a 10-token vocabulary) make the measured error vary more than a large GEMM's.
E4M3_BLOCK_BOUND = 2**0.5 * E4M3_GEMM_BOUND
E5M2_BLOCK_BOUND = 2**0.5 * E5M2_GEMM_BOUND
#: Bound for comparing a result against an exact float64 emulation of the *same* fp8 operands: only the
#: float32 accumulation order differs (≈ sqrt(K) · 2^-24 relative).
EMULATION_BOUND = 1e-5
#: Bound for a bf16 output against a float64 value of the same computation: bf16 rounding (2^-9 relative, RMS
#: ≈ 2^-9/√3 ≈ 1.1e-3) with margin.
BF16_OUT_BOUND = 8e-3

BACKENDS = ("rowwise", "tensorwise", "emulated")


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Seed torch with a fresh (or replayed, via ``FP8TENSOR_TEST_SEED``) seed and print it; a failing test's report
    names it (a ``seed`` section, see :func:`pytest_runtest_makereport`, and the test's ``user_properties``)."""
    seed = int(os.environ.get("FP8TENSOR_TEST_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(seed)
    request.node._fp8tensor_seed = seed
    request.node.user_properties.append(("seed", seed))
    print(f"FP8TENSOR_TEST_SEED={seed}")
    yield seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed or erroring test's report carries its seed and the command that replays it, whatever the output
    capture (``-s``, ``--tb=line``, ``-p no:logging``)."""
    outcome = yield
    rep = outcome.get_result()
    seed = getattr(item, "_fp8tensor_seed", None)
    if rep.failed and seed is not None:
        rep.sections.append(("seed", f"FP8TENSOR_TEST_SEED={seed}  (replay: FP8TENSOR_TEST_SEED={seed} "
                                     f"python -m pytest '{item.nodeid}')"))


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_left_behind(request):
    """A test module that leaves a default process group initialized would make every later module's own group
    (each creates one of the world size it needs) impossible: destroy it and fail the module, so that no test's
    outcome depends on the modules run before it."""
    import torch.distributed as dist

    before = dist.is_available() and dist.is_initialized()
    yield
    if dist.is_available() and dist.is_initialized() and not before:
        dist.destroy_process_group()
        pytest.fail(f"{request.node.nodeid} left a process group initialized (destroyed now); destroy it where it "
                    "is created", pytrace=False)


def set_knobs(monkeypatch, **changes) -> None:
    """``fp8tensor.set_config(**changes)`` until the end of the test (``monkeypatch`` restores the settings). Process-wide
    rather than a ``with fp8tensor.config(...)`` block: the backward of CUDA tensors runs in autograd's device threads,
    which a thread-local block does not reach."""
    from fp8tensor import settings

    monkeypatch.setattr(settings, "_global", fp8tensor.set_config())  # (records the settings to restore)
    fp8tensor.set_config(**changes)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖_F / ‖ref‖_F`` in float64 (plain tensors; dequantize fp8 tensors before calling)."""
    out = out.detach().to(torch.float64)
    ref = ref.detach().to(torch.float64)
    assert out.shape == ref.shape, (tuple(out.shape), tuple(ref.shape))
    return ((out - ref).norm() / ref.norm()).item()


def dequant_rowwise(x: torch.Tensor, dim: int, float8_dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """float64 value of ``x`` after fp8tensor's row-wise quantization over ``dim`` (the fp8 operand a GEMM uses)."""
    q, s = quantize_rowwise(x, dim=dim, float8_dtype=float8_dtype)
    return q.to(torch.float64) * s.to(torch.float64)


def emulated_fp8_mm(a: torch.Tensor, b: torch.Tensor, float8_dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """float64 ``a @ b`` where plain operands are first quantized row-wise along K, as fp8tensor does on the fly.

    ``a`` is ``(M, K)``, ``b`` is ``(K, N)``; ScaledFp8Tensor operands are taken as their exact dequantized values.
    """
    from fp8tensor import ScaledFp8Tensor

    def _val(t, k_dim):
        if isinstance(t, ScaledFp8Tensor):
            return t.to_hp(torch.float32).to(torch.float64)
        return dequant_rowwise(t, k_dim, float8_dtype)

    return _val(a, 1) @ _val(b, 0)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN) of two tensors of the same dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all())


def same_fp8(w, expected) -> bool:
    """``w`` is a ScaledFp8Tensor with exactly ``expected``'s fp8 bits and scales."""
    from fp8tensor import ScaledFp8Tensor

    return (
        isinstance(w, ScaledFp8Tensor)
        and w.qdata.dtype == expected.qdata.dtype
        and torch.equal(w.qdata.view(torch.uint8), expected.qdata.view(torch.uint8))
        and torch.equal(w.scale, expected.scale)
    )


def dequant(t: torch.Tensor) -> torch.Tensor:
    """Exact float32 value of a ScaledFp8Tensor (``qdata * scale``), the data of a master weight, else ``t``."""
    from fp8tensor import Fp8MasterWeight, ScaledFp8Tensor

    if isinstance(t, ScaledFp8Tensor):
        return t.to_hp(torch.float32)
    if isinstance(t, Fp8MasterWeight):
        return t._data
    return t


@contextlib.contextmanager
def count_scaled_mm():
    """Count fp8 GEMMs (``torch._scaled_mm`` calls: fp8tensor's CPU and CUDA GEMM path) while active."""
    n = [0]
    orig = torch._scaled_mm

    def counting(*args, **kwargs):
        n[0] += 1
        return orig(*args, **kwargs)

    torch._scaled_mm = counting
    try:
        yield n
    finally:
        torch._scaled_mm = orig


def run_under_triton_interpreter(script: str) -> None:
    """Run ``tests/<script>`` in a subprocess with ``TRITON_INTERPRET=1`` (Triton's interpreter on CPU, read when the
    kernels are defined) and a random seed as its argument; it must exit 0 and print ``ok`` last."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    seed = str(torch.randint(0, 2**31, ()).item())
    proc = subprocess.run([sys.executable, str(root / "tests" / script), seed], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (seed, proc.stdout[-2000:], proc.stderr[-3000:])
