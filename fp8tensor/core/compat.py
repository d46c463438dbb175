"""Every use of a private PyTorch API by fp8tensor (torch 2.11 to 2.14), in one place, gated by the torch version
where it differs; ``tests/test_compat.py`` checks each of them against the installed torch."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
import torch.autograd.forward_ad as _forward_ad
from torch.utils import _pytree
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes  # (no mode active inside)

__all__ = ["TORCH_VERSION", "register_foreach_type", "local_tensor", "set_local_tensor", "dtensor_spec",
           "dispatch_modes_active", "function_modes_active", "functorch_active", "fsdp_states", "fsdp_param_groups",
           "fsdp_module_state", "fsdp_params_of", "fsdp_sharded_local", "fsdp_param_name", "fsdp_is_sharded",
           "fsdp_state_name", "fsdp_unsharded_param", "fsdp_flat_shard", "fsdp_set_flat_shard",
           "fsdp_reset_extension", "process_group_size", "process_group_rank", "wait_work", "tree_flatten",
           "tree_unflatten", "tree_leaves",
           "tree_map_only", "is_fake", "local_tensor_cls", "run_per_simulated_rank", "COMPOSITE_IMPLICIT",
           "DISABLED_TORCH_FUNCTION", "DATA_SETTER", "DATA_GETTER", "disable_torch_function_subclass", "parse_to",
           "is_exporting", "is_compiling", "prepend_forward_pre_hook", "disable_current_modes", "is_functorch_wrapped",
           "raw_cuda_stream", "rebuild_parameter", "functional_collectives", "register_state_dict_hook",
           "functional_data", "forward_ad_active", "op_schema", "is_parameter_marked", "mark_parameter",
           "local_tensor_shards", "disable_torch_function", "assert_tensor_metadata_op", "buffers_dict", "children_dict", "parameters_dict", "experts_implementation", "preserve_version_counter",
           "c10d_functional_ops", "view_base", "eager_unless_inlined", "assert_async"]

#: The dispatch key of composite ops (decomposed above autograd).
COMPOSITE_IMPLICIT = torch._C.DispatchKey.CompositeImplicitAutograd
#: ``__torch_function__`` of a subclass that opts out of torch-function handling (goes straight to dispatch).
DISABLED_TORCH_FUNCTION = torch._C._disabled_torch_function_impl
#: What ``__torch_function__`` receives as ``func`` for ``t.data = new``.
DATA_SETTER = torch._C.TensorBase.data.__set__
DATA_GETTER = torch._C.TensorBase.data.__get__


#: ``parse_to(*args, **kwargs)``: ``(device, dtype, non_blocking, memory_format)`` of ``Tensor.to``'s arguments.
parse_to = torch._C._nn._parse_to
#: ``is_functorch_wrapped(t)``: whether ``t`` is a ``torch.func`` (vmap / grad) wrapper (a plain tensor to Python).
is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
#: ``functorch_active()``: whether a ``torch.func`` transform (grad, vmap, ...) is active.
functorch_active = torch._C._are_functorch_transforms_active
#: Context manager: subclasses' ``__torch_function__`` is skipped inside (plain tensor behaviour).
disable_torch_function_subclass = torch._C.DisableTorchFunctionSubclass
disable_torch_function = torch._C.DisableTorchFunction  # (every __torch_function__ off, subclasses' and modes')
#: The metadata check an exported ``t.to(dtype)`` records (read-only: an op-table entry answers it from metadata).
assert_tensor_metadata_op = torch.ops.aten._assert_tensor_metadata.default
#: ``preserve_version_counter(t)``: context manager; writes into ``t`` leave its version counter as it was.
preserve_version_counter = torch.autograd._unsafe_preserve_version_counter


def is_exporting() -> bool:
    """Whether ``torch.export`` is tracing (strict or not), and only then (False under ``torch.compile``): reads the
    flag ``torch.export`` alone sets (the public ``is_exporting()`` is True in every dynamo trace on torch 2.11)."""
    return bool(torch.compiler._is_exporting_flag)


#: ``is_compiling()``: whether ``torch.compile`` or ``torch.export`` is tracing (False in eager fallbacks). torch's
#: function itself, not a wrapper: the eager fp8 Linear asks it about a dozen times per call.
is_compiling = torch.compiler.is_compiling


def eager_unless_inlined(fn):
    """Mark ``fn`` (a forward pre-hook) so that dynamo never compiles it as a frame of its own: inlined where traced
    code calls it (``torch.compile`` of the model or of a block), run eagerly with everything it calls where eager code
    calls it while ``torch.compile``'s frame hook is on (``nn.Module.__call__`` of a Linear left to run eagerly by a
    graph break, e.g. FSDP2's hooks in a whole-model compile), where it would otherwise be one more compiled frame.
    The flag is on ``fn``'s code object, read only when a frame starts (dynamo's tracer does not read it); it changes
    no result. Not for a module ``forward``: ``torch.compile(module)`` compiles the module's forward as the frame it
    starts, which the flag would leave eager. Returns ``fn``."""
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    set_code_exec_strategy(fn.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    return fn


#: Module-name segments of torch's module wrappers whose state-dict hooks drop them from the keys (activation
#: checkpointing's ``checkpoint_wrapper``, FSDP1's wrapper): a wrapped module's keys at the root lack them.
STATE_DICT_HIDDEN_SEGMENTS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def prepend_forward_pre_hook(module: torch.nn.Module, hook):
    """Register ``hook`` as the first forward pre-hook of ``module`` and return its ``RemovableHandle``. (Not
    ``prepend=True``: its ``move_to_end`` order fails torch 2.11's dynamo guards; the dict is re-filled in order.)"""
    handle = module.register_forward_pre_hook(hook)
    hooks = module._forward_pre_hooks
    items = list(hooks.items())
    items.insert(0, items.pop())  # the new hook (registered last) first
    hooks.clear()
    hooks.update(items)
    return handle


def raw_cuda_stream(device_index: int) -> int:
    """The handle of the current CUDA stream of a device, as kernel launchers take it."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def rebuild_parameter():
    """``torch._utils._rebuild_parameter``: what pickling an ``nn.Parameter`` calls on load (for ``__reduce_ex__``)."""
    return torch._utils._rebuild_parameter


def functional_collectives():
    """The functional collectives module (``torch.distributed._functional_collectives``)."""
    import torch.distributed._functional_collectives as funcol
    return funcol


def register_state_dict_hook(module: torch.nn.Module, hook) -> None:
    """Register ``hook(module, state_dict, prefix, local_metadata)``, which may return a new state dict
    (``nn.Module._register_state_dict_hook``; the public post-hook must edit in place)."""
    module._register_state_dict_hook(hook)


def functional_data(x: torch.Tensor):
    """``(proxy tracer, inner tensor with pending mutations synced, storage identity)`` of a ``FunctionalTensor``
    traced under a proxy mode; None for any other tensor and wherever torch's private tracing APIs differ."""
    from torch._subclasses.functional_tensor import FunctionalTensor
    if not isinstance(x, FunctionalTensor):
        return None
    try:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        tracer = getattr(get_proxy_mode(), "tracer", None)
        if tracer is None:
            return None
        torch._sync(x)
        inner = torch._from_functional_tensor(x.elem)
        return tracer, inner, inner.untyped_storage()._cdata
    except Exception:
        return None


def forward_ad_active() -> bool:
    """Whether a forward-mode AD level is open (``torch.autograd.forward_ad.dual_level``)."""
    return _forward_ad._current_level >= 0


def _version(v: str) -> tuple:
    parts = []
    for p in v.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


#: ``(major, minor)`` of the installed torch.
TORCH_VERSION = _version(torch.__version__)


def register_foreach_type(cls: type) -> None:
    """Let optimizers pick foreach / fused implementations for parameters of type ``cls`` (as DTensor does)."""
    from torch.optim import optimizer as _optimizer
    from torch.utils import _foreach_utils
    for types in (_optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if cls not in types:
            types.append(cls)


def _getter(attr: str, doc: str, *default):
    """A function reading the private attribute ``attr`` (or ``default``) of its argument (``doc``: its docstring)."""
    def get(obj):
        return getattr(obj, attr, *default)
    get.__doc__ = doc
    return get


def _setter(attr: str, doc: str):
    """A function writing the private attribute ``attr`` of its first argument (``doc``: its docstring)."""
    def set_(obj, value) -> None:
        setattr(obj, attr, value)
    set_.__doc__ = doc
    return set_


# Private attributes of DTensor, FSDP2's FSDPParamGroup / FSDPParam, nn.Module and OpOverload.
local_tensor = _getter("_local_tensor", "A DTensor's local tensor without ``to_local``'s autograd Function.")
set_local_tensor = _setter("_local_tensor", "Swap a DTensor's local tensor in place (same shape, dtype and device).")
dtensor_spec = _getter("_spec", "A DTensor's ``DTensorSpec`` (mesh, placements, global shape and stride).")
fsdp_params_of = _getter("fsdp_params", "The ``FSDPParam`` s of a parameter group.")
fsdp_sharded_local = _getter("_sharded_local_tensor", "The sharded local tensor of an ``FSDPParam``.")
fsdp_flat_shard = _getter("_sharded_param_data",
                          "The flat copy FSDP2 keeps of a shard (the default all-gather path's input).")
fsdp_unsharded_param = _getter("_unsharded_param", "FSDP2's unsharded parameter of an ``FSDPParam``, or None.", None)
fsdp_set_flat_shard = _setter("_sharded_param_data", "Replace the flat copy FSDP2 keeps of a shard.")
parameters_dict = _getter("_parameters", "``module``'s own live parameter dict (name -> Parameter or None).")
buffers_dict = _getter("_buffers", "``module``'s own live buffer dict (name -> tensor or None).")
children_dict = _getter("_modules", "``module``'s own live child-module dict (name -> Module or None).")
is_parameter_marked = _getter("_is_param", "Whether ``nn.Parameter(t)`` marked the tensor subclass ``t``.", False)
op_schema = _getter("_schema", "The ``torch._C.FunctionSchema`` of an ``OpOverload`` (no public accessor).")
# Hugging Face transformers (a config attribute its experts dispatcher reads):
experts_implementation = _getter("_experts_implementation",
                                 "A transformers config's experts implementation (``grouped_mm``, ...), or None.", None)


def dispatch_modes_active() -> bool:
    """Whether any ``TorchDispatchMode`` is active."""
    return torch._C._len_torch_dispatch_stack() > 0


def function_modes_active() -> bool:
    """Whether any ``TorchFunctionMode`` is active."""
    return torch._C._len_torch_function_stack() > 0


# ------------------------------------------------------------------------------------------------ FSDP2 internals
# ``torch/distributed/fsdp/_fully_shard/``: FSDPState (one per fully_shard-ed module), FSDPParamGroup, FSDPParam.

def fsdp_states() -> list:
    """The live FSDP2 states (one per module ``fully_shard`` was applied to); [] without torch.distributed."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # pragma: no cover - builds without distributed
        return []
    states = []
    for ref in list(_module_state_mapping.values()):
        state = ref()
        if isinstance(state, FSDPState) and all(state is not s for s in states):
            states.append(state)
    return states


def fsdp_module_state(module: torch.nn.Module):
    """The composable state attached to ``module`` (FSDP2's ``FSDPState`` after ``fully_shard``), or None."""
    from torch.distributed._composable_state import _get_module_state
    return _get_module_state(module)


def fsdp_param_groups(state) -> list:
    """The ``FSDPParamGroup`` s of an FSDP2 state (torch >= 2.12: a list; 2.11: one optional group)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return groups


def fsdp_param_name(fp) -> str:
    """A readable name of an ``FSDPParam``'s parameter (its FQN where FSDP2 recorded it)."""
    return getattr(fp, "_param_fqn", None) or fp._module_info.param_name


def fsdp_is_sharded(fp) -> bool:
    """Whether an ``FSDPParam`` is in its sharded state (not unsharded between forward and backward)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
    return fp.sharded_state == ShardedState.SHARDED


def fsdp_state_name(fp) -> str:
    """The name of an ``FSDPParam``'s sharded state (``SHARDED``, ``UNSHARDED``, ...)."""
    return fp.sharded_state.name


def fsdp_reset_extension(fp) -> None:
    """Make an ``FSDPParam`` re-read its local tensor's all-gather extension and drop what was sized and typed for the
    previous one (all-gather outputs, unsharded parameter, mixed-precision dtypes)."""
    fp._init_extensions()
    fp.all_gather_outputs = []
    if hasattr(fp, "_unsharded_param"):
        del fp._unsharded_param
    if hasattr(fp, "orig_dtype"):
        fp.init_dtype_attrs(fp.mp_policy)


# ------------------------------------------------------------------------------------------------ c10d
def process_group_size(group_name: str) -> int:
    """The size of the process group registered under ``group_name`` (the functional collectives' handle)."""
    from torch.distributed.distributed_c10d import _get_group_size_by_name
    return _get_group_size_by_name(group_name)


def process_group_rank(process_group) -> int:
    """This process's rank in ``process_group``, the ``ProcessGroup`` argument of a ``c10d.*_`` op (the dispatcher
    boxes it as a ScriptObject)."""
    from torch._C._distributed_c10d import ProcessGroup
    pg = process_group if isinstance(process_group, ProcessGroup) else ProcessGroup.unbox(process_group)
    return pg.rank()


def wait_work(work) -> None:
    """Block on a ``c10d`` Work returned by a ``c10d.*_`` op (the dispatcher boxes it as a ScriptObject)."""
    from torch._C._distributed_c10d import Work
    (Work.unbox(work) if not isinstance(work, Work) else work).wait()


# ------------------------------------------------------------------------------------------------ pytrees, fakes
#: Nested structures of lists, tuples and dicts (``torch.utils._pytree``, loaded by ``import torch``).
tree_flatten, tree_unflatten = _pytree.tree_flatten, _pytree.tree_unflatten
tree_leaves, tree_map_only = _pytree.tree_leaves, _pytree.tree_map_only


def view_base(t: torch.Tensor):
    """The tensor whose memory the view ``t`` shares (``Tensor._base``), or None when ``t`` is not a view."""
    return t._base


def is_fake(t) -> bool:
    """Whether ``t`` is a ``FakeTensor`` (shapes without data, as ``torch.compile`` traces)."""
    return isinstance(t, FakeTensor)


# ------------------------------------------------------------------------------------------------ LocalTensorMode
def local_tensor_cls():
    """``torch.distributed._local_tensor.LocalTensor`` (one tensor per simulated rank), or None where missing."""
    try:
        from torch.distributed._local_tensor import LocalTensor
    except Exception:  # pragma: no cover - builds without distributed
        return None
    return LocalTensor


def run_per_simulated_rank(fn):
    """``fn`` wrapped to run once per simulated rank on a ``LocalTensor`` (``maybe_run_for_local_tensor``)."""
    from torch.distributed._local_tensor import maybe_run_for_local_tensor
    return maybe_run_for_local_tensor(fn)


def c10d_functional_ops():
    """The ``torch.ops._c10d_functional`` namespace (the functional collectives DTensor issues)."""
    return torch.ops._c10d_functional


def mark_parameter(t: torch.Tensor) -> None:
    """Set the marker :func:`is_parameter_marked` reads (unpickling a subclass that was a parameter)."""
    t._is_param = True


def local_tensor_shards(t) -> dict:
    """The per-rank tensors of a ``LocalTensor`` (its ``_local_tensors`` dict, rank -> tensor); else ``{}``."""
    shards = getattr(t, "_local_tensors", None)
    return shards if isinstance(shards, dict) else {}


def assert_async(cond: torch.Tensor, msg: str) -> None:
    """``torch._assert_async(cond, msg)``: a check of a one-element bool tensor that a traced graph keeps and runs
    (on CPU it raises ``RuntimeError(msg)`` where ``cond`` is False, when the graph runs; use it only where a failed
    check may be synchronous: on CUDA it is a device assert)."""
    torch._assert_async(cond, msg)


def one_buffer(x: torch.Tensor) -> torch.Tensor:
    """Traced, ``x`` realized once at its strides (``prims.inductor_force_stride_order``, where inductor registered
    it), so that several kernels of a ``triton_op`` read one buffer instead of one fused copy each, and a layout an op
    needs (a row-major ``_grouped_mm`` operand) stays pinned. Not traced (:func:`is_traced`): ``x`` itself."""
    if not is_traced(x):
        return x
    op = getattr(torch.ops.prims, "inductor_force_stride_order", None)
    return x if op is None else op(x, x.stride())


def is_traced(x: torch.Tensor) -> bool:
    """Whether dynamo is tracing or ``x`` is a fake / functional tensor (AOTAutograd's trace, where
    ``torch.compiler.is_compiling()`` is False)."""
    from torch._subclasses.functional_tensor import FunctionalTensor

    return is_compiling() or isinstance(x, (FakeTensor, FunctionalTensor))
