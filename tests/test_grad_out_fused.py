"""``grad_out`` quantized for both gradient GEMMs from two reads (``fp8tensor.kernels.launch_rows_dim0_t``).

* The fused kernels against the kernels they replace (the row-wise kernel, the column amax and the transposed
  cast), run by Triton's CPU interpreter (``TRITON_INTERPRET=1``) on small shapes: same bits. The interpreter's own
  float32 -> fp8 conversion rounds some values differently from a GPU (a mantissa carry into the exponent is lost),
  so its fp8 bytes are compared with the old kernels' bytes under the same interpreter, and the float32 scales with
  the plain ops.
* The op ``fp8tensor::quantize_rows_dim0_t`` (its plain-ops body off CUDA) against :func:`quantize` and
  :func:`quantize_dim0_t`; its registration (``opcheck``).
* The backward's wiring (eager and traced), with the op standing in for the CUDA-only entry point: gradients with the
  fused quantization are bit-identical to the separate quantizations, and track float64.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fp8tensor
from fp8tensor.numerics.cache import OPERANDS
from fp8tensor import kernels
from fp8tensor import linear as linear_mod
from fp8tensor import quantize as qmod
from fp8tensor.quantize import SCALE_FLOOR, quantize, quantize_dim0_t
from fp8tensor.tensor import make_scaled

from conftest import E4M3_GEMM_BOUND, rel_err, set_knobs

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


def _stand_in(calls):
    """quantize_rows_and_tokens through the op (its plain-ops body on CPU), counting calls."""

    def f(x, float8_dtype=F8, *, col_mul=None):
        if not torch.compiler.is_dynamo_compiling():  # (Python side effects are for eager and AOT tracing only)
            calls.append(col_mul is not None)
        qr, sr, qt, st = torch.ops.fp8tensor.quantize_rows_dim0_t(x, col_mul, float8_dtype)
        return (qr, sr), (qt.t(), st.t())

    return f


def _op_targets(gm) -> set:
    """Names of the ops called anywhere in a dynamo graph (its subgraphs included)."""
    return {str(n.target) for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
            if n.op == "call_function"}


def _grads(x, w, gy, bias):
    xr = x.detach().clone().requires_grad_()
    wr = w.detach().clone().requires_grad_() if type(w) is torch.Tensor else w
    y = fp8tensor.fp8_linear(xr, wr, bias)
    y.backward(gy)
    return y.detach(), xr.grad, wr.grad


def _ref_grads(x, w_ref, gy, bias):
    xd = x.double().requires_grad_()
    wd = w_ref.double().clone().requires_grad_()
    torch.nn.functional.linear(xd, wd, None if bias is None else bias.double()).backward(gy.double())
    return xd.grad, wd.grad


@pytest.mark.parametrize("weight", ["hp", "fp8"])
def test_eager_backward_same_bits(weight, monkeypatch):
    K, N = 48, 40
    x = torch.randn(3, 8, K, dtype=torch.bfloat16)
    gy = torch.randn(3, 8, N, dtype=torch.bfloat16)
    w_hp = torch.randn(N, K, dtype=torch.bfloat16) * K ** -0.5
    bias = torch.randn(N, dtype=torch.bfloat16)
    if weight == "fp8":  # a row-scaled fp8 weight that requires grad (as FSDP2's gathered one): scale folding
        q, s = quantize(w_hp, -1, F8)
        make_w = lambda: make_scaled(q, s, torch.bfloat16, requires_grad=True)  # noqa: E731
        w_ref = q.double() * s.double()
    else:
        make_w = lambda: w_hp  # noqa: E731
        w_ref = w_hp
    set_knobs(monkeypatch, fused_grad_out="never")
    y0, gx0, gw0 = _grads(x, make_w(), gy, bias)
    calls = []
    monkeypatch.setattr(linear_mod, "quantize_rows_and_tokens", _stand_in(calls))
    set_knobs(monkeypatch, fused_grad_out="eager")
    y1, gx1, gw1 = _grads(x, make_w(), gy, bias)
    # "eager": grad_out in backward only where the fp8 weight's row scales are folded in by the kernel
    assert calls == ([True] if weight == "fp8" else []), calls
    assert torch.equal(y1, y0) and torch.equal(gx1, gx0) and torch.equal(gw1, gw0)
    gxd, gwd = _ref_grads(x, w_ref, gy, bias)  # and the float64 math
    assert rel_err(gx1, gxd) <= E4M3_GEMM_BOUND and rel_err(gw1, gwd) <= E4M3_GEMM_BOUND


def test_row_operand_shared_by_consecutive_linears(monkeypatch):
    """q/k/v read one input: its row-wise operand is made once (and again after an in-place change); same bits."""
    real = linear_mod.quantize
    x_rows = []
    monkeypatch.setattr(linear_mod, "quantize",
                        lambda t, dim=-1, *a, **k: (x_rows.append(1) if t.shape == (16, 32) and dim == 1 else None)
                        or real(t, dim, *a, **k))

    def run(share):
        set_knobs(monkeypatch, share_input_quantization=share)
        torch.manual_seed(0)
        x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
        ws = [torch.randn(24, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        h = x * 1  # the shared input (a non-leaf, as a norm's output)
        ys = [fp8tensor.fp8_linear(h, w) for w in ws[:2]]
        with torch.no_grad():
            h.mul_(2)  # a new version: quantized again
        ys.append(fp8tensor.fp8_linear(h, ws[2]))
        sum(y.float().sum() for y in ys).backward()
        assert "x_rows" not in OPERANDS._held  # emptied by the backward
        return [y.detach() for y in ys], x.grad, [w.grad for w in ws]

    x_rows.clear()
    y1, gx1, gw1 = run(True)
    n_shared = len(x_rows)
    x_rows.clear()
    y0, gx0, gw0 = run(False)
    assert n_shared == 2 and len(x_rows) == 3
    assert all(torch.equal(a, b) for a, b in zip(y1, y0)) and torch.equal(gx1, gx0)
    assert all(torch.equal(a, b) for a, b in zip(gw1, gw0))
