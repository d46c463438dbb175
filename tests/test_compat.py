"""``fp8tensor.compat``: each private torch API the package uses exists and behaves as expected on the installed torch
(CI runs this on torch 2.13 and 2.14.1, the GPU tests on 2.11)."""
from __future__ import annotations

import torch
import torch.nn as nn

import fp8tensor
from fp8tensor import compat


def test_torch_version_parsed():
    assert compat.TORCH_VERSION >= (2, 11), torch.__version__
    assert compat._version("2.14.1+cu130") == (2, 14) and compat._version("2.13.0a0+git1234") == (2, 13)


def test_master_weights_get_the_default_foreach_and_fused_optimizer_paths():
    """Optimizers built without foreach= / fused= treat a master like a plain parameter (not a Python loop)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach
    from torch.utils._foreach_utils import _foreach_supported_types

    model = nn.Sequential(nn.Linear(16, 16))
    fp8tensor.convert_to_fp8(model)
    assert type(model[0].weight) is fp8tensor.Fp8MasterWeight
    assert fp8tensor.Fp8MasterWeight in _foreach_supported_types
    params = list(model.parameters())
    plain = list(nn.Linear(16, 16).parameters())
    # The same choice as for the plain model on this device (foreach on CUDA; on CPU PyTorch picks neither).
    assert _default_to_fused_or_foreach(params, False, False) == _default_to_fused_or_foreach(plain, False, False)
    assert _default_to_fused_or_foreach(params, False, True) == _default_to_fused_or_foreach(plain, False, True)


def test_dtensor_accessors():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        local = torch.randn(4, 3)
        d = DTensor.from_local(local, mesh, [Replicate()])
        assert compat.local_tensor(d).data_ptr() == local.data_ptr() and torch.equal(compat.local_tensor(d), local)
        assert tuple(compat.dtensor_spec(d).placements) == (Replicate(),)
        new = torch.randn(4, 3)
        compat.set_local_tensor(d, new)
        assert torch.equal(d.to_local(), new)
    finally:
        if own:
            dist.destroy_process_group()


def test_mode_queries():
    from torch.utils._python_dispatch import TorchDispatchMode

    assert not compat.dispatch_modes_active() and not compat.function_modes_active() and not compat.functorch_active()

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert compat.dispatch_modes_active()
    with torch.overrides.TorchFunctionMode():
        assert compat.function_modes_active()
    assert torch.func.grad(lambda x: (x * float(compat.functorch_active())).sum())(torch.ones(2)).sum() == 2


def test_fsdp2_accessors():
    """The FSDP2 internals fp8tensor reads and writes exist on this torch: states, groups, params, sharded state,
    flat shard, extension reset."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16))
        fp8tensor.convert_to_fp8(model)
        fully_shard(model[0], mesh=init_device_mesh("cpu", (1,)))
        state = compat.fsdp_module_state(model[0])
        assert state is not None and any(s is state for s in compat.fsdp_states())
        (group,) = compat.fsdp_param_groups(state)
        fps = compat.fsdp_params_of(group)
        assert [compat.fsdp_param_name(fp) for fp in fps] == ["weight", "bias"] or \
            sorted(compat.fsdp_param_name(fp).split(".")[-1] for fp in fps) == ["bias", "weight"]
        w = next(fp for fp in fps if compat.fsdp_param_name(fp).endswith("weight"))
        assert isinstance(compat.fsdp_sharded_local(w), fp8tensor.Fp8MasterWeight)
        assert compat.fsdp_is_sharded(w) and compat.fsdp_state_name(w) == "SHARDED"
        assert compat.fsdp_unsharded_param(w) is None or compat.fsdp_is_sharded(w)
        flat = compat.fsdp_flat_shard(w)
        compat.fsdp_set_flat_shard(w, flat)
        assert compat.fsdp_flat_shard(w) is flat
        compat.fsdp_reset_extension(w)
        out = model(torch.randn(3, 32))
        assert out.shape == (3, 16) and torch.isfinite(out).all()
    finally:
        if own:
            dist.destroy_process_group()


def test_prepend_forward_pre_hook_runs_first_and_compiles():
    """The hook runs before the hooks registered earlier, its handle removes it, and a compiled module with a closure
    hook behind it traces (torch 2.11's dynamo failed creating a guard after ``prepend=True``)."""
    order = []
    k = 7

    def closure_hook(m, args):  # a closure, as parallel styles' input hooks are
        order.append(("late", k))

    def first(m, args):
        order.append(("first", None))

    m = nn.Sequential(nn.Linear(4, 4))
    m[0].register_forward_pre_hook(closure_hook)
    handle = compat.prepend_forward_pre_hook(m[0], first)
    x = torch.randn(2, 4)
    m(x)
    assert order == [("first", None), ("late", 7)]
    order.clear()
    torch._dynamo.reset()
    out = torch.compile(m, backend="eager")(x)
    assert torch.allclose(out, m(x)) and order[:2] == [("first", None), ("late", 7)]
    handle.remove()
    order.clear()
    m(x)
    assert order == [("late", 7)]


def test_mode_and_autograd_state_helpers():
    from torch.utils._python_dispatch import TorchDispatchMode
    import torch.autograd.forward_ad as fwd

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert compat.dispatch_modes_active()
        with compat.disable_current_modes():
            assert not compat.dispatch_modes_active()
    seen = []
    torch.func.vmap(lambda t: seen.append(compat.is_functorch_wrapped(t)) or t)(torch.ones(2, 3))
    assert seen == [True] and not compat.is_functorch_wrapped(torch.ones(2))
    assert not compat.forward_ad_active()
    with fwd.dual_level():
        assert compat.forward_ad_active()


def test_pickling_and_state_dict_helpers():
    import pickle

    p = nn.Parameter(torch.randn(3))
    fn = compat.rebuild_parameter()
    q = fn(p.detach(), True, __import__("collections").OrderedDict())
    assert isinstance(q, nn.Parameter) and torch.equal(q, p)
    assert torch.equal(pickle.loads(pickle.dumps(p)), p)
    m = nn.Linear(2, 2)
    compat.register_state_dict_hook(m, lambda mod, sd, prefix, meta: {k: v * 0 for k, v in sd.items()})
    assert all(not v.any() for v in m.state_dict().values())
    funcol = compat.functional_collectives()
    assert hasattr(funcol, "all_gather_tensor") and hasattr(funcol, "AsyncCollectiveTensor")


def test_functional_data_sees_the_traced_storage():
    """``functional_data`` of a FunctionalTensor under a proxy tracer (as AOTAutograd traces): the tracer, the tensor it
    holds and a storage identity shared by views; None in eager code. (The compiled trace memo built on it is tested
    by the compiled dedup tests of tests/test_saved_memory.py.)"""
    from torch._subclasses.functional_tensor import FunctionalTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    assert compat.functional_data(torch.ones(2)) is None
    seen = []

    def fn(x):
        with FunctionalTensorMode():
            from torch._subclasses.functional_tensor import FunctionalTensor

            fx = FunctionalTensor.to_functional(x)
            y = fx * 2
            seen.append((compat.functional_data(y), compat.functional_data(y.view(2, 2))))
        return x + 1

    make_fx(fn)(torch.ones(4))
    (a, b), = seen
    assert a is not None and b is not None and a[0] is not None and a[2] == b[2]


def test_raw_cuda_stream():
    if not torch.cuda.is_available():
        import pytest

        pytest.skip("needs CUDA")
    assert compat.raw_cuda_stream(0) == torch.cuda.current_stream(0).cuda_stream


def test_op_schema_and_parameter_marker_and_local_shards():
    """The compat wrappers of an op's schema, the Parameter marker of subclass tensors and LocalTensor's shards
    read what torch sets."""
    from fp8tensor import ScaledFp8Tensor

    schema = compat.op_schema(torch.ops.aten.add_.Tensor)
    assert schema.is_mutable and schema.arguments[0].alias_info.is_write
    assert not compat.op_schema(torch.ops.aten.add.Tensor).is_mutable
    t = ScaledFp8Tensor.from_hp(torch.randn(4, 8))
    assert not compat.is_parameter_marked(t)
    p = nn.Parameter(t, requires_grad=False)
    assert compat.is_parameter_marked(p)
    u = ScaledFp8Tensor.from_hp(torch.randn(4, 8))
    compat.mark_parameter(u)
    assert compat.is_parameter_marked(u)
    assert compat.local_tensor_shards(torch.randn(2)) == {}


def test_module_member_dicts_are_the_live_dicts():
    """parameters_dict / buffers_dict / children_dict are the module's own live dicts (None entries included)."""
    m = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    m.register_module("empty", None)
    m[0].register_parameter("extra", None)
    assert list(compat.parameters_dict(m[0])) == ["weight", "bias", "extra"]
    assert compat.parameters_dict(m[0])["weight"] is m[0].weight
    assert list(compat.buffers_dict(m[1])) == ["running_mean", "running_var", "num_batches_tracked"]
    assert list(compat.children_dict(m)) == ["0", "1", "empty"] and compat.children_dict(m)["empty"] is None
    new = nn.Linear(2, 3)
    m[0] = new
    assert compat.children_dict(m)["0"] is new


def test_one_buffer_is_identity_on_real_tensors_and_keeps_a_traced_tensor_strides():
    # compat.one_buffer: inductor's force-stride-order op on traced (fake) tensors, the tensor itself otherwise.
    import torch._inductor.inductor_prims  # noqa: F401  (registers prims.inductor_force_stride_order, as inductor does)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp8tensor.core import compat

    x = torch.randn(6, 4)[:, :3]  # a strided view: returned as it is, no copy
    assert compat.one_buffer(x) is x
    with FakeTensorMode():
        f = torch.empty(5, 8).t()
        y = compat.one_buffer(f)
    assert y.shape == f.shape and y.stride() == f.stride()


def test_view_base():
    base = torch.randn(4, 3)
    assert compat.view_base(base) is None
    assert compat.view_base(base.t()) is base and compat.view_base(base[:, :1].t()) is base
    assert compat.view_base(base.clone()) is None


def test_assert_async_raises_on_cpu_eagerly_and_in_a_compiled_graph():
    """compat.assert_async: a False check raises RuntimeError with the message (eager, and when a compiled graph that
    traced it runs); a True one passes."""
    import pytest

    compat.assert_async(torch.tensor(True), "never")
    with pytest.raises(RuntimeError, match="the check failed"):
        compat.assert_async(torch.tensor(False), "the check failed")
    torch._dynamo.reset()
    f = torch.compile(lambda x: (compat.assert_async((x >= 0).all(), "negative input"), x + 1)[1], fullgraph=True,
                      backend="aot_eager")
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))
    with pytest.raises(RuntimeError, match="negative input"):
        f(-torch.ones(3))
    torch._dynamo.reset()
