"""The decode GEMM's two reduces of its K split on CUDA (skipped without a GPU): ``reduce="in_kernel"`` (one launch,
per-tile arrival counters) gives the bits of ``"second_launch"`` on every shape, run after run, leaves its counters at
zero, runs on two streams at once, is captured by a CUDA graph (one launch per GEMM once the stream has its counters,
two before), and compiled models take it through ``fp8tensor::w8_mm_one_launch`` with eager's bits."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fp8tensor
from fp8tensor import kernels
from fp8tensor.quantize import quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda"
from conftest import rel_err  # noqa: E402


def _operands(M, N, K, dtype, bias, seed):
    g = torch.Generator(DEV).manual_seed(seed)
    x = torch.randn(M, K, device=DEV, generator=g).to(dtype)
    w = torch.randn(N, K, device=DEV, generator=g) * torch.logspace(-2, 1, N, device=DEV)[:, None]
    q, s = quantize(w, -1)
    b = torch.randn(N, device=DEV, generator=g).to(dtype) if bias else None
    return x, q, s, b


def _counters():
    idx = torch.cuda.current_device()
    return kernels._W8_COUNTERS.get((idx, torch.cuda.current_stream().cuda_stream))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K", [(1, 4096, 4096), (1, 1024, 4096), (8, 14336, 4096), (32, 4096, 14336),
                                   (17, 6144, 4096), (3, 70, 300), (1, 5, 1000), (64, 4096, 4096),
                                   (100, 1000, 2000), (128, 4096, 14336), (0, 64, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_in_kernel_reduce_has_the_second_launchs_bits(dtype, M, N, K, bias):
    seed = M * 7 + N + K
    x, q, s, b = _operands(M, N, K, dtype, bias, seed)
    two = kernels.launch_w8_mm(x, q, s, b, reduce="second_launch")
    one = kernels.launch_w8_mm(x, q, s, b, reduce="in_kernel")
    split = kernels._w8_mm_plan(M, N, K, x.device)[3] if M else 0
    assert one.shape == (M, N) and one.dtype == dtype
    assert torch.equal(one, two), (seed, split)
    for _ in range(20):  # the arrival order changes from run to run; the bits do not
        assert torch.equal(kernels.launch_w8_mm(x, q, s, b, reduce="in_kernel"), one), (seed, split)
    torch.cuda.synchronize()
    c = _counters()
    assert c is None or not c.any(), (seed, c.nonzero()[:5])
    if M:
        ref = x.double() @ (q.double() * s.double()).t() + (b.double() if bias else 0)
        # float32 sums of exact products, one rounding: 2^-8 (bf16) / 2^-11 (fp16) relative, with margin
        assert rel_err(one, ref) < (4e-3 if dtype == torch.bfloat16 else 6e-4), (seed, split)


def test_two_streams_at_once():
    # each stream has its own counters: GEMMs running side by side on two streams do not mix their arrivals
    x, q, s, b = _operands(4, 14336, 4096, torch.bfloat16, True, 0)
    ref = kernels.launch_w8_mm(x, q, s, b, reduce="second_launch")
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = {i: [] for i in range(2)}
    torch.cuda.synchronize()
    for _ in range(50):
        for i, st in enumerate(streams):
            with torch.cuda.stream(st):
                outs[i].append(kernels.launch_w8_mm(x, q, s, b, reduce="in_kernel"))
    torch.cuda.synchronize()
    assert all(torch.equal(o, ref) for i in outs for o in outs[i])


def _count_launches(monkeypatch):
    n = []
    real = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda fn, *a, **k: n.append(fn) or real(fn, *a, **k))
    return n


def test_cuda_graph_capture(monkeypatch):
    x, q, s, b = _operands(8, 4096, 4096, torch.bfloat16, True, 1)
    ref = kernels.launch_w8_mm(x, q, s, b, reduce="second_launch")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the warm-up makes this stream's counters
        kernels.launch_w8_mm(x, q, s, b, reduce="in_kernel")
    torch.cuda.current_stream().wait_stream(side)
    launches = _count_launches(monkeypatch)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        out = kernels.launch_w8_mm(x, q, s, b, reduce="in_kernel")
    assert launches == [kernels._w8_mm_kernel]  # one launch per GEMM
    xs = [x.clone(), torch.randn_like(x)]
    refs = [kernels.launch_w8_mm(xi, q, s, b, reduce="second_launch") for xi in xs]
    assert torch.equal(refs[0], ref)
    for _ in range(10):
        for xi, ri in zip(xs, refs):
            x.copy_(xi)  # the graph's input
            g.replay()
            assert torch.equal(out, ri)
    # a stream that never ran it eagerly: the capture keeps the two launches (counters are only made outside one)
    launches.clear()
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2, stream=torch.cuda.Stream()):
        out2 = kernels.launch_w8_mm(x, q, s, b, reduce="in_kernel")
    assert launches == [kernels._w8_mm_kernel, kernels._w8_mm_reduce_kernel]
    g2.replay()
    assert torch.equal(out2, ref)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_in_kernel_equals_eager(mode, monkeypatch):
    cfg = kernels.W8_MM_CONFIG
    monkeypatch.setattr(kernels, "W8_MM_CONFIG", kernels._frozen(
        dict({k: v for k, v in cfg.items() if k != "tiles"}, reduce="in_kernel",
             tiles={k: dict(v) for k, v in cfg["tiles"].items()})))
    torch.manual_seed(0)
    m = fp8tensor.quantize_weights(nn.Sequential(nn.Linear(512, 4096), nn.Linear(4096, 256, bias=False)).to(
        DEV, torch.bfloat16)).eval()
    torch._dynamo.reset()
    c = torch.compile(m, mode=mode)
    with torch.no_grad():
        for n in (1, 8, kernels.W8_MM_CONFIG["max_m"]):
            x = torch.randn(n, 512, device=DEV, dtype=torch.bfloat16)
            for _ in range(3):  # (reduce-overhead: warm-up, record, replay)
                if mode == "reduce-overhead":
                    torch.compiler.cudagraph_mark_step_begin()
                y = c(x).clone()
                assert torch.equal(y, m(x)), n
            with fp8tensor.config(weight_only_decode=False):
                assert rel_err(y, m(x)) < 0.1  # (sanity: the weight-only path ran, not garbage)
    torch._dynamo.reset()
