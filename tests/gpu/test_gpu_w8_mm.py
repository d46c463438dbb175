"""The decode GEMM ``launch_w8_mm`` on CUDA beyond the no-grad Linear's tests (skipped without a GPU): the 64- and
128-row blocks, tile candidates given through ``tiles=`` (as ``benchmarks/serve.py --crossover`` times them) and
M = 0, and an fp8 ``x`` with row scales (``x_scale``), against a float64 reference and with the same bits run after
run; and a quantized model's decode step
captured by ``torch.cuda.graph`` (the GEMM and, for a split K, its reduce launched inside the capture) replaying with
eager's bits on new inputs."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fp8tensor
from fp8tensor import kernels
from fp8tensor.quantize import quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda"
from conftest import E4M3_GEMM_BOUND, rel_err  # noqa: E402


def _operands(M, N, K, dtype, bias, seed):
    g = torch.Generator(DEV).manual_seed(seed)
    x = torch.randn(M, K, device=DEV, generator=g).to(dtype)
    w = torch.randn(N, K, device=DEV, generator=g) * torch.logspace(-2, 1, N, device=DEV)[:, None]
    q, s = quantize(w, -1)
    b = torch.randn(N, device=DEV, generator=g).to(dtype) if bias else None
    return x, q, s, b


def _check(x, q, s, b, tiles=None):
    M, N = x.shape[0], q.shape[0]
    out = kernels.launch_w8_mm(x, q, s, b, tiles=tiles)
    assert out.shape == (M, N) and out.dtype == x.dtype
    for _ in range(5):  # fixed split of K, fixed summation order: the same bits
        assert torch.equal(kernels.launch_w8_mm(x, q, s, b, tiles=tiles), out)
    if M:
        ref = x.double() @ (q.double() * s.double()).t() + (b.double() if b is not None else 0)
        # float32 sums of exact products, one rounding: 2^-8 (bf16) / 2^-11 (fp16) relative, with margin
        assert rel_err(out, ref) < (4e-3 if x.dtype == torch.bfloat16 else 6e-4)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K", [(33, 70, 300), (48, 1024, 4096), (64, 4096, 4096), (100, 1000, 2000),
                                   (128, 4096, 14336), (64, 14336, 4096), (0, 64, 64), (1, 4096, 4096),
                                   (1, 14336, 4096), (1, 4096, 14336), (1, 70, 300)])
@pytest.mark.parametrize("bias", [False, True])
def test_row_blocks_against_float64(dtype, M, N, K, bias):
    # (one row: the table's gemv tile, no MMA)
    _check(*_operands(M, N, K, dtype, bias, M * 7 + N + K))


@pytest.mark.parametrize("block_n,block_k,warps,programs_per_sm", [(8, 1024, 4, 4), (32, 256, 4, 8), (16, 512, 8, 2)])
@pytest.mark.parametrize("N,K", [(4096, 4096), (1024, 4096), (4096, 14336), (70, 300)])
def test_gemv_tiles_given_against_float64(block_n, block_k, warps, programs_per_sm, N, K):
    # one row through gemv tiles (no MMA) other than the table's; two rows refused with a clear error
    tiles = dict(block_n=block_n, block_k=block_k, warps=warps, stages=1, programs_per_sm=programs_per_sm,
                 min_k_tiles=1, gemv=True)
    _check(*_operands(1, N, K, torch.bfloat16, True, N + K), tiles=tiles)
    x, q, s, b = _operands(2, N, K, torch.bfloat16, True, N + K)
    with pytest.raises(ValueError, match="takes one row"):
        kernels.launch_w8_mm(x, q, s, b, tiles=tiles)


@pytest.mark.parametrize("block_n,block_k,warps,programs_per_sm", [(128, 128, 4, 2), (32, 128, 4, 4),
                                                                   (128, 64, 8, 2), (64, 64, 4, 4)])
@pytest.mark.parametrize("N,K", [(4096, 4096), (1024, 4096), (4096, 14336)])
def test_tiles_given_against_float64(block_n, block_k, warps, programs_per_sm, N, K):
    tiles = dict(kernels.W8_MM_CONFIG["tiles"][64], block_n=block_n, block_k=block_k, warps=warps,
                 programs_per_sm=programs_per_sm)
    _check(*_operands(64, N, K, torch.bfloat16, True, N + K), tiles=tiles)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K", [(1, 4096, 4096), (16, 1024, 4096), (33, 70, 300), (64, 14336, 4096),
                                   (128, 4096, 14336)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_x_against_float64_and_the_dual_fp8_gemm(dtype, M, N, K, bias):
    # x quantized per row (x_scale): the dot fp8 x fp8 (wgmma from 64 rows), each row's partial sums times its
    # scale; against float64 of the dequantized operands (exact products, float32 sums, one rounding) and against
    # cuBLAS's dual-fp8 GEMM of the same operands (float32 summation order, one output rounding apart)
    x, q, s, b = _operands(M, N, K, dtype, bias, M * 11 + N + K)
    xq, xs = quantize(x, -1)
    out = kernels.launch_w8_mm(xq, q, s, b, x_scale=xs, out_dtype=dtype)
    assert out.shape == (M, N) and out.dtype == dtype
    for _ in range(3):
        assert torch.equal(kernels.launch_w8_mm(xq, q, s, b, x_scale=xs, out_dtype=dtype), out)
    ref = (xq.double() * xs.double()) @ (q.double() * s.double()).t() + (b.double() if b is not None else 0)
    assert rel_err(out, ref) < (4e-3 if dtype == torch.bfloat16 else 6e-4)
    if dtype == torch.bfloat16 and N % 16 == 0 and K % 16 == 0:
        cublas = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.t().contiguous(), out_dtype=dtype,
                                  bias=b, use_fast_accum=False)
        assert rel_err(out, cublas.double()) < 8e-3


def test_more_rows_than_the_largest_row_block_refused():
    x, q, s, b = _operands(max(kernels.W8_MM_CONFIG["tiles"]) + 1, 64, 64, torch.bfloat16, False, 0)
    with pytest.raises(ValueError, match="tiles for at most"):
        kernels.launch_w8_mm(x, q, s, b)


def test_cuda_graph_capture(monkeypatch):
    # the no-grad Linear's decode path (weight_only_mm -> launch_w8_mm) recorded into a CUDA graph, after a warm-up on
    # a side stream (Triton's compiles, the launch plans); the graph reads its input buffer at each replay
    torch.manual_seed(0)
    shapes = [(4096, 4096), (1024, 4096)]  # (N, K) of each Linear: K split on an H200 (the reduce kernel captured)
    m = fp8tensor.quantize_weights(nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 1024, bias=False)).to(
        DEV, torch.bfloat16)).eval()
    x = torch.randn(8, 4096, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            m(x)
        torch.cuda.current_stream().wait_stream(side)
        launches = []
        real = kernels._launch
        monkeypatch.setattr(kernels, "_launch", lambda fn, *a, **k: launches.append(fn) or real(fn, *a, **k))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = m(x)
        monkeypatch.setattr(kernels, "_launch", real)
        expected = []
        for N, K in shapes:
            split = kernels._w8_mm_plan(8, N, K, x.device)[3]
            expected += [kernels._w8_mm_kernel] + ([kernels._w8_mm_reduce_kernel] if split > 1 else [])
        assert launches == expected
        xs = [x.clone(), torch.randn_like(x), torch.randn_like(x) * 8]
        refs = [m(xi) for xi in xs]
    for _ in range(10):
        for xi, ri in zip(xs, refs):
            x.copy_(xi)  # the graph's input
            g.replay()
            assert torch.equal(out, ri)


@pytest.mark.parametrize("M", [1, 8, 40])
def test_eager_one_launch_same_bits_as_the_split(monkeypatch, M):
    """Eagerly, outside CUDA graph capture, a K-split decode GEMM runs as one launch (each program adds its column
    block's slices in slice order): the same bits as the split's kernel and reduce launches, bf16 and fp8 x."""
    torch.manual_seed(M)
    N, K = 1024, 4096
    x, q, s, b = _operands(M, N, K, torch.bfloat16, True, M)
    assert kernels.w8_mm_split(M, N, K, x.device) > 1
    kernels.launch_w8_mm(x, q, s, b)  # (the first call of a plan also launches the split once: a later capture's)
    launches = []
    real = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda fn, *a, **k: launches.append(fn) or real(fn, *a, **k))
    out = kernels.launch_w8_mm(x, q, s, b)
    assert launches == [kernels._w8_mm_kernel]
    assert torch.equal(kernels.launch_w8_mm(x, q, s, b, one_launch=False), out)
    assert launches[1:] == [kernels._w8_mm_kernel, kernels._w8_mm_reduce_kernel]
    xq, xs = quantize(x, -1)
    f8 = kernels.launch_w8_mm(xq, q, s, b, x_scale=xs, out_dtype=torch.bfloat16)
    assert torch.equal(kernels.launch_w8_mm(xq, q, s, b, x_scale=xs, out_dtype=torch.bfloat16, one_launch=False), f8)


@pytest.mark.parametrize("shape", [(2, 3), (1, 1), (4, 8)])
def test_batched_input_as_its_rows(shape):
    """A quantize_weights Linear given a contiguous ``(..., K)`` decode input launches the decode GEMM on it as it is
    (no reshape): the same bits as the 2-D input, against float64 within the fp8 weight's bound."""
    torch.manual_seed(0)
    lin = fp8tensor.quantize_weights(nn.Sequential(nn.Linear(512, 96, device=DEV, dtype=torch.bfloat16)))[0]
    x = torch.randn(*shape, 512, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        out = lin(x)
        flat = lin(x.reshape(-1, 512))
    assert out.shape == (*shape, 96)
    assert torch.equal(out.reshape(-1, 96), flat)
    ref = x.double().reshape(-1, 512) @ lin.weight.to_hp(torch.float64).t() + lin.bias.double()
    rows = flat.shape[0]  # (past max_m rows x is quantized per row to e4m3 as well: the fp8 GEMM's bound)
    assert rel_err(flat, ref) < (1e-2 if rows <= kernels.W8_MM_CONFIG["max_m"] else E4M3_GEMM_BOUND)


@pytest.mark.parametrize("M,N,K", [(1, 1024, 4096), (8, 4096, 4096), (33, 4096, 14336), (64, 1024, 4096)])
@pytest.mark.parametrize("bias", [False, True])
def test_partials_sum_to_the_output(M, N, K, bias):
    """``launch_w8_mm_partials`` (the traced decode GEMM's K split, summed in the graph): one float32 slice per
    ``w8_mm_split`` slice, each the product over its K slice against float64, and their epilogue (slice order, row
    scales, bias, one rounding) the reduce launch's output: bit for bit without a bias (the same float32 operations in
    the same order), within one bf16 rounding with one (eager ops round the product before adding the bias; the
    kernel may fuse the two)."""
    from fp8tensor.numerics.quantize import _w8_mm_epilogue

    seed = M * 7 + N + K + bias
    x, q, s, b = _operands(M, N, K, torch.bfloat16, bias, seed)
    split = kernels.w8_mm_split(M, N, K, x.device)
    if split == 1:
        with pytest.raises(ValueError, match="not split over K"):
            kernels.launch_w8_mm_partials(x, q)
        return
    p = kernels.launch_w8_mm_partials(x, q)
    assert p.shape == (split, M, N) and p.dtype == torch.float32
    k_per = kernels._w8_mm_plan(M, N, K, x.device)[4]
    for i in range(split):
        ks = slice(i * k_per, min(K, (i + 1) * k_per))
        ref = x[:, ks].double() @ q[:, ks].double().t()
        assert rel_err(p[i], ref) < 1e-5, (seed, i)  # exact products, float32 sums
    out = _w8_mm_epilogue(p, s, b, x.dtype)
    full = kernels.launch_w8_mm(x, q, s, b)
    if b is None:
        assert torch.equal(out, full), seed
    assert rel_err(out, full.double()) < 2 ** -8, seed
    ref = x.double() @ (q.double() * s.double()).t() + (b.double() if b is not None else 0)
    assert rel_err(out, ref) < 4e-3, seed


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_decode_sums_the_split_in_the_graph(mode):
    """Compiled, a K-split decode GEMM launches its kernel and no reduce kernel of its own: the partial sums'
    epilogue is plain ops in the graph, fused by inductor into the consumer (here the SiLU); the result equals
    eager's within one bf16 rounding, and the float64 reference within the fp8 weight's bound."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    m = fp8tensor.quantize_weights(nn.Sequential(nn.Linear(4096, 1024), nn.SiLU()).to(DEV, torch.bfloat16)).eval()
    hp = nn.Linear(4096, 1024).to(DEV, torch.float64)
    with torch.no_grad():
        hp.weight.copy_(m[0].weight.to_hp(torch.float64))
        hp.bias.copy_(m[0].bias.double())
    torch._dynamo.reset()
    c = torch.compile(m, mode=mode)
    with torch.no_grad():
        for n in (1, 8, 48):
            assert kernels.w8_mm_split(n, 1024, 4096, torch.device(DEV)) > 1
            x = torch.randn(n, 4096, device=DEV, dtype=torch.bfloat16)
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            y, code = run_and_get_code(c, x)
            y = y.clone()
            code = "\n".join(code)
            assert "_w8_mm_kernel" in code and "_w8_mm_reduce_kernel" not in code, n
            assert rel_err(y, m(x).double()) < 2 ** -7, n
            # the weight-only form rounds only the weight; past max_m rows x is quantized per row to e4m3 as well
            bound = 4e-3 if n <= kernels.W8_MM_CONFIG["max_m"] else E4M3_GEMM_BOUND
            assert rel_err(y, torch.nn.functional.silu(hp(x.double()))) < bound, n
    torch._dynamo.reset()
