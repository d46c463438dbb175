"""Host-overhead machinery on CUDA (skipped without a GPU): the grouped row-wise kernel gives the bits of one launch
per tensor, and compiled graphs launch the dim-0 kernels inline (no Python custom op left in the generated code)."""
import pytest
import torch

import fp8tensor.quantize
from fp8tensor import kernels
from fp8tensor.quantize import SCALE_FLOOR, quantize, quantize_dim0_t, quantize_group

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("float8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_group_kernel_bit_identical_to_one_launch_each(dtype, float8_dtype):
    shapes = [(2048, 2048), (7, 33), (1, 1030), (300, 4096), (3, 5, 1030)]
    xs = [(torch.randn(*s, device=DEV) * torch.rand(*s[:-1], 1, device=DEV) * 100).to(dtype) for s in shapes]
    xs[0][3] = 0  # an all-zero row
    xs[1][2, 5] = float("nan")  # a NaN row stays non-finite
    xs[3][0, 0] = 1e30 if dtype == torch.float32 else 3e38  # saturating
    got = quantize_group(xs, float8_dtype)
    for x, (q, s) in zip(xs, got):
        qr, sr = kernels.quantize_last_dim(x, float8_dtype, SCALE_FLOOR)
        assert q.shape == x.shape and q.dtype == float8_dtype and s.shape == (*x.shape[:-1], 1)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
        assert torch.equal(s.nan_to_num(), sr.nan_to_num())
        qe, se = quantize(x, -1, float8_dtype)
        assert torch.equal(q.view(torch.uint8), qe.view(torch.uint8))


def test_group_falls_back_for_mixed_dtypes_and_layouts():
    xs = [torch.randn(64, 128, device=DEV), torch.randn(64, 128, device=DEV, dtype=torch.bfloat16),
          torch.randn(128, 64, device=DEV).t()]
    for x, (q, s) in zip(xs, quantize_group(xs)):
        qr, sr = quantize(x, -1)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)


def test_compiled_graph_launches_dim0_kernels_inline():
    from torch._inductor.utils import run_and_get_code

    def f(x):
        return quantize_dim0_t(x * 2, torch.float8_e4m3fn)

    x = torch.randn(512, 256, device=DEV, dtype=torch.bfloat16)
    (q, s), codes = run_and_get_code(torch.compile(f), x)
    code = "\n".join(codes)
    assert "_col_amax_kernel" in code and "_cast_t_kernel" in code
    assert "torch.ops.fp8tensor.quantize_dim0_t" not in code
    qr, sr = quantize_dim0_t(x * 2, torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)


def test_eager_dim0_direct_launch_matches_op():
    from fp8tensor.quantize import _dim0_t

    x = torch.randn(1000, 300, device=DEV)
    q, s = _dim0_t(x, torch.float8_e4m3fn)
    qr, sr = torch.ops.fp8tensor.quantize_dim0_t(x, torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)


@pytest.mark.parametrize("reshard", [False, True])
def test_fsdp_one_rank_grouped_packed_matches_per_weight(reshard):
    """FSDP2 over a 1-rank NCCL mesh: the grouped kernel writing the packed payload trains bit for bit like
    quantizing each weight in its own hook (3 AdamW steps), and the unsharded weight's data and scales view one
    buffer."""
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fp8tensor
    from fp8tensor import fsdp as payload

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runs = {}
        for grouped in (True, False):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.Linear(512, 128, bias=False),
                                  nn.Linear(128, 256, bias=False)).to(DEV)
            fp8tensor.convert_to_fp8(model, fp8_all_gather=True)
            fully_shard(model, mesh=init_device_mesh("cuda", (1,)), reshard_after_forward=reshard)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            shared = []
            def _local(w):  # the unsharded parameter FSDP2 put on the module (a DTensor only with TP)
                return w.to_local() if hasattr(w, "to_local") else w

            model[1].register_forward_pre_hook(lambda m, a: shared.append(
                _local(m.weight).qdata.untyped_storage().data_ptr()
                == _local(m.weight).scale.untyped_storage().data_ptr()))
            gen = torch.Generator(device=DEV).manual_seed(1)
            finder = payload.fsdp_group
            if not grouped:
                payload.fsdp_group = lambda local: (None, [])
            ys = []
            try:
                for _ in range(3):
                    x = torch.randn(8, 64, 256, device=DEV, generator=gen)
                    y = model(x)
                    y.float().square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                    ys.append(y.detach())
            finally:
                payload.fsdp_group = finder
            runs[grouped] = (ys, [p.to_local()._data.clone() for p in model.parameters()], shared)
        (yg, pg, sg), (ys_, ps, ss) = runs[True], runs[False]
        assert all(torch.equal(a, b) for a, b in zip(yg, ys_))
        assert all(torch.equal(a, b) for a, b in zip(pg, ps))
        assert not torch.equal(yg[0], yg[1]) and all(sg) and all(ss)
    finally:
        if own:
            dist.destroy_process_group()


@pytest.mark.parametrize("shape", [(14336, 4096), (300, 1030), (1, 77), (129, 1)])
@pytest.mark.parametrize("float8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_transpose_kernel_bit_identical(shape, float8_dtype):
    """The tiled fp8 transpose (eager launch, the op, compiled) is ``q.t().contiguous()`` bit for bit, also for a
    row-sliced view (row stride larger than its width)."""
    from fp8tensor.quantize import transpose_after as _transpose_after

    q = (torch.randn(*shape, device=DEV) * 50).to(float8_dtype)
    g = torch.randn(8, 8, device=DEV)
    g[0, 0] = float("nan")  # the dependency reads this element: no effect on values
    for src in (q, torch.cat([q, q], dim=1)[:, : shape[1]]):
        ref = src.t().contiguous()
        for got in (kernels.launch_transpose(src), _transpose_after(src, g),
                    torch.ops.fp8tensor.transpose_after(src, g)):
            assert got.shape == ref.shape and got.is_contiguous() and got.dtype == float8_dtype
            assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    torch._dynamo.reset()
    got = torch.compile(lambda a, b: _transpose_after(a, b * 2), fullgraph=True)(q, g)
    assert torch.equal(got.view(torch.uint8), q.t().contiguous().view(torch.uint8))


@pytest.mark.parametrize("shape", [(8, 2048, 7168), (128, 768, 2048), (3, 129, 1), (1, 77, 300)])
def test_batched_transpose_kernel_bit_identical(shape):
    """Expert weights ``(E, N, K)``: the batched fp8 transpose (eager, the op, compiled) is
    ``q.transpose(-2, -1).contiguous()`` bit for bit, also for a slice of experts out of a wider buffer."""
    from fp8tensor.quantize import transpose_after as _transpose_after

    q = (torch.randn(*shape, device=DEV) * 50).to(torch.float8_e4m3fn)
    g = torch.randn(4, 8, device=DEV)
    for src in (q, torch.cat([q, q], dim=-2)[:, : shape[1]]):
        ref = src.transpose(-2, -1).contiguous()
        assert kernels.transpose_available(src)
        for got in (kernels.launch_transpose(src), _transpose_after(src, g),
                    torch.ops.fp8tensor.transpose_after(src, g)):
            assert got.shape == ref.shape and got.is_contiguous() and got.dtype == src.dtype
            assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    torch._dynamo.reset()
    got = torch.compile(lambda a, b: _transpose_after(a, b * 2), fullgraph=True)(q, g)
    assert torch.equal(got.view(torch.uint8), q.transpose(-2, -1).contiguous().view(torch.uint8))


def test_quantize_columns_after_matches_dim0_t():
    """``quantize_dim0_t_after`` (eager direct launch, the op, compiled) gives the bits of ``quantize_dim0_t``, also
    when ``after`` holds NaN or inf."""
    from fp8tensor.quantize import quantize_dim0_t_after

    w = torch.randn(1000, 300, device=DEV) * torch.rand(1000, 1, device=DEV)
    w[:, 7] = 0.0  # an all-zero column: the floor scale
    qr, sr = quantize_dim0_t(w, torch.float8_e4m3fn)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: quantize_dim0_t_after(a, b), fullgraph=True)
    for bad in (0.0, float("nan"), float("inf"), -float("inf")):
        g = torch.randn(4, 4, device=DEV)
        g[0, 0] = bad
        for q, s in (quantize_dim0_t_after(w, g),
                     torch.ops.fp8tensor.quantize_columns_after(w, g, torch.float8_e4m3fn),
                     compiled(w, g)):
            assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_kernel_with_folded_column_scales_matches_the_ops(dtype):
    """The row-wise kernel with ``col_scale`` (grad_out times the weight's row scales, as grad_input's GEMM folds
    them) gives the bits of the plain ops on ``x.float() * col_scale``, including NaN / inf / zero rows and columns
    whose multiplier is zero."""
    from fp8tensor.numerics import kernels
    from fp8tensor.quantize import SCALE_FLOOR, cast_to_fp8, rowwise_scale

    x = (torch.randn(333, 4100, device=DEV) * torch.logspace(-3, 3, 333, device=DEV)[:, None]).to(dtype)
    x[5] = 0.0
    x[9, 17] = float("nan")
    x[11, 3] = float("inf")
    c = torch.rand(1, 4100, device=DEV) * 3
    c[0, 100] = 0.0
    q, s = kernels.quantize_last_dim(x, torch.float8_e4m3fn, SCALE_FLOOR, col_scale=c.reshape(-1))
    xf = x.float() * c
    rs = rowwise_scale(xf, -1, torch.float8_e4m3fn)
    rq = cast_to_fp8(xf, rs, torch.float8_e4m3fn)
    finite = torch.isfinite(rs).reshape(-1)  # a NaN / inf row: non-finite either way (inf scale here, NaN there)
    assert torch.equal(q[finite].view(torch.uint8), rq[finite].view(torch.uint8))
    assert torch.equal(s[finite], rs[finite]) and not torch.isfinite(s[~finite]).any()
    with pytest.raises(ValueError, match="col_scale"):
        kernels.quantize_last_dim(x, torch.float8_e4m3fn, SCALE_FLOOR, col_scale=c.reshape(-1)[:-1])


@pytest.mark.parametrize("ends", [[0, 100, 101, 250], [333], [40, 40, 40, 300]])
def test_row_kernel_with_grouped_column_scales_matches_the_ops(ends):
    """The row-wise kernel with one row of multipliers per token group (``quantize(..., col_scale=(G, K),
    col_scale_ends=offs)``: fp8 expert weights' row scales folded into grad_out) gives the bits of the plain ops on
    ``x.float() * col_scale[group of each row]``: empty groups, rows past the last end (the last group's row), a
    NaN / inf row."""
    from fp8tensor.quantize import SCALE_FLOOR, cast_to_fp8, quantize, rowwise_scale

    x = (torch.randn(333, 4100, device=DEV) * torch.logspace(-3, 3, 333, device=DEV)[:, None]).to(torch.bfloat16)
    x[5] = 0.0
    x[9, 17] = float("nan")
    x[11, 3] = float("inf")
    offs = torch.tensor(ends, dtype=torch.int32, device=DEV)
    c = torch.rand(len(ends), 4100, device=DEV) * 3
    c[0, 100] = 0.0
    q, s = quantize(x, -1, torch.float8_e4m3fn, col_scale=c, col_scale_ends=offs)
    gid = torch.searchsorted(offs, torch.arange(333, device=DEV, dtype=torch.int32), right=True).clamp(max=len(ends) - 1)
    xf = x.float() * c[gid]
    rs = rowwise_scale(xf, -1, torch.float8_e4m3fn)
    rq = cast_to_fp8(xf, rs, torch.float8_e4m3fn)
    finite = torch.isfinite(rs).reshape(-1)
    assert int((~finite).sum()) == 2
    assert torch.equal(q[finite].view(torch.uint8), rq[finite].view(torch.uint8))
    assert torch.equal(s[finite], rs[finite]) and not torch.isfinite(s[~finite]).any()


@pytest.mark.parametrize("weights", ["master", "fp8"])
def test_compiled_backward_weight_ops_in_backward_and_not_saved(weights):
    """Compiled (inductor, CUDA): the backward's weight operand — the fp8 weight's transposed copy or the master's
    per-column quantization — is made in the *backward* graph (the forward saves nothing of the weight's size); the
    dim-0 quantizations run as inline kernels; Linears reading one input (q/k/v) save one fp8 copy of it, not one
    each; gradients match eager fp8 within fp8 noise."""
    import torch.nn as nn
    from torch._inductor.utils import run_and_get_code
    from torch.autograd.graph import saved_tensors_hooks

    import fp8tensor

    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(512, 768, bias=False) for _ in range(3))

        def forward(self, x):
            return self.q(x) * self.k(x) + self.v(x)

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = QKV().to(DEV, torch.bfloat16)
    m = fp8tensor.quantize_weights(m) if weights == "fp8" else fp8tensor.convert_to_fp8(m)
    x = torch.randn(1024, 512, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(1024, 768, device=DEV, dtype=torch.bfloat16)

    def step(mod):
        x.grad = None
        mod(x).backward(gy)
        return x.grad.clone()

    ref = step(m)
    mc = torch.compile(m, fullgraph=True)
    got, codes = run_and_get_code(step, mc)
    code = "\n".join(codes)
    assert "torch.ops.fp8tensor.quantize_dim0_t" not in code  # dim-0 kernels inline (grad_weight of a master)
    # x and grad_out per row and per feature from two reads (grad_weight of a master); frozen fp8 weights: none
    assert ("_amax_both_kernel" in code) == (weights == "master")
    assert "torch.ops.fp8tensor.quantize_both" not in code
    # the weight's transposed copy / per-column quantization: plain ops inductor generates, no opaque Python op
    assert "torch.ops.fp8tensor.transpose_after" not in code
    assert "torch.ops.fp8tensor.quantize_columns_after" not in code
    fp8_saved = []

    def pack(t):
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            fp8_saved.append(t.numel())
            if t.numel() == 768 * 512:  # the frozen weights' own fp8 data may be saved (no copy), nothing else
                assert t.untyped_storage().data_ptr() in own, "a weight-sized fp8 copy is saved for backward"
        return t

    own = {lin.weight.qdata.untyped_storage().data_ptr() for lin in (m.q, m.k, m.v)} if weights == "fp8" else set()
    with saved_tensors_hooks(pack, lambda t: t):
        mc(x)
    assert weights == "fp8" or 768 * 512 not in fp8_saved, f"weight-sized fp8 saved: {fp8_saved}"
    assert sum(n == 1024 * 512 for n in fp8_saved) <= 1, f"one fp8 x for q/k/v, got {fp8_saved}"
    err = (got.double() - ref.double()).norm() / ref.double().norm()
    assert err < 2e-2, err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(333, 4100), (2, 7, 40), (1, 64), (4096, 1), "strided"])
def test_token_layouts_match_the_ops(shape, dtype):
    """``quantize_token_layouts`` (row and column amax in one pass, both layouts from one read of each tile): per row
    and per column the scales of the plain ops and their fp8 values but at rounding ties, eager and compiled; NaN /
    inf entries make their row's and column's scale non-finite and leave the others exact; zero rows and columns get
    the floor scale."""
    from torch._inductor.utils import run_and_get_code

    from fp8tensor.quantize import cast_to_fp8, quantize_token_layouts, rowwise_scale

    torch.manual_seed(0)
    if shape == "strided":  # a 2-D view whose rows are wider than K
        x = torch.randn(700, 300, device=DEV).to(dtype)[:, :250]
    else:
        x = (torch.randn(*shape, device=DEV) * torch.logspace(-3, 3, shape[-1], device=DEV)).to(dtype)
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M > 20 and K > 20:
        x2[5] = 0.0
        x2[:, 7] = 0.0
        x2[9, 17] = float("nan")
        x2[11, 3] = float("inf")
    f8 = torch.float8_e4m3fn
    torch._dynamo.reset()
    (cq, cs, cqt, cst), codes = run_and_get_code(torch.compile(lambda t: quantize_token_layouts(t * 1.0)), x)
    assert "_amax_both_kernel" in "\n".join(codes) and "torch.ops.fp8tensor.quantize_both" not in "\n".join(codes)
    for q, s, qt, st in (quantize_token_layouts(x), (cq, cs, cqt, cst)):
        assert q.shape == (M, K) and q.is_contiguous() and s.shape == (M, 1)
        assert qt.shape == (M, K) and qt.t().is_contiguous() and st.shape == (1, K)
        for data, got_q, got_s in ((x2, q, s), (x2.t(), qt.t(), st.t())):
            rs = rowwise_scale(data, -1, f8)
            rq = cast_to_fp8(data, rs, f8)
            ok = torch.isfinite(rs).reshape(-1)
            assert torch.equal(got_s[ok], rs[ok]) and not torch.isfinite(got_s[~ok]).any()
            # x times the reciprocal scale: one e4m3 step apart at most, and only at rounding ties
            diff = (got_q[ok].float() - rq[ok].float()).abs()
            assert float((diff > 0).float().mean()) < 1e-4, float((diff > 0).float().mean())
            assert bool((diff <= rq[ok].float().abs() * 2**-3 + 2**-9).all())
    torch._dynamo.reset()


@pytest.mark.parametrize("shape", [(2, 512, 768), (3, 7, 40), (1024, 768)])
def test_quantize_tokens_nd_matches_reshaped_dim0(shape):
    """``quantize_tokens`` of an N-D input (eager direct launch and compiled) gives the bits of quantizing its
    ``(M, K)`` reshape along dim 0, in the same layout."""
    from fp8tensor.quantize import quantize_tokens

    x = torch.randn(*shape, device=DEV, dtype=torch.bfloat16) * 3
    qr, sr = quantize(x.reshape(-1, shape[-1]), 0, torch.float8_e4m3fn, gemm_layout=True)
    torch._dynamo.reset()
    for q, s in (quantize_tokens(x), torch.compile(lambda t: quantize_tokens(t * 1.0))(x)):
        assert q.shape == qr.shape and q.stride() == qr.stride() and s.shape == sr.shape == (1, shape[-1])
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
    torch._dynamo.reset()


@pytest.mark.parametrize("fast", [False, True])
def test_fast_launch_bit_identical_to_jit(fast, monkeypatch):
    """Eager kernels give the same bits through the direct launcher (second and later launches of an argument class)
    as through Triton's JIT (the path of a Triton without the direct entry point); a misaligned view starts a class of
    its own (its own compiled kernel)."""
    monkeypatch.setattr(kernels, "_FAST_OK", fast and kernels._FAST_OK)
    torch.manual_seed(0)
    x = torch.randn(1031, 2048, device=DEV, dtype=torch.bfloat16) * 7
    q8 = (torch.randn(300, 1030, device=DEV) * 50).to(torch.float8_e4m3fn)
    flat = torch.cat([q8.view(torch.uint8).view(-1), q8.view(torch.uint8).view(-1)])[1:1 + q8.numel()]
    misaligned = flat.view(torch.float8_e4m3fn).view(300, 1030)  # data pointer not 16-byte aligned
    for _ in range(3):
        for src in (q8, misaligned):
            assert torch.equal(kernels.launch_transpose(src).view(torch.uint8), src.t().contiguous().view(torch.uint8))
        q, s = kernels.quantize_last_dim(x, torch.float8_e4m3fn, SCALE_FLOOR)
        q0, s0 = kernels.launch_dim0_t(x, torch.float8_e4m3fn, SCALE_FLOOR)
        qt, st = quantize_dim0_t(x, torch.float8_e4m3fn)
        assert torch.equal(q0.view(torch.uint8), qt.view(torch.uint8)) and torch.equal(s0, st)
        ref = {}
        with monkeypatch.context() as m:
            m.setattr(kernels, "_FAST_OK", False)
            ref["q"], ref["s"] = kernels.quantize_last_dim(x, torch.float8_e4m3fn, SCALE_FLOOR)
        assert torch.equal(q.view(torch.uint8), ref["q"].view(torch.uint8)) and torch.equal(s, ref["s"])


def test_local_group_payload_matches_packed_quantize():
    """FSDP2's 1-rank group payload on CUDA (one buffer, raw-address group launch) holds the bytes of
    ``pack(quantize(w))`` for every weight."""

    from fp8tensor import fsdp as payload
    from fp8tensor.master import Fp8MasterWeight

    torch.manual_seed(0)
    ws = [Fp8MasterWeight(torch.randn(n, k, device=DEV) * 3) for n, k in ((2048, 2048), (512, 2048), (7, 33), (1, 48))]
    finder, payload.fsdp_group = payload.fsdp_group, lambda local: (None, ws)
    try:
        for _ in range(2):
            got = [payload._quantized_rows(w, torch.float8_e4m3fn, True) for w in ws]
            for w, (_, _, buf) in zip(ws, got):
                qr, sr = quantize(w._data, -1)
                assert torch.equal(buf, payload.pack(qr, sr))
        # one weight alone (no group) takes the same one-launch path
        payload.fsdp_group = lambda local: (None, [])
        (_, _, buf) = payload._quantized_rows(ws[0], torch.float8_e4m3fn, True)
        assert torch.equal(buf, payload.pack(*quantize(ws[0]._data, -1)))
    finally:
        payload.fsdp_group = finder
