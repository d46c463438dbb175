"""``torch.export`` of fp8 models: ``quantize_weights`` (inference, the deployment case) and ``convert_to_fp8``
(training models: the forward graph), strict and non-strict, static and dynamic batch / sequence dims,
``torch.export.save`` / ``load``.

What must hold, and the reference:

* the exported program's outputs equal the eager model's **bit for bit** (the same quantizations and the same
  ``torch._scaled_mm`` call run in both; CPU runs the real ``torch._scaled_mm`` for e4m3 with row-wise scales), on
  fresh random inputs, also at sizes other than the traced one (1 token included) when dims are dynamic;
* the weights stay fp8 in the program: its state holds the model's ScaledFp8Tensor (the same fp8 bytes and
  scales), and its decomposed graph (what AOTInductor compiles) feeds the fp8 weight bytes to ``_scaled_mm``
  without converting them to a high-precision dtype;
* what cannot be exported raises an error naming fp8tensor and the remedy, and leaves the model unchanged.
"""
from __future__ import annotations

import io

import warnings

import pytest
import torch
import torch.nn as nn

import fp8tensor
from fp8tensor import Fp8MasterWeight, ScaledFp8Tensor
from fp8tensor.quantize import FLOAT8_DTYPES

from conftest import E4M3_GEMM_BOUND, rel_err

STRICT = pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


class Block(nn.Module):
    """Two fp8-convertible Linears around a nonlinearity, a residual, one without bias."""

    def __init__(self, d=64, h=128, bias=True):
        super().__init__()
        self.up = nn.Linear(d, h, bias=bias)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _export(m, x, strict, dynamic_shapes=None):
    return torch.export.export(m, (x,), dynamic_shapes=dynamic_shapes, strict=strict)


def _fp8_weight_feeds(ep) -> dict:
    """For each fp8 placeholder of the decomposed program: the set of ops its value reaches before ``_scaled_mm``
    (only layout ops are allowed: a conversion to a high-precision dtype would be a dequantized weight)."""
    gm = ep.run_decompositions().graph_module
    out = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op != "placeholder" or not isinstance(val, torch.Tensor) or val.dtype not in FLOAT8_DTYPES:
            continue
        seen, todo = set(), list(node.users)
        while todo:
            u = todo.pop()
            name = getattr(u.target, "__name__", str(u.target))
            seen.add(name)
            if "_scaled_mm" not in name:
                todo.extend(u.users)
        out[node.name] = seen
    return out


def _assert_fp8_program(ep, model, n_weights):
    feeds = _fp8_weight_feeds(ep)
    assert len(feeds) == n_weights, f"expected {n_weights} fp8 weight inputs, got {sorted(feeds)}"
    for name, ops in feeds.items():
        assert any("_scaled_mm" in o for o in ops), (name, ops)
        assert ops <= {"permute.default", "t.default", "_scaled_mm.default", "transpose.int", "view.default",
                       "clone.default", "expand.default"}, (name, ops)
    for key, w in model.state_dict().items():
        if isinstance(w, ScaledFp8Tensor):
            got = ep.state_dict[key]
            assert type(got) is ScaledFp8Tensor, (key, type(got))
            assert torch.equal(got.qdata.view(torch.uint8), w.qdata.view(torch.uint8))
            assert torch.equal(got.scale, w.scale)


@STRICT
@DTYPES
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("ndim", [2, 3])
def test_quantized_linear_exports_bit_exact(strict, dtype, bias, ndim):
    m = fp8tensor.quantize_weights(nn.Linear(64, 32, bias=bias).to(dtype))
    shape = (8, 64) if ndim == 2 else (2, 5, 64)
    x = torch.randn(shape, dtype=dtype)
    ep = _export(m, x, strict)
    _assert_fp8_program(ep, m, 1)
    for _ in range(2):  # fresh inputs of the traced shape
        x = torch.randn(shape, dtype=dtype) * 3
        y = ep.module()(x)
        assert y.dtype == dtype and y.shape == (*shape[:-1], 32)
        assert torch.equal(y, m(x))


@STRICT
@DTYPES
def test_dynamic_batch_and_sequence(strict, dtype):
    m = fp8tensor.quantize_weights(Block().to(dtype))
    x = torch.randn(3, 7, 64, dtype=dtype)
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=1, max=2048)
    ep = _export(m, x, strict, dynamic_shapes=({0: batch, 1: seq},))
    _assert_fp8_program(ep, m, 2)
    run = ep.module()
    for shape in [(1, 1, 64), (1, 9, 64), (5, 1, 64), (4, 33, 64), (3, 7, 64)]:
        x = torch.randn(shape, dtype=dtype)
        assert torch.equal(run(x), m(x)), shape


@STRICT
def test_dynamic_tokens_2d(strict):
    m = fp8tensor.quantize_weights(nn.Linear(64, 48).to(torch.bfloat16))
    tokens = torch.export.Dim("tokens", min=1, max=4096)
    ep = _export(m, torch.randn(16, 64, dtype=torch.bfloat16), strict, dynamic_shapes=({0: tokens},))
    for n in (1, 2, 17, 300):
        x = torch.randn(n, 64, dtype=torch.bfloat16)
        assert torch.equal(ep.module()(x), m(x)), n


@STRICT
def test_save_load_round_trip(strict, tmp_path):
    m = fp8tensor.quantize_weights(Block(bias=True).to(torch.bfloat16))
    batch = torch.export.Dim("batch", min=1, max=32)
    ep = _export(m, torch.randn(4, 64, dtype=torch.bfloat16), strict, dynamic_shapes=({0: batch},))
    path = tmp_path / "fp8.pt2"
    torch.export.save(ep, path)
    ep2 = torch.export.load(path)
    _assert_fp8_program(ep2, m, 2)
    for n in (1, 4, 11):
        x = torch.randn(n, 64, dtype=torch.bfloat16)
        assert torch.equal(ep2.module()(x), m(x)), n
    buf = io.BytesIO()  # file objects too
    torch.export.save(ep, buf)
    buf.seek(0)
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    assert torch.equal(torch.export.load(buf).module()(x), m(x))


@STRICT
@DTYPES
def test_converted_training_model_exports_forward(strict, dtype):
    """convert_to_fp8: the exported forward quantizes the high-precision master on use, as eager does."""
    m = fp8tensor.convert_to_fp8(Block().to(dtype))
    x = torch.randn(2, 6, 64, dtype=dtype)
    ep = _export(m, x, strict)
    sd = ep.state_dict
    assert type(sd["up.weight"]) is Fp8MasterWeight and sd["up.weight"].dtype == dtype
    code = ep.run_decompositions().graph_module.code
    assert code.count("torch.ops.aten._scaled_mm.default(") == 2
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 6, 64, dtype=dtype)
            assert torch.equal(ep.module()(x), m(x))


def test_eager_model_unchanged_by_export():
    """Exporting changes nothing the user owns: same parameters (objects, bytes) and the same eager outputs."""
    m = fp8tensor.quantize_weights(Block().to(torch.bfloat16))
    before = {k: (v, v.qdata.clone() if isinstance(v, ScaledFp8Tensor) else v.detach().clone())
              for k, v in m.state_dict(keep_vars=True).items()}
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    y = m(x)
    torch.export.export(m, (x,))
    for k, v in m.state_dict(keep_vars=True).items():
        assert v is before[k][0], k
        got = v.qdata if isinstance(v, ScaledFp8Tensor) else v.detach()
        assert torch.equal(got.view(torch.uint8) if got.dtype in FLOAT8_DTYPES else got,
                           before[k][1].view(torch.uint8) if got.dtype in FLOAT8_DTYPES else before[k][1]), k
    assert type(m.up).__name__ == "Fp8Linear" and torch.equal(m(x), y)


class _PlainWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 64))

    def forward(self, x):
        return fp8tensor.fp8_linear(x, self.w)


@STRICT
def test_plain_weight_fp8_linear_exports(strict):
    """fp8_linear of a plain high-precision weight: the program quantizes it per row on each call, as each eager call
    does (outputs equal bit for bit), and keeps it a parameter of the program, not a constant."""
    m = _PlainWeight()
    x = torch.randn(4, 64)
    ep = torch.export.export(m, (x,), strict=strict)
    assert "w" in ep.state_dict and ep.state_dict["w"].dtype == torch.float32
    # the eager call's fast-accumulation flag (CPU's _scaled_mm ignores it, so outputs cannot show it); no
    # _scaled_mm where this torch's CPU GEMM is emulated (torch 2.11)
    fast = fp8tensor.RECIPES["rowwise"].output.fast_accum
    for node in ep.run_decompositions().graph_module.graph.nodes:
        if node.target is torch.ops.aten._scaled_mm.default:
            flag = node.kwargs.get("use_fast_accum", node.args[7] if len(node.args) > 7 else False)
            assert flag is fast, node.format_node()
    for _ in range(2):
        x = torch.randn(4, 64)
        assert torch.equal(ep.module()(x), m(x))
    with torch.no_grad():  # the program reads the parameter it was given, quantized when it runs
        prog = ep.module()
        prog.w.mul_(2)
        m.w.mul_(2)
    assert torch.equal(prog(x), m(x))


class _TiedLM(nn.Module):
    """An embedding, a Linear, and an output head tied to the embedding (a plain Parameter after convert_to_fp8)."""

    def __init__(self, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.proj = nn.Linear(32, 32)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight if tied else nn.Parameter(self.embed.weight.detach().clone())

    def forward(self, ids):
        return self.head(self.proj(self.embed(ids)))


@STRICT
@pytest.mark.parametrize("fp8_all_gather", [None, False], ids=["default", "bf16_all_gather"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_converted_plain_weights_export(strict, fp8_all_gather, tied):
    """convert_to_fp8 leaves a weight a plain Parameter with fp8_all_gather=False, and an output head tied to the
    embedding always: their exported forward quantizes them in the program, as eager does (equal bit for bit)."""
    torch.manual_seed(0)
    m = _TiedLM(tied)
    kw = {} if fp8_all_gather is None else {"fp8_all_gather": fp8_all_gather}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the tied head left in high precision: the conversion says so)
        fp8tensor.convert_to_fp8(m, **kw)
    ids = torch.randint(0, 64, (2, 8))
    ep = torch.export.export(m, (ids,), strict=strict)
    for _ in range(2):
        ids = torch.randint(0, 64, (2, 8))
        with torch.no_grad():
            assert torch.equal(ep.module()(ids), m(ids))


@STRICT
def test_example_llama_dynamic_sequence(strict):
    """The README's example model (examples/llama.py, small): quantize_weights, export with a dynamic sequence dim,
    run at other lengths (1 token included): logits equal eager bit for bit."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
    from llama import Llama, ModelArgs

    args = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=64)
    m = fp8tensor.quantize_weights(Llama(args).to(torch.bfloat16)).eval()
    seq = torch.export.Dim("seq", min=1, max=64)
    ep = torch.export.export(m, (torch.randint(0, 256, (2, 16)),), dynamic_shapes=({1: seq},), strict=strict)
    n_linear = sum(isinstance(p, ScaledFp8Tensor) for p in m.parameters())
    assert n_linear == 2 * 7 + 1
    _assert_fp8_program(ep, m, n_linear)
    for T in (1, 7, 16, 64):
        ids = torch.randint(0, 256, (2, T))
        assert torch.equal(ep.module()(ids), m(ids)), T


@pytest.mark.parametrize("f8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_other_formats_and_no_grad(f8):
    """e5m2 weights and float16 models export too, also traced under torch.no_grad()."""
    m = fp8tensor.quantize_weights(nn.Linear(64, 32).to(torch.float16), float8_dtype=f8)
    with torch.no_grad():
        ep = torch.export.export(m, (torch.randn(5, 64, dtype=torch.float16),))
    assert ep.state_dict["weight"].qdata.dtype == f8
    x = torch.randn(5, 64, dtype=torch.float16)
    assert torch.equal(ep.module()(x), m(x))


def test_training_model_program_saved_after_decompositions(tmp_path):
    """A ``convert_to_fp8`` model's exported program, decomposed, saves and loads with its quantization in the graph:
    the loaded program equals eager to the bit (docs/serving.md: save after ``run_decompositions``)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    fp8tensor.convert_to_fp8(m)
    x = torch.randn(2, 7, 64)
    ep = torch.export.export(m, (x,)).run_decompositions()
    assert "_scaled_mm" in ep.graph_module.code
    torch.export.save(ep, str(tmp_path / "m.pt2"))
    loaded = torch.export.load(str(tmp_path / "m.pt2"))
    x = torch.randn(2, 7, 64)
    with torch.no_grad():
        assert torch.equal(loaded.module()(x), m(x))


class _Experts(nn.Module):
    """A grouped-experts module (``torch._grouped_mm`` on 3-D ``[E, out, in]`` weights), as torchtitan's."""

    def __init__(self, E=4, d=32, h=64):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, h, d) / d ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, d, h) / h ** 0.5)

    def forward(self, x, counts):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = torch.relu(torch._grouped_mm(x, self.w1.to(x.dtype).transpose(-2, -1), offs=offs))
        return torch._grouped_mm(h, self.w2.to(x.dtype).transpose(-2, -1), offs=offs)


def _experts_f64(m: _Experts, x, counts, w1, w2):
    out, start = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64), 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start:start + n].double()
        out[start:start + n] = torch.relu(xe @ w1[e].double().t()) @ w2[e].double().t()
        start += n
    return out


def _matches_eager_but_for_requantization(y, ref):
    """The exported experts equal eager up to the traced masked GEMMs' float32 sum order, which the second GEMM's
    row-wise quantization of the hidden activations can amplify: an element within float32 rounding of an e4m3
    rounding boundary rounds the other way (one e4m3 step, 2**-3 of it at most), so an occasional row differs by
    that much. Asserted: at most two rows differ beyond float32 sum order (1e-5 relative per row), and the whole
    output stays within one fp8 GEMM's bound of eager."""
    row_err = (y - ref).double().norm(dim=-1) / ref.double().norm(dim=-1).clamp_min(1e-30)
    flipped = (row_err > 1e-5).nonzero().flatten().tolist()
    assert len(flipped) <= 2, ("rows beyond float32 sum order", flipped, row_err.max().item())
    assert rel_err(y, ref) < E4M3_GEMM_BOUND, rel_err(y, ref)


@STRICT
@pytest.mark.parametrize("conversion", ["convert_to_fp8", "quantize_weights"])
def test_grouped_experts_export(strict, conversion):
    """Converted grouped experts export: the program reads the model's own (master or fp8) weights, its outputs are
    real tensors equal to eager's (up to the float32 sum order of the traced masked GEMMs, see
    :func:`_matches_eager_but_for_requantization`) and within the fp8 bound of float64 (empty groups, an unaligned
    total)."""
    m = _Experts()
    w1, w2 = m.w1.detach().clone(), m.w2.detach().clone()
    getattr(fp8tensor, conversion)(m)
    counts = torch.tensor([5, 0, 12, 3])
    ep = torch.export.export(m, (torch.randn(20, 32), counts), strict=strict)
    want = Fp8MasterWeight if conversion == "convert_to_fp8" else ScaledFp8Tensor
    assert all(type(v) is want for v in ep.state_dict.values()), {k: type(v) for k, v in ep.state_dict.items()}
    assert not ep.constants, list(ep.constants)  # (no weight captured as a traced constant)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(20, 32)
            y = ep.module()(x, counts)
            assert type(y) is torch.Tensor, type(y)
            _matches_eager_but_for_requantization(y, m(x, counts))
            assert rel_err(y, _experts_f64(m, x, counts, w1, w2)) < 2 * E4M3_GEMM_BOUND  # (two GEMMs in a row)


def test_cast_of_fp8_weight_exports_without_fallback_warning():
    """``w.to(dtype)`` of an fp8 weight in an exported program records ``aten._assert_tensor_metadata``, a metadata
    check: it reads the weight's metadata, not a dequantized copy (no "has no fp8 implementation" fallback, here
    raising), and a mismatch still raises."""
    m = fp8tensor.quantize_weights(_Experts())
    counts = torch.tensor([5, 0, 12, 3])
    x = torch.randn(20, 32)
    with fp8tensor.config(unknown_ops="raise"), torch.no_grad():
        ep = torch.export.export(m, (torch.randn(20, 32), counts), strict=False)
        _matches_eager_but_for_requantization(ep.module()(x, counts), m(x, counts))
        w = m.w1
        torch.ops.aten._assert_tensor_metadata(w, w.shape, w.stride(), torch.float32, device=w.device,
                                               layout=w.layout)
        with pytest.raises(RuntimeError, match="dtype"):
            torch.ops.aten._assert_tensor_metadata(w, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="size"):
            torch.ops.aten._assert_tensor_metadata(w, [1, 2, 3])
