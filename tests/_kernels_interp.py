"""Run the dim-0 kernels (column amax, transposing cast), the two-layout kernels and the row-wise kernel with folded
column scales under Triton's interpreter (CPU) and compare with the plain ops.

Invoked by tests/test_quantize.py in a subprocess with TRITON_INTERPRET=1 (read when the kernels are defined). The
interpreter's float -> fp8 cast is not the GPU's (tests/_group_cols_interp.py), so fp8 values are compared within one
e4m3 step where the plain result is not a power of two; scales and layouts exactly."""
import sys

import torch
import triton

from fp8tensor import kernels
from fp8tensor.quantize import SCALE_FLOOR, cast_to_fp8, rowwise_scale

from _group_cols_interp import _close


def _same_fp8(a, b):
    a, b = a.float(), b.float()
    bad = _close(a, b)
    assert bad.numel() == 0, (bad[:5].tolist(), a[tuple(bad[:5].t())].tolist(), b[tuple(bad[:5].t())].tolist())
    assert float((a != b).float().mean()) < 0.05  # nearly all values agree exactly


def main():
    torch.manual_seed(int(sys.argv[1]))
    # dim 0: M not a multiple of the blocks, several partial chunks, a row stride wider than K
    M, K = 1000, 70
    base = torch.randn(M, K + 6) * torch.logspace(-2, 2, K + 6)
    x = base[:, :K]
    x[:, 5] = 0.0  # an all-zero column: the floor scale
    amax = torch.zeros(K)
    kernels._col_amax_kernel[(triton.cdiv(K, 32), triton.cdiv(M, 128))](x, amax, M, K, x.stride(0), CHUNK_M=128,
                                                                       BLOCK_M=64, BLOCK_K=32)
    assert torch.equal(amax, x.abs().amax(0))
    q = torch.empty(K, M, dtype=torch.float8_e4m3fn)
    s = torch.empty(K, 1)
    kernels._cast_t_kernel[(triton.cdiv(M, 64), triton.cdiv(K, 32))](
        x, amax, q, s, M, K, x.stride(0), FMAX=448.0, EPS=SCALE_FLOOR, BLOCK_M=64, BLOCK_K=32)
    rs = rowwise_scale(x.t(), -1, torch.float8_e4m3fn)
    assert torch.equal(s, rs), (s - rs).abs().max()
    _same_fp8(q, cast_to_fp8(x.t(), rs, torch.float8_e4m3fn))
    # both layouts (row amax and column amax in one pass, then one read per tile): x with a wider row stride
    amax = torch.zeros(M + K)
    kernels._amax_both_kernel[(triton.cdiv(K, 32), triton.cdiv(M, 128))](x, amax, M, K, x.stride(0), CHUNK_M=128,
                                                                        BLOCK_M=32, BLOCK_K=32)
    assert torch.equal(amax[:M], x.abs().amax(1)) and torch.equal(amax[M:], x.abs().amax(0))
    q, s, qt, st = (torch.empty(M, K, dtype=torch.float8_e4m3fn), torch.empty(M, 1),
                    torch.empty(K, M, dtype=torch.float8_e4m3fn), torch.empty(K, 1))
    kernels._cast_both_kernel[(triton.cdiv(M, 64), triton.cdiv(K, 32))](
        x, amax[:M], amax[M:], q, s, qt, st, M, K, x.stride(0), FMAX=448.0, EPS=SCALE_FLOOR, BLOCK_M=64, BLOCK_K=32)
    for data, got_q, got_s in ((x, q, s), (x.t(), qt, st)):
        rs = rowwise_scale(data, -1, torch.float8_e4m3fn)
        assert torch.equal(got_s, rs), (got_s - rs).abs().max()
        _same_fp8(got_q, cast_to_fp8(data, rs, torch.float8_e4m3fn))
    # launch_both with the package's tiles: a NaN and an inf entry make their row's and column's scales non-finite,
    # the other rows and columns as the ops
    x = x.clone()
    x[9, 17], x[11, 3] = float("nan"), float("inf")
    q, s, qt, st = kernels.launch_both(x, torch.float8_e4m3fn, SCALE_FLOOR)
    for data, got_q, got_s in ((x, q, s), (x.t(), qt, st)):
        rs = rowwise_scale(data, -1, torch.float8_e4m3fn)
        ok = torch.isfinite(rs).reshape(-1)
        assert int((~ok).sum()) == 2 and not torch.isfinite(got_s[~ok]).any()
        assert torch.equal(got_s[ok], rs[ok]), (got_s[ok] - rs[ok]).abs().max()
        _same_fp8(got_q[ok], cast_to_fp8(data[ok], rs[ok], torch.float8_e4m3fn))
    # rows times column multipliers (grad_input's folded weight scales)
    M, K = 37, 300
    x = torch.randn(M, K) * torch.logspace(-3, 3, M)[:, None]
    x[4] = 0.0
    c = torch.rand(K) * 3
    c[10] = 0.0
    for bm, bk, one_tile in ((4, 128, False), (2, 512, True)):  # two reads of 128-column tiles; whole rows once
        q = torch.empty(M, K, dtype=torch.float8_e4m3fn)
        s = torch.empty(M, 1)
        kernels._row_quant_kernel[(triton.cdiv(M, bm),)](x, c, q, s, M, K, FMAX=448.0, EPS=SCALE_FLOOR, BLOCK_M=bm,
                                                         BLOCK_K=bk, HAS_C=True, ends_ptr=x, G=0, G_BLOCK=0,
                                                         ONE_TILE=one_tile)
        xf = x * c
        rs = rowwise_scale(xf, -1, torch.float8_e4m3fn)
        assert torch.equal(s, rs), (one_tile, (s - rs).abs().max())
        _same_fp8(q, cast_to_fp8(xf, rs, torch.float8_e4m3fn))
    # whole rows read once without multipliers: an odd row count and width, a zero row (the floor scale), a NaN
    # and an inf (their rows' scales non-finite, the other rows as the ops)
    xr = x.clone()
    xr[7, 3], xr[9, 0] = float("nan"), float("inf")
    for bm, bk in ((1, 512), (8, 512)):
        q = torch.empty(M, K, dtype=torch.float8_e4m3fn)
        s = torch.empty(M, 1)
        kernels._row_quant_kernel[(triton.cdiv(M, bm),)](xr, xr, q, s, M, K, FMAX=448.0, EPS=SCALE_FLOOR, BLOCK_M=bm,
                                                         BLOCK_K=bk, HAS_C=False, ends_ptr=xr, G=0, G_BLOCK=0,
                                                         ONE_TILE=True)
        rs = rowwise_scale(xr, -1, torch.float8_e4m3fn)
        ok = torch.isfinite(rs).reshape(-1)
        assert int((~ok).sum()) == 2 and not torch.isfinite(s[~ok]).any(), bm
        assert torch.equal(s[ok], rs[ok]), (bm, (s[ok] - rs[ok]).abs().max())
        _same_fp8(q[ok], cast_to_fp8(xr[ok], rs[ok], torch.float8_e4m3fn))
    # rows times their token group's column multipliers (grad_input of fp8 expert weights): uneven groups, an empty
    # one, a group end inside a block of rows, rows past the last end (the last group's multipliers), one group
    for ends in ([3, 3, 20, 30], [37], [0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]):
        ends_t = torch.tensor(ends, dtype=torch.int32)
        G = len(ends)
        cg = torch.rand(G, K) * 3
        cg[0, 7] = 0.0
        for bm, bk, one_tile in ((4, 128, False), (4, 512, True)):
            q = torch.empty(M, K, dtype=torch.float8_e4m3fn)
            s = torch.empty(M, 1)
            kernels._row_quant_kernel[(triton.cdiv(M, bm),)](x, cg, q, s, M, K, FMAX=448.0, EPS=SCALE_FLOOR,
                                                             BLOCK_M=bm, BLOCK_K=bk, HAS_C=True, ends_ptr=ends_t, G=G,
                                                             G_BLOCK=triton.next_power_of_2(G), ONE_TILE=one_tile)
            gid = torch.searchsorted(ends_t, torch.arange(M, dtype=torch.int32), right=True).clamp(max=G - 1)
            xf = x * cg[gid]
            rs = rowwise_scale(xf, -1, torch.float8_e4m3fn)
            assert torch.equal(s, rs), (ends, one_tile, (s - rs).abs().max())
            _same_fp8(q, cast_to_fp8(xf, rs, torch.float8_e4m3fn))
    # the fp8 transpose, one matrix and a batch of them (expert weights): sizes off the tiles, a batch stride wider
    # than a matrix (a slice of a larger buffer), bytes moved exactly
    wide = (torch.randn(3, 70, 45) * 40).to(torch.float8_e4m3fn)
    for src in (wide[0, :, :37], wide[:, :, :37]):
        M2, N2 = src.shape[-2:]
        B = src.shape[0] if src.dim() == 3 else 1
        dst = torch.empty(*src.shape[:-2], N2, M2, dtype=src.dtype)
        kernels._transpose_kernel[(triton.cdiv(M2, 32), triton.cdiv(N2, 16), B)](
            src, dst, M2, N2, src.stride(-2), src.stride(0) if B > 1 else 0, BLOCK_M=32, BLOCK_N=16)
        assert torch.equal(dst.view(torch.uint8), src.transpose(-2, -1).contiguous().view(torch.uint8))
    print("ok")


if __name__ == "__main__":
    main()
