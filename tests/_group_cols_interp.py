"""Run the per-group column quantization kernel (and the row re-cast of expert weights) under Triton's interpreter
(CPU) and compare with the plain ops.

Invoked by tests/test_moe.py in a subprocess with TRITON_INTERPRET=1 (read when the kernels are defined). The
interpreter's float -> fp8 cast is not the GPU's (it rounds ties away from zero and maps some exact powers of two
to half their value), so the fp8 values are compared within one e4m3 step (2^-3 relative) where the plain result is
not a power of two; the scales, the layout and the zero padding exactly."""
import sys

import torch
import triton


def _close(a, b):
    """Indices where fp8 values ``a`` (interpreter) and ``b`` (plain ops) differ by more than one e4m3 step, leaving
    out exact powers of two of ``b`` (see the module docstring)."""
    pow2 = (b != 0) & (torch.log2(b.abs()) == torch.log2(b.abs()).round())
    return (((a - b).abs() > b.abs() * 2.0**-3 + 2.0**-9) & ~pow2).nonzero()

from fp8tensor import grouped as G
from fp8tensor import kernels
from fp8tensor.quantize import SCALE_FLOOR


def _forms_agree(x, ends, dst, q_cols, q_ref, s_ref, *, align, min_pad, per_group=False):
    """launch_group_cols_t in its one-launch and split forms (chunks of 2 to 5 per group: some chunks past a group's
    rows, some groups in fewer rows than a chunk) writes the bits of the kernel launched directly (q_ref, s_ref)."""
    G_ = ends.numel()
    C = x.shape[1]
    saved = kernels.GROUP_COL_CONFIG
    small = dict(block_m=16, block_c=32, warps=4, amax_block_m=8, amax_block_c=64, amax_warps=4)
    try:
        for mode, rows, most in (("one_kernel", 512, 8), ("split", 512, 8), ("split", 2, 5), ("auto", 2, 3)):
            kernels.GROUP_COL_CONFIG = kernels._frozen({**saved, **small, "mode": mode, "split_rows": rows,
                                                        "split_max": most, "split_min_rows": 4})
            chunks = kernels.group_col_chunks(x.shape[0], G_)
            assert chunks == (1 if mode == "one_kernel" else 2 if rows == 512 else most), (mode, chunks)
            if per_group:
                q = torch.empty(G_, C, q_cols, dtype=torch.float8_e4m3fn)
                kw = dict(stride_qg=C * q_cols, stride_qc=q_cols)
            else:
                q = torch.full((C, q_cols), 5.0).to(torch.float8_e4m3fn)
                kw = dict(stride_qg=0, stride_qc=q_cols)
            s = torch.full((G_, C), -1.0)
            kernels.launch_group_cols_t(x, ends, dst, q, s, q_cols=q_cols, align=align,
                                        float8_dtype=torch.float8_e4m3fn, scale_floor=SCALE_FLOOR, min_pad=min_pad,
                                        **kw)
            assert torch.equal(s, s_ref), (mode, chunks)
            assert torch.equal(q.view(torch.uint8).reshape(q_ref.shape), q_ref.view(torch.uint8)), (mode, chunks)
    finally:
        kernels.GROUP_COL_CONFIG = saved


def main():
    torch.manual_seed(int(sys.argv[1]))
    offs = torch.cumsum(torch.tensor([13, 0, 40, 1, 0, 20]), 0).to(torch.int32)
    M = int(offs[-1]) + 3  # rows past the last group
    x = torch.randn(M, 70) * torch.logspace(-2, 2, 70)
    M_pad, pad_ends, pad_starts = G.padded_offsets(offs, M)
    q = torch.full((70, M_pad), 5.0).to(torch.float8_e4m3fn)  # not zero: the kernel must write the padding
    s = torch.empty(6, 70)
    kernels._group_col_quant_t_kernel[(triton.cdiv(70, 32), 6)](
        x, offs, pad_starts, q, s, M, 70, x.stride(0), 0, M_pad, M_pad,
        FMAX=448.0, EPS=SCALE_FLOOR, ALIGN=16, MIN_PAD=16, BLOCK_M=16, BLOCK_C=32)
    qp, sp = G.quantize_group_cols(x, offs, M_pad, pad_starts)
    assert torch.equal(s, sp), (s - sp).abs().max()
    _forms_agree(x, offs, pad_starts, M_pad, q, s, align=16, min_pad=16)
    end = int(pad_ends[-1])
    a, b = q[:, :end].float(), qp[:, :end].float()
    bad = _close(a, b)
    assert bad.numel() == 0, (bad[:5].tolist(), a[tuple(bad[:5].t())].tolist(), b[tuple(bad[:5].t())].tolist())
    assert float((a != b).float().mean()) < 0.05  # nearly all values agree exactly
    start = 0
    for e, stop in enumerate(offs.tolist()):
        pad = q[:, int(pad_starts[e]) + stop - start:int(pad_ends[e])].float()
        assert int(pad_ends[e]) - int(pad_starts[e]) >= 16 and torch.count_nonzero(pad) == 0, e
        start = stop
    # per-expert columns of (E, N, K) weights, written as (E, K, N)
    w = torch.randn(5, 48, 80)
    E, N, K = w.shape
    qw = torch.empty(E, K, N, dtype=torch.float8_e4m3fn)
    sw = torch.empty(E, K)
    kernels._group_col_quant_t_kernel[(triton.cdiv(K, 32), E)](
        w.reshape(E * N, K), torch.arange(1, E + 1, dtype=torch.int32) * N, torch.zeros(E, dtype=torch.int32), qw,
        sw, E * N, K, K, K * N, N, N, FMAX=448.0, EPS=SCALE_FLOOR, ALIGN=1, MIN_PAD=0, BLOCK_M=16, BLOCK_C=32)
    qp, sp = G.quantize_expert_cols(w)
    assert torch.equal(sw, sp)
    _forms_agree(w.reshape(E * N, K), torch.arange(1, E + 1, dtype=torch.int32) * N, torch.zeros(E, dtype=torch.int32),
                 N, qw.reshape(E * K, N), sw, align=1, min_pad=0, per_group=True)
    a, b = qw.float(), qp.float()
    assert _close(a, b).numel() == 0 and float((a != b).float().mean()) < 0.05
    # a master weight's rows re-cast with given scales, stored transposed (grad_input's operand): ragged tiles
    w = torch.randn(3, 37, 70) * torch.logspace(-2, 2, 70)
    sr = w.abs().amax(-1) / 448.0
    qt = torch.empty(3, 70, 37, dtype=torch.float8_e4m3fn)
    kernels._cast_rows_t_kernel[(triton.cdiv(37, 16), triton.cdiv(70, 32), 3)](
        w, sr, qt, 37, 70, w.stride(1), w.stride(0), FMAX=448.0, BLOCK_M=16, BLOCK_N=32)
    ref = torch.clamp(w / sr[..., None], -448.0, 448.0).to(torch.float8_e4m3fn).transpose(-2, -1).float()
    assert _close(qt.float(), ref).numel() == 0 and float((qt.float() != ref).float().mean()) < 0.05
    # its launch function (the package's tiles; a 3-D weight and a 2-D one): the kernel's bits
    assert torch.equal(kernels.launch_cast_rows_t(w, sr, torch.float8_e4m3fn).view(torch.uint8), qt.view(torch.uint8))
    q2 = kernels.launch_cast_rows_t(w[1], sr[1], torch.float8_e4m3fn)
    assert q2.shape == (70, 37) and torch.equal(q2.view(torch.uint8), qt[1].view(torch.uint8))
    print("ok")


if __name__ == "__main__":
    main()
