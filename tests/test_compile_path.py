"""A compiled fp8 Linear trains through its autograd Function on every supported torch (CPU, ``aot_eager``), and a
compiled tensor-parallel fp8 Linear on a 1-rank mesh trains. See ``tests/_compile_path.py`` for what is checked and
why; ``tests/gpu/test_gpu_compile_path.py`` runs the same checks with inductor on CUDA."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fp8tensor
from fp8tensor import compat
from _compile_path import (check_compiled_matches_eager, check_compiled_tp_linear_trains,
                           check_compiled_under_stale_config_block, check_config_block_after_compiled_first,
                           check_converted_compiled_first,
                           check_functional_compiled_first, check_whole_model_compile_under_fsdp)


#: (weights, recipe): a frozen fp8 weight has no grad_weight GEMM, so its recipes do not differ.
WEIGHTS_RECIPES = [("master", "rowwise"), ("master", "rowwise_gw_hp"), ("fp8", "rowwise")]


@pytest.mark.parametrize("weights,recipe", WEIGHTS_RECIPES)
@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("ndim", [2, 3])
def test_compiled_linear_trains_like_eager(monkeypatch, ndim, fullgraph, weights, recipe):
    # aot_eager runs the traced ops as eager runs them: the compiled path is claimed bit-identical here.
    check_compiled_matches_eager(monkeypatch, device="cpu", ndim=ndim, weights=weights, recipe=recipe,
                                 fullgraph=fullgraph, backend="aot_eager", bit_exact=True)


def test_compiled_user_module_calling_fp8_linear_on_its_own_parameter():
    """``fp8_linear(x, self.weight, self.bias)`` with plain Parameters, compiled with fullgraph before anything of
    fp8tensor ran eagerly in the process, trains as eager does (it failed tracing its backward: a cache fp8tensor
    filled on first use was a side effect inside the traced autograd.Function)."""
    seed = torch.initial_seed()
    check_functional_compiled_first("cpu", "aot_eager", seed, bit_exact=True)


def test_converted_model_compiled_first_compiles_once():
    """Converted models (both recipes, a user subclass of nn.Linear, quantize_weights) compiled before any eager
    fp8tensor call in the process: no recompile over three calls, the same bits as the model compiled again and as
    eager (aot_eager), float64 bounds. The Linear forward's per-class memo was filled inside the compiled forward:
    dynamo guarded on it and recompiled at the second call, the first graph unlike the later ones."""
    check_converted_compiled_first("cpu", "aot_eager", torch.initial_seed(), bit_exact=True)


def test_whole_model_compile_under_fsdp_compiles_as_often_as_nn_linear():
    """Models of nn.Sequential blocks, fully_shard per block and on the root, compiled whole (fresh process): the
    blocks run eagerly (FSDP2's hooks graph-break the compile) and dynamo compiles each Linear's forward as a frame of
    its own, once per weight shape. The converted model compiles the same frames, graphs and recompiles as the
    unconverted one with hooked Linears (whose forwards torch compiles the same way), none for Linears of one shape,
    and matches eager fp8 and float64. Its export pre-hook was compiled as two frames of its own."""
    check_whole_model_compile_under_fsdp("cpu", "aot_eager", torch.initial_seed())


def test_compiled_linear_inside_a_config_block_made_stale_by_set_config(monkeypatch):
    """``set_config`` inside a ``fp8tensor.config`` block, then a compiled fp8 Linear: the settings read in its traced
    forward re-merge the block without caching it into the thread's state (a side effect inside the traced
    autograd.Function, which failed the trace). On CPU the forward is made to read the settings, as on CUDA."""
    check_compiled_under_stale_config_block(monkeypatch, device="cpu", backend="aot_eager", bit_exact=True,
                                            read_settings_in_forward=True)


def test_config_block_reaches_a_model_compiled_before_the_first_block():
    """A ``quantize_weights`` model compiled and called before any ``fp8tensor.config`` block in the thread (fresh
    process), then called inside ``config(weight_only_decode=False)``: the block reaches the compiled code (a graph
    traced under it). The thread-local settings state had class-level defaults, so the first graph was guarded on
    their absence from the thread-local ``__dict__``, which later blocks did not fail: every block was ignored."""
    check_config_block_after_compiled_first("cpu", "aot_eager", torch.initial_seed())


def test_compat_tracing_state_queries():
    """compat's answers in eager code, under torch.compile and under torch.export (strict and not)."""
    assert not compat.is_exporting() and not compat.is_compiling()
    seen = {}

    def probe(x, key):
        seen[key] = (compat.is_compiling(), compat.is_exporting())
        return x + 1

    torch._dynamo.reset()
    # read at trace time (the values are constants of the trace): a graph break would run probe eagerly instead
    torch.compile(lambda x: probe(x, "compile"), backend="eager", fullgraph=True)(torch.ones(2))
    assert seen["compile"] == (True, False), seen

    class M(nn.Module):
        def forward(self, x):
            return x * 3 if compat.is_exporting() else x + 1

    for strict in (True, False):
        ep = torch.export.export(M(), (torch.ones(2),), strict=strict)
        assert torch.equal(ep.module()(torch.ones(2)), torch.full((2,), 3.0)), f"strict={strict}"
    torch._dynamo.reset()
    assert torch.equal(torch.compile(M(), backend="eager", fullgraph=True)(torch.ones(2)), torch.full((2,), 2.0))
    assert torch.equal(torch.compile(M(), backend="aot_eager", fullgraph=False)(torch.ones(2)), torch.full((2,), 2.0))


@pytest.fixture
def one_rank_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if own:
            dist.destroy_process_group()


@pytest.mark.parametrize("style", ["colwise", "rowwise"])
def test_compiled_tensor_parallel_linear_trains(monkeypatch, one_rank_mesh, style):
    check_compiled_tp_linear_trains(monkeypatch, one_rank_mesh, style, device="cpu", backend="aot_eager")


@pytest.mark.parametrize("convert", ["quantize_weights", "convert_to_fp8"])
def test_compiling_a_converted_model_raises_no_dynamo_cache_warning(monkeypatch, convert):
    """Compiling a converted model warns nothing about fp8tensor's code: dynamo warns (once per process) about every
    ``functools.lru_cache`` function it traces ("Silent incorrectness is only a potential risk"), so none is traced."""
    import warnings

    import torch._dynamo.utils as dynamo_utils

    if hasattr(dynamo_utils, "warn_once_cache"):  # (dynamo's once-per-process memory of its warnings)
        monkeypatch.setattr(dynamo_utils, "warn_once_cache", set())
    torch.manual_seed(0)
    model = getattr(fp8tensor, convert)(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 32)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torch.no_grad():
            compiled(x)
        compiled(x.requires_grad_()).sum().backward()
    assert not [str(w.message) for w in seen if "lru_cache" in str(w.message)]


@pytest.mark.parametrize("style", ["colwise", "rowwise"])
def test_tensor_parallel_input_takes_both_layouts_eager_and_compiled(monkeypatch, one_rank_mesh, style):
    """A DTensor input's two-layout quantization (CUDA kernels, emulated here by the op's CPU path) runs on its local
    tensor, eager (DTensor built from the spec) and compiled (``from_local`` traced): output and gradients equal the
    path without it bit for bit (the same values)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from torch._dynamo.backends.debugging import aot_eager

    from fp8tensor.training import linear as L

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    base = nn.Linear(64, 96, dtype=torch.bfloat16)
    x = torch.randn(2, 20, 64, dtype=torch.bfloat16)
    gy = torch.randn(2, 20, 96, dtype=torch.bfloat16)

    graphs = []

    def recording_aot_eager(gm, example_inputs):
        graphs.append(gm.print_readable(print_output=False))
        return aot_eager(gm, example_inputs)

    def run(compiled):
        torch._dynamo.reset()
        model = nn.Sequential(nn.Linear(64, 96, dtype=torch.bfloat16))
        model[0].load_state_dict(base.state_dict())
        parallelize_module(model, one_rank_mesh, {"0": ColwiseParallel() if style == "colwise" else RowwiseParallel()})
        fp8tensor.convert_to_fp8(model)
        fn = torch.compile(model, backend=recording_aot_eager) if compiled else model
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.backward(gy)
        return full(y).detach(), xi.grad, full(model[0].weight.grad), full(model[0].bias.grad)

    without = run(False)
    calls = []

    def emulated(t, float8_dtype=torch.float8_e4m3fn):
        if not torch.compiler.is_compiling():  # (traced: no side effects inside the autograd Function's forward)
            calls.append(type(t).__name__)
        q, s, qt, st = torch.ops.fp8tensor.quantize_both(t.reshape(-1, t.shape[-1]), float8_dtype)
        return q, s, qt.t(), st.t()

    monkeypatch.setattr(L, "quantize_token_layouts", emulated)
    for compiled in (False, True):
        calls.clear()
        graphs.clear()
        got = run(compiled)
        taken = any("fp8tensor.quantize_both" in g for g in graphs) if compiled else calls == ["Tensor"]
        assert taken, f"compiled={compiled}: the input's two layouts were not taken ({calls})"
        for a, b, what in zip(got, without, ("out", "grad_input", "grad_weight", "grad_bias")):
            assert torch.equal(a, b), (compiled, what, (a.double() - b.double()).norm() / b.double().norm())
