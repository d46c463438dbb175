"""Converting after tensor parallelism when a framework wrapped the Linears' forward, on 2 gloo processes,
without torchtitan: ``parallelize_module`` (ColwiseParallel -> RowwiseParallel) and then, on every Linear, the
wrapper torchtitan's ``Module.parallelize`` sets (``lin.forward = forward_with_redistribution`` calling the bound
``nn.Linear.forward`` it captured, through a ``functools.partial`` as ``local_map`` builds).

Checked per rank:

* ``convert_to_fp8`` after TP + wrapper: no warning, both Linears converted, 3 fp8 GEMMs per Linear per
  forward+backward (6), and output, input gradient and weight gradients bit-identical to converting *before*
  parallelizing (the supported order: same fp8 numerics, same DTensor placements); against the float64 product of
  the same fp8 operands within fp8 GEMM bounds.
* A direct weight swap (``weight._local_tensor = Fp8MasterWeight(...)``, no module conversion) under the wrapper:
  ``F.linear`` on a DTensor never reaches the master's ``__torch_function__`` (DTensor disables it), so autograd
  records plain ``mm`` nodes: forward and grad_input run in fp8 on the master, grad_weight in high precision. It
  warns saying so, and runs exactly 2 fp8 GEMMs per forward+backward. ``convert_to_fp8`` on that model keeps the
  masters and gives the modules the fp8 forward: 3 fp8 GEMMs per Linear, no warning, same result as converting.

Data and weights are fresh per run (``FP8TENSOR_TEST_SEED`` replays).
"""
from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn as nn
from conftest import count_scaled_mm as _count_scaled_mm  # noqa: E402  (tests/ is on sys.path: pytest rootdir / the spawn harness)

pytestmark = pytest.mark.slow

WORLD = 2
D, H = 64, 128
FP8_GEMM_BOUND = 5e-2



def _titan_like_wrap(lin: nn.Linear) -> None:
    """The per-instance forward torchtitan's ``Module.parallelize`` sets (its structure, not its code)."""
    fn = functools.partial(lambda f, *a, **k: f(*a, **k), lin.forward)  # local_map's shape: a partial over func

    def forward_with_redistribution(*args, **kwargs):
        return fn(*args, **kwargs)

    lin.forward = forward_with_redistribution


def _model():
    return nn.Sequential(nn.Linear(D, H, bias=False), nn.GELU(), nn.Linear(H, D, bias=False))


def _tp(model, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _run(model, x):
    x = x.detach().clone().requires_grad_()
    with _count_scaled_mm() as n:
        y = model(x)
        y.backward(torch.ones_like(y))
    grads = [model[i].weight.grad.full_tensor() for i in (0, 2)]
    return y.detach(), x.grad, grads, n[0]


def gloo_entry(rank: int, world: int, seed: int) -> dict:
    import fp8tensor
    from fp8tensor import Fp8MasterWeight
    from fp8tensor.convert import Fp8LinearMixin
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(seed)  # same weights and data on every rank
    mesh = init_device_mesh("cpu", (world,))
    base = _model()
    x = torch.randn(16, D)
    fp8tensor.convert_to_fp8(nn.Linear(16, 16))(torch.randn(2, 16))  # the one-time CPU _scaled_mm probe

    before = _tp(fp8tensor.convert_to_fp8(copy.deepcopy(base)), mesh)
    after = _tp(copy.deepcopy(base), mesh)
    for i in (0, 2):
        _titan_like_wrap(after[i])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fp8tensor.convert_to_fp8(after)
    res = {
        "after_warnings": [str(m.message) for m in w],
        "after_converted": [isinstance(after[i], Fp8LinearMixin) for i in (0, 2)],
        "before": _run(before, x),
        "after": _run(after, x),
        "master0": after[0].weight.full_tensor().detach(),
        "master2": after[2].weight.full_tensor().detach(),
    }

    swap = _tp(copy.deepcopy(base), mesh)
    for i in (0, 2):
        _titan_like_wrap(swap[i])
        wt = swap[i].weight
        wt._local_tensor = Fp8MasterWeight(wt._local_tensor)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        res["swap"] = _run(swap, x)
    res["swap_warnings"] = [str(m.message) for m in w]
    for i in (0, 2):
        swap[i].weight.grad = None
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fp8tensor.convert_to_fp8(swap)  # the masters stay; the modules (and their wrappers) get the fp8 forward
        res["swap_converted"] = _run(swap, x)
    res["swap_converted_warnings"] = [str(m.message) for m in w]
    res["x"] = x
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _spawn import spawn

    return spawn(__name__, "gloo_entry", WORLD, tmp_path_factory.mktemp("wrapped_tp"), timeout=600)


def test_convert_after_tp_wrapper_converts_every_linear(results):
    for r in results:
        assert r["after_converted"] == [True, True]
        assert not [m for m in r["after_warnings"] if "convert_to_fp8" in m]


def test_convert_after_tp_wrapper_runs_three_fp8_gemms_per_linear(results):
    for r in results:
        assert r["before"][3] == 6 and r["after"][3] == 6


def test_convert_after_tp_wrapper_equals_convert_before_tp(results):
    from conftest import same_bits

    for r in results:
        (yb, gxb, gwb, _), (ya, gxa, gwa, _) = r["before"], r["after"]
        assert same_bits(ya, yb) and same_bits(gxa, gxb)
        assert all(same_bits(a, b) for a, b in zip(gwa, gwb))


def test_convert_after_tp_wrapper_values_vs_float64(results):
    from conftest import dequant_rowwise, rel_err

    for r in results:
        x = r["x"].double()
        w0 = r["master0"]
        h = dequant_rowwise(x, 1) @ dequant_rowwise(w0, 1).t()
        # the first GEMM's output (before GELU) is not returned; check the whole block against a float64 chain of
        # the same fp8 roundings of each GEMM's inputs: two fp8 GEMMs in series
        h = torch.nn.functional.gelu(h)
        y = dequant_rowwise(h, 1) @ dequant_rowwise(r["master2"], 1).t()
        assert rel_err(r["after"][0], y) < 2 * FP8_GEMM_BOUND


def test_direct_swap_under_a_wrapper_warns_and_runs_two_fp8_gemms(results):
    for r in results:
        assert r["swap"][3] == 4  # forward + grad_input of each of the 2 Linears; grad_weight in high precision
        assert any("grad_weight" in m and "high precision" in m for m in r["swap_warnings"]), r["swap_warnings"]


def test_convert_after_a_direct_swap_runs_three_fp8_gemms(results):
    from conftest import same_bits

    for r in results:
        assert r["swap_converted"][3] == 6 and r["swap_converted_warnings"] == []
        (ya, gxa, gwa, _), (ys, gxs, gws, _) = r["after"], r["swap_converted"]
        assert same_bits(ys, ya) and same_bits(gxs, gxa) and all(same_bits(a, b) for a, b in zip(gws, gwa))
