"""What a converted Linear keeps for backward, and that keeping only that changes no bit of any gradient.

Memory: every tensor autograd saves is seen through ``torch.autograd.graph.saved_tensors_hooks`` (eager Functions and
compiled graphs alike). Bytes are counted once per storage, so a tensor several Linears save counts once. What each
recipe must keep, for a Linear ``(N, K)`` on ``M`` tokens of dtype ``d``:

* ``rowwise``: ``x`` quantized per input feature over the tokens — ``M*K`` fp8 bytes plus ``K`` float32 scales — and
  no high-precision copy of ``x`` (``M*K*sizeof(d)`` bytes, 2x or 4x more); Linears reading the same input share it.
* ``rowwise_gw_hp``: ``x`` itself (its grad_weight GEMM is in high precision).
* the weight as the forward received it (the master parameter, or the fp8 weight) and never a quantized or transposed
  copy of it; nothing for grad_weight when the weight is frozen, no weight when ``x`` needs no gradient.

Numerics: :class:`_RequantizingFp8Linear` below is the straightforward formulation (saves ``x`` and the weight,
quantizes both again in backward), written with the package's public pieces. Outputs and gradients of the converted
modules must be *bit-identical* to it — plain tensors, masters in fp32/bf16, frozen fp8 weights, several Linears
sharing an input, ``torch.utils.checkpoint``, ``torch.compile`` and DTensor (``LocalTensorMode``).
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn

import fp8tensor.linear as linear_mod
from fp8tensor import Fp8MasterWeight, ScaledFp8Tensor, convert_to_fp8, quantize_weights
from fp8tensor.quantize import quantize
from fp8tensor.tensor import map_local
from fp8tensor.recipes import get_recipe

RECIPES = ["rowwise", "rowwise_gw_hp"]
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


# ================================================================================================ reference
def _q(t, dim, fast, dtype=torch.float8_e4m3fn):
    """``t`` (a tensor, master or fp8 weight, or a DTensor of one: each shard on its own) as a ScaledFp8Tensor
    quantized along ``dim``; an fp8 tensor is used as it is."""

    def one(lt):
        if isinstance(lt, ScaledFp8Tensor):
            return lt.with_fast_accum(fast)
        lt = lt._data if isinstance(lt, Fp8MasterWeight) else lt
        q, s = quantize(lt, dim, dtype, gemm_layout=True)
        return ScaledFp8Tensor(q, s, lt.dtype, fast)

    return map_local(t, one)


class _RequantizingFp8Linear(torch.autograd.Function):
    """The straightforward formulation: save x and W, quantize both again in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe):
        K, N = x.shape[-1], weight.shape[0]
        x2 = x.reshape(-1, K)
        w8 = _q(weight, -1, recipe.fast_accum_forward, recipe.float8_dtype)
        out = torch.mm(x2, w8.t())
        if bias is not None:
            out = out + bias
        ctx.recipe, ctx.has_bias = recipe, bias is not None
        ctx.save_for_backward(x, weight)
        return torch.ops.aten._unsafe_view(out, (*x.shape[:-1], N))

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        r = ctx.recipe
        K, N = x.shape[-1], weight.shape[0]
        g2 = grad_out.reshape(-1, N)
        fast = r.fast_accum_backward
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            fp8_weight = any(isinstance(loc, ScaledFp8Tensor) for loc in per_rank(weight))
            gx = torch.mm(g2, _q(weight, -1 if fp8_weight else 0, fast, r.float8_dtype)).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, K)
            gw = torch.mm(g2.t(), _q(x2, 0, fast, r.float8_dtype)) if r.grad_weight_fp8 else torch.mm(g2.t(), x2)
            gw = gw.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb, None


@pytest.fixture
def requantizing(monkeypatch):
    """Context switch: inside ``with requantizing():`` fp8 Linears run :class:`_RequantizingFp8Linear`."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        with monkeypatch.context() as m:
            m.setattr(linear_mod, "_Fp8Linear", _RequantizingFp8Linear)
            yield

    return ctx


# ================================================================================================ helpers
def _leaves(t):
    """Plain tensors holding ``t``'s bytes (DTensor / LocalTensor / ScaledFp8Tensor / master unwrapped)."""
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        return _leaves(local)
    shards = getattr(t, "_local_tensors", None)
    if isinstance(shards, dict):
        return [x for s in shards.values() for x in _leaves(s)]
    if isinstance(t, ScaledFp8Tensor):
        return _leaves(t.qdata) + _leaves(t.scale)
    if isinstance(t, Fp8MasterWeight):
        return _leaves(t._data)
    return [t]


class Saved:
    """Records what autograd saves inside the ``with`` block."""

    def __enter__(self):
        self.tensors = []
        self._h = torch.autograd.graph.saved_tensors_hooks(lambda t: self.tensors.append(t) or t, lambda t: t)
        self._h.__enter__()
        return self

    def __exit__(self, *exc):
        self._h.__exit__(*exc)

    def storages(self, exclude=()):
        """``{storage ptr: (nbytes, dtype)}`` of everything saved, minus the storages of ``exclude`` tensors."""
        skip = {leaf.untyped_storage().data_ptr() for t in exclude for leaf in _leaves(t)}
        out = {}
        for t in self.tensors:
            for leaf in _leaves(t):
                st = leaf.untyped_storage()
                if st.data_ptr() not in skip:
                    out[st.data_ptr()] = (st.nbytes(), leaf.dtype)
        return out


def _grads(mod, x):
    return [x.grad] + [p.grad for p in mod.parameters()]


def _assert_same(a, b, what):
    assert a is not None and b is not None, what
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a, b), f"{what}: not bit-identical (max diff {(a.float() - b.float()).abs().max().item():.3g})"


def _run(mod, x, g):
    for p in mod.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_()
    y = mod(x)
    y.backward(g)
    return y.detach(), _grads(mod, x)


def _compare(mod, x, g, requantizing, names=None):
    """Outputs and all gradients of ``mod`` equal, bit for bit, those of an identical copy run with the requantizing
    formulation."""
    ref = copy.deepcopy(mod)
    y, grads = _run(mod, x, g)
    with requantizing():
        yr, grads_r = _run(ref, x, g)
    _assert_same(y, yr, "output")
    names = names or ["x"] + [n for n, _ in mod.named_parameters()]
    for n, a, b in zip(names, grads, grads_r):
        if b is None:
            assert a is None, n
            continue
        _assert_same(a, b, f"grad of {n}")


class TwoHeads(nn.Module):
    """Two Linears reading the same input (as q/k/v or w1/w3), then one reading their product (as w2)."""

    def __init__(self, K=64, N=48, bias=False):
        super().__init__()
        self.a = nn.Linear(K, N, bias=bias)
        self.b = nn.Linear(K, N, bias=bias)
        self.c = nn.Linear(N, K, bias=bias)

    def forward(self, x):
        return self.c(torch.nn.functional.silu(self.a(x)) * self.b(x))


# ================================================================================================ what is saved
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_linear_saves_fp8_x_or_hp_x_and_the_master(recipe, dtype):
    M, K, N = 40, 64, 48
    lin = convert_to_fp8(nn.Linear(K, N, bias=True).to(dtype), recipe=recipe)
    x = torch.randn(4, M // 4, K, dtype=dtype, requires_grad=True)
    with Saved() as s:
        y = lin(x)
    saved = s.storages(exclude=[lin.weight, lin.bias])
    if recipe == "rowwise":
        # x quantized per feature over tokens: M*K fp8 bytes + K float32 scales; no high-precision activation
        assert sorted(saved.values(), key=lambda v: v[0]) == [(4 * K, torch.float32), (M * K, torch.float8_e4m3fn)]
        x8 = next(t for t in s.tensors if isinstance(t, ScaledFp8Tensor))
        assert x8.shape == (M, K) and x8.scale.shape == (1, K)
    else:
        assert list(saved.values()) == [(M * K * x.element_size(), dtype)]  # x itself, nothing else
        assert any(t is x for t in s.tensors)
    # the weight is saved as the forward got it (the master parameter), never a quantized copy
    assert any(t is lin.weight for t in s.tensors)
    assert not any(isinstance(t, ScaledFp8Tensor) and t.shape in ((N, K), (K, N)) for t in s.tensors)
    y.sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


@pytest.mark.parametrize("recipe", RECIPES)
def test_frozen_weight_saves_no_activation_and_no_grad_input_saves_no_weight(recipe):
    K, N = 64, 32
    lin = convert_to_fp8(nn.Linear(K, N, bias=False), recipe=recipe)
    lin.weight.requires_grad_(False)
    x = torch.randn(24, K, requires_grad=True)
    with Saved() as s:
        y = lin(x)
    assert s.storages(exclude=[lin.weight]) == {}  # grad_input needs only the weight
    y.sum().backward()
    assert x.grad is not None

    lin.weight.requires_grad_(True)
    x = torch.randn(24, K)  # no grad for x: no weight kept
    with Saved() as s:
        y = lin(x)
    assert not any(t is lin.weight for t in s.tensors)
    assert all(leaf.dtype in FP8 + (torch.float32,) for t in s.tensors for leaf in _leaves(t)) if recipe == "rowwise" \
        else all(t is x for t in s.tensors)
    y.sum().backward()
    assert lin.weight.grad is not None


def test_linears_sharing_an_input_each_save_their_own_fp8_copy():
    """Eager Linears reading one input each save their own fp8 copy of it (nothing is shared between calls, so an
    in-place write between them that bypasses the version counter cannot be missed); compiled graphs share one
    (``test_compiled_dim0_op_quantizes_one_input_once_and_a_modified_input_again``)."""
    M, K, N = 32, 64, 48
    m = convert_to_fp8(TwoHeads(K, N), recipe="rowwise")
    x = torch.randn(M, K, requires_grad=True)
    with Saved() as s:
        y = m(x)
    params = list(m.parameters())
    saved = s.storages(exclude=params)
    fp8 = [b for b, d in saved.values() if d in FP8]
    # one M*K copy for each of a and b, one M*N for c; no high-precision x, no (M, N) high-precision input of c
    assert sorted(fp8) == sorted([M * K, M * K, M * N])
    assert not any(b == M * K * 4 and d == torch.float32 for b, d in saved.values())
    y.sum().backward()


def test_input_modified_in_place_between_consumers_is_quantized_again(requantizing):
    K, N = 32, 16
    m = convert_to_fp8(nn.ModuleList([nn.Linear(K, N, bias=False), nn.Linear(K, N, bias=False)]), recipe="rowwise")
    ref = copy.deepcopy(m)
    x0 = torch.randn(20, K)

    def run(mod, copy_first=False):
        x = x0.clone().requires_grad_()
        h = x * 1.0
        y0 = mod[0](h.clone() if copy_first else h)  # the requantizing one saves h itself: needs its own copy
        h.mul_(3.0)  # a new version: mod[1] must not reuse mod[0]'s copy
        y1 = mod[1](h)
        (y0.square().sum() + y1.square().sum()).backward()
        return [x.grad, mod[0].weight.grad, mod[1].weight.grad]

    got = run(m)
    with requantizing():
        want = run(ref, copy_first=True)
    for a, b in zip(got, want):
        _assert_same(a, b, "grad")


def test_frozen_fp8_weight_is_saved_as_is():
    K, N = 64, 48
    lin = quantize_weights(nn.Linear(K, N, bias=False))
    w = lin.weight
    assert isinstance(w, ScaledFp8Tensor)
    x = torch.randn(16, K, requires_grad=True)
    with Saved() as s:
        y = lin(x)
    assert s.storages(exclude=[w]) == {}  # no transposed / quantized copy of the fp8 weight
    y.sum().backward()


# ================================================================================================ bit-identical
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_gradients_bit_identical_to_requantizing(recipe, bias, dtype, requantizing):
    m = convert_to_fp8(TwoHeads(64, 48, bias=bias).to(dtype), recipe=recipe)
    x = torch.randn(3, 10, 64, dtype=dtype)
    g = torch.randn(3, 10, 64, dtype=dtype)
    _compare(m, x, g, requantizing)


def test_frozen_fp8_weights_bit_identical_to_requantizing(requantizing):
    m = TwoHeads(64, 48)
    quantize_weights(m)
    _compare(m, torch.randn(24, 64), torch.randn(24, 64), requantizing)


@pytest.mark.parametrize("recipe", RECIPES)
def test_checkpointing_bit_identical_to_requantizing(recipe, requantizing):
    from torch.utils.checkpoint import checkpoint

    class Ckpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = TwoHeads(64, 48)

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    m = convert_to_fp8(Ckpt(), recipe=recipe)
    x, g = torch.randn(2, 12, 64), torch.randn(2, 12, 64)
    _compare(m, x, g, requantizing)
    # and checkpointing itself changes nothing
    plain = convert_to_fp8(TwoHeads(64, 48), recipe=recipe)
    plain.load_state_dict({k.removeprefix("inner."): v for k, v in m.state_dict().items()})
    y, grads = _run(m, x, g)
    yp, grads_p = _run(plain, x, g)
    _assert_same(y, yp, "checkpointed output")
    for a, b in zip(grads, grads_p):
        _assert_same(a, b, "checkpointed grad")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_bit_identical_to_requantizing_compiled(recipe, backend, requantizing):
    torch._dynamo.reset()
    m = convert_to_fp8(TwoHeads(64, 48), recipe=recipe)
    ref = copy.deepcopy(m)
    x, g = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    mc = torch.compile(m, backend=backend, fullgraph=True)
    y, grads = _run(mc, x, g)
    torch._dynamo.reset()
    with requantizing():
        rc = torch.compile(ref, backend=backend, fullgraph=True)
        yr, grads_r = _run(rc, x, g)
    torch._dynamo.reset()
    _assert_same(y, yr, "compiled output")
    for a, b in zip(grads, grads_r):
        _assert_same(a, b, "compiled grad")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("weights", ["master", "fp8"])
def test_compiled_graph_keeps_no_copy_of_the_weight(weights, backend):
    """The compiled forward must not compute and save the backward's weight operand — a transposed copy of an fp8
    weight (as the weight FSDP2 gathers) or the per-column re-quantization of a master — next to the weight. With
    inductor (min-cut partitioner) the master's quantization is traced inline on the CPU (plain ops pinned after
    ``grad_out`` by ``fp8tensor.quantize.after_dep``), not an opaque op."""
    torch._dynamo.reset()
    M, K, N = 32, 64, 96
    m = quantize_weights(TwoHeads(K, N)) if weights == "fp8" else convert_to_fp8(TwoHeads(K, N))
    mc = torch.compile(m, backend=backend, fullgraph=True)
    x = torch.randn(M, K, requires_grad=True)
    if backend == "inductor":
        from torch._inductor.utils import run_and_get_code

        _, codes = run_and_get_code(lambda: mc(x).sum().backward())
        if weights == "master":
            assert "torch.ops.fp8tensor" not in "\n".join(codes)
    else:
        mc(x).sum().backward()  # compile fwd + bwd
    with Saved() as s:
        y = mc(x)
    weights = [t for t in m.parameters()]
    saved = s.storages(exclude=weights)
    big_fp8 = [b for b, d in saved.values() if d in FP8 and b >= N * K]
    assert big_fp8 == [], f"the compiled forward keeps fp8 weight copies: {big_fp8}"
    y.sum().backward()
    torch._dynamo.reset()


# ================================================================================================ DTensor
@pytest.fixture(scope="module")
def mesh2():
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("fake", rank=0, world_size=2)
    elif dist.get_world_size() != 2:
        pytest.fail(f"a process group of world size {dist.get_world_size()} is already initialized (left by an earlier test)")
    try:
        yield init_device_mesh("cpu", (2,)), LocalTensorMode(frozenset(range(2)))
    finally:
        if own:
            dist.destroy_process_group()


def _tp(m, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(m, mesh, {"a": ColwiseParallel(), "b": ColwiseParallel(), "c": RowwiseParallel()})


def per_rank(t):
    """The tensor each simulated rank holds (the local tensor of a DTensor under LocalTensorMode)."""
    loc = t.to_local() if hasattr(t, "to_local") else t
    shards = getattr(loc, "_local_tensors", None)
    return [shards[r] for r in sorted(shards)] if isinstance(shards, dict) else [loc]


@pytest.mark.parametrize("recipe", RECIPES)
def test_dtensor_saves_fp8_shards_and_is_bit_identical(recipe, mesh2, requantizing):
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.tensor import DTensor

    mesh, mode = mesh2
    M, K, N = 24, 64, 48
    with mode:
        m = _tp(convert_to_fp8(TwoHeads(K, N), recipe=recipe), mesh)
        ref = copy.deepcopy(m)
        x0 = torch.randn(M, K)
        g0 = torch.randn(M, K)
        x0 = LocalTensor({r: x0.clone() for r in range(2)})
        g0 = LocalTensor({r: g0.clone() for r in range(2)})

        x = x0.clone().requires_grad_()
        with Saved() as s:
            y = m(x)
        params = set(map(id, m.parameters()))
        acts = [t for t in s.tensors if id(t) not in params and isinstance(t, DTensor)]
        # the Linear inputs: x (M, K) for a and b, c's input (M, N) sharded on N
        inputs = [t for t in acts if tuple(t.shape) in ((M, K), (M, N))]
        kinds = {type(loc).__name__ for t in inputs for loc in per_rank(t)}
        if recipe == "rowwise":
            assert inputs and kinds == {"ScaledFp8Tensor"}, kinds  # fp8 per rank, never the high-precision x
            assert all(loc.scale.shape[0] == 1 for t in inputs for loc in per_rank(t))  # scaled over the tokens
            for t in inputs:  # bytes per rank: one fp8 byte per element of the rank's shard + 4 per feature
                for r, loc in enumerate(per_rank(t)):
                    q, sc = loc.qdata, loc.scale
                    q = per_rank(q)[r] if hasattr(q, "_local_tensors") else q
                    sc = per_rank(sc)[r] if hasattr(sc, "_local_tensors") else sc
                    m_r, k_r = q.shape
                    assert q.dtype == torch.float8_e4m3fn and q.untyped_storage().nbytes() == m_r * k_r
                    assert sc.dtype == torch.float32 and sc.numel() == k_r
        else:
            assert inputs and "ScaledFp8Tensor" not in kinds, kinds  # x in high precision
        y.backward(g0)
        grads = [x.grad] + [p.grad for p in m.parameters()]

        with requantizing():
            xr = x0.clone().requires_grad_()
            yr = ref(xr)
            yr.backward(g0)
        grads_r = [xr.grad] + [p.grad for p in ref.parameters()]

    for a, b in zip(per_rank(y), per_rank(yr)):
        _assert_same(a, b, "TP output")
    for ga, gb in zip(grads, grads_r):
        for a, b in zip(per_rank(ga), per_rank(gb)):
            _assert_same(a, b, "TP grad")


@pytest.mark.parametrize("shape", [(1, 16, 8), (5, 1, 8), (5, 16, 1), (0, 16, 8)], ids=["1tok", "K1", "N1", "0tok"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_small_shapes_bit_identical_to_requantizing(recipe, shape, requantizing):
    M, K, N = shape
    lin = convert_to_fp8(nn.Linear(K, N, bias=True), recipe=recipe)
    frozen = quantize_weights(nn.Linear(K, N, bias=False))
    for mod in (lin, frozen):  # 0 and 1 tokens, 1 input / 1 output feature are ordinary shapes
        x, g = torch.randn(M, K), torch.randn(M, N)
        try:
            with requantizing():
                _run(copy.deepcopy(mod), x, g)
        except Exception as e:  # noqa: BLE001 - a shape the previous formulation refused must still be refused
            with pytest.raises(type(e)):
                _run(mod, x, g)
            continue
        _compare(mod, x, g, requantizing)


# ================================================================================================ compiled sharing
def test_compiled_dim0_op_quantizes_one_input_once_and_a_modified_input_again(monkeypatch):
    """Under ``torch.compile`` the dim-0 triton op is decomposed into its kernels, which the compiler does not
    deduplicate; the trace memo (``quantize._trace_memo``) makes Linears reading one input (each with its own
    ``reshape`` of it) share one quantization (``fp8tensor::quantize_dim0_t_shared``, fp8tensor's own operands), and
    an input modified in place in between is quantized again."""
    from torch._subclasses.functional_tensor import FunctionalTensor

    import fp8tensor.quantize as qmod

    traced = []
    real = qmod._reference_dim0_t

    def counting(x, dt):
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        if isinstance(x, FunctionalTensor) and get_proxy_mode() is not None:  # traced into a graph
            traced.append(tuple(x.shape))
        return real(x, dt)

    monkeypatch.setattr(qmod, "_reference_dim0_t", counting)

    def f(x, op=torch.ops.fp8tensor.quantize_dim0_t_shared):
        a = op(x.reshape(-1, 8), torch.float8_e4m3fn)  # q, k, v: three views of one input
        b = op(x.reshape(-1, 8), torch.float8_e4m3fn)
        c = op(x.view(-1, 8), torch.float8_e4m3fn)
        x.mul_(3.0)  # a new value: must not reuse the copies above
        d = op(x.reshape(-1, 8), torch.float8_e4m3fn)
        return [t for pair in (a, b, c, d) for t in pair]

    x0 = torch.randn(2, 5, 8)
    want = f(x0.clone())
    counts = []
    # the memo serves the shared op only: the plain fp8tensor::quantize_dim0_t (same kernels) is the baseline
    for op in (torch.ops.fp8tensor.quantize_dim0_t_shared, torch.ops.fp8tensor.quantize_dim0_t):
        traced.clear()
        torch._dynamo.reset()
        got = torch.compile(functools.partial(f, op=op), backend="aot_eager", fullgraph=True)(x0.clone())
        for g, w in zip(got, want):
            assert torch.equal(g.float(), w.float())
        counts.append(len(traced))
    # per graph traced (AOT may trace more than once): 2 quantizations with the memo (before and after the in-place
    # update), 4 without. Without Triton the op is a plain (opaque) custom op: not traced into, nothing to count.
    from fp8tensor import kernels

    if kernels.HAS_TRITON:
        assert counts[0] > 0 and counts[0] * 2 == counts[1], counts
    torch._dynamo.reset()


@pytest.mark.parametrize("case", ["dynamic", "automatic_dynamic", "nested_region", "public_op_outputs_owned"])
def test_compiled_dim0_memo_bypassed_where_unsafe(case):
    """The trace memo stays out of the way where it cannot be right: symbolic shapes (no memo, no crash), a nested
    compile region (a graph of its own: no tensor of another graph is served), and the public op (its results are
    the caller's: modifying one in place must not change a later call's result)."""
    dt = torch.float8_e4m3fn
    shared = torch.ops.fp8tensor.quantize_dim0_t_shared

    def two(x):
        a = shared(x.reshape(-1, 8), dt)
        b = shared(x.reshape(-1, 8), dt)
        return a[0].float() * a[1] + b[0].float() * b[1]

    torch._dynamo.reset()
    if case == "dynamic":
        x = torch.randn(2, 5, 8)
        assert torch.equal(torch.compile(two, backend="aot_eager", dynamic=True, fullgraph=True)(x), two(x))
    elif case == "automatic_dynamic":
        g = torch.compile(two, backend="aot_eager")
        for n in (5, 7, 9):  # the second length recompiles with a symbolic length
            x = torch.randn(2, n, 8)
            assert torch.equal(g(x), two(x))
    elif case == "nested_region":
        region = getattr(torch.compiler, "nested_compile_region", None)
        if region is None:
            pytest.skip("torch.compiler.nested_compile_region is not in this torch")

        @region
        def blk(x, w):
            q, s = shared(x.reshape(-1, 8), dt)
            return (q.float() * s).sum() * w

        def f(x, w):
            q, s = shared(x.reshape(-1, 8), dt)
            return (q.float() * s).sum() + blk(x, w) + blk(x * 2, w)

        x, w = torch.randn(2, 5, 8), torch.randn(3)
        assert torch.equal(torch.compile(f, backend="aot_eager", fullgraph=True)(x, w), f(x, w))
    else:
        op = torch.ops.fp8tensor.quantize_dim0_t

        def f(x):
            q1, s1 = op(x.reshape(-1, 8), dt)
            s1.mul_(2.0)  # the caller's tensor
            q2, s2 = op(x.reshape(-1, 8), dt)
            return s1, s2

        x = torch.randn(2, 5, 8)
        e, c = f(x), torch.compile(f, backend="aot_eager", fullgraph=True)(x)
        assert torch.equal(e[0], c[0]) and torch.equal(e[1], c[1])
    torch._dynamo.reset()


def test_dim0_op_empty_feature_dim():
    q, s = torch.ops.fp8tensor.quantize_dim0_t(torch.zeros(4, 0), torch.float8_e4m3fn)
    assert q.shape == (0, 4) and s.shape == (0, 1)
    q, s = torch.ops.fp8tensor.quantize_dim0_t(torch.zeros(2, 3, 0), torch.float8_e4m3fn)
    assert q.shape == (0, 6) and s.shape == (0, 1)
