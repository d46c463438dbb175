"""``grad_out`` quantized for both gradient GEMMs from two reads (``fp8tensor.kernels.launch_rows_dim0_t``).

* The fused kernels against the kernels they replace (the row-wise kernel, the column amax and the transposed
  cast), run by Triton's CPU interpreter (``TRITON_INTERPRET=1``) on small shapes: same bits. The interpreter's own
  float32 -> fp8 conversion rounds some values differently from a GPU (a mantissa carry into the exponent is lost),
  so its fp8 bytes are compared with the old kernels' bytes under the same interpreter, and the float32 scales with
  the plain ops.
* The op ``fp8tensor::quantize_rows_dim0_t`` (its plain-ops body off CUDA) against :func:`quantize` and
  :func:`quantize_dim0_t`; its registration (``opcheck``).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fp8tensor import kernels
from fp8tensor import quantize as qmod
from fp8tensor.quantize import quantize, quantize_dim0_t

F8 = torch.float8_e4m3fn


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


_INTERPRETER_CHECK = textwrap.dedent(
    """
    import torch, triton
    from fp8tensor import kernels
    from fp8tensor.quantize import SCALE_FLOOR, rowwise_scale, _reference_dim0_t
    torch.manual_seed(int(__import__("sys").argv[1]))
    F8 = torch.float8_e4m3fn
    u = lambda t: t.view(torch.uint8)
    kernels.ROWS_DIM0_CONFIG.update(block_m=4, block_k=32)
    kernels.CONFIG.update(cast_block_m=16, cast_block_k=16)
    for dt, fp8 in ((torch.bfloat16, F8), (torch.float32, F8), (torch.float16, torch.float8_e5m2)):
        fmax = torch.finfo(fp8).max
        for M, K in ((37, 48), (5, 70), (9, 1)):
            x = (torch.randn(M, K) * torch.logspace(-3, 3, K)).to(dt)
            x[2] = 0  # an all-zero row: the floor scale
            if K > 3:
                x[1, 3] = float("nan")  # a NaN: inf row and column scales, as the separate kernels
            for mul, one_pass, copies in ((None, 0, 1), (torch.rand(K) + 0.5, 0, 3), (None, 1024, 16),
                                          (torch.rand(K) + 0.5, 1024, 1)):
                # two loops over K / rows in registers; the column amax reduced into 1, 3 or (at most) 16 rows
                kernels.ROWS_DIM0_CONFIG.update(one_pass_elems=one_pass, amax_copies=copies)
                qr, sr, qt, st = kernels.launch_rows_dim0_t(x, fp8, SCALE_FLOOR, col_mul=mul)
                xr = x if mul is None else x.float() * mul  # what the separate row-wise kernel is given
                q2, s2 = torch.empty(M, K, dtype=fp8), torch.empty(M, 1)
                kernels._row_quant_kernel[(triton.cdiv(M, 4),)](xr, q2, s2, M, K, FMAX=fmax, EPS=SCALE_FLOOR,
                                                               BLOCK_M=4, BLOCK_K=64)
                amax, q3, s3 = torch.zeros(K), torch.empty(K, M, dtype=fp8), torch.empty(K, 1)
                kernels._col_amax_kernel[(triton.cdiv(K, 16), triton.cdiv(M, 32))](
                    x, amax, M, K, K, CHUNK_M=32, BLOCK_M=16, BLOCK_K=16)
                kernels._cast_t_kernel[(triton.cdiv(M, 32), triton.cdiv(K, 16))](
                    x, amax, q3, s3, M, K, K, FMAX=fmax, EPS=SCALE_FLOOR, BLOCK_M=32, BLOCK_K=16, N_AMAX=1)
                assert torch.equal(u(qr), u(q2)) and torch.equal(sr, s2), (dt, M, K, "rows")
                assert torch.equal(u(qt), u(q3)) and torch.equal(st, s3), (dt, M, K, "columns")
                # the scales are the plain ops' (a NaN gives inf where the plain ops give NaN)
                ref_r = rowwise_scale(xr, -1, fp8)
                ref_t = _reference_dim0_t(x, fp8)[1]
                assert torch.equal(sr, torch.where(ref_r.isnan(), float("inf"), ref_r)), (dt, M, K)
                assert torch.equal(st, torch.where(ref_t.isnan(), float("inf"), ref_t)), (dt, M, K)
                assert sr[2].item() == SCALE_FLOOR
    print("OK")
    """
)


@pytest.mark.skipif(not kernels.HAS_TRITON, reason="needs Triton (its CPU interpreter)")
def test_fused_kernels_match_separate_kernels_in_interpreter(_fresh_seed):
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _INTERPRETER_CHECK, str(_fresh_seed)], env=env, cwd=root,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("mul", [False, True])
@pytest.mark.parametrize("shape", [(6, 40), (2, 3, 17)])
def test_op_same_bits_as_separate_quantizations(shape, mul):
    x = torch.randn(*shape, dtype=torch.bfloat16)
    K = shape[-1]
    col_mul = torch.rand(K) + 0.5 if mul else None
    qr, sr, qt, st = torch.ops.fp8tensor.quantize_rows_dim0_t(x, col_mul, F8)
    x2 = x.reshape(-1, K)
    q1, s1 = quantize(x2 if col_mul is None else x2.float() * col_mul, -1, F8)
    q2, s2 = quantize_dim0_t(x, F8)
    assert torch.equal(_bytes(qr), _bytes(q1)) and torch.equal(sr, s1)
    assert torch.equal(_bytes(qt), _bytes(q2)) and torch.equal(st, s2)
    assert qt.shape == (K, x2.shape[0]) and qt.is_contiguous()


def test_op_registration():
    x = torch.randn(8, 24, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.fp8tensor.quantize_rows_dim0_t.default, (x, None, F8))
    torch.library.opcheck(torch.ops.fp8tensor.quantize_rows_dim0_t.default, (x, torch.rand(24) + 0.5, F8))


def test_entry_point_declines_cpu_and_bad_multiplier():
    x = torch.randn(8, 24, dtype=torch.bfloat16)
    assert qmod.quantize_rows_and_tokens(x) is None  # CPU: the callers quantize each layout on their own
    with pytest.raises(TypeError):
        qmod.quantize_rows_and_tokens(x, torch.int8)
