"""torch.export + AOTInductor of fp8 models on CUDA (skipped without a GPU).

``torch._inductor.aoti_compile_and_package`` of the exported ``quantize_weights`` model, loaded back with
``torch._inductor.aoti_load_package``, against the eager fp8 model. The fp8 weights and the ``torch._scaled_mm`` call
are the same; the input's row-wise quantization is generated code in the AOTI model (inductor's division and amax)
and Triton / the eager kernels in eager mode, so a scale may differ in its last bit and flip single fp8 roundings:
outputs agree to ``SAME_FP8`` (far below one fp8 rounding of the whole GEMM, ``E4M3_GEMM_BOUND``), and both are within
the fp8 bound of the float64 reference computed from the high-precision weights.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fp8tensor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda"

#: Loads an AOTInductor package of a plain bf16 ``nn.Linear`` (no fp8tensor) in a fresh process: some PyTorch builds
#: crash (segmentation fault in ``aoti_load_package``) on any package, which would take pytest down with it.
_CANARY = """
import torch
m = torch.nn.Linear(64, 32).cuda().bfloat16().eval()
x = torch.randn(4, 64, device='cuda', dtype=torch.bfloat16)
p = torch._inductor.aoti_compile_and_package(torch.export.export(m, (x,)), package_path=PATH)
assert torch.equal(torch._inductor.aoti_load_package(p)(x), m(x))
"""


def aoti_loads(tmp_dir) -> tuple:
    """``(ok, detail)``: whether this PyTorch build compiles and loads an AOTInductor package of a plain bf16 Linear
    (in a subprocess, so a crash cannot end the caller)."""
    import os
    import subprocess
    import sys

    code = _CANARY.replace("PATH", repr(os.path.join(str(tmp_dir), "canary.pt2")))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    return r.returncode == 0, f"exit code {r.returncode}: {(r.stderr or '').strip().splitlines()[-1:] }"


@pytest.fixture(scope="module")
def aoti_ok(tmp_path_factory):
    ok, detail = aoti_loads(tmp_path_factory.mktemp("canary"))
    if not ok:
        pytest.skip(f"this PyTorch build cannot load an AOTInductor package even of a plain bf16 nn.Linear "
                    f"({detail}); not an fp8tensor problem")
#: A GEMM with both operands rounded to e4m3: ~3.6 % relative error on Gaussian data (tests/conftest.py).
E4M3_GEMM_BOUND = 5e-2
#: AOTI vs eager fp8: the same fp8 weights and GEMM; a last-bit difference in an input scale flips single roundings.
SAME_FP8 = 1e-2


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm()).item()


class Block(nn.Module):
    def __init__(self, d=256, h=512):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _aoti(m, x, tmp_path, dynamic_shapes=None):
    ep = torch.export.export(m, (x,), dynamic_shapes=dynamic_shapes)
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "m.pt2"))
    return ep, torch._inductor.aoti_load_package(path)


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
def test_aoti_matches_eager(tmp_path, dtype, aoti_ok):
    hp = Block().to(DEV, dtype)
    ref64 = Block().to(DEV, torch.float64)
    ref64.load_state_dict(hp.state_dict())
    m = fp8tensor.quantize_weights(copy.deepcopy(hp))
    tokens = torch.export.Dim("tokens", min=1, max=4096)
    x = torch.randn(64, 256, device=DEV, dtype=dtype)
    ep, run = _aoti(m, x, tmp_path, dynamic_shapes=({0: tokens},))
    assert "_scaled_mm" in ep.run_decompositions().graph_module.code
    # the exported program always quantizes the input (the GEMM of training); eager decode-sized calls would take the
    # weight-only kernel, compared separately in tests/gpu/test_gpu_inference.py
    with torch.no_grad(), fp8tensor.config(weight_only_decode=False):
        for n in (1, 7, 64, 300):
            x = torch.randn(n, 256, device=DEV, dtype=dtype)
            y_aoti, y_eager = run(x), m(x)
            y_ep = ep.module()(x)
            assert torch.equal(y_ep, y_eager), n  # the exported program runs the eager ops
            assert y_aoti.dtype == dtype and y_aoti.shape == y_eager.shape
            assert rel(y_aoti, y_eager) < SAME_FP8, (n, rel(y_aoti, y_eager))
            want = ref64(x.double())
            assert rel(y_aoti, want) < 2 * E4M3_GEMM_BOUND, (n, rel(y_aoti, want))
            assert rel(y_eager, want) < 2 * E4M3_GEMM_BOUND, (n, rel(y_eager, want))


def test_aoti_example_llama(tmp_path, aoti_ok):
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
    from llama import Llama, ModelArgs

    args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=128)
    m = fp8tensor.quantize_weights(Llama(args).to(DEV, torch.bfloat16)).eval()
    seq = torch.export.Dim("seq", min=1, max=128)
    ep, run = _aoti(m, torch.randint(0, 512, (2, 32), device=DEV), tmp_path, dynamic_shapes=({1: seq},))
    with torch.no_grad(), fp8tensor.config(weight_only_decode=False):
        for T in (1, 17, 32, 128):
            ids = torch.randint(0, 512, (2, T), device=DEV)
            y, ref = run(ids), m(ids)
            assert torch.isfinite(y).all()
            # two layers of fp8 GEMMs in series: the logits agree within fp8 rounding of the chain
            assert rel(y, ref) < 2 * SAME_FP8, (T, rel(y, ref))


@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
def test_converted_plain_weight_export_on_cuda(strict):
    """A ``convert_to_fp8`` model whose Linears keep plain weights (``fp8_all_gather=False``) exports on CUDA: the
    program quantizes each weight per row when it runs, with the bits of eager's row kernel (tests/gpu/
    test_gpu_numerics.py) and eager's ``torch._scaled_mm`` call (fast accumulation included): outputs equal to eager
    bit for bit, both within the e4m3 bound of the float64 reference of the high-precision model."""
    torch.manual_seed(0)
    hp = Block().to(DEV, torch.bfloat16)
    m = fp8tensor.convert_to_fp8(copy.deepcopy(hp), fp8_all_gather=False)
    assert type(m.up.weight) is nn.Parameter
    x = torch.randn(8, 256, device=DEV, dtype=torch.bfloat16)
    ep = torch.export.export(m, (x,), strict=strict)
    with torch.no_grad():
        got, want = ep.module()(x), m(x)
        ref = hp.double()(x.double())
    assert torch.equal(got, want), rel(got, want)
    assert rel(want, ref) < 2 * E4M3_GEMM_BOUND
